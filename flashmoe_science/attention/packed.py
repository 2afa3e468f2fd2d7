"""Attention on a packed QKV projection: `flash_attention_qkvpacked`.

A transformer projects x to q, k and v with one matrix product and splits the result. Calling
`flash_attention_science` on the split views reads them in place, but autograd then has to put
the three gradients back into one: the backward of `unbind` stacks dq, dk and dv into a new
tensor, and that of slicing fills a zero tensor the size of the whole projection per slice and
adds them up, a few passes at memory speed over the projection's gradient in every training step.
Given the projection itself, the backward kernels write dq, dk and dv straight into their places
in one dQKV tensor, as flash-attn's `flash_attn_qkvpacked_func` does.
"""
from __future__ import annotations

import torch

from ..device import check_runnable
from .backward import attention_backward
from .checks import DTYPES, NO_WINDOW, check_flags, is_int
from .forward import attention_forward
from .interface import flash_attention_science, refuse_double_backward
from .layouts import dense_strides


def _heads(qkv, num_kv_heads) -> tuple[torch.Tensor, int, int]:
    """(qkv as (B, S, Hq + 2 * Hkv, D), Hq, Hkv), after checking the argument."""
    if not isinstance(qkv, torch.Tensor):
        raise TypeError(f"qkv must be a torch.Tensor, got {type(qkv).__name__}")
    if qkv.dtype not in DTYPES:
        raise TypeError(f"qkv has dtype {qkv.dtype}; supported: float16, bfloat16, float32")
    check_runnable("qkv", qkv)
    if num_kv_heads is not None and not (is_int(num_kv_heads) and num_kv_heads >= 1):
        raise ValueError(f"num_kv_heads must be a positive int or None, got {num_kv_heads!r}")
    if qkv.dim() == 5:
        if qkv.shape[2] != 3:
            raise ValueError(f"a 5-D qkv must be (batch, seqlen, 3, heads, head_dim), got shape {tuple(qkv.shape)}")
        heads = qkv.shape[3]
        if num_kv_heads not in (None, heads):
            raise ValueError(f"a 5-D qkv holds as many key/value heads as query heads ({heads}); pass a 4-D "
                             f"(batch, seqlen, heads_q + 2 * num_kv_heads, head_dim) qkv for {num_kv_heads}")
        return qkv.flatten(2, 3), heads, heads
    if qkv.dim() != 4:
        raise ValueError(f"qkv must be (batch, seqlen, 3, heads, head_dim) or (batch, seqlen, heads_q + 2 * "
                         f"num_kv_heads, head_dim), got shape {tuple(qkv.shape)}")
    total = qkv.shape[2]
    if num_kv_heads is None:
        if total % 3:
            raise ValueError(f"qkv holds {total} heads, not a multiple of 3: pass num_kv_heads for grouped-query "
                             f"attention")
        return qkv, total // 3, total // 3
    heads_q = total - 2 * num_kv_heads
    if heads_q < num_kv_heads or heads_q % num_kv_heads:
        raise ValueError(f"qkv holds {total} heads, which with num_kv_heads = {num_kv_heads} leaves {heads_q} query "
                         f"heads: that must be a positive multiple of num_kv_heads")
    return qkv, heads_q, num_kv_heads


def _split(qkv, heads_q, heads_kv):
    """q, k, v as (B, H, S, D) views of qkv (B, S, Hq + 2 * Hkv, D). (One split: indexing with
    slices costs some 15 us of host time per view.)"""
    q, k, v = qkv.split_with_sizes((heads_q, heads_kv, heads_kv), 2)
    return q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)


class _PackedFunction(torch.autograd.Function):
    """Eager autograd over the kernels, whose backward writes into views of one dQKV tensor."""

    @staticmethod
    def forward(ctx, qkv, heads_q, heads_kv, causal, softmax_scale, window_size, softcap):
        q, k, v = _split(qkv, heads_q, heads_kv)
        out, lse = attention_forward(q, k, v, causal, softmax_scale, True, None, window_size, softcap)
        ctx.save_for_backward(q, k, v, out, lse)
        # dQKV: qkv's own layout where it is dense (the projection's output), else dense in its order
        ctx.options = (qkv.shape, dense_strides(qkv.shape, qkv.stride()), heads_q, heads_kv, causal, softmax_scale,
                       window_size, softcap)
        ctx.set_materialize_grads(False)
        return out.transpose(1, 2), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        refuse_double_backward("flash_attention_qkvpacked")
        q, k, v, out, lse = ctx.saved_tensors
        shape, strides, heads_q, heads_kv, causal, softmax_scale, window_size, softcap = ctx.options
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.transpose(1, 2)
        dqkv = torch.empty_strided(shape, strides, dtype=q.dtype, device=q.device)
        attention_backward(grad_out, q, k, v, out, lse, causal, softmax_scale, window_size, softcap, grad_lse,
                           grads=_split(dqkv, heads_q, heads_kv))
        return dqkv, None, None, None, None, None, None


def flash_attention_qkvpacked(qkv, causal=False, softmax_scale=None, *, num_kv_heads=None, window_size=NO_WINDOW,
                              softcap=0.0, return_lse=False, deterministic=False):
    """Fused self-attention on a packed QKV projection, differentiable in qkv.

    Args:
        qkv: the projection's output, one of
            (B, S, 3, H, D): q, k and v of H heads each, as flash-attn's `flash_attn_qkvpacked_func`;
            (B, S, Hq + 2 * Hkv, D): Hq query heads, then Hkv key heads, then Hkv value heads
            (grouped-query attention, with `num_kv_heads` = Hkv; without it, Hq = Hkv), as
            `FlashMoEScienceAttention`'s projection lays them out.
            fp16, bf16 or fp32; read in place (a copy first only if D is not its unit-stride dimension).
        num_kv_heads: Hkv for a 4-D qkv; None for Hq = Hkv.
        causal, softmax_scale, window_size, softcap, deterministic: as for `flash_attention_science`.
        return_lse: also return lse (B, Hq, S) float32, natural log; differentiable.

    The same kernels as `flash_attention_science(q, k, v)` on (B, H, S, D) views of qkv, and the
    same results. The difference is the gradient: the backward writes dq, dk and dv into one
    tensor laid out like qkv, where gradients through views of it would cost autograd a
    concatenation of the three (or, for slices, a zero-filled tensor per slice, summed).
    Under torch.compile the call runs `flash_attention_science`'s custom ops on the views.

    Returns:
        out (B, S, Hq, D), contiguous (reshape it to (B, S, Hq * D) for the output projection
        without a copy), or (out, lse) when return_lse.
    """
    check_flags(deterministic, return_lse)
    qkv4, heads_q, heads_kv = _heads(qkv, num_kv_heads)
    if qkv4.stride(-1) != 1:
        qkv4 = qkv4.contiguous()
    if torch.compiler.is_compiling():
        out, lse = flash_attention_science(*_split(qkv4, heads_q, heads_kv), causal, softmax_scale,
                                           window_size=window_size, softcap=softcap, return_lse=True)
        out = out.transpose(1, 2)
    elif torch.is_grad_enabled() and qkv4.requires_grad:
        out, lse = _PackedFunction.apply(qkv4, heads_q, heads_kv, causal, softmax_scale, window_size, softcap)
    else:
        out, lse = attention_forward(*_split(qkv4, heads_q, heads_kv), causal, softmax_scale, return_lse, None,
                                     window_size, softcap)
        out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
