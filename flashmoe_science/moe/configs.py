"""MoE kernel configurations: the one table of block sizes, warps and stages, and the tile
constants of the routing, dispatch and combine kernels.

The expert GEMMs run over an expert-sorted layout cut into BLOCK_M-row blocks, one expert each
(see `_kernels/dispatch.py`), so the figure that decides the tiling is how many token-expert
pairs an expert receives on average, T * k / E:
- up to 8 (decode: Qwen3-30B-A3B up to 128 tokens, Mixtral up to 32): BLOCK_M = 16, so an
  expert's few rows fill one block and its weights are read once. Narrow column tiles
  (BLOCK_N 32 for gate/up, 64 for down) give hundreds to thousands of programs, so every SM
  streams weights; K tiles of 128 in a 4-stage pipeline keep bytes in flight while taking
  60 KB of shared memory, so three programs share an SM and one wave covers a Qwen3 decode
  call (BLOCK_K 256 would take 120 KB: one program per SM, 1.5 waves). The weight-bandwidth
  floor needs both. There is nothing to reuse, so no grouping (GROUP_M = 1).
- up to 32 and up to 96: BLOCK_M 32 and 64, wider column tiles as rows start to be reused.
- beyond (prefill): BLOCK_M = 128 tiles that keep the tensor cores busy (wgmma on Hopper
  from BLOCK_M = 64 with num_warps a multiple of 4), grouped launch order (GROUP_M = 8) so the
  tiles in flight share an expert's weight columns in L2.
The gate/up kernel's accumulator holds gate and up of its BLOCK_N columns (2 * BLOCK_N wide), so
its BLOCK_N is half of the down kernel's at the same register budget.

Families differ by shared memory per block: Hopper (sm90) 227 KB, A100-class (sm80) 163 KB and
the 99 KB parts (sm86, sm89). Triton keeps num_stages copies of the A and B tiles in shared
memory for wgmma on Hopper and num_stages - 1 elsewhere; the 99 KB parts get narrower tiles.
fp32 inputs (3xTF32 or TF32 tensor-core products on the GPU, `device.fp32_dot_precision`) have one small
table for every family.

These tables are reasoned starting points, not yet measured: `flashmoe-science bench moe
--sweep` times a grid of candidates per bucket on the GPU and prints a table in this format.
`builds.py` enumerates every kernel specialisation the launchers can pick from these tables,
so the CPU test compiles each for sm80, sm86, sm89 and sm90 and checks it fits.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from ..dependent_launch import PDL_AVAILABLE
from ..device import SHARED_MEMORY_PER_BLOCK, DeviceInfo, interpreter_active


@dataclass(frozen=True)
class GemmConfig:
    """Tiling of one expert GEMM (BLOCK_M is shared by both and lives in ExpertsConfig)."""

    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return (f"BLOCK_N={self.block_n} BLOCK_K={self.block_k} GROUP_M={self.group_m} "
                f"warps={self.num_warps} stages={self.num_stages}")


@dataclass(frozen=True)
class ExpertsConfig:
    """BLOCK_M of the sorted layout and the tiling of the gate/up and down GEMMs.
    tma: the dense operands (both weight tiles, down's h tile) come through tensor descriptors
    (sm90) instead of pointer loads: the same tiles and products, so the same bits; calls whose
    tensors TMA cannot address run the pointer kernels with the same tiles.
    gluon_down_stages > 0 (sm90, 128-row blocks, with tma): the down GEMM runs the Gluon kernel
    (`_kernels/forward_gluon.py`: persistent, warp-specialised, its tiles fixed there) with this
    many pipeline buffers and down's group_m, where the call suits it (16-bit, no bias, w2
    contiguous, descriptors possible); other calls run the Triton kernel with down's tiling.
    pdl (sm90): the gate/up, down and combine launches are programmatic dependents of the launch
    before each (`dependent_launch`): each launches as that kernel finishes, its launch overlapping
    the kernel's end, and waits at its start; the routing launch releases the gate/up launch as it
    starts, so gate/up launches while the routing runs."""

    block_m: int
    gate_up: GemmConfig
    down: GemmConfig
    tma: bool = False
    gluon_down_stages: int = 0
    pdl: bool = False

    def __str__(self) -> str:
        return (f"BLOCK_M={self.block_m} gate_up[{self.gate_up}] down[{self.down}]" + (" tma" if self.tma else "")
                + (f" gluon_down_stages={self.gluon_down_stages}" if self.gluon_down_stages else "")
                + (" pdl" if self.pdl else ""))


G, X = GemmConfig, ExpertsConfig
# Decode takes 60 KB of shared memory, which every family has room for (three programs per SM
# on Hopper).
_DECODE = X(16, G(32, 128, 1, 4, 4), G(64, 128, 1, 4, 4))
# 163 KB and more (sm80, sm90): pipelines of up to 192 KB on Hopper (num_stages buffers),
# 144 KB on sm80 (num_stages - 1 buffers).
_LARGE_SMEM = ((8, _DECODE),
               (32, X(32, G(64, 128, 1, 4, 3), G(128, 128, 1, 4, 3))),
               (96, X(64, G(128, 64, 8, 4, 4), G(128, 64, 8, 4, 4))),
               (None, X(128, G(128, 64, 8, 8, 4), G(256, 64, 8, 8, 4))))
# Hopper: the dense operands of the middle and prefill tiles come through tensor descriptors
# (ExpertsConfig.tma), measured per GEMM against pointer loads on an H100 (`bench moe --sweep`
# over restricted grids: benchmarks/results/moe_sweep_tma_prefill.json and
# moe_sweep_tma_small.json): prefill gate/up 5-20% and down 2-20% faster (Mixtral-8x7B at 16k
# tokens 11.5 against 13.6 ms and 5.5 against 6.8 ms), the middle bucket 2-5%; the decode tiles
# stream weights at the same speed either way (within 2%), so they keep the pointer builds. With
# descriptors the prefill gate/up GEMM runs four stages (Mixtral-8x7B at 1024 tokens 1.15
# against 1.36 ms for three), the middle bucket's down GEMM three (Mixtral-8x7B at 256 tokens
# 351 against 402 us for four).
# The prefill bucket's down GEMM runs the Gluon kernel (4 stages, 213 KB): against the Triton kernel
# on an H200, inside fused_moe (benchmarks/results/moe_down_gluon/, alternating in one process, the
# same bits of every output and gradient), the down GEMM alone takes 0.90-0.92x the time at
# Qwen3-30B-A3B (0.677-0.680 against 0.736-0.737 ms at 16k tokens, forward), 0.91-0.95x at
# DeepSeek-V2-Lite, 0.91-0.94x at OLMoE-1B-7B and 0.98-1.01x at Mixtral-8x7B (both near 700 TFLOP/s
# there), at 4096 and 16k tokens, in the forward and in forward+backward.
# Hopper's decode entry chains its launches as programmatic dependents: in CUDA graphs on an H200
# (benchmarks/results/moe_decode_pdl/), Qwen3-30B-A3B T = 1 31.0 against 32.8 us a layer, other
# decode shapes 0-1% faster, the same bits.
_HOPPER = (((8, replace(_DECODE, pdl=PDL_AVAILABLE)), _LARGE_SMEM[1])
           + ((96, X(64, G(128, 64, 8, 4, 4), G(128, 64, 8, 4, 3), tma=True)),)
           + ((None, replace(_LARGE_SMEM[3][1], tma=True, gluon_down_stages=4)),))
# sm80: as above, but the middle bucket's gate/up GEMM on eight warps: on four its 64 x 256 fp32
# accumulator (gate and up interleaved) spills 72-80 bytes a thread under sm80's ptxas.
_SM80 = _LARGE_SMEM[:2] + ((96, X(64, G(128, 64, 8, 8, 4), G(128, 64, 8, 4, 4))),) + _LARGE_SMEM[3:]
# 99 KB (sm86, sm89): half-width B tiles, two buffers, at most 64 KB.
_SMALL_SMEM = ((8, _DECODE),
               (32, X(32, G(64, 64, 1, 4, 3), G(128, 64, 1, 4, 3))),
               (96, X(64, G(64, 64, 8, 4, 3), G(128, 64, 8, 4, 3))),
               (None, X(128, G(64, 64, 8, 8, 3), G(128, 64, 8, 8, 3))))
# fp32 (3xTF32 products hold each operand twice): the prefill GEMMs on eight warps, whose
# accumulators spill 800-930 bytes a thread on four under sm80 and sm89's ptxas.
_FP32 = ((8, X(16, G(32, 64, 1, 4, 3), G(64, 64, 1, 4, 3))),
         (None, X(64, G(64, 32, 8, 8, 3), G(128, 32, 8, 8, 3))))
# EXPERTS[family][element bytes]: ((most pairs per expert, config), ...) in increasing bound;
# the last bound, None, takes every larger load.
EXPERTS = {
    90: {2: _HOPPER, 4: _FP32},
    80: {2: _SM80, 4: _FP32},
    89: {2: _SMALL_SMEM, 4: _FP32},
}
del G, X


@dataclass(frozen=True)
class WeightGradConfig:
    """Tiling of a weight-gradient GEMM: one (BLOCK_M, BLOCK_N) tile of an expert's gradient,
    summed over that expert's layout rows BLOCK_K at a time."""

    block_m: int
    block_n: int
    block_k: int
    group_m: int
    num_warps: int
    num_stages: int

    def __str__(self) -> str:
        return (f"BLOCK_M={self.block_m} BLOCK_N={self.block_n} BLOCK_K={self.block_k} GROUP_M={self.group_m} "
                f"warps={self.num_warps} stages={self.num_stages}")


@dataclass(frozen=True)
class BackwardConfig:
    """Tiling of the four backward GEMMs for one BLOCK_M of the forward's layout.

    grad_gate_up: layout rows x I columns, K = H (dY @ w2[e], the activation gradient in its
    epilogue); grad_x: layout rows x H columns, K = 2I; grad_w1: (2I, H) and grad_w2: (H, I)
    tiles of each expert's weight gradient, K = the expert's rows.
    tma: the operands the kernels read as dense tiles (w2 in grad_gate_up, both of grad_x, the
    layout-order operand of the weight gradients) come through tensor descriptors (the tensor
    memory accelerator, sm90 and later) instead of pointer loads: the same tiles and products in
    the same order, so the same bits. Calls whose tensors TMA cannot address, and other GPUs,
    run the pointer kernels with the same tiles. One flag for the four kernels; the Hopper
    prefill entries set it (measured below, at BACKWARD).
    gather_x (with tma): grad_w1 reads x from a copy in layout order (rows, H), written by one
    gather launch before it, through a descriptor, instead of gathering x by token in its loop:
    the same tiles in the same order, so the same bits, for a transient buffer of the layout's
    rows times H (measured below, at BACKWARD_GATHER_X).
    """

    grad_gate_up: GemmConfig
    grad_x: GemmConfig
    grad_w1: WeightGradConfig
    grad_w2: WeightGradConfig
    tma: bool = False
    gather_x: bool = False
    # gluon_stages > 0: grad_gate_up runs the Gluon kernel (`_kernels/backward_gluon.py`, sm90:
    # persistent, warp-specialised, its tiles and warps fixed there) with this many pipeline
    # buffers and grad_gate_up's group_m, where the call suits it (`backward.gluon_grad_gate_up_ok`);
    # other calls run the Triton kernel with grad_gate_up's tiling.
    gluon_stages: int = 0
    # gluon_weight_grad_stages > 0: the weight gradients named in gluon_weight_grads run the Gluon
    # weight-gradient kernel (`_kernels/backward_gluon.py`, sm90: persistent, warp-specialised,
    # 128 x 256 tiles) with this many pipeline buffers and their own group_m, where the call suits
    # it (`backward.gluon_weight_grad_ok`); the others, and other calls, run the Triton kernels
    # with their tilings.
    gluon_weight_grad_stages: int = 0
    gluon_weight_grads: tuple = ("grad_w1", "grad_w2")

    def __str__(self) -> str:
        return (f"grad_gate_up[{self.grad_gate_up}] grad_x[{self.grad_x}] grad_w1[{self.grad_w1}] "
                f"grad_w2[{self.grad_w2}]" + (" tma" if self.tma else "") + (" gather_x" if self.gather_x else "")
                + (f" gluon_stages={self.gluon_stages}" if self.gluon_stages else "")
                + (f" gluon_weight_grad_stages={self.gluon_weight_grad_stages}"
                   + ("" if self.gluon_weight_grads == ("grad_w1", "grad_w2")
                      else f" gluon_weight_grads={','.join(self.gluon_weight_grads)}")
                   if self.gluon_weight_grad_stages else ""))

    def gluon_weight_grad(self, name: str) -> int:
        """The Gluon kernel's pipeline buffers for weight gradient `name` (grad_w1 or grad_w2); 0:
        the Triton kernel."""
        return self.gluon_weight_grad_stages if name in self.gluon_weight_grads else 0


# The backward runs over the forward's layout (its saved intermediates are in layout order),
# so its tables are keyed by the forward's BLOCK_M, and must cover every BLOCK_M of EXPERTS.
# The row GEMMs mirror the forward's: grad_gate_up holds one accumulator where gate_up holds
# two, but its epilogue loads three tiles (h, dh/dgate, dh/dup), so it keeps gate_up's
# BLOCK_N (at BLOCK_M 128 and 8 warps: 64 registers a thread per fp32 tile; 233 in all on
# sm90, no spills, where BLOCK_N 256 spills); grad_x is the down GEMM's shape (K = 2I).
# The weight gradients sum over an expert's rows with one operand gathered by token through
# an index loaded in the loop. Triton pipelines such indirect loads num_stages - 2 deep on
# Hopper (at most 3) and num_stages - 3 deep elsewhere, hence 5 stages: at prefill loads,
# 128 x 256 tiles with 64-row steps keep 3 buffers (148 KB) on Hopper and 2 (99 KB) on sm80,
# 128 x 128 tiles keep 2 (66 KB) on the 99 KB parts. For decode-sized loads an expert has a
# few rows, the work is writing its gradient, and 32-row steps waste little on padding.
G, B, W = GemmConfig, BackwardConfig, WeightGradConfig
_SMALL_LOAD_WEIGHT_GRAD = W(64, 128, 32, 8, 4, 4)
_MID_LOAD_WEIGHT_GRAD = W(128, 128, 64, 8, 8, 5)
_BACKWARD_LARGE_SMEM = {
    16: B(G(32, 128, 1, 4, 4), G(64, 128, 1, 4, 4), _SMALL_LOAD_WEIGHT_GRAD, _SMALL_LOAD_WEIGHT_GRAD),
    32: B(G(64, 128, 1, 4, 3), G(128, 128, 1, 4, 3), _SMALL_LOAD_WEIGHT_GRAD, _SMALL_LOAD_WEIGHT_GRAD),
    64: B(G(128, 64, 8, 4, 4), G(128, 64, 8, 4, 4), _MID_LOAD_WEIGHT_GRAD, _MID_LOAD_WEIGHT_GRAD),
    128: B(G(128, 64, 8, 8, 4), G(256, 64, 8, 8, 4), W(128, 256, 64, 8, 8, 5), W(128, 256, 64, 8, 8, 5)),
}
# 99 KB: two pipeline buffers of at most 64 KB, as in the forward's table.
_BACKWARD_SMALL_SMEM = {
    16: _BACKWARD_LARGE_SMEM[16],
    32: B(G(64, 64, 1, 4, 3), G(128, 64, 1, 4, 3), _SMALL_LOAD_WEIGHT_GRAD, _SMALL_LOAD_WEIGHT_GRAD),
    64: B(G(64, 64, 8, 4, 3), G(128, 64, 8, 4, 3), _MID_LOAD_WEIGHT_GRAD, _MID_LOAD_WEIGHT_GRAD),
    128: B(G(64, 64, 8, 8, 3), G(128, 64, 8, 8, 3), _MID_LOAD_WEIGHT_GRAD, _MID_LOAD_WEIGHT_GRAD),
}
_FP32_WEIGHT_GRAD = W(64, 64, 32, 8, 4, 4)
_BACKWARD_FP32 = {
    16: B(G(32, 64, 1, 4, 3), G(64, 64, 1, 4, 3), _FP32_WEIGHT_GRAD, _FP32_WEIGHT_GRAD),
    64: B(G(64, 32, 8, 4, 3), G(128, 32, 8, 8, 3), _FP32_WEIGHT_GRAD, _FP32_WEIGHT_GRAD),
}
# BACKWARD[family][element bytes][forward BLOCK_M]. On Hopper the prefill tiles read their dense
# operands through tensor descriptors (`BackwardConfig.tma`): the same bits as pointer loads,
# faster on an H100 (Mixtral-8x7B at 16k tokens, dW2 alone: 6.16 against 7.65 ms). There
# grad_gate_up keeps six stages (192 KB): alone at 16k tokens, 1.325 -> 1.211 ms on
# Qwen3-30B-A3B, 1.683 -> 1.559 on OLMoE-1B-7B, 1.747 -> 1.650 on DeepSeek-V2-Lite against
# four, Mixtral-8x7B within 0.4%; wider tiles (BLOCK_N 256) and 128-deep K steps are slower
# (out of tree, H100).
# The Gluon grad_gate_up (gluon_stages) runs at every prefill shape: alone, inside forward+backward on
# an H200 (benchmarks/results/moe_grad_gate_up_gluon_coop/, the Triton kernel in the same run),
# Triton -> Gluon at 16k tokens: Qwen3-30B-A3B 1.091 -> 0.908 ms, DeepSeek-V2-Lite 1.512 -> 1.286,
# OLMoE-1B-7B 1.372 -> 1.183; at 4096 0.333 -> 0.321, 0.424 -> 0.394 and 0.389 -> 0.339; Mixtral-8x7B
# 8.22 -> 7.38 at 16k and 2.06 -> 1.90 at 4096. The same d x, d w1 and d w2 bits, the router logits'
# gradients within 3e-7 (d topk_weights sums its rows in another order). Three stages are all that
# fit beside the epilogue's buffers.
# The Gluon weight-gradient kernel (gluon_weight_grad_stages; its three buffers, 213 KB with its
# output's, are all that fit) runs at every prefill shape: d w1 and d w2 alone, inside
# forward+backward on an H200 (benchmarks/results/moe_weight_grad_gluon.json, the Triton kernels
# alternating with it in the same run, the same bits of every output and gradient), Triton -> Gluon:
# Qwen3-30B-A3B at 4096 tokens 1.105 -> 0.806 ms, at 16k 2.55-2.66 -> 2.25-2.27, DeepSeek-V2-Lite
# at 16k 3.53-3.65 -> 2.92-3.00, OLMoE-1B-7B 3.14-3.26 -> 2.87-2.89 (its d w2 0.87-0.89 -> 0.95-0.96),
# Mixtral-8x7B at 8192 9.66-9.81 -> 9.60-9.77 (d w1 6.20-6.30 against the gather_x kernel's
# 6.53-6.69, d w2 3.41-3.45 -> 3.07-3.09: its BACKWARD_GATHER_X entry keeps the Triton d w1).
# The whole layer's step replayed from a CUDA graph:
# 2.84-2.86 -> 2.57-2.58 ms at 4096 tokens on Qwen3-30B-A3B, 10.53-10.60 -> 10.01-10.02 on
# DeepSeek-V2-Lite at 16k (moe_weight_grad_gluon/wg_prof.json).
# It runs on the 64-row layout's entry too (an expert's rows are whole 64-row K steps), where the
# Triton kernels' short K (an expert's 33-96 rows) leaves them writing their tiles one program at a
# time: both weight gradients in the forward+backward on an H200 (benchmarks/results/
# moe_weight_grad_small/, the same bits), Mixtral-8x7B at 256 tokens 1.68 -> 0.86 ms (the layer
# 3.41 -> 2.60), Qwen3-30B-A3B at 1024 and 1536 0.72 -> 0.38 and 0.81 -> 0.44, DeepSeek-V2-Lite at
# 1024 0.74 -> 0.39.
_HOPPER_BACKWARD = {**_BACKWARD_LARGE_SMEM,
                    64: replace(_BACKWARD_LARGE_SMEM[64], gluon_weight_grad_stages=3),
                    128: replace(_BACKWARD_LARGE_SMEM[128], grad_gate_up=G(128, 64, 8, 8, 6), tma=True,
                                 gluon_stages=3, gluon_weight_grad_stages=3)}
BACKWARD = {
    90: {2: _HOPPER_BACKWARD, 4: _BACKWARD_FP32},
    80: {2: _BACKWARD_LARGE_SMEM, 4: _BACKWARD_FP32},
    89: {2: _BACKWARD_SMALL_SMEM, 4: _BACKWARD_FP32},
}
# Where the experts are wider than the model (H < I: Mixtral-8x7B) and take at least
# GATHER_X_MIN_LOAD pairs each, BACKWARD_GATHER_X[family][element bytes][forward BLOCK_M] replaces
# the entry: dW1 reads x copied into layout order
# (gather_x) in 128 x 256 tiles, 3 stages, instead of gathering x by token (a gathered operand
# pipelines at most 3 loads deep, dense descriptor loads all the stages). The copy, (rows, H),
# is then small beside the (rows, 2I) d [gate, up] and the (E, 2I, H) dW1 alive with it. H100,
# bf16, forward+backward, the two alternating in one process (out of tree): Mixtral 1.08x at
# 4096 and 16k tokens, for +2% and +0% of the layer's peak memory; dW1 and its copy alone
# 17.3 -> 11.8 + 0.15 ms at 16k tokens, 2.48 -> 2.16 + 0.02 at 2048. Where H >= I the copy
# costs more of the peak than it saves time: DeepSeek-V2-Lite 1.03x for +2-10%, Qwen3-30B-A3B
# 1.01-1.02x for +14-31%, OLMoE-1B-7B 1.02-1.04x for +1-17%; those keep the gathering kernel.
# Against the Gluon kernel's d w1 (the entry it replaces) on an H200, Mixtral-8x7B: 5% faster at
# 2048 pairs an expert (8192 tokens; moe_weight_grad_gluon.json), slower below: the copy and d w1
# 4.01 against 3.65 ms at 1024 pairs, 2.31 against 1.98 at 512, 1.53 against 1.20 at 256, and
# 1.26 against 0.81 at 128 (moe_weight_grad_small/, d w2 subtracted).
GATHER_X_MIN_LOAD = 2048
BACKWARD_GATHER_X = {90: {2: {128: replace(_HOPPER_BACKWARD[128], grad_w1=W(128, 256, 64, 8, 8, 3), gather_x=True,
                                           gluon_weight_grads=("grad_w2",))}}}
del G, B, W

# The largest BLOCK_M of any table (bounds the padding rows of the sorted layout).
MAX_BLOCK_M = 128

# Calls of at most this many tokens are "decode" in reports (the definition); their
# configuration comes from the same table, by load per expert.
DECODE_MAX_TOKENS = 64

# gather_rows_kernel (BackwardConfig.gather_x): (rows, columns) of x a program copies, and its warps.
GATHER_ROWS_TILE = (32, 128)
GATHER_ROWS_WARPS = 4

# Routing and dispatch tiles. The expert dimension is padded to MAX_EXPERTS in the count and
# align kernels (one build covers every E); tiles of (DISPATCH_ROWS, MAX_EXPERTS) hold ROUTE_TILE
# elements: count-table rows per load, blocks per block-table step.
MAX_EXPERTS = 256
MAX_TOP_K = 8
ROUTE_TILE = 4096
DISPATCH_ROWS = ROUTE_TILE // MAX_EXPERTS
# The routing launch pads the experts only to the next power of two of E, at least 16. A launch
# that builds the whole layout itself ("one_token", "full": small calls, ONE_LAUNCH_TOKENS) runs
# 1 warp for one token, 8 for more. H100, the launch alone, 20 in a CUDA graph,
# against E_PAD 256 and 4 warps: Qwen3-30B-A3B (E 128, k 8) T = 1 4.3 -> 3.9 us, T = 4 12.8 -> 8.1,
# T = 64 47.0 -> 29.5; DeepSeek-V2-Lite (64, 6) T = 1 4.1 -> 3.3, T = 4 10.7 -> 5.6, T = 64
# 36.2 -> 17.6; Mixtral (8, 2) T = 1 3.0 -> 2.8, T = 4 8.4 -> 4.0, T = 64 20.7 -> 7.3; the same
# bits (`bench/sweeps/moe_decode.py route`, benchmarks/results/moe_decode/route_sweep.txt).
ROUTE_EXPERT_PADS = (16, 32, 64, 128, 256)
# Routing alone ("none": larger calls, whose layout a count and an align launch then build, and
# calls without a layout) spreads the tokens over programs of ROUTE_PROGRAM_ROWS rows, 4 warps
# each. H200, bf16 logits, the routing launch against 128-token chunks of 16-row steps (the
# chunks' expert counts written by the routing program, so one program a chunk): Qwen3-30B-A3B
# T = 256 37.9 -> 5.4 us, T = 16384 38.7 -> 16.0 (+ 2.1 for the count launch); DeepSeek-V2-Lite
# 31.2 -> 3.1 and 31.9 -> 7.3; Mixtral 32.8 -> 2.0 and 35.0 -> 3.1, the same bits
# (benchmarks/results/moe_routing/route_exp.txt).
ROUTE_PROGRAM_ROWS = 32
# A single token (decode at batch 1) is routed as a one-row tile, and its layout written from
# its k picks without the counting sort ("one_token"). H100, bf16, T = 1: the routing launch
# 10.7 -> 4.3 us on Qwen3-30B-A3B (a profile of the launches), the whole layer in a CUDA graph
# 57.4 -> 52.3 us, OLMoE 65.6 -> 60.7, Mixtral 270 -> 262 (`bench moe`, moe.json's graph
# column, before and after). Its weights may differ from a batched token's in the last fp32
# bit (the row sums in another order), as the expert GEMMs' tiles already differ between
# batch sizes.


def route_layout(num_tokens: int, top_k: int) -> str:
    """What the routing launch of a call that needs the layout writes besides the picks: the
    whole layout ("one_token", "full"), or nothing ("none": count and align launches build it)."""
    if num_tokens == 1:
        return "one_token"
    one_launch = num_tokens <= ONE_LAUNCH_TOKENS or num_tokens * top_k <= ONE_LAUNCH_PAIRS
    return "full" if one_launch else "none"


def route_rows(layout: str, expert_pad: int) -> int:
    """Token rows per routing step of the routing launch building `layout` with experts padded to
    expert_pad ("none": at most ROUTE_TILE scores, at most a program's rows)."""
    if layout == "one_token":
        return 1
    return min(ROUTE_TILE // expert_pad, ROUTE_PROGRAM_ROWS) if layout == "none" else DISPATCH_ROWS


# The routing's backward (`route_backward_kernel`) holds a few more (rows, E_PAD) fp32 tiles than
# the routing: half ROUTE_TILE's scores a program keep it within 4 warps' registers (sm80-sm90).
ROUTE_BACKWARD_TILE = ROUTE_TILE // 2


def route_backward_rows(expert_pad: int) -> int:
    """Token rows a program of the routing's backward takes, experts padded to expert_pad."""
    return min(ROUTE_BACKWARD_TILE // expert_pad, ROUTE_PROGRAM_ROWS)


def route_program_tokens(layout: str, num_tokens: int) -> int:
    """Tokens a program of the routing launch building `layout` for num_tokens tokens routes."""
    return ROUTE_PROGRAM_ROWS if layout == "none" else num_tokens


def route_expert_pad(num_experts: int) -> int:
    """E_PAD of a routing launch for num_experts experts."""
    return next(pad for pad in ROUTE_EXPERT_PADS if pad >= num_experts)


def route_warps(layout: str) -> int:
    """Warps of the routing launch building `layout`."""
    return {"one_token": 1, "full": 8}.get(layout, DISPATCH_WARPS)


# Pairs ranked per counting-sort step (a PAIRS x PAIRS comparison) and counted per histogram.
SORT_PAIRS = 64
COUNT_TILE = 1024
DISPATCH_WARPS = 4
DISPATCH_STAGES = 1
# Calls of at most ONE_LAUNCH_TOKENS tokens, or ONE_LAUNCH_PAIRS token-expert pairs, are routed
# and laid out by one program in one launch; larger ones by routing, count and align launches.
# H200, routing with the layout in CUDA graphs, one launch -> three: Qwen3-30B-A3B T = 32 17.6 ->
# 23.9 us, T = 64 27.6 -> 21.7, T = 128 46.9 -> 19.7; DeepSeek-V2-Lite 10.5 -> 15.7, 17.5 -> 15.3,
# 29.9 -> 14.6; Mixtral (k 2) 4.4 -> 7.1, 7.0 -> 9.0, 12.3 -> 9.2 (moe_routing/one_launch.txt).
# The layout is built in chunks of at least CHUNK_TOKENS tokens, at most MAX_CHUNKS of them
# (each align program reads the whole (chunks, E_PAD) count table). H200, count + align launches
# against 128-token chunks: Qwen3-30B-A3B T = 256 35.2 -> 12.4 us, T = 4096 31.1 -> 16.7;
# DeepSeek-V2-Lite 26.2 -> 9.5 and 25.0 -> 15.0; Mixtral 11.0 -> 6.3 and 12.1 -> 11.8; at 16k
# tokens the chunks are 128 tokens either way (benchmarks/results/moe_routing/align_exp.txt).
ONE_LAUNCH_TOKENS = 32
ONE_LAUNCH_PAIRS = 128
CHUNK_TOKENS = 32
MAX_CHUNKS = 128
# Combine tile: BLOCK_T tokens x BLOCK_H columns, reading top_k rows of y for each.
COMBINE_BLOCK_T = 8
COMBINE_BLOCK_H = 256
COMBINE_WARPS = 4
COMBINE_STAGES = 1

# The gated activations of the expert kernels: SwiGLU, GeGLU (tanh approximation) and gpt-oss's
# clamped SwiGLU (`_kernels/grouped_gemm._clamped_swiglu`), with the constants transformers'
# GptOssExperts and vLLM's swigluoai use.
ACTIVATIONS = ("silu", "gelu", "swiglu_oai")
SWIGLU_OAI_ALPHA, SWIGLU_OAI_LIMIT = 1.702, 7.0
_TRITON_DTYPES = {2: ("fp16", "bf16"), 4: ("fp32",)}


FP8_GROUP = 128  # FP8 scale groups: activations per row and 128 columns, weights per 128 x 128 block


@dataclass(frozen=True)
class FP8Config:
    """Tiling of the FP8 expert GEMMs (`_kernels/fp8.py`): BLOCK_K and the gate/up BLOCK_N are the
    128-column quantisation group; the down BLOCK_N divides 128 or is 128, so H and I multiples of
    128 need no mask."""

    block_m: int
    group_m: int
    gate_up_warps: int
    down_warps: int
    num_stages: int
    down_block_n: int = 128
    # The Gluon kernels (`_kernels/fp8_gluon.py`, sm90): block_m 128, the warps and tiles fixed
    # there; num_stages for both GEMMs.
    gluon: bool = False
    # As ExpertsConfig.pdl: the launches chain as programmatic dependents (sm90).
    pdl: bool = False
    # The products transposed, weight tiles on the MMA's M side (`_kernels/fp8.py`'s `_product`):
    # FP8 wgmma on Hopper at BLOCK_M below 64.
    swap_ab: bool = False
    # The down GEMM's K (I) split over this many programs a tile where its tiles are fewer than
    # the SMs (`fp8_down_split`), each writing fp32 partial sums that the combine adds in a fixed
    # order.
    down_split_k: int = 1

    def __str__(self) -> str:
        if self.gluon:
            return f"gluon BLOCK_M={self.block_m} GROUP_M={self.group_m} stages={self.num_stages}"
        return (f"BLOCK_M={self.block_m} GROUP_M={self.group_m} warps={self.gate_up_warps}/{self.down_warps} "
                f"stages={self.num_stages} down BLOCK_N={self.down_block_n}"
                + (f" down split_k={self.down_split_k}" if self.down_split_k > 1 else "")
                + (" swap_ab" if self.swap_ab else "")
                + (" pdl" if self.pdl else ""))


# FP8[family]: ((most pairs per expert, config), ...) as EXPERTS. A gate/up stage holds a
# BLOCK_M x 128 FP8 A tile and a 256 x 128 B tile (gate and up interleaved): 40 KB at BLOCK_M 64.
# Each K step's product is scaled before it is added, so the gate/up kernel holds two BLOCK_M x
# 256 fp32 tiles: eight warps from BLOCK_M 32, and BLOCK_M at most 64, keep ptxas from spilling.
# Moving the prefill entry's weight tiles (and down's h tiles) through TMA descriptors, as the 16-bit
# prefill entries do, measured within run-to-run noise on an H100 (1-2% either way at 4k-16k
# tokens; benchmarks/results/moe_fp8_tma_trial.json against the pointer loads' run of the same
# day), so the pointer loads stay: what bounds these kernels is the scaling of every K step's
# product before it is added (a wait on each product and two BLOCK_M x 256 fp32 tiles of FMAs),
# not the loads; the Gluon entry below hides that scaling.
# Decode (at most 8 pairs an expert) on Hopper: eight gate/up warps, four stages and 64-column
# down tiles (twice the programs, where one or two experts' down projection would fill half the
# SMs) measured 7-10% faster at T = 1 and 1-3% at T = 16 than (16, 1, 4, 4, 3) with 128-column
# tiles, in CUDA graphs on an H100 for Mixtral-8x7B, Qwen3-30B-A3B and DeepSeek-V2-Lite
# (Mixtral T = 1: 182.5 -> 166.3 us), with the same bits; the sweep tried down tiles of
# 32, 64 and 128 columns, 3, 4 and 6 stages, 4 and 8 warps.
_FP8_DECODE = FP8Config(16, 1, 8, 4, 4, 64)
_FP8_PREFILL = FP8Config(64, 8, 8, 4, 4)
_FP8_LARGE = ((8, _FP8_DECODE), (32, FP8Config(32, 1, 8, 4, 3)), (None, _FP8_PREFILL))
_FP8_SMALL = ((8, FP8Config(16, 1, 4, 4, 3)), _FP8_LARGE[1], (None, FP8Config(64, 8, 8, 4, 3)))
# Hopper past 128 pairs an expert: the Gluon kernels (`_kernels/fp8_gluon.py`), which scale
# each step's product while the next one runs. Whole layer against the Triton entry on an H200
# (block scales, benchmarks/results/moe_fp8_gluon_ab.json): Qwen3-30B-A3B 1.03x at 128 pairs an
# expert (T = 2048; 0.95x with per-channel scales, so that load stays on Triton), 1.15-1.21x at
# 256-1024; DeepSeek-V2-Lite 0.69x at 96 (their 128-row blocks are a quarter padding there),
# 1.04x at 192, 1.19-1.24x at 384-1536; Mixtral-8x7B 1.16-1.33x at 256-8192. Five stages and
# GROUP_M 8 were the fastest or within 1% of it among 3-5 stages and GROUP_M 4-32 at 4096 and 16k
# tokens (moe_fp8_gluon_tune.json). Where the weights are not TMA-addressable the Triton prefill
# entry serves instead.
FP8_GLUON_PREFILL = FP8Config(128, 8, 4, 4, 5, gluon=True)
# Hopper up to 32 pairs an expert: the products transposed (swap_ab: FP8 wgmma on the weight tiles
# instead of mma.sync on both operands converted to fp16), and at decode the down GEMM's K split in
# two where one or two experts of a wide layer hold the work (`fp8_down_split`). Swept and A/B-timed
# on an H200 in CUDA graphs (benchmarks/results/moe_fp8_decode_swap_ab/): against the entries
# before, (16, 1, 8, 4, 4, 64) and (32, 1, 8, 4, 3, 128) in the plain orientation, Mixtral-8x7B
# T = 1 0.88x the time (0.58x the 16-bit layer), T = 16 0.96x, T = 64 0.89x; Qwen3-30B-A3B and
# DeepSeek-V2-Lite T = 1 0.93-0.95x, T = 256 0.91-0.93x, T = 4-64 1.00-1.02x. Six stages and
# 128-column down tiles measured 2-4% slower than four and 64 at T = 4 for those two. The decode
# entry chains its launches as the 16-bit one (within 0.5%, benchmarks/results/moe_decode_pdl/),
# the tokens' quantisation beside the routing (`fp8._quantized_tokens`): 1.7-2.0 us less a layer at
# T = 1-16, Qwen3-30B-A3B T = 1 28.6 -> 26.6 us (benchmarks/results/moe_fp8_quant_pdl/).
_FP8_HOPPER = (((8, replace(_FP8_DECODE, swap_ab=True, down_split_k=2, pdl=PDL_AVAILABLE)),
                (32, FP8Config(32, 1, 8, 4, 4, 128, swap_ab=True)))
               + ((128, _FP8_PREFILL), (None, FP8_GLUON_PREFILL)))
# sm80 runs no FP8 on the GPU (the launcher refuses it); its entry serves Triton's interpreter.
FP8 = {90: _FP8_HOPPER, 89: _FP8_SMALL, 80: _FP8_LARGE}
FP8_TRITON_FALLBACK = {90: _FP8_PREFILL}
FP8_QUANTIZE_ROWS = 16  # token rows a program quantises (one group each)
FP8_GATHER_ROWS = 32  # layout rows a program copies (every group) for the Gluon GEMMs


def family_of(capability: int) -> int:
    """The configuration family (90, 80 or 89) of a compute capability."""
    return DeviceInfo("", capability, 1, SHARED_MEMORY_PER_BLOCK[capability], 0).arch_family


def pairs_per_expert(num_tokens: int, top_k: int, num_experts: int) -> int:
    return -(-num_tokens * top_k // num_experts)


# Choices measured by `experts.tune` on this process's GPU, by (family, element size, E, H, I,
# top_k, load bucket bound); they take precedence over the table for calls of that shape and
# bucket. The tuner only picks among the table's configurations, so `builds.shipped_builds` covers them.
TUNED: dict = {}


def load_bound(table, num_tokens: int, top_k: int, num_experts: int):
    """The bound of the table entry a call falls in (None for the last, unbounded entry)."""
    load = pairs_per_expert(num_tokens, top_k, num_experts)
    return next(bound for bound, _ in table if bound is None or load <= bound)


def experts_config(device: DeviceInfo, element_size: int, num_tokens: int, top_k: int, num_experts: int,
                   hidden: int, inter: int) -> ExpertsConfig:
    """The configuration for a call on `device` with inputs of `element_size` bytes: a tuned
    choice for this shape if `experts.tune` made one, else the table's entry for its load."""
    table = EXPERTS[device.arch_family][element_size]
    bound = load_bound(table, num_tokens, top_k, num_experts)
    tuned = TUNED.get((device.arch_family, element_size, num_experts, hidden, inter, top_k, bound))
    return tuned or next(cfg for b, cfg in table if b == bound)


def backward_config(device: DeviceInfo, element_size: int, block_m: int, hidden: int, inter: int,
                    load: int) -> BackwardConfig:
    """The backward's tiling on `device` for inputs of `element_size` bytes laid out in blocks of
    `block_m` rows by the forward, with `hidden` (H) and `inter` (I) the experts' widths and `load`
    pairs an expert on average (`pairs_per_expert`)."""
    if hidden < inter and load >= GATHER_X_MIN_LOAD:
        gather_x = BACKWARD_GATHER_X.get(device.arch_family, {}).get(element_size, {}).get(block_m)
        if gather_x is not None:
            return gather_x
    return BACKWARD[device.arch_family][element_size][block_m]


def path_name(num_tokens: int) -> str:
    return "decode" if num_tokens <= DECODE_MAX_TOKENS else "prefill"


def chunk_tokens(num_tokens: int) -> int:
    """Tokens per dispatch chunk: CHUNK_TOKENS, or a larger power of two past MAX_CHUNKS chunks."""
    per_chunk = -(-num_tokens // MAX_CHUNKS)
    return max(CHUNK_TOKENS, 1 << (per_chunk - 1).bit_length())


def experts_configs(capability: int):
    """Every (element size, config) the experts dispatcher can pick on `capability`."""
    for element_size, table in EXPERTS[family_of(capability)].items():
        for cfg in dict.fromkeys(cfg for _, cfg in table):
            yield element_size, cfg


def backward_configs(capability: int):
    """Every (element size, forward BLOCK_M, BackwardConfig) the backward can pick on `capability`."""
    for table in (BACKWARD, BACKWARD_GATHER_X):
        for element_size, by_block_m in table.get(family_of(capability), {}).items():
            for block_m, cfg in by_block_m.items():
                yield element_size, block_m, cfg


def fp8_config(device: DeviceInfo, num_tokens: int, top_k: int, num_experts: int,
               gluon_ok: bool = True) -> FP8Config:
    """The FP8 tiling for a call on `device`, by its load (pairs per expert); a Gluon entry only
    where the call suits those kernels (`gluon_ok`: weights contiguous and 16-byte aligned) and
    kernels run on the GPU."""
    table = FP8[device.arch_family]
    bound = load_bound(table, num_tokens, top_k, num_experts)
    cfg = next(cfg for b, cfg in table if b == bound)
    if cfg.gluon and not (gluon_ok and not interpreter_active()):
        return FP8_TRITON_FALLBACK[device.arch_family]
    return cfg


FP8_DOWN_SPLIT_MIN_STEPS = 16  # K steps of 128 each split of the down GEMM keeps at least


def fp8_down_split(cfg: FP8Config, device: DeviceInfo, num_tokens: int, top_k: int, num_experts: int, hidden: int,
                   inter: int) -> int:
    """How many programs share each down tile's K: the entry's down_split_k where the launch has
    fewer tiles than `device` has SMs (at most min(T k, E) experts' H / BLOCK_N tiles: one or two
    experts of a wide layer at decode, as Mixtral-8x7B's at T = 1) and every split keeps
    FP8_DOWN_SPLIT_MIN_STEPS K steps, else 1."""
    tiles = min(num_tokens * top_k, num_experts) * (hidden // cfg.down_block_n)
    steps = inter // FP8_GROUP
    if tiles < device.sm_count and steps >= cfg.down_split_k * FP8_DOWN_SPLIT_MIN_STEPS:
        return cfg.down_split_k
    return 1


def fp8_configs(capability: int):
    """Every FP8 config the dispatcher can pick on `capability` (none below sm89)."""
    if capability < 89:
        return
    family = family_of(capability)
    picks = [cfg for _, cfg in FP8[family]]
    if family in FP8_TRITON_FALLBACK:
        picks.append(FP8_TRITON_FALLBACK[family])
    yield from dict.fromkeys(picks)
