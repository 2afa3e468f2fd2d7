"""The backward of `fused_experts`: argument layout, buffers, configuration and launches.

What the forward stores and what the backward recomputes (`experts.gate_up_for_backward`),
all in the forward's expert-sorted layout:
- stored: h = act(gate) * up (pairs, I), the down GEMM's input, which the forward writes
  anyway; the backward reads it for d topk_weights and (times w_p) for d w2.
- stored: the activation's local derivatives [dh/dgate, dh/dup] = [up * act'(gate),
  act(gate)] (pairs, 2I), computed in the forward's gate/up epilogue in place of the
  pre-activations an autograd of the plain formula keeps. Recomputing the pre-activations
  would repeat the forward's largest GEMM (4·T·k·H·I FLOPs, a third more work in the
  backward); recomputing the activation from stored pre-activations in the backward's first
  epilogue overflows its registers at the 128 x 128 tiles the GEMM wants (ptxas spills), so
  the forward, which has gate and up in registers, forms the derivatives once. Memory: 3
  elements per pair and column of I.
- stored: the layout (sorted_pairs, block_expert, block_rows), so the backward runs over the
  same blocks without routing again.
- not stored: the per-pair down outputs; d topk_weights = <dY_t, w2[e] @ h_p> is formed as
  <w2[e].T @ dY_t, h_p> from the first backward GEMM's accumulator.

The forward is two custom ops, so the backward is two autograd nodes (ops.py): `down_backward`
(launches 1 and d w2) then `gate_up_backward` (d x and d w1). Autograd frees h and the
derivatives, which only the first reads, when it returns, so the peak of the second (d w1,
the largest gradient, with d [gate, up]) holds no saved activation, as an autograd of the plain
formula frees its saved tensors op by op. The first's eager backward writes d [gate, up] over
the derivatives and w_p * h_p over h (`overwrite_saved`; ops.py says when), so its own peak
holds no buffer of (rows, I) or (rows, 2I) beyond the saved ones.

The launches (kernels in `_kernels/backward.py`), none read back by the host:
1. grad_gate_up: [d gate, d up] (pairs, 2I) in layout order, per-column-tile parts of
   d topk_weights (a (tiles, T * k) fp32 table summed here by one torch reduction), and for
   the weight gradients w_p * h_p and each layout row's token; where the configuration's
   gluon_stages asks and the call suits it (`gluon_grad_gate_up_ok`), the Gluon kernel of
   `_kernels/backward_gluon.py` (sm90), whose 256 columns a tile fill fewer rows of that table;
2. grad_x: the (T * k, H) per-pair input gradients, then the forward's combine kernel sums
   each token's k rows in the fixed order j = 0..k-1;
3. grad_w1 and grad_w2: one program per (expert, tile), each summing its expert's rows in
   layout order (grad_w1 gathers x by each row's token, sorted_pairs // k, or, with the
   configuration's gather_x, reads a copy of x in layout order that one launch writes first:
   a transient (rows, H) buffer). The experts' block ranges come from a torch.searchsorted
   over block_expert.
Every output element is written by one program with a fixed summation order: the gradients
are bitwise reproducible (no atomics anywhere). Each launch is a function of the plan, so
`bench moe --sweep --mode fwd+bwd` times one alone under a plan with a forced configuration.

With the configuration's `tma` (sm90 and later), each launch whose tensors the tensor memory
accelerator can address (`tma_addressable`) passes its dense-tile operands as tensor
descriptors (see `_kernels/backward.py`). A descriptor holds its tensor's data pointer, so
it is built per call; what Triton specialises the kernel on (the descriptor's dtype and tile)
follows from the plan, so the compiled kernel is cached under the call's key and whether the
launch took descriptors (`_launch_key`). The others take the pointer kernels with the same tiles.
"""
from __future__ import annotations

import torch

from ..device import info_for, interpreter_active
from ..launch import KernelLauncher, PlanCache
from ..tma import addressable, gluon_descriptor
from . import configs, experts, routing
from ._kernels import backward_gluon
from ._kernels.backward import gather_rows_kernel, grad_gate_up_kernel, grad_w1_kernel, grad_w2_kernel, grad_x_kernel
from ._kernels.backward_gluon import grad_gate_up_gluon_kernel, weight_grad_gluon_kernel

_GRAD_GATE_UP = KernelLauncher("moe_grad_gate_up", grad_gate_up_kernel, fp32_dots=True)
_GRAD_X = KernelLauncher("moe_grad_x", grad_x_kernel, fp32_dots=True)
_GRAD_W1 = KernelLauncher("moe_grad_w1", grad_w1_kernel, fp32_dots=True)
_GRAD_W2 = KernelLauncher("moe_grad_w2", grad_w2_kernel, fp32_dots=True)
_GATHER_ROWS = KernelLauncher("moe_gather_rows", gather_rows_kernel)
_GRAD_GATE_UP_GLUON = KernelLauncher("moe_grad_gate_up_gluon", grad_gate_up_gluon_kernel)
_WEIGHT_GRAD_GLUON = {name: KernelLauncher(f"moe_{name}_gluon", weight_grad_gluon_kernel)
                      for name in ("grad_w1", "grad_w2")}


class BackwardPlan:
    """Sizes, configuration and grids of a backward call (from shapes, strides and dtypes).

    `config` forces a BackwardConfig in place of the table's (for sweeps); launch such a plan
    with key None, since the launchers cache compiled kernels by the call's facts alone.
    `tma`: the configuration asks for tensor descriptors and the device has TMA (sm90 or later;
    the CPU interpreter emulates descriptor loads); each launch still checks its tensors."""

    __slots__ = ("num_tokens", "hidden", "inter", "num_experts", "top_k", "block_m", "num_blocks", "config",
                 "copy_x", "copy_w1", "copy_w2", "grad_gate_up_tiles", "grids", "device_index", "tma",
                 "grad_gate_up_gluon", "weight_grad_gluon")

    def __init__(self, x, w1, w2, topk_ids, block_expert, sorted_pairs,
                 config: configs.BackwardConfig | None = None):
        (T, H), (E, two_i, _) = x.shape, w1.shape
        self.num_tokens, self.hidden, self.inter, self.num_experts = T, H, two_i // 2, E
        self.top_k = topk_ids.shape[1]
        self.num_blocks = block_expert.numel()
        # The forward chose BLOCK_M (T > 0 here, so there is at least one block); the saved
        # layout says which.
        self.block_m = sorted_pairs.numel() // self.num_blocks
        device = info_for(x)
        self.config = config or configs.backward_config(device, x.element_size(), self.block_m, H, self.inter,
                                                        configs.pairs_per_expert(T, self.top_k, E))
        self.tma = self.config.tma and experts.tma_capable(x)
        self.copy_x = not experts.rows_read_in_place(x)
        # Weights with unit stride along either of their last two dimensions are read in place.
        self.copy_w1, self.copy_w2 = (not experts.unit_stride_rows_or_columns(w) for w in (w1, w2))
        cfg, I = self.config, self.inter
        # Rows of the d topk_weights table: the Triton kernel's column tiles, at least as many as the
        # Gluon kernel's (configs' test); rows no program writes keep their zeros.
        self.grad_gate_up_tiles = -(-I // cfg.grad_gate_up.block_n)
        self.grids = {
            "grad_gate_up": (self.num_blocks * self.grad_gate_up_tiles, 1, 1),
            "grad_x": (self.num_blocks * -(-H // cfg.grad_x.block_n), 1, 1),
            "grad_w1": (E * -(-2 * I // cfg.grad_w1.block_m) * -(-H // cfg.grad_w1.block_n), 1, 1),
            "grad_w2": (E * -(-H // cfg.grad_w2.block_m) * -(-I // cfg.grad_w2.block_n), 1, 1),
        }
        self.device_index = x.device.index if x.device.type == "cuda" else None
        # Whether the configuration's Gluon grad_gate_up runs: decided at the first launch, from
        # facts of d out and w2 that the down backward's plan key holds.
        self.grad_gate_up_gluon = None
        # Whether each weight gradient (grad_w1, grad_w2) runs the Gluon kernel: decided at its
        # first launch, from facts of its operands that the plan's key holds.
        self.weight_grad_gluon = {}


_PLANS = PlanCache()


def expert_block_ranges(block_expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E + 1,) int32: expert e's blocks are [out[e], out[e + 1]). Blocks are in expert order,
    followed by unused blocks marked -1 (counted as E here so the sequence stays sorted)."""
    sorted_experts = torch.where(block_expert < 0, num_experts, block_expert)
    boundaries = torch.arange(num_experts + 1, dtype=torch.int32, device=block_expert.device)
    return torch.searchsorted(sorted_experts, boundaries, out_int32=True)


def expert_row_sums(rows: torch.Tensor, block_expert: torch.Tensor, num_experts: int) -> torch.Tensor:
    """(E, C) fp32: each expert's sum of `rows` (layout rows, C) over its blocks (padding rows hold
    zeros; unused blocks belong to no expert), block sums then one product (deterministic)."""
    if rows.numel() == 0:
        return rows.new_zeros((num_experts, rows.shape[1]), dtype=torch.float32)
    per_block = rows.view(block_expert.numel(), -1, rows.shape[1]).float().sum(1)
    experts_of = torch.arange(num_experts, device=rows.device, dtype=block_expert.dtype)
    return (block_expert[None, :] == experts_of[:, None]).float() @ per_block


def launch_grad_gate_up(key, plan: BackwardPlan, grad_out, w2, h, h_grads, topk_weights, sorted_pairs, block_expert,
                        block_rows, grad_gate_up, weighted_h, row_tokens, grad_weight_parts,
                        need_weight_grads: bool, interleaved: bool = False) -> None:
    """[d gate, d up] (layout rows, 2I) in w1's row order (gate rows then up rows, or `interleaved`)
    into grad_gate_up, each column tile's part of d topk_weights
    into grad_weight_parts (plan.grad_gate_up_tiles, T * k) fp32, and with need_weight_grads
    w_p * h_p (layout rows, I) into weighted_h and each row's token into row_tokens (layout rows,)."""
    g = plan.config.grad_gate_up
    if plan.grad_gate_up_gluon is None:
        plan.grad_gate_up_gluon = bool(plan.config.gluon_stages) and gluon_grad_gate_up_ok(plan, grad_out, w2,
                                                                                            interleaved)
    if plan.grad_gate_up_gluon:
        _launch_grad_gate_up_gluon(key, plan, grad_out, w2, h, h_grads, topk_weights, sorted_pairs, block_expert,
                                   block_rows, grad_gate_up, weighted_h if need_weight_grads else h, row_tokens,
                                   grad_weight_parts, need_weight_grads)
        return
    tma = plan.tma and experts.tma_addressable(w2)
    _GRAD_GATE_UP.launch(
        experts.launch_key_with_tma(key, tma), plan.grids["grad_gate_up"],
        (grad_out, experts.tma_descriptor(w2, (1, g.block_k, g.block_n)) if tma else w2, h, h_grads, topk_weights,
         grad_gate_up, weighted_h, row_tokens, grad_weight_parts, sorted_pairs, block_expert, block_rows,
         plan.num_blocks, plan.num_tokens * plan.top_k, plan.hidden, plan.inter, plan.top_k, int(need_weight_grads),
         grad_out.stride(0), w2.stride(0), w2.stride(1), w2.stride(2), plan.block_m, g.block_n, g.block_k, g.group_m,
         tma, interleaved),
        num_warps=g.num_warps, num_stages=g.num_stages, device_index=plan.device_index)


def gluon_grad_gate_up_ok(plan: BackwardPlan, grad_out, w2, interleaved: bool) -> bool:
    """Whether `backward_gluon.grad_gate_up_gluon_kernel` can run this call: on the GPU, over
    128-row blocks, gate and up not interleaved, H a multiple of its K step and I of its epilogue's
    columns, w2 contiguous and dY's row stride a multiple of 16 elements (Triton specialises on it:
    its gathered copies are 16 bytes)."""
    return (grad_out.is_cuda and not interpreter_active() and plan.block_m == backward_gluon.TILE_M.value
            and not interleaved and plan.hidden % backward_gluon.BLOCK_K.value == 0
            and plan.inter % backward_gluon.EPILOGUE_N.value == 0 and w2.is_contiguous() and addressable(w2)
            and addressable(grad_out) and grad_out.stride(0) % 16 == 0)


def _launch_grad_gate_up_gluon(key, plan: BackwardPlan, grad_out, w2, h, h_grads, topk_weights, sorted_pairs,
                               block_expert, block_rows, grad_gate_up, weighted_h, row_tokens, grad_weight_parts,
                               need_weight_grads: bool) -> None:
    """launch_grad_gate_up on the Gluon kernel (not interleaved; weighted_h: any (rows, I) tensor
    when need_weight_grads is off, unwritten)."""
    bg = backward_gluon
    H, I, E = plan.hidden, plan.inter, plan.num_experts
    tiles = plan.num_blocks * -(-I // bg.BLOCK_N.value)

    def epilogue_box(t):
        return gluon_descriptor(t, bg.HALF_M.value, bg.EPILOGUE_N.value)
    _GRAD_GATE_UP_GLUON.launch(
        key, (min(tiles, info_for(grad_out).sm_count), 1, 1),
        (grad_out, gluon_descriptor(w2.view(E * H, I), bg.BLOCK_K.value, bg.BLOCK_N.value), epilogue_box(h),
         epilogue_box(h_grads), topk_weights, epilogue_box(grad_gate_up), grad_gate_up, epilogue_box(weighted_h),
         row_tokens, grad_weight_parts, sorted_pairs,
         block_expert, block_rows, plan.num_blocks, plan.num_tokens * plan.top_k, H, I, plan.top_k,
         int(need_weight_grads), grad_out.stride(0), plan.config.grad_gate_up.group_m, plan.config.gluon_stages),
        num_warps=4, num_stages=1, device_index=plan.device_index)


def launch_grad_x(key, plan: BackwardPlan, grad_gate_up, w1, grad_x_pairs, sorted_pairs, block_expert,
                  block_rows) -> None:
    """grad_x_pairs (T * k, H): row p = w1[e].T @ grad_gate_up[row of p]."""
    g = plan.config.grad_x
    tma = plan.tma and experts.tma_addressable(grad_gate_up, w1)
    if tma:
        grad_gate_up = experts.tma_descriptor(grad_gate_up, (plan.block_m, g.block_k))
        w1_arg = experts.tma_descriptor(w1, (1, g.block_k, g.block_n))
    else:
        w1_arg = w1
    _GRAD_X.launch(
        experts.launch_key_with_tma(key, tma), plan.grids["grad_x"],
        (grad_gate_up, w1_arg, grad_x_pairs, sorted_pairs, block_expert, block_rows, plan.num_blocks, plan.hidden,
         plan.inter, w1.stride(0), w1.stride(1), w1.stride(2), plan.block_m, g.block_n, g.block_k, g.group_m, tma),
        num_warps=g.num_warps, num_stages=g.num_stages, device_index=plan.device_index)


def _launch_weight_grad(launcher, name, key, plan: BackwardPlan, operands, dense, gathered_stride,
                        row_tokens, expert_blocks, flags=()) -> None:
    """One weight-gradient kernel (`name`: grad_w1 or grad_w2): `operands` are its two inputs and
    its output (any strides) in the kernel's argument order; `dense` maps the index of each
    input read in layout order to its block shape (a descriptor of those blocks with TMA, all of
    them or none); `gathered_stride` is the row stride of the input gathered by token; `flags`,
    the kernel's constexpr flags after TMA."""
    g = getattr(plan.config, name)
    grad = operands[2]
    tma = plan.tma and experts.tma_addressable(*(operands[i] for i in dense))
    if tma:
        operands = list(operands)
        for i, block in dense.items():
            operands[i] = experts.tma_descriptor(operands[i], block)
    launcher.launch(
        experts.launch_key_with_tma(None if key is None else (key, *flags), tma), plan.grids[name],
        (*operands, row_tokens, expert_blocks, plan.hidden, plan.inter, plan.block_m, gathered_stride, *grad.stride(),
         g.block_m, g.block_n, g.block_k, g.group_m, plan.block_m % g.block_k == 0, tma, *flags),
        num_warps=g.num_warps, num_stages=g.num_stages, device_index=plan.device_index)


def gluon_weight_grad_ok(plan: BackwardPlan, name: str, gathered, dense, grad) -> bool:
    """Whether `backward_gluon.weight_grad_gluon_kernel` can run weight gradient `name` (grad_w1 or
    grad_w2) of this call: on the GPU, in a 16-bit dtype, over blocks of whole K steps (64 or 128
    rows), the gradient (E, M, N) contiguous with M a multiple of the tile's rows, TMA able to
    address it and the layout-order operand `dense`, and the operand `gathered` by token in rows
    of H elements whose length and stride are multiples of 16 (which Triton specialises on: its
    cp.async copies are 16 bytes, each of 8 elements)."""
    tile_m = backward_gluon.TILE_M.value
    return (grad.is_cuda and not interpreter_active() and grad.element_size() == 2
            and plan.block_m % backward_gluon.BLOCK_K.value == 0 and grad.shape[1] % tile_m == 0
            and grad.is_contiguous() and plan.hidden % 16 == 0 and gathered.stride(0) % 16 == 0
            and addressable(grad.view(-1, grad.shape[2]), dense, gathered))


def _weight_grad_gluon(plan: BackwardPlan, name: str, gathered, dense, grad) -> bool:
    """Whether weight gradient `name` runs the Gluon kernel (the configuration asks, the call suits
    it), decided once per plan."""
    ok = plan.weight_grad_gluon.get(name)
    if ok is None:
        ok = plan.weight_grad_gluon[name] = (bool(plan.config.gluon_weight_grad(name))
                                             and gluon_weight_grad_ok(plan, name, gathered, dense, grad))
    return ok


def _launch_weight_grad_gluon(key, plan: BackwardPlan, name: str, gathered, dense, grad, row_tokens,
                              expert_blocks) -> None:
    """Weight gradient `name` on the Gluon kernel: grad (E, M, N) = dense[rows of e].T @
    gathered[tokens of e] (grad_w1) or gathered[tokens of e].T @ dense[rows of e] (grad_w2)."""
    bg = backward_gluon
    E, M, N = grad.shape
    tiles = E * (M // bg.TILE_M.value) * -(-N // bg.BLOCK_N.value)
    dense_cols = bg.BLOCK_N.value if name == "grad_w2" else bg.HALF_M.value
    _WEIGHT_GRAD_GLUON[name].launch(
        key, (min(tiles, info_for(grad).sm_count), 1, 1),
        (gathered, gluon_descriptor(dense, bg.BLOCK_K.value, dense_cols),
         gluon_descriptor(grad.view(E * M, N), bg.HALF_M.value, bg.BLOCK_N.value), row_tokens, expert_blocks,
         E, M, N, plan.hidden, gathered.stride(0), plan.block_m, name == "grad_w2", getattr(plan.config, name).group_m,
         plan.config.gluon_weight_grad(name)),
        num_warps=4, num_stages=1, device_index=plan.device_index)


def launch_grad_w1(key, plan: BackwardPlan, grad_gate_up, x, grad_w1, row_tokens, expert_blocks) -> None:
    """grad_w1 (E, 2I, H), any strides: grad_w1[e] = grad_gate_up[rows of e].T @ x[tokens of e].
    With the configuration's gather_x (and TMA), x is first copied into layout order
    (`gather_x_rows`) and read from there as dense tiles."""
    if _weight_grad_gluon(plan, "grad_w1", x, grad_gate_up, grad_w1):
        _launch_weight_grad_gluon(key, plan, "grad_w1", x, grad_gate_up, grad_w1, row_tokens, expert_blocks)
        return
    g = plan.config.grad_w1
    if plan.tma and plan.config.gather_x:
        x_rows = routing.allocate((row_tokens.numel(), plan.hidden), x.dtype, x.device)
        if experts.tma_addressable(grad_gate_up, x_rows):
            gather_x_rows(key, plan, x, row_tokens, x_rows)
            _launch_weight_grad(_GRAD_W1, "grad_w1", key, plan, (grad_gate_up, x_rows, grad_w1),
                                {0: (g.block_k, g.block_m), 1: (g.block_k, g.block_n)}, x_rows.stride(0),
                                row_tokens, expert_blocks, flags=(True,))
            return
        del x_rows
    _launch_weight_grad(_GRAD_W1, "grad_w1", key, plan, (grad_gate_up, x, grad_w1), {0: (g.block_k, g.block_m)},
                        x.stride(0), row_tokens, expert_blocks, flags=(False,))


def gather_x_rows(key, plan: BackwardPlan, x, row_tokens, x_rows) -> None:
    """x_rows (rows, H) contiguous: x's row of each layout row's token, zero on padding rows."""
    rows, H = x_rows.shape
    block_r, block_h = configs.GATHER_ROWS_TILE
    _GATHER_ROWS.launch(key, (-(-rows // block_r), -(-H // block_h), 1),
                        (x, row_tokens, x_rows, rows, H, x.stride(0), block_r, block_h),
                        num_warps=configs.GATHER_ROWS_WARPS, num_stages=1, device_index=plan.device_index)


def launch_grad_w2(key, plan: BackwardPlan, grad_out, weighted_h, grad_w2, row_tokens, expert_blocks) -> None:
    """grad_w2 (E, H, I), any strides: grad_w2[e] = grad_out[tokens of e].T @ weighted_h[rows of e]."""
    if _weight_grad_gluon(plan, "grad_w2", grad_out, weighted_h, grad_w2):
        _launch_weight_grad_gluon(key, plan, "grad_w2", grad_out, weighted_h, grad_w2, row_tokens, expert_blocks)
        return
    g = plan.config.grad_w2
    _launch_weight_grad(_GRAD_W2, "grad_w2", key, plan, (grad_out, weighted_h, grad_w2), {1: (g.block_k, g.block_n)},
                        grad_out.stride(0), row_tokens, expert_blocks)


def describe(hidden_states: torch.Tensor, w1: torch.Tensor, top_k: int) -> dict:
    """Which backward configuration a call with these inputs runs (for benchmarks and reports)."""
    T, H = hidden_states.shape
    E, two_i, _ = w1.shape
    device = info_for(hidden_states)
    forward = configs.experts_config(device, hidden_states.element_size(), T, top_k, E, H, two_i // 2)
    return {"backward_config": str(configs.backward_config(device, hidden_states.element_size(), forward.block_m, H,
                                                           two_i // 2, configs.pairs_per_expert(T, top_k, E)))}


def gradient_like(w: torch.Tensor) -> torch.Tensor:
    """An uninitialised gradient buffer for weight `w` (E, N, K), in its layout where that is dense
    (a transposed view's gradient is one too, which autograd hands to the stored parameter without
    a copy), else contiguous. The weight-gradient kernels write any strides whose column offsets
    stay 32-bit: K times the column stride below 2**31 (contiguous, where an expert's matrix is
    larger than that, and a transposed view's would pass it)."""
    if w.shape[2] * w.stride(2) < 2**31:
        return torch.empty_like(w)
    return torch.empty(w.shape, dtype=w.dtype, device=w.device)


def _plan(name, hidden_states, w1, w2, topk_ids, sorted_pairs, block_expert, *tensors):
    """(launch key, BackwardPlan) of a backward call, cached under the call's facts."""
    key = (name, *map(routing.tensor_key, (hidden_states, w1, w2, topk_ids, sorted_pairs, block_expert, *tensors)))
    plan = _PLANS.get(key)
    if plan is None:
        plan = _PLANS.remember(key, BackwardPlan(hidden_states, w1, w2, topk_ids, block_expert, sorted_pairs))
    return key, plan


def down_backward(grad_out, hidden_states, w1, w2, topk_weights, topk_ids, h, h_grads, sorted_pairs, block_expert,
                  block_rows, need_gate_up_grad: bool, need_w2_grad: bool, interleaved: bool = False,
                  overwrite_saved: bool = False):
    """The backward of the down GEMM and the activation: the first half of `fused_experts`' backward.

    Args:
        grad_out: (T, H), d out, any row stride (unit stride along H, else copied).
        hidden_states, w1, w2: the forward's inputs (hidden_states and w1 only size the plan).
        topk_weights: (T, k) float32 and topk_ids: (T, k) int32, contiguous, as the forward ran.
        h, h_grads, sorted_pairs, block_expert, block_rows: what `experts.gate_up_for_backward`
            returned.
        need_gate_up_grad, need_w2_grad: which gradients to return.
        interleaved: w1's gate and up rows alternate (`fused_experts`' gate_up_interleaved).
        overwrite_saved: write d [gate, up] over h_grads and w_p * h_p over h (each program
            writes the elements it has read, so no other reads them after): the caller's last
            use of them. Not with interleaved (its d [gate, up] columns are not h_grads').

    Returns:
        (d [gate, up] (rows, 2I) in layout order, its columns in w1's row order, zero on padding
        rows, or an empty (0,) tensor; d w2 (E, H, I) in w2's layout (`gradient_like`) or an
        empty (0,) tensor; d topk_weights (T, k) float32, zero for dropped slots). d w2 is zero
        for experts that received no token.
    """
    T = hidden_states.shape[0]
    if T == 0:
        return (hidden_states.new_empty((0, w1.shape[1]) if need_gate_up_grad else (0,)),
                gradient_like(w2).zero_() if need_w2_grad else w2.new_empty((0,)),
                torch.empty(topk_ids.shape, dtype=torch.float32, device=hidden_states.device))
    key, plan = _plan(("experts_down_backward", interleaved), hidden_states, w1, w2, topk_ids, sorted_pairs,
                      block_expert, grad_out, topk_weights, h, h_grads, block_rows)
    w2 = w2.contiguous() if plan.copy_w2 else w2
    h, h_grads = h.contiguous(), h_grads.contiguous()  # the forward's are
    if not experts.rows_read_in_place(grad_out):
        grad_out = grad_out.contiguous()
    I, E, k = plan.inter, plan.num_experts, plan.top_k
    device, dtype = grad_out.device, h.dtype
    rows = plan.num_blocks * plan.block_m
    if overwrite_saved and interleaved:
        raise ValueError("overwrite_saved needs gate and up rows not interleaved")
    grad_gate_up = h_grads if overwrite_saved else routing.allocate((rows, 2 * I), dtype, device)
    if need_w2_grad:
        weighted_h = h if overwrite_saved else routing.allocate((rows, I), dtype, device)
        row_tokens = routing.allocate((rows,), torch.int32, device)
    else:  # not written: the kernel's flag is off
        weighted_h, row_tokens = grad_gate_up, sorted_pairs
    # Slots that no program covers (dropped ids) keep their zero.
    grad_weight_parts = torch.zeros((plan.grad_gate_up_tiles, T * k), dtype=torch.float32, device=device)
    launch_grad_gate_up(key, plan, grad_out, w2, h, h_grads, topk_weights, sorted_pairs, block_expert, block_rows,
                        grad_gate_up, weighted_h, row_tokens, grad_weight_parts, need_w2_grad, interleaved)
    grad_weights = grad_weight_parts.sum(dim=0).view(T, k)
    grad_w2 = w2.new_empty((0,))
    if need_w2_grad:
        grad_w2 = gradient_like(w2)
        launch_grad_w2(key, plan, grad_out, weighted_h, grad_w2, row_tokens, expert_block_ranges(block_expert, E))
    return grad_gate_up if need_gate_up_grad else grad_gate_up.new_empty((0,)), grad_w2, grad_weights


def gate_up_backward(grad_gate_up, hidden_states, w1, w2, topk_ids, sorted_pairs, block_expert, block_rows,
                     need_input_grad: bool, need_w1_grad: bool):
    """The backward of the gate/up GEMM: the second half of `fused_experts`' backward.

    Args:
        grad_gate_up: (rows, 2I), d [gate, up] in layout order from `down_backward` (any
            strides: copied when not contiguous).
        hidden_states, w1, w2, topk_ids, sorted_pairs, block_expert, block_rows: as the forward
            ran (w2 only sizes the plan).
        need_input_grad, need_w1_grad: which gradients to return.

    Returns:
        (d hidden_states (T, H) or an empty (0,) tensor, d w1 (E, 2I, H) in w1's layout
        (`gradient_like`) or an empty (0,) tensor), in hidden_states' dtype; d w1 is zero for
        experts that received no token.
    """
    x, T = hidden_states, hidden_states.shape[0]
    if T == 0:
        return (x.new_empty(x.shape if need_input_grad else (0,)),
                gradient_like(w1).zero_() if need_w1_grad else x.new_empty((0,)))
    key, plan = _plan("experts_gate_up_backward", x, w1, w2, topk_ids, sorted_pairs, block_expert, grad_gate_up,
                      block_rows)
    x = x.contiguous() if plan.copy_x else x
    w1 = w1.contiguous() if plan.copy_w1 else w1
    grad_gate_up = grad_gate_up.contiguous()  # autograd's is; a caller's may be a broadcast
    H, E, k = plan.hidden, plan.num_experts, plan.top_k
    device, dtype = x.device, x.dtype
    # Gradients not asked for are empty tensors (distinct: a custom op's outputs may not alias).
    grad_x, grad_w1 = x.new_empty((0,)), x.new_empty((0,))
    if need_input_grad:  # first, so its (T * k, H) pair rows are freed before d w1 exists
        grad_x_pairs = routing.allocate((T * k, H), dtype, device)
        grad_x = routing.allocate((T, H), dtype, device)
        launch_grad_x(key, plan, grad_gate_up, w1, grad_x_pairs, sorted_pairs, block_expert, block_rows)
        experts.launch_combine(key, grad_x_pairs, topk_ids, grad_x, E, plan.device_index)
        del grad_x_pairs
    if need_w1_grad:
        # each row's token; padding rows' -1 stays -1 (floor division), as the kernels read them
        row_tokens = torch.div(sorted_pairs, k, rounding_mode="floor")
        grad_w1 = gradient_like(w1)
        launch_grad_w1(key, plan, grad_gate_up, x, grad_w1, row_tokens, expert_block_ranges(block_expert, E))
    return grad_x, grad_w1
