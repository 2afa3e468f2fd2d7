"""Attention backward for Hopper (sm90) in Gluon: the dK/dV and dQ kernels of `backward.py` with
asynchronous wgmma, so that the exponentials and the dS products of one block run while the
tensor cores work on another.

The formulas, the band and the base-2 recomputation of P are those of `backward.py` (its module
docstring); only the schedule differs. Triton 3.6 waits on each `tl.dot` wgmma right after
issuing it; here every product is issued asynchronously and waited for only when its result is
needed (`warpgroup_mma_wait(n)`: at most n products of this warpgroup still in flight):

* dK/dV, step j (queries Q_j, dO_j against the program's keys, transposed tiles):
  issue S^T_j = K Q_j^T and dP^T_j = V dO_j^T; wait for S^T_j (which also retires the previous
  step's dV and dK); compute P^T_j while dP^T_j runs; issue dV += P^T_j dO_j; wait for dP^T_j;
  compute dS^T_j while dV runs; issue dK += dS^T_j Q_j, which runs while the next step starts.
* dQ, step j (keys K_j, V_j against the program's queries):
  issue S_j = Q K_j^T and dP_j = dO V_j^T; wait for S_j (and the previous dQ product); compute P_j
  while dP_j runs; wait for dP_j; issue dQ += dS_j K_j, which runs while the next step starts.

One program holds a resident block of 64 or 128 rows (keys for dK/dV, queries for dQ), each
warpgroup 64 of them; with two warpgroups on 64 rows they split the columns instead, which halves
each one's accumulators (D = 256: 64 x 128 of dK and of dV per warpgroup, no spills), the score
tiles reaching the other warpgroup's products through shared memory. The streamed tiles arrive by
TMA into NUM_STAGES buffers, each with its own mbarrier, refilled as soon as the products reading
them are retired. Inputs and gradients go through 4-D (batch, head, seq, head_dim) descriptors:
loads past the end are zero-filled and stores past it dropped. Streamed query rows past Sq read
lse = -inf (as +inf: p = 0) and delta = 0, so only blocks on the band's edges are masked; streamed
key rows past Sk are zero and masked with the band's right edge (`band_blocks` marks the partial
last key block as an edge). Each output element is summed by one program in a fixed order:
gradients are reproducible. A fused variant (dQ added by the dK/dV program with TMA reduce-adds,
no dQ kernel) measured slower on an H100: 367 against 453 TFLOP/s at D = 128, S = 4096, 356
against 376 at D = 64 (benchmarks/results/attention_backward_sweep_gluon_dq_tma.json).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_init, warpgroup_mma_wait)

from .backward import _lse_log2
from .forward import band_blocks, band_diagonals, visible_band
from .forward_gluon import _scores


@gluon.jit
def _load_pair(desc_a, desc_b, smem_a, smem_b, bars_a, bars_b, stage, b, h, row, pred):
    """TMA copies of the tiles of desc_a and desc_b starting at `row` into buffer `stage` (if pred)."""
    mbarrier.expect(bars_a.index(stage), desc_a.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc_a, [b, h, row, 0], bars_a.index(stage), smem_a.index(stage), pred=pred)
    mbarrier.expect(bars_b.index(stage), desc_b.block_type.nbytes, pred=pred)
    tma.async_copy_global_to_shared(desc_b, [b, h, row, 0], bars_b.index(stage), smem_b.index(stage), pred=pred)


@gluon.jit
def _step_coordinates(idx, num_blocks, h_first, lo, BLOCK_M: gl.constexpr):
    """(query head, first query row) of step idx of the dK/dV loop over (head of the group, block)."""
    return h_first + idx // num_blocks, lo + (idx % num_blocks) * BLOCK_M


@gluon.jit
def _row_terms(lse_base, delta_base, h, rows, stride_lh, seqlen_q):
    """lse in base 2 (+inf where a row sees no key or lies past Sq: p = 0) and delta of query rows `rows`."""
    row_offsets = h.to(gl.int64) * stride_lh + rows
    lse_log2 = _lse_log2(gl.load(lse_base + row_offsets, mask=rows < seqlen_q, other=float("-inf")))
    return lse_log2, gl.load(delta_base + row_offsets, mask=rows < seqlen_q, other=0.0)


@gluon.jit
def _transposed_probabilities(st, lse_log2, keys, rows, start_m, full_lo, full_hi, diag_lo, diag_hi, scale_log2):
    """P^T of the scores S^T (keys x query rows from start_m), masked to the band on its edges."""
    p = gl.exp2(st * scale_log2 - lse_log2[None, :])
    if (start_m < full_lo) | (start_m >= full_hi):
        rel = keys[:, None] - rows[None, :]
        p = gl.where((rel <= diag_hi) & (rel >= diag_lo), p, 0.0)
    return p


@gluon.jit
def _init_bars(bars, NUM: gl.constexpr):
    for i in gl.static_range(NUM):
        mbarrier.init(bars.index(i), count=1)


@gluon.jit
def _invalidate_bars(bars, NUM: gl.constexpr):
    for i in gl.static_range(NUM):
        mbarrier.invalidate(bars.index(i))


@gluon.jit
def attention_backward_dkdv_gluon_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dk, desc_dv, LSE, DELTA,
    softmax_scale, scale_log2, stride_lb, stride_lh,
    num_heads_kv, group_size, seqlen_q, seqlen_k, num_n_blocks, window_left, window_right,
    HEAD_DIM: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, NUM_STAGES: gl.constexpr,
):
    """Q, K and dK tiles span BLOCK_D columns (HEAD_DIM of them real: the scores skip the zero
    64-column slices, `forward_gluon._scores`), V, dO and dV tiles BLOCK_DV (v's padded head dim,
    which may differ: MLA)."""
    # Warpgroups split the keys (64 each), then the columns: with 64 keys and two warpgroups each
    # holds half of the dK and dV columns and half of the S^T, dP^T columns.
    WARPS_M: gl.constexpr = BLOCK_N // 16
    WARPS_N: gl.constexpr = gl.num_warps() // WARPS_M
    gl.static_assert(WARPS_M % 4 == 0 and WARPS_M * WARPS_N == gl.num_warps(), "64 keys per warpgroup")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
                                                       instr_shape=[16, BLOCK_M // WARPS_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
                                                         instr_shape=[16, BLOCK_D // WARPS_N, 16])
    dv_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
                                                        instr_shape=[16, BLOCK_DV // WARPS_N, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
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
    v_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_N, BLOCK_DV], desc_v.layout)
    q_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, BLOCK_D], desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_M, BLOCK_DV], desc_do.layout)
    if num_steps <= 0:
        # No query sees these keys: zero gradients. Returning here also spares the loop a path
        # that skips it, whose zeroed accumulators ptxas would take for writes into the
        # accumulators of wgmmas in flight, and serialize them (its warning C7515).
        k_smem.reshape([BLOCK_N, BLOCK_D]).store(gl.zeros([BLOCK_N, BLOCK_D], dtype, layout=acc_layout))
        v_smem.reshape([BLOCK_N, BLOCK_DV]).store(gl.zeros([BLOCK_N, BLOCK_DV], dtype, layout=dv_layout))
        fence_async_shared()
        tma.async_copy_shared_to_global(desc_dk, [b, h_kv, start_n, 0], k_smem)
        tma.async_copy_shared_to_global(desc_dv, [b, h_kv, start_n, 0], v_smem)
        tma.store_wait(0)
        return
    kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    q_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    do_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(kv_bar, count=1)
    _init_bars(q_bars, NUM_STAGES)
    _init_bars(do_bars, NUM_STAGES)

    mbarrier.expect(kv_bar, desc_k.block_type.nbytes + desc_v.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_k, [b, h_kv, start_n, 0], kv_bar, k_smem)
    tma.async_copy_global_to_shared(desc_v, [b, h_kv, start_n, 0], kv_bar, v_smem)
    for i in gl.static_range(NUM_STAGES):
        h, row = _step_coordinates(i, num_blocks, h_first, lo, BLOCK_M)
        _load_pair(desc_q, desc_do, q_smem, do_smem, q_bars, do_bars, i, b, h, row, i < num_steps)

    keys = start_n + gl.arange(0, BLOCK_N, layout=gl.SliceLayout(1, s_layout))
    offs_m = gl.arange(0, BLOCK_M, layout=gl.SliceLayout(0, s_layout))
    s_init = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
    dk = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_D], gl.float32, layout=acc_layout))
    dv = warpgroup_mma_init(gl.zeros([BLOCK_N, BLOCK_DV], gl.float32, layout=dv_layout))
    p_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=p_layout)
    ds_op = gl.zeros([BLOCK_N, BLOCK_M], dtype, layout=op_layout)
    k = k_smem.reshape([BLOCK_N, BLOCK_D])
    v = v_smem.reshape([BLOCK_N, BLOCK_DV])
    lse_base = LSE + b.to(gl.int64) * stride_lb
    delta_base = DELTA + b.to(gl.int64) * stride_lb
    mbarrier.wait(kv_bar, 0)

    for idx in range(num_steps):
        stage = idx % NUM_STAGES
        phase = (idx // NUM_STAGES) & 1
        h, start_m = _step_coordinates(idx, num_blocks, h_first, lo, BLOCK_M)
        q = q_smem.index(stage).reshape([BLOCK_M, BLOCK_D])
        do = do_smem.index(stage).reshape([BLOCK_M, BLOCK_DV])
        mbarrier.wait(q_bars.index(stage), phase)
        st_tok = _scores(k, q, s_init, HEAD_DIM, BLOCK_D)
        mbarrier.wait(do_bars.index(stage), phase)
        dpt_tok = warpgroup_mma(v, do.permute((1, 0)), s_init, use_acc=False, is_async=True)
        rows = start_m + offs_m
        lse_log2, delta = _row_terms(lse_base, delta_base, h, rows, stride_lh, seqlen_q)
        # At most dP^T in flight: S^T is done, and so are the previous step's dV and dK, whose
        # buffers are refilled NUM_STAGES steps ahead.
        st, dk, dv, p_op, ds_op = warpgroup_mma_wait(1, deps=[st_tok, dk, dv, p_op, ds_op])
        prev = idx - 1 + NUM_STAGES
        h_next, row_next = _step_coordinates(prev, num_blocks, h_first, lo, BLOCK_M)
        _load_pair(desc_q, desc_do, q_smem, do_smem, q_bars, do_bars, (idx - 1 + NUM_STAGES) % NUM_STAGES, b,
                   h_next, row_next, (idx > 0) & (prev < num_steps))
        p = _transposed_probabilities(st, lse_log2, keys, rows, start_m, full_lo, full_hi, diag_lo, diag_hi,
                                      scale_log2)
        p_op = gl.convert_layout(p.to(dtype), p_layout)
        dv = warpgroup_mma(p_op, do, dv, is_async=True)
        dpt = warpgroup_mma_wait(1, deps=[dpt_tok])
        ds = (p * (dpt - delta[None, :])).to(dtype)
        ds_op = gl.convert_layout(ds, op_layout)
        dk = warpgroup_mma(ds_op, q, dk, is_async=True)

    dk, dv, p_op, ds_op = warpgroup_mma_wait(0, deps=[dk, dv, p_op, ds_op])
    mbarrier.invalidate(kv_bar)
    _invalidate_bars(q_bars, NUM_STAGES)
    _invalidate_bars(do_bars, NUM_STAGES)
    # K and V are no longer read: their buffers stage the gradients for the TMA stores.
    k.store((dk * softmax_scale).to(dtype))
    v.store(dv.to(dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dk, [b, h_kv, start_n, 0], k_smem)
    tma.async_copy_shared_to_global(desc_dv, [b, h_kv, start_n, 0], v_smem)
    tma.store_wait(0)


@gluon.jit
def attention_backward_dq_gluon_kernel(
    desc_q, desc_k, desc_v, desc_do, desc_dq, O, LSE, DELTA,
    softmax_scale, scale_log2, stride_ob, stride_oh, stride_om, stride_lb, stride_lh,
    num_heads_q, group_size, seqlen_q, seqlen_k, num_m_blocks, window_left, window_right,
    HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
    BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, NUM_STAGES: gl.constexpr, DELTA_HERE: gl.constexpr,
):
    """Q, K and dQ tiles span BLOCK_D columns (HEAD_DIM of them real), V and dO tiles BLOCK_DV; O
    (read for delta) has v's head dim HEAD_DIM_V."""
    WARPS_M: gl.constexpr = BLOCK_M // 16  # as in the dK/dV kernel, with query rows resident
    WARPS_N: gl.constexpr = gl.num_warps() // WARPS_M
    gl.static_assert(WARPS_M % 4 == 0 and WARPS_M * WARPS_N == gl.num_warps(), "64 query rows per warpgroup")
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
                                                       instr_shape=[16, BLOCK_N // WARPS_N, 16])
    acc_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[WARPS_M, WARPS_N],
                                                         instr_shape=[16, BLOCK_D // WARPS_N, 16])
    op_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=acc_layout, k_width=2)
    rows_layout: gl.constexpr = gl.SliceLayout(1, s_layout)
    dtype: gl.constexpr = desc_q.dtype

    # Query blocks of one head adjacent (they share K and V in L2); under causal masking the last
    # query block sees the most keys, so blocks run last-first.
    pid = gl.program_id(0)
    pid_bh = pid // num_m_blocks
    pid_m = num_m_blocks - 1 - pid % num_m_blocks
    b = pid_bh // num_heads_q
    h = pid_bh % num_heads_q
    h_kv = h // group_size
    start_m = pid_m * BLOCK_M
    diag_lo, diag_hi, lo, full_lo, full_hi, hi = visible_band(pid_m, seqlen_q, seqlen_k, window_left, window_right,
                                                               BLOCK_M, BLOCK_N)
    num_blocks = gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)

    q_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, BLOCK_D], desc_q.layout)
    do_smem = gl.allocate_shared_memory(dtype, [1, 1, BLOCK_M, BLOCK_DV], desc_do.layout)
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, BLOCK_D], desc_k.layout)
    v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, BLOCK_DV], desc_v.layout)
    qdo_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
    k_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_bars = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    mbarrier.init(qdo_bar, count=1)
    _init_bars(k_bars, NUM_STAGES)
    _init_bars(v_bars, NUM_STAGES)

    mbarrier.expect(qdo_bar, desc_q.block_type.nbytes + desc_do.block_type.nbytes)
    tma.async_copy_global_to_shared(desc_q, [b, h, start_m, 0], qdo_bar, q_smem)
    tma.async_copy_global_to_shared(desc_do, [b, h, start_m, 0], qdo_bar, do_smem)
    for i in gl.static_range(NUM_STAGES):
        _load_pair(desc_k, desc_v, k_smem, v_smem, k_bars, v_bars, i, b, h_kv, lo + i * BLOCK_N, i < num_blocks)

    rows = start_m + gl.arange(0, BLOCK_M, layout=rows_layout)
    offs_n = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s_layout))
    in_q = rows < seqlen_q
    row_offsets = b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + rows
    lse_log2 = _lse_log2(gl.load(LSE + row_offsets, mask=in_q, other=float("-inf")))
    q = q_smem.reshape([BLOCK_M, BLOCK_D])
    do = do_smem.reshape([BLOCK_M, BLOCK_DV])
    mbarrier.wait(qdo_bar, 0)
    if DELTA_HERE:  # delta = rowsum(dO * O) of these rows, for this kernel and the dK/dV kernel after it
        tile: gl.constexpr = gl.BlockedLayout([1, 8], [4, 8], [gl.num_warps(), 1], [1, 0])
        o_rows = start_m + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, tile))
        offs_d = gl.arange(0, BLOCK_DV, layout=gl.SliceLayout(0, tile))
        o_ptrs = (O + b.to(gl.int64) * stride_ob + h.to(gl.int64) * stride_oh
                  + o_rows.to(gl.int64)[:, None] * stride_om + offs_d[None, :])
        o = gl.load(o_ptrs, mask=(o_rows < seqlen_q)[:, None] & (offs_d < HEAD_DIM_V)[None, :], other=0.0)
        delta = gl.sum(o.to(gl.float32) * do.load(tile).to(gl.float32), 1)
        delta = gl.convert_layout(delta, rows_layout)
        gl.store(DELTA + row_offsets, delta, mask=in_q)
    else:
        delta = gl.load(DELTA + row_offsets, mask=in_q, other=0.0)

    s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    dq = warpgroup_mma_init(gl.zeros([BLOCK_M, BLOCK_D], gl.float32, layout=acc_layout))
    ds_op = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=op_layout)
    for j in range(num_blocks):
        stage = j % NUM_STAGES
        phase = (j // NUM_STAGES) & 1
        start_n = lo + j * BLOCK_N
        k = k_smem.index(stage).reshape([BLOCK_N, BLOCK_D])
        v = v_smem.index(stage).reshape([BLOCK_N, BLOCK_DV])
        mbarrier.wait(k_bars.index(stage), phase)
        s_tok = _scores(q, k, s_init, HEAD_DIM, BLOCK_D)
        mbarrier.wait(v_bars.index(stage), phase)
        dp_tok = warpgroup_mma(do, v.permute((1, 0)), s_init, use_acc=False, is_async=True)
        # At most dP in flight: S is done, and so is the previous block's dQ product, whose K
        # and V buffers are refilled NUM_STAGES blocks ahead.
        s, dq, ds_op = warpgroup_mma_wait(1, deps=[s_tok, dq, ds_op])
        prev = j - 1 + NUM_STAGES
        _load_pair(desc_k, desc_v, k_smem, v_smem, k_bars, v_bars, prev % NUM_STAGES, b, h_kv,
                   lo + prev * BLOCK_N, (j > 0) & (prev < num_blocks))
        p = gl.exp2(s * scale_log2 - lse_log2[:, None])
        if (start_n < full_lo) | (start_n >= full_hi):
            cols = start_n + offs_n
            rel = cols[None, :] - rows[:, None]
            p = gl.where((cols[None, :] < seqlen_k) & (rel <= diag_hi) & (rel >= diag_lo), p, 0.0)
        dp = warpgroup_mma_wait(0, deps=[dp_tok])
        ds = p * (dp - delta[:, None])
        ds_op = gl.convert_layout(ds.to(dtype), op_layout)
        dq = warpgroup_mma(ds_op, k, dq, is_async=True)

    dq, ds_op = warpgroup_mma_wait(0, deps=[dq, ds_op])
    mbarrier.invalidate(qdo_bar)
    _invalidate_bars(k_bars, NUM_STAGES)
    _invalidate_bars(v_bars, NUM_STAGES)
    # Rows that see no key get exactly 0 (`backward.no_key_rows_zero`).
    no_key = gl.convert_layout(lse_log2 == float("inf"), gl.SliceLayout(1, acc_layout))
    dq = gl.where(no_key[:, None], 0.0, dq)
    q.store((dq * softmax_scale).to(dtype))  # Q is no longer read: its buffer stages dQ
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_dq, [b, h, start_m, 0], q_smem)
    tma.store_wait(0)
