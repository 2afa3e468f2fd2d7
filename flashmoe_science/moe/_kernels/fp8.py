"""The FP8 (e4m3) expert GEMMs, w8a8: the same expert-sorted layout and tiles as grouped_gemm.py,
with both operands of every product in FP8 and fp32 accumulation.

Scales (fp32): activations per row and group of GROUP = 128 columns (`quantize_groups_kernel`
for the tokens; the gate/up epilogue for the intermediate h, whose column tile is one group);
weights either per 128 x 128 block (w_scale (E, N / 128, K / 128), DeepSeek-V3's format, applied
in the main loop: each K step of 128 is one block) or per output channel (w_scale (E, N), applied
in the epilogue). A K step's product is scaled by its row scales (and block scales) before it is
added to the accumulator.

gate_up_fp8_kernel: h = act(x @ w1[e, :I].T) * (x @ w1[e, I:].T) with x gathered from the FP8
tokens, written in FP8 with one scale per row and group (BLOCK_N = GROUP columns a program).
down_fp8_kernel: y[p] = w[p] * (h[row] @ w2[e].T), in the output dtype, each row at its pair's
slot for the combine (combine.py), as down_kernel.

H and I are multiples of GROUP (the launcher checks), so no K or N mask is needed.
"""
import triton
import triton.language as tl

from ... import float8
from ...dependent_launch import chain_end, chain_start, release_dependents
from ...float8 import to_e4m3
from .grouped_gemm import _expert_tile_ptrs, _gated_activation, _tile, _tile_of
from .offsets import wide_offset

FP8_MAX = tl.constexpr(float8.FP8_MAX)
# The smallest scale: a row group of zeros (or a padding row) quantises to zeros, never 0 / 0.
MIN_SCALE = tl.constexpr(1e-12)


@triton.jit
def _quantize_rows(values):
    """(values / s in FP8, rounded to nearest even, s) with s = max |value| of each row / FP8_MAX.
    On the GPU the hardware's conversion rounds (the same values as `float8.round_to_e4m3`, bar
    the sign of zeros, at 0.37x its time: 26 against 71 us for 16k x 2048 tokens on an H200,
    benchmarks/results/moe_routing/route_exp.txt)."""
    scale = tl.maximum(tl.max(tl.abs(values), axis=1) / FP8_MAX, MIN_SCALE)
    return to_e4m3(values / scale[:, None]), scale


@triton.jit
def quantize_groups_kernel(x_ptr, q_ptr, s_ptr, T, H, stride_xt, BLOCK_T: tl.constexpr, GROUP: tl.constexpr,
                           PDL: tl.constexpr):
    """x: (T, H), row stride stride_xt; q: (T, H) FP8 contiguous; s: (T, H / GROUP) fp32.
    PDL: launched as a programmatic dependent of the routing launch, whose outputs it does not
    read: it lets the gate/up GEMM launch and quantises while the routing runs, then waits for it
    (`dependent_launch.chain_end`)."""
    release_dependents(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    ok = (rows < T)[:, None]
    x = tl.load(x_ptr + wide_offset(rows, stride_xt)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    q, scale = _quantize_rows(x)
    tl.store(q_ptr + wide_offset(rows, H)[:, None] + cols[None, :], q, mask=ok)
    tl.store(s_ptr + wide_offset(rows, H // GROUP) + tl.program_id(1), scale, mask=rows < T)
    chain_end(PDL)


@triton.jit
def _weight_scales(ws_ptr, expert, stride_se, stride_sn, offs_n, kb, BLOCK_SCALES: tl.constexpr, GROUP: tl.constexpr):
    """The weight scales of output columns offs_n: of K block kb (block scales) or per channel."""
    if BLOCK_SCALES:
        return tl.load(ws_ptr + wide_offset(expert, stride_se) + (offs_n // GROUP) * stride_sn + kb)
    return tl.load(ws_ptr + wide_offset(expert, stride_se) + offs_n * stride_sn)


@triton.jit
def _product(a, w, SWAP_AB: tl.constexpr):
    """One K step's product a (BLOCK_M, K) @ w (K, N): as (BLOCK_M, N), or with SWAP_AB its
    transpose (N, BLOCK_M) = w.T @ a.T, the weight tile on the MMA's M side and the token rows on
    its N side. Hopper's FP8 wgmma needs 64 rows on the M side: the plain order pads a decode
    block's few tokens to 64 rows or, below 64, runs mma.sync with both operands converted to
    fp16 each step; the swapped order runs wgmma on the FP8 tiles with N = BLOCK_M >= 8."""
    if SWAP_AB:
        product = tl.dot(tl.trans(w), tl.trans(a))
    else:
        product = tl.dot(a, w)
    return product


@triton.jit
def _per_row(scale, SWAP_AB: tl.constexpr):
    """Token rows' scales (BLOCK_M,) broadcast over a product in the orientation of `_product`."""
    if SWAP_AB:
        along = scale[None, :]
    else:
        along = scale[:, None]
    return along


@triton.jit
def _per_column(scale, SWAP_AB: tl.constexpr):
    """Weight columns' scales (N,) broadcast over a product in the orientation of `_product`."""
    if SWAP_AB:
        along = scale[:, None]
    else:
        along = scale[None, :]
    return along


@triton.jit
def _add_scaled(acc, product, a_scale, ws_ptr, expert, stride_se, stride_sn, offs_n, kb, BLOCK_SCALES: tl.constexpr,
                GROUP: tl.constexpr, SWAP_AB: tl.constexpr):
    """acc + one K block's product scaled by its row scales (and, with block scales, the weight
    block's column scales)."""
    scaled = product * _per_row(a_scale, SWAP_AB)
    if BLOCK_SCALES:
        w_scale = _weight_scales(ws_ptr, expert, stride_se, stride_sn, offs_n, kb, BLOCK_SCALES, GROUP)
        scaled = scaled * _per_column(w_scale, SWAP_AB)
    return acc + scaled


@triton.jit
def _channel_scaled(acc, ws_ptr, expert, stride_se, stride_sn, offs_n, BLOCK_SCALES: tl.constexpr,
                    GROUP: tl.constexpr, SWAP_AB: tl.constexpr):
    """The accumulator (BLOCK_M, N) times the per-channel weight scales (unchanged with block
    scales); with SWAP_AB the accumulator comes transposed and leaves untransposed."""
    if SWAP_AB:
        acc = tl.trans(acc)
    if BLOCK_SCALES:
        return acc
    return acc * _weight_scales(ws_ptr, expert, stride_se, stride_sn, offs_n, 0, BLOCK_SCALES, GROUP)[None, :]


@triton.jit(do_not_specialize=["num_blocks_m", "top_k"])
def gate_up_fp8_kernel(
    xq_ptr, xs_ptr, w1_ptr, w1s_ptr, hq_ptr, hs_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    num_blocks_m, H, I, top_k,
    stride_we, stride_wn, stride_se, stride_sn,
    ACTIVATION: tl.constexpr, BLOCK_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, GROUP_M: tl.constexpr, GROUP: tl.constexpr, SWAP_AB: tl.constexpr, PDL: tl.constexpr,
):
    """xq: (T, H) FP8, xs: (T, H / GROUP) fp32; w1: (E, 2I, H) FP8, strides (stride_we,
    stride_wn, 1); w1s: (E, 2I / GROUP, H / GROUP) (block) or (E, 2I) (channel), strides
    (stride_se, stride_sn, 1); hq: (num_blocks_m * BLOCK_M, I) FP8, hs: (rows, I / GROUP).
    SWAP_AB: products transposed (`_product`). PDL: launched as a programmatic dependent
    (`dependent_launch`)."""
    chain_start(PDL)
    expert, rows, row_ok, pairs, pid_n = _tile(sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, num_blocks_m, I,
                                               BLOCK_M, GROUP, GROUP_M)
    if expert < 0:
        return
    tokens = pairs // top_k
    offs_k = tl.arange(0, GROUP)
    x_ptrs = xq_ptr + wide_offset(tokens, H)[:, None] + offs_k[None, :]
    xs_ptrs = xs_ptr + wide_offset(tokens, H // GROUP)
    # Gate and up rows of the same columns interleaved in one B tile, as gate_up_kernel.
    offs_c = tl.arange(0, 2 * GROUP)
    w_rows = (offs_c % 2) * I + pid_n * GROUP + offs_c // 2
    w_ptrs = _expert_tile_ptrs(w1_ptr, expert, stride_we, w_rows, stride_wn, offs_k, 1)
    acc = tl.zeros((2 * GROUP, BLOCK_M) if SWAP_AB else (BLOCK_M, 2 * GROUP), dtype=tl.float32)
    for kb in range(0, H // GROUP):
        a = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
        a_scale = tl.load(xs_ptrs + kb, mask=row_ok, other=0.0)
        acc = _add_scaled(acc, _product(a, tl.load(w_ptrs), SWAP_AB), a_scale, w1s_ptr, expert, stride_se, stride_sn,
                          w_rows, kb, BLOCK_SCALES, GROUP, SWAP_AB)
        x_ptrs += GROUP
        w_ptrs += GROUP
    acc = _channel_scaled(acc, w1s_ptr, expert, stride_se, stride_sn, w_rows, BLOCK_SCALES, GROUP, SWAP_AB)
    gate, up = tl.split(tl.reshape(acc, (BLOCK_M, GROUP, 2)))
    h, h_scale = _quantize_rows(_gated_activation(gate, up, ACTIVATION))
    offs_n = pid_n * GROUP + tl.arange(0, GROUP)
    tl.store(hq_ptr + wide_offset(rows, I)[:, None] + offs_n[None, :], h)
    tl.store(hs_ptr + wide_offset(rows, I // GROUP) + pid_n, h_scale)


@triton.jit(do_not_specialize=["num_blocks_m", "num_pairs"])
def down_fp8_kernel(
    hq_ptr, hs_ptr, w2_ptr, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    num_blocks_m, num_pairs, H, I,
    stride_we, stride_wn, stride_se, stride_sn,
    BLOCK_SCALES: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr, GROUP: tl.constexpr, SPLIT_K: tl.constexpr,
    SWAP_AB: tl.constexpr, PDL: tl.constexpr,
):
    """hq: (num_blocks_m * BLOCK_M, I) FP8, hs: (rows, I / GROUP) fp32; w2: (E, H, I) FP8,
    strides (stride_we, stride_wn, 1); w2s: (E, H / GROUP, I / GROUP) (block) or (E, H)
    (channel); weights: (num_pairs = T * top_k,) fp32; y: (num_pairs, H) contiguous, the output
    dtype, or with SPLIT_K > 1 (SPLIT_K, num_pairs, H) fp32: SPLIT_K programs a tile, program s
    adding the s-th run of K steps and writing its partial rows to y[s] (the combine adds them).
    BLOCK_N divides GROUP or is a multiple of it. SWAP_AB: products transposed (`_product`). PDL:
    launched as a programmatic dependent (`dependent_launch`)."""
    chain_start(PDL)
    expert, rows, row_ok, pairs, pid_n = _tile_of(tl.program_id(0) // SPLIT_K, sorted_pairs_ptr, block_expert_ptr,
                                                  block_rows_ptr, num_blocks_m, H, BLOCK_M, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    if SPLIT_K == 1:
        first = 0
        last = I // GROUP
    else:  # K steps a split adds: the last split may add fewer, or none
        steps = tl.cdiv(I // GROUP, SPLIT_K)
        first = (tl.program_id(0) % SPLIT_K) * steps
        last = tl.minimum(first + steps, I // GROUP)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = first * GROUP + tl.arange(0, GROUP)
    h_ptrs = hq_ptr + wide_offset(rows, I)[:, None] + offs_k[None, :]
    hs_ptrs = hs_ptr + wide_offset(rows, I // GROUP)
    w_ptrs = _expert_tile_ptrs(w2_ptr, expert, stride_we, offs_n, stride_wn, offs_k, 1)
    acc = tl.zeros((BLOCK_N, BLOCK_M) if SWAP_AB else (BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(first, last):
        acc = _add_scaled(acc, _product(tl.load(h_ptrs), tl.load(w_ptrs), SWAP_AB), tl.load(hs_ptrs + kb), w2s_ptr,
                          expert, stride_se, stride_sn, offs_n, kb, BLOCK_SCALES, GROUP, SWAP_AB)
        h_ptrs += GROUP
        w_ptrs += GROUP
    acc = _channel_scaled(acc, w2s_ptr, expert, stride_se, stride_sn, offs_n, BLOCK_SCALES, GROUP, SWAP_AB)
    route_weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
    y = acc * route_weight[:, None]
    if SPLIT_K > 1:
        pairs += (tl.program_id(0) % SPLIT_K) * num_pairs  # the rows of this program's part
    tl.store(y_ptr + wide_offset(pairs, H)[:, None] + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None])


@triton.jit(do_not_specialize=["top_k"])
def gather_rows_kernel(xq_ptr, xs_ptr, sorted_pairs_ptr, block_rows_ptr, q_ptr, s_t_ptr, rows_total, H, top_k,
                       BLOCK_M: tl.constexpr, BLOCK_T: tl.constexpr, GROUP: tl.constexpr):
    """The quantised tokens (`quantize_groups_kernel`'s xq (T, H) bytes and xs (T, H / GROUP))
    copied into layout order, for GEMMs that read A as dense tiles: row r of q (rows_total, H)
    is xq[sorted_pairs[r] // top_k], its scales go to s_t (H / GROUP, rows_total) fp32
    (transposed: one group's scales of consecutive rows are adjacent); padding rows (past their
    block's block_rows of the BLOCK_M-row layout blocks) are zeros. A program copies BLOCK_T rows."""
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, GROUP)
    row_ok = rows % BLOCK_M < tl.load(block_rows_ptr + rows // BLOCK_M)
    tokens = tl.load(sorted_pairs_ptr + rows, mask=row_ok, other=0) // top_k
    x_ptrs = xq_ptr + wide_offset(tokens, H)[:, None] + cols[None, :]
    q_ptrs = q_ptr + wide_offset(rows, H)[:, None] + cols[None, :]
    for g in range(0, H // GROUP):
        tl.store(q_ptrs + g * GROUP, tl.load(x_ptrs + g * GROUP, mask=row_ok[:, None], other=0))
        # H / GROUP * rows_total < 2^31 for any buffer of rows_total x H bytes below 256 GB
        tl.store(s_t_ptr + g * rows_total + rows, tl.load(xs_ptr + tokens * (H // GROUP) + g, mask=row_ok, other=0.0))
