"""Public attention functions: argument checks, output allocation, dispatch and launch.

The kernels live in `_kernels/`; this module is the contract. A call with the same shapes,
strides, dtypes and devices as an earlier one skips every check and configuration decision
(a dictionary lookup on a key of those facts) and launches the cached compiled kernel
directly, because on small inputs host time decides the speed users feel.

Calls that need gradients run under a torch.autograd.Function; calls traced by torch.compile
go through the torch.library custom ops of `ops.py`, which carry fake implementations and the
same backward.
"""
from __future__ import annotations

import math

import torch

from ..device import check_runnable, info_for
from ..launch import KernelLauncher
from ._kernels.backward import (attention_backward_dkdv_kernel, attention_backward_dq_kernel,
                                attention_backward_preprocess_kernel)
from ._kernels.forward import attention_forward_kernel
from .configs import PREPROCESS_WARPS, backward_config, forward_config, head_dim_block, preprocess_block_m

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634

_FORWARD = KernelLauncher("attention_forward", attention_forward_kernel)
_BACKWARD_PREPROCESS = KernelLauncher("attention_backward_preprocess", attention_backward_preprocess_kernel)
_BACKWARD_DKDV = KernelLauncher("attention_backward_dkdv", attention_backward_dkdv_kernel)
_BACKWARD_DQ = KernelLauncher("attention_backward_dq", attention_backward_dq_kernel)
_MAX_PLANS = 4096


class _ForwardPlan:
    """Everything about a forward call that depends only on its shapes, strides and dtypes."""

    __slots__ = ("empty", "contiguous", "config", "head_dim", "block_d", "group", "grid", "num_m_blocks",
                 "default_scale", "lse_shape", "device_index", "launch_tail")

    def __init__(self, q, k, v, config=None):
        _check_inputs(q, k, v)
        batch, heads_q, seqlen_q, head_dim = q.shape
        heads_kv = k.shape[1]
        self.contiguous = q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
        self.empty = q.numel() == 0
        self.head_dim = head_dim
        self.block_d = head_dim_block(head_dim)
        self.group = heads_q // heads_kv
        self.default_scale = 1.0 / math.sqrt(head_dim)
        self.lse_shape = (batch, heads_q, seqlen_q)
        self.device_index = q.device.index if q.device.type == "cuda" else None
        self.config = config or forward_config(info_for(q), q.element_size(), head_dim, seqlen_q, batch * heads_q)
        self.num_m_blocks = -(-seqlen_q // self.config.block_m)
        self.grid = (self.num_m_blocks * batch * heads_q, 1, 1)
        self.launch_tail = None  # the kernel arguments after the pointers and scales, set at first launch


_PLANS: dict = {}


def _plan_key(q, k, v, causal, write_lse):
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, causal, write_lse,
            q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)


def _check_inputs(q, k, v) -> None:
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, seqlen, head_dim), "
                             f"got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_runnable("q", q)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[3] != k.shape[3]:
        raise ValueError(f"q, k and v must have the same head_dim, got q {q.shape[3]} and k/v {k.shape[3]}")
    head_dim = q.shape[3]
    if not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim (last dimension of q, k, v) must be between 16 and 256, got {head_dim}")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"the number of query heads ({heads_q}) must be a multiple of the number of "
                         f"key/value heads ({heads_kv})")


def _check_options(causal, softmax_scale) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float)):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not math.isfinite(softmax_scale):
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")


def _output_like(q: torch.Tensor) -> torch.Tensor:
    """The output takes q's memory layout (so a (B, S, H, D).transpose(1, 2) view stays one)."""
    if q.stride(-1) != 1:
        return torch.empty(q.shape, dtype=q.dtype, device=q.device)
    return torch.empty_like(q)


def attention_forward(q, k, v, causal: bool, softmax_scale: float | None, write_lse: bool, config=None):
    """Runs the forward kernel: returns (out, lse) with lse None unless `write_lse`.

    `config` forces an AttentionConfig (for tuning sweeps); such calls take Triton's ordinary,
    uncached launch path.
    """
    try:
        key = None if config is not None else _plan_key(q, k, v, causal, write_lse)
    except AttributeError:  # not tensors: let the checks say which argument is wrong
        _check_inputs(q, k, v)
        raise
    plan = _PLANS.get(key) if config is None else _ForwardPlan(q, k, v, config)
    if plan is None:
        _check_options(causal, softmax_scale)
        plan = _ForwardPlan(q, k, v)
        if len(_PLANS) >= _MAX_PLANS:
            _PLANS.clear()
        _PLANS[key] = plan
    elif softmax_scale is not None:
        _check_options(causal, softmax_scale)
    if plan.contiguous:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = _output_like(q)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device) if write_lse else None
    if plan.empty:
        return out, lse
    scale = plan.default_scale if softmax_scale is None else float(softmax_scale)
    cfg = plan.config
    tail = plan.launch_tail
    if tail is None:
        # Strides, sizes and constexprs follow from the plan's key, so they are gathered once.
        _, heads_q, seqlen_q, _ = q.shape
        sq, sk, sv, so = q.stride(), k.stride(), v.stride(), out.stride()
        tail = plan.launch_tail = (
            sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], so[0], so[1], so[2],
            heads_q * seqlen_q, seqlen_q,
            heads_q, plan.group, seqlen_q, k.shape[2], plan.num_m_blocks, -1, 0 if causal else -1,
            plan.head_dim, plan.block_d, cfg.block_m, cfg.block_n, causal, False, False, write_lse)
    _FORWARD.launch(key, plan.grid, (q, k, v, out, lse if write_lse else out, None, None, scale * _LOG2E, 0.0, 0.0)
                    + tail, num_warps=cfg.num_warps, num_stages=cfg.num_stages, device_index=plan.device_index)
    return out, lse


class _BackwardPlan:
    """Everything about a backward call that depends only on its shapes, strides and dtypes."""

    __slots__ = ("empty", "copy_last_dim", "config", "head_dim", "block_d", "group", "default_scale", "diagonal",
                 "preprocess_block_m", "num_preprocess_blocks", "num_n_blocks", "num_m_blocks",
                 "preprocess_grid", "dkdv_grid", "dq_grid", "device_index")

    def __init__(self, grad_output, q, k, v, out, lse, causal, config=None):
        _check_backward_inputs(grad_output, q, k, v, out, lse)
        batch, heads_q, seqlen_q, head_dim = q.shape
        heads_kv, seqlen_k = k.shape[1], k.shape[2]
        self.copy_last_dim = any(t.stride(-1) != 1 for t in (grad_output, q, k, v, out))
        self.empty = q.numel() == 0 or k.numel() == 0
        self.head_dim = head_dim
        self.block_d = head_dim_block(head_dim)
        self.group = heads_q // heads_kv
        self.default_scale = 1.0 / math.sqrt(head_dim)
        # Query i sees key j when j <= i + diagonal; Sk admits every key, so non-causal calls
        # run the same kernels with nothing masked but the tails.
        self.diagonal = seqlen_k - seqlen_q if causal else seqlen_k
        self.device_index = q.device.index if q.device.type == "cuda" else None
        cfg = self.config = config or backward_config(info_for(q), q.element_size(), head_dim)
        self.preprocess_block_m = preprocess_block_m(self.block_d)
        self.num_preprocess_blocks = -(-seqlen_q // self.preprocess_block_m)
        self.num_n_blocks = -(-seqlen_k // cfg.dkdv.block_n)
        self.num_m_blocks = -(-seqlen_q // cfg.dq.block_m)
        self.preprocess_grid = (self.num_preprocess_blocks * batch * heads_q, 1, 1)
        self.dkdv_grid = (self.num_n_blocks * batch * heads_kv, 1, 1)
        self.dq_grid = (self.num_m_blocks * batch * heads_q, 1, 1)


_BACKWARD_PLANS: dict = {}


def _backward_key(grad_output, q, k, v, out, lse, causal):
    tensors = (grad_output, q, k, v, out, lse)
    return (tuple(t.shape for t in tensors), tuple(t.stride() for t in tensors), tuple(t.dtype for t in tensors),
            tuple(t.device for t in tensors), tuple(t.data_ptr() % 16 for t in tensors), causal)


def _check_backward_inputs(grad_output, q, k, v, out, lse) -> None:
    _check_inputs(q, k, v)
    for name, t in (("grad_output", grad_output), ("output", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"softmax_lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.shape != q.shape[:3]:
        raise ValueError(f"softmax_lse must have shape (batch, heads_q, seqlen_q) = {tuple(q.shape[:3])}, "
                         f"got {tuple(lse.shape)}")
    if lse.dtype != torch.float32:
        raise TypeError(f"softmax_lse must be float32 (as flash_attention_forward returns it), got {lse.dtype}")
    if lse.device != q.device:
        raise ValueError(f"softmax_lse must be on the device of q ({q.device}), got {lse.device}")


def _check_deterministic(deterministic) -> None:
    if not isinstance(deterministic, bool):
        raise TypeError(f"deterministic must be a bool, got {type(deterministic).__name__}")


def attention_backward(grad_output, q, k, v, out, lse, causal: bool, softmax_scale: float | None,
                       grad_lse=None, config=None):
    """Runs the backward kernels: returns (dq, dk, dv) with the layouts of q, k and v.

    `grad_lse`, the gradient of lse when a caller differentiated it too, enters through delta:
    d lse_i / d s_ij = p_ij, so it adds p * grad_lse to dS. `config` forces a BackwardConfig
    (for tuning sweeps); such calls take Triton's ordinary, uncached launch path.
    """
    try:
        key = None if config is not None else _backward_key(grad_output, q, k, v, out, lse, causal)
    except AttributeError:  # not tensors: let the checks say which argument is wrong
        _check_backward_inputs(grad_output, q, k, v, out, lse)
        raise
    plan = _BACKWARD_PLANS.get(key) if config is None else None
    if plan is None:
        _check_options(causal, softmax_scale)
        plan = _BackwardPlan(grad_output, q, k, v, out, lse, causal, config)
        if config is None:
            if len(_BACKWARD_PLANS) >= _MAX_PLANS:
                _BACKWARD_PLANS.clear()
            _BACKWARD_PLANS[key] = plan
    elif softmax_scale is not None:
        _check_options(causal, softmax_scale)
    if plan.copy_last_dim:
        grad_output, q, k, v, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (grad_output, q, k, v, out))
    dq, dk, dv = _output_like(q), _output_like(k), _output_like(v)
    if plan.empty:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    batch, heads_q, seqlen_q, _ = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    delta = torch.empty((batch, heads_q, seqlen_q), dtype=torch.float32, device=q.device)
    so, sdo = out.stride(), grad_output.stride()
    _BACKWARD_PREPROCESS.launch(
        key, plan.preprocess_grid,
        (out, grad_output, delta, so[0], so[1], so[2], sdo[0], sdo[1], sdo[2], heads_q, seqlen_q,
         plan.num_preprocess_blocks, plan.head_dim, plan.block_d, plan.preprocess_block_m),
        num_warps=PREPROCESS_WARPS, num_stages=1, device_index=plan.device_index)
    if grad_lse is not None:
        delta.sub_(grad_lse)
    scale = plan.default_scale if softmax_scale is None else float(softmax_scale)
    cfg = plan.config
    sq, sk, sv, sdq, sdk, sdv = q.stride(), k.stride(), v.stride(), dq.stride(), dk.stride(), dv.stride()
    _BACKWARD_DKDV.launch(
        key, plan.dkdv_grid,
        (q, k, v, grad_output, lse, delta, dk, dv, scale, scale * _LOG2E,
         sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sdo[0], sdo[1], sdo[2],
         sdk[0], sdk[1], sdk[2], sdv[0], sdv[1], sdv[2],
         heads_kv, plan.group, seqlen_q, seqlen_k, plan.diagonal, plan.num_n_blocks,
         plan.head_dim, plan.block_d, cfg.dkdv.block_m, cfg.dkdv.block_n),
        num_warps=cfg.dkdv.num_warps, num_stages=cfg.dkdv.num_stages, device_index=plan.device_index)
    _BACKWARD_DQ.launch(
        key, plan.dq_grid,
        (q, k, v, grad_output, lse, delta, dq, scale, scale * _LOG2E,
         sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], sdo[0], sdo[1], sdo[2],
         sdq[0], sdq[1], sdq[2],
         heads_q, plan.group, seqlen_q, seqlen_k, plan.diagonal, plan.num_m_blocks,
         plan.head_dim, plan.block_d, cfg.dq.block_m, cfg.dq.block_n),
        num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages, device_index=plan.device_index)
    return dq, dk, dv


def save_for_backward(ctx, q, k, v, out, lse, causal, softmax_scale) -> None:
    """What the backward needs, saved on an autograd context (shared with the custom ops)."""
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.causal = causal
    ctx.softmax_scale = softmax_scale
    # An output the loss does not use gets None instead of a tensor of zeros.
    ctx.set_materialize_grads(False)


def gradients_from_context(ctx, grad_out, grad_lse, backward):
    """(dq, dk, dv) from a context `save_for_backward` filled; `backward` runs the kernels."""
    q, k, v, out, lse = ctx.saved_tensors
    if grad_out is None:  # only lse was used
        grad_out = torch.zeros_like(out)
    return backward(grad_out, q, k, v, out, lse, ctx.causal, ctx.softmax_scale, grad_lse)


class _AttentionFunction(torch.autograd.Function):
    """Eager autograd over the kernels. It skips the custom ops' dispatcher round trips (which
    about double the host time of a small training call); torch.compile uses the ops instead."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale):
        out, lse = attention_forward(q, k, v, causal, softmax_scale, True)
        save_for_backward(ctx, q, k, v, out, lse, causal, softmax_scale)
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        if torch.is_grad_enabled():  # create_graph=True: the kernels' gradients have no graph of their own
            raise RuntimeError("flash_attention_science has no second derivative; "
                               "backward with create_graph=True is not supported")
        return (*gradients_from_context(ctx, grad_out, grad_lse, attention_backward), None, None)


def flash_attention_forward(q, k, v, causal=False, softmax_scale=None):
    """Fused attention forward; returns (out, lse). See `flash_attention_science` for the contract.

    lse: (B, Hq, Sq) float32, the natural-log sum of exponentials of each query row's scaled
    scores (-inf for rows that see no key); the backward pass takes it.
    """
    return attention_forward(q, k, v, causal, softmax_scale, True)


def flash_attention_backward(grad_output, q, k, v, output, softmax_lse, causal=False, softmax_scale=None, *,
                             deterministic=False):
    """Gradients of fused attention; returns (dq, dk, dv).

    Args:
        grad_output: (B, Hq, Sq, D) gradient of the attention output, the dtype of q; any strides.
        q, k, v, causal, softmax_scale: the forward call's arguments (see `flash_attention_science`).
        output: (B, Hq, Sq, D) the forward's output.
        softmax_lse: (B, Hq, Sq) float32, the lse `flash_attention_forward` returned.
        deterministic: accepted for compatibility with flash-attn. Gradients are always bitwise
            reproducible here: every element of dq, dk and dv is summed by one program in a fixed
            order (dQ has its own kernel instead of atomic adds), so True costs nothing.

    dq has q's layout and dtype, dk and dv those of k and v: (B, Hkv, Sk, D), summed over the
    query heads of each group under GQA/MQA. Rows that saw no key get zero gradients. fp32
    inputs use tf32 matrix products on the GPU. Memory beyond the outputs is O(B * Hq * Sq).
    """
    _check_deterministic(deterministic)
    return attention_backward(grad_output, q, k, v, output, softmax_lse, causal, softmax_scale)


def flash_attention_science(q, k, v, causal=False, softmax_scale=None, *, return_lse=False, deterministic=False):
    """Fused scaled-dot-product attention, differentiable in q, k and v.

    Args:
        q: (B, Hq, Sq, D) query, fp16, bf16 or fp32 (fp32 uses tf32 matrix products on the GPU).
        k, v: (B, Hkv, Sk, D) keys and values, the dtype of q. Hq must be a multiple of Hkv
            (grouped-query / multi-query attention); K and V are never repeated in memory.
        causal: mask scores above the diagonal. The diagonal is aligned bottom-right: query i sees
            keys j <= i + (Sk - Sq), as in flash-attn >= 2.1 and as decoding with a KV cache needs.
            This differs from `scaled_dot_product_attention(is_causal=True)` when Sq != Sk (SDPA
            aligns top-left). Query rows that see no key return 0 (and lse -inf), never NaN.
        softmax_scale: multiplies q.k^T before the softmax; default 1/sqrt(D).
        return_lse: also return lse (B, Hq, Sq) float32, natural log. It is differentiable too.
        deterministic: accepted for compatibility with flash-attn. The backward is always bitwise
            reproducible (no atomic adds: dQ has its own kernel), so True costs nothing.

    Any Sq, Sk >= 0 and any D from 16 to 256. Inputs may have any strides with unit stride in D
    (such as (B, S, H, D).transpose(1, 2) views), which are read in place; a tensor whose last
    dimension is not contiguous is copied first. The output has q's layout and dtype.

    Gradients flow when autograd is on and q, k or v requires grad. Under torch.compile the call
    goes through the torch.library ops `flashmoe_science::attention_forward` and
    `::attention_backward` (`fullgraph=True` works, forward and backward); eager calls launch the
    same kernels directly. The backward keeps memory O(S): it recomputes the attention weights
    from q, k and lse instead of storing them.

    Returns:
        out (B, Hq, Sq, D), or (out, lse) when return_lse.
    """
    _check_deterministic(deterministic)
    try:
        differentiable = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    except AttributeError:  # not tensors: the lean path's checks say which argument is wrong
        differentiable = False
    if torch.compiler.is_compiling():
        _check_options(causal, softmax_scale)
        out, lse = torch.ops.flashmoe_science.attention_forward(q, k, v, causal, softmax_scale)
    elif differentiable:
        out, lse = _AttentionFunction.apply(q, k, v, causal, softmax_scale)
    else:
        out, lse = attention_forward(q, k, v, causal, softmax_scale, return_lse)
    return (out, lse) if return_lse else out
