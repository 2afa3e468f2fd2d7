"""The MoE kernels as torch.library custom ops, so autograd and torch.compile see them.

- `flashmoe_science::moe_route` (router_logits -> topk_weights, topk_ids): its backward is
  `flashmoe_science::moe_route_backward` (`routing.route_backward`, one launch).
- `flashmoe_science::moe_experts_gate_up` (hidden_states, w1, ... -> h, the activation's
  derivatives and the layout) and `flashmoe_science::moe_experts_down` (those -> out): the
  forward of a call that needs gradients, in two halves, so autograd sees two nodes; their
  backwards `moe_experts_down_backward` and `moe_experts_gate_up_backward` (backward.py).
- `flashmoe_science::moe_experts` (the same, and FP8 weights with their scales -> out): what a
  compiled graph calls where no gradient is wanted (inference, decoding under CUDA graphs): it
  stores nothing for a backward, and its output's shape is the input's, whatever the token count.

Each has a fake implementation that allocates outputs with exactly the real ones' shapes,
dtypes and strides (the layout's size follows from the shapes and the configuration table),
so torch.compile traces a model using `fused_moe`, `fused_experts` or `moe_route` without a
graph break and without running a kernel, forward and backward. `fused_moe`, `fused_experts`
and `moe_route` call these ops when torch.compile traces; when autograd records outside
it (on plain tensors) they call the same forwards, context setups and backwards as
torch.autograd.Functions (`route`, `experts_gate_up`, `experts_down` below), whose backwards call
the backward ops' Python functions directly: torch.library's wrappers of a differentiable
custom op handle its schema on every call (`fill_defaults`, redispatch), host time that an eager
training step paid five times (benchmarks/results/moe_host/). Other calls take the lean
cached-plan path.
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


@torch.library.custom_op("flashmoe_science::moe_route_backward", mutates_args=())
def route_backward_op(grad_weights: Tensor, router_logits: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                      renormalize: bool, scoring: str) -> Tensor:
    """d router_logits of `routing.route_backward`."""
    return routing.route_backward(grad_weights, router_logits, topk_weights, topk_ids, renormalize, scoring)


@route_backward_op.register_fake
def _route_backward_fake(grad_weights, router_logits, topk_weights, topk_ids, renormalize, scoring):
    return router_logits.new_empty(router_logits.shape)


def _route_backward(ctx, grad_weights, grad_ids):
    if grad_weights is None:
        return None, None, None, None
    route_backward = routing.route_backward if getattr(ctx, "eager", False) else route_backward_op
    return route_backward(grad_weights, *ctx.saved_tensors, ctx.renormalize, ctx.scoring), None, None, None


route_op.register_autograd(_route_backward, setup_context=_route_setup_context)


@torch.library.custom_op("flashmoe_science::moe_experts_gate_up", mutates_args=())
def experts_gate_up_op(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                       activation: str, w1_bias: Optional[Tensor] = None,
                       gate_up_interleaved: bool = False) -> Tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(h, h_grads, sorted_pairs, block_expert, block_rows) of `experts.gate_up_for_backward`;
    topk_weights float32 and topk_ids int32, contiguous."""
    return experts.gate_up_for_backward(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias,
                                        gate_up_interleaved)


@experts_gate_up_op.register_fake
def _experts_gate_up_fake(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias=None,
                          gate_up_interleaved=False):
    T = hidden_states.shape[0]
    inter = w1.shape[1] // 2
    if isinstance(T, torch.SymInt):
        # A dynamic token count: the layout's size follows from T through the configuration
        # table's load buckets, which a symbolic T cannot pick without guarding on its range. Its
        # tensors only travel to the other ops, so their sizes can stay unknown.
        ctx = torch.library.get_ctx()
        rows, num_blocks = ctx.new_dynamic_size(), ctx.new_dynamic_size()
    else:
        block_m, num_blocks = experts.saved_layout_size(hidden_states, w1, topk_ids.shape[1])
        rows = num_blocks * block_m
    new = hidden_states.new_empty
    return (new((rows, inter)), new((rows, 2 * inter)), topk_ids.new_empty((rows,)),
            topk_ids.new_empty((num_blocks,)), topk_ids.new_empty((num_blocks,)))


@torch.library.custom_op("flashmoe_science::moe_experts_down", mutates_args=())
def experts_down_op(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor, h: Tensor,
                    h_grads: Tensor, sorted_pairs: Tensor, block_expert: Tensor, block_rows: Tensor,
                    gate_up_interleaved: bool = False) -> Tensor:
    """out (T, H) of `experts.down_for_backward`; h_grads and w1's gate/up row order are for the
    backward only."""
    return experts.down_for_backward(hidden_states, w1, w2, topk_weights, topk_ids, h, sorted_pairs, block_expert,
                                     block_rows)


@experts_down_op.register_fake
def _experts_down_fake(hidden_states, w1, w2, topk_weights, topk_ids, h, h_grads, sorted_pairs, block_expert,
                       block_rows, gate_up_interleaved=False):
    return hidden_states.new_empty((hidden_states.shape[0], w2.shape[1]))


@torch.library.custom_op("flashmoe_science::moe_experts", mutates_args=())
def experts_inference_op(hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor, topk_ids: Tensor,
                         activation: str, w1_scale: Optional[Tensor], w2_scale: Optional[Tensor],
                         block_shape: Optional[List[int]], w1_bias: Optional[Tensor] = None,
                         w2_bias: Optional[Tensor] = None, gate_up_interleaved: bool = False) -> Tensor:
    """`experts.fused_experts` without gradients (its lean path; FP8 weights with their scales;
    expert biases and interleaved gate/up rows)."""
    return experts.fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation=activation,
                                 w1_scale=w1_scale, w2_scale=w2_scale, block_shape=block_shape, w1_bias=w1_bias,
                                 w2_bias=w2_bias, gate_up_interleaved=gate_up_interleaved)


@experts_inference_op.register_fake
def _experts_inference_fake(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_scale, w2_scale,
                            block_shape, w1_bias=None, w2_bias=None, gate_up_interleaved=False):
    return hidden_states.new_empty((hidden_states.shape[0], w2.shape[1]))


@torch.library.custom_op("flashmoe_science::moe_experts_down_backward", mutates_args=())
def experts_down_backward_op(grad_out: Tensor, hidden_states: Tensor, w1: Tensor, w2: Tensor, topk_weights: Tensor,
                             topk_ids: Tensor, h: Tensor, h_grads: Tensor, sorted_pairs: Tensor,
                             block_expert: Tensor, block_rows: Tensor, need_gate_up_grad: bool,
                             need_w2_grad: bool, gate_up_interleaved: bool = False) -> Tuple[Tensor, Tensor, Tensor]:
    """(d [gate, up], d w2, d topk_weights) of `backward.down_backward`."""
    return backward.down_backward(grad_out, hidden_states, w1, w2, topk_weights, topk_ids, h, h_grads, sorted_pairs,
                                  block_expert, block_rows, need_gate_up_grad, need_w2_grad, gate_up_interleaved)


@experts_down_backward_op.register_fake
def _experts_down_backward_fake(grad_out, hidden_states, w1, w2, topk_weights, topk_ids, h, h_grads, sorted_pairs,
                                block_expert, block_rows, need_gate_up_grad, need_w2_grad, gate_up_interleaved=False):
    return (h_grads.new_empty(h_grads.shape) if need_gate_up_grad else h_grads.new_empty((0,)),
            backward.gradient_like(w2) if need_w2_grad else w2.new_empty((0,)),
            topk_weights.new_empty(topk_ids.shape))


@torch.library.custom_op("flashmoe_science::moe_experts_gate_up_backward", mutates_args=())
def experts_gate_up_backward_op(grad_gate_up: Tensor, hidden_states: Tensor, w1: Tensor, w2: Tensor,
                                topk_ids: Tensor, sorted_pairs: Tensor, block_expert: Tensor, block_rows: Tensor,
                                need_input_grad: bool, need_w1_grad: bool) -> Tuple[Tensor, Tensor]:
    """(d hidden_states, d w1) of `backward.gate_up_backward`."""
    return backward.gate_up_backward(grad_gate_up, hidden_states, w1, w2, topk_ids, sorted_pairs, block_expert,
                                     block_rows, need_input_grad, need_w1_grad)


@experts_gate_up_backward_op.register_fake
def _experts_gate_up_backward_fake(grad_gate_up, hidden_states, w1, w2, topk_ids, sorted_pairs, block_expert,
                                   block_rows, need_input_grad, need_w1_grad):
    new = hidden_states.new_empty
    return (new(hidden_states.shape) if need_input_grad else new((0,)),
            backward.gradient_like(w1) if need_w1_grad else new((0,)))


# The two saving ops are two autograd nodes. The down node's backward applies the activation's
# chain rule (its h_grads are the activation's derivatives) and so hands the gate/up node, in the
# place of h_grads, the gradient with respect to the gate and up projections, d [gate, up]; h
# gets none (its dependence on gate and up is inside that gradient). Once the down node's
# backward has run, autograd frees h and h_grads, before d w1 is allocated.

def _gate_up_setup_context(ctx, inputs, output):
    hidden_states, w1, w2, topk_weights, topk_ids = inputs[:5]
    ctx.save_for_backward(hidden_states, w1, w2, topk_ids, *output[2:])
    ctx.set_materialize_grads(False)


def _gate_up_backward(ctx, grad_h, grad_gate_up, *layout_grads):
    # one gradient per input the op was called with (w1_bias, when left at its default, is not one)
    grads = [None] * len(ctx.needs_input_grad)
    if grad_gate_up is None:
        return tuple(grads)
    need_x, need_w1 = ctx.needs_input_grad[:2]
    gate_up_backward = backward.gate_up_backward if getattr(ctx, "eager", False) else experts_gate_up_backward_op
    grad_x, grad_w1 = gate_up_backward(grad_gate_up, *ctx.saved_tensors, need_x, need_w1)
    grads[0], grads[1] = (grad_x if need_x else None), (grad_w1 if need_w1 else None)
    if len(grads) > 6 and ctx.needs_input_grad[6]:  # d w1_bias[e]: the sum of d [gate, up] over e's rows
        _, w1, _, _, _, block_expert, _ = ctx.saved_tensors
        grads[6] = backward.expert_row_sums(grad_gate_up, block_expert, w1.shape[0]).to(w1.dtype)
    return tuple(grads)


experts_gate_up_op.register_autograd(_gate_up_backward, setup_context=_gate_up_setup_context)


def _down_setup_context(ctx, inputs, output):
    ctx.save_for_backward(*inputs[:10])
    ctx.interleaved = inputs[10] if len(inputs) > 10 else False
    ctx.set_materialize_grads(False)


def _down_backward(ctx, grad_out):
    # one gradient per input the op was called with (gate_up_interleaved, when left at its default, is not one)
    grads = [None] * len(ctx.needs_input_grad)
    if grad_out is None:
        return tuple(grads)
    need = ctx.needs_input_grad
    need_w2, need_weights, need_gate_up = need[2], need[3], need[6]
    if getattr(ctx, "eager", False):
        saved, overwrite = _saved_to_overwrite(ctx)
        grad_gate_up, grad_w2, grad_weights = backward.down_backward(grad_out, *saved, need_gate_up, need_w2,
                                                                     ctx.interleaved, overwrite)
    else:
        grad_gate_up, grad_w2, grad_weights = experts_down_backward_op(grad_out, *ctx.saved_tensors, need_gate_up,
                                                                       need_w2, ctx.interleaved)
    grads[2], grads[3] = (grad_w2 if need_w2 else None), (grad_weights if need_weights else None)
    grads[6] = grad_gate_up if need_gate_up else None
    return tuple(grads)


experts_down_op.register_autograd(_down_backward, setup_context=_down_setup_context)


def _saved_to_overwrite(ctx):
    """(the eager down node's saved tensors, whether its backward writes its gradients over the
    saved h and h_grads). It does where `experts_down` gave the node the gate/up half's options
    (`gate_up_options`) and gate and up are not interleaved: this backward is their last reader,
    and d [gate, up] and w_p * h_p then take no memory of their own ((rows, 3I) elements, the
    largest buffers of the backward). A second backward through a retained graph finds them
    overwritten and recomputes them with the gate/up GEMM."""
    saved = ctx.saved_tensors
    options = getattr(ctx, "gate_up_options", None)
    if options is None or ctx.interleaved:
        return saved, False
    if getattr(ctx, "saved_overwritten", False):
        activation, w1_bias = options
        h, h_grads = experts.gate_up_for_backward(*saved[:5], activation, w1_bias)[:2]
        saved = (*saved[:5], h, h_grads, *saved[7:])
    ctx.saved_overwritten = True
    return saved, True


def _eager_function(name, forward, setup_context, backward_fn):
    """A torch.autograd.Function running a custom op's forward, context setup and backward outside
    torch.compile; `ctx.eager` tells the backward to call the backward ops' Python functions
    directly (the registered autograd, which AOT tracing runs on fake tensors, calls the ops). Its
    forward takes ctx and sets it up itself: with a separate setup_context, Function.apply binds
    its arguments through inspect.signature on every call."""
    def forward_with_ctx(ctx, *inputs):
        output = forward(*inputs)
        setup_context(ctx, inputs, output)
        ctx.eager = True
        return output
    return type(torch.autograd.Function)(name, (torch.autograd.Function,), {
        "forward": staticmethod(forward_with_ctx), "backward": staticmethod(backward_fn),
        "__doc__": f"{name}: a custom op's forward and backward outside torch.compile."})


def _down_forward(hidden_states, w1, w2, topk_weights, topk_ids, h, h_grads, sorted_pairs, block_expert, block_rows,
                  gate_up_interleaved=False):
    return experts.down_for_backward(hidden_states, w1, w2, topk_weights, topk_ids, h, sorted_pairs, block_expert,
                                     block_rows)


# (The forwards look their functions up at each call, as the custom ops' bodies do.)
_EagerRoute = _eager_function("_EagerRoute", lambda *inputs: routing.route(*inputs), _route_setup_context,
                              _route_backward)
_EagerGateUp = _eager_function("_EagerGateUp", lambda *inputs: experts.gate_up_for_backward(*inputs),
                               _gate_up_setup_context, _gate_up_backward)
_EagerDown = _eager_function("_EagerDown", _down_forward, _down_setup_context, _down_backward)


def _recorded(op, eager, *args):
    """A differentiable call where autograd records: its eager Function on plain tensors outside
    torch.compile, else the custom op (compiled graphs, and tensor subclasses such as the fake
    and functional tensors of tracing, which only the op's registrations handle)."""
    if _eager(args[0]):
        return eager.apply(*args)
    return op(*args)


def _eager(first_input) -> bool:
    """Whether `_recorded` runs the eager Function for a call whose first input is this."""
    return type(first_input) is torch.Tensor and not torch.compiler.is_compiling()


def route(router_logits, top_k, renormalize, scoring):
    """`route_op` where autograd records (`_recorded`)."""
    return _recorded(route_op, _EagerRoute, router_logits, top_k, renormalize, scoring)


def experts_gate_up(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias=None,
                    gate_up_interleaved=False):
    """`experts_gate_up_op` where autograd records (`_recorded`)."""
    return _recorded(experts_gate_up_op, _EagerGateUp, hidden_states, w1, w2, topk_weights, topk_ids, activation,
                     w1_bias, gate_up_interleaved)


def experts_down(hidden_states, w1, w2, topk_weights, topk_ids, h, h_grads, sorted_pairs, block_expert, block_rows,
                 gate_up_interleaved=False, *, activation=None, w1_bias=None):
    """`experts_down_op` where autograd records: its eager Function where `_recorded` would take
    it, whose node is then given the gate/up half's activation (and w1_bias), so its backward may
    write its gradients over h and h_grads (`_saved_to_overwrite`): pass them only where nothing
    else reads h and h_grads."""
    args = (hidden_states, w1, w2, topk_weights, topk_ids, h, h_grads, sorted_pairs, block_expert, block_rows,
            gate_up_interleaved)
    if not _eager(hidden_states):
        return experts_down_op(*args)
    out = _EagerDown.apply(*args)
    if activation is not None and out.grad_fn is not None:
        out.grad_fn.gate_up_options = (activation, w1_bias)
    return out
