"""The attention kernels as torch.library custom ops, so torch.compile traces through them.

`flashmoe_science::attention_forward` returns (out, lse) and carries its backward
(`register_autograd`, with the eager path's context helpers); `flashmoe_science::attention_backward`
returns (dq, dk, dv). Both have fake implementations that allocate outputs with exactly the real
ones' shapes, dtypes and strides, so torch.compile traces a model using `flash_attention_science`
without a graph break and without running a kernel, forward and backward.

lse is a differentiable output: its gradient enters the backward through delta (the derivative
of lse_i with respect to score s_ij is p_ij), so a loss may use it.
"""
from typing import Optional, Tuple

import torch
from torch import Tensor

from . import interface


@torch.library.custom_op("flashmoe_science::attention_forward", mutates_args=())
def attention_forward(q: Tensor, k: Tensor, v: Tensor, causal: bool,
                      softmax_scale: Optional[float]) -> Tuple[Tensor, Tensor]:
    """(out, lse) of `flash_attention_forward`."""
    return interface.attention_forward(q, k, v, causal, softmax_scale, True)


@attention_forward.register_fake
def _attention_forward_fake(q, k, v, causal, softmax_scale):
    # The real forward copies all of q, k, v when one has a non-unit stride in D, and the
    # output takes the layout of the q it ran on.
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1:
        q = q.contiguous()
    return interface._output_like(q), q.new_empty(q.shape[:3], dtype=torch.float32)


@torch.library.custom_op("flashmoe_science::attention_backward", mutates_args=())
def attention_backward(grad_output: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, causal: bool,
                       softmax_scale: Optional[float], grad_lse: Optional[Tensor]) -> Tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) of `flash_attention_backward`, with lse's own gradient `grad_lse` if any."""
    return interface.attention_backward(grad_output, q, k, v, out, lse, causal, softmax_scale, grad_lse)


@attention_backward.register_fake
def _attention_backward_fake(grad_output, q, k, v, out, lse, causal, softmax_scale, grad_lse):
    return interface._output_like(q), interface._output_like(k), interface._output_like(v)


def _setup_context(ctx, inputs, output):
    q, k, v, causal, softmax_scale = inputs
    out, lse = output
    interface.save_for_backward(ctx, q, k, v, out, lse, causal, softmax_scale)


def _backward(ctx, grad_out, grad_lse):
    return (*interface.gradients_from_context(ctx, grad_out, grad_lse, attention_backward), None, None)


attention_forward.register_autograd(_backward, setup_context=_setup_context)
