"""`flashmoe-science doctor`: what this machine is, which kernel and configuration each call
actually launched (read off the compiled kernel, not a table), whether the answer is right
against a float64 reference, and how fast it is next to PyTorch.

Exit status 0 when every correctness check passes.
"""
from __future__ import annotations

import platform

import torch

from .device import device_info, interpreter_active
from .launch import clear_records, last_launch


def _environment_lines() -> list[str]:
    import triton

    lines = [f"python {platform.python_version()}  torch {torch.__version__}  triton {triton.__version__}  "
             f"CUDA {torch.version.cuda}  cuDNN "
             f"{torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else 'none'}"]
    if torch.cuda.is_available():
        info = device_info()
        lines.append(f"GPU {info.name}: sm{info.capability}, {info.sm_count} SMs, "
                     f"{info.shared_memory_per_block // 1024} KB shared memory per block, "
                     f"{info.l2_bytes // 2**20} MB L2; configuration family sm{info.arch_family}")
    else:
        lines.append("no CUDA GPU: kernels run through Triton's CPU interpreter (TRITON_INTERPRET="
                     f"{'1' if interpreter_active() else 'unset'}) at small sizes; no GPU timings")
    return lines


def _describe(record) -> str:
    if record is None:
        return "no launch recorded"
    cfg = " ".join(f"{k}={v}" for k, v in record.constexprs.items())
    if record.interpreted:
        return f"{record.kernel} [interpreter] {cfg} grid={record.grid}"
    # Registers and spills as the loaded kernel reports them (a launch bound shows as the count).
    regs = getattr(record.compiled, "n_regs", None)
    spills = getattr(record.compiled, "n_spills", None)
    regs = "" if regs is None else f" regs={regs}" + (f" spills={spills}" if spills else "")
    return (f"{record.kernel} {cfg} warps={record.num_warps} stages={record.num_stages}{regs} "
            f"smem={record.shared_bytes}B grid={record.grid}")


def _matrix_instructions(record) -> str:
    """Which tensor-core instructions the launched kernel's machine code uses (sm90: HGMMA)."""
    if record is None or record.compiled is None:
        return ""
    try:
        sass = record.compiled.asm["sass"]
    except Exception as exc:  # cuobjdump missing or failing: say so rather than guess
        return f"SASS unavailable ({type(exc).__name__})"
    counts = {op: sass.count(op) for op in ("HGMMA", "HMMA") if op in sass}
    return "SASS: " + (", ".join(f"{n} {op}" for op, n in counts.items()) or "no tensor-core instructions")


def _print_launches(records, gpu: bool) -> None:
    """What each launch ran and, on Hopper, the tensor-core instructions of its machine code."""
    for record in records:
        print(f"    ran: {_describe(record)}")
        if gpu and record is not None and record.compiled is not None and device_info().capability >= 90:
            print(f"    {_matrix_instructions(record)}")


def _attention_cases(gpu: bool, quick: bool):
    if not gpu:
        return [(1, 2, 1, 33, 47, 64, torch.float16, True), (1, 2, 2, 20, 20, 40, torch.float32, False),
                (1, 8, 2, 1, 600, 64, torch.float16, True)]
    cases = [(4, 16, 16, 2048, 2048, 128, torch.bfloat16, True),
             (2, 16, 4, 777, 1500, 64, torch.float16, False),
             (4, 16, 16, 2048, 2048, 64, torch.bfloat16, True),
             (8, 32, 8, 1, 4096, 128, torch.bfloat16, True),
             (2, 8, 8, 2048, 2048, 256, torch.bfloat16, False)]
    return cases[:2] if quick else cases


def _check_attention(gpu: bool, quick: bool) -> bool:
    from .attention import attention_reference, flash_attention_science
    from .attention.reference import causal_mask
    from .bench.common import rel_error
    from .bench.timing import time_gpu

    device = "cuda" if gpu else "cpu"
    ok = True
    print("\nattention forward")
    for batch, hq, hkv, sq, sk, d, dtype, causal in _attention_cases(gpu, quick):
        q = torch.randn(batch, sq, hq, d, dtype=dtype, device=device).transpose(1, 2)
        k = torch.randn(batch, sk, hkv, d, dtype=dtype, device=device).transpose(1, 2)
        v = torch.randn(batch, sk, hkv, d, dtype=dtype, device=device).transpose(1, 2)
        clear_records()
        out = flash_attention_science(q, k, v, causal=causal)
        record = next(filter(None, map(last_launch, ("attention_decode_split", "attention_forward_gluon",
                                                     "attention_forward_hopper", "attention_forward"))), None)
        ref, _ = attention_reference(q, k, v, causal=causal)
        group = hq // hkv
        kr, vr = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
        mask = causal_mask(sq, sk, q.device) if causal else None
        torch_out = torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask)
        ours_err, torch_err = rel_error(out, ref), rel_error(torch_out, ref)
        passed = ours_err <= 2 * torch_err + 1e-4
        ok &= passed
        name = str(dtype).replace("torch.", "")
        print(f"  B={batch} Hq={hq} Hkv={hkv} Sq={sq} Sk={sk} D={d} {name} causal={causal}")
        _print_launches([record], gpu)
        print(f"    error vs float64: ours {ours_err:.2e}, PyTorch {name} {torch_err:.2e}  "
              f"{'ok' if passed else 'FAIL (more than 2x PyTorch)'}")
        if gpu:
            ours_t = time_gpu(lambda: flash_attention_science(q, k, v, causal=causal), repeats=3).median_ms
            sdpa_t = time_gpu(lambda: torch.nn.functional.scaled_dot_product_attention(q, kr, vr, attn_mask=mask),
                              repeats=3).median_ms
            print(f"    GPU time: ours {ours_t * 1e3:.1f} us, SDPA (same mask, repeated K/V) {sdpa_t * 1e3:.1f} us")
    return ok


def _check_attention_backward(gpu: bool, quick: bool) -> bool:
    """The backward of the first forward cases: which kernels ran (on sm90, the Gluon kernels or
    whether the Triton kernels' tiles moved through tensor descriptors, constexpr TMA), the worst of
    the dq, dk, dv errors against float64 next to PyTorch's own, and GPU time next to SDPA's
    backward."""
    from .attention import attention_reference, flash_attention_science
    from .attention.reference import causal_mask
    from .bench.common import rel_error
    from .bench.timing import time_gpu

    device = "cuda" if gpu else "cpu"
    ok = True
    print("\nattention backward")
    for batch, hq, hkv, sq, sk, d, dtype, causal in _attention_cases(gpu, quick)[:3]:
        q, k, v = (torch.randn(batch, s, h, d, dtype=dtype, device=device).transpose(1, 2).requires_grad_()
                   for s, h in ((sq, hq), (sk, hkv), (sk, hkv)))
        grad = torch.randn_like(q)
        clear_records()
        ours = torch.autograd.grad(flash_attention_science(q, k, v, causal=causal), (q, k, v), grad)
        records = [next(filter(None, map(last_launch, (f"attention_backward_{kernel}_gluon",
                                                       f"attention_backward_{kernel}"))), None)
                   for kernel in ("dkdv", "dq")]
        leaves = [t.detach().double().requires_grad_() for t in (q, k, v)]
        refs = torch.autograd.grad(attention_reference(*leaves, causal=causal)[0], leaves, grad.double())
        group = hq // hkv
        mask = causal_mask(sq, sk, q.device) if causal else None

        def sdpa():
            return torch.nn.functional.scaled_dot_product_attention(
                q, k.repeat_interleave(group, 1), v.repeat_interleave(group, 1), attn_mask=mask)

        theirs = torch.autograd.grad(sdpa(), (q, k, v), grad)
        ours_err = max(rel_error(g, r) for g, r in zip(ours, refs))
        torch_err = max(rel_error(g, r) for g, r in zip(theirs, refs))
        passed = ours_err <= 2 * torch_err + 5e-4
        ok &= passed
        name = str(dtype).replace("torch.", "")
        print(f"  B={batch} Hq={hq} Hkv={hkv} Sq={sq} Sk={sk} D={d} {name} causal={causal}")
        _print_launches(records, gpu)
        print(f"    error vs float64 (worst of dq, dk, dv): ours {ours_err:.2e}, PyTorch {name} {torch_err:.2e}  "
              f"{'ok' if passed else 'FAIL (more than 2x PyTorch)'}")
        if gpu:
            out, expected = flash_attention_science(q, k, v, causal=causal), sdpa()
            ours_t = time_gpu(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True),
                              repeats=3).median_ms
            sdpa_t = time_gpu(lambda: torch.autograd.grad(expected, (q, k, v), grad, retain_graph=True),
                              repeats=3).median_ms
            print(f"    GPU time of the backward: ours {ours_t * 1e3:.1f} us, SDPA (same mask, repeated K/V) "
                  f"{sdpa_t * 1e3:.1f} us")
    return ok


def _moe_cases(gpu: bool, quick: bool):
    """(name, E, top_k, H, I, T, dtype)."""
    if not gpu:
        return [("tiny", 8, 2, 64, 32, 5, torch.float32)]
    cases = [("Qwen3-30B-A3B decode", 128, 8, 2048, 768, 1, torch.bfloat16),
             ("Qwen3-30B-A3B prefill", 128, 8, 2048, 768, 2048, torch.bfloat16),
             ("Mixtral-8x7B", 8, 2, 4096, 14336, 64, torch.bfloat16)]
    return cases[:2] if quick else cases


def _check_moe(gpu: bool, quick: bool) -> bool:
    from .bench.common import rel_error
    from .bench.timing import time_gpu
    from .moe import fused_moe, moe_route
    from .moe.experts import describe
    from .moe.reference import fused_experts_torch, fused_moe_torch

    device = "cuda" if gpu else "cpu"
    ok = True
    print("\nfused MoE forward")
    for name, experts, top_k, hidden, inter, tokens, dtype in _moe_cases(gpu, quick):
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        w1 = (torch.randn(experts, 2 * inter, hidden, device=device) / hidden**0.5).to(dtype)
        w2 = (torch.randn(experts, hidden, inter, device=device) / inter**0.5).to(dtype)
        logits = torch.randn(tokens, experts, device=device, dtype=dtype)
        clear_records()
        out = fused_moe(x, w1, w2, logits, top_k)
        records = [last_launch(op) for op in ("moe_route", "moe_align", "moe_gate_up", "moe_down", "moe_down_gluon",
                                               "moe_combine")]
        weights, ids = moe_route(logits, top_k)
        ref = fused_experts_torch(x.double(), w1.double(), w2.double(), weights.double(), ids)
        torch_err = rel_error(fused_experts_torch(x, w1, w2, weights, ids), ref)
        ours_err = rel_error(out, ref)
        passed = ours_err <= 2 * torch_err + 1e-4
        ok &= passed
        label = str(dtype).replace("torch.", "")
        print(f"  {name}: E={experts} k={top_k} H={hidden} I={inter} T={tokens} {label}, "
              f"path {describe(x, w1, top_k)['path']}")
        for record in records:
            if record is not None:
                print(f"    ran: {_describe(record)}")
        print(f"    error vs float64: ours {ours_err:.2e}, PyTorch {label} {torch_err:.2e}  "
              f"{'ok' if passed else 'FAIL (more than 2x PyTorch)'}")
        if gpu:
            ours_t = time_gpu(lambda: fused_moe(x, w1, w2, logits, top_k), repeats=3).median_ms
            loop_t = time_gpu(lambda: fused_moe_torch(x, w1, w2, logits, top_k), repeats=3).median_ms
            print(f"    GPU time: ours {ours_t * 1e3:.1f} us, per-expert PyTorch loop {loop_t * 1e3:.1f} us")
    return ok


def run(quick: bool = False) -> int:
    print("FlashMoE-Science doctor")
    for line in _environment_lines():
        print("  " + line)
    gpu = torch.cuda.is_available()
    if not gpu and not interpreter_active():
        print("no GPU and no interpreter: set TRITON_INTERPRET=1 (the flashmoe-science command does this)")
        return 1
    ok = _check_attention(gpu, quick)
    ok &= _check_attention_backward(gpu, quick)
    ok &= _check_moe(gpu, quick)
    print("\nall checks passed" if ok else "\nSOME CHECKS FAILED")
    return 0 if ok else 1
