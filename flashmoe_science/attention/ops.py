"""The attention kernels as torch.library custom ops, so torch.compile traces through them.

`flashmoe_science::attention_forward` returns (out, lse) and carries its backward
(`register_autograd`, with the eager path's context helpers); `flashmoe_science::attention_backward`
returns (dq, dk, dv). `attention_varlen_forward` and `attention_varlen_backward` are the same for
packed variable-length batches. All have fake implementations that allocate outputs with exactly
the real ones' shapes, dtypes and strides, so torch.compile traces a model using
`flash_attention_science` or `flash_attention_varlen` without a graph break and without running a
kernel, forward and backward. The sliding window travels as two ints (left, right).
`attention_with_kvcache` is `flash_attention_with_kvcache` (inference: it mutates the caches
when given new keys and values, and has no backward). The forward ops take FP8 inputs with their
(B, Hkv, 3) `descales` (`fp8.fp8_descales`; forward only, bf16 output).

lse is a differentiable output: its gradient enters the backward through delta (the derivative
of lse_i with respect to score s_ij is p_ij), so a loss may use it.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from ..float8 import FP8_DTYPE
from . import decode, interface, varlen
from .backward import attention_backward as _attention_backward
from .forward import attention_forward as _attention_forward
from .fp8 import FP8_OUT_DTYPE
from .layouts import output_like


def _output_fake(q, k, v, descales=None):
    # The output takes the layout of q (`forward.ForwardPlan`), contiguous when any of q, k, v has
    # a non-unit stride in D, with v's head dim; bf16 for FP8 inputs.
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q = q.contiguous()
    return output_like(q, v.shape[-1], FP8_OUT_DTYPE if descales is not None else None)


def _gradients_fake(q, k, v):
    return output_like(q), output_like(k), output_like(v)


@torch.library.custom_op("flashmoe_science::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool, softmax_scale: Optional[float],
                      window_left: int = -1, window_right: int = -1, softcap: float = 0.0,
                      descales: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse) of `flash_attention_forward`."""
    return _attention_forward(q, k, v, causal, softmax_scale, True, None, (window_left, window_right), softcap,
                              descales)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, causal, softmax_scale, window_left=-1, window_right=-1, softcap=0.0,
                            descales=None):
    return _output_fake(q, k, v, descales), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashmoe_science::attention_backward", mutates_args=())
def attention_backward(grad_output: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       softmax_scale: Optional[float], window_left: int, window_right: int, softcap: float,
                       grad_lse: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `flash_attention_backward`, with lse's own gradient `grad_lse` if any."""
    return _attention_backward(grad_output, q, k, v, out, lse, causal, softmax_scale,
                                        (window_left, window_right), softcap, grad_lse)


@attention_backward.register_fake
def _attention_backward_fake(grad_output, q, k, v, out, lse, causal, softmax_scale, window_left, window_right,
                             softcap, grad_lse):
    return _gradients_fake(q, k, v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale, window_left, window_right, softcap, _ = inputs  # FP8 (descales) never requires grad
    interface.save_for_backward(ctx, (q, k, v, *output), (causal, softmax_scale, window_left, window_right, softcap))


def _backward(ctx, grad_out, grad_lse):
    return (*interface.gradients_from_context(ctx, grad_out, grad_lse, attention_backward), *(None,) * 6)


attention_forward.register_autograd(_backward, setup_context=_setup_context)


@torch.library.custom_op("flashmoe_science::attention_varlen_forward", mutates_args=())
def attention_varlen_forward(q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                             max_seqlen_q: int, max_seqlen_k: int, causal: bool, softmax_scale: Optional[float],
                             window_left: int, window_right: int, softcap: float,
                             descales: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse) of `flash_attention_varlen(..., return_lse=True)`."""
    return varlen.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                 softmax_scale, True, (window_left, window_right), softcap, descales)


@attention_varlen_forward.register_fake
def _attention_varlen_forward_fake(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, causal,
                                   softmax_scale, window_left, window_right, softcap, descales=None):
    return _output_fake(q, k, v, descales), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


@torch.library.custom_op("flashmoe_science::attention_varlen_backward", mutates_args=())
def attention_varlen_backward(grad_output: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                              cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
                              causal: bool, softmax_scale: Optional[float], window_left: int, window_right: int,
                              softcap: float, grad_lse: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of a packed batch, with lse's own gradient `grad_lse` if any."""
    return varlen.varlen_backward(grad_output, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, causal, softmax_scale, (window_left, window_right), softcap, grad_lse)


@attention_varlen_backward.register_fake
def _attention_varlen_backward_fake(grad_output, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, causal, softmax_scale, window_left, window_right, softcap,
                                    grad_lse):
    return _gradients_fake(q, k, v)


def _setup_varlen_context(ctx, inputs, output):
    q, k, v, cu_seqlens_q, cu_seqlens_k, *options, _ = inputs  # FP8 (descales) never requires grad
    interface.save_for_backward(ctx, (q, k, v, *output, cu_seqlens_q, cu_seqlens_k), tuple(options))


def _varlen_backward(ctx, grad_out, grad_lse):
    return (*interface.gradients_from_context(ctx, grad_out, grad_lse, attention_varlen_backward), *(None,) * 10)


attention_varlen_forward.register_autograd(_varlen_backward, setup_context=_setup_varlen_context)


@torch.library.custom_op("flashmoe_science::attention_with_kvcache",
                         mutates_args=("k_cache", "v_cache", "k_descale", "v_descale"))
def attention_with_kvcache(q: Tensor, k_cache: Tensor, v_cache: Tensor, k: Optional[Tensor], v: Optional[Tensor],
                           cache_seqlens: Tensor, block_table: Optional[Tensor], cache_leftpad: Optional[Tensor],
                           causal: bool, softmax_scale: Optional[float], window_left: int, window_right: int,
                           softcap: float, num_splits: int, k_descale: Optional[Tensor] = None,
                           v_descale: Optional[Tensor] = None) -> Tuple[Tensor, Tensor]:
    """(out, lse) of `flash_attention_with_kvcache`; k and v, when given, are written into the
    caches in place first (an FP8 cache's per-token descales too). Not differentiable. A 16-bit
    cache's descales are ignored (the compiled call passes empty placeholders)."""
    if k_cache.dtype != FP8_DTYPE:
        k_descale = v_descale = None
    return decode._with_kvcache(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, causal,
                                softmax_scale, (window_left, window_right), softcap, num_splits, True, k_descale,
                                v_descale)


@attention_with_kvcache.register_fake
def _attention_with_kvcache_fake(q, k_cache, v_cache, k, v, cache_seqlens, block_table, cache_leftpad, causal,
                                 softmax_scale, window_left, window_right, softcap, num_splits, k_descale=None,
                                 v_descale=None):
    return torch.empty_like(q), q.new_empty((q.shape[0], q.shape[2], q.shape[1]), dtype=torch.float32)
