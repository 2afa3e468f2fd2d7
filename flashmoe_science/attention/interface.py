"""Public attention functions: argument checks, output allocation, dispatch and launch.

The kernels live in `_kernels/`; this module is the contract. A call with the same shapes,
strides, dtypes and devices as an earlier one skips every check and configuration decision
(a dictionary lookup on a key of those facts) and launches the cached compiled kernel
directly, because on small inputs host time decides the speed users feel.
"""
from __future__ import annotations

import math

import torch

from ..device import check_runnable, info_for
from ..launch import KernelLauncher
from ._kernels.forward import attention_forward_kernel
from .configs import forward_config, head_dim_block

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634

_FORWARD = KernelLauncher("attention_forward", attention_forward_kernel)
_MAX_PLANS = 4096


class _ForwardPlan:
    """Everything about a forward call that depends only on its shapes, strides and dtypes."""

    __slots__ = ("empty", "contiguous", "config", "head_dim", "block_d", "group", "grid", "num_m_blocks",
                 "default_scale", "lse_shape", "device_index")

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
    batch, heads_q, seqlen_q, _ = q.shape
    sq, sk, sv, so = q.stride(), k.stride(), v.stride(), out.stride()
    _FORWARD.launch(
        key, plan.grid,
        (q, k, v, out, lse if write_lse else out, scale * _LOG2E,
         sq[0], sq[1], sq[2], sk[0], sk[1], sk[2], sv[0], sv[1], sv[2], so[0], so[1], so[2],
         heads_q, plan.group, seqlen_q, k.shape[2], plan.num_m_blocks,
         plan.head_dim, plan.block_d, cfg.block_m, cfg.block_n, causal, write_lse),
        num_warps=cfg.num_warps, num_stages=cfg.num_stages, device_index=plan.device_index)
    return out, lse


def flash_attention_forward(q, k, v, causal=False, softmax_scale=None):
    """Fused attention forward; returns (out, lse). See `flash_attention_science` for the contract.

    lse: (B, Hq, Sq) float32, the natural-log sum of exponentials of each query row's scaled
    scores (-inf for rows that see no key); the backward pass takes it.
    """
    return attention_forward(q, k, v, causal, softmax_scale, True)


def flash_attention_science(q, k, v, causal=False, softmax_scale=None, *, return_lse=False):
    """Fused scaled-dot-product attention.

    Args:
        q: (B, Hq, Sq, D) query, fp16, bf16 or fp32 (fp32 uses tf32 matrix products on the GPU).
        k, v: (B, Hkv, Sk, D) keys and values, the dtype of q. Hq must be a multiple of Hkv
            (grouped-query / multi-query attention); K and V are never repeated in memory.
        causal: mask scores above the diagonal. The diagonal is aligned bottom-right: query i sees
            keys j <= i + (Sk - Sq), as in flash-attn >= 2.1 and as decoding with a KV cache needs.
            This differs from `scaled_dot_product_attention(is_causal=True)` when Sq != Sk (SDPA
            aligns top-left). Query rows that see no key return 0 (and lse -inf), never NaN.
        softmax_scale: multiplies q.k^T before the softmax; default 1/sqrt(D).
        return_lse: also return lse (B, Hq, Sq) float32, natural log.

    Any Sq, Sk >= 0 and any D from 16 to 256. Inputs may have any strides with unit stride in D
    (such as (B, S, H, D).transpose(1, 2) views), which are read in place; a tensor whose last
    dimension is not contiguous is copied first. The output has q's layout and dtype.

    Returns:
        out (B, Hq, Sq, D), or (out, lse) when return_lse.
    """
    out, lse = attention_forward(q, k, v, causal, softmax_scale, return_lse)
    return (out, lse) if return_lse else out
