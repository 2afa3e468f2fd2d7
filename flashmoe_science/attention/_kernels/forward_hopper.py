"""Attention forward for Hopper (sm90): the same algorithm as `forward.py`, with the tiles moved
by the tensor memory accelerator (TMA) and the main loop warp-specialised.

Q, K, V and O are addressed through 4-D tensor descriptors over (batch, head, seq, head_dim) with
the caller's strides, so (B, S, H, D).transpose(1, 2) views need no copy. A descriptor load
fills rows past the end of the sequence, and columns past head_dim, with zeros; a descriptor
store drops them. So no load or store carries a mask: only scores on the band's edges are
masked, exactly as in the generic kernel. The dispatcher takes it where the Gluon kernel
(`forward_gluon.py`) has no build: softcap, and head dim 64 causal calls of fewer keys.
"""
import triton
import triton.language as tl

from .forward import BOTH_EDGES, NO_EDGE, RIGHT_EDGE, finish, program_coordinates, softmax_step, visible_band


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, desc_k, desc_v, b, h_kv, lo, hi, offs_m, offs_n, seqlen_k, diag_lo, diag_hi,
                  scale_log2, softcap_scale, softcap_log2, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_DV: tl.constexpr, MASKED: tl.constexpr, SOFTCAP: tl.constexpr):
    for start_n in tl.range(lo, hi, BLOCK_N):
        k = desc_k.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, BLOCK_D)
        v = desc_v.load([b, h_kv, start_n, 0]).reshape(BLOCK_N, BLOCK_DV)
        qk = tl.dot(q, tl.trans(k))
        acc, l_i, m_i = softmax_step(acc, l_i, m_i, qk, v, offs_m, start_n, offs_n, seqlen_k, diag_lo, diag_hi,
                                     scale_log2, softcap_scale, softcap_log2, MASKED, SOFTCAP)
    return acc, l_i, m_i


@triton.jit
def attention_forward_hopper_kernel(
    desc_q, desc_k, desc_v, desc_o, LSE,
    scale_log2, softcap_scale, softcap_log2,
    stride_lb, stride_lh,
    num_heads_q, group_size, seqlen_q, seqlen_k, num_m_blocks, window_left, window_right,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    """desc_q, desc_k: tiles of BLOCK_D columns; desc_v, desc_o: BLOCK_DV (v's head dim, padded)."""
    b, h, h_kv, pid_m = program_coordinates(num_heads_q, group_size, num_m_blocks, CAUSAL)

    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    q = desc_q.load([b, h, pid_m * BLOCK_M, 0]).reshape(BLOCK_M, BLOCK_D)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)

    diag_lo, diag_hi, lo, full_lo, full_hi, hi = visible_band(pid_m, seqlen_q, seqlen_k, window_left, window_right,
                                                               BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, desc_k, desc_v, b, h_kv, lo, tl.minimum(full_lo, hi), offs_m,
                                  offs_n, seqlen_k, diag_lo, diag_hi, scale_log2, softcap_scale, softcap_log2,
                                  BLOCK_N, BLOCK_D, BLOCK_DV, BOTH_EDGES, SOFTCAP)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, desc_k, desc_v, b, h_kv, full_lo, full_hi, offs_m, offs_n,
                                  seqlen_k, diag_lo, diag_hi, scale_log2, softcap_scale, softcap_log2,
                                  BLOCK_N, BLOCK_D, BLOCK_DV, NO_EDGE, SOFTCAP)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, desc_k, desc_v, b, h_kv, full_hi, hi, offs_m, offs_n,
                                  seqlen_k, diag_lo, diag_hi, scale_log2, softcap_scale, softcap_log2,
                                  BLOCK_N, BLOCK_D, BLOCK_DV, RIGHT_EDGE, SOFTCAP)

    out, lse = finish(acc, l_i, m_i)
    desc_o.store([b, h, pid_m * BLOCK_M, 0], out.to(desc_o.dtype).reshape(1, 1, BLOCK_M, BLOCK_DV))
    if WRITE_LSE:
        lse_ptrs = LSE + b.to(tl.int64) * stride_lb + h.to(tl.int64) * stride_lh + offs_m
        tl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)
