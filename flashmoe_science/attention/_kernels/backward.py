"""Attention backward: FlashAttention-2 recomputation, never storing an Sq x Sk matrix.

With S = scale * Q K^T, P = exp(S - lse) (lse saved by the forward), O = P V and dO the
gradient of the output:

    dV = P^T dO        dP = dO V^T        dS = P * (dP - delta),  delta = rowsum(dO * O)
    dQ = scale * dS K  dK = scale * dS^T Q

Three kernels, each output element written by exactly one program that sums in a fixed order,
so gradients are bitwise reproducible (no atomics):

* `attention_backward_preprocess_kernel` computes delta (fp32, one value per query row) and
  lse in base 2 where the dQ kernel does not: when lse has a gradient of its own.
* `attention_backward_dq_kernel`: one program per block of BLOCK_M query rows of one (batch,
  query head), Q and dO on chip, walking the key blocks. It runs first: with DELTA_HERE it loads
  its rows of O as well, computes their delta and stores it, with their lse in base 2, for the
  dK/dV kernel, which saves a launch and a second pass over dO. (The dK/dV kernel meets each
  query row once per key block, so it takes lse ready to subtract.)
* `attention_backward_dkdv_kernel`: one program per block of BLOCK_N keys of one (batch, kv head).
  K and V stay on chip while the program walks the query blocks of every query head of its GQA
  group, so dK and dV are summed over the group in registers and written once. It works on the
  transposed tiles (S^T = K Q^T) so that dV += P^T dO and dK += dS^T Q are plain products.

Splitting dQ from dK/dV recomputes S and dP once more (seven block products per block pair
instead of five), the price of never accumulating dQ across programs. Adding dQ from the dK/dV
kernel instead (fp32 atomic adds, or FlashAttention-3's TMA reduce-adds) measured slower on an H100
at S = 4096: at best 369 TFLOP/s against 401 at D = 128, 155 against 204 at D = 256
(benchmarks/results/attention_backward_sweep_dq_{tma,atomic}.json).

P is recomputed in base 2: scores times scale*log2(e) minus lse*log2(e), one exp2 per element.
With a softcap the forward's logits were softcap * tanh(scale * q.k / softcap); the backward
recomputes t = tanh(...) from the raw score and multiplies dS by the derivative 1 - t^2 (the
softcap's scale cancels: d logit / d(q.k) = scale * (1 - t^2)).

Which keys a query sees is the forward's band (`forward.band_diagonals`: bottom-right aligned,
causal and sliding windows alike), so both kernels walk only the blocks that meet it
(`forward.band_blocks`; the dK/dV kernel asks with the band mirrored, keys as rows): blocks nobody
sees are skipped, so cost grows with the window; blocks that every row fully sees run without any
mask; only blocks on the band's two edges, and the partial last block of the streamed dimension
(queries in the dK/dV kernel, keys in the dQ kernel), pay for masking. Both masked runs share one
loop (a select picks the block), so each kernel has two loop bodies, not three.

Variable-length batches (VARLEN) pack the sequences along one token axis with batch strides 0:
each program reads its sequence's start and lengths from the cumulative lengths and returns at
once when its block lies past that sequence's end. lse and delta are addressed with strides
(stride_lb, stride_lh) plus the token row: (Hq*Sq, Sq) for dense (B, Hq, Sq), (0, total_q) for
variable-length (Hq, total_q). The preprocess kernel needs no sequence structure at all: it runs
on the packed tokens as one batch entry.

Rows that saw no key in the forward have lse = -inf. Their lse is read (and stored in base 2)
as +inf instead, so every p of theirs is exp2(-inf) = 0 and their gradients are exactly zero.
Padding rows past Sq load q = dO = 0 and lse = +inf for the same effect, so query tails need
load masks but no score mask. Key tails need a score mask where they feed dQ (a zero key row
still scores 0, not -inf), but not in the dK/dV kernel, where only their own unstored rows see
them.
"""
import triton
import triton.language as tl

from .forward import band_blocks, band_diagonals, sequence_bounds, tanh, visible_band
from .tiles import load_tile

_LOG2E = tl.constexpr(1.4426950408889634)


@triton.jit
def _lse_log2(lse):
    # Rows that see no key have lse = -inf; +inf makes exp2(s - lse) = 0 for them, not NaN.
    return tl.where(lse == float("-inf"), float("inf"), lse * _LOG2E)


@triton.jit
def no_key_rows_zero(dq, lse_log2):
    """dq with exactly 0 in the rows that see no key (lse_log2 = +inf). Their p is 0 everywhere,
    but 0 times a NaN or Inf score gradient (from V or dO of keys their neighbours see) is NaN."""
    return tl.where((lse_log2 == float("inf"))[:, None], 0.0, dq)


@triton.jit
def attention_backward_preprocess_kernel(
    O, DO, LSE, DELTA, LSE_LOG2,
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
    row_offsets = pid_bh.to(tl.int64) * seqlen_q + rows
    tl.store(DELTA + row_offsets, delta, mask=rows < seqlen_q)
    lse = tl.load(LSE + row_offsets, mask=rows < seqlen_q)
    tl.store(LSE_LOG2 + row_offsets, _lse_log2(lse), mask=rows < seqlen_q)


@triton.jit
def _descriptor_tile(desc, coords, rows, num_rows, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                     ZERO_TAIL: tl.constexpr):
    """A (BLOCK_ROWS, BLOCK_D) tile through a 4-D descriptor at `coords`. Past the tensor the
    copy engine fills zeros; with ZERO_TAIL rows at or past `num_rows` (a packed sequence's end,
    where the next sequence's rows follow) are zeroed too, so that no value of another sequence,
    finite or not, reaches a product."""
    tile = desc.load(coords).reshape(BLOCK_ROWS, BLOCK_D)
    if ZERO_TAIL:
        tile = tl.where((rows < num_rows)[:, None], tile, tl.zeros_like(tile))
    return tile


@triton.jit
def _block_runs(lo, full_lo, full_hi, hi, BLOCK: tl.constexpr):
    """Block counts of the runs `band_blocks` describes: (masked before, unmasked, masked after).
    The masked runs are [lo, min(full_lo, hi)) and [full_hi, hi), the unmasked [full_lo, full_hi)."""
    num_before = tl.cdiv(tl.maximum(tl.minimum(full_lo, hi) - lo, 0), BLOCK)
    num_after = tl.cdiv(tl.maximum(hi - full_hi, 0), BLOCK)
    return num_before, (full_hi - full_lo) // BLOCK, num_after


@triton.jit
def _scores_to_probabilities(qk, lse_log2, scale_log2, softcap_scale, softcap_log2, SOFTCAP: tl.constexpr,
                             TRANSPOSED: tl.constexpr):
    """P = exp(logits - lse) from raw scores q.k (fp32), in base 2 as the forward computed it;
    with SOFTCAP also t = tanh(scale * q.k / softcap), whose 1 - t^2 is the softcap's derivative."""
    if SOFTCAP:
        t = tanh(qk * softcap_scale)
        s = t * softcap_log2
    else:
        t = qk
        s = qk * scale_log2
    if TRANSPOSED:
        p = tl.math.exp2(s - lse_log2[None, :])
    else:
        p = tl.math.exp2(s - lse_log2[:, None])
    return p, t


@triton.jit
def _key_block_step(dk, dv, k, v, Q, DO, LSE_LOG2, DELTA, h, i, first_m, num_first, second_m, b64, acc_b,
                    q_tile, do_tile, offs_m, keys, offs_d, offs_dv, q_start, seqlen_q, diag_lo, diag_hi, scale_log2,
                    softcap_scale, softcap_log2, stride_qb, stride_qh, stride_qm, stride_dob, stride_doh,
                    stride_dom, stride_lb, stride_lh, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
                    TMA: tl.constexpr, VARLEN: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Query head `h`'s query block `i` of a loop: one BLOCK_M block of query rows against the
    program's BLOCK_N keys, on transposed tiles. The blocks of a loop are one run from `first_m`,
    or (masked loops) `num_first` blocks from `first_m` then the rest from `second_m`."""
    h64 = h.to(tl.int64)
    if MASKED:
        start_m = tl.where(i < num_first, first_m + i * BLOCK_M, second_m + (i - num_first) * BLOCK_M)
    else:
        start_m = first_m + i * BLOCK_M
    rows = start_m + offs_m
    row64 = tl.cast(q_start + start_m, tl.int64)  # row offsets of long (B, S, H, D) inputs pass 2**31 elements
    row_offsets = b64 * stride_lb + h64 * stride_lh + row64 + offs_m
    if TMA:
        coords = [acc_b, h64.to(tl.int32), q_start + start_m, 0]
        q = _descriptor_tile(Q, coords, rows, seqlen_q, BLOCK_M, BLOCK_D, MASKED and VARLEN)
        do = _descriptor_tile(DO, coords, rows, seqlen_q, BLOCK_M, BLOCK_DV, MASKED and VARLEN)
    else:
        q_ptrs = Q + (b64 * stride_qb + h64 * stride_qh + row64 * stride_qm) + q_tile
        do_ptrs = DO + (b64 * stride_dob + h64 * stride_doh + row64 * stride_dom) + do_tile
        q = load_tile(q_ptrs, rows, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        do = load_tile(do_ptrs, rows, seqlen_q, offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED)
    if MASKED:
        lse_log2 = tl.load(LSE_LOG2 + row_offsets, mask=rows < seqlen_q, other=float("inf"))
        delta = tl.load(DELTA + row_offsets, mask=rows < seqlen_q, other=0.0)
    else:
        lse_log2 = tl.load(LSE_LOG2 + row_offsets)
        delta = tl.load(DELTA + row_offsets)
    s_t = tl.dot(k, tl.trans(q), input_precision=DOT_PRECISION)
    p_t, t = _scores_to_probabilities(s_t, lse_log2, scale_log2, softcap_scale, softcap_log2,
                                      SOFTCAP, True)
    if MASKED:
        rel = keys[:, None] - rows[None, :]
        p_t = tl.where((rel <= diag_hi) & (rel >= diag_lo), p_t, 0.0)
    dv = tl.dot(p_t.to(do.dtype), do, dv, input_precision=DOT_PRECISION)
    dp_t = tl.dot(v, tl.trans(do), input_precision=DOT_PRECISION)
    ds_t = p_t * (dp_t - delta[None, :])
    if SOFTCAP:
        ds_t = ds_t * (1.0 - t * t)
    ds_t = ds_t.to(q.dtype)
    dk = tl.dot(ds_t, q, dk, input_precision=DOT_PRECISION)
    return dk, dv


@triton.jit
def attention_backward_dkdv_kernel(
    Q, K, V, DO, LSE_LOG2, DELTA, DK, DV, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUENCE_ORDER,
    softmax_scale, scale_log2, softcap_scale, softcap_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_dkb, stride_dkh, stride_dkn,
    stride_dvb, stride_dvh, stride_dvn,
    stride_lb, stride_lh,
    num_heads_kv, group_size, seqlen_q, seqlen_k, total_q, total_k, num_n_blocks, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """q, k, dk: head dim HEAD_DIM (tiles of BLOCK_D); v, dO, dv: HEAD_DIM_V (BLOCK_DV)."""
    # Key blocks of one kv head are adjacent in the grid so that they share Q and dO in L2. Under
    # causal masking the first key blocks are seen by the most query rows: heaviest run first.
    pid = tl.program_id(0)
    pid_bh = pid // num_n_blocks
    pid_n = pid % num_n_blocks
    b = pid_bh // num_heads_kv
    b64 = b.to(tl.int64)
    h_kv64 = (pid_bh % num_heads_kv).to(tl.int64)
    start_n = pid_n * BLOCK_N
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, SEQUENCE_ORDER, b, seqlen_q,
                                                            seqlen_k, total_q, total_k, VARLEN)
    if VARLEN:
        if start_n >= seqlen_k:
            return

    offs_m = tl.arange(0, BLOCK_M)
    keys = start_n + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    keys64 = (k_start + keys[:, None]).to(tl.int64)
    acc_b = 0 if VARLEN else b  # a packed batch is one (1, H, total, D) entry of descriptors
    if TMA:
        # Key rows past a packed sequence's end hold the next sequence's keys: they only reach
        # their own dK and dV rows, which are never stored.
        k = _descriptor_tile(K, [acc_b, h_kv64.to(tl.int32), k_start + start_n, 0], keys, seqlen_k, BLOCK_N,
                             BLOCK_D, False)
        v = _descriptor_tile(V, [acc_b, h_kv64.to(tl.int32), k_start + start_n, 0], keys, seqlen_k, BLOCK_N,
                             BLOCK_DV, False)
    else:
        k = load_tile(K + b64 * stride_kb + h_kv64 * stride_kh + keys64 * stride_kn + offs_d[None, :], keys,
                      seqlen_k, offs_d, HEAD_DIM, BLOCK_D, True)
        v = load_tile(V + b64 * stride_vb + h_kv64 * stride_vh + keys64 * stride_vn + offs_dv[None, :], keys,
                      seqlen_k, offs_dv, HEAD_DIM_V, BLOCK_DV, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    # The query rows that see these keys, by the band mirrored (key j sees query i when
    # -diag_hi <= i - j <= -diag_lo): blocks on the band's edges and the partial last query
    # block are masked, the blocks between run unmasked. Keys past Sk need no mask: they load
    # as zero rows, and what their dK and dV rows collect is never stored, while no other row
    # depends on them.
    diag_lo, diag_hi = band_diagonals(seqlen_q, seqlen_k, window_left, window_right)
    lo, full_lo, full_hi, hi = band_blocks(start_n, seqlen_k, seqlen_q, -diag_hi, -diag_lo, BLOCK_N, BLOCK_M)
    num_before, num_full, num_after = _block_runs(lo, full_lo, full_hi, hi, BLOCK_M)
    num_masked = num_before + num_after

    # Two flat loops over (query head of the group, query block) pairs rather than a loop over
    # heads around three block loops: nested and repeated loop bodies cost registers, which this
    # kernel (two fp32 BLOCK_N x D accumulators plus two BLOCK_N x BLOCK_M score tiles) lacks.
    q_tile = offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
    do_tile = offs_m[:, None].to(tl.int64) * stride_dom + offs_dv[None, :]
    # Each loop walks (query head of the group, query block) pairs with counters, the head moving
    # on when the block count wraps: an integer division per step, and lse turned into base 2 in
    # the step, cost 88 of its 443 SASS instructions (sm90, D = 64) and 3 to 5% of the backward.
    h_first = (h_kv64 * group_size).to(tl.int32)
    h = h_first
    i = 0
    for _ in range(0, group_size * num_masked):
        dk, dv = _key_block_step(dk, dv, k, v, Q, DO, LSE_LOG2, DELTA, h, i, lo, num_before, full_hi,
                                 b64, acc_b, q_tile, do_tile, offs_m, keys, offs_d, offs_dv, q_start, seqlen_q, diag_lo,
                                 diag_hi, scale_log2, softcap_scale, softcap_log2, stride_qb, stride_qh, stride_qm,
                                 stride_dob, stride_doh, stride_dom, stride_lb, stride_lh, HEAD_DIM, BLOCK_D,
                                 HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, True, SOFTCAP, TMA, VARLEN, DOT_PRECISION)
        i += 1
        h = tl.where(i == num_masked, h + 1, h)
        i = tl.where(i == num_masked, 0, i)
    h = h_first
    i = 0
    for _ in range(0, group_size * num_full):
        dk, dv = _key_block_step(dk, dv, k, v, Q, DO, LSE_LOG2, DELTA, h, i, full_lo, num_full, full_lo,
                                 b64, acc_b, q_tile, do_tile, offs_m, keys, offs_d, offs_dv, q_start, seqlen_q, diag_lo,
                                 diag_hi, scale_log2, softcap_scale, softcap_log2, stride_qb, stride_qh, stride_qm,
                                 stride_dob, stride_doh, stride_dom, stride_lb, stride_lh, HEAD_DIM, BLOCK_D,
                                 HEAD_DIM_V, BLOCK_DV, BLOCK_M, BLOCK_N, False, SOFTCAP, TMA, VARLEN, DOT_PRECISION)
        i += 1
        h = tl.where(i == num_full, h + 1, h)
        i = tl.where(i == num_full, 0, i)

    dk = dk * softmax_scale
    if TMA and not VARLEN:  # the descriptor drops rows past Sk and columns past HEAD_DIM
        DK.store([b, h_kv64.to(tl.int32), start_n, 0], dk.to(DK.dtype).reshape(1, 1, BLOCK_N, BLOCK_D))
        DV.store([b, h_kv64.to(tl.int32), start_n, 0], dv.to(DV.dtype).reshape(1, 1, BLOCK_N, BLOCK_DV))
    else:
        dk_ptrs = DK + b64 * stride_dkb + h_kv64 * stride_dkh + keys64 * stride_dkn + offs_d[None, :]
        dv_ptrs = DV + b64 * stride_dvb + h_kv64 * stride_dvh + keys64 * stride_dvn + offs_dv[None, :]
        key_ok = keys[:, None] < seqlen_k
        tl.store(dk_ptrs, dk.to(DK.dtype.element_ty), mask=key_ok & (offs_d[None, :] < HEAD_DIM))
        tl.store(dv_ptrs, dv.to(DV.dtype.element_ty), mask=key_ok & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _query_block_step(dq, q, do, lse_log2, delta, k_ptrs, v_ptrs, kv_coords, i, lo, num_first, second_n, rows,
                      offs_n, offs_d, offs_dv, seqlen_k, diag_lo, diag_hi, scale_log2, softcap_scale, softcap_log2,
                      stride_kn, stride_vn, BLOCK_N: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                      HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                      MASKED: tl.constexpr, SOFTCAP: tl.constexpr, TMA: tl.constexpr, VARLEN: tl.constexpr,
                      DOT_PRECISION: tl.constexpr):
    """The program's BLOCK_M query rows against key block `i` of a loop: one run of blocks from
    `lo`, or (masked loops) `num_first` blocks from `lo` then the rest from `second_n`. With TMA,
    k_ptrs and v_ptrs are the K and V descriptors and kv_coords their (batch, head, first row)."""
    if MASKED:
        start_n = tl.where(i < num_first, lo + i * BLOCK_N, second_n + (i - num_first) * BLOCK_N)
    else:
        start_n = lo + i * BLOCK_N
    keys = start_n + offs_n
    if TMA:
        coords = [kv_coords[0], kv_coords[1], kv_coords[2] + start_n, 0]
        k = _descriptor_tile(k_ptrs, coords, keys, seqlen_k, BLOCK_N, BLOCK_D, MASKED and VARLEN)
        v = _descriptor_tile(v_ptrs, coords, keys, seqlen_k, BLOCK_N, BLOCK_DV, MASKED and VARLEN)
    else:
        start64 = tl.cast(start_n, tl.int64)  # row offsets of long (B, S, H, D) inputs pass 2**31 elements
        k = load_tile(k_ptrs + start64 * stride_kn, keys, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        v = load_tile(v_ptrs + start64 * stride_vn, keys, seqlen_k, offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    p, t = _scores_to_probabilities(s, lse_log2, scale_log2, softcap_scale, softcap_log2,
                                    SOFTCAP, False)
    if MASKED:
        rel = keys[None, :] - rows[:, None]
        p = tl.where((keys[None, :] < seqlen_k) & (rel <= diag_hi) & (rel >= diag_lo), p, 0.0)
    dp = tl.dot(do, tl.trans(v), input_precision=DOT_PRECISION)
    ds = p * (dp - delta[:, None])
    if SOFTCAP:
        ds = ds * (1.0 - t * t)
    return tl.dot(ds.to(k.dtype), k, dq, input_precision=DOT_PRECISION)


# Sequence lengths never specialised: Triton would make a value of 1 a constant, and with every
# size argument 1 (B = H = Sq = Sk = 1) ptxas crashed (SIGSEGV) on the sm90 fp16 D = 16 softcap
# build (8 warps, 3 stages).
@triton.jit(do_not_specialize=["seqlen_q", "seqlen_k"])
def attention_backward_dq_kernel(
    Q, K, V, DO, O, LSE, DELTA, LSE_LOG2, DQ, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUENCE_ORDER,
    softmax_scale, scale_log2, softcap_scale, softcap_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_dob, stride_doh, stride_dom,
    stride_ob, stride_oh, stride_om,
    stride_dqb, stride_dqh, stride_dqm,
    stride_lb, stride_lh,
    num_heads_q, group_size, seqlen_q, seqlen_k, total_q, total_k, num_m_blocks, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, TMA: tl.constexpr, DELTA_HERE: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """q, k, dq: head dim HEAD_DIM (tiles of BLOCK_D); v, dO, O: HEAD_DIM_V (BLOCK_DV)."""
    # Query blocks of one head adjacent (they share K and V in L2); under causal masking the last
    # query block sees the most keys, so blocks run last-first to shorten the tail.
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    pid_m = num_m_blocks - 1 - pid % num_m_blocks
    b = pid_bh // num_heads_q
    b64 = b.to(tl.int64)
    h = pid_bh % num_heads_q
    h64 = h.to(tl.int64)
    h_kv64 = (h // group_size).to(tl.int64)
    start_m = pid_m * BLOCK_M
    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, SEQUENCE_ORDER, b, seqlen_q,
                                                            seqlen_k, total_q, total_k, VARLEN)
    if VARLEN:
        if start_m >= seqlen_q:
            return

    rows = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    in_q = rows < seqlen_q
    rows64 = (q_start + rows[:, None]).to(tl.int64)
    tma_b = 0 if VARLEN else b  # a packed batch is one (1, H, total, D) entry of the descriptors
    kv_coords = (tma_b, h_kv64.to(tl.int32), k_start)
    if TMA:
        # Query rows past a packed sequence's end (the next sequence's) only reach their own,
        # unstored dQ rows: their lse reads as -inf, so every p of theirs is 0.
        q = Q.load([tma_b, h, q_start + start_m, 0]).reshape(BLOCK_M, BLOCK_D)
        do = DO.load([tma_b, h, q_start + start_m, 0]).reshape(BLOCK_M, BLOCK_DV)
        k_ptrs = K
        v_ptrs = V
    else:
        q = load_tile(Q + b64 * stride_qb + h64 * stride_qh + rows64 * stride_qm + offs_d[None, :], rows, seqlen_q,
                      offs_d, HEAD_DIM, BLOCK_D, True)
        do = load_tile(DO + b64 * stride_dob + h64 * stride_doh + rows64 * stride_dom + offs_dv[None, :], rows,
                       seqlen_q, offs_dv, HEAD_DIM_V, BLOCK_DV, True)
        kv_rows = (k_start + offs_n[:, None]).to(tl.int64)
        k_ptrs = K + b64 * stride_kb + h_kv64 * stride_kh + kv_rows * stride_kn + offs_d[None, :]
        v_ptrs = V + b64 * stride_vb + h_kv64 * stride_vh + kv_rows * stride_vn + offs_dv[None, :]
    row_offsets = b64 * stride_lb + h64 * stride_lh + (q_start + rows).to(tl.int64)
    lse_log2 = _lse_log2(tl.load(LSE + row_offsets, mask=in_q, other=float("-inf")))
    if DELTA_HERE:  # the preprocess's work on this program's rows, for it and the dK/dV kernel after it
        o = load_tile(O + b64 * stride_ob + h64 * stride_oh + rows64 * stride_om + offs_dv[None, :], rows, seqlen_q,
                      offs_dv, HEAD_DIM_V, BLOCK_DV, True)
        delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
        tl.store(DELTA + row_offsets, delta, mask=in_q)
        tl.store(LSE_LOG2 + row_offsets, lse_log2, mask=in_q)
    else:
        delta = tl.load(DELTA + row_offsets, mask=in_q, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    # The key blocks of the forward's band: those on its edges (and the partial last key block,
    # whose zero rows would otherwise score 0) masked, those between unmasked. Padding rows past
    # Sq contribute p = 0 anywhere.
    diag_lo, diag_hi, lo, full_lo, full_hi, hi = visible_band(pid_m, seqlen_q, seqlen_k, window_left, window_right,
                                                               BLOCK_M, BLOCK_N)
    num_before, num_full, num_after = _block_runs(lo, full_lo, full_hi, hi, BLOCK_N)
    for i in range(0, num_before + num_after):
        dq = _query_block_step(dq, q, do, lse_log2, delta, k_ptrs, v_ptrs, kv_coords, i, lo, num_before, full_hi,
                               rows, offs_n, offs_d, offs_dv, seqlen_k, diag_lo, diag_hi, scale_log2, softcap_scale,
                               softcap_log2, stride_kn, stride_vn, BLOCK_N, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV,
                               True, SOFTCAP, TMA, VARLEN, DOT_PRECISION)
    for i in range(0, num_full):
        dq = _query_block_step(dq, q, do, lse_log2, delta, k_ptrs, v_ptrs, kv_coords, i, full_lo, num_full, full_lo,
                               rows, offs_n, offs_d, offs_dv, seqlen_k, diag_lo, diag_hi, scale_log2, softcap_scale,
                               softcap_log2, stride_kn, stride_vn, BLOCK_N, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV,
                               False, SOFTCAP, TMA, VARLEN, DOT_PRECISION)

    dq = no_key_rows_zero(dq, lse_log2) * softmax_scale
    if TMA and not VARLEN:
        DQ.store([b, h, start_m, 0], dq.to(DQ.dtype).reshape(1, 1, BLOCK_M, BLOCK_D))
    else:
        tl.store(DQ + b64 * stride_dqb + h64 * stride_dqh + rows64 * stride_dqm + offs_d[None, :],
                 dq.to(DQ.dtype.element_ty), mask=in_q[:, None] & (offs_d[None, :] < HEAD_DIM))
