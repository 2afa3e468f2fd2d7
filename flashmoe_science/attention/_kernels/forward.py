"""Attention forward: one program computes BLOCK_M query rows of one (batch, head) pair.

The online softmax of FlashAttention-2 in base 2: scores are scaled by softmax_scale*log2(e)
so every exponential is an exp2, the running row maximum `m` and row sum `l` rescale the
accumulator when the maximum grows, and nothing of size Sq x Sk is ever stored.

The key loop is split in two. Key blocks that every row of the program fully sees (below the
causal diagonal and inside Sk) run without any mask; only the blocks that straddle the diagonal
or the end of the keys pay for masking. Causal alignment is bottom-right: query i sees keys
j <= i + (Sk - Sq), as flash-attn >= 2.1 and decoding need.
"""
import triton
import triton.language as tl


@triton.jit
def _attend_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d, seqlen_k, diagonal,
                  scale_log2, stride_kn, stride_vn,
                  HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, MASKED: tl.constexpr, CAUSAL: tl.constexpr):
    cols = start_n + offs_n
    if MASKED:
        in_k = cols < seqlen_k
        if BLOCK_D != HEAD_DIM:
            kv_mask = in_k[:, None] & (offs_d[None, :] < HEAD_DIM)
        else:
            kv_mask = in_k[:, None]
        k = tl.load(k_ptrs + start_n * stride_kn, mask=kv_mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        k = tl.load(k_ptrs + start_n * stride_kn, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        k = tl.load(k_ptrs + start_n * stride_kn)
    s = tl.dot(q, tl.trans(k)) * scale_log2
    if MASKED:
        visible = in_k[None, :]
        if CAUSAL:
            visible = visible & (cols[None, :] <= offs_m[:, None] + diagonal)
        s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKED:
        # A row that has seen no key yet keeps m = -inf; subtracting 0 instead keeps exp2 at 0, not NaN.
        m_sub = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_sub = m_new
    p = tl.math.exp2(s - m_sub[:, None])
    alpha = tl.math.exp2(m_i - m_sub)
    l_i = l_i * alpha + tl.sum(p, 1)
    if MASKED:
        v = tl.load(v_ptrs + start_n * stride_vn, mask=kv_mask, other=0.0)
    elif BLOCK_D != HEAD_DIM:
        v = tl.load(v_ptrs + start_n * stride_vn, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    else:
        v = tl.load(v_ptrs + start_n * stride_vn)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i, m_new


@triton.jit
def attention_forward_kernel(
    Q, K, V, O, LSE,
    scale_log2,
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    num_heads_q, group_size, seqlen_q, seqlen_k, num_m_blocks,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    # A 1-D grid, query blocks of one head adjacent so that they share K/V in L2. Causal blocks
    # run heaviest first (the last query block sees the most keys), which shortens the tail.
    pid = tl.program_id(0)
    pid_bh = pid // num_m_blocks
    pid_m = pid % num_m_blocks
    if CAUSAL:
        pid_m = num_m_blocks - 1 - pid_m
    b = pid_bh // num_heads_q
    h = pid_bh % num_heads_q
    h_kv = h // group_size

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    b64 = b.to(tl.int64)
    q_ptrs = Q + b64 * stride_qb + h.to(tl.int64) * stride_qh + offs_m[:, None].to(tl.int64) * stride_qm + offs_d[None, :]
    kv_row = offs_n[:, None].to(tl.int64)
    k_ptrs = K + b64 * stride_kb + h_kv.to(tl.int64) * stride_kh + kv_row * stride_kn + offs_d[None, :]
    v_ptrs = V + b64 * stride_vb + h_kv.to(tl.int64) * stride_vh + kv_row * stride_vn + offs_d[None, :]

    row_mask = offs_m[:, None] < seqlen_q
    if BLOCK_D != HEAD_DIM:
        row_mask = row_mask & (offs_d[None, :] < HEAD_DIM)
    q = tl.load(q_ptrs, mask=row_mask, other=0.0)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)

    diagonal = seqlen_k - seqlen_q
    if CAUSAL:
        # Keys this block's last row may see, and keys its first row sees (all rows see those).
        end_n = tl.minimum(seqlen_k, (pid_m + 1) * BLOCK_M + diagonal)
        full_n = tl.minimum(end_n, pid_m * BLOCK_M + diagonal + 1)
    else:
        end_n = seqlen_k
        full_n = seqlen_k
    full_n = tl.maximum(full_n, 0) // BLOCK_N * BLOCK_N

    for start_n in range(0, full_n, BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d,
                                      seqlen_k, diagonal, scale_log2, stride_kn, stride_vn,
                                      HEAD_DIM, BLOCK_D, False, CAUSAL)
    for start_n in range(full_n, end_n, BLOCK_N):
        acc, l_i, m_i = _attend_block(acc, l_i, m_i, q, k_ptrs, v_ptrs, start_n, offs_m, offs_n, offs_d,
                                      seqlen_k, diagonal, scale_log2, stride_kn, stride_vn,
                                      HEAD_DIM, BLOCK_D, True, CAUSAL)

    # Rows that saw no key (causal with Sk < Sq, or Sk = 0) have l = 0: output 0, lse -inf.
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    o_ptrs = O + b64 * stride_ob + h.to(tl.int64) * stride_oh + offs_m[:, None].to(tl.int64) * stride_om + offs_d[None, :]
    tl.store(o_ptrs, out.to(O.dtype.element_ty), mask=row_mask)
    if WRITE_LSE:
        # lse in natural log: (m + log2 l) * ln 2, with m in the base-2 scaled units of the loop.
        lse = (m_i + tl.math.log2(l_i)) * 0.6931471805599453
        tl.store(LSE + pid_bh.to(tl.int64) * seqlen_q + offs_m, lse, mask=offs_m < seqlen_q)
