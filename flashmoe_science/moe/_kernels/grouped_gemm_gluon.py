"""The forward's gate/up GEMM for Hopper (sm90) in Gluon: persistent, warp-specialised, the token
rows gathered by copy warps.

It computes what `grouped_gemm.gate_up_kernel` computes for 128-row blocks (see that kernel for the
formulas and the outputs' layouts): [gate, up] = x[tokens of the block's rows] @ w1[e][gate and up
rows of the column tile].T, then h = act(gate) * up and, when a backward follows (store_h_grads),
the activation's local derivatives [dh/dgate, dh/dup]. In the Triton kernel the gathered x rows
are pointer loads that Triton pipelines at most 3 loads deep, and each program's epilogue runs
with nothing overlapping it. Here, as in `backward_gluon.weight_grad_gluon_kernel`:
- a producer partition of GATHER_WARPS warps fills NUM_STAGES buffers, each with a `ready` and an
  `empty` mbarrier: w1[e]'s gate rows and up rows of the tile's BLOCK_N columns, two TMA boxes, and
  the block's x rows gathered by token as 16-byte cp.async copies (Hopper has no TMA gather), each
  producer thread signalling the stage's `ready` barrier once its copies land (zeros on padding
  rows);
- two consumer warpgroups each take HALF_M rows of every tile (the row halves of A lie in buffers
  of their own) with two accumulators, gate and up (m64n128 wgmmas), and release a buffer once both
  have read it;
- each consumer's epilogue writes h (and the derivatives) by TMA from shared memory, waited on
  only before a buffer is written again, so the stores run under the next tile's products.
Persistent: one program an SM takes tiles program_id, + num_programs, ... in grouped order; every
partition walks the same tiles and counts buffer uses across them, so the producer copies the next
tile's first steps while the consumers finish one.

Rows: a tile is one 128-row block of the layout; padding rows gather zeros, so they hold what the
Triton kernel writes there (h = 0). Blocks past the last expert are written as zeros when
store_h_grads is set (the backward reads every block), else left alone. w1 is viewed as (E * 2I,
H), so I must be a multiple of BLOCK_N for a box never to cross from gate rows into up rows, and H
of BLOCK_K.
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .fp8_gluon import _tile
from .grouped_gemm import _gated_activation, _gated_activation_grads
from .offsets import wide_offset

TILE_M = gl.constexpr(128)  # the layout's block: a tile's rows
HALF_M = gl.constexpr(64)  # a consumer's rows: one wgmma's M
BLOCK_N = gl.constexpr(128)  # a tile's columns of h (twice as many rows of w1)
BLOCK_K = gl.constexpr(64)  # K step (128 bytes of a 16-bit row: the widest swizzle)
EPILOGUE_N = gl.constexpr(64)  # the epilogue's columns at a time (half the tile's)
EPILOGUE_BUFFERS = gl.constexpr(2)  # a consumer's ring of (HALF_M, EPILOGUE_N) buffers for its stores
GATHER_WARPS = gl.constexpr(4)
CONSUMERS = gl.constexpr(2)
# The activations it is built for: gpt-oss's clamped SwiGLU ("swiglu_oai", which comes with biases
# that this kernel does not add) spills 648 bytes a thread in the epilogue.
ACTIVATIONS = ("silu", "gelu")
# Registers a thread: the second consumer and the gather warps; the first consumer (the default
# partition) gets the rest of the 64K, about as many as the second.
REGS_CONSUMER = gl.constexpr(208)
REGS_PRODUCER = gl.constexpr(88)


@gluon.jit
def _gate_up_producer(x_ptr, desc_w1, a_smem, b_smem, ready, empty, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
                      num_blocks_m, num_tiles_n, H, I, top_k, stride_xt, GROUP_M: gl.constexpr,
                      NUM_STAGES: gl.constexpr):
    """Every K step of this program's tiles with rows, in order: the gate and up boxes of w1[e] by
    TMA, the block's two row halves of x by cp.async."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [GATHER_WARPS, 1], [1, 0])
    in_half = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    num_k = H // BLOCK_K
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            block_rows = gl.load(block_rows_ptr + pid_m)
            ok0 = in_half < block_rows
            ok1 = in_half + HALF_M < block_rows
            pairs0 = gl.load(sorted_pairs_ptr + pid_m * TILE_M + in_half, mask=ok0, other=0)
            pairs1 = gl.load(sorted_pairs_ptr + pid_m * TILE_M + HALF_M + in_half, mask=ok1, other=0)
            x0 = x_ptr + wide_offset(pairs0 // top_k, stride_xt)[:, None] + offs_k[None, :]
            x1 = x_ptr + wide_offset(pairs1 // top_k, stride_xt)[:, None] + offs_k[None, :]
            mask0 = ok0[:, None] & (offs_k < BLOCK_K)[None, :]
            mask1 = ok1[:, None] & (offs_k < BLOCK_K)[None, :]
            gate_row = expert * 2 * I + pid_n * BLOCK_N
            for kb in range(num_k):
                stage = it % NUM_STAGES
                mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, 2 * desc_w1.block_type.nbytes)
                tma.async_copy_global_to_shared(desc_w1, [gate_row, kb * BLOCK_K], bar, b_smem.index(2 * stage))
                tma.async_copy_global_to_shared(desc_w1, [gate_row + I, kb * BLOCK_K], bar, b_smem.index(2 * stage + 1))
                async_copy.async_copy_global_to_shared(a_smem.index(2 * stage), x0 + kb * BLOCK_K, mask=mask0)
                async_copy.async_copy_global_to_shared(a_smem.index(2 * stage + 1), x1 + kb * BLOCK_K, mask=mask1)
                async_copy.mbarrier_arrive(bar, increment_count=False)
                it += 1


@gluon.jit
def _store(values, epi_smem, C: gl.constexpr, n: gl.constexpr, desc, row, col):
    """values into desc's box at (row, col) through the n-th store of a tile (from 0) in consumer
    C's ring of EPILOGUE_BUFFERS shared-memory buffers, once that buffer's last store has read it
    (the caller waited for the previous tile's)."""
    if n >= EPILOGUE_BUFFERS:
        tma.store_wait(EPILOGUE_BUFFERS - 1)
    buf = epi_smem.index(C * EPILOGUE_BUFFERS + n % EPILOGUE_BUFFERS)
    buf.store(values)
    fence_async_shared()
    gl.thread_barrier()
    tma.async_copy_shared_to_global(desc, [row, col], buf)


@gluon.jit
def _epilogue_half(gate, up, epi_smem, C: gl.constexpr, j: gl.constexpr, desc_h, desc_hg, row, col, I,
                   store_h_grads, ACTIVATION: gl.constexpr):
    """The epilogue of the tile's columns [col, col + EPILOGUE_N), half j of the consumer's: h,
    and with store_h_grads the derivatives, stored through the buffer ring (stores 3j... of the
    tile with derivatives, j without)."""
    out_dtype: gl.constexpr = epi_smem.dtype
    if store_h_grads:
        dh_dgate, dh_dup = _gated_activation_grads(gate, up, ACTIVATION)
        _store((dh_dup * up).to(out_dtype), epi_smem, C, 3 * j, desc_h, row, col)  # h = act(gate) * up
        _store(dh_dgate.to(out_dtype), epi_smem, C, 3 * j + 1, desc_hg, row, col)
        _store(dh_dup.to(out_dtype), epi_smem, C, 3 * j + 2, desc_hg, row, I + col)
    else:
        _store(_gated_activation(gate, up, ACTIVATION).to(out_dtype), epi_smem, C, j, desc_h, row, col)


@gluon.jit
def _gate_up_consumer(a_smem, b_smem, ready, empty, epi_smem, desc_h, desc_hg, block_expert_ptr, num_blocks_m,
                      num_tiles_n, H, I, store_h_grads, C: gl.constexpr, ACTIVATION: gl.constexpr,
                      GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Consumer C's rows [C * HALF_M, (C + 1) * HALF_M) of every tile of this program: gate and up
    summed over K, then h (and the derivatives) stored from its two epilogue buffers."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_k = H // BLOCK_K
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        row = pid_m * TILE_M + C * HALF_M
        col = pid_n * BLOCK_N
        if expert >= 0:
            gate = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=acc_layout)
            up = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=acc_layout)
            for kb in range(num_k):
                stage = (it + kb) % NUM_STAGES
                mbarrier.wait(ready.index(stage), ((it + kb) // NUM_STAGES) & 1)
                fence_async_shared()  # the gathered rows came through the generic proxy; wgmma reads the async one
                a = a_smem.index(2 * stage + C)
                gate = warpgroup_mma(a, b_smem.index(2 * stage).permute((1, 0)), gate, is_async=True)
                up = warpgroup_mma(a, b_smem.index(2 * stage + 1).permute((1, 0)), up, is_async=True)
                gate, up = warpgroup_mma_wait(2, deps=[gate, up])
                if kb > 0:
                    mbarrier.arrive(empty.index((it + kb - 1) % NUM_STAGES), count=1)
            gate, up = warpgroup_mma_wait(0, deps=[gate, up])
            mbarrier.arrive(empty.index((it + num_k - 1) % NUM_STAGES), count=1)
            it += num_k
            tma.store_wait(0)  # the previous tile's stores have read the buffers
            # Half the columns at a time: gate, up and the derivatives of all of them at once
            # overflow the registers.
            gate0, gate1 = gl.split(gl.permute(gl.reshape(gate, [HALF_M, 2, EPILOGUE_N]), (0, 2, 1)))
            up0, up1 = gl.split(gl.permute(gl.reshape(up, [HALF_M, 2, EPILOGUE_N]), (0, 2, 1)))
            _epilogue_half(gate0, up0, epi_smem, C, 0, desc_h, desc_hg, row, col, I, store_h_grads, ACTIVATION)
            _epilogue_half(gate1, up1, epi_smem, C, 1, desc_h, desc_hg, row, col + EPILOGUE_N, I, store_h_grads,
                           ACTIVATION)
        elif store_h_grads:  # the layout's unused blocks, saved for the backward: zeros, never stale memory
            tma.store_wait(0)
            zeros = epi_smem.index(C * EPILOGUE_BUFFERS)
            zeros.store(gl.zeros([HALF_M, EPILOGUE_N], zeros.dtype, layout=gl.BlockedLayout([1, 8], [4, 8], [4, 1],
                                                                                              [1, 0])))
            fence_async_shared()
            gl.thread_barrier()
            for j in gl.static_range(2):
                tma.async_copy_shared_to_global(desc_h, [row, col + j * EPILOGUE_N], zeros)
                tma.async_copy_shared_to_global(desc_hg, [row, col + j * EPILOGUE_N], zeros)
                tma.async_copy_shared_to_global(desc_hg, [row, I + col + j * EPILOGUE_N], zeros)
    tma.store_wait(0)


@gluon.jit
def gate_up_gluon_kernel(
    x_ptr, desc_w1, desc_h, desc_hg, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    num_blocks_m, H, I, top_k, store_h_grads, stride_xt,
    ACTIVATION: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
):
    """The arguments of `grouped_gemm.gate_up_kernel` (no bias, not interleaved), with
    TMA descriptors for the dense ones: desc_w1 of w1 (E, 2I, H) viewed as (E * 2I, H), boxes
    (BLOCK_N, BLOCK_K); desc_h and desc_hg of h (rows, I) and h_grads (rows, 2I) (when store_h_grads
    is 0, any descriptor of the same boxes: not written), boxes (HALF_M, EPILOGUE_N). x's rows
    (stride_xt) 16-byte aligned; I a multiple of BLOCK_N, H of BLOCK_K; the layout's blocks TILE_M
    rows. num_warps = 4 (the first consumer); one program an SM."""
    dtype: gl.constexpr = desc_w1.dtype
    a_smem = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, HALF_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], dtype))
    b_smem = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, BLOCK_N, BLOCK_K], desc_w1.layout)
    epi_smem = gl.allocate_shared_memory(desc_h.dtype, [CONSUMERS * EPILOGUE_BUFFERS, HALF_M, EPILOGUE_N],
                                         desc_h.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        # The TMA's expect arrives once, and every producer thread once its copies land.
        mbarrier.init(ready.index(i), count=1 + 32 * GATHER_WARPS)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    num_tiles_n = I // BLOCK_N
    gl.warp_specialize([
        (_gate_up_consumer, (a_smem, b_smem, ready, empty, epi_smem, desc_h, desc_hg, block_expert_ptr, num_blocks_m,
                             num_tiles_n, H, I, store_h_grads, 0, ACTIVATION, GROUP_M, NUM_STAGES)),
        (_gate_up_consumer, (a_smem, b_smem, ready, empty, epi_smem, desc_h, desc_hg, block_expert_ptr, num_blocks_m,
                             num_tiles_n, H, I, store_h_grads, 1, ACTIVATION, GROUP_M, NUM_STAGES)),
        (_gate_up_producer, (x_ptr, desc_w1, a_smem, b_smem, ready, empty, sorted_pairs_ptr, block_expert_ptr,
                             block_rows_ptr, num_blocks_m, num_tiles_n, H, I, top_k, stride_xt, GROUP_M,
                             NUM_STAGES)),
    ], [4, GATHER_WARPS], [REGS_CONSUMER, REGS_PRODUCER])
