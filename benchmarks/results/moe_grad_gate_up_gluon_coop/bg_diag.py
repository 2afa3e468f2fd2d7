"""The 128 x 128 ping-pong Gluon d [gate, up] kernel (each consumer warpgroup a whole tile, the
two alternating, so one's epilogue runs during the other's products) that the cooperative 128 x 256
kernel replaced, with switches for diagnosis: DIAG bit 1 drops the epilogue, bit 2 the dY copies
(their buffers then hold stale data: timing only). Run by `diag.py` with DIAGS."""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

import os
from flashmoe_science.moe._kernels.fp8_gluon import _tile
from flashmoe_science.moe._kernels.offsets import wide_offset
DIAG = gl.constexpr(int(os.environ.get('DIAG', '0')))

TILE_M = gl.constexpr(128)  # the forward layout's block: a tile's rows
BLOCK_N = gl.constexpr(128)  # a tile's columns of I
EPILOGUE_N = gl.constexpr(32)  # the epilogue's columns at a time (a quarter of the tile)
BLOCK_K = gl.constexpr(64)  # K step (128 bytes of a 16-bit row: the widest swizzle)
GATHER_WARPS = gl.constexpr(4)
PENDING = gl.constexpr(1)  # a consumer's steps in flight beyond the newest (2 measured slower)
CONSUMERS = gl.constexpr(2)
# Registers a thread: two consumer warpgroups and the gather warps share 64K.
REGS_CONSUMER = gl.constexpr(232)
REGS_PRODUCER = gl.constexpr(40)


@gluon.jit
def _gather_producer(grad_out_ptr, desc_w2, a_smem, b_smem, ready, empty, sorted_pairs_ptr, block_expert_ptr,
                     block_rows_ptr, num_blocks_m, num_tiles_n, H, top_k, stride_gt, GROUP_M: gl.constexpr,
                     NUM_STAGES: gl.constexpr):
    """Every K step of this program's tiles in order: w2[e]'s (BLOCK_K, BLOCK_N) box by TMA and the
    block's dY rows (zeros on padding rows) by cp.async, 16 bytes a copy."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [GATHER_WARPS, 1], [1, 0])
    in_block = gl.arange(0, TILE_M, layout=gl.SliceLayout(1, layout))
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    num_k = H // BLOCK_K
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            row_ok = in_block < gl.load(block_rows_ptr + pid_m)
            pairs = gl.load(sorted_pairs_ptr + pid_m * TILE_M + in_block, mask=row_ok, other=0)
            dy_ptrs = grad_out_ptr + wide_offset(pairs // top_k, stride_gt)[:, None] + offs_k[None, :]
            mask = row_ok[:, None] & (offs_k < BLOCK_K)[None, :]
            b_row = expert * H
            for kb in range(num_k):
                stage = it % NUM_STAGES
                mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, desc_w2.block_type.nbytes)
                tma.async_copy_global_to_shared(desc_w2, [b_row + kb * BLOCK_K, pid_n * BLOCK_N], bar,
                                                b_smem.index(stage))
                if (DIAG & 2) == 0:
                    async_copy.async_copy_global_to_shared(a_smem.index(stage), dy_ptrs + kb * BLOCK_K, mask=mask)
                async_copy.mbarrier_arrive(bar, increment_count=False)
                it += 1


@gluon.jit
def _product(a_smem, b_smem, ready, empty, products_done, it, num_k, acc_layout: gl.constexpr,
             NUM_STAGES: gl.constexpr, PENDING: gl.constexpr):
    """The (TILE_M, BLOCK_N) fp32 sum over one tile's K steps (buffer uses it, it + 1, ...) with up
    to PENDING + 1 steps' products in flight, each buffer released once its product is done.
    `products_done` is signalled once every buffer of the tile has been waited on, so the other
    consumer's products queue behind this tile's last ones."""
    acc = gl.zeros([TILE_M, BLOCK_N], gl.float32, layout=acc_layout)
    for kb in range(num_k):
        stage = (it + kb) % NUM_STAGES
        mbarrier.wait(ready.index(stage), ((it + kb) // NUM_STAGES) & 1)
        fence_async_shared()  # the gathered rows came through the generic proxy; wgmma reads the async one
        acc = warpgroup_mma(a_smem.index(stage), b_smem.index(stage), acc, use_acc=kb > 0, is_async=True)
        acc = warpgroup_mma_wait(PENDING, deps=[acc])
        if kb >= PENDING:
            mbarrier.arrive(empty.index((it + kb - PENDING) % NUM_STAGES), count=1)
    mbarrier.arrive(products_done, count=1)
    acc = warpgroup_mma_wait(0, deps=[acc])
    for p in gl.static_range(PENDING):
        if num_k - PENDING + p >= 0:
            mbarrier.arrive(empty.index((it + num_k - PENDING + p) % NUM_STAGES), count=1)
    return acc


@gluon.jit
def _load_epilogue_operands(desc_h, desc_hg, epi_smem, epi_bar, C: gl.constexpr, first_row, col, I):
    """TMA copies of h and both derivatives of EPILOGUE_N columns from `col` into the epilogue
    buffers, signalled on consumer C's barrier."""
    bar = epi_bar.index(C)
    mbarrier.expect(bar, 3 * desc_h.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_h, [first_row, col], bar, epi_smem.index(0))
    tma.async_copy_global_to_shared(desc_hg, [first_row, col], bar, epi_smem.index(1))
    tma.async_copy_global_to_shared(desc_hg, [first_row, I + col], bar, epi_smem.index(2))


@gluon.jit
def _epilogue(acc, desc_h, desc_hg, desc_ggu, desc_wh, epi_smem, epi_bar, epi_phase, weights_ptr, row_tokens_ptr,
              grad_weights_ptr, sorted_pairs_ptr, block_rows_ptr, pid_m, pid_n, num_pairs, I, top_k,
              weight_grad_operands, C: gl.constexpr):
    """grad_gate_up_kernel's epilogue on a = acc, EPILOGUE_N columns at a time: h and the
    derivatives come in by TMA (the first part's copies issued by the caller) and the results
    leave by TMA from the same buffers, so no element address lives in registers. Returns the
    epilogue barrier's phase after its waits."""
    parts = gl.split(gl.permute(gl.reshape(acc, [TILE_M, 2, BLOCK_N // 2]), (0, 2, 1)))
    q0, q1 = gl.split(gl.permute(gl.reshape(parts[0], [TILE_M, 2, EPILOGUE_N]), (0, 2, 1)))
    q2, q3 = gl.split(gl.permute(gl.reshape(parts[1], [TILE_M, 2, EPILOGUE_N]), (0, 2, 1)))
    layout: gl.constexpr = q0.type.layout
    in_block = gl.arange(0, TILE_M, layout=gl.SliceLayout(1, layout))
    first_row = pid_m * TILE_M
    row_ok = in_block < gl.load(block_rows_ptr + pid_m)
    pairs = gl.load(sorted_pairs_ptr + first_row + in_block, mask=row_ok, other=0)
    if weight_grad_operands:
        if pid_n == 0:
            gl.store(row_tokens_ptr + first_row + in_block, gl.where(row_ok, pairs // top_k, -1))
    route_weight = gl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    col = pid_n * BLOCK_N
    d_weight, epi_phase = _epilogue_part(q0, desc_h, desc_hg, desc_ggu, desc_wh, epi_smem, epi_bar, epi_phase,
                                         route_weight, first_row, col, I, weight_grad_operands, C, layout)
    for j in gl.static_range(1, BLOCK_N // EPILOGUE_N):
        part = q1 if j == 1 else q2 if j == 2 else q3
        if col + j * EPILOGUE_N < I:
            _load_epilogue_operands(desc_h, desc_hg, epi_smem, epi_bar, C, first_row, col + j * EPILOGUE_N, I)
            d_part, epi_phase = _epilogue_part(part, desc_h, desc_hg, desc_ggu, desc_wh, epi_smem, epi_bar, epi_phase,
                                               route_weight, first_row, col + j * EPILOGUE_N, I, weight_grad_operands,
                                               C, layout)
            d_weight += d_part
    gl.store(grad_weights_ptr + wide_offset(pid_n, num_pairs) + pairs, d_weight, mask=row_ok)
    return epi_phase


@gluon.jit
def _epilogue_part(a, desc_h, desc_hg, desc_ggu, desc_wh, epi_smem, epi_bar, epi_phase, route_weight, first_row, col,
                   I, weight_grad_operands, C: gl.constexpr, layout: gl.constexpr):
    """Columns [col, col + EPILOGUE_N) of the epilogue, whose operands' copies are in flight:
    the stores from its buffers, and the rows' sums of a * h over them."""
    h_buf, dgate_buf, dup_buf = epi_smem.index(0), epi_smem.index(1), epi_smem.index(2)
    mbarrier.wait(epi_bar.index(C), epi_phase)
    out_dtype: gl.constexpr = h_buf.dtype
    h = h_buf.load(layout).to(gl.float32)
    d_weight = gl.sum(a * h, axis=1)
    grad_h = a * route_weight
    dh_dgate = dgate_buf.load(layout).to(gl.float32)
    dh_dup = dup_buf.load(layout).to(gl.float32)
    if weight_grad_operands:
        h_buf.store((h * route_weight).to(out_dtype))
    dgate_buf.store((grad_h * dh_dgate).to(out_dtype))
    dup_buf.store((grad_h * dh_dup).to(out_dtype))
    fence_async_shared()
    gl.thread_barrier()
    if weight_grad_operands:
        tma.async_copy_shared_to_global(desc_wh, [first_row, col], h_buf)
    tma.async_copy_shared_to_global(desc_ggu, [first_row, col], dgate_buf)
    tma.async_copy_shared_to_global(desc_ggu, [first_row, I + col], dup_buf)
    tma.store_wait(0)  # the buffers are read before the next copies land in them
    return d_weight, epi_phase ^ 1


@gluon.jit
def _consumer(a_smem, b_smem, ready, empty, products_done, epilogue_done, epi_smem, epi_bar, desc_h, desc_hg,
              desc_ggu, desc_wh, grad_gate_up_ptr, weights_ptr, row_tokens_ptr, grad_weights_ptr, sorted_pairs_ptr,
              block_expert_ptr, block_rows_ptr, num_blocks_m, num_pairs, H, I, top_k, weight_grad_operands,
              C: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Consumer C's share of this program's tiles: of those with rows, and of those of unused
    blocks, every CONSUMERS-th from the C-th."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_tiles_n = gl.cdiv(I, BLOCK_N)
    num_k = H // BLOCK_K
    it = 0
    turn = 0
    epi_phase = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            used = it // num_k  # the program's tiles with rows before this one: the consumers alternate over them
            if used % CONSUMERS == C:
                # The products run one tile after the other, so a consumer waits on each buffer's next
                # phase only (mbarrier waits tell phases apart by parity alone), and the other's
                # epilogue overlaps them. The epilogues, which share their buffers, run in the same order.
                if used > 0:
                    mbarrier.wait(products_done, (used - 1) & 1)
                acc = _product(a_smem, b_smem, ready, empty, products_done, it, num_k, acc_layout, NUM_STAGES,
                               PENDING)
                if (DIAG & 1) == 0:
                    if used > 0:
                        mbarrier.wait(epilogue_done, (used - 1) & 1)
                    _load_epilogue_operands(desc_h, desc_hg, epi_smem, epi_bar, C, pid_m * TILE_M, pid_n * BLOCK_N, I)
                    epi_phase = _epilogue(acc, desc_h, desc_hg, desc_ggu, desc_wh, epi_smem, epi_bar, epi_phase,
                                          weights_ptr, row_tokens_ptr, grad_weights_ptr, sorted_pairs_ptr, block_rows_ptr,
                                          pid_m, pid_n, num_pairs, I, top_k, weight_grad_operands, C)
                    mbarrier.arrive(epilogue_done, count=1)
                else:
                    rows_in = pid_m * TILE_M + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, acc_layout))
                    gl.store(grad_weights_ptr + rows_in, gl.sum(acc, axis=1), mask=rows_in < num_pairs)
            it += num_k
        else:
            if turn % CONSUMERS == C:  # the layout's unused blocks: grad_gate_up (the op's output) is zero there too
                _zero_tile(grad_gate_up_ptr, pid_m * TILE_M, pid_n * BLOCK_N, I)
            turn += 1


@gluon.jit
def _zero_tile(grad_gate_up_ptr, first_row, col, I):
    """Zeros into the gate and up columns [col, col + BLOCK_N) of grad_gate_up's (rows, 2I) rows
    from first_row, EPILOGUE_N columns at a time."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    zeros = gl.zeros([TILE_M, EPILOGUE_N], grad_gate_up_ptr.dtype.element_ty, layout=layout)
    rows = first_row + gl.arange(0, TILE_M, layout=gl.SliceLayout(1, layout))
    cols = gl.arange(0, EPILOGUE_N, layout=gl.SliceLayout(0, layout))
    for j in gl.static_range(BLOCK_N // EPILOGUE_N):
        if col + j * EPILOGUE_N < I:
            ptrs = grad_gate_up_ptr + wide_offset(rows, 2 * I)[:, None] + (col + j * EPILOGUE_N + cols)[None, :]
            gl.store(ptrs, zeros)
            gl.store(ptrs + I, zeros)


@gluon.jit
def grad_gate_up_gluon_kernel(
    grad_out_ptr, desc_w2, desc_h, desc_hg, weights_ptr, desc_ggu, grad_gate_up_ptr, desc_wh, row_tokens_ptr,
    grad_weights_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    num_blocks_m, num_pairs, H, I, top_k, weight_grad_operands, stride_gt,
    GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
):
    """The arguments of `backward.grad_gate_up_kernel` (not interleaved), with TMA descriptors for
    the dense operands: desc_w2 of w2 (E, H, I) viewed as (E * H, I), boxes (BLOCK_K, BLOCK_N);
    desc_h, desc_hg, desc_ggu and desc_wh of h (rows, I), h_grads (rows, 2I), grad_gate_up (rows,
    2I) and weighted_h (rows, I), boxes (TILE_M, EPILOGUE_N); grad_gate_up_ptr the same
    grad_gate_up (its unused blocks' zeros are pointer stores). H a multiple of BLOCK_K, I of
    EPILOGUE_N; grad_out's rows (stride_gt) 16-byte aligned; the layout's blocks TILE_M rows.
    num_warps = 4 (the first consumer); one program an SM."""
    dtype: gl.constexpr = grad_out_ptr.dtype.element_ty
    a_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, TILE_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([TILE_M, BLOCK_K], dtype))
    b_smem = gl.allocate_shared_memory(desc_w2.dtype, [NUM_STAGES, BLOCK_K, BLOCK_N], desc_w2.layout)
    epi_smem = gl.allocate_shared_memory(desc_h.dtype, [3, TILE_M, EPILOGUE_N], desc_h.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    epi_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        # The TMA's expect arrives once, and every producer thread once its copies land.
        mbarrier.init(ready.index(i), count=1 + 32 * GATHER_WARPS)
        mbarrier.init(empty.index(i), count=1)
    for c in gl.static_range(CONSUMERS):
        mbarrier.init(epi_bar.index(c), count=1)
    products_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(products_done, count=1)
    epilogue_done = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    mbarrier.init(epilogue_done, count=1)
    num_tiles_n = gl.cdiv(I, BLOCK_N)
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, ready, empty, products_done, epilogue_done, epi_smem, epi_bar, desc_h,
                     desc_hg, desc_ggu, desc_wh, grad_gate_up_ptr, weights_ptr, row_tokens_ptr, grad_weights_ptr,
                     sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, num_blocks_m, num_pairs, H, I, top_k,
                     weight_grad_operands, 0, GROUP_M, NUM_STAGES)),
        (_consumer, (a_smem, b_smem, ready, empty, products_done, epilogue_done, epi_smem, epi_bar, desc_h,
                     desc_hg, desc_ggu, desc_wh, grad_gate_up_ptr, weights_ptr, row_tokens_ptr, grad_weights_ptr,
                     sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, num_blocks_m, num_pairs, H, I, top_k,
                     weight_grad_operands, 1, GROUP_M, NUM_STAGES)),
        (_gather_producer, (grad_out_ptr, desc_w2, a_smem, b_smem, ready, empty, sorted_pairs_ptr, block_expert_ptr,
                            block_rows_ptr, num_blocks_m, num_tiles_n, H, top_k, stride_gt, GROUP_M, NUM_STAGES)),
    ], [4, GATHER_WARPS], [REGS_CONSUMER, REGS_PRODUCER])
