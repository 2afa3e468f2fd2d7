"""Attention forward: one program computes BLOCK_M query rows of one (sequence, head) pair.

The online softmax of FlashAttention-2 in base 2: scores are scaled by softmax_scale*log2(e)
so every exponential is an exp2, the running row maximum `m` and row sum `l` rescale the
accumulator when the maximum grows, and nothing of size Sq x Sk is ever stored.

Which keys a query sees is a band around the bottom-right diagonal: query i sees key j when
diag_lo <= j - i <= diag_hi, where for a sequence with Sq queries and Sk keys
    diag_hi = Sk - Sq + window_right  (causal: window_right = 0; unbounded: +2^30)
    diag_lo = Sk - Sq - window_left   (unbounded: -2^30)
as flash-attn >= 2.1 aligns causal and sliding-window attention. The key loop visits only the
blocks that meet the band, in three runs: blocks on the band's left edge (masked), blocks every
row of the program fully sees (no mask at all), and blocks on the right edge or past the end of
the keys (masked). Cost therefore grows with the window, not with Sk.

Variable-length batches (VARLEN) pack sequences along one token axis; cumulative lengths give
each sequence's start, and programs past a short sequence's end return at once.
"""
import triton
import triton.language as tl

from ...float8 import SOFTWARE_FP8_ROUNDING, round_to_e4m3
from .tiles import load_tile

UNBOUNDED = tl.constexpr(1 << 30)
# Which edges of the band a key block crosses (`band_edge_mask`).
NO_EDGE = tl.constexpr(0)
RIGHT_EDGE = tl.constexpr(1)
BOTH_EDGES = tl.constexpr(2)
# The input precision of fp32 products where a kernel takes none (the Hopper kernels: 16-bit only).
TF32 = tl.constexpr("tf32")
# The smallest softmax scale the forward kernels take: a zero one gives the same uniform weights
# this way, without 0 * -inf on masked scores (`softmax_step`).
MIN_SCALE = 1e-30
MIN_SCALE_IN_KERNEL = tl.constexpr(MIN_SCALE)
# FP8 forwards scale P by 2^FP8_P_SHIFT before quantising it (`softmax_step`): P <= 256 stays far
# below e4m3's 448, and probabilities down to 2^-14 stay normal numbers (2^-6 unscaled).
FP8_P_SHIFT = tl.constexpr(8)


@triton.jit
def band_diagonals(seqlen_q, seqlen_k, window_left, window_right):
    """(diag_lo, diag_hi): query i sees key j when diag_lo <= j - i <= diag_hi (module docstring)."""
    diagonal = seqlen_k - seqlen_q
    diag_hi = tl.where(window_right < 0, UNBOUNDED, diagonal + window_right)
    diag_lo = tl.where(window_left < 0, -UNBOUNDED, diagonal - window_left)
    return diag_lo, diag_hi


@triton.jit
def band_blocks(first_row, num_rows, num_cols, diag_lo, diag_hi, BLOCK_ROWS: tl.constexpr,
                BLOCK_COLS: tl.constexpr):
    """Which column blocks the rows [first_row, first_row + BLOCK_ROWS) meet, where row r sees
    column c when diag_lo <= c - r <= diag_hi and c < num_cols: returns (lo, full_lo, full_hi, hi).
    Columns [lo, hi) meet the band (lo is block-aligned); the blocks in [full_lo, full_hi) are
    visible to every real row (r < num_rows) and need no mask. The forward and the dQ kernel ask
    with rows = queries, columns = keys; the dK/dV kernel with rows = keys, columns = queries and
    the band mirrored (-diag_hi, -diag_lo)."""
    last_row = tl.minimum(first_row + BLOCK_ROWS - 1, num_rows - 1)
    lo = tl.maximum(first_row + diag_lo, 0) // BLOCK_COLS * BLOCK_COLS
    hi = tl.minimum(last_row + diag_hi + 1, num_cols)
    full_lo = tl.maximum(lo, tl.cdiv(tl.maximum(last_row + diag_lo, 0), BLOCK_COLS) * BLOCK_COLS)
    full_hi = tl.maximum(full_lo, tl.minimum(first_row + diag_hi + 1, num_cols) // BLOCK_COLS * BLOCK_COLS)
    return lo, full_lo, full_hi, hi


@triton.jit
def program_coordinates(num_heads_q, group_size, num_m_blocks, CAUSAL: tl.constexpr):
    """(batch, query head, its key/value head, query block) of this program. The grid is 1-D with
    the query blocks of one head adjacent, so that they share K/V in L2; causal blocks run
    heaviest first (the last query block sees the most keys), which shortens the tail."""
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    pid_m = pid % num_m_blocks
    if CAUSAL:
        pid_m = num_m_blocks - 1 - pid_m
    h = pid_bh % num_heads_q
    return pid_bh // num_heads_q, h, h // group_size, pid_m


@triton.jit
def visible_band(pid_m, seqlen_q, seqlen_k, window_left, window_right, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr):
    """The band of keys query block `pid_m` sees (see the module docstring): returns
    (diag_lo, diag_hi, lo, full_lo, full_hi, hi). Keys [lo, hi) meet the band; blocks in
    [full_lo, full_hi) are visible to every row of the block and need no mask."""
    diag_lo, diag_hi = band_diagonals(seqlen_q, seqlen_k, window_left, window_right)
    lo, full_lo, full_hi, hi = band_blocks(pid_m * BLOCK_M, seqlen_q, seqlen_k, diag_lo, diag_hi, BLOCK_M, BLOCK_N)
    return diag_lo, diag_hi, lo, full_lo, full_hi, hi


@triton.jit
def tanh(x):
    """tanh(x) to a few fp32 ulp over the whole range (the softcap of scores s is
    softcap * tanh(s / softcap), where a large softcap makes s / softcap small).

    |x| >= 1/4: sign(x) (1 - e) / (1 + e) with e = exp(-2|x|) in (0, 0.61], one exp2, no
    overflow and no cancellation worth a bit. |x| < 1/4, where 1 - e would cancel: the odd
    Taylor series to x^11, whose first omitted term is below 2e-9 relative there."""
    ax = tl.abs(x)
    e = tl.math.exp2(ax * -2.8853900817779268)
    wide = (1.0 - e) / (1.0 + e)
    x2 = x * x
    poly = x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * (-0.05396825396825397 + x2 * (
        0.021869488536155203 + x2 * -0.008863235529902197))))
    return tl.where(ax < 0.25, x + x * poly, tl.where(x < 0.0, -wide, wide))


@triton.jit
def sequence_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, SEQUENCE_ORDER, b, seqlen_q, seqlen_k, total_q, total_k,
                    VARLEN: tl.constexpr):
    """(q_start, seqlen_q, k_start, seqlen_k) of the program's sequence: in a variable-length
    batch the b-th of SEQUENCE_ORDER (longest first, so that the longest programs start first and
    short ones fill the tail), from the cumulative lengths; else the dense batch's own (rows
    start at 0 of each batch entry).

    In a variable-length batch seqlen_q and seqlen_k come in as max_seqlen_q and max_seqlen_k,
    and the bounds read are clamped into the tensors: start in [0, total], end in [start, total],
    length at most max_seqlen. Well-formed cumulative lengths pass unchanged; malformed ones (which
    the host checks once per tensor, and `lengths.malformed_lengths_poison_kernel` on every call)
    can then never move a program's reads or writes outside q, k, v and their outputs."""
    if VARLEN:
        b = tl.load(SEQUENCE_ORDER + b)
        q_start = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_Q + b), 0), total_q)
        q_end = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_Q + b + 1), q_start), total_q)
        k_start = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_K + b), 0), total_k)
        k_end = tl.minimum(tl.maximum(tl.load(CU_SEQLENS_K + b + 1), k_start), total_k)
        seqlen_q = tl.minimum(q_end - q_start, seqlen_q)
        seqlen_k = tl.minimum(k_end - k_start, seqlen_k)
    else:
        q_start = 0
        k_start = 0
    return q_start, seqlen_q, k_start, seqlen_k


@triton.jit
def band_edge_mask(s, offs_m, start_n, offs_n, seqlen_k, diag_lo, diag_hi, EDGES: tl.constexpr):
    """s, the scores of the key block at start_n, with those outside the band (or past the last
    key) set to -inf. EDGES = RIGHT_EDGE: the block lies wholly right of the band's left edge
    (`band_blocks`' full_lo), so each row's last visible key bounds it alone; BOTH_EDGES: its
    first visible key too. Bounds are taken per row and relative to start_n, so a score costs
    one compare per edge and a select."""
    end = tl.minimum(offs_m + (diag_hi + 1), seqlen_k) - start_n  # past the row's last visible key
    visible = offs_n[None, :] < end[:, None]
    if EDGES == BOTH_EDGES:
        visible = visible & (offs_n[None, :] >= (offs_m + diag_lo - start_n)[:, None])
    return tl.where(visible, s, float("-inf"))


@triton.jit
def softmax_step(acc, l_i, m_i, qk, v, offs_m, start_n, offs_n, seqlen_k, diag_lo, diag_hi, scale_log2,
                 softcap_scale, softcap_log2, MASKED: tl.constexpr, SOFTCAP: tl.constexpr,
                 DOT_PRECISION: tl.constexpr = TF32, P_SHIFT: tl.constexpr = 0):
    """One key block of the online softmax: scores qk = q.k^T (fp32) to base-2 logits s * mult
    (softcapped if asked), masked to the band on edge blocks (MASKED: NO_EDGE, RIGHT_EDGE or
    BOTH_EDGES, `band_edge_mask`), then rescale and accumulate p.v.

    The multiplier is folded into the exponent's one FMA and the row maximum is taken over the
    unscaled scores: max(s) * mult = max(s * mult) as mult > 0 (`layouts.positive_scale` negates q
    for a negative softmax_scale and raises a zero one to MIN_SCALE, so masked scores stay -inf
    after the multiply).

    P_SHIFT (FP8 products, `FP8_P_SHIFT`): the probabilities are 2^P_SHIFT times their value, so
    that P, quantised to v's dtype for the P V product, uses e4m3's normal range rather than its
    subnormals; the row sums carry the same power of two, which the division by them cancels
    exactly."""
    if SOFTCAP:
        s = tanh(qk * softcap_scale)  # softcap * tanh(score / softcap) = softcap_log2 * s in base 2
        mult = softcap_log2
    else:
        s = qk
        mult = scale_log2
    if MASKED != NO_EDGE:
        s = band_edge_mask(s, offs_m, start_n, offs_n, seqlen_k, diag_lo, diag_hi, MASKED)
        m_new = tl.maximum(m_i, tl.max(s, 1) * mult)
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1) * mult)
        m_sub = m_new
    if P_SHIFT != 0:
        p = tl.math.exp2(s * mult - (m_sub - P_SHIFT)[:, None])
    else:
        p = tl.math.exp2(s * mult - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None]
    if P_SHIFT != 0:
        if SOFTWARE_FP8_ROUNDING:
            p = round_to_e4m3(p)
    acc = tl.dot(p.to(v.dtype), v, acc, input_precision=DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def fp8_scores_scale(descale, scale_log2, softcap_scale):
    """(scale_log2, softcap_scale) of an FP8 product whose scores carry the factor `descale` (q's
    times k's): both times it. The softmax takes row maxima of unscaled scores, so a negative or
    NaN descale turns every score NaN rather than silently inverting the weights; a zero one (an
    all-zero tensor's) is raised to MIN_SCALE as the host raises a zero softmax_scale, so masked
    scores stay -inf after the multiply."""
    scale_log2 = tl.where(descale >= 0, tl.maximum(scale_log2 * descale, MIN_SCALE_IN_KERNEL), float("nan"))
    return scale_log2, softcap_scale * descale


@triton.jit
def finish(acc, l_i, m_i):
    """Normalised output and natural-log lse. Rows that saw no key (causal with Sk < Sq, an empty
    window, Sk = 0) have l = 0: output exactly 0 and lse -inf, also where a key block their
    neighbours see holds NaN or Inf in V (their p of 0 times it is NaN in the product)."""
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
    return tl.where((l_i == 0.0)[:, None], 0.0, acc / l_safe[:, None]), lse


@triton.jit
def _attend_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, offs_dv, seqlen_k, diag_lo,
                  diag_hi, scale_log2, softcap_scale, softcap_log2, stride_kn, stride_vn,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
                  MASKED: tl.constexpr, SOFTCAP: tl.constexpr, DOT_PRECISION: tl.constexpr, P_SHIFT: tl.constexpr):
    cols = start_n + offs_n
    start64 = tl.cast(start_n, tl.int64)  # start_n * stride passes 2**31 on long (B, S, H, D) inputs
    k = load_tile(k_ptrs + start64 * stride_kn, cols, seqlen_k, offs_d, HEAD_DIM, BLOCK_D, MASKED != NO_EDGE)
    v = load_tile(v_ptrs + start64 * stride_vn, cols, seqlen_k, offs_dv, HEAD_DIM_V, BLOCK_DV, MASKED != NO_EDGE)
    qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    return softmax_step(acc, l_i, m_i, qk, v, offs_m, start_n, offs_n, seqlen_k, diag_lo, diag_hi, scale_log2,
                        softcap_scale, softcap_log2, MASKED, SOFTCAP, DOT_PRECISION, P_SHIFT)


@triton.jit
def attention_forward_kernel(
    Q, K, V, O, LSE, CU_SEQLENS_Q, CU_SEQLENS_K, SEQUENCE_ORDER, DESCALE,
    scale_log2, softcap_scale, softcap_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_lb, stride_lh,
    num_heads_q, group_size, seqlen_q, seqlen_k, total_q, total_k, num_m_blocks, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, VARLEN: tl.constexpr, WRITE_LSE: tl.constexpr,
    FP8: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """q and k have head dim HEAD_DIM (padded to BLOCK_D in tiles), v and the output HEAD_DIM_V
    (padded to BLOCK_DV): equal, or different as in MLA (192 and 128).

    FP8: q, k, v in float8 e4m3, both products on the FP8 tensor cores with fp32 accumulation, and
    DESCALE a float32 (batch, heads_kv, 3) tensor: the factors (q_descale, k_descale, v_descale)
    that turn each (sequence, KV head)'s stored values back into real ones (FlashAttention-3's
    per-head descaling). Scores take q_descale * k_descale with the softmax scale, P is quantised
    to e4m3 at 2^FP8_P_SHIFT times its value, and the output takes v_descale; O is 16-bit.
    Otherwise DESCALE is never read."""
    b, h, h_kv, pid_m = program_coordinates(num_heads_q, group_size, num_m_blocks, CAUSAL)
    P_SHIFT: tl.constexpr = FP8_P_SHIFT if FP8 else 0
    if FP8:
        descale = DESCALE + (b.to(tl.int64) * (num_heads_q // group_size) + h_kv) * 3
        if VARLEN:  # the sequence's own index
            descale = DESCALE + (tl.load(SEQUENCE_ORDER + b).to(tl.int64) * (num_heads_q // group_size) + h_kv) * 3
        scale_log2, softcap_scale = fp8_scores_scale(tl.load(descale) * tl.load(descale + 1), scale_log2,
                                                     softcap_scale)

    q_start, seqlen_q, k_start, seqlen_k = sequence_bounds(CU_SEQLENS_Q, CU_SEQLENS_K, SEQUENCE_ORDER, b, seqlen_q,
                                                           seqlen_k, total_q, total_k, VARLEN)
    if VARLEN:
        if pid_m * BLOCK_M >= seqlen_q:
            return

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    b64 = b.to(tl.int64)
    q_rows = (q_start + offs_m[:, None]).to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + q_rows * stride_qm + offs_d[None, :]
    kv_rows = (k_start + offs_n[:, None]).to(tl.int64)
    k_ptrs = K + b64 * stride_kb + h_kv.to(tl.int64) * stride_kh + kv_rows * stride_kn + offs_d[None, :]
    v_ptrs = V + b64 * stride_vb + h_kv.to(tl.int64) * stride_vh + kv_rows * stride_vn + offs_dv[None, :]

    q = load_tile(q_ptrs, offs_m, seqlen_q, offs_d, HEAD_DIM, BLOCK_D, True)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    diag_lo, diag_hi, lo, full_lo, full_hi, hi = visible_band(pid_m, seqlen_q, seqlen_k, window_left, window_right,
                                                               BLOCK_M, BLOCK_N)
    for start_n in range(lo, tl.minimum(full_lo, hi), BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, offs_dv,
                                      seqlen_k, diag_lo, diag_hi, scale_log2, softcap_scale, softcap_log2,
                                      stride_kn, stride_vn, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, BOTH_EDGES,
                                      SOFTCAP, DOT_PRECISION, P_SHIFT)
    for start_n in range(full_lo, full_hi, BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, offs_dv,
                                      seqlen_k, diag_lo, diag_hi, scale_log2, softcap_scale, softcap_log2,
                                      stride_kn, stride_vn, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, NO_EDGE, SOFTCAP,
                                      DOT_PRECISION, P_SHIFT)
    for start_n in range(full_hi, hi, BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, offs_dv,
                                      seqlen_k, diag_lo, diag_hi, scale_log2, softcap_scale, softcap_log2,
                                      stride_kn, stride_vn, HEAD_DIM, BLOCK_D, HEAD_DIM_V, BLOCK_DV, RIGHT_EDGE,
                                      SOFTCAP, DOT_PRECISION, P_SHIFT)

    out, lse = finish(acc, l_i, m_i - P_SHIFT)
    if FP8:
        out = out * tl.load(descale + 2)
    o_ptrs = O + b64 * stride_ob + h.to(tl.int64) * stride_oh + q_rows * stride_om + offs_dv[None, :]
    row_mask = offs_m[:, None] < seqlen_q
    if BLOCK_DV != HEAD_DIM_V:
        row_mask = row_mask & (offs_dv[None, :] < HEAD_DIM_V)
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_mask)
    if WRITE_LSE:
        lse_ptrs = LSE + b64 * stride_lb + h.to(tl.int64) * stride_lh + (q_start + offs_m).to(tl.int64)
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)
