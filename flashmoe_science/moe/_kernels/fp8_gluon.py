"""The FP8 expert GEMMs for Hopper (sm90) in Gluon, with block scales applied off the tensor
cores' path.

Every 128-deep K step of a block-scaled product has scales of its own (the activations' per row
and group of 128, the weights' per 128 x 128 block), so each step's product is scaled before it
joins the sum. Triton 3.6 waits for each `tl.dot` wgmma right after issuing it (`fp8.py`): the
tensor cores idle while the CUDA cores scale. Here each consumer warpgroup issues step k's
product into a scratch accumulator, then waits only for step k - 1's and scales it into the sum
while step k's runs (DeepGEMM's promotion, with the scratch double-buffered).

Partitions (as `attention/_kernels/forward_gluon.py`):
- a producer warp copies, by TMA, each K step's A tile (the tile's TILE_M = 128 layout rows, one
  layout block), A's row scales, and a (128, 128) B tile (two boxes of 64 weight rows) into
  NUM_STAGES buffers, each with a `ready` and an `empty` mbarrier;
- two consumer warpgroups take 64 rows each and share B (each B byte read from L2 serves 128
  rows: tilings that load more bytes a step for the same products measured slower,
  benchmarks/results/moe_fp8_gluon_tiles.txt), releasing a buffer once their product has read
  it. They take the producer's registers (240 a thread).
Persistent: one program an SM takes tiles program_id, + num_programs, ... in grouped order;
every partition walks the same tiles and counts buffer uses across them, so the producer copies
the next tile's first steps while the consumers finish one.

Operands, all dense (TMA boxes never cross an expert: the weights are viewed as (E * N, K) with N
and K multiples of 128):
- gate_up_fp8_gluon_kernel: A = the tokens quantised in layout order (`fp8.gather_rows_kernel`).
  A tile is 128 columns of h, one scale group, in two passes over K: pass p's B = gate rows
  [n + 64p, n + 64p + 64) and the same up rows (I past them) of w1[e]. A consumer keeps pass 0's
  h in shared memory until pass 1 gives its rows' maxima over the whole group, then writes h in
  FP8 with one scale per row and 128 columns, as `fp8.gate_up_fp8_kernel` does.
- down_fp8_gluon_kernel: A = h, B = w2[e]'s rows [n, n + 128); y[p] = w_p * (h @ w2[e].T) at its
  pair's slot p, in the output dtype, for the combine (combine.py).
Activation scales are stored transposed, (K / 128, rows), so a step's row scales are one TMA box.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .fp8 import FP8_MAX, MIN_SCALE
from .grouped_gemm import _gated_activation, _tile_coordinates
from .offsets import wide_offset

CONSUMER_ROWS = gl.constexpr(64)  # a consumer warpgroup's rows: one wgmma's M
TILE_M = gl.constexpr(128)  # two consumers' rows: the layout's block
GROUP = gl.constexpr(128)  # K step, scale group and a tile's columns (of h, in the gate/up)
HALF = gl.constexpr(64)  # rows of a B box: a gate/up pass's columns of h
INSTR_K = gl.constexpr(32)  # an FP8 wgmma's K


@gluon.jit
def _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M: gl.constexpr):
    """(expert, row block, column tile) of tile `tile` in grouped order; expert -1: an unused block."""
    pid_m, pid_n = _tile_coordinates(tile, num_blocks_m, num_tiles_n, GROUP_M)
    return gl.load(block_expert_ptr + pid_m), pid_m, pid_n


@gluon.jit
def _producer(desc_a, desc_b, desc_s, a_smem, b_smem, s_smem, ready, empty, block_expert_ptr, num_blocks_m,
              num_tiles_n, num_k, b_rows_per_expert, b_half_step, GROUP_M: gl.constexpr, PASSES: gl.constexpr,
              NUM_STAGES: gl.constexpr):
    """Copies every K step of this program's tiles (and passes) in order. A pass's B rows are two
    boxes of HALF from expert * b_rows_per_expert + pid_n * GROUP + pass * HALF and b_half_step
    past it."""
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            for p in gl.static_range(PASSES):
                b_row = expert * b_rows_per_expert + pid_n * GROUP + p * HALF
                for kb in range(num_k):
                    stage = (it + kb) % NUM_STAGES
                    mbarrier.wait(empty.index(stage), (((it + kb) // NUM_STAGES) & 1) ^ 1)
                    bar = ready.index(stage)
                    mbarrier.expect(bar, desc_a.block_type.nbytes + 2 * desc_b.block_type.nbytes
                                    + desc_s.block_type.nbytes)
                    tma.async_copy_global_to_shared(desc_a, [pid_m * TILE_M, kb * GROUP], bar, a_smem.index(stage))
                    tma.async_copy_global_to_shared(desc_s, [kb, pid_m * TILE_M], bar, s_smem.index(stage))
                    b = b_smem.index(stage)
                    tma.async_copy_global_to_shared(desc_b, [b_row, kb * GROUP], bar, b.slice(0, HALF))
                    tma.async_copy_global_to_shared(desc_b, [b_row + b_half_step, kb * GROUP], bar,
                                                    b.slice(HALF, HALF))
                it += num_k


@gluon.jit
def _step_scales(s_smem, stage, C: gl.constexpr, ws_ptr0, ws_ptr1, kb, rows_layout: gl.constexpr,
                 BLOCK_SCALES: gl.constexpr, ONE_BLOCK: gl.constexpr):
    """Step kb's row scales for B's first and second HALF rows: consumer C's rows' activation
    scales (buffer `stage`) times (block scales) each half's weight block (ONE_BLOCK: both halves
    in one, ws_ptr1 unread)."""
    a_scale = s_smem.index(stage).reshape([TILE_M]).slice(C * CONSUMER_ROWS, CONSUMER_ROWS).load(rows_layout)
    if BLOCK_SCALES:
        s0 = a_scale * gl.load(ws_ptr0 + kb)
        if ONE_BLOCK:
            return s0, s0
        return s0, a_scale * gl.load(ws_ptr1 + kb)
    return a_scale, a_scale


@gluon.jit
def _scaled(product, s0, s1, first_half, ONE_SCALE: gl.constexpr):
    if ONE_SCALE:
        return product * s0[:, None]
    return product * gl.where(first_half, s0[:, None], s1[:, None])


@gluon.jit
def _scaled_sum(a_smem, b_smem, s_smem, ready, empty, it, num_k, C: gl.constexpr, ws_ptr0, ws_ptr1,
                acc_layout: gl.constexpr, NUM_STAGES: gl.constexpr, BLOCK_SCALES: gl.constexpr,
                ONE_BLOCK: gl.constexpr):
    """Consumer C's (64, 128) sum over one pass's K steps (buffer uses it, it + 1, ...) of each
    step's product times its scales (B's first HALF rows: the first half's, the rest: the
    second's)."""
    ONE_SCALE: gl.constexpr = ONE_BLOCK | (not BLOCK_SCALES)
    rows_layout: gl.constexpr = gl.SliceLayout(1, acc_layout)
    first_half = (gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, acc_layout)) < HALF)[None, :]
    zero = gl.zeros([CONSUMER_ROWS, 2 * HALF], gl.float32, layout=acc_layout)
    stage = it % NUM_STAGES
    mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
    prev = warpgroup_mma(a_smem.index(stage).slice(C * CONSUMER_ROWS, CONSUMER_ROWS),
                         b_smem.index(stage).permute((1, 0)), zero, use_acc=False, is_async=True)
    s0, s1 = _step_scales(s_smem, stage, C, ws_ptr0, ws_ptr1, 0, rows_layout, BLOCK_SCALES, ONE_BLOCK)
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
        s0, s1 = _step_scales(s_smem, stage, C, ws_ptr0, ws_ptr1, kb, rows_layout, BLOCK_SCALES, ONE_BLOCK)
        prev = tok
    product = warpgroup_mma_wait(0, deps=[prev])
    mbarrier.arrive(empty.index((it + num_k - 1) % NUM_STAGES), count=1)
    return acc + _scaled(product, s0, s1, first_half, ONE_SCALE)


@gluon.jit
def _gated_pass(a_smem, b_smem, s_smem, ready, empty, it, num_k, w_scales, gate_col, I, stride_sn,
                C: gl.constexpr, ACTIVATION: gl.constexpr, BLOCK_SCALES: gl.constexpr, NUM_STAGES: gl.constexpr,
                h_layout: gl.constexpr):
    """h = act(gate) * up of consumer C's rows and the HALF columns of h from gate_col, fp32, in
    h_layout."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 2 * HALF, INSTR_K])
    if BLOCK_SCALES:  # (E, 2I / 128, H / 128): the gate and up rows' blocks
        ws0 = w_scales + (gate_col // GROUP) * stride_sn
        ws1 = w_scales + ((I + gate_col) // GROUP) * stride_sn
    else:
        ws0 = w_scales
        ws1 = w_scales
    acc = _scaled_sum(a_smem, b_smem, s_smem, ready, empty, it, num_k, C, ws0, ws1, acc_layout, NUM_STAGES,
                      BLOCK_SCALES, False)
    if not BLOCK_SCALES:  # per output channel, (E, 2I): gate rows, then up rows
        cols = gl.arange(0, 2 * HALF, layout=gl.SliceLayout(0, acc_layout))
        w_rows = gl.where(cols < HALF, gate_col + cols, I + gate_col + cols - HALF)
        acc = acc * gl.load(w_scales + w_rows * stride_sn)[None, :]
    gate, up = gl.split(gl.permute(gl.reshape(acc, [CONSUMER_ROWS, 2, HALF]), (0, 2, 1)))
    return gl.convert_layout(_gated_activation(gate, up, ACTIVATION), h_layout)


@gluon.jit
def _gate_up_tile(a_smem, b_smem, s_smem, h_smem, ready, empty, it, w1s_ptr, hq_ptr, hs_t_ptr, expert, pid_m,
                  pid_n, num_k, rows_total, I, stride_se, stride_sn, C: gl.constexpr, ACTIVATION: gl.constexpr,
                  BLOCK_SCALES: gl.constexpr, NUM_STAGES: gl.constexpr):
    h_layout: gl.constexpr = gl.BlockedLayout([1, 16], [16, 2], [4, 1], [1, 0])
    rows_h: gl.constexpr = gl.SliceLayout(1, h_layout)
    w_scales = w1s_ptr + wide_offset(expert, stride_se)
    first_col = pid_n * GROUP
    h0 = _gated_pass(a_smem, b_smem, s_smem, ready, empty, it, num_k, w_scales, first_col, I, stride_sn, C,
                     ACTIVATION, BLOCK_SCALES, NUM_STAGES, h_layout)
    amax = gl.max(gl.abs(h0), axis=1)
    h_smem.index(C).store(h0)  # read back by the same threads, in the same layout
    h1 = _gated_pass(a_smem, b_smem, s_smem, ready, empty, it + num_k, num_k, w_scales, first_col + HALF, I,
                     stride_sn, C, ACTIVATION, BLOCK_SCALES, NUM_STAGES, h_layout)
    scale = gl.maximum(gl.maximum(amax, gl.max(gl.abs(h1), axis=1)) / FP8_MAX, MIN_SCALE)
    inverse = (1.0 / scale)[:, None]
    # The hardware's conversion rounds to nearest even (this path never runs in the interpreter).
    rows = pid_m * TILE_M + C * CONSUMER_ROWS + gl.arange(0, CONSUMER_ROWS, layout=rows_h)
    cols = first_col + gl.arange(0, HALF, layout=gl.SliceLayout(0, h_layout))
    h_ptrs = hq_ptr + wide_offset(rows, I)[:, None] + cols[None, :]
    gl.store(h_ptrs, (h_smem.index(C).load(h_layout) * inverse).to(hq_ptr.dtype.element_ty))
    gl.store(h_ptrs + HALF, (h1 * inverse).to(hq_ptr.dtype.element_ty))
    gl.store(hs_t_ptr + wide_offset(pid_n, rows_total) + rows, scale)
    return it + 2 * num_k


@gluon.jit
def _gate_up_consumer(a_smem, b_smem, s_smem, h_smem, ready, empty, w1s_ptr, hq_ptr, hs_t_ptr, block_expert_ptr,
                      num_blocks_m, num_k, rows_total, I, stride_se, stride_sn, C: gl.constexpr,
                      ACTIVATION: gl.constexpr, BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr,
                      NUM_STAGES: gl.constexpr):
    num_tiles_n = I // GROUP
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            it = _gate_up_tile(a_smem, b_smem, s_smem, h_smem, ready, empty, it, w1s_ptr, hq_ptr, hs_t_ptr, expert,
                               pid_m, pid_n, num_k, rows_total, I, stride_se, stride_sn, C, ACTIVATION,
                               BLOCK_SCALES, NUM_STAGES)


@gluon.jit
def _buffers(desc_a, desc_b, desc_s, NUM_STAGES: gl.constexpr):
    """The A, B and A-scale buffers and their `ready` and `empty` mbarriers (each buffer released
    by both consumers)."""
    a_smem = gl.allocate_shared_memory(desc_a.dtype, [NUM_STAGES, TILE_M, GROUP], desc_a.layout)
    b_smem = gl.allocate_shared_memory(desc_b.dtype, [NUM_STAGES, 2 * HALF, GROUP], desc_b.layout)
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
    """desc_x: (rows_total, H) FP8, the tokens in layout order (128-row blocks), boxes (128, 128);
    desc_xs: their scales (H / 128, rows_total) fp32, boxes (1, 128); desc_w1: w1 (E, 2I, H) FP8
    viewed as (E * 2I, H), boxes (64, 128); w1s: (E, 2I / 128, H / 128) (block) or (E, 2I)
    (channel), strides (stride_se, stride_sn, 1); hq: (rows_total, I) FP8, hs_t: (I / 128,
    rows_total) fp32. num_warps = 4 (the first consumer); one program an SM."""
    a_smem, b_smem, s_smem, ready, empty = _buffers(desc_x, desc_w1, desc_xs, NUM_STAGES)
    h_smem = gl.allocate_shared_memory(gl.float32, [2, CONSUMER_ROWS, HALF], gl.SwizzledSharedLayout(1, 1, 1, [1, 0]))
    num_k = H // GROUP
    gl.warp_specialize([
        (_gate_up_consumer, (a_smem, b_smem, s_smem, h_smem, ready, empty, w1s_ptr, hq_ptr, hs_t_ptr,
                             block_expert_ptr, num_blocks_m, num_k, rows_total, I, stride_se, stride_sn, 0,
                             ACTIVATION, BLOCK_SCALES, GROUP_M, NUM_STAGES)),
        (_gate_up_consumer, (a_smem, b_smem, s_smem, h_smem, ready, empty, w1s_ptr, hq_ptr, hs_t_ptr,
                             block_expert_ptr, num_blocks_m, num_k, rows_total, I, stride_se, stride_sn, 1,
                             ACTIVATION, BLOCK_SCALES, GROUP_M, NUM_STAGES)),
        (_producer, (desc_x, desc_w1, desc_xs, a_smem, b_smem, s_smem, ready, empty, block_expert_ptr, num_blocks_m,
                     I // GROUP, num_k, 2 * I, I, GROUP_M, 2, NUM_STAGES)),
    ], [4, 1], [240, 24])


@gluon.jit
def _down_tile(a_smem, b_smem, s_smem, ready, empty, it, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr,
               block_rows_ptr, expert, pid_m, pid_n, num_k, H, stride_se, stride_sn, C: gl.constexpr,
               BLOCK_SCALES: gl.constexpr, NUM_STAGES: gl.constexpr):
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, 2 * HALF, INSTR_K])
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    # Block scales (E, H / 128, I / 128): the tile's 128 columns are one block.
    ws = w2s_ptr + wide_offset(expert, stride_se) + (pid_n * stride_sn if BLOCK_SCALES else 0)
    cols = pid_n * GROUP + gl.arange(0, GROUP, layout=gl.SliceLayout(0, store_layout))
    # The store's rows, pairs and routing weights (dependent loads) are read before the products,
    # so their latency passes while the tensor cores run rather than after.
    in_block = C * CONSUMER_ROWS + gl.arange(0, CONSUMER_ROWS, layout=gl.SliceLayout(1, store_layout))
    row_ok = in_block < gl.load(block_rows_ptr + pid_m)
    pairs = gl.load(sorted_pairs_ptr + pid_m * TILE_M + in_block, mask=row_ok, other=0)
    route_weight = gl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
    if not BLOCK_SCALES:  # per output channel, (E, H)
        channel_scale = gl.load(ws + cols * stride_sn)
    acc = _scaled_sum(a_smem, b_smem, s_smem, ready, empty, it, num_k, C, ws, ws, acc_layout, NUM_STAGES,
                      BLOCK_SCALES, True)
    acc = gl.convert_layout(acc, store_layout)
    if not BLOCK_SCALES:
        acc = acc * channel_scale[None, :]
    gl.store(y_ptr + wide_offset(pairs, H)[:, None] + cols[None, :],
             (acc * route_weight[:, None]).to(y_ptr.dtype.element_ty), mask=row_ok[:, None])
    return it + num_k


@gluon.jit
def _down_consumer(a_smem, b_smem, s_smem, ready, empty, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr,
                   block_expert_ptr, block_rows_ptr, num_blocks_m, num_k, H, stride_se, stride_sn,
                   C: gl.constexpr, BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    num_tiles_n = H // GROUP
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            it = _down_tile(a_smem, b_smem, s_smem, ready, empty, it, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr,
                            block_rows_ptr, expert, pid_m, pid_n, num_k, H, stride_se, stride_sn, C, BLOCK_SCALES,
                            NUM_STAGES)


@gluon.jit
def down_fp8_gluon_kernel(
    desc_h, desc_w2, desc_hs, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    num_blocks_m, H, I, stride_se, stride_sn,
    BLOCK_SCALES: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
):
    """desc_h: hq (rows, I) FP8, boxes (128, 128); desc_hs: its scales (I / 128, rows) fp32, boxes
    (1, 128); desc_w2: w2 (E, H, I) FP8 viewed as (E * H, I), boxes (64, 128); w2s: (E, H / 128,
    I / 128) (block) or (E, H) (channel), strides (stride_se, stride_sn, 1); weights: (T * top_k,)
    fp32; y: (T * top_k, H) contiguous, the output dtype. num_warps = 4; one program an SM."""
    a_smem, b_smem, s_smem, ready, empty = _buffers(desc_h, desc_w2, desc_hs, NUM_STAGES)
    num_k = I // GROUP
    gl.warp_specialize([
        (_down_consumer, (a_smem, b_smem, s_smem, ready, empty, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr,
                          block_expert_ptr, block_rows_ptr, num_blocks_m, num_k, H, stride_se, stride_sn, 0,
                          BLOCK_SCALES, GROUP_M, NUM_STAGES)),
        (_down_consumer, (a_smem, b_smem, s_smem, ready, empty, w2s_ptr, y_ptr, weights_ptr, sorted_pairs_ptr,
                          block_expert_ptr, block_rows_ptr, num_blocks_m, num_k, H, stride_se, stride_sn, 1,
                          BLOCK_SCALES, GROUP_M, NUM_STAGES)),
        (_producer, (desc_h, desc_w2, desc_hs, a_smem, b_smem, s_smem, ready, empty, block_expert_ptr, num_blocks_m,
                     H // GROUP, num_k, H, HALF, GROUP_M, 1, NUM_STAGES)),
    ], [4, 1], [240, 24])
