"""The backward's GEMMs for Hopper (sm90) in Gluon, persistent and warp-specialised: d [gate, up]
(`grad_gate_up_gluon_kernel`) and the weight gradients d w1 and d w2 (`weight_grad_gluon_kernel`).
Both run CUTLASS's cooperative Hopper layout: tiles of TILE_M x BLOCK_N (128 x 256), two consumer
warpgroups each HALF_M rows of a tile (one m64n256 wgmma a 16-deep slice, A's row halves in
buffers of their own), fed by a producer partition of GATHER_WARPS warps that fills NUM_STAGES
buffers, each with a `ready` and an `empty` mbarrier: the operand in layout order by TMA, the
operand gathered by token as 16-byte cp.async copies (Hopper has no TMA gather) whose completion
each producer thread signals on the same `ready` barrier (`cp.async.mbarrier.arrive.noinc`), zeros
on padding rows. A buffer is released once both consumers have read it. Persistent: one program an
SM takes tiles program_id, + num_programs, ... and every partition walks the same sequence,
counting buffer uses across tiles, so the producer copies the next tile's first operands during a
tile's last products and epilogue.

Why 128 x 256: these kernels read their operands from L2 (w2's tiles are shared by an expert's
row blocks, dY's rows by the columns' tiles), and 128 x 128 tiles (32 KB a K step for 2 MFLOP)
left d [gate, up] at about 390 TFLOP/s on an H200, bound by those reads: without the dY copies it
ran at 595 (benchmarks/results/moe_grad_gate_up_gluon_coop/ggu_diag.json). 128 x 256 tiles read
48 KB for 4 MFLOP.

d [gate, up]:

It computes what `backward.grad_gate_up_kernel` computes, element for element (see that kernel for
the formulas and the outputs' layouts): a = dY[tokens of the block's rows] @ w2[e][:, n-tile], then
an epilogue that reads h and the two stored activation derivatives and writes d [gate, up], the
tile's part of d topk_weights (one part per BLOCK_N columns) and, for the weight gradients,
w_p * h_p and each row's token. The epilogue moves 12 bytes per row and column of I, and the two
consumers run theirs at the same time, after their products; so that its copies do not wait:
- each consumer loads the epilogue's operands (h and both derivatives) of its HALF_M rows by TMA,
  EPILOGUE_N columns at a time, into two input slots of its own: the first two chunks while its
  products run, then chunk j + 2 as soon as chunk j has been read;
- the results leave by TMA from output buffers of their own, waited on only before the next
  chunk's results are written there.
(Element addresses in registers beside the 128-register accumulator made ptxas spill.)
Rows: one tile is one 128-row block of the forward's layout; padding rows read as zeros (masked
copies fill zeros) and are written as zeros, as are the blocks past the last expert. Columns past
I read as zeros (the descriptor's bounds) and are not written. w2 is viewed as (E * H, I), so H
must be a multiple of BLOCK_K for a box never to cross an expert.

Weight gradients: out[e] = A[rows of e].T @ B[rows of e], K = the expert's layout rows, as
`backward.grad_w1_kernel` and `grad_w2_kernel` (d w1: A = d [gate, up] in layout order, B = x
gathered by token; d w2: A = dY gathered by token, B = w_p * h_p in layout order). The Triton
kernels run one program per (expert, tile) whose gathered operand Triton pipelines at most 3 loads
deep, with the output written after each tile's products. Here each consumer stores its
(HALF_M, BLOCK_N) part by TMA from shared memory, waited on only before the buffer is written
again, so the store runs under the next tile's products; an expert without rows gets zeros. Tiles
go in `backward._expert_rows`' order (experts in turn): at 4096 tokens an expert of Qwen3-30B-A3B
has 4 row steps a tile, where a program per tile spends much of its time filling its pipeline. The
row steps are BLOCK_K layout rows, so the layout's blocks (64 or 128 rows) hold whole steps.
Each output element is one tile's sum over the rows in order, as in the Triton kernels (the same
bits in every case measured: benchmarks/results/moe_weight_grad_gluon.json).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.ampere import async_copy
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .backward import _expert_rows
from .fp8_gluon import _tile
from .offsets import wide_offset

TILE_M = gl.constexpr(128)  # the forward layout's block: a tile's rows
HALF_M = gl.constexpr(64)  # a consumer's rows of a tile
BLOCK_N = gl.constexpr(256)  # a tile's columns
EPILOGUE_N = gl.constexpr(32)  # d [gate, up]'s epilogue: columns at a time
BLOCK_K = gl.constexpr(64)  # K step (128 bytes of a 16-bit row: the widest swizzle)
GATHER_WARPS = gl.constexpr(4)
CONSUMERS = gl.constexpr(2)
# Registers a thread: two consumer warpgroups and the gather warps share 64K.
REGS_CONSUMER = gl.constexpr(232)
REGS_PRODUCER = gl.constexpr(40)  # d [gate, up]'s, which gathers A
REGS_WEIGHT_GRAD_PRODUCER = gl.constexpr(88)


@gluon.jit
def _gather_producer(grad_out_ptr, desc_w2, a_smem, b_smem, ready, empty, sorted_pairs_ptr, block_expert_ptr,
                     block_rows_ptr, num_blocks_m, num_tiles_n, H, top_k, stride_gt, GROUP_M: gl.constexpr,
                     NUM_STAGES: gl.constexpr):
    """Every K step of this program's tiles in order: w2[e]'s (BLOCK_K, BLOCK_N) box by TMA and the
    block's dY rows (zeros on padding rows) by cp.async, 16 bytes a copy, each row half into the
    buffer its consumer reads."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [GATHER_WARPS, 1], [1, 0])
    in_half = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))
    offs_k = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(0, layout))
    num_k = H // BLOCK_K
    it = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        if expert >= 0:
            block_rows = gl.load(block_rows_ptr + pid_m)
            ok_0 = in_half < block_rows
            ok_1 = in_half + HALF_M < block_rows
            pairs_0 = gl.load(sorted_pairs_ptr + pid_m * TILE_M + in_half, mask=ok_0, other=0)
            pairs_1 = gl.load(sorted_pairs_ptr + pid_m * TILE_M + HALF_M + in_half, mask=ok_1, other=0)
            dy_0 = grad_out_ptr + wide_offset(pairs_0 // top_k, stride_gt)[:, None] + offs_k[None, :]
            dy_1 = grad_out_ptr + wide_offset(pairs_1 // top_k, stride_gt)[:, None] + offs_k[None, :]
            mask_0 = ok_0[:, None] & (offs_k < BLOCK_K)[None, :]
            mask_1 = ok_1[:, None] & (offs_k < BLOCK_K)[None, :]
            b_row = expert * H
            for kb in range(num_k):
                stage = it % NUM_STAGES
                mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
                bar = ready.index(stage)
                mbarrier.expect(bar, desc_w2.block_type.nbytes)
                tma.async_copy_global_to_shared(desc_w2, [b_row + kb * BLOCK_K, pid_n * BLOCK_N], bar,
                                                b_smem.index(stage))
                async_copy.async_copy_global_to_shared(a_smem.index(2 * stage), dy_0 + kb * BLOCK_K, mask=mask_0)
                async_copy.async_copy_global_to_shared(a_smem.index(2 * stage + 1), dy_1 + kb * BLOCK_K,
                                                       mask=mask_1)
                async_copy.mbarrier_arrive(bar, increment_count=False)
                it += 1


@gluon.jit
def _load_epilogue_chunk(desc_h, desc_hg, in_smem, in_bar, C: gl.constexpr, slot: gl.constexpr, row, col, I):
    """TMA copies of h and both derivatives, rows [row, row + HALF_M) and EPILOGUE_N columns from
    `col`, into consumer C's input slot `slot`."""
    first: gl.constexpr = 3 * (2 * C + slot)
    bar = in_bar.index(2 * C + slot)
    mbarrier.expect(bar, 3 * desc_h.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_h, [row, col], bar, in_smem.index(first))
    tma.async_copy_global_to_shared(desc_hg, [row, col], bar, in_smem.index(first + 1))
    tma.async_copy_global_to_shared(desc_hg, [row, I + col], bar, in_smem.index(first + 2))


@gluon.jit
def _column_halves(t):
    """t's left and right halves of columns (register views: no data moves)."""
    half: gl.constexpr = t.shape[1] // 2
    return gl.split(gl.permute(gl.reshape(t, [t.shape[0], 2, half]), (0, 2, 1)))


@gluon.jit
def _epilogue_chunks(acc):
    """acc's BLOCK_N // EPILOGUE_N column chunks, left to right."""
    left, right = _column_halves(acc)
    q0, q1 = _column_halves(left)
    q2, q3 = _column_halves(right)
    c0, c1 = _column_halves(q0)
    c2, c3 = _column_halves(q1)
    c4, c5 = _column_halves(q2)
    c6, c7 = _column_halves(q3)
    return c0, c1, c2, c3, c4, c5, c6, c7


@gluon.jit
def _epilogue_chunk(a, j: gl.constexpr, num_chunks, desc_h, desc_hg, desc_ggu, desc_wh, in_smem, out_smem, in_bar,
                    phase, route_weight, row, col, I, weight_grad_operands, C: gl.constexpr):
    """Chunk j of consumer C's epilogue (columns col + j * EPILOGUE_N ...; num_chunks of the tile's
    lie within I) on a = its part of the accumulator: waits for its operands, issues chunk j + 2's
    into the slot it frees, stores its results by TMA. Returns the rows' sums of a * h over it and
    the slot barrier's phase after the wait."""
    slot: gl.constexpr = j % 2
    first: gl.constexpr = 3 * (2 * C + slot)
    layout: gl.constexpr = a.type.layout
    c = col + j * EPILOGUE_N
    mbarrier.wait(in_bar.index(2 * C + slot), phase)
    h = in_smem.index(first).load(layout).to(gl.float32)
    dh_dgate = in_smem.index(first + 1).load(layout).to(gl.float32)
    dh_dup = in_smem.index(first + 2).load(layout).to(gl.float32)
    gl.thread_barrier()  # every thread has read the slot
    if j + 2 < num_chunks:
        _load_epilogue_chunk(desc_h, desc_hg, in_smem, in_bar, C, slot, row, c + 2 * EPILOGUE_N, I)
    d_weight = gl.sum(a * h, axis=1)
    grad_h = a * route_weight
    out: gl.constexpr = 3 * C
    out_dtype: gl.constexpr = out_smem.dtype
    tma.store_wait(0)  # the previous chunk's stores have read the output buffers
    gl.thread_barrier()
    if weight_grad_operands:
        out_smem.index(out).store((h * route_weight).to(out_dtype))
    out_smem.index(out + 1).store((grad_h * dh_dgate).to(out_dtype))
    out_smem.index(out + 2).store((grad_h * dh_dup).to(out_dtype))
    fence_async_shared()
    gl.thread_barrier()
    if weight_grad_operands:
        tma.async_copy_shared_to_global(desc_wh, [row, c], out_smem.index(out))
    tma.async_copy_shared_to_global(desc_ggu, [row, c], out_smem.index(out + 1))
    tma.async_copy_shared_to_global(desc_ggu, [row, I + c], out_smem.index(out + 2))
    return d_weight, phase ^ 1


@gluon.jit
def _consumer(a_smem, b_smem, ready, empty, in_smem, out_smem, in_bar, desc_h, desc_hg, desc_ggu, desc_wh,
              grad_gate_up_ptr, weights_ptr, row_tokens_ptr, grad_weights_ptr, sorted_pairs_ptr, block_expert_ptr,
              block_rows_ptr, num_blocks_m, num_pairs, H, I, top_k, weight_grad_operands, C: gl.constexpr,
              GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Consumer C's rows [C * HALF_M, (C + 1) * HALF_M) of every tile of this program: the products,
    then the epilogue; zeros in grad_gate_up on the layout's unused blocks."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    num_tiles_n = gl.cdiv(I, BLOCK_N)
    num_k = H // BLOCK_K
    it = 0
    phase_0 = 0  # each input slot's barrier phase
    phase_1 = 0
    for tile in range(gl.program_id(0), num_blocks_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n = _tile(tile, block_expert_ptr, num_blocks_m, num_tiles_n, GROUP_M)
        row = pid_m * TILE_M + C * HALF_M
        col = pid_n * BLOCK_N
        if expert >= 0:
            num_chunks = gl.minimum((I - col) // EPILOGUE_N, BLOCK_N // EPILOGUE_N)
            _load_epilogue_chunk(desc_h, desc_hg, in_smem, in_bar, C, 0, row, col, I)
            if num_chunks > 1:
                _load_epilogue_chunk(desc_h, desc_hg, in_smem, in_bar, C, 1, row, col + EPILOGUE_N, I)
            acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=acc_layout)
            for kb in range(num_k):
                stage = (it + kb) % NUM_STAGES
                mbarrier.wait(ready.index(stage), ((it + kb) // NUM_STAGES) & 1)
                fence_async_shared()  # the gathered rows came through the generic proxy; wgmma reads the async one
                acc = warpgroup_mma(a_smem.index(2 * stage + C), b_smem.index(stage), acc, use_acc=kb > 0,
                                    is_async=True)
                acc = warpgroup_mma_wait(1, deps=[acc])
                if kb > 0:
                    mbarrier.arrive(empty.index((it + kb - 1) % NUM_STAGES), count=1)
            acc = warpgroup_mma_wait(0, deps=[acc])
            mbarrier.arrive(empty.index((it + num_k - 1) % NUM_STAGES), count=1)
            it += num_k

            chunks = _epilogue_chunks(acc)
            layout: gl.constexpr = chunks[0].type.layout
            in_half = gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))
            row_ok = in_half + C * HALF_M < gl.load(block_rows_ptr + pid_m)
            pairs = gl.load(sorted_pairs_ptr + row + in_half, mask=row_ok, other=0)
            if weight_grad_operands:
                if pid_n == 0:
                    gl.store(row_tokens_ptr + row + in_half, gl.where(row_ok, pairs // top_k, -1))
            route_weight = gl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
            d_weight = gl.zeros([HALF_M], gl.float32, layout=gl.SliceLayout(1, layout))
            for j in gl.static_range(BLOCK_N // EPILOGUE_N):
                if j < num_chunks:
                    if j % 2 == 0:
                        d_part, phase_0 = _epilogue_chunk(chunks[j], j, num_chunks, desc_h, desc_hg, desc_ggu,
                                                          desc_wh, in_smem, out_smem, in_bar, phase_0, route_weight,
                                                          row, col, I, weight_grad_operands, C)
                    else:
                        d_part, phase_1 = _epilogue_chunk(chunks[j], j, num_chunks, desc_h, desc_hg, desc_ggu,
                                                          desc_wh, in_smem, out_smem, in_bar, phase_1, route_weight,
                                                          row, col, I, weight_grad_operands, C)
                    d_weight += d_part
            gl.store(grad_weights_ptr + wide_offset(pid_n, num_pairs) + pairs, d_weight, mask=row_ok)
        else:  # the layout's unused blocks: grad_gate_up (the op's output) is zero there too
            _zero_rows(grad_gate_up_ptr, row, col, I)
    tma.store_wait(0)


@gluon.jit
def _zero_rows(grad_gate_up_ptr, row, col, I):
    """Zeros into the gate and up columns [col, col + BLOCK_N) of grad_gate_up's (rows, 2I) rows
    [row, row + HALF_M), EPILOGUE_N columns at a time."""
    layout: gl.constexpr = gl.BlockedLayout([1, 8], [8, 4], [4, 1], [1, 0])
    zeros = gl.zeros([HALF_M, EPILOGUE_N], grad_gate_up_ptr.dtype.element_ty, layout=layout)
    rows = row + gl.arange(0, HALF_M, layout=gl.SliceLayout(1, layout))
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
    2I) and weighted_h (rows, I), boxes (HALF_M, EPILOGUE_N); grad_gate_up_ptr the same
    grad_gate_up (its unused blocks' zeros are pointer stores); grad_weights_ptr at least
    cdiv(I, BLOCK_N) rows of num_pairs. H a multiple of BLOCK_K, I of EPILOGUE_N; grad_out's rows
    (stride_gt) 16-byte aligned; the layout's blocks TILE_M rows. num_warps = 4 (the first
    consumer); one program an SM."""
    dtype: gl.constexpr = grad_out_ptr.dtype.element_ty
    a_smem = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, HALF_M, BLOCK_K],
                                       gl.NVMMASharedLayout.get_default_for([HALF_M, BLOCK_K], dtype))
    b_smem = gl.allocate_shared_memory(desc_w2.dtype, [NUM_STAGES, BLOCK_K, BLOCK_N], desc_w2.layout)
    # Each consumer's two input slots (h and both derivatives) and its output buffers.
    in_smem = gl.allocate_shared_memory(desc_h.dtype, [CONSUMERS * 2 * 3, HALF_M, EPILOGUE_N], desc_h.layout)
    out_smem = gl.allocate_shared_memory(desc_h.dtype, [CONSUMERS * 3, HALF_M, EPILOGUE_N], desc_h.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    in_bar = gl.allocate_shared_memory(gl.int64, [CONSUMERS * 2, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        # The TMA's expect arrives once, and every producer thread once its copies land.
        mbarrier.init(ready.index(i), count=1 + 32 * GATHER_WARPS)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    for i in gl.static_range(CONSUMERS * 2):
        mbarrier.init(in_bar.index(i), count=1)
    num_tiles_n = gl.cdiv(I, BLOCK_N)
    gl.warp_specialize([
        (_consumer, (a_smem, b_smem, ready, empty, in_smem, out_smem, in_bar, desc_h, desc_hg, desc_ggu, desc_wh,
                     grad_gate_up_ptr, weights_ptr, row_tokens_ptr, grad_weights_ptr, sorted_pairs_ptr,
                     block_expert_ptr, block_rows_ptr, num_blocks_m, num_pairs, H, I, top_k, weight_grad_operands, 0,
                     GROUP_M, NUM_STAGES)),
        (_consumer, (a_smem, b_smem, ready, empty, in_smem, out_smem, in_bar, desc_h, desc_hg, desc_ggu, desc_wh,
                     grad_gate_up_ptr, weights_ptr, row_tokens_ptr, grad_weights_ptr, sorted_pairs_ptr,
                     block_expert_ptr, block_rows_ptr, num_blocks_m, num_pairs, H, I, top_k, weight_grad_operands, 1,
                     GROUP_M, NUM_STAGES)),
        (_gather_producer, (grad_out_ptr, desc_w2, a_smem, b_smem, ready, empty, sorted_pairs_ptr, block_expert_ptr,
                            block_rows_ptr, num_blocks_m, num_tiles_n, H, top_k, stride_gt, GROUP_M, NUM_STAGES)),
    ], [4, GATHER_WARPS], [REGS_CONSUMER, REGS_PRODUCER])


@gluon.jit
def _weight_grad_producer(gathered_ptr, desc_dense, a_smem, b_smem, ready, empty, row_tokens_ptr, expert_blocks_ptr,
                          num_experts, num_tiles_m, num_tiles_n, gathered_cols, stride_g, layout_block_m,
                          GATHERED_A: gl.constexpr,
                          GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    """Every row step of this program's tiles in order: the dense operand's boxes by TMA and the
    gathered operand's rows (zeros on padding rows and past gathered_cols) by cp.async, 16 bytes a
    copy. A's two row halves (the tile's M) go to buffers of their own, one a consumer."""
    if GATHERED_A:  # (BLOCK_K, HALF_M) pieces of dY
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [GATHER_WARPS, 1], [1, 0])
        width: gl.constexpr = HALF_M
    else:  # a (BLOCK_K, BLOCK_N) piece of x; warps of 2 rows x 128 columns, 8 rows a thread (1 x 256, 16
        # rows a thread, made d w1 5-11% slower on an H200, runs apart)
        layout: gl.constexpr = gl.BlockedLayout([1, 8], [2, 16], [GATHER_WARPS, 1], [1, 0])
        width: gl.constexpr = BLOCK_N
    offs_r = gl.arange(0, BLOCK_K, layout=gl.SliceLayout(1, layout))
    offs_c = gl.arange(0, width, layout=gl.SliceLayout(0, layout))
    it = 0
    for tile in range(gl.program_id(0), num_experts * num_tiles_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n, first_row, end_row = _expert_rows(tile, expert_blocks_ptr, layout_block_m,
                                                                num_tiles_m, num_tiles_n, GROUP_M)
        for r0 in range(first_row, end_row, BLOCK_K):
            stage = it % NUM_STAGES
            mbarrier.wait(empty.index(stage), ((it // NUM_STAGES) & 1) ^ 1)
            bar = ready.index(stage)
            tokens = gl.load(row_tokens_ptr + r0 + offs_r)
            row_ptrs = gathered_ptr + wide_offset(tokens, stride_g)[:, None]
            rows_ok = (tokens >= 0)[:, None]  # padding rows: zeros
            if GATHERED_A:  # d w2: dY's columns of the tile's rows of H; weighted_h's of its columns
                mbarrier.expect(bar, desc_dense.block_type.nbytes)
                tma.async_copy_global_to_shared(desc_dense, [r0, pid_n * BLOCK_N], bar, b_smem.index(stage))
                for half in gl.static_range(2):
                    cols = pid_m * TILE_M + half * HALF_M + offs_c
                    async_copy.async_copy_global_to_shared(a_smem.index(2 * stage + half), row_ptrs + cols[None, :],
                                                           mask=rows_ok & (cols < gathered_cols)[None, :])
            else:  # d w1: d [gate, up]'s columns of the tile's rows of 2I; x's of its columns
                mbarrier.expect(bar, 2 * desc_dense.block_type.nbytes)
                for half in gl.static_range(2):
                    tma.async_copy_global_to_shared(desc_dense, [r0, pid_m * TILE_M + half * HALF_M], bar,
                                                    a_smem.index(2 * stage + half))
                cols = pid_n * BLOCK_N + offs_c
                async_copy.async_copy_global_to_shared(b_smem.index(stage), row_ptrs + cols[None, :],
                                                       mask=rows_ok & (cols < gathered_cols)[None, :])
            async_copy.mbarrier_arrive(bar, increment_count=False)
            it += 1


@gluon.jit
def _weight_grad_consumer(a_smem, b_smem, ready, empty, epi_smem, desc_out, expert_blocks_ptr, num_experts, num_tiles_m,
                          num_tiles_n, M, layout_block_m, C: gl.constexpr, GROUP_M: gl.constexpr,
                          NUM_STAGES: gl.constexpr):
    """Consumer C's rows [C * HALF_M, (C + 1) * HALF_M) of every tile of this program: the sum over
    the expert's row steps (one m64n256 wgmma a 16-deep slice), then a TMA store of it (zeros for an
    expert without rows)."""
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[4, 1],
                                                         instr_shape=[16, BLOCK_N, 16])
    epi = epi_smem.index(C)
    it = 0
    for tile in range(gl.program_id(0), num_experts * num_tiles_m * num_tiles_n, gl.num_programs(0)):
        expert, pid_m, pid_n, first_row, end_row = _expert_rows(tile, expert_blocks_ptr, layout_block_m,
                                                                num_tiles_m, num_tiles_n, GROUP_M)
        num_k = (end_row - first_row) // BLOCK_K
        acc = gl.zeros([HALF_M, BLOCK_N], gl.float32, layout=acc_layout)
        for kb in range(num_k):
            stage = (it + kb) % NUM_STAGES
            mbarrier.wait(ready.index(stage), ((it + kb) // NUM_STAGES) & 1)
            fence_async_shared()  # the gathered rows came through the generic proxy; wgmma reads the async one
            acc = warpgroup_mma(a_smem.index(2 * stage + C).permute((1, 0)), b_smem.index(stage), acc, is_async=True)
            acc = warpgroup_mma_wait(1, deps=[acc])
            if kb > 0:
                mbarrier.arrive(empty.index((it + kb - 1) % NUM_STAGES), count=1)
        acc = warpgroup_mma_wait(0, deps=[acc])
        if num_k > 0:
            mbarrier.arrive(empty.index((it + num_k - 1) % NUM_STAGES), count=1)
        it += num_k
        tma.store_wait(0)  # the previous tile's store has read the buffer
        epi.store(acc.to(epi.dtype))
        fence_async_shared()
        gl.thread_barrier()
        tma.async_copy_shared_to_global(desc_out, [expert * M + pid_m * TILE_M + C * HALF_M, pid_n * BLOCK_N],
                                        epi)
    tma.store_wait(0)


@gluon.jit
def weight_grad_gluon_kernel(
    gathered_ptr, desc_dense, desc_out, row_tokens_ptr, expert_blocks_ptr,
    num_experts, M, N, gathered_cols, stride_g, layout_block_m,
    GATHERED_A: gl.constexpr, GROUP_M: gl.constexpr, NUM_STAGES: gl.constexpr,
):
    """out[e] (M, N) = A[rows of e].T @ B[rows of e], one operand in layout order (desc_dense) and
    the other gathered by each row's token from gathered_ptr ((tokens, gathered_cols), row stride
    stride_g; both multiples of 16): GATHERED_A, d w2 = dY[tokens].T @ weighted_h (desc_dense of
    weighted_h (rows, I), boxes (BLOCK_K, BLOCK_N)), else d w1 = d [gate, up].T @ x[tokens]
    (desc_dense of d [gate, up] (rows, 2I), boxes (BLOCK_K, HALF_M)). desc_out: out viewed as
    (E * M, N), boxes (HALF_M, BLOCK_N), M a multiple of TILE_M. row_tokens and expert_blocks
    as for `backward.grad_w1_kernel`, over the layout's blocks of layout_block_m rows (a multiple of
    BLOCK_K: an expert's rows are whole K steps). num_warps = 4; one program an SM."""
    num_tiles_m = M // TILE_M
    num_tiles_n = gl.cdiv(N, BLOCK_N)
    dtype: gl.constexpr = desc_out.dtype
    a_smem = gl.allocate_shared_memory(dtype, [2 * NUM_STAGES, BLOCK_K, HALF_M],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, HALF_M], dtype))
    b_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, BLOCK_K, BLOCK_N],
                                       gl.NVMMASharedLayout.get_default_for([BLOCK_K, BLOCK_N], dtype))
    epi_smem = gl.allocate_shared_memory(dtype, [CONSUMERS, HALF_M, BLOCK_N], desc_out.layout)
    ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for i in gl.static_range(NUM_STAGES):
        # The TMA's expect arrives once, and every producer thread once its copies land.
        mbarrier.init(ready.index(i), count=1 + 32 * GATHER_WARPS)
        mbarrier.init(empty.index(i), count=CONSUMERS)
    gl.warp_specialize([
        (_weight_grad_consumer, (a_smem, b_smem, ready, empty, epi_smem, desc_out, expert_blocks_ptr, num_experts,
                                 num_tiles_m, num_tiles_n, M, layout_block_m, 0, GROUP_M, NUM_STAGES)),
        (_weight_grad_consumer, (a_smem, b_smem, ready, empty, epi_smem, desc_out, expert_blocks_ptr, num_experts,
                                 num_tiles_m, num_tiles_n, M, layout_block_m, 1, GROUP_M, NUM_STAGES)),
        (_weight_grad_producer, (gathered_ptr, desc_dense, a_smem, b_smem, ready, empty, row_tokens_ptr,
                                 expert_blocks_ptr, num_experts, num_tiles_m, num_tiles_n, gathered_cols, stride_g,
                                 layout_block_m, GATHERED_A, GROUP_M, NUM_STAGES)),
    ], [4, GATHER_WARPS], [REGS_CONSUMER, REGS_WEIGHT_GRAD_PRODUCER])
