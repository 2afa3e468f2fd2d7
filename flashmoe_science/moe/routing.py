"""Routing and GPU dispatch: top-k over router scores, and the expert-sorted layout of the
token-expert pairs that the expert GEMMs read.

`moe_route` is the public routing function. `route_pairs` and `align_pairs` are the dispatch
steps `fused_moe` and `fused_experts` run: one to three Triton launches (see
`_kernels/dispatch.py`) sized from shapes alone, with no host synchronisation and no
data-dependent output shapes, so a whole MoE layer can be captured in a CUDA graph.
`route_backward` is the gradient of the routing weights with respect to the logits, one launch
(as torch ops it was about fifteen launches, each costing host time that small training calls
are bound by).

Every buffer the MoE launchers allocate comes from `allocate`, so a test can fill them with
poison to prove that every element a kernel reads was written first.
"""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..device import check_runnable
from ..launch import KernelLauncher, PlanCache
from . import configs
from ._kernels.dispatch import align_pairs_kernel, count_pairs_kernel, route_backward_kernel, route_kernel

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
SCORINGS = ("softmax", "sigmoid")

def tensor_key(t: torch.Tensor) -> tuple:
    """What a tensor contributes to a plan or launch key: everything Triton specialises on."""
    return t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16


_ROUTE = KernelLauncher("moe_route", route_kernel)
_ROUTE_BACKWARD = KernelLauncher("moe_route_backward", route_backward_kernel)
_COUNT = KernelLauncher("moe_count", count_pairs_kernel)
_ALIGN = KernelLauncher("moe_align", align_pairs_kernel)


def allocate(shape, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialised buffer for a kernel to write."""
    return torch.empty(shape, dtype=dtype, device=device)


class PairLayout(NamedTuple):
    """The expert-sorted, block-aligned layout of the token-expert pairs.

    sorted_pairs: (num_blocks * block_m,) int32. Pair p = t * top_k + j stands for token t's
        j-th expert. Expert e's pairs sit in increasing p at the start of one contiguous range
        of whole blocks; ranges follow in expert order. Rows past a block's block_rows are
        padding and hold -1.
    block_expert: (num_blocks,) int32, the expert of each block_m-row block, -1 past the last.
    block_rows: (num_blocks,) int32, how many rows of each block hold pairs (0 past the last).
    num_blocks is the upper bound cdiv(T * top_k, block_m) + min(E, T * top_k).
    """

    sorted_pairs: torch.Tensor
    block_expert: torch.Tensor
    block_rows: torch.Tensor
    block_m: int
    num_blocks: int


def layout_blocks(num_pairs: int, num_experts: int, block_m: int) -> int:
    """Blocks of the layout: the bound cdiv(num_pairs, block_m) + min(E, num_pairs) (each expert
    that receives pairs pads its last block)."""
    return -(-num_pairs // block_m) + min(num_experts, num_pairs)


class DispatchPlan:
    """Sizes, chunking and tiles of routing and dispatch for one problem shape (block_m None:
    routing only, no layout). release: the routing launch lets the next kernel, launched as its
    programmatic dependent (`dependent_launch`), start at once."""

    __slots__ = ("num_tokens", "num_experts", "top_k", "num_pairs", "block_m", "num_blocks", "chunk_tokens",
                 "num_chunks", "blocks_per_program", "device_index", "release")

    def __init__(self, num_tokens: int, num_experts: int, top_k: int, block_m: int | None, device: torch.device,
                 release: bool = False):
        self.num_tokens, self.num_experts, self.top_k = num_tokens, num_experts, top_k
        self.num_pairs = num_tokens * top_k
        self.block_m = block_m or 1
        self.num_blocks = layout_blocks(self.num_pairs, num_experts, block_m) if block_m else 0
        self.chunk_tokens = configs.chunk_tokens(num_tokens)
        self.num_chunks = max(1, -(-num_tokens // self.chunk_tokens))
        self.blocks_per_program = -(-self.num_blocks // self.num_chunks)
        self.device_index = device.index if device.type == "cuda" else None
        self.release = release

    def layout_buffers(self, device) -> PairLayout:
        return PairLayout(allocate((self.num_blocks * self.block_m,), torch.int32, device),
                          allocate((self.num_blocks,), torch.int32, device),
                          allocate((self.num_blocks,), torch.int32, device), self.block_m, self.num_blocks)

    def launch_align(self, key, ids: torch.Tensor, counts: torch.Tensor | None, layout: PairLayout) -> None:
        _ALIGN.launch(
            key, (self.num_chunks, 1, 1),
            (ids, ids if counts is None else counts, layout.sorted_pairs, layout.block_expert, layout.block_rows,
             self.num_pairs, self.num_experts, self.block_m, self.chunk_tokens * self.top_k, self.num_chunks,
             self.blocks_per_program, self.num_blocks,
             configs.MAX_EXPERTS, configs.SORT_PAIRS, configs.DISPATCH_ROWS, configs.COUNT_TILE, configs.DISPATCH_ROWS,
             counts is None),
            num_warps=configs.DISPATCH_WARPS, num_stages=configs.DISPATCH_STAGES, device_index=self.device_index)


def route_pairs(router_logits: torch.Tensor, plan: DispatchPlan, key, *, sigmoid: bool, renormalize: bool,
                with_layout: bool):
    """Routes every token; returns (topk_weights (T, k) fp32, topk_ids (T, k) int32, PairLayout or
    None). For small calls (`configs.route_layout`) the routing launch also builds the layout
    (for one token, from its picks without a sort); otherwise it spreads the tokens over many
    programs, and `align_pairs`' launches build the layout. `key` must determine the kernels'
    specialisation (shapes, strides, dtypes, alignment of router_logits)."""
    device = router_logits.device
    weights = allocate((plan.num_tokens, plan.top_k), torch.float32, device)
    ids = allocate((plan.num_tokens, plan.top_k), torch.int32, device)
    mode = configs.route_layout(plan.num_tokens, plan.top_k) if with_layout else "none"
    layout = plan.layout_buffers(device) if mode != "none" else None
    tables = (ids, ids, ids) if layout is None else (layout.sorted_pairs, layout.block_expert, layout.block_rows)
    program_tokens = configs.route_program_tokens(mode, plan.num_tokens)
    expert_pad = configs.route_expert_pad(plan.num_experts)
    _ROUTE.launch(
        key, (max(1, -(-plan.num_tokens // program_tokens)), 1, 1),
        (router_logits, weights, ids, *tables,
         plan.num_tokens, plan.num_experts, router_logits.stride(0), plan.top_k, int(sigmoid), int(renormalize),
         program_tokens, plan.block_m, plan.num_blocks,
         expert_pad, configs.MAX_TOP_K, configs.route_rows(mode, expert_pad), mode,
         configs.SORT_PAIRS, configs.DISPATCH_ROWS, plan.release),
        num_warps=configs.route_warps(mode), num_stages=configs.DISPATCH_STAGES, device_index=plan.device_index)
    if with_layout and mode == "none":
        layout = align_pairs(ids, plan, key)
    return weights, ids, layout


def align_pairs(topk_ids: torch.Tensor, plan: DispatchPlan, key) -> PairLayout:
    """The layout of given topk_ids ((T, k) int32, contiguous): one align launch for a single
    chunk, else a count launch and an align launch."""
    layout = plan.layout_buffers(topk_ids.device)
    counts = None
    if plan.num_chunks > 1:
        counts = allocate((plan.num_chunks, configs.MAX_EXPERTS), torch.int32, topk_ids.device)
        _COUNT.launch(key, (plan.num_chunks, 1, 1),
                      (topk_ids, counts, plan.num_pairs, plan.num_experts, plan.chunk_tokens * plan.top_k,
                       configs.MAX_EXPERTS, configs.COUNT_TILE),
                      num_warps=configs.DISPATCH_WARPS, num_stages=configs.DISPATCH_STAGES,
                      device_index=plan.device_index)
    plan.launch_align(key, topk_ids, counts, layout)
    return layout


def ids_int32(topk_ids: torch.Tensor, num_experts: int) -> torch.Tensor:
    """topk_ids as the kernels read them: int32, contiguous, every id outside [0, num_experts)
    (the slots a caller drops) as -1. An int64 id is mapped before it is narrowed, so that
    2**32 + 3 drops its slot instead of wrapping to expert 3."""
    if topk_ids.dtype == torch.int64:
        topk_ids = topk_ids.masked_fill((topk_ids < 0) | (topk_ids >= num_experts), -1)
    return topk_ids.to(torch.int32).contiguous()


def check_router_logits(router_logits, name: str = "router_logits") -> None:
    if not isinstance(router_logits, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(router_logits).__name__}")
    if router_logits.dim() != 2:
        raise ValueError(f"{name} must be 2-D (T, E), got shape {tuple(router_logits.shape)}")
    if router_logits.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} has dtype {router_logits.dtype}; supported: float16, bfloat16, float32")
    check_runnable(name, router_logits)
    num_experts = router_logits.shape[1]
    if not 1 <= num_experts <= configs.MAX_EXPERTS:
        raise ValueError(f"{name} has E = {num_experts} experts (its last dimension); supported: "
                         f"1 to {configs.MAX_EXPERTS}")


def check_top_k(top_k, num_experts: int) -> None:
    if isinstance(top_k, bool) or not isinstance(top_k, int):
        raise TypeError(f"top_k must be an int, got {type(top_k).__name__}")
    if not 1 <= top_k <= min(num_experts, configs.MAX_TOP_K):
        raise ValueError(f"top_k must be between 1 and min(E, {configs.MAX_TOP_K}) = "
                         f"{min(num_experts, configs.MAX_TOP_K)} for E = {num_experts} experts, got {top_k}")


def check_routing_options(renormalize, scoring) -> None:
    if not isinstance(renormalize, bool):
        raise TypeError(f"renormalize must be a bool, got {type(renormalize).__name__}")
    if scoring not in SCORINGS:
        raise ValueError(f"scoring must be one of {SCORINGS}, got {scoring!r}")


class _RoutePlan:
    __slots__ = ("dispatch", "sigmoid")

    def __init__(self, router_logits, top_k, renormalize, scoring):
        check_router_logits(router_logits)
        check_top_k(top_k, router_logits.shape[1])
        check_routing_options(renormalize, scoring)
        num_tokens, num_experts = router_logits.shape
        if num_tokens * top_k >= 2**31:
            raise ValueError(f"T * top_k = {num_tokens * top_k} pairs; at most 2**31 - 1 are supported")
        self.dispatch = DispatchPlan(num_tokens, num_experts, top_k, None, router_logits.device)
        self.sigmoid = scoring == "sigmoid"


_PLANS = PlanCache()


def needs_gradient(*tensors) -> bool:
    """Whether autograd records and one of `tensors` requires grad."""
    if torch.is_grad_enabled():
        for t in tensors:  # a loop, not any(): this runs on every call of the lean paths
            if getattr(t, "requires_grad", False):
                return True
    return False


def records_autograd(*tensors) -> bool:
    """Whether a call must go through the MoE custom ops (ops.py): torch.compile traces it, or
    autograd records and one of `tensors` requires grad. Other calls take the lean paths."""
    return needs_gradient(*tensors) or torch.compiler.is_compiling()


def moe_route(router_logits, top_k, *, renormalize=True, scoring="softmax"):
    """Top-k routing of each token over E experts, as one Triton kernel; differentiable in
    router_logits (through topk_weights).

    Args:
        router_logits: (T, E) float16, bfloat16 or float32; any row stride, unit column stride.
            E from 1 to 256.
        top_k: experts per token, 1 <= top_k <= min(E, 8).
        renormalize: divide the k chosen weights by their sum.
        scoring: "softmax": p = softmax(logits) over the E experts, in fp32; "sigmoid"
            (DeepSeek-V3): p = sigmoid(logits), in fp32, each expert scored independently.

    Returns:
        (topk_weights, topk_ids): (T, top_k) float32 and (T, top_k) int32, contiguous. Row t
        holds the top_k largest p of token t in decreasing order (equal scores: the lower expert
        index first), with weights p, or p / sum of the k chosen p when renormalize.

    When autograd records (router_logits requires grad) or torch.compile traces, the call goes
    through `ops.route` (the custom op `flashmoe_science::moe_route` under torch.compile), whose
    backward is `route_backward`.
    """
    if records_autograd(router_logits):
        check_router_logits(router_logits)
        check_top_k(top_k, router_logits.shape[1])
        check_routing_options(renormalize, scoring)
        from . import ops
        return ops.route(router_logits, top_k, renormalize, scoring)
    return route(router_logits, top_k, renormalize, scoring)


def route(router_logits, top_k, renormalize, scoring):
    """`moe_route` without autograd: the cached-plan path straight to the kernel."""
    try:
        key = ("route", router_logits.shape, router_logits.stride(), router_logits.dtype, router_logits.device,
               router_logits.data_ptr() % 16, top_k, renormalize, scoring)
        plan = _PLANS.get(key)
    except (AttributeError, TypeError):  # not a tensor, or an unhashable option: the checks name it
        _RoutePlan(router_logits, top_k, renormalize, scoring)
        raise
    if plan is None:
        plan = _RoutePlan(router_logits, top_k, renormalize, scoring)
        _PLANS.remember(key, plan)
    else:  # the key compares top_k=2.0 equal to 2 and renormalize=1 equal to True: types checked every call
        check_top_k(top_k, plan.dispatch.num_experts)
        check_routing_options(renormalize, scoring)
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    dispatch = plan.dispatch
    if dispatch.num_tokens == 0:
        empty = router_logits.new_empty((0, top_k))
        return empty.float(), empty.int()
    weights, ids, _ = route_pairs(router_logits, dispatch, key, sigmoid=plan.sigmoid, renormalize=renormalize,
                                  with_layout=False)
    return weights, ids


def route_backward(grad_weights, router_logits, topk_weights, topk_ids, renormalize: bool, scoring: str):
    """d router_logits (T, E), in router_logits' dtype, from d topk_weights (T, k), for the routing
    `route` made of these logits (its topk_weights and topk_ids): one launch,
    `route_backward_kernel` (whose docstring has the formulas); top-k is piecewise constant, so
    the choice itself carries no gradient."""
    T, E = router_logits.shape
    grad_logits = allocate((T, E), router_logits.dtype, router_logits.device)
    if T == 0:
        return grad_logits
    if router_logits.stride(-1) != 1:
        router_logits = router_logits.contiguous()
    grad_weights = grad_weights.to(torch.float32).contiguous()
    key = ("route_backward", *(tensor_key(t) for t in (grad_weights, router_logits, topk_weights, topk_ids)),
           renormalize, scoring)
    expert_pad = configs.route_expert_pad(E)
    rows = configs.route_backward_rows(expert_pad)
    _ROUTE_BACKWARD.launch(
        key, (-(-T // rows), 1, 1),
        (grad_weights, router_logits, topk_weights, topk_ids, grad_logits, T, E, router_logits.stride(0),
         grad_logits.stride(0), topk_ids.shape[1], int(scoring == "sigmoid"), int(renormalize), expert_pad, rows),
        num_warps=configs.DISPATCH_WARPS, num_stages=configs.DISPATCH_STAGES,
        device_index=router_logits.device.index if router_logits.is_cuda else None)
    return grad_logits
