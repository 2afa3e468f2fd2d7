"""The FP8 expert GEMMs for Hopper (sm90) in Gluon, with block scales applied off the tensor
cores' path.

Every K step of a block-scaled product has scales of its own (the activations' per row and
group, the weights' per 128 x 128 block), so each step's product is scaled before it joins the
sum. Triton 3.6 waits for each `tl.dot` wgmma right after issuing it (`fp8.py`): the tensor
cores idle while the CUDA cores scale. Here each consumer warpgroup issues step k's product
into a scratch accumulator of its own, then waits only for step k - 1's and scales it into the
sum while step k's runs (DeepGEMM's promotion, with the scratch double-buffered).

Partitions (as `attention/_kernels/forward_gluon.py`):
- a producer warp copies, by TMA, each K step's A tile (the program's TILE_M = 128 layout rows)
  and its B tile (two boxes of HALF_N weight rows) into NUM_STAGES buffers, each with a `ready`
  and an `empty` mbarrier;
- two consumer warpgroups take 64 rows each of A and share B, releasing a buffer once their
  product has read it. They give the producer's registers to themselves (240 a thread).

Operands, all dense (TMA boxes never cross an expert: the weights are viewed as (E * N, K) with N
and K multiples of 128):
- gate_up_fp8_gluon_kernel: A = the tokens quantised in layout order (`fp8.gather_quantize_kernel`),
  B = gate rows [n, n + 64) and up rows [I + n, I + n + 64) of w1[e]. The epilogue writes
  h = act(gate) * up in FP8 with one scale per row and H_GROUP = 64 columns (one program's).
- down_fp8_gluon_kernel: A = h, K steps of H_GROUP, B = 128 rows of w2[e]; y[p] = w_p * (h @
  w2[e].T) at its pair's slot p, in the output dtype, for the combine (combine.py).
Activation scales are stored transposed, (K / group, rows), so a step's 64 row scales are one
contiguous load; the consumers load each step's scales during the step before the one that
applies them.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .fp8 import FP8_MAX, MIN_SCALE
from .grouped_gemm import _gated_activation, _tile_coordinates
from .offsets import wide_offset

CONSUMER_ROWS = gl.constexpr(64)  # a consumer warpgroup's rows: one wgmma's M
TILE_M = gl.constexpr(128)  # two consumers' rows: the layout's block
H_GROUP = gl.constexpr(64)  # columns of h per scale (a gate/up program's)
INSTR_K = gl.constexpr(32)  # an FP8 wgmma's K


@gluon.jit
def _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M: gl.constexpr):
    """(expert, row block, column tile) of tile `tile` in grouped order; expert -1: an unused block."""
    pid_m, pid_n = _tile_coordinates(tile, num_blocks_m, num_tiles_n, GROUP_M)
    return gl.load(block_expert_ptr + pid_m), pid_m, pid_n


@gluon.jit
def _producer(desc_a, desc_b, desc_s, a_smem, b_smem, s_smem, ready, empty, block_expert_ptr, num_blocks_m,
              num_tiles_n, num_k,
              b_rows_per_expert, b_second_half, GROUP_M: gl.constexpr, BLOCK_K: gl.constexpr, HALF_N: gl.constexpr,
              TILE_N: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Copies every K step of this program's tiles in order; `it` counts buffer uses across
    tiles, so the next tile's first steps load while the consumers finish one. B's halves start
    at weight rows expert * b_rows_per_expert + pid_n * TILE_N and b_second_half past it."""
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            b_row = expert * b_rows_per_expert + pid_n * TILE_N
            for kb in range(num_k):
                stage = (it + kb) % NUM_STAGES
                mbarrier.wait(empty.index(stage), (((it + kb) // NUM_STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, desc_a.block_type.nbytes + 2 * desc_b.block_type.nbytes
                                + desc_s.block_type.nbytes)
                tma.async_copy_global_to_shared(desc_a, [pid_m * TILE_M, kb * BLOCK_K], bar, a_smem.index(stage))
                tma.async_copy_global_to_shared(desc_s, [kb, pid_m * TILE_M], bar, s_smem.index(stage))
                b = b_smem.index(stage)
                tma.async_copy_global_to_shared(desc_b, [b_row, kb * BLOCK_K], bar, b.slice(0, HALF_N))
                tma.async_copy_global_to_shared(desc_b, [b_row + b_second_half, kb * BLOCK_K], bar,
                                                b.slice(HALF_N, HALF_N))
            it += num_k


@gluon.jit
def _step_scales(s_smem, stage, C: gl.constexpr, ws_ptr0, ws_ptr1, kb, ws_k_div, rows_layout: gl.constexpr,
                 BLOCK_SCALES: gl.constexpr, ONE_BLOCK: gl.constexpr):
    """Step kb's row scales for B's first and second half: consumer C's rows' activation scales
    (buffer `stage`) times (block scales) each half's weight block (ONE_BLOCK: both halves in
    one, ws_ptr1 unread)."""
    a_scale = s_smem.index(stage).reshape([TILE_M]).slice(C * CONSUMER_ROWS, CONSUMER_ROWS).load(rows_layout)
    if BLOCK_SCALES:
        s0 = a_scale * gl.load(ws_ptr0 + kb // ws_k_div)
        if ONE_BLOCK:
            return s0, s0
        return s0, a_scale * gl.load(ws_ptr1 + kb // ws_k_div)
    return a_scale, a_scale


@gluon.jit
def _scaled(product, s0, s1, first_half, ONE_SCALE: gl.constexpr):
    if ONE_SCALE:
        return product * s0[:, None]
    return product * gl.where(first_half, s0[:, None], s1[:, None])


@gluon.jit
def _scaled_sum(a_smem, b_smem, s_smem, ready, empty, it, num_k, C: gl.constexpr, ws_ptr0, ws_ptr1, ws_k_div, acc_layout: gl.constexpr, BLOCK_N: gl.constexpr, HALF_N: gl.constexpr,
                NUM_STAGES: gl.constexpr, BLOCK_SCALES: gl.constexpr, ONE_BLOCK: gl.constexpr):
    """Consumer C's (64, BLOCK_N) sum over one tile's K steps (buffer uses it, it + 1, ...) of
    each step's product times its scales (columns below HALF_N: the first half's, the rest: the
    second's)."""
    ONE_SCALE: gl.constexpr = ONE_BLOCK | (not BLOCK_SCALES)
    first_half = (gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout)) < HALF_N)[None, :]
    zero = gl.zeros([CONSUMER_ROWS, BLOCK_N], gl.float32, layout=acc_layout)
    stage = it % NUM_STAGES
    mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
    prev = warpgroup_mma(a_smem.index(stage).slice(C * CONSUMER_ROWS, CONSUMER_ROWS),
                         b_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    s0, s1 = _step_scales(s_smem, stage, C, ws_ptr0, ws_ptr1, 0, ws_k_div, rows_layout, BLOCK_SCALES, ONE_BLOCK)
    acc = zero
    for kb in range(1, num_k):
        stage = (it + kb) % NUM_STAGES
        mbarrier.wait(ready.index(stage), ((it + kb) // NUM_STAGES) & 1)
        tok = warpgroup_mma(a_smem.index(stage).slice(C * CONSUMER_ROWS, CONSUMER_ROWS),
                            b_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
        # Step kb - 1's product is done once at most step kb's is in flight: scale it meanwhile.
        product = warpgroup_mma_wait(1, deps=[prev])
        mbarrier.arrive(empty.index((it + kb - 1) % NUM_STAGES), count=1)
        acc = acc + _scaled(product, s0, s1, first_half, ONE_SCALE)
        s0, s1 = _step_scales(s_smem, stage, C, ws_ptr0, ws_ptr1, kb, ws_k_div, rows_layout, BLOCK_SCALES,
                              ONE_BLOCK)
        prev = tok
    product = warpgroup_mma_wait(0, deps=[prev])
    mbarrier.arrive(empty.index((it + num_k - 1) % NUM_STAGES), count=1)
    return acc + _scaled(product, s0, s1, first_half, ONE_SCALE)


@gluon.jit
def _quantized(h, hq_ptr):
    """h (rows, H_GROUP) fp32 in FP8 with its per-row scale max |h| / FP8_MAX; the hardware's
    conversion rounds to nearest even (this path never runs in the interpreter)."""
    scale = gl.maximum(gl.max(gl.abs(h), axis=1) / FP8_MAX, MIN_SCALE)
    return (h * (1.0 / scale)[:, None]).to(hq_ptr.dtype.element_ty), scale


@gluon.jit
def _gate_up_tile(a_smem, b_smem, s_smem, ready, empty, it, w1s_ptr, hq_ptr, hs_t_ptr, expert, pid_m, pid_n,
                  num_k, rows_total, I, stride_se, stride_sn, C: gl.constexpr, ACTIVATION: gl.constexpr,
                  BLOCK_SCALES: gl.constexpr, NUM_STAGES: gl.constexpr):
    BLOCK_N: gl.constexpr = 2 * H_GROUP
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, INSTR_K])
    first_row = pid_m * TILE_M + C * CONSUMER_ROWS
    gate_col = pid_n * H_GROUP
    w_scales = w1s_ptr + wide_offset(expert, stride_se)
    if BLOCK_SCALES:  # (E, 2I / 128, H / 128): the gate and up rows' blocks
        ws0 = w_scales + (gate_col // 128) * stride_sn
        ws1 = w_scales + ((I + gate_col) // 128) * stride_sn
    else:
        ws0 = w_scales
        ws1 = w_scales
    acc = _scaled_sum(a_smem, b_smem, s_smem, ready, empty, it, num_k, C, ws0, ws1, 1, acc_layout, BLOCK_N, H_GROUP, NUM_STAGES, BLOCK_SCALES, False)
    cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, acc_layout))
    if not BLOCK_SCALES:  # per output channel, (E, 2I): gate rows, then up rows
        w_rows = gl.where(cols < H_GROUP, gate_col + cols, I + gate_col + cols - H_GROUP)
        acc = acc * gl.load(w_scales + w_rows * stride_sn)[None, :]
    gate, up = gl.split(gl.permute(gl.reshape(acc, [CONSUMER_ROWS, 2, H_GROUP]), (0, 2, 1)))
    store_layout: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
    q, scale = _quantized(gl.convert_layout(_gated_activation(gate, up, ACTIVATION), store_layout), hq_ptr)
    out_rows = first_row + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, store_layout))
    out_cols = gate_col + gl.arange(0, H_GROUP, layout=gl.SliceLayout(0, store_layout))
    gl.store(hq_ptr + wide_offset(out_rows, I)[:, None] + out_cols[None, :], q)
    gl.store(hs_t_ptr + wide_offset(pid_n, rows_total) + out_rows, scale)
    return it + num_k


@gluon.jit
def _gate_up_consumer(a_smem, b_smem, s_smem, ready, empty, w1s_ptr, hq_ptr, hs_t_ptr, block_expert_ptr,
                      num_blocks_m, num_k, rows_total, I, stride_se, stride_sn, C: gl.constexpr,
                      ACTIVATION: gl.constexpr, BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr,
                      NUM_STAGES: gl.constexpr):
    num_tiles_n = I // H_GROUP
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            it = _gate_up_tile(a_smem, b_smem, s_smem, ready, empty, it, w1s_ptr, hq_ptr, hs_t_ptr, expert, pid_m,
                               pid_n, num_k, rows_total, I, stride_se, stride_sn, C, ACTIVATION, BLOCK_SCALES,
                               NUM_STAGES)


@gluon.jit
def _buffers(desc_a, desc_b, desc_s, NUM_STAGES: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_K: gl.constexpr):
    """The A, B and A-scale buffers and their `ready` and `empty` mbarriers (each buffer released
    by both consumers)."""
    a_smem = gl.allocate_shared_memory(desc_a.dtype, [NUM_STAGES, TILE_M, BLOCK_K], desc_a.layout)
    b_smem = gl.allocate_shared_memory(desc_b.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], desc_b.layout)
    s_smem = gl.allocate_shared_memory(desc_s.dtype, [NUM_STAGES, 1, TILE_M], desc_s.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=2)
    return a_smem, b_smem, s_smem, ready, empty


@gluon.jit
def gate_up_fp8_gluon_kernel(
    desc_x, desc_w1, desc_xs, w1s_ptr, hq_ptr, hs_t_ptr, block_expert_ptr,
    num_blocks_m, rows_total, H, I, stride_se, stride_sn,
    ACTIVATION: gl.constexpr, BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
):
    """desc_x: (rows_total, H) FP8, the tokens in layout order, boxes (128, 128); desc_xs: their
    scales (H / 128, rows_total) fp32, boxes (1, 128); desc_w1: w1 (E, 2I, H) FP8 viewed as (E * 2I, H), boxes (64, 128); w1s:
    (E, 2I / 128, H / 128) (block) or (E, 2I) (channel), strides (stride_se, stride_sn, 1);
    hq: (rows_total, I) FP8, hs_t: (I / 64, rows_total) fp32. num_warps = 4; persistent: each
    program takes tiles program_id, + num_programs, ... (one program an SM)."""
    BLOCK_K: gl.constexpr = 128
    num_k = H // BLOCK_K
    a_smem, b_smem, s_smem, ready, empty = _buffers(desc_x, desc_w1, desc_xs, NUM_STAGES, 2 * H_GROUP, BLOCK_K)
    gl.warp_specialize([
        (_gate_up_consumer, (a_smem, b_smem, s_smem, ready, empty, w1s_ptr, hq_ptr, hs_t_ptr, block_expert_ptr,
                             num_blocks_m, num_k, rows_total, I, stride_se, stride_sn, 0, ACTIVATION, BLOCK_SCALES,
                             GROUP_M, NUM_STAGES)),
        (_gate_up_consumer, (a_smem, b_smem, s_smem, ready, empty, w1s_ptr, hq_ptr, hs_t_ptr, block_expert_ptr,
                             num_blocks_m, num_k, rows_total, I, stride_se, stride_sn, 1, ACTIVATION, BLOCK_SCALES,
                             GROUP_M, NUM_STAGES)),
        (_producer, (desc_x, desc_w1, desc_xs, a_smem, b_smem, s_smem, ready, empty, block_expert_ptr, num_blocks_m, I // H_GROUP,
                     num_k, 2 * I, I, GROUP_M, BLOCK_K, H_GROUP, H_GROUP, NUM_STAGES)),
    ], [4, 1], [240, 24])


@gluon.jit
def _down_tile(a_smem, b_smem, s_smem, ready, empty, it, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr,
               block_rows_ptr, expert, pid_m, pid_n, num_k, rows_total, H, stride_se, stride_sn, C: gl.constexpr,
               BLOCK_SCALES: gl.constexpr, NUM_STAGES: gl.constexpr):
    BLOCK_N: gl.constexpr = 128
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, INSTR_K])
    row0 = pid_m * TILE_M
    # Block scales (E, H / 128, I / 128): the tile's 128 columns are one block, a K block two steps.
    ws = w2s_ptr + wide_offset(expert, stride_se) + (pid_n * stride_sn if BLOCK_SCALES else 0)
    acc = _scaled_sum(a_smem, b_smem, s_smem, ready, empty, it, num_k, C, ws, ws, 128 // H_GROUP, acc_layout, BLOCK_N, BLOCK_N // 2, NUM_STAGES, BLOCK_SCALES, True)
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    acc = gl.convert_layout(acc, store_layout)
    cols = pid_n * BLOCK_N + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, store_layout))
    if not BLOCK_SCALES:  # per output channel, (E, H)
        acc = acc * gl.load(ws + cols * stride_sn)[None, :]
    in_block = C * CONSUMER_ROWS + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, store_layout))
    row_ok = in_block < gl.load(block_rows_ptr + pid_m)
    pairs = gl.load(sorted_pairs_ptr + row0 + in_block, mask=row_ok, other=0)
    route_weight = gl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
    gl.store(y_ptr + wide_offset(pairs, H)[:, None] + cols[None, :],
             (acc * route_weight[:, None]).to(y_ptr.dtype.element_ty), mask=row_ok[:, None])
    return it + num_k


@gluon.jit
def _down_consumer(a_smem, b_smem, s_smem, ready, empty, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr,
                   block_expert_ptr, block_rows_ptr, num_blocks_m, num_k, rows_total, H, stride_se, stride_sn,
                   C: gl.constexpr, BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    num_tiles_n = H // 128
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            it = _down_tile(a_smem, b_smem, s_smem, ready, empty, it, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr,
                            block_rows_ptr, expert, pid_m, pid_n, num_k, rows_total, H, stride_se, stride_sn, C,
                            BLOCK_SCALES, NUM_STAGES)


@gluon.jit
def down_fp8_gluon_kernel(
    desc_h, desc_w2, desc_hs, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    num_blocks_m, rows_total, H, I, stride_se, stride_sn,
    BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
):
    """desc_h: hq (rows_total, I) FP8, boxes (128, 64); desc_hs: its scales (I / 64, rows_total)
    fp32, boxes (1, 128); desc_w2:
    w2 (E, H, I) FP8 viewed as (E * H, I), boxes (64, 64); w2s: (E, H / 128, I / 128) (block) or
    (E, H) (channel), strides (stride_se, stride_sn, 1); weights: (T * top_k,) fp32; y:
    (T * top_k, H) contiguous, the output dtype. num_warps = 4; persistent as the gate/up."""
    num_k = I // H_GROUP
    a_smem, b_smem, s_smem, ready, empty = _buffers(desc_h, desc_w2, desc_hs, NUM_STAGES, 128, H_GROUP)
    gl.warp_specialize([
        (_down_consumer, (a_smem, b_smem, s_smem, ready, empty, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr,
                          block_expert_ptr, block_rows_ptr, num_blocks_m, num_k, rows_total, H, stride_se, stride_sn,
                          0, BLOCK_SCALES, GROUP_M, NUM_STAGES)),
        (_down_consumer, (a_smem, b_smem, s_smem, ready, empty, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr,
                          block_expert_ptr, block_rows_ptr, num_blocks_m, num_k, rows_total, H, stride_se, stride_sn,
                          1, BLOCK_SCALES, GROUP_M, NUM_STAGES)),
        (_producer, (desc_h, desc_w2, desc_hs, a_smem, b_smem, s_smem, ready, empty, block_expert_ptr, num_blocks_m, H // 128, num_k,
                     H, 64, GROUP_M, H_GROUP, 64, 128, NUM_STAGES)),
    ], [4, 1], [240, 24])
