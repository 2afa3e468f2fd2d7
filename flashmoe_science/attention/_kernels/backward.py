"""Attention backward: FlashAttention-2 recomputation, never storing an Sq x Sk matrix.

With S = scale * Q K^T, P = exp(S - lse) (lse saved by the forward), O = P V and dO the
gradient of the output:

    dV = P^T dO        dP = dO V^T        dS = P * (dP - delta),  delta = rowsum(dO * O)
    dQ = scale * dS K  dK = scale * dS^T Q

Three kernels, each output element written by exactly one program that sums in a fixed order,
so gradients are bitwise reproducible (no atomics anywhere):

* `attention_backward_preprocess_kernel` computes delta (fp32, one value per query row).
* `attention_backward_dkdv_kernel`: one program per block of BLOCK_N keys of one (batch, kv head).
  K and V stay on chip while the program walks the query blocks of every query head of its GQA
  group, so dK and dV are summed over the group in registers and written once. It works on the
  transposed tiles (S^T = K Q^T) so that dV += P^T dO and dK += dS^T Q are plain products.
* `attention_backward_dq_kernel`: one program per block of BLOCK_M query rows of one (batch,
  query head), Q and dO on chip, walking the key blocks.

Splitting dQ from dK/dV recomputes S and dP once more (seven block products per block pair
instead of five), the price of never accumulating dQ across programs. Accumulating dQ with fp32
atomic adds inside the dK/dV kernel (FlashAttention-2's CUDA choice) saves that work but has been
the slowest variant in Triton (triton-lang/triton#3523, FlagAttention#4), and would make results
vary between runs; FlexAttention's Triton backward and the Triton tutorial also split.

P is recomputed in base 2: scores times scale*log2(e) minus lse*log2(e), one exp2 per element.
Causal alignment is bottom-right (query i sees keys j <= i + Sk - Sq); a non-causal call passes
`diagonal = Sk`, which every key satisfies, so one compiled kernel serves both. Blocks nobody
sees are skipped by the loop bounds; blocks that every row fully sees run without any mask; only
blocks that straddle the diagonal, and the partial last block of the streamed dimension (queries
in the dK/dV kernel, keys in the dQ kernel), pay for masking.

Rows that saw no key in the forward have lse = -inf. Their lse is read as +inf instead, so every
p of theirs is exp2(-inf) = 0 and their gradients are exactly zero. Padding rows past Sq load
q = dO = 0 and lse = -inf (read as +inf) for the same effect, so query tails need load masks but
no score mask. Key tails need a score mask where they feed dQ (a zero key row still scores 0,
not -inf), but not in the dK/dV kernel, where only their own unstored rows see them.
"""
import triton
import triton.language as tl

from .tiles import load_tile

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _lse_log2(lse):
    # Rows that see no key have lse = -inf; +inf makes exp2(s - lse) = 0 for them, not NaN.
    return tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)


@triton.jit
def attention_backward_preprocess_kernel(
    O, DO, DELTA,
    stride_ob, stride_oh, stride_om,
    stride_dob, stride_doh, stride_dom,
    num_heads_q, seqlen_q, num_m_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    pid_m = pid % num_m_blocks
    b = (pid_bh // num_heads_q).to(tl.int64)
    h = (pid_bh % num_heads_q).to(tl.int64)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    rows64 = rows[:, None].to(tl.int64)
    o = load_tile(O + b * stride_ob + h * stride_oh + rows64 * stride_om + offs_d[None, :], rows, seqlen_q, offs_d,
                  HEAD_DIM, BLOCK_D, True)
    do = load_tile(DO + b * stride_dob + h * stride_doh + rows64 * stride_dom + offs_d[None, :], rows, seqlen_q,
                   offs_d, HEAD_DIM, BLOCK_D, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(DELTA + pid_bh.to(tl.int64) * seqlen_q + rows, delta, mask=rows < seqlen_q)


@triton.jit
def _key_block_step(dk, dv, k, v, Q, DO, LSE, DELTA, idx, num_blocks, first_m, tail_m, num_before_tail, b64,
                    h_kv64, group_size, num_heads_q, q_tile, do_tile, offs_m, keys, offs_d, seqlen_q, diagonal,
                    scale_log2, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh, stride_dom,
                    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, MASKED: tl.constexpr):
    """Step `idx` of a loop over (query head of the group, query block) pairs: one BLOCK_M block
    of query rows against the program's BLOCK_N keys, on transposed tiles."""
    h64 = h_kv64 * group_size + idx // num_blocks
    i = idx % num_blocks
    if MASKED:
        # The masked blocks are the diagonal run from first_m, then the query tail at tail_m.
        start_m = tl.where(i < num_before_tail, first_m + i * BLOCK_M, tail_m)
    else:
        start_m = first_m + i * BLOCK_M
    rows = start_m + offs_m
    start64 = tl.cast(start_m, tl.int64)  # row offsets of long (B, S, H, D) inputs pass 2**31 elements
    q_ptrs = Q + (b64 * stride_qb + h64 * stride_qh + start64 * stride_qm) + q_tile
    do_ptrs = DO + (b64 * stride_dob + h64 * stride_doh + start64 * stride_dom) + do_tile
    row_base = (b64 * num_heads_q + h64) * seqlen_q
    q = load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
    do = load_tile(do_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
    if MASKED:
        lse = tl.load(LSE + row_base + rows, mask=rows < seqlen_q, other=float("-inf"))
        delta = tl.load(DELTA + row_base + rows, mask=rows < seqlen_q, other=0.0)
    else:
        lse = tl.load(LSE + row_base + rows)
        delta = tl.load(DELTA + row_base + rows)
    p_t = tl.math.exp2(tl.dot(k, tl.trans(q)) * scale_log2 - _lse_log2(lse)[None, :])
    if MASKED:
        p_t = tl.where(keys[:, None] <= rows[None, :] + diagonal, p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv)
    dp_t = tl.dot(v, tl.trans(do))
    ds_t = p_t * (dp_t - delta[None, :])
    dk = tl.dot(ds_t.to(q.dtype), q, dk)
    return dk, dv


@triton.jit
def attention_backward_dkdv_kernel(
    Q, K, V, DO, LSE, DELTA, DK, DV,
    softmax_scale, scale_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    num_heads_kv, group_size, seqlen_q, seqlen_k, diagonal, num_n_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Key blocks of one kv head are adjacent in the grid so that they share Q and dO in L2. Under
    # causal masking the first key blocks are seen by the most query rows: heaviest run first.
    pid = tl.program_id(0)
    pid_bh = pid // num_n_blocks
    pid_n = pid % num_n_blocks
    b64 = (pid_bh // num_heads_kv).to(tl.int64)
    h_kv64 = (pid_bh % num_heads_kv).to(tl.int64)
    start_n = pid_n * BLOCK_N

    offs_m = tl.arange(0, BLOCK_M)
    keys = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    keys64 = keys[:, None].to(tl.int64)
    k = load_tile(K + b64 * stride_kb + h_kv64 * stride_kh + keys64 * stride_kn + offs_d[None, :], keys, seqlen_k,
                  offs_d, HEAD_DIM, BLOCK_D, True)
    v = load_tile(V + b64 * stride_vb + h_kv64 * stride_vh + keys64 * stride_vn + offs_d[None, :], keys, seqlen_k,
                  offs_d, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # Query rows that see any key of this block start at start_n - diagonal; rows from
    # last_key - diagonal on see all of them. The query blocks in between straddle the diagonal
    # and are masked, and so is the partial last query block when Sq is not a multiple of
    # BLOCK_M. Keys past Sk need no mask: they load as zero rows, and what their dK and dV rows
    # collect is never stored, while no other row depends on them.
    last_key = tl.minimum(start_n + BLOCK_N, seqlen_k) - 1
    masked_lo = tl.maximum(start_n - diagonal, 0) // BLOCK_M * BLOCK_M
    rows_ceil = (seqlen_q + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    full_lo = (tl.maximum(last_key - diagonal, 0) + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    full_hi = seqlen_q // BLOCK_M * BLOCK_M
    tail_lo = tl.maximum(full_lo, full_hi)
    num_diagonal = (tl.minimum(full_lo, rows_ceil) - masked_lo) // BLOCK_M
    num_masked = num_diagonal + (rows_ceil - tail_lo) // BLOCK_M
    num_full = tl.maximum(full_hi - full_lo, 0) // BLOCK_M

    # Two flat loops over (query head of the group, query block) pairs rather than a loop over
    # heads around three block loops: nested and repeated loop bodies cost registers, which this
    # kernel (two fp32 BLOCK_N x D accumulators plus two BLOCK_N x BLOCK_M score tiles) lacks.
    num_heads_q = num_heads_kv * group_size
    q_tile = offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
    do_tile = offs_m[:, None].to(tl.int64) * stride_dom + offs_d[None, :]
    for idx in range(0, group_size * num_masked):
        dk, dv = _key_block_step(dk, dv, k, v, Q, DO, LSE, DELTA, idx, num_masked, masked_lo, tail_lo, num_diagonal,
                                 b64, h_kv64, group_size, num_heads_q, q_tile, do_tile, offs_m, keys, offs_d,
                                 seqlen_q, diagonal, scale_log2, stride_qb, stride_qh, stride_qm,
                                 stride_dob, stride_doh, stride_dom, HEAD_DIM, BLOCK_D, BLOCK_M, True)
    for idx in range(0, group_size * num_full):
        dk, dv = _key_block_step(dk, dv, k, v, Q, DO, LSE, DELTA, idx, num_full, full_lo, full_lo, num_full,
                                 b64, h_kv64, group_size, num_heads_q, q_tile, do_tile, offs_m, keys, offs_d,
                                 seqlen_q, diagonal, scale_log2, stride_qb, stride_qh, stride_qm,
                                 stride_dob, stride_doh, stride_dom, HEAD_DIM, BLOCK_D, BLOCK_M, False)

    dk = dk * softmax_scale
    dk_ptrs = DK + b64 * stride_dkb + h_kv64 * stride_dkh + keys64 * stride_dkn + offs_d[None, :]
    dv_ptrs = DV + b64 * stride_dvb + h_kv64 * stride_dvh + keys64 * stride_dvn + offs_d[None, :]
    key_mask = (keys[:, None] < seqlen_k) & (offs_d[None, :] < HEAD_DIM)
    tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=key_mask)
    tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_mask)


@triton.jit
def _query_block_step(dq, q, do, lse_log2, delta, k_ptrs, v_ptrs, start_n, rows, offs_n, offs_d, seqlen_k,
                      diagonal, scale_log2, stride_kn, stride_vn,
                      HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr):
    """The program's BLOCK_M query rows against one BLOCK_N block of keys."""
    keys = start_n + offs_n
    start64 = tl.cast(start_n, tl.int64)  # row offsets of long (B, S, H, D) inputs pass 2**31 elements
    k = load_tile(k_ptrs + start64 * stride_kn, keys, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
    v = load_tile(v_ptrs + start64 * stride_vn, keys, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
    p = tl.math.exp2(tl.dot(q, tl.trans(k)) * scale_log2 - lse_log2[:, None])
    if MASKED:
        visible = (keys[None, :] < seqlen_k) & (keys[None, :] <= rows[:, None] + diagonal)
        p = tl.where(visible, p, 0.0)
    dp = tl.dot(do, tl.trans(v))
    ds = p * (dp - delta[:, None])
    return tl.dot(ds.to(k.dtype), k, dq)


@triton.jit
def attention_backward_dq_kernel(
    Q, K, V, DO, LSE, DELTA, DQ,
    softmax_scale, scale_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dqb, stride_dqh, stride_dqm,
    num_heads_q, group_size, seqlen_q, seqlen_k, diagonal, num_m_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    # Query blocks of one head adjacent (they share K and V in L2); under causal masking the last
    # query block sees the most keys, so blocks run last-first to shorten the tail.
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    pid_m = num_m_blocks - 1 - pid % num_m_blocks
    b64 = (pid_bh // num_heads_q).to(tl.int64)
    h = pid_bh % num_heads_q
    h64 = h.to(tl.int64)
    h_kv64 = (h // group_size).to(tl.int64)
    start_m = pid_m * BLOCK_M

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    in_q = rows < seqlen_q
    rows64 = rows[:, None].to(tl.int64)
    q = load_tile(Q + b64 * stride_qb + h64 * stride_qh + rows64 * stride_qm + offs_d[None, :], rows, seqlen_q,
                  offs_d, HEAD_DIM, BLOCK_D, True)
    do = load_tile(DO + b64 * stride_dob + h64 * stride_doh + rows64 * stride_dom + offs_d[None, :], rows, seqlen_q,
                   offs_d, HEAD_DIM, BLOCK_D, True)
    lse_log2 = _lse_log2(tl.load(LSE + pid_bh.to(tl.int64) * seqlen_q + rows, mask=in_q, other=float("-inf")))
    delta = tl.load(DELTA + pid_bh.to(tl.int64) * seqlen_q + rows, mask=in_q, other=0.0)
    kv_rows = offs_n[:, None].to(tl.int64)
    k_ptrs = K + b64 * stride_kb + h_kv64 * stride_kh + kv_rows * stride_kn + offs_d[None, :]
    v_ptrs = V + b64 * stride_vb + h_kv64 * stride_vh + kv_rows * stride_vn + offs_d[None, :]
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # Keys the block's last real row sees end at last_row + diagonal; keys up to
    # start_m + diagonal are seen by every row. Padding rows past Sq contribute p = 0 anywhere.
    last_row = tl.minimum(start_m + BLOCK_M, seqlen_q) - 1
    end_n = tl.minimum(tl.maximum(last_row + diagonal + 1, 0), seqlen_k)
    full_n = tl.minimum(tl.maximum(start_m + diagonal + 1, 0), end_n) // BLOCK_N * BLOCK_N
    for start_n in range(0, full_n, BLOCK_N):
        dq = _query_block_step(dq, q, do, lse_log2, delta, k_ptrs, v_ptrs, start_n, rows, offs_n, offs_d,
                               seqlen_k, diagonal, scale_log2, stride_kn, stride_vn, HEAD_DIM, BLOCK_D, False)
    for start_n in range(full_n, end_n, BLOCK_N):
        dq = _query_block_step(dq, q, do, lse_log2, delta, k_ptrs, v_ptrs, start_n, rows, offs_n, offs_d,
                               seqlen_k, diagonal, scale_log2, stride_kn, stride_vn, HEAD_DIM, BLOCK_D, True)

    dq = dq * softmax_scale
    tl.store(DQ + b64 * stride_dqb + h64 * stride_dqh + rows64 * stride_dqm + offs_d[None, :],
             dq.to(DQ.dtype.element_ty), mask=in_q[:, None] & (offs_d[None, :] < HEAD_DIM))
