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
from ..launch import PlanCache
from .backward import backward_plan, launch_backward
from .checks import DTYPES, NO_WINDOW, check_band, check_flags, check_options, is_int
from .forward import forward_plan, launch_forward
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


class _PackedCall:
    """What a packed call's checked arguments decide: the heads, the window as `check_band` returns
    it, dQKV's strides, and the plans and launch keys of the forward (per write_lse) and of the
    backward (per layout of the output's gradient). Kept under the call's facts (`_call_key`) by
    `_packed_call`, so a training loop's later calls skip the checks and the plans' own keys."""

    __slots__ = ("heads_q", "heads_kv", "causal", "window_size", "softcap", "grad_strides", "cached", "forwards",
                 "backwards")

    def __init__(self, qkv4, heads_q, heads_kv, causal, window_size, softcap, cached):
        self.heads_q, self.heads_kv = heads_q, heads_kv
        self.causal, self.window_size, self.softcap = causal, window_size, softcap
        # dQKV: qkv's own layout where it is dense (the projection's output), else dense in its order
        self.grad_strides = dense_strides(qkv4.shape, qkv4.stride())
        self.cached = cached  # under `_call_key`: then the views' facts, and so their plans, are fixed
        self.forwards, self.backwards = {}, {}

    def forward(self, q, k, v, write_lse):
        plan = self.forwards.get(write_lse)
        if plan is None:
            plan = forward_plan(q, k, v, self.causal, self.window_size, self.softcap, write_lse)
            if self.cached and plan[1] is not None:
                self.forwards[write_lse] = plan
        return plan

    def backward(self, grad_out, q, k, v, out, lse, grads):
        facts = (grad_out.stride(), grad_out.dtype, grad_out.data_ptr() % 16)  # its shape is out's
        plan = self.backwards.get(facts)
        if plan is None:
            plan = backward_plan(grad_out, q, k, v, out, lse, self.causal, self.window_size, self.softcap,
                                 grads=grads)
            if self.cached and plan[1] is not None:
                self.backwards[facts] = plan
        return plan


CALLS = PlanCache()


def _call_key(qkv, num_kv_heads, causal, softmax_scale, window_size, softcap, return_lse, deterministic):
    """The facts that fix a packed call's checks and plans: qkv's shape, strides, dtype, device and
    alignment, and each option with its type (the checks tell 1 from True and (1.0, 2) from
    (1, 2), which compare equal); None where the arguments cannot key a call (checked in full)."""
    if type(qkv) is not torch.Tensor or type(window_size) is not tuple or len(window_size) != 2:
        return None
    left, right = window_size
    return (qkv.shape, qkv.stride(), qkv.dtype, qkv.device, qkv.data_ptr() % 16, type(num_kv_heads), num_kv_heads,
            type(causal), causal, type(softmax_scale), softmax_scale, type(left), left, type(right), right,
            type(softcap), softcap, type(return_lse), return_lse, type(deterministic), deterministic)


def _checked_heads(qkv, num_kv_heads, deterministic, return_lse):
    """The flags checked and `_heads`, with qkv as (B, S, Hq + 2 * Hkv, D) given unit stride in D:
    (qkv4, Hq, Hkv, whether that took a copy)."""
    check_flags(deterministic, return_lse)
    qkv4, heads_q, heads_kv = _heads(qkv, num_kv_heads)
    copied = qkv4.stride(-1) != 1
    return (qkv4.contiguous() if copied else qkv4), heads_q, heads_kv, copied


def _packed_call(qkv, num_kv_heads, causal, softmax_scale, window_size, softcap, return_lse, deterministic):
    """(qkv as (B, S, Hq + 2 * Hkv, D) with unit stride in D, its `_PackedCall`): checked in full
    unless a call with the same facts was (`_call_key`)."""
    key = _call_key(qkv, num_kv_heads, causal, softmax_scale, window_size, softcap, return_lse, deterministic)
    call = CALLS.get(key) if key is not None else None
    if call is not None:
        return (qkv.flatten(2, 3) if qkv.dim() == 5 else qkv), call
    qkv4, heads_q, heads_kv, copied = _checked_heads(qkv, num_kv_heads, deterministic, return_lse)
    check_options(causal, softmax_scale)
    window_size = check_band(window_size, softcap)
    cached = key is not None and not copied  # a copy is new memory each call: never a key's facts
    call = _PackedCall(qkv4, heads_q, heads_kv, causal, window_size, softcap, cached)
    if cached:
        CALLS.remember(key, call)
    return qkv4, call


class _PackedFunction(torch.autograd.Function):
    """Eager autograd over the kernels, whose backward writes into views of one dQKV tensor."""

    @staticmethod
    def forward(ctx, qkv, call, softmax_scale):
        q, k, v = _split(qkv, call.heads_q, call.heads_kv)
        plan, key = call.forward(q, k, v, True)
        out, lse = launch_forward(plan, key, q, k, v, None, None, softmax_scale, True)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.options = (qkv.shape, call, softmax_scale)
        ctx.set_materialize_grads(False)
        return out.transpose(1, 2), lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        refuse_double_backward("flash_attention_qkvpacked")
        q, k, v, out, lse = ctx.saved_tensors
        shape, call, softmax_scale = ctx.options
        grad_out = torch.zeros_like(out) if grad_out is None else grad_out.transpose(1, 2)
        dqkv = torch.empty_strided(shape, call.grad_strides, dtype=q.dtype, device=q.device)
        grads = _split(dqkv, call.heads_q, call.heads_kv)
        plan, key = call.backward(grad_out, q, k, v, out, lse, grads)
        launch_backward(plan, key, grad_out, q, k, v, out, lse, None, None, softmax_scale, grad_lse, None, grads)
        return dqkv, None, None


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
    if torch.compiler.is_compiling():
        qkv4, heads_q, heads_kv, _ = _checked_heads(qkv, num_kv_heads, deterministic, return_lse)
        out, lse = flash_attention_science(*_split(qkv4, heads_q, heads_kv), causal, softmax_scale,
                                           window_size=window_size, softcap=softcap, return_lse=True)
        out = out.transpose(1, 2)
    else:
        qkv4, call = _packed_call(qkv, num_kv_heads, causal, softmax_scale, window_size, softcap, return_lse,
                                  deterministic)
        if torch.is_grad_enabled() and qkv4.requires_grad:
            out, lse = _PackedFunction.apply(qkv4, call, softmax_scale)
        else:
            q, k, v = _split(qkv4, call.heads_q, call.heads_kv)
            plan, key = call.forward(q, k, v, return_lse)
            out, lse = launch_forward(plan, key, q, k, v, None, None, softmax_scale, return_lse)
            out = out.transpose(1, 2)
    return (out, lse) if return_lse else out
