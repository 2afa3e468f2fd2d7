"""Every kernel path at small shapes, for NVIDIA's compute-sanitizer (memcheck, racecheck,
synccheck, initcheck): `benchmarks/gpu_run.sh sanitize` runs this file under each tool and
records what it reports.

Each call below reaches a different kernel or build: the attention forward's generic, TMA and
Gluon kernels, the backward's Triton (pointer and TMA builds) and Gluon kernels, softcap,
windows, GQA, fp32 and fp16, packed variable-length batches with empty sequences, the packed
QKV projection; the MoE routing, dispatch (one-launch decode and chunked prefill layouts),
grouped GEMMs, combine and backward kernels. Shapes are the smallest that still select each
path (the Hopper kernels start at `attention.configs.HOPPER_MIN_FLOPS`). Run with
PYTORCH_NO_CUDA_MEMORY_CACHING=1 so that every tensor has an allocation of its own and an
access past its end is one memcheck sees.

`--consan` runs the Hopper attention forwards (with `--backward`, their backwards too) under
Triton's own concurrency sanitizer instead (TRITON_INSTRUMENTATION_MODE=consan: every
shared-memory access, TMA copy, wgmma and mbarrier of the Gluon and TMA kernels checked for a
missing wait, a device assert on any), meant to understand the asynchronous copies and barriers
that compute-sanitizer's racecheck and initcheck do not.
"""
import math
import sys

import torch

from flashmoe_science import (flash_attention_qkvpacked, flash_attention_science, flash_attention_varlen,
                              fused_experts, fused_moe)
from flashmoe_science.attention.configs import HOPPER_MIN_FLOPS
from flashmoe_science.launch import clear_records, last_launch

_ATTENTION_OPS = ("attention_forward", "attention_forward_hopper", "attention_forward_gluon", "attention_backward_dq",
                  "attention_backward_dkdv", "attention_backward_dq_gluon", "attention_backward_dkdv_gluon",
                  "attention_varlen_lengths_check")
_MOE_OPS = ("moe_route", "moe_count", "moe_align", "moe_gate_up", "moe_down", "moe_combine", "moe_grad_gate_up",
            "moe_grad_x", "moe_grad_w1", "moe_grad_w2")


def hopper_length(B, H, D) -> int:
    """The shortest multiple of 128 tokens whose causal call reaches the Hopper kernels."""
    S = math.ceil(math.sqrt(2 * HOPPER_MIN_FLOPS / (4 * B * H * D)))
    return -(-S // 128) * 128


def attention(B, Hq, Hkv, S, D, dtype, *, causal=False, window=(-1, -1), softcap=0.0, Sk=None, backward=True):
    clear_records()
    q = torch.randn(B, Hq, S, D, device="cuda", dtype=dtype, requires_grad=True)
    k = torch.randn(B, Hkv, Sk or S, D, device="cuda", dtype=dtype, requires_grad=True)
    v = torch.randn(B, Hkv, Sk or S, D, device="cuda", dtype=dtype, requires_grad=True)
    out = flash_attention_science(q, k, v, causal=causal, window_size=window, softcap=softcap)
    if backward:
        out.backward(torch.randn_like(out))
    return [last_launch(op).kernel for op in _ATTENTION_OPS if last_launch(op) is not None]


def hopper_attention(backward: bool = True) -> list[str]:
    ran = []
    for D in (64, 128, 256):  # the Hopper forward and backward (TMA and Gluon) kernels
        S = hopper_length(2, 8, D)
        ran += attention(2, 8, 2, S, D, torch.bfloat16, causal=True, backward=backward)
        ran += attention(2, 8, 8, S, D, torch.bfloat16, backward=backward)
    ran += attention(2, 8, 8, hopper_length(2, 8, 128), 128, torch.bfloat16, softcap=30.0,  # the Triton TMA forward
                     backward=backward)
    return ran


def consan():
    from contextvars import ContextVar

    from triton import knobs
    from triton.runtime import _allocation

    def scratch(size: int, alignment: int, stream):
        return torch.empty(size, device="cuda", dtype=torch.int8)

    # The sanitizer's state lives in scratch memory from triton's allocator, a context variable that
    # triton.set_allocator sets for this thread alone: the backward runs on autograd's threads.
    _allocation._allocator = ContextVar("_allocator", default=scratch)
    _allocation.set_profile_allocator(scratch)
    knobs.compilation.instrumentation_mode = "consan"
    torch.manual_seed(0)
    ran = hopper_attention(backward="--backward" in sys.argv)
    torch.cuda.synchronize()
    print("kernels run under consan:", ", ".join(sorted(set(ran))))


def main():
    torch.manual_seed(0)
    ran = []
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        ran += attention(1, 4, 2, 96, 64, dtype, causal=True)
        ran += attention(1, 2, 1, 80, 40, dtype, window=(17, 3), softcap=20.0)
    ran += attention(1, 2, 2, 40, 128, torch.bfloat16, Sk=24, causal=True)  # rows that see no key
    ran += hopper_attention()
    lengths = [5, 0, 33, 1, 17]
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(sum(lengths), 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(sum(lengths), 2, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn_like(k, requires_grad=True)
    out = flash_attention_varlen(q, k, v, cu, cu, 33, 33, causal=True)
    out.backward(torch.randn_like(out))
    qkv = torch.randn(2, 64, 3, 4, 64, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    flash_attention_qkvpacked(qkv, causal=True).sum().backward()

    E, H, I = 8, 256, 128
    w1 = (torch.randn(E, 2 * I, H, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda", dtype=torch.bfloat16) * 0.05).requires_grad_()
    for T in (1, 8, 300, 2048):  # decode and prefill layouts
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        logits = torch.randn(T, E, device="cuda", requires_grad=True)
        with torch.no_grad():
            fused_moe(x, w1, w2, logits, 2)
        fused_moe(x, w1, w2, logits, 2).float().square().sum().backward()
    ids = torch.randint(-2, E + 2, (64, 2), device="cuda")  # dropped slots of both signs
    fused_experts(torch.randn(64, H, device="cuda", dtype=torch.bfloat16), w1.detach(), w2.detach(),
                  torch.rand(64, 2, device="cuda"), ids)
    torch.cuda.synchronize()
    ran += [last_launch(op).kernel for op in _MOE_OPS if last_launch(op) is not None]
    print("kernels run:", ", ".join(sorted(set(ran))))


if __name__ == "__main__":
    consan() if "--consan" in sys.argv else main()
