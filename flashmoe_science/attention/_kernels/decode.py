"""Attention against a KV cache (decode and short queries): split-KV with GQA packing, over a
contiguous or a paged cache.

- `attention_decode_split_kernel`: one program per (key split, batch entry and KV head, row
  block). The rows of its tile are the Sq x group query rows that share the KV head (row r is
  query position r // group of query head kv_head * group + r % group), so each K and V tile is
  read once for the whole group. It walks the keys of its split that the rows' band reaches, with
  `forward.softmax_step`'s base-2 online softmax (each row masked by its own query position's
  band, and by the sequence's length), and writes its normalised partial output and lse.
- `attention_decode_combine_kernel`: per row, the splits' partials weighted by exp(lse_s - lse),
  written in the output's dtype and layout, with the total lse. With one split there is nothing
  to combine: the split kernel writes the output itself (SINGLE).
- `kv_cache_append_kernel`: writes new keys and values into the cache at each sequence's
  position `cache_seqlens[b] + t`, before the attention reads them.

On Hopper the combine kernel launches as a programmatic dependent of the split kernel (PDL):
each split program lets it launch as soon as the program starts (`gdc_launch_dependents`), and
its programs wait (`gdc_wait`) for the whole split grid and its memory before they read, so the
combine's launch and start pass under the split kernel. (Split kernels launched so after one
another, one split each, measured 3-9% slower in CUDA graphs at B 32-64, Sk 1k: they stay
ordinary launches.)

An FP8 (e4m3) cache is read with q's dtype: each K and V tile is converted as it loads, times its
descales (SCALES): one per (sequence, KV head), folded into the score scale and the output, or
one per cached token and KV head (K_SCALE, V_SCALE laid out as the cache without its head dim),
applied to the tile's rows. Appending quantises the new values: with the sequence's descale, or
with a descale of its own per token and head (its largest magnitude to e4m3's 448), written
beside it.

A paged cache (PAGE_SIZE > 0) holds a sequence's key t in page `block_table[b, t // PAGE_SIZE]`,
slot t % PAGE_SIZE; each key's page is looked up as its block loads, or, where key blocks fall on
page bounds (ALIGNED_PAGES), each block's pages a block ahead. Keys past a sequence's length
load as zeros (the cache beyond it may hold anything). A cache length out of [0, max_seqlen_k -
new tokens] or a visible key's page id out of [0, num_pages) is malformed input that no host
check saw (they are device values): such a sequence's outputs and lse become NaN, and nothing is
read or written outside the cache.
"""
import triton
import triton.language as tl

from ...dependent_launch import gdc_launch_dependents, gdc_wait
from ...float8 import to_e4m3
from .forward import BOTH_EDGES, TF32, band_diagonals, finish, fp8_scores_scale, softmax_step

# How an FP8 cache's values are scaled (SCALES): not at all (a 16-bit or fp32 cache), by one
# descale per (sequence, KV head), or by one per cached token and KV head.
NO_SCALES = tl.constexpr(0)
HEAD_SCALES = tl.constexpr(1)
TOKEN_SCALES = tl.constexpr(2)
FP8_MAX = tl.constexpr(448.0)
MIN_TOKEN_SCALE = tl.constexpr(1e-12)  # a token of zeros quantises to zeros, never 0 / 0


@triton.jit
def _cached_length(CACHE_SEQLENS, b, cache_len, seqlen_new, max_seqlen_k, LENGTHS_TENSOR: tl.constexpr):
    """(tokens already in sequence b's cache, whether that length leaves room in the cache for the
    new tokens: a length outside [0, max_seqlen_k - seqlen_new] is malformed)."""
    if LENGTHS_TENSOR:
        cached = tl.load(CACHE_SEQLENS + b)
    else:
        cached = cache_len
    return cached, (cached >= 0) & (cached <= max_seqlen_k - seqlen_new)


@triton.jit
def _block_pages(TABLE_ROW, start, seqlen, offs_n, PAGE_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """The page id of each key of the block starting at `start` (a multiple of BLOCK_N; 0 past
    `seqlen`): one load for the block when it lies in one page."""
    if PAGE_SIZE >= BLOCK_N:
        return tl.load(TABLE_ROW + start // PAGE_SIZE, mask=start < seqlen, other=0) + tl.zeros([BLOCK_N], tl.int32)
    else:
        return tl.load(TABLE_ROW + (start // PAGE_SIZE + offs_n // PAGE_SIZE), mask=start + offs_n < seqlen, other=0)


# cache_len (an int cache_seqlens) changes from call to call under one launch key, and has_leftpad
# (0 or 1) is a runtime flag: never specialised.
@triton.jit(do_not_specialize=["cache_len", "has_leftpad"])
def attention_decode_split_kernel(
    Q, K, V, O_PART, LSE_PART, OUT, LSE, CACHE_SEQLENS, CACHE_LEFTPAD, BLOCK_TABLE, K_SCALE, V_SCALE,
    scale_log2, softcap_scale, softcap_log2,
    stride_qb, stride_qm, stride_qh,
    stride_kb, stride_kn, stride_kh,
    stride_vb, stride_vn, stride_vh,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    stride_tb,
    stride_sb, stride_sn, stride_sh,
    num_heads_kv, group_size, seqlen_q, seqlen_new, cache_len, has_leftpad, max_seqlen_k, num_pages, rows,
    rows_padded, split_len, num_splits, window_left, window_right,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr, SOFTCAP: tl.constexpr, LENGTHS_TENSOR: tl.constexpr, SINGLE: tl.constexpr,
    WRITE_LSE: tl.constexpr, SCALES: tl.constexpr = NO_SCALES, PDL: tl.constexpr = False,
    ALIGNED_PAGES: tl.constexpr = False, DOT_PRECISION: tl.constexpr = TF32,
):
    """K, V strides: (batch, token, head) of a contiguous cache, (page, slot, head) of a paged one.
    O_PART (num_splits, B, Hkv, rows_padded, BLOCK_D) and LSE_PART (num_splits, B, Hkv,
    rows_padded), fp32, contiguous. SINGLE (one split: no combine kernel): the output goes straight
    to OUT (B, Sq, Hq, D), in its dtype and strides, and lse to LSE (B, Hq, Sq) when WRITE_LSE.
    has_leftpad: sequence b starts at cache position CACHE_LEFTPAD[b] (its earlier slots are
    padding); the program works in positions relative to that start, so causality and windows
    are as for a sequence of cached + new - leftpad tokens. SCALES (module docstring): K_SCALE and
    V_SCALE (batch, heads_kv) with strides (stride_sb, -, stride_sh), or laid out as the cache
    without its head dim, strides (stride_sb, stride_sn, stride_sh); else never read. PDL: the
    combine kernel follows as a programmatic dependent (module docstring). ALIGNED_PAGES (a paged
    cache without leftpad, PAGE_SIZE a multiple of BLOCK_N or a divisor of it): key blocks start at
    multiples of BLOCK_N, so a block's slots are known at compile time, a block within one page
    takes one page id for all its keys, and each block's page ids are loaded a block ahead."""
    if PDL and not SINGLE:
        gdc_launch_dependents()
    pid_s = tl.program_id(0)
    pid_bh = tl.program_id(1)
    pid_m = tl.program_id(2)
    b = pid_bh // num_heads_kv
    h_kv = pid_bh % num_heads_kv
    b64 = b.to(tl.int64)
    cached, fits = _cached_length(CACHE_SEQLENS, b, cache_len, seqlen_new, max_seqlen_k, LENGTHS_TENSOR)
    leftpad = tl.load(CACHE_LEFTPAD + b, mask=has_leftpad != 0, other=0)
    bad = ~fits | (leftpad < 0) | (leftpad > cached)
    seqlen_abs = tl.minimum(tl.maximum(cached, 0) + seqlen_new, max_seqlen_k)
    leftpad = tl.minimum(tl.maximum(leftpad, 0), seqlen_abs)
    seqlen_k = seqlen_abs - leftpad  # keys from here on are positions relative to the start
    diag_lo, diag_hi = band_diagonals(seqlen_q, seqlen_k, window_left, window_right)

    offs_r = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    row_ok = offs_r < rows
    qi = offs_r // group_size  # query position of each row
    h = h_kv * group_size + offs_r % group_size
    if SCALES == HEAD_SCALES:  # k's descale on the scores, v's on the output
        scale_log2, softcap_scale = fp8_scores_scale(tl.load(K_SCALE + b64 * stride_sb + h_kv * stride_sh),
                                                     scale_log2, softcap_scale)
    q = tl.load(Q + b64 * stride_qb + qi.to(tl.int64)[:, None] * stride_qm + h.to(tl.int64)[:, None] * stride_qh
                + offs_d[None, :], mask=row_ok[:, None] & d_ok[None, :], other=0.0)

    # The keys of this split that some row of the tile sees: the first row's band start to the
    # last row's band end (rows past `rows` repeat the last query position).
    first_q = (pid_m * BLOCK_M) // group_size
    last_q = tl.minimum(pid_m * BLOCK_M + BLOCK_M - 1, rows - 1) // group_size
    start = pid_s * split_len
    end = tl.minimum(start + split_len, seqlen_k)
    lo = tl.maximum(start, first_q + diag_lo)
    lo = start + tl.maximum(lo - start, 0) // BLOCK_N * BLOCK_N
    hi = tl.minimum(end, last_q + diag_hi + 1)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    bad_page = tl.zeros([BLOCK_N], dtype=tl.int32)
    kv_head_k = h_kv.to(tl.int64) * stride_kh
    kv_head_v = h_kv.to(tl.int64) * stride_vh
    table_row = BLOCK_TABLE + b64 * stride_tb  # sequence b's page ids (paged caches)
    if ALIGNED_PAGES:  # page ids a block ahead of their keys, so that both pipeline
        next_page = _block_pages(table_row, lo, seqlen_abs, offs_n, PAGE_SIZE, BLOCK_N)
    for start_n in range(lo, hi, BLOCK_N):
        keys = (leftpad + start_n) + offs_n  # cache positions
        key_ok = keys < seqlen_abs
        if PAGE_SIZE > 0:
            if ALIGNED_PAGES:
                page = next_page
                next_page = _block_pages(table_row, start_n + BLOCK_N, seqlen_abs, offs_n, PAGE_SIZE, BLOCK_N)
                if PAGE_SIZE >= BLOCK_N:
                    slot = (start_n % PAGE_SIZE + offs_n).to(tl.int64)
                else:
                    slot = (offs_n % PAGE_SIZE).to(tl.int64)
            else:
                page = tl.load(table_row + keys // PAGE_SIZE, mask=key_ok, other=0)
                slot = (keys % PAGE_SIZE).to(tl.int64)
            page_ok = (page >= 0) & (page < num_pages)
            bad_page = tl.maximum(bad_page, (key_ok & ~page_ok).to(tl.int32))
            key_ok = key_ok & page_ok
            page64 = tl.where(page_ok, page, 0).to(tl.int64)
            k_rows = page64 * stride_kb + slot * stride_kn
            v_rows = page64 * stride_vb + slot * stride_vn
        else:
            k_rows = b64 * stride_kb + keys.to(tl.int64) * stride_kn
            v_rows = b64 * stride_vb + keys.to(tl.int64) * stride_vn
        mask = key_ok[:, None] & d_ok[None, :]
        k = tl.load(K + k_rows[:, None] + kv_head_k + offs_d[None, :], mask=mask, other=0.0)
        v = tl.load(V + v_rows[:, None] + kv_head_v + offs_d[None, :], mask=mask, other=0.0)
        if SCALES == TOKEN_SCALES:
            if PAGE_SIZE > 0:
                s_rows = page64 * stride_sb + slot * stride_sn + h_kv * stride_sh
            else:
                s_rows = b64 * stride_sb + keys.to(tl.int64) * stride_sn + h_kv * stride_sh
            # in q's dtype: e4m3 values times a descale lose nothing worth a register more in 16 bits
            k_descale = tl.load(K_SCALE + s_rows, mask=key_ok, other=0.0).to(Q.dtype.element_ty)
            v_descale = tl.load(V_SCALE + s_rows, mask=key_ok, other=0.0).to(Q.dtype.element_ty)
            k = k.to(Q.dtype.element_ty) * k_descale[:, None]
            v = v.to(Q.dtype.element_ty) * v_descale[:, None]
        k = k.to(Q.dtype.element_ty)
        v = v.to(Q.dtype.element_ty)
        qk = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, qi, start_n, offs_n, seqlen_k, diag_lo, diag_hi,
                                     scale_log2, softcap_scale, softcap_log2, BOTH_EDGES, SOFTCAP, DOT_PRECISION)
    out, lse = finish(acc, l_i, m_i)
    if SCALES == HEAD_SCALES:
        out = out * tl.load(V_SCALE + b64 * stride_sb + h_kv * stride_sh)
    malformed = bad | (tl.max(bad_page, 0) > 0)
    out = tl.where(malformed, float("nan"), out)
    lse = tl.where(malformed, float("nan"), lse)
    if SINGLE:
        tl.store(OUT + b64 * stride_ob + qi.to(tl.int64)[:, None] * stride_om + h.to(tl.int64)[:, None] * stride_oh
                 + offs_d[None, :], out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
        if WRITE_LSE:
            tl.store(LSE + b64 * stride_lb + h.to(tl.int64) * stride_lh + qi, lse, mask=row_ok)
    else:
        part = (pid_s * tl.num_programs(1) + pid_bh).to(tl.int64) * rows_padded + offs_r
        tl.store(O_PART + part[:, None] * BLOCK_D + offs_d[None, :], out)
        tl.store(LSE_PART + part, lse)


@triton.jit
def attention_decode_combine_kernel(
    O_PART, LSE_PART, OUT, LSE,
    stride_ob, stride_om, stride_oh,
    stride_lb, stride_lh,
    num_heads_kv, group_size, rows_padded, num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr, WRITE_LSE: tl.constexpr,
    PDL: tl.constexpr = False,
):
    """One program per row (batch entry and KV head, row): its splits' partials, BLOCK_S splits a
    load, weighted by exp(lse_s - max lse). OUT (B, Sq, Hq, D) in its own dtype and strides; LSE
    (B, Hq, Sq) fp32 when WRITE_LSE. A row no split saw gets 0 and lse -inf; a NaN partial
    (malformed input) makes its row NaN. PDL: launched as a programmatic dependent of the split
    kernel (module docstring)."""
    if PDL:
        gdc_wait()
    pid_bh = tl.program_id(0)
    r = tl.program_id(1)
    b = pid_bh // num_heads_kv
    h_kv = pid_bh % num_heads_kv
    offs_s = tl.arange(0, BLOCK_S)
    offs_d = tl.arange(0, BLOCK_D)
    row = pid_bh.to(tl.int64) * rows_padded + r
    split_stride = tl.num_programs(0).to(tl.int64) * rows_padded  # rows between one split's partials and the next's
    m = tl.full([BLOCK_S], float("-inf"), dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + offs_s
        m = tl.maximum(m, tl.load(LSE_PART + s * split_stride + row, mask=s < num_splits, other=float("-inf")))
    m_max = tl.max(m, 0)
    m_sub = tl.where(m_max == float("-inf"), 0.0, m_max)
    total = tl.zeros([BLOCK_S], dtype=tl.float32)
    acc = tl.zeros([BLOCK_S, BLOCK_D], dtype=tl.float32)
    for s0 in range(0, num_splits, BLOCK_S):
        s = s0 + offs_s
        ok = s < num_splits
        part = s * split_stride + row
        w = tl.exp(tl.load(LSE_PART + part, mask=ok, other=float("-inf")) - m_sub)
        total += w
        acc += w[:, None] * tl.load(O_PART + part[:, None] * BLOCK_D + offs_d[None, :], mask=ok[:, None], other=0.0)
    total_sum = tl.sum(total, 0)
    out = tl.where(total_sum == 0.0, 0.0, tl.sum(acc, 0) / tl.where(total_sum == 0.0, 1.0, total_sum))
    qi = r // group_size
    h = (h_kv * group_size + r % group_size).to(tl.int64)
    tl.store(OUT + b.to(tl.int64) * stride_ob + qi.to(tl.int64) * stride_om + h * stride_oh + offs_d,
             out.to(OUT.dtype.element_ty), mask=offs_d < HEAD_DIM)
    if WRITE_LSE:
        lse = tl.where(total_sum == 0.0, float("-inf"), m_sub + tl.log(tl.where(total_sum == 0.0, 1.0, total_sum)))
        tl.store(LSE + b.to(tl.int64) * stride_lb + h * stride_lh + qi, lse)


@triton.jit(do_not_specialize=["cache_len"])
def kv_cache_append_kernel(
    NEW, CACHE, CACHE_SEQLENS, BLOCK_TABLE, SCALE,
    stride_nb, stride_nm, stride_nh,
    stride_cb, stride_cn, stride_ch,
    stride_tb,
    stride_sb, stride_sn, stride_sh,
    seqlen_new, cache_len, max_seqlen_k, num_pages,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, PAGE_SIZE: tl.constexpr, LENGTHS_TENSOR: tl.constexpr,
    SCALES: tl.constexpr = NO_SCALES,
):
    """NEW (B, Sq_new, Hkv, D) into CACHE at token cache_seqlens[b] + t of each sequence; one
    program per (batch entry and new token, KV head). Positions outside the cache, or in pages out
    of range, are not written (the attention kernel turns such a sequence's outputs into NaN).
    An FP8 CACHE (SCALES, as the split kernel's) gets the values divided by the sequence's
    descale, saturated to +-448 (HEAD_SCALES), or by a descale of the token's own, its largest
    magnitude over 448, written to SCALE beside it (TOKEN_SCALES); rounded to nearest even. NaN or
    infinite values are stored as NaN (e4m3 has no infinity), never as a finite value."""
    pid = tl.program_id(0)
    h = tl.program_id(1).to(tl.int64)
    b = pid // seqlen_new
    t = pid % seqlen_new
    cached, ok = _cached_length(CACHE_SEQLENS, b, cache_len, seqlen_new, max_seqlen_k, LENGTHS_TENSOR)
    pos = cached + t
    if PAGE_SIZE > 0:
        page = tl.load(BLOCK_TABLE + b.to(tl.int64) * stride_tb + pos // PAGE_SIZE, mask=ok, other=0)
        ok = ok & (page >= 0) & (page < num_pages)
        row = tl.where(ok, page, 0).to(tl.int64) * stride_cb + (pos % PAGE_SIZE).to(tl.int64) * stride_cn
    else:
        row = b.to(tl.int64) * stride_cb + tl.where(ok, pos, 0).to(tl.int64) * stride_cn
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < HEAD_DIM
    value = tl.load(NEW + b.to(tl.int64) * stride_nb + t.to(tl.int64) * stride_nm + h * stride_nh + offs_d, mask=d_ok)
    if SCALES != NO_SCALES:
        value = value.to(tl.float32)
        if SCALES == HEAD_SCALES:
            descale = tl.load(SCALE + b.to(tl.int64) * stride_sb + h * stride_sh)
        else:
            descale = tl.maximum(tl.max(tl.abs(tl.where(d_ok, value, 0.0)), 0) / FP8_MAX, MIN_TOKEN_SCALE)
            if PAGE_SIZE > 0:
                scale_row = tl.where(ok, page, 0).to(tl.int64) * stride_sb + (pos % PAGE_SIZE).to(tl.int64) * stride_sn
            else:
                scale_row = b.to(tl.int64) * stride_sb + tl.where(ok, pos, 0).to(tl.int64) * stride_sn
            tl.store(SCALE + scale_row + h * stride_sh, descale, mask=ok)
        value = value / descale
        # finite values beyond e4m3's range saturate; NaN and +-inf (which e4m3 lacks) become NaN
        value = to_e4m3(tl.where(tl.abs(value) < float("inf"), tl.minimum(tl.maximum(value, -FP8_MAX), FP8_MAX),
                                 float("nan")))
    tl.store(CACHE + row + h * stride_ch + offs_d, value.to(CACHE.dtype.element_ty), mask=d_ok & ok)
