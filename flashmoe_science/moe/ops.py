"""The MoE kernels as torch.library custom ops, so autograd and torch.compile see them.

- `flashmoe_science::moe_route` (router_logits -> topk_weights, topk_ids): its backward is
  `routing.route_backward` (torch ops on the (T, E) logits).
- `flashmoe_science::moe_experts_forward` (hidden_states, w1, w2, topk_weights, topk_ids ->
  out and what the backward needs: h, the activation's derivatives and the layout) with its
  backward `flashmoe_science::moe_experts_backward` (the kernels of backward.py).
- `flashmoe_science::moe_experts` (the same, and FP8 weights with their scales -> out): what a
  compiled graph calls where no gradient is wanted (inference, decoding under CUDA graphs): it
  stores nothing for a backward, and its output's shape is the input's, whatever the token count.

Each has a fake implementation that allocates outputs with exactly the real ones' shapes,
dtypes and strides (the layout's size follows from the shapes and the configuration table),
so torch.compile traces a model using `fused_moe`, `fused_experts` or `moe_route` without a
graph break and without running a kernel, forward and backward. `fused_moe`, `fused_experts`
and `moe_route` call these ops when autograd records or torch.compile traces; other calls
take the lean cached-plan path.
"""
from typing import List, Optional, Tuple

import torch
from torch import Tensor

from . import backward, experts, routing


@torch.library.custom_op("flashmoe_science::moe_route", mutates_args=())
def route_op(router_logits: Tensor, top_k: int, renormalize: bool, scoring: str) -> Tuple[Tensor, Tensor]:
    """(topk_weights (T, k) float32, topk_ids (T, k) int32) of `routing.moe_route`."""
    return routing.route(router_logits, top_k, renormalize, scoring)


@route_op.register_fake
def _route_fake(router_logits, top_k, renormalize, scoring):
    shape = (router_logits.shape[0], top_k)
    return router_logits.new_empty(shape, dtype=torch.float32), router_logits.new_empty(shape, dtype=torch.int32)


def _route_setup_context(ctx, inputs, output):
    router_logits, _, renormalize, scoring = inputs
    topk_weights, topk_ids = output
    ctx.save_for_backward(router_logits, topk_weights, topk_ids)
    ctx.renormalize, ctx.scoring = renormalize, scoring
    ctx.set_materialize_grads(False)


def _route_backward(ctx, grad_weights, grad_ids):
    if grad_weights is None:
        return None, None, None, None
    router_logits, topk_weights, topk_ids = ctx.saved_tensors
    return (routing.route_backward(grad_weights, router_logits, topk_weights, topk_ids, ctx.renormalize, ctx.scoring),
            None, None, None)


route_op.register_autograd(_route_backward, setup_context=_route_setup_context)


@torch.library.custom_op("flashmoe_science::moe_experts_forward", mutates_args=())
def experts_forward_op(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                       activation: str) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(out, h, h_grads, sorted_pairs, block_expert, block_rows) of `experts.forward_for_backward`;
    topk_weights float32 and topk_ids int32, contiguous."""
    return experts.forward_for_backward(hidden_states, w1, w2, topk_weights, topk_ids, activation)


@experts_forward_op.register_fake
def _experts_forward_fake(hidden_states, w1, w2, topk_weights, topk_ids, activation):
    T, H = hidden_states.shape
    inter = w1.shape[1] // 2
    if isinstance(T, torch.SymInt):
        # A dynamic token count: the layout's size follows from T through the configuration
        # table's load buckets, which a symbolic T cannot pick without guarding on its range. Its
        # tensors only travel to the backward op, so their sizes can stay unknown.
        ctx = torch.library.get_ctx()
        rows, num_blocks = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    else:
        block_m, num_blocks = experts.saved_layout_size(hidden_states, w1, topk_ids.shape[1])
        rows = num_blocks * block_m
    new = hidden_states.new_empty
    return (new((T, H)), new((rows, inter)), new((rows, 2 * inter)), topk_ids.new_empty((rows,)),
            topk_ids.new_empty((num_blocks,)), topk_ids.new_empty((num_blocks,)))


@torch.library.custom_op("flashmoe_science::moe_experts", mutates_args=())
def experts_inference_op(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                         activation: str, w1_scale: Optional[Tensor], w2_scale: Optional[Tensor],
                         block_shape: Optional[List[int]]) -> Tensor:
    """`experts.fused_experts` without gradients (its lean path; FP8 weights with their scales)."""
    return experts.fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation=activation,
                                 w1_scale=w1_scale, w2_scale=w2_scale, block_shape=block_shape)


@experts_inference_op.register_fake
def _experts_inference_fake(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_scale, w2_scale,
                            block_shape):
    return hidden_states.new_empty((hidden_states.shape[0], w2.shape[1]))


@torch.library.custom_op("flashmoe_science::moe_experts_backward", mutates_args=())
def experts_backward_op(grad_out: Tensor, hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                        topk_ids: Tensor, h: Tensor, h_grads: Tensor, sorted_pairs: Tensor, block_expert: Tensor,
                        block_rows: Tensor, need_input_grad: bool,
                        need_weight_grads: bool) -> Tuple[Tensor, Tensor, Tensor, Tensor]:
    """(d hidden_states, d w1, d w2, d topk_weights) of `backward.experts_backward`."""
    return backward.experts_backward(grad_out, hidden_states, w1, w2, topk_weights, topk_ids, h, h_grads, sorted_pairs,
                                     block_expert, block_rows, need_input_grad, need_weight_grads)


@experts_backward_op.register_fake
def _experts_backward_fake(grad_out, hidden_states, w1, w2, topk_weights, topk_ids, h, h_grads, sorted_pairs,
                           block_expert, block_rows, need_input_grad, need_weight_grads):
    new = hidden_states.new_empty
    return (new(hidden_states.shape) if need_input_grad else new((0,)),
            new(w1.shape) if need_weight_grads else new((0,)),
            new(w2.shape) if need_weight_grads else new((0,)),
            topk_weights.new_empty(topk_ids.shape))


def _experts_setup_context(ctx, inputs, output):
    hidden_states, w1, w2, topk_weights, topk_ids, _ = inputs
    ctx.save_for_backward(hidden_states, w1, w2, topk_weights, topk_ids, *output[1:])
    # Only out carries a gradient; the saved outputs get None instead of tensors of zeros.
    ctx.set_materialize_grads(False)


def _experts_backward(ctx, grad_out, *saved_output_grads):
    if grad_out is None:
        return None, None, None, None, None, None
    need_x, need_w1, need_w2, need_weights = ctx.needs_input_grad[:4]
    grad_x, grad_w1, grad_w2, grad_weights = experts_backward_op(
        grad_out, *ctx.saved_tensors, need_x, need_w1 or need_w2)
    return (grad_x if need_x else None, grad_w1 if need_w1 else None, grad_w2 if need_w2 else None,
            grad_weights if need_weights else None, None, None)


experts_forward_op.register_autograd(_experts_backward, setup_context=_experts_setup_context)
