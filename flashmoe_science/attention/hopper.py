"""The Hopper (sm90) forward path: TMA tensor descriptors, optionally a warp-specialised loop.

Dense inputs only (no variable lengths). Every stride but the last must be a multiple of 16
bytes and every base pointer 16-byte aligned, as the tensor memory accelerator requires;
`supports(q, k, v)` says whether a call qualifies.
"""
from __future__ import annotations

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

from ..launch import KernelLauncher
from ._kernels.forward_hopper import attention_forward_hopper_kernel
from .configs import head_dim_block

_LOG2E = 1.4426950408889634
_HOPPER = KernelLauncher("attention_forward_hopper", attention_forward_hopper_kernel)


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the tensor memory accelerator can address these (B, H, S, D) tensors."""
    for t in tensors:
        if not t.is_cuda or t.stride(-1) != 1 or t.data_ptr() % 16 or t.numel() == 0:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return torch.cuda.get_device_capability(tensors[0].device)[0] == 9


def attention_forward_hopper(q, k, v, causal: bool, softmax_scale: float, config, *, warp_specialize: bool,
                             write_lse: bool = False):
    """Forward through the Hopper kernel with an explicit AttentionConfig; returns (out, lse).

    q: (B, Hq, Sq, D), k and v: (B, Hkv, Sk, D), fp16 or bf16, on an sm90 GPU, `supports` true.
    """
    batch, heads_q, seqlen_q, head_dim = q.shape
    block_d = head_dim_block(head_dim)
    out = torch.empty_like(q)
    lse = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device) if write_lse else None
    bm, bn = config.block_m, config.block_n

    def describe(t, rows):
        return TensorDescriptor(t, list(t.shape), list(t.stride()), [1, 1, rows, block_d])

    num_m_blocks = -(-seqlen_q // bm)
    _HOPPER.launch(
        None, (num_m_blocks * batch * heads_q, 1, 1),
        (describe(q, bm), describe(k, bn), describe(v, bn), describe(out, bm), lse if write_lse else out,
         softmax_scale * _LOG2E, 0.0, 0.0, heads_q * seqlen_q, seqlen_q,
         heads_q, heads_q // k.shape[1], seqlen_q, k.shape[2], num_m_blocks, -1, 0 if causal else -1,
         block_d, bm, bn, causal, False, write_lse, warp_specialize),
        num_warps=config.num_warps, num_stages=config.num_stages, device_index=q.device.index)
    return out, lse
