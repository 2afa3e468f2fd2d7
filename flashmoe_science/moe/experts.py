"""Public fused MoE functions: argument checks, configuration, buffers and launches.

A layer call is a fixed sequence of Triton launches sized from shapes alone:
1. routing and dispatch (routing.py): top-k, then the expert-sorted, block-aligned layout of
   the token-expert pairs (one launch for decode-sized calls, two or three otherwise);
2. gate/up GEMM: token rows gathered from hidden_states inside the kernel, gate and up tiles
   accumulated together, SwiGLU/GeGLU in the epilogue, the intermediate written once;
3. down GEMM: times the routing weight, each pair's row written to its token-slot position;
4. combine: each token's k rows summed in a fixed order (deterministic).
Nothing is read back by the host, so the call can be captured in a CUDA graph. On Hopper at
decode sizes (the configuration's `pdl`) launches 2-4 are programmatic dependents of the launch
before each (`dependent_launch`), so each launch overlaps the end of the kernel before it.

Calls that need gradients (autograd records and an input requires grad) or that torch.compile
traces go through the torch.library custom ops of `ops.py` instead: the same launches, except
that the gate/up GEMM also stores the activation's local derivatives, returned with h and the
layout for the backward (`gate_up_for_backward`, `down_for_backward`: two ops, two autograd nodes;
the backward is in backward.py).

A call with the same shapes, strides, dtypes, devices and options as an earlier one skips every
check and configuration decision (one dictionary lookup) and launches cached compiled kernels.
Configurations come from the tables in configs.py, or from `tune`, which times the table's
entries on the caller's inputs and caches the fastest for that shape and load bucket.
"""
from __future__ import annotations

import functools
import time

import torch

from triton.tools.tensor_descriptor import TensorDescriptor

from ..dependent_launch import launch_options
from ..device import check_runnable, info_for, interpreter_active
from ..launch import KernelLauncher, PlanCache
from ..tma import addressable as tma_addressable
from ..tma import gluon_descriptor, unchecked_descriptor
from . import configs, fp8, routing
from .routing import tensor_key
from ._kernels import forward_gluon
from ._kernels.combine import combine_kernel, gather_sum_kernel
from ._kernels.forward_gluon import down_gluon_kernel
from ._kernels.grouped_gemm import down_kernel, gate_up_kernel

_GATE_UP = KernelLauncher("moe_gate_up", gate_up_kernel, fp32_dots=True)
_DOWN = KernelLauncher("moe_down", down_kernel, fp32_dots=True)
_DOWN_GLUON = KernelLauncher("moe_down_gluon", down_gluon_kernel)
_COMBINE = KernelLauncher("moe_combine", combine_kernel)
_GATHER_SUM = KernelLauncher("moe_gather_sum", gather_sum_kernel)
_ID_DTYPES = (torch.int32, torch.int64)
# The expert kernels' K offsets within a tile are 32-bit (`_kernels/grouped_gemm._expert_tile_ptrs`):
# weights read in place with a larger stride along K are copied first.
MAX_K_STRIDE = 2**22
NO_BLOCK_SHAPE = "block_shape applies to FP8 weights only (w1, w2 in torch.float8_e4m3fn with w1_scale, w2_scale)"


def _check_tensor(name: str, t, ndim: int, layout: str) -> None:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must be {ndim}-D {layout}, got shape {tuple(t.shape)}")


def _check_experts_args(hidden_states, w1, w2, activation) -> None:
    _check_tensor("hidden_states", hidden_states, 2, "(T, H)")
    _check_tensor("w1", w1, 3, "(E, 2*I, H)")
    _check_tensor("w2", w2, 3, "(E, H, I)")
    if hidden_states.dtype not in routing.FLOAT_DTYPES:
        raise TypeError(f"hidden_states has dtype {hidden_states.dtype}; supported: float16, bfloat16, float32")
    for name, t in (("w1", w1), ("w2", w2)):
        if t.dtype != hidden_states.dtype:
            raise TypeError(f"{name} has dtype {t.dtype}; it must match hidden_states ({hidden_states.dtype})")
        if t.device != hidden_states.device:
            raise ValueError(f"{name} is on {t.device}; it must be on hidden_states' device ({hidden_states.device})")
    check_runnable("hidden_states", hidden_states)
    T, H = hidden_states.shape
    E, two_i, w1_h = w1.shape
    if w1_h != H:
        raise ValueError(f"w1 has shape {tuple(w1.shape)}; its last dimension must be H = {H} (hidden_states)")
    if two_i % 2:
        raise ValueError(f"w1 has shape {tuple(w1.shape)}; its middle dimension must be 2*I (gate and up rows)")
    I = two_i // 2
    if w2.shape[0] == E and w2.shape[1] == H and w2.shape[2] != I:
        raise ValueError(f"w1 has shape {tuple(w1.shape)} and w2 {tuple(w2.shape)}: w1 must be (E, 2*I, H), gate "
                         f"rows then up rows, with I = {w2.shape[2]} (w2's last dimension), so its middle dimension "
                         f"must be {2 * w2.shape[2]}, not {two_i}; or w2 must be (E, H, {I})")
    if tuple(w2.shape) != (E, H, I):
        raise ValueError(f"w2 has shape {tuple(w2.shape)}; expected (E, H, I) = {(E, H, I)} from w1 and hidden_states")
    if not 1 <= E <= configs.MAX_EXPERTS:
        raise ValueError(f"w1 has E = {E} experts; supported: 1 to {configs.MAX_EXPERTS}")
    if H % 16 or H == 0:
        raise ValueError(f"H = {H} (hidden_states' last dimension) must be a positive multiple of 16")
    if I % 16 or I == 0:
        raise ValueError(f"I = {I} (half of w1's middle dimension) must be a positive multiple of 16")
    if activation is not None and activation not in configs.ACTIVATIONS:
        raise ValueError(f"activation must be one of {configs.ACTIVATIONS}, got {activation!r}")


class _ExpertsPlan:
    """Everything about a call that depends only on its shapes, strides, dtypes and options."""

    __slots__ = ("num_tokens", "hidden", "inter", "num_experts", "top_k", "config", "dispatch", "path",
                 "copy_x", "copy_w1", "copy_w2", "device_index", "launch_key")

    def __init__(self, key, hidden_states, w1, w2, top_k: int, config: configs.ExpertsConfig | None = None):
        T, H = hidden_states.shape
        E, two_i, _ = w1.shape
        # Row indices of the padded layout (pairs plus up to BLOCK_M - 1 padding rows per expert)
        # are 32-bit.
        if T * top_k + E * configs.MAX_BLOCK_M >= 2**31:
            raise ValueError(f"T * top_k = {T * top_k} token-expert pairs is too many: at most "
                             f"{2**31 - 1 - E * configs.MAX_BLOCK_M} for E = {E} experts")
        self.num_tokens, self.hidden, self.inter, self.num_experts, self.top_k = T, H, two_i // 2, E, top_k
        self.config = config or configs.experts_config(info_for(hidden_states), hidden_states.element_size(), T,
                                                       top_k, E, H, self.inter)
        self.dispatch = routing.DispatchPlan(T, E, top_k, self.config.block_m, hidden_states.device,
                                             self.config.pdl)
        self.path = configs.path_name(T)
        # The kernels read rows as `rows_read_in_place` says, and weights as
        # `unit_stride_rows_or_columns` says; other layouts are copied once.
        self.copy_x = not rows_read_in_place(hidden_states)
        self.copy_w1, self.copy_w2 = (not unit_stride_rows_or_columns(w) for w in (w1, w2))
        self.device_index = self.dispatch.device_index
        # What the launchers cache compiled kernels by: the call's facts and the configuration
        # (a tuned configuration replaces the table's for the same call facts).
        self.launch_key = (key, self.config)

    def operands(self, hidden_states, w1, w2):
        return (hidden_states.contiguous() if self.copy_x else hidden_states,
                w1.contiguous() if self.copy_w1 else w1, w2.contiguous() if self.copy_w2 else w2)


def tma_capable(t: torch.Tensor) -> bool:
    """Whether kernels can move `t`'s device's tiles through tensor descriptors: sm90 or later (the
    CPU interpreter emulates descriptor loads)."""
    return info_for(t).capability >= 90 if t.is_cuda else interpreter_active()


def launch_key_with_tma(key, tma: bool):
    """A launcher's cache key: the call's key and whether this launch passes descriptors."""
    return None if key is None else (key, tma)


def tma_descriptor(t: torch.Tensor, block, shape=None, strides=None) -> TensorDescriptor:
    """A descriptor over `t` (or its view of `shape` and `strides`) in boxes of `block`; `t` has
    passed `tma_addressable`."""
    return unchecked_descriptor(TensorDescriptor, t, list(t.shape if shape is None else shape),
                                list(t.stride() if strides is None else strides), list(block))


def rows_read_in_place(x: torch.Tensor) -> bool:
    """Whether the expert kernels read the token rows x (T, H) where they are: with unit stride
    along H and a row stride that is a multiple of 16 elements. With another row stride Triton
    cannot prove 16-byte loads and issues narrow ones: DeepSeek-V2-Lite's expert-parallel
    forward+backward (4 H200s, EP 2, 16384 tokens a GPU), whose experts read rows 2072 elements
    apart, took 31.0 ms against 16.0 at 2080, so such rows are copied first, one pass over x."""
    return x.stride(1) == 1 and x.stride(0) % 16 == 0


def unit_stride_rows_or_columns(w: torch.Tensor) -> bool:
    """Whether the expert kernels, forward and backward, read weight `w` (E, N, K) where it lies:
    with unit stride along K, as our weights are stored, or along N (a transposed view, as
    transformers stores gpt-oss's) with a K stride the forward's 32-bit tile offsets reach."""
    return w.stride(2) == 1 or (w.stride(1) == 1 and w.stride(2) < MAX_K_STRIDE)


def gate_up_weight_descriptor(w1: torch.Tensor, block_n: int, block_k: int, interleaved: bool) -> TensorDescriptor:
    """w1 (E, 2I, H) seen as (E, I, 2, H), in boxes of (1, block_n, 2, block_k): each box holds the
    gate and up rows of block_n columns interleaved, gate_up_kernel's B tile."""
    E, two_i, H = w1.shape
    # rows from one column's gate row to the next column's, and from a gate row to its up row
    column_rows, up_row = (2, 1) if interleaved else (1, two_i // 2)
    return tma_descriptor(w1, (1, block_n, 2, block_k), (E, two_i // 2, 2, H),
                          (w1.stride(0), column_rows * w1.stride(1), up_row * w1.stride(1), 1))


def launch_gate_up(key, cfg: configs.ExpertsConfig, layout: routing.PairLayout, x, w1, h, top_k: int,
                   activation: str, device_index, h_grads=None, w1_bias=None, interleaved: bool = False) -> None:
    """h (layout rows, I) = act(gate, up), [gate, up] = x @ w1[e].T (+ w1_bias[e]), for every
    pair of the layout (w1's rows gate then up, or alternating with `interleaved`); with `h_grads`
    ((layout rows, 2I), x's dtype) also the activation's local derivatives [dh/dgate, dh/dup].
    Biased calls run the pointer path (the builds of the biased kernel)."""
    g = cfg.gate_up
    H, I = x.shape[1], h.shape[1]
    tma = cfg.tma and w1_bias is None and tma_capable(x) and tma_addressable(w1)
    _GATE_UP.launch(
        launch_key_with_tma(key, tma), (layout.num_blocks * -(-I // g.block_n), 1, 1),
        (x, gate_up_weight_descriptor(w1, g.block_n, g.block_k, interleaved) if tma else w1,
         x if w1_bias is None else w1_bias, h, h if h_grads is None else h_grads,
         layout.sorted_pairs, layout.block_expert, layout.block_rows,
         layout.num_blocks, H, I, top_k, int(h_grads is not None), x.stride(0), w1.stride(0), w1.stride(1),
         w1.stride(2), 0 if w1_bias is None else w1_bias.stride(0),
         activation, cfg.block_m, g.block_n, g.block_k, g.group_m, tma, w1_bias is not None, interleaved, cfg.pdl),
        num_warps=g.num_warps, num_stages=g.num_stages, device_index=device_index, **launch_options(cfg.pdl))


def launch_down(key, cfg: configs.ExpertsConfig, layout: routing.PairLayout, h, w2, y, topk_weights,
                device_index, w2_bias=None) -> None:
    """y (T * top_k, H): row p = topk_weights[p] * (h[row of p] @ w2[e].T (+ w2_bias[e])).
    Biased calls run the pointer path (the builds of the biased kernel); where the configuration's
    gluon_down_stages asks and the call suits it, the Gluon kernel of `_kernels/forward_gluon.py`."""
    d = cfg.down
    H, I = y.shape[1], h.shape[1]
    tma = cfg.tma and w2_bias is None and tma_capable(h) and tma_addressable(h, w2)
    if tma and cfg.gluon_down_stages and gluon_down_suits(cfg, h, w2):
        E = w2.shape[0]
        fg = forward_gluon
        _DOWN_GLUON.launch(
            key, (min(layout.num_blocks * -(-H // fg.BLOCK_N.value), info_for(h).sm_count), 1, 1),
            (gluon_descriptor(h, fg.TILE_M.value, fg.BLOCK_K.value),
             gluon_descriptor(w2.view(E * H, I), fg.BLOCK_N.value, fg.BLOCK_K.value), y, topk_weights,
             layout.sorted_pairs, layout.block_expert, layout.block_rows, layout.num_blocks, H, I, d.group_m,
             cfg.gluon_down_stages),
            num_warps=4, num_stages=1, device_index=device_index)
        return
    _DOWN.launch(
        launch_key_with_tma(key, tma), (layout.num_blocks * -(-H // d.block_n), 1, 1),
        (tma_descriptor(h, (cfg.block_m, d.block_k)) if tma else h,
         tma_descriptor(w2, (1, d.block_n, d.block_k)) if tma else w2, y if w2_bias is None else w2_bias, y,
         topk_weights, layout.sorted_pairs, layout.block_expert, layout.block_rows, layout.num_blocks,
         H, I, w2.stride(0), w2.stride(1), w2.stride(2), 0 if w2_bias is None else w2_bias.stride(0), cfg.block_m,
         d.block_n, d.block_k, d.group_m, tma, w2_bias is not None, cfg.pdl),
        num_warps=d.num_warps, num_stages=d.num_stages, device_index=device_index, **launch_options(cfg.pdl))


def gluon_down_suits(cfg: configs.ExpertsConfig, h, w2) -> bool:
    """Whether `forward_gluon.down_gluon_kernel` can run a down GEMM whose operands TMA can address:
    an sm90 GPU (not the interpreter), the layout in blocks of its TILE_M rows, 16-bit, w2
    contiguous (viewed as (E * H, I))."""
    return (h.is_cuda and not interpreter_active() and info_for(h).hopper
            and cfg.block_m == forward_gluon.TILE_M.value and h.element_size() == 2 and w2.is_contiguous())


def launch_combine(key, y, topk_ids, out, num_experts: int, device_index, pdl: bool = False) -> None:
    """out (T, H) = sum over j of y[t * top_k + j], skipping ids outside [0, num_experts); y
    (splits, T * top_k, H) or (T * top_k, H): a down GEMM's K splits' partial rows, added after
    each j. With `pdl`, as a programmatic dependent of the down GEMM."""
    T, H = out.shape
    splits = y.shape[0] if y.dim() == 3 else 1
    _COMBINE.launch(
        (key, pdl, splits), (-(-T // configs.COMBINE_BLOCK_T), -(-H // configs.COMBINE_BLOCK_H), 1),
        (y, topk_ids, out, T, num_experts, H, topk_ids.shape[1], splits, configs.COMBINE_BLOCK_T,
         configs.COMBINE_BLOCK_H, pdl),
        num_warps=configs.COMBINE_WARPS, num_stages=configs.COMBINE_STAGES, device_index=device_index,
        **launch_options(pdl))


def gather_sum(rows: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """out (T, H) in rows' dtype: out[t] = sum over j of rows[index[t, j]], accumulated in fp32 in
    the order j = 0, 1, ... (deterministic); an index outside [0, N) adds nothing. rows (N, H);
    index (T, m) int64, any strides. One kernel, reading each named row once."""
    if rows.stride(1) != 1 and rows.shape[1] > 1:
        rows = rows.contiguous()
    if index.dtype != torch.int64:
        index = index.long()
    (T, m), (N, H) = index.shape, rows.shape
    out = torch.empty(T, H, dtype=rows.dtype, device=rows.device)
    if T and H:
        key = (rows.dtype, H, rows.data_ptr() % 16, index.data_ptr() % 16, out.data_ptr() % 16)
        _GATHER_SUM.launch(
            key, (-(-T // configs.COMBINE_BLOCK_T), -(-H // configs.COMBINE_BLOCK_H), 1),
            (rows, index, out, T, N, H, rows.stride(0), index.stride(0), index.stride(1), m,
             configs.COMBINE_BLOCK_T, configs.COMBINE_BLOCK_H),
            num_warps=configs.COMBINE_WARPS, num_stages=configs.COMBINE_STAGES, device_index=rows.device.index)
    return out


def _run_gate_up(plan: _ExpertsPlan, x, w1, layout, activation, h_grads=None, w1_bias=None, interleaved=False):
    """Launches gate/up (also storing the activation's derivatives in `h_grads` when given); returns
    h (layout rows, I) in x's dtype."""
    h = routing.allocate((layout.num_blocks * plan.config.block_m, plan.inter), x.dtype, x.device)
    launch_gate_up(plan.launch_key, plan.config, layout, x, w1, h, plan.top_k, activation, plan.device_index, h_grads,
                   w1_bias, interleaved)
    return h


def _run_down(plan: _ExpertsPlan, h, w2, topk_weights, topk_ids, layout, w2_bias=None):
    """Launches down and combine over the layout's h; returns out (T, H) in h's dtype."""
    y = routing.allocate((plan.dispatch.num_pairs, plan.hidden), h.dtype, h.device)
    out = routing.allocate((plan.num_tokens, plan.hidden), h.dtype, h.device)
    launch_down(plan.launch_key, plan.config, layout, h, w2, y, topk_weights, plan.device_index, w2_bias)
    launch_combine(plan.launch_key, y, topk_ids, out, plan.num_experts, plan.device_index, plan.config.pdl)
    return out


def _run_experts(plan: _ExpertsPlan, x, w1, w2, topk_weights, topk_ids, layout, activation, w1_bias=None,
                 w2_bias=None, interleaved=False):
    """The lean forward's expert launches: gate/up, down and combine; out (T, H) in x's dtype."""
    h = _run_gate_up(plan, x, w1, layout, activation, None, w1_bias, interleaved)
    return _run_down(plan, h, w2, topk_weights, topk_ids, layout, w2_bias)


def _moe_key(hidden_states, w1, w2, router_logits, top_k, renormalize, activation, scoring) -> tuple:
    return ("moe", tensor_key(hidden_states), tensor_key(w1), tensor_key(w2), tensor_key(router_logits),
            top_k, renormalize, activation, scoring)


_EXPERTS_PLANS = PlanCache()
_MOE_PLANS = PlanCache()


def _check_routing_tensors(hidden_states, topk_weights, topk_ids, num_experts) -> None:
    _check_tensor("topk_weights", topk_weights, 2, "(T, top_k)")
    _check_tensor("topk_ids", topk_ids, 2, "(T, top_k)")
    if topk_weights.dtype not in routing.FLOAT_DTYPES:
        raise TypeError(f"topk_weights has dtype {topk_weights.dtype}; supported: float16, bfloat16, float32")
    if topk_ids.dtype not in _ID_DTYPES:
        raise TypeError(f"topk_ids has dtype {topk_ids.dtype}; supported: int32, int64")
    T = hidden_states.shape[0]
    if topk_ids.shape[0] != T or topk_weights.shape != topk_ids.shape:
        raise ValueError(f"topk_weights {tuple(topk_weights.shape)} and topk_ids {tuple(topk_ids.shape)} must "
                         f"both be (T, top_k) with T = {T} (hidden_states)")
    for name, t in (("topk_weights", topk_weights), ("topk_ids", topk_ids)):
        if t.device != hidden_states.device:
            raise ValueError(f"{name} is on {t.device}; it must be on hidden_states' device ({hidden_states.device})")
    routing.check_top_k(topk_ids.shape[1], num_experts)


def _new_experts_plan(key, hidden_states, w1, w2, topk_weights, topk_ids, activation) -> _ExpertsPlan:
    """Checks a call of `fused_experts` (or its saving forward) and caches its plan under `key`."""
    _check_experts_args(hidden_states, w1, w2, activation)
    _check_routing_tensors(hidden_states, topk_weights, topk_ids, w1.shape[0])
    return _EXPERTS_PLANS.remember(key, _ExpertsPlan(key, hidden_states, w1, w2, topk_ids.shape[1]))


def _check_biases(hidden_states, w1, w1_bias, w2_bias) -> None:
    """The expert biases of a 16-bit or fp32 `fused_experts` call."""
    E, two_i, _ = w1.shape
    H = hidden_states.shape[1]
    for name, t, shape in (("w1_bias", w1_bias, (E, two_i)), ("w2_bias", w2_bias, (E, H))):
        if t is None:
            continue
        _check_tensor(name, t, 2, f"(E, {'2*I' if name == 'w1_bias' else 'H'})")
        if tuple(t.shape) != shape:
            raise ValueError(f"{name} has shape {tuple(t.shape)}; expected {shape} from w1 and hidden_states")
        if t.dtype != hidden_states.dtype or t.device != hidden_states.device:
            raise TypeError(f"{name} must have hidden_states' dtype and device ({hidden_states.dtype} on "
                            f"{hidden_states.device}), got {t.dtype} on {t.device}")


def _contiguous_rows(t):
    """`t` (None, or 2-D) with unit stride along its last dimension, as the kernels read biases."""
    return t if t is None or t.stride(1) == 1 else t.contiguous()


def fused_experts(hidden_states, w1, w2, topk_weights, topk_ids, *, activation="silu", w1_scale=None, w2_scale=None,
                  block_shape=None, w1_bias=None, w2_bias=None, gate_up_interleaved=False):
    """The experts of an MoE layer for given routing, in fused Triton kernels; differentiable in
    hidden_states, w1, w2 and topk_weights.

    out[t] = sum_j topk_weights[t, j] * w2[e] @ (act(w1[e, :I] @ x_t) * (w1[e, I:] @ x_t)),
    e = topk_ids[t, j]; with expert biases, gate and up are w1[e] @ x_t + w1_bias[e] and w2_bias[e]
    is added to each expert's output before its routing weight scales it (gpt-oss's experts).

    Args:
        hidden_states: (T, H) float16, bfloat16 or float32 (fp32 products follow torch's
            float32 matmul precision: 3xTF32 at "highest", PyTorch's default, else TF32); any row
            stride.
        w1: (E, 2*I, H), hidden_states' dtype: rows [0, I) are the gate projection, rows
            [I, 2I) the up projection.
        w2: (E, H, I), hidden_states' dtype: the down projection.
        topk_weights: (T, top_k) float32 (float16 and bfloat16 are converted to float32 first).
        topk_ids: (T, top_k) int32 or int64. An id outside [0, E), of either dtype and of any
            magnitude, drops that slot: it contributes nothing (as for experts held by another
            rank), never another expert's output.
        activation: "silu" (SwiGLU), "gelu" (GeGLU, with the tanh approximation of GELU) or
            "swiglu_oai" (gpt-oss's: (clamp(up, -7, 7) + 1) * g * sigmoid(1.702 g), g = min(gate, 7)).
        w1_scale, w2_scale, block_shape: FP8 weights (inference): w1 and w2 in
            torch.float8_e4m3fn with float32 scales per 128 x 128 block (block_shape=(128, 128);
            (E, 2I / 128, H / 128) and (E, H / 128, I / 128)) or per output channel
            (block_shape=None; (E, 2I) and (E, H)), as vLLM's fused_moe takes them; hidden_states
            float16 or bfloat16, quantised per token and 128 columns on the fly; H and I
            multiples of 128; compute capability 8.9 or newer (see `fp8.py`). Not differentiable.

        w1_bias: (E, 2I) in w1's row order, and w2_bias: (E, H), hidden_states' dtype, or None.
        gate_up_interleaved: w1's (and w1_bias') rows alternate gate, up, gate, ... instead of
            gate rows then up rows (gpt-oss's layout).

    E from 1 to 256, top_k from 1 to min(E, 8); H and I multiples of 16. The weights are read in
    place, forward and backward, with unit stride along their last dimension or along their
    middle one (views of weights stored transposed, (E, H, 2I) and (E, I, H), as transformers
    stores gpt-oss's), and their gradients come back in the same layout; other layouts are
    copied first.

    Returns:
        out: (T, H) in hidden_states' dtype; (0, H) when T = 0. The result is deterministic: a
        token's k expert outputs are summed in fp32 in the order j = 0..k-1.

    Gradients: when autograd records and an input requires grad, eager or compiled, the call
    runs the custom ops `flashmoe_science::moe_experts_gate_up` and `moe_experts_down`, which also
    keep the layout, h and the activation's derivatives for the backward kernels (see backward.py for what is
    stored and what is recomputed). Gradients of topk_weights come back in its dtype; dropped
    slots get zero. Other calls take the lean path, which stores nothing; under torch.compile,
    through the custom op `flashmoe_science::moe_experts` (FP8 weights too).
    """
    if gate_up_interleaved is not False and gate_up_interleaved is not True:
        raise TypeError(f"gate_up_interleaved must be a bool, got {type(gate_up_interleaved).__name__}")
    fp8_weights = w1_scale is not None or w2_scale is not None or getattr(w1, "dtype", None) == fp8.FP8_DTYPE
    gpt_oss_form = w1_bias is not None or w2_bias is not None or gate_up_interleaved
    if torch.compiler.is_compiling() and not routing.needs_gradient(hidden_states, w1, w2, topk_weights, w1_bias,
                                                                     w2_bias):
        return _inference_op(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_scale, w2_scale,
                             block_shape, fp8_weights, w1_bias, w2_bias, gate_up_interleaved)
    if fp8_weights:
        if gpt_oss_form:
            raise ValueError("FP8 experts take no w1_bias, w2_bias or gate_up_interleaved")
        return _fp8_experts(hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, block_shape,
                            activation)
    if block_shape is not None:
        raise ValueError(NO_BLOCK_SHAPE)
    if routing.records_autograd(hidden_states, w1, w2, topk_weights, w1_bias, w2_bias):
        _check_experts_args(hidden_states, w1, w2, activation)
        _check_biases(hidden_states, w1, w1_bias, w2_bias)
        _check_routing_tensors(hidden_states, topk_weights, topk_ids, w1.shape[0])
        return _experts_op(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias, w2_bias,
                           gate_up_interleaved)
    try:
        key = ("experts", tensor_key(hidden_states), tensor_key(w1), tensor_key(w2), tensor_key(topk_weights),
               tensor_key(topk_ids), activation, None if w1_bias is None else tensor_key(w1_bias),
               None if w2_bias is None else tensor_key(w2_bias), gate_up_interleaved)
        plan = _EXPERTS_PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable option: the checks name it
        _check_experts_args(hidden_states, w1, w2, activation)
        _check_biases(hidden_states, w1, w1_bias, w2_bias)
        _check_routing_tensors(hidden_states, topk_weights, topk_ids, w1.shape[0])
        raise
    if plan is None:
        _check_biases(hidden_states, w1, w1_bias, w2_bias)
        plan = _new_experts_plan(key, hidden_states, w1, w2, topk_weights, topk_ids, activation)
    x, w1, w2 = plan.operands(hidden_states, w1, w2)
    if plan.num_tokens == 0:
        return x.new_empty((0, plan.hidden))
    if topk_weights.dtype != torch.float32 or not topk_weights.is_contiguous():
        topk_weights = topk_weights.to(torch.float32).contiguous()
    if topk_ids.dtype != torch.int32 or not topk_ids.is_contiguous():
        topk_ids = routing.ids_int32(topk_ids, plan.num_experts)
    layout = routing.align_pairs(topk_ids, plan.dispatch, plan.launch_key)
    return _run_experts(plan, x, w1, w2, topk_weights, topk_ids, layout, activation, _contiguous_rows(w1_bias),
                        _contiguous_rows(w2_bias), gate_up_interleaved)


def _inference_op(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_scale, w2_scale, block_shape,
                  fp8_weights: bool, w1_bias=None, w2_bias=None, gate_up_interleaved=False):
    """`fused_experts` traced by torch.compile with no gradient wanted: the arguments checked as far
    as shapes and dtypes tell, then one `flashmoe_science::moe_experts` op."""
    if fp8_weights:
        fp8.check_fp8_args(hidden_states, w1, w2, w1_scale, w2_scale, block_shape, activation)
    elif block_shape is not None:
        raise ValueError(NO_BLOCK_SHAPE)
    else:
        _check_experts_args(hidden_states, w1, w2, activation)
        _check_biases(hidden_states, w1, w1_bias, w2_bias)
    _check_routing_tensors(hidden_states, topk_weights, topk_ids, w1.shape[0])
    return torch.ops.flashmoe_science.moe_experts(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_scale,
                                                  w2_scale, None if block_shape is None else list(block_shape),
                                                  w1_bias, w2_bias, gate_up_interleaved)


def _fp8_experts(hidden_states, w1, w2, topk_weights, topk_ids, w1_scale, w2_scale, block_shape, activation):
    """`fused_experts` with FP8 weights (fp8.py): checked once per shape, scales every call."""
    if routing.needs_gradient(hidden_states, topk_weights):
        raise RuntimeError("FP8 experts are for inference: call them under torch.no_grad() (hidden_states or "
                           "topk_weights requires grad)")
    try:
        key = ("experts_fp8", tensor_key(hidden_states), tensor_key(w1), tensor_key(w2), tensor_key(topk_weights),
               tensor_key(topk_ids), tensor_key(w1_scale), tensor_key(w2_scale),
               None if block_shape is None else tuple(block_shape), activation)
    except (AttributeError, TypeError):  # not tensors, or an unhashable option: the checks name it
        fp8.check_fp8_args(hidden_states, w1, w2, w1_scale, w2_scale, block_shape, activation)
        raise
    plan = fp8.PLANS.get(key)
    if plan is None:
        fp8.check_fp8_args(hidden_states, w1, w2, w1_scale, w2_scale, block_shape, activation)
        _check_routing_tensors(hidden_states, topk_weights, topk_ids, w1.shape[0])
        plan = fp8.new_plan(key, hidden_states, w1, w2, topk_ids.shape[1], block_shape)
    return _run_fp8(plan, hidden_states, w1, w2, w1_scale, w2_scale, activation,
                    lambda: _fp8_routing_from_ids(plan, topk_weights, topk_ids))


def _fp8_routing_from_ids(plan, topk_weights, topk_ids):
    """(weights fp32, ids int32, layout) of a caller's routing, as the FP8 kernels read them."""
    ids = routing.ids_int32(topk_ids, plan.num_experts)
    return topk_weights.to(torch.float32).contiguous(), ids, routing.align_pairs(ids, plan.dispatch, plan.launch_key)


def _run_fp8(plan, hidden_states, w1, w2, w1_scale, w2_scale, activation, route):
    """The FP8 experts of a planned call; `route()` gives (weights, ids, layout)."""
    fp8.check_scales_finite(w1_scale, w2_scale)
    if plan.num_tokens == 0:
        return hidden_states.new_empty((0, plan.hidden))
    x = hidden_states if hidden_states.stride(1) == 1 else hidden_states.contiguous()
    w1, w2, w1_scale, w2_scale = (t if t.stride(-1) == 1 else t.contiguous() for t in (w1, w2, w1_scale, w2_scale))
    weights, ids, layout = route()
    return fp8.run_fp8_experts(plan, x, w1, w2, w1_scale, w2_scale, weights, ids, layout, activation)


def _fp8_moe(hidden_states, w1, w2, router_logits, top_k, renormalize, activation, scoring, w1_scale, w2_scale,
             block_shape):
    """`fused_moe` with FP8 weights, without gradients, eager: one plan for the whole layer and the
    routing launch building the layout itself (decode: one launch), as the 16-bit lean path."""
    try:
        key = ("moe_fp8", tensor_key(hidden_states), tensor_key(w1), tensor_key(w2), tensor_key(router_logits),
               tensor_key(w1_scale), tensor_key(w2_scale), top_k, renormalize, activation, scoring,
               None if block_shape is None else tuple(block_shape))
        plan = fp8.PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable option: the checks name it
        fp8.check_fp8_args(hidden_states, w1, w2, w1_scale, w2_scale, block_shape, activation)
        _check_router_args(hidden_states, router_logits, top_k, w1.shape[0], renormalize, scoring)
        raise
    if plan is None:
        fp8.check_fp8_args(hidden_states, w1, w2, w1_scale, w2_scale, block_shape, activation)
        _check_router_args(hidden_states, router_logits, top_k, w1.shape[0], renormalize, scoring)
        plan = fp8.new_plan(key, hidden_states, w1, w2, top_k, block_shape)
    else:  # as `fused_moe`'s cached path: the key compares top_k=2.0 equal to 2
        routing.check_top_k(top_k, plan.num_experts)
        routing.check_routing_options(renormalize, scoring)
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    return _run_fp8(plan, hidden_states, w1, w2, w1_scale, w2_scale, activation,
                    lambda: routing.route_pairs(router_logits, plan.dispatch, plan.launch_key,
                                                sigmoid=scoring == "sigmoid", renormalize=renormalize,
                                                with_layout=True))


def _experts_op(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias=None, w2_bias=None,
                interleaved=False):
    """fused_experts through the differentiable custom ops (arguments already checked): the
    routing weights as fp32 and the ids as int32, contiguous, as the kernels read them (the
    conversion of the weights is itself differentiable). The kernels read w1 and w2 where they
    lie, forward and backward, gate/up rows interleaved or not, and write their gradients in
    the same layout. w2_bias is added as the routed sum of its rows (`_routed_bias`), through
    which autograd takes its gradient and its part of the routing weights'."""
    weights = topk_weights.to(torch.float32).contiguous()
    ids = routing.ids_int32(topk_ids, w1.shape[0])
    out = _experts_with_backward(hidden_states, w1, w2, weights, ids, activation, w1_bias, interleaved)
    if w2_bias is None:
        return out
    return (out.float() + _routed_bias(weights, ids, w2_bias)).to(out.dtype)


def _routed_bias(weights, ids, bias):
    """(T, H) fp32: sum_j weights[t, j] * bias[ids[t, j]], ids outside [0, E) contributing nothing;
    each token's weights gathered per expert in a fixed order (deterministic), then one product."""
    E = bias.shape[0]
    slots = torch.where((ids >= 0) & (ids < E), ids, E).long()
    per_expert = (torch.nn.functional.one_hot(slots, E + 1).to(weights.dtype) * weights[..., None]).sum(1)
    return per_expert[:, :E] @ bias.float()


def saved_layout_size(hidden_states, w1, top_k: int) -> tuple[int, int]:
    """(BLOCK_M, number of blocks) of the layout `gate_up_for_backward` returns for these inputs
    (from shapes alone: the custom op's fake implementation allocates by it)."""
    T, H = hidden_states.shape
    E, two_i, _ = w1.shape
    cfg = configs.experts_config(info_for(hidden_states), hidden_states.element_size(), T, top_k, E, H, two_i // 2)
    return cfg.block_m, routing.layout_blocks(T * top_k, E, cfg.block_m)


def _saving_plan(name, hidden_states, w1, w2, topk_weights, topk_ids, activation=None, w1_bias=None,
                 interleaved=False) -> _ExpertsPlan:
    """The plan of a custom op's half of the saving forward, cached under its own key (the
    activation, w1_bias and the gate/up row order checked where they apply: the gate/up half)."""
    key = (name, tensor_key(hidden_states), tensor_key(w1), tensor_key(w2), tensor_key(topk_weights),
           tensor_key(topk_ids), activation, None if w1_bias is None else tensor_key(w1_bias), interleaved)
    plan = _EXPERTS_PLANS.get(key)
    if plan is None:
        if w1_bias is not None:  # checked before a plan is cached under the key it is part of
            _check_experts_args(hidden_states, w1, w2, activation)
            _check_biases(hidden_states, w1, w1_bias, None)
        plan = _new_experts_plan(key, hidden_states, w1, w2, topk_weights, topk_ids, activation)
    return plan


def gate_up_for_backward(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias=None,
                         interleaved=False):
    """The first half of `fused_experts`' forward, keeping what its backward needs: routing's
    layout and the gate/up GEMM.

    Args as for `fused_experts`, except topk_weights: (T, top_k) float32 and topk_ids:
    (T, top_k) int32, both contiguous (w2 and topk_weights only size the plan); w1's rows (and
    w1_bias') gate then up, or alternating with `interleaved`.

    Returns:
        (h (rows, I), h_grads (rows, 2I), sorted_pairs (rows,) int32, block_expert (blocks,)
        int32, block_rows (blocks,) int32). h and h_grads are in hidden_states' dtype; h is the
        down GEMM's input and h_grads the activation's local derivatives [dh/dgate, dh/dup],
        both in layout order and zero on padding rows; rows = blocks * BLOCK_M
        (`saved_layout_size`).
    """
    plan = _saving_plan("experts_gate_up", hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias,
                        interleaved)
    x, w1, _ = plan.operands(hidden_states, w1, w2)
    if plan.num_tokens == 0:
        return (x.new_empty((0, plan.inter)), x.new_empty((0, 2 * plan.inter)),
                *(topk_ids.new_empty((0,)) for _ in range(3)))
    layout = routing.align_pairs(topk_ids, plan.dispatch, plan.launch_key)
    h_grads = routing.allocate((layout.num_blocks * layout.block_m, 2 * plan.inter), x.dtype, x.device)
    h = _run_gate_up(plan, x, w1, layout, activation, h_grads, _contiguous_rows(w1_bias), interleaved)
    return h, h_grads, layout.sorted_pairs, layout.block_expert, layout.block_rows


def down_for_backward(hidden_states, w1, w2, topk_weights, topk_ids, h, sorted_pairs, block_expert, block_rows):
    """The second half of `fused_experts`' forward: the down GEMM and the combine over the
    layout and h of `gate_up_for_backward` (hidden_states and w1 only size the plan); out (T, H)."""
    plan = _saving_plan("experts_down", hidden_states, w1, w2, topk_weights, topk_ids)
    _, _, w2 = plan.operands(hidden_states, w1, w2)
    if plan.num_tokens == 0:
        return h.new_empty((0, plan.hidden))
    layout = routing.PairLayout(sorted_pairs, block_expert, block_rows, plan.config.block_m, block_expert.numel())
    return _run_down(plan, h, w2, topk_weights, topk_ids, layout)


def _experts_with_backward(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias=None,
                           interleaved=False):
    """`fused_experts` through its two saving custom ops (ops.py): gate/up, then down. Two
    autograd nodes, so the backward frees what the down half kept (h and the activation's
    derivatives) before the gate/up half's weight gradient is allocated; the down half's eager
    backward writes its gradients over them (nothing else reads them)."""
    from . import ops
    saved = ops.experts_gate_up(hidden_states, w1, w2, topk_weights, topk_ids, activation, w1_bias, interleaved)
    return ops.experts_down(hidden_states, w1, w2, topk_weights, topk_ids, *saved, interleaved,
                            activation=activation, w1_bias=w1_bias)


def fused_moe(hidden_states, w1, w2, router_logits, top_k, *, renormalize=True, activation="silu",
              scoring="softmax", w1_scale=None, w2_scale=None, block_shape=None):
    """A whole MoE layer (routing, dispatch, experts, combine) in fused Triton kernels.

    p = softmax(router_logits in fp32) (or sigmoid with scoring="sigmoid"); (w, e) = top_k(p);
    if renormalize: w /= sum(w); out[t] = sum_j w[t, j] * w2[e_j] @ (act(w1[e_j, :I] @ x_t) *
    (w1[e_j, I:] @ x_t)).

    Args:
        hidden_states: (T, H) float16, bfloat16 or float32 (fp32 products as in `fused_experts`).
        w1: (E, 2*I, H) and w2: (E, H, I), hidden_states' dtype (see `fused_experts`).
        router_logits: (T, E) float16, bfloat16 or float32, any dtype of the three.
        top_k: experts per token, 1 <= top_k <= min(E, 8).
        renormalize, scoring: as in `moe_route` (ties between equal scores: lower expert first).
        activation: "silu" (SwiGLU), "gelu" (GeGLU, tanh approximation) or "swiglu_oai" (gpt-oss's
            clamped SwiGLU, as in `fused_experts`).
        w1_scale, w2_scale, block_shape: FP8 weights for inference, as in `fused_experts`.

    Returns:
        out: (T, H) in hidden_states' dtype, deterministic; (0, H) when T = 0.

    Differentiable in hidden_states, w1, w2 and router_logits: with autograd recording (or
    under torch.compile) the call is `moe_route` then `fused_experts`, each through its custom
    op, and router_logits receive the gradient of the routing weights (see `moe_route`).
    """
    if w1_scale is not None or w2_scale is not None or getattr(w1, "dtype", None) == fp8.FP8_DTYPE:
        if not routing.records_autograd(hidden_states, router_logits):
            return _fp8_moe(hidden_states, w1, w2, router_logits, top_k, renormalize, activation, scoring, w1_scale,
                            w2_scale, block_shape)
        weights, ids = routing.moe_route(router_logits, top_k, renormalize=renormalize, scoring=scoring)
        return fused_experts(hidden_states, w1, w2, weights, ids, activation=activation, w1_scale=w1_scale,
                             w2_scale=w2_scale, block_shape=block_shape)
    if block_shape is not None:
        raise ValueError(NO_BLOCK_SHAPE)
    if routing.records_autograd(hidden_states, w1, w2, router_logits):
        _check_moe_args(hidden_states, w1, w2, router_logits, top_k, renormalize, activation, scoring)
        from . import ops
        weights, ids = ops.route(router_logits, top_k, renormalize, scoring)
        if not routing.needs_gradient(hidden_states, w1, w2, router_logits):  # compiled inference
            return torch.ops.flashmoe_science.moe_experts(hidden_states, w1, w2, weights, ids, activation, None, None,
                                                          None)
        return _experts_with_backward(hidden_states, w1, w2, weights, ids, activation)
    try:
        key = _moe_key(hidden_states, w1, w2, router_logits, top_k, renormalize, activation, scoring)
        plan = _MOE_PLANS.get(key)
    except (AttributeError, TypeError):  # not tensors, or an unhashable option: the checks name it
        _check_moe_args(hidden_states, w1, w2, router_logits, top_k, renormalize, activation, scoring)
        raise
    if plan is None:
        _check_moe_args(hidden_states, w1, w2, router_logits, top_k, renormalize, activation, scoring)
        plan = _MOE_PLANS.remember(key, _ExpertsPlan(key, hidden_states, w1, w2, top_k))
    else:  # the key compares top_k=2.0 equal to 2 and renormalize=1 equal to True: types checked every call
        routing.check_top_k(top_k, plan.num_experts)
        routing.check_routing_options(renormalize, scoring)
    return _moe_forward(plan, hidden_states, w1, w2, router_logits, renormalize, activation, scoring)


def _moe_forward(plan: _ExpertsPlan, hidden_states, w1, w2, router_logits, renormalize, activation, scoring):
    x, w1, w2 = plan.operands(hidden_states, w1, w2)
    if plan.num_tokens == 0:
        return x.new_empty((0, plan.hidden))
    if router_logits.stride(1) != 1:
        router_logits = router_logits.contiguous()
    weights, ids, layout = routing.route_pairs(router_logits, plan.dispatch, plan.launch_key,
                                               sigmoid=scoring == "sigmoid", renormalize=renormalize, with_layout=True)
    return _run_experts(plan, x, w1, w2, weights, ids, layout, activation)


def _check_moe_args(hidden_states, w1, w2, router_logits, top_k, renormalize, activation, scoring) -> None:
    _check_experts_args(hidden_states, w1, w2, activation)
    _check_router_args(hidden_states, router_logits, top_k, w1.shape[0], renormalize, scoring)


def _check_router_args(hidden_states, router_logits, top_k, num_experts, renormalize, scoring) -> None:
    """router_logits (T, E) on hidden_states' device and the routing options (the expert weights
    checked apart: 16-bit or FP8)."""
    routing.check_router_logits(router_logits)
    if router_logits.device != hidden_states.device:
        raise ValueError(f"router_logits is on {router_logits.device}; it must be on hidden_states' device "
                         f"({hidden_states.device})")
    T, E = hidden_states.shape[0], num_experts
    if tuple(router_logits.shape) != (T, E):
        raise ValueError(f"router_logits has shape {tuple(router_logits.shape)}; expected (T, E) = {(T, E)} "
                         "from hidden_states and w1")
    routing.check_top_k(top_k, E)
    routing.check_routing_options(renormalize, scoring)


def describe(hidden_states: torch.Tensor, w1: torch.Tensor, top_k: int) -> dict:
    """Which path and configuration a call with these inputs runs (for benchmarks and reports)."""
    T, H = hidden_states.shape
    E, two_i, _ = w1.shape
    cfg = configs.experts_config(info_for(hidden_states), hidden_states.element_size(), T, top_k, E, H, two_i // 2)
    return {"path": configs.path_name(T), "config": str(cfg)}


def _median_call_ms(fn) -> float:
    """Median time of fn in ms: CUDA events on the GPU, the host clock in the interpreter."""
    fn()
    if torch.cuda.is_available():
        from triton.testing import do_bench

        return do_bench(fn, warmup=25, rep=100, return_mode="median")
    times = []
    for _ in range(3):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    return sorted(times)[1]


def tune(hidden_states, w1, w2, router_logits, top_k, *, renormalize=True, activation="silu", scoring="softmax"):
    """The autotuned fallback: times `fused_moe` on these inputs with each configuration the
    table holds for this device family and dtype, and makes the fastest the choice for every
    later call with the same E, H, I and top_k whose load (T * top_k / E) falls in the same
    bucket of the table. Cached for the process. It times kernels, so it must not run while a
    CUDA graph is being captured: tune first, then capture. Arguments as for `fused_moe`.

    Returns:
        the chosen configs.ExpertsConfig.
    """
    _check_moe_args(hidden_states, w1, w2, router_logits, top_k, renormalize, activation, scoring)
    device = info_for(hidden_states)
    element_size = hidden_states.element_size()
    (T, H), (E, two_i, _) = hidden_states.shape, w1.shape
    table = configs.EXPERTS[device.arch_family][element_size]
    key = _moe_key(hidden_states, w1, w2, router_logits, top_k, renormalize, activation, scoring)
    timings = {}
    for cfg in dict.fromkeys(cfg for _, cfg in table):
        plan = _ExpertsPlan(key, hidden_states, w1, w2, top_k, cfg)
        timings[cfg] = _median_call_ms(functools.partial(
            _moe_forward, plan, hidden_states, w1, w2, router_logits, renormalize, activation, scoring))
    best = min(timings, key=timings.get)
    bound = configs.load_bound(table, T, top_k, E)
    configs.TUNED[(device.arch_family, element_size, E, H, two_i // 2, top_k, bound)] = best
    _MOE_PLANS.clear()  # plans made before hold the table's choice
    _EXPERTS_PLANS.clear()
    return best
