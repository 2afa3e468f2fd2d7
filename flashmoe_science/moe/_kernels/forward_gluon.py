"""The forward's down GEMM for Hopper (sm90) in Gluon: y[p] = w_p * (h[row of p] @ w2[e].T), what
`grouped_gemm.down_kernel` computes on its descriptor path, element for element (the same bits in
every case measured: benchmarks/results/moe_down_gluon/), persistent and warp-specialised.

The Triton kernel runs one program per (row block, column tile): each fills its pipeline before its
first product and stores its tile after its last, and at prefill sizes K = I is short (768 for
Qwen3-30B-A3B: 12 steps of 64), so that fill and that store are a large part of a tile. Here:
- a producer warp copies each K step's operands by TMA into NUM_STAGES buffers, each with a
  `ready` and an `empty` mbarrier: the block's TILE_M rows of h (layout order, dense) and BLOCK_N
  rows of w2[e] (w2 viewed as (E * H, I), read K-major);
- two consumer warpgroups each take HALF_M rows of a TILE_M x BLOCK_N tile (one m64n256 wgmma a
  16-deep slice), releasing a buffer once both have read it;
- persistent: one program an SM takes tiles program_id, + num_programs, ... in grouped order, and
  the producer copies the next tile's first steps while the consumers store a tile.
The store: each output row goes to its pair's slot p (the combine sums a token's k slots), so rows
scatter; EPILOGUE_N columns at a time, the scaled product is converted to a layout of 16-byte row
pieces (through shared memory) and stored with plain stores. Columns past I read as zeros (the
descriptors' bounds); a partial last column tile reads the next expert's (or no) rows of w2 into
columns past H, which are not stored.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import mbarrier, tma, warpgroup_mma, warpgroup_mma_wait

from .backward_gluon import _column_halves
from .fp8_gluon import _tile
from .offsets import wide_offset

TILE_M = gl.constexpr(128)  # the forward layout's block: a tile's rows
HALF_M = gl.constexpr(64)  # a consumer's rows of a tile
BLOCK_N = gl.constexpr(256)  # a tile's columns of H
BLOCK_K = gl.constexpr(64)  # K step (128 bytes of a 16-bit row: the widest swizzle)
EPILOGUE_N = gl.constexpr(64)  # the store's columns at a time
CONSUMERS = gl.constexpr(2)
# Registers a thread: two consumer warpgroups and the producer warp share 64K.
REGS_CONSUMER = gl.constexpr(240)
REGS_PRODUCER = gl.constexpr(24)


@gluon.jit
def _down_producer(desc_h, desc_w2, a_smem, b_smem, ready, empty, block_expert_ptr, num_blocks_m, num_tiles_n,
                   num_k, H, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Every K step of this program's tiles in order: h's (TILE_M, BLOCK_K) box and w2[e]'s
    (BLOCK_N, BLOCK_K) box."""
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            b_row = expert * H + pid_n * BLOCK_N
            for kb in range(num_k):
                stage = it % NUM_STAGES
                mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, desc_h.block_type.nbytes + desc_w2.block_type.nbytes)
                tma.async_copy_global_to_shared(desc_h, [pid_m * TILE_M, kb * BLOCK_K], bar, a_smem.index(stage))
                tma.async_copy_global_to_shared(desc_w2, [b_row, kb * BLOCK_K], bar, b_smem.index(stage))
                it += 1


@gluon.jit
def _down_consumer(a_smem, b_smem, ready, empty, y_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr,
                   block_rows_ptr, num_blocks_m, num_tiles_n, num_k, H, C: gl.constexpr, GROUP_M: gl.constexpr,
                   NUM_STAGES: gl.constexpr):
    """Consumer C's rows [C * HALF_M, (C + 1) * HALF_M) of every tile of this program: the
    products, then the rows scaled by their routing weights (in fp32, as the Triton kernel) and
    stored at their pairs' slots."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    store_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [4, 1], [1, 0])
    out_dtype: gl.constexpr = y_ptr.dtype.element_ty
    cols = gl.arange(0, EPILOGUE_N, layout=gl.SliceLayout(0, store_layout))
    rows = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, store_layout))
    acc_rows = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, acc_layout))
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            # The store's rows, pairs and routing weights (dependent loads) are read before the
            # products, so their latency passes while the tensor cores run rather than after.
            first_row = pid_m * TILE_M + C * HALF_M
            block_rows = gl.load(block_rows_ptr + pid_m)
            acc_ok = acc_rows + C * HALF_M < block_rows  # the weights in the accumulator's row layout
            route_weight = gl.load(weights_ptr + gl.load(sorted_pairs_ptr + first_row + acc_rows, mask=acc_ok,
                                                         other=0), mask=acc_ok, other=0.0)
            row_ok = rows + C * HALF_M < block_rows  # the pairs in the store's
            pairs = gl.load(sorted_pairs_ptr + first_row + rows, mask=row_ok, other=0)
            acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=acc_layout)
            for kb in range(num_k):
                stage = it % NUM_STAGES
                mbarrier.wait(ready.index(stage), (it // NUM_STAGES) & 1)
                acc = warpgroup_mma(a_smem.index(stage).slice(C * HALF_M, HALF_M),
                                    b_smem.index(stage).permute((1, 0)), acc, use_acc=kb > 0, is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                if kb > 0:
                    mbarrier.arrive(empty.index((it - 1) % NUM_STAGES), count=1)
                it += 1
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index((it - 1) % NUM_STAGES), count=1)

            left, right = _column_halves(acc)
            q0, q1 = _column_halves(left)
            q2, q3 = _column_halves(right)
            chunks = (q0, q1, q2, q3)
            # The same rows a thread holds: no data moves.
            route_weight = gl.convert_layout(route_weight, gl.SliceLayout(1, q0.type.layout))[:, None]
            row_ptrs = y_ptr + wide_offset(pairs, H)[:, None]
            for j in gl.static_range(BLOCK_N // EPILOGUE_N):
                col = pid_n * BLOCK_N + j * EPILOGUE_N
                if col < H:
                    part = gl.convert_layout((chunks[j] * route_weight).to(out_dtype), store_layout)
                    gl.store(row_ptrs + (col + cols)[None, :], part, mask=row_ok[:, None] & (col + cols < H)[None, :])


@gluon.jit
def down_gluon_kernel(desc_h, desc_w2, y_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
                      num_blocks_m, H, I, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """desc_h: h (layout rows, I), boxes (TILE_M, BLOCK_K); desc_w2: w2 (E, H, I) viewed as
    (E * H, I), boxes (BLOCK_N, BLOCK_K); y: (T * top_k, H) contiguous; weights: (T * top_k,) fp32
    routing weights; the layout's blocks TILE_M rows. num_warps = 4 (the first consumer); one
    program an SM."""
    a_smem = gl.allocate_shared_memory(desc_h.dtype, [NUM_STAGES, TILE_M, BLOCK_K], desc_h.layout)
    b_smem = gl.allocate_shared_memory(desc_w2.dtype, [NUM_STAGES, BLOCK_N, BLOCK_K], desc_w2.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(ready.index(i), count=1)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    num_tiles_n = gl.cdiv(H, BLOCK_N)
    num_k = gl.cdiv(I, BLOCK_K)
    gl.warp_specialize([
        (_down_consumer, (a_smem, b_smem, ready, empty, y_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr,
                          block_rows_ptr, num_blocks_m, num_tiles_n, num_k, H, 0, GROUP_M, NUM_STAGES)),
        (_down_consumer, (a_smem, b_smem, ready, empty, y_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr,
                          block_rows_ptr, num_blocks_m, num_tiles_n, num_k, H, 1, GROUP_M, NUM_STAGES)),
        (_down_producer, (desc_h, desc_w2, a_smem, b_smem, ready, empty, block_expert_ptr, num_blocks_m, num_tiles_n,
                          num_k, H, GROUP_M, NUM_STAGES)),
    ], [4, 1], [REGS_CONSUMER, REGS_PRODUCER])
