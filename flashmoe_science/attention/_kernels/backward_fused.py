"""Attention backward for Hopper (sm90) in Gluon, fused: one kernel computes dK, dV and dQ with
five block products per block pair instead of the split kernels' seven, in FlashAttention-3's
warp-specialised form (Shah et al. 2024, section 3 and appendix B).

One program holds a block of BLOCK_N keys (K and V resident, dK and dV accumulated in
registers) and walks the query blocks that see them, as the Gluon dK/dV kernel does
(`backward_gluon.py`, whose products, masks and base-2 recomputation of P it shares). Three
partitions run side by side:

- a loader warp issues the TMA copies: K and V once, then Q and dO of each step into
  NUM_STAGES buffers, each with `ready` mbarriers and an `empty` one the consumers arrive on
  once the products reading the buffer have retired;
- the consumer warpgroups (16 keys a warp) compute each step's S^T and dP^T, P^T and dS^T,
  issue dV += P^T dO and dK += dS^T Q, and the step's dQ rows = dS K: every warpgroup's share of
  dS^T goes to shared memory (two buffers), and past a barrier of the consumers the dQ product
  (split between the warpgroups by rows, then columns) runs while dK does. Its fp32 result goes
  to one of two shared tiles;
- a reduce warp adds each finished dQ tile into an fp32 accumulator in global memory with one
  TMA reduce-add (`cp.reduce.async.bulk.tensor`) and gives the tile back once the reduce has
  read it, so the consumers never wait for the adds.

The launcher zeroes the accumulator and scales it into dq afterwards. The adds from the programs
of different key blocks arrive in a varying order, so dq is not bitwise reproducible (dK and dV
are).

It is a sweep candidate (`configs.gluon_fused_backward_candidates`), never dispatched: on an H100
(benchmarks/results/attention_backward_sweep_gluon_dq_tma.json, bf16, the backward alone, the
sweep's shapes) the best fused configuration reaches, at S = 2048 / 4096,
D = 64: 325 / 356 TFLOP/s (causal 285 / 332) against 363 / 376 (310 / 344) for the Triton split
kernels of the table, with one warpgroup on 64 keys and two programs an SM
(`configs.fused_backward_maxnreg`); D = 128: 357 / 367 (293 / 328) against 436 / 453 (386 / 407)
for the Gluon split kernels, with two warpgroups on 128 keys, one program an SM (229 KB of shared
memory) and a 76-byte spill. The loader and reduce warps did not change the picture of the
unspecialised fused kernel this one replaced (D = 128 368 and D = 64 376 at S = 4096, with each
step waiting for its own reduce): what limits it is the consumers' chain within a step, S^T and
dP^T, the exponentials, dS^T through shared memory, a barrier of the consumers, then the dQ and
dK products, with nothing from another program to overlap at one program an SM. Keeping dQ in
flight into the next step instead of waiting for it while dK runs measured slower still (D = 64,
one-off: 293 against 323 at S = 2048, 329 against 357 at S = 4096).
"""
from triton._C.libtriton import ir
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language._core import builtin
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from .backward_gluon import _init_bars, _load_pair, _row_terms, _step_coordinates, _transposed_probabilities
from .forward import band_blocks, band_diagonals


@builtin
def _tma_reduce_add(tensor_desc, coord, src, _semantic=None):
    """Adds shared-memory tile `src` into the tile of `tensor_desc` at `coord` (cp.reduce.async.bulk
    .tensor, committed as a bulk group like `tma.async_copy_shared_to_global`, so `tma.store_wait`
    waits for it). Gluon 3.6 exposes no wrapper for the builder's op, which Triton's own
    `tensor_descriptor.atomic_add` lowers to."""
    coord = _semantic._convert_to_ir_values(coord, require_i64=False)
    _semantic.builder.create_async_tma_reduce(ir.DESCRIPTOR_REDUCE_KIND.ADD, tensor_desc.handle, coord, src.handle)


@gluon.jit
def _loader(desc_q, desc_k, desc_v, desc_do, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready, qdo_empty,
            b, h_kv, start_n, lo, num_blocks, num_steps, h_first, BLOCK_M: gl.constexpr, NUM_STAGES: gl.constexpr):
    mbarrier.expect(kv_bar, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_k, [b, h_kv, start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(desc_v, [b, h_kv, start_n, 0], kv_bar, v_smem)
    for idx in range(num_steps):
        stage = idx % NUM_STAGES
        # A fresh mbarrier counts as having completed the phase before 0: the first wait is free.
        mbarrier.wait(qdo_empty.index(stage), ((idx // NUM_STAGES) & 1) ^ 1)
        h, row = _step_coordinates(idx, num_blocks, h_first, lo, BLOCK_M)
        _load_pair(desc_q, desc_do, q_smem, do_smem, q_ready, do_ready, stage, b, h, row, True)


@gluon.jit
def _dq_reducer(desc_dq, dq_smem, dq_ready, dq_empty, b, lo, num_blocks, num_steps, h_first, BLOCK_M: gl.constexpr,
                DQ_BUFFERS: gl.constexpr):
    for idx in range(num_steps):
        buf = idx % DQ_BUFFERS
        mbarrier.wait(dq_ready.index(buf), (idx // DQ_BUFFERS) & 1)
        h, row = _step_coordinates(idx, num_blocks, h_first, lo, BLOCK_M)
        _tma_reduce_add(desc_dq, [b, h, row, 0], dq_smem.index(buf))
        # The reduce issued DQ_BUFFERS - 1 steps ago has read its tile: the consumers may refill it.
        tma.store_wait(DQ_BUFFERS - 1)
        done = idx - (DQ_BUFFERS - 1)
        mbarrier.arrive(dq_empty.index(done % DQ_BUFFERS), pred=done >= 0)
    tma.store_wait(0)


@gluon.jit
def _stage_dq(dq, dq_smem, dq_ready, dq_empty, idx, BLOCK_M: gl.constexpr, BLOCK_D: gl.constexpr,
              DQ_BUFFERS: gl.constexpr):
    """Step idx's dQ rows into a free fp32 tile for the reduce warp."""
    buf = idx % DQ_BUFFERS
    mbarrier.wait(dq_empty.index(buf), ((idx // DQ_BUFFERS) & 1) ^ 1)
    dq_smem.index(buf).reshape([BLOCK_M, BLOCK_D]).store(dq)
    fence_async_shared()
    mbarrier.arrive(dq_ready.index(buf))  # after a barrier of the consumers: the tile is whole


@gluon.jit
def _consumer(desc_dk, desc_dv, LSE, DELTA, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bar, q_ready,
              do_ready, qdo_empty, dq_ready, dq_empty, softmax_scale, scale_log2, stride_lb, stride_lh, b, h_kv,
              start_n, lo, full_lo, full_hi, num_blocks, num_steps, h_first, seqlen_q, diag_lo, diag_hi,
              BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr,
              DQ_BUFFERS: gl.constexpr):
    gl.static_assert(BLOCK_N == 16 * gl.num_warps(), "16 keys a warp")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, BLOCK_M, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                         instr_shape=[16, BLOCK_D, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    # The dQ product (BLOCK_M query rows x BLOCK_D): the warpgroups split its rows, then its columns.
    DQ_WARPS_M: gl.constexpr = BLOCK_M // 16
    DQ_WARPS_N: gl.constexpr = gl.num_warps() // DQ_WARPS_M
    dq_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[DQ_WARPS_M, DQ_WARPS_N],
                                                        instr_shape=[16, BLOCK_D // DQ_WARPS_N, 16])
    dtype: gl.constexpr = k_smem.dtype

    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    s_init = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    dq_init = gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=dq_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_D], gl.float32, layout=acc_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_D], gl.float32, layout=acc_layout))
    p_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=op_layout)
    ds_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=op_layout)
    k = k_smem.reshape([BLOCK_N, BLOCK_D])
    v = v_smem.reshape([BLOCK_N, BLOCK_D])
    lse_base = LSE + b.to(gl.int64) * stride_lb
    delta_base = DELTA + b.to(gl.int64) * stride_lb
    mbarrier.wait(kv_bar, 0)

    for idx in range(num_steps):
        stage = idx % NUM_STAGES
        phase = (idx // NUM_STAGES) & 1
        h, start_m = _step_coordinates(idx, num_blocks, h_first, lo, BLOCK_M)
        q = q_smem.index(stage).reshape([BLOCK_M, BLOCK_D])
        do = do_smem.index(stage).reshape([BLOCK_M, BLOCK_D])
        mbarrier.wait(q_ready.index(stage), phase)
        st_tok = warpgroup_mma(k, q.permute((1, 0)), s_init, use_acc=False, is_async=True)
        mbarrier.wait(do_ready.index(stage), phase)
        dpt_tok = warpgroup_mma(v, do.permute((1, 0)), s_init, use_acc=False, is_async=True)
        rows = start_m + offs_m
        lse_log2, delta = _row_terms(lse_base, delta_base, h, rows, stride_lh, seqlen_q)
        # At most dP^T in flight: S^T is done, and so are the previous step's dV and dK, so its
        # Q and dO buffers go back to the loader.
        st, dk, dv, p_op, ds_op = warpgroup_mma_wait(1, deps=[st_tok, dk, dv, p_op, ds_op])
        mbarrier.arrive(qdo_empty.index((idx + NUM_STAGES - 1) % NUM_STAGES), pred=idx > 0)
        p = _transposed_probabilities(st, lse_log2, keys, rows, start_m, full_lo, full_hi, diag_lo, diag_hi,
                                      scale_log2)
        p_op = gl.convert_layout(p.to(dtype), op_layout)
        dv = warpgroup_mma(p_op, do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt_tok])
        ds = (p * (dpt - delta[None, :])).to(dtype)
        ds_op = gl.convert_layout(ds, op_layout)
        # Every warpgroup's dS^T into shared memory; past the barrier the tile is whole. The
        # buffer's previous use (two steps ago) was retired by every warp before the last barrier.
        ds_buf = ds_smem.index(idx % 2)
        ds_buf.store(ds)
        fence_async_shared()
        gl.thread_barrier()
        dq_tok = warpgroup_mma(ds_buf.permute((1, 0)), k, dq_init, use_acc=False, is_async=True)
        dk = warpgroup_mma(ds_op, q, dk, is_async=True)
        # Waiting for dQ here (dK still running) measured faster than keeping it in flight into
        # the next step (module docstring).
        dq = warpgroup_mma_wait(1, deps=[dq_tok])
        _stage_dq(dq, dq_smem, dq_ready, dq_empty, idx, BLOCK_M, BLOCK_D, DQ_BUFFERS)

    dk, dv, p_op, ds_op = warpgroup_mma_wait(0, deps=[dk, dv, p_op, ds_op])
    # K and V are no longer read: their buffers stage the gradients for the TMA stores.
    k.store((dk * softmax_scale).to(dtype))
    v.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dk, [b, h_kv, start_n, 0], k_smem)
    tma.async_copy_shared_to_global(desc_dv, [b, h_kv, start_n, 0], v_smem)
    tma.store_wait(0)


@gluon.jit
def attention_backward_fused_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, desc_dq, LSE, DELTA,
    softmax_scale, scale_log2, stride_lb, stride_lh,
    num_heads_kv, group_size, seqlen_q, seqlen_k, num_n_blocks, window_left, window_right,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr, NUM_STAGES: gl.constexpr,
):
    """num_warps consumer warps (16 keys each: BLOCK_N = 16 * num_warps), a loader warp and a
    reduce warp. One program per block of BLOCK_N keys of one (batch, kv head)."""
    dtype: gl.constexpr = desc_q.dtype
    # Key blocks of one kv head adjacent (they share Q and dO in L2); under causal masking the
    # first key blocks are seen by the most query rows, so they run first.
    pid = gl.program_id(0)
    pid_bh = pid // num_n_blocks
    start_n = (pid % num_n_blocks) * BLOCK_N
    b = pid_bh // num_heads_kv
    h_kv = pid_bh % num_heads_kv
    # The query rows that see these keys, by the band mirrored: blocks on its edges are masked.
    diag_lo, diag_hi = band_diagonals(seqlen_q, seqlen_k, window_left, window_right)
    lo, full_lo, full_hi, hi = band_blocks(start_n, seqlen_k, seqlen_q, -diag_hi, -diag_lo, BLOCK_N, BLOCK_M)
    num_blocks = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_M)
    num_steps = group_size * num_blocks
    h_first = h_kv * group_size

    k_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, BLOCK_D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, BLOCK_D], desc_v.layout)
    if num_steps <= 0:  # no query sees these keys: zero gradients (and no dQ rows)
        zero_layout: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        k_smem.reshape([BLOCK_N, BLOCK_D]).store(gl.zeros([BLOCK_N, BLOCK_D], dtype, layout=zero_layout))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_dk, [b, h_kv, start_n, 0], k_smem)
        tma.async_copy_shared_to_global(desc_dv, [b, h_kv, start_n, 0], k_smem)
        tma.store_wait(0)
        return
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, BLOCK_D], desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, BLOCK_D], desc_do.layout)
    ds_layout: gl.constexpr = gl.NVMMASharedLayout(swizzle_byte_width=128, element_bitwidth=16, rank=2)
    ds_smem = gl.allocate_shared_memory(dtype, [2, BLOCK_N, BLOCK_M], ds_layout)
    DQ_BUFFERS: gl.constexpr = 2
    dq_smem = gl.allocate_shared_memory(gl.float32, [DQ_BUFFERS, 1, 1, BLOCK_M, BLOCK_D], desc_dq.layout)
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    qdo_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    dq_ready = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    dq_empty = gl.allocate_shared_memory(gl.int64, [DQ_BUFFERS, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    _init_bars(q_ready, NUM_STAGES)
    _init_bars(do_ready, NUM_STAGES)
    _init_bars(qdo_empty, NUM_STAGES)
    _init_bars(dq_ready, DQ_BUFFERS)
    _init_bars(dq_empty, DQ_BUFFERS)

    gl.warp_specialize([
        (_consumer, (desc_dk, desc_dv, LSE, DELTA, k_smem, v_smem, q_smem, do_smem, ds_smem, dq_smem, kv_bar, q_ready,
                     do_ready, qdo_empty, dq_ready, dq_empty, softmax_scale, scale_log2, stride_lb, stride_lh, b, h_kv,
                     start_n, lo, full_lo, full_hi, num_blocks, num_steps, h_first, seqlen_q, diag_lo, diag_hi, BLOCK_M,
                     BLOCK_N, BLOCK_D, NUM_STAGES, DQ_BUFFERS)),
        (_loader, (desc_q, desc_k, desc_v, desc_do, k_smem, v_smem, q_smem, do_smem, kv_bar, q_ready, do_ready,
                   qdo_empty, b, h_kv, start_n, lo, num_blocks, num_steps, h_first, BLOCK_M, NUM_STAGES)),
        (_dq_reducer, (desc_dq, dq_smem, dq_ready, dq_empty, b, lo, num_blocks, num_steps, h_first, BLOCK_M,
                       DQ_BUFFERS)),
    ], [1, 1], [24, 24])
