"""Attention forward for Hopper (sm90) in Gluon: FlashAttention-3's warp specialisation and
intra-warpgroup pipeline.

Triton 3.6 waits on each `tl.dot` wgmma right after issuing it, so in the Triton kernels the
exponentials of one key block never run while the tensor cores work. Gluon, Triton's lower-level
dialect, exposes the asynchronous wgmma and its wait, and splits a program's warps into
partitions that run different code (Shah et al. 2024, FlashAttention-3):

- A producer warp issues every TMA copy: Q once, then K and V tiles into NUM_STAGES buffers,
  each with a `ready` mbarrier (the copy has landed) and an `empty` one (every consumer is done
  with it). It runs ahead of the consumers by as many buffers as there are.
- Two or three consumer warpgroups hold BLOCK_M = 64 query rows each and share every K and V
  tile, so each tile is loaded once for all their rows. Each runs algorithm 2 of the paper:
  iteration j issues S_j = Q K_j^T, then O += P_{j-1} V_{j-1}, waits for S_j alone and computes
  its softmax while the P V product is still running on the tensor cores; only then does it
  wait for O and rescale it. The consumers are not synchronised with each other: while one
  computes exponentials, another's products occupy the tensor cores.
- The producer's warpgroup gives its registers to the consumers (`setmaxnreg`): 240 a thread
  each for two consumers, 160 for three.
- Persistent (PERSISTENT): one program per SM takes tile after tile (`_schedule`), its
  partitions counting buffer uses across tiles, so the producer copies the next tile's first K
  block, Q and V while the consumers finish one. Causal calls skip, per consumer, the key
  blocks its rows never see. Otherwise one program per tile, in `_tile_coordinates`' order.

Q, K, V and O are addressed through 4-D (batch, head, seq, head_dim) descriptors with the
caller's strides; loads past the end are zero-filled and stores past it dropped, so only scores
on the band's edges are masked, exactly as in `forward.py` (whose module docstring describes the
band and the base-2 online softmax).
"""
from triton.experimental import gluon
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.language.nvidia.hopper import (fence_async_shared, mbarrier, tma, warpgroup_mma,
                                                              warpgroup_mma_wait)

from .forward import BOTH_EDGES, FP8_P_SHIFT, NO_EDGE, RIGHT_EDGE, band_blocks, band_diagonals, fp8_scores_scale

# FP8: up to this head dim, P is carried between iterations in fp16 rather than fp32 (32 registers
# a thread fewer: no spills with three consumers). One H200, S = 16384 non-causal
# (benchmarks/results/attention_fp8_p_carry/): D = 64 470 -> 551 TFLOP/s with two consumers, 615
# with three; D = 128 827 -> 808 and D = 256 1006 -> 965, where fp32 stays.
FP8_P16_CARRY_MAX_D = gl.constexpr(64)


@gluon.jit
def _softmax(s, m_i, l_i, offs_m, start_n, offs_n, seqlen_k, diag_lo, diag_hi, scale_log2, EDGES: gl.constexpr,
             ROW_BOUNDS: gl.constexpr, P_SHIFT: gl.constexpr):
    """One key block of the online softmax in base 2 (as `forward.softmax_step`): returns the
    probabilities p, the new row sums and maxima, and alpha, the factor that rescales O. Masked
    blocks (EDGES) compare each score's key with its row's bounds (ROW_BOUNDS, as
    `forward.band_edge_mask`) or its diagonal with the band's (fewer registers a thread); unmasked
    ones skip the compares. P_SHIFT: p is 2^P_SHIFT times the probabilities (FP8, as
    `forward.softmax_step`)."""
    if EDGES != NO_EDGE:
        if ROW_BOUNDS:
            visible = offs_n[None, :] < (gl.minimum(offs_m + (diag_hi + 1), seqlen_k) - start_n)[:, None]
            if EDGES == BOTH_EDGES:
                visible = visible & (offs_n[None, :] >= (offs_m + diag_lo - start_n)[:, None])
        else:
            cols = start_n + offs_n
            rel = cols[None, :] - offs_m[:, None]
            visible = (cols[None, :] < seqlen_k) & (rel <= diag_hi) & (rel >= diag_lo)
        s = gl.where(visible, s, float("-inf"))
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
        m_sub = gl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet keeps p = 0
    else:
        m_new = gl.maximum(m_i, gl.max(s, 1) * scale_log2)
        m_sub = m_new
    if P_SHIFT != 0:
        p = gl.exp2(s * scale_log2 - (m_sub - P_SHIFT)[:, None])
    else:
        p = gl.exp2(s * scale_log2 - m_sub[:, None])
    alpha = gl.exp2(m_i - m_sub)
    l_i = l_i * alpha + gl.sum(p, 1)
    return p, l_i, m_new, alpha


@gluon.jit
def _softmax_block(s, m_i, l_i, offs_m, offs_n, start_n, full_lo, full_hi, seqlen_k, diag_lo, diag_hi, scale_log2,
                   ROW_BOUNDS: gl.constexpr, P_SHIFT: gl.constexpr):
    """`_softmax` of the key block at start_n: masked on the band's edges, plain in [full_lo, full_hi).
    With ROW_BOUNDS, blocks right of the left edge compare with the right bound alone. Without
    (`_consume_tile` sets it for two consumers up to D = 128), one masked copy of the softmax
    takes both edges by diagonal: in the three-consumer builds (160 registers a thread) per-row
    bounds made ptxas spill 132 bytes a thread, and a third copy in the loop 524, where the
    diagonal compare spills none; at D = 256 per-row bounds spilled 20."""
    if ROW_BOUNDS:
        if start_n >= full_hi:
            p, l_i, m_i, alpha = _softmax(s, m_i, l_i, offs_m, start_n, offs_n, seqlen_k, diag_lo, diag_hi,
                                          scale_log2, RIGHT_EDGE, True, P_SHIFT)
        elif start_n < full_lo:
            p, l_i, m_i, alpha = _softmax(s, m_i, l_i, offs_m, start_n, offs_n, seqlen_k, diag_lo, diag_hi,
                                          scale_log2, BOTH_EDGES, True, P_SHIFT)
        else:
            p, l_i, m_i, alpha = _softmax(s, m_i, l_i, offs_m, start_n, offs_n, seqlen_k, diag_lo, diag_hi,
                                          scale_log2, NO_EDGE, True, P_SHIFT)
    elif (start_n < full_lo) | (start_n >= full_hi):
        p, l_i, m_i, alpha = _softmax(s, m_i, l_i, offs_m, start_n, offs_n, seqlen_k, diag_lo, diag_hi, scale_log2,
                                      BOTH_EDGES, False, P_SHIFT)
    else:
        p, l_i, m_i, alpha = _softmax(s, m_i, l_i, offs_m, start_n, offs_n, seqlen_k, diag_lo, diag_hi, scale_log2,
                                      NO_EDGE, False, P_SHIFT)
    return p, l_i, m_i, alpha


@gluon.jit
def _tile_coordinates(tile, num_heads_q, group_size, num_m_blocks, batch_heads, section, CAUSAL: gl.constexpr):
    """(batch, query head, its key/value head, query block) of tile `tile`. Tiles run in sections
    of `section` (batch, head) pairs whose K and V fit in L2 together; within a section the query
    block is the slow index, so the tiles in flight at once span the section's heads, and causal
    blocks run heaviest first (the last query block sees the most keys): a program that takes a
    light tile late fills the tail left by heavy ones (longest-processing-time-first order)."""
    per_section = section * num_m_blocks
    first_bh = tile // per_section * section
    heads = gl.minimum(section, batch_heads - first_bh)  # the last section may hold fewer
    rest = tile % per_section
    pid_m = rest // heads
    bh = first_bh + rest % heads
    if CAUSAL:
        pid_m = num_m_blocks - 1 - pid_m
    h = bh % num_heads_q
    return bh // num_heads_q, h, h // group_size, pid_m


@gluon.jit
def _tile_blocks(tile_row, seqlen_q, seqlen_k, diag_lo, diag_hi, ROWS: gl.constexpr, BLOCK_N: gl.constexpr):
    """(lo, number of key blocks) the tile's ROWS query rows from tile_row meet."""
    lo, _, _, hi = band_blocks(tile_row, seqlen_q, seqlen_k, diag_lo, diag_hi, ROWS, BLOCK_N)
    return lo, gl.cdiv(gl.maximum(hi - lo, 0), BLOCK_N)


@gluon.jit
def _scores(q, k, s_init, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr):
    """Issues S = Q K^T (q: (BLOCK_M, BLOCK_D), k: (BLOCK_N, BLOCK_D) in shared memory) without
    waiting. A head dim padded in the tiles (192 in 256 columns: MLA) is summed in 64-column
    slices up to the last that holds any of it, so the zero columns cost no product."""
    if HEAD_DIM == BLOCK_D:
        return warpgroup_mma(q, k.permute((1, 0)), s_init, use_acc=False, is_async=True)
    CHUNK: gl.constexpr = 64
    s_tok = warpgroup_mma(q.slice(0, CHUNK, 1), k.slice(0, CHUNK, 1).permute((1, 0)), s_init, use_acc=False,
                          is_async=True)
    for c in gl.static_range(1, (HEAD_DIM + CHUNK - 1) // CHUNK):
        s_tok = warpgroup_mma(q.slice(c * CHUNK, CHUNK, 1), k.slice(c * CHUNK, CHUNK, 1).permute((1, 0)), s_tok,
                              is_async=True)
    return s_tok


@gluon.jit
def _load_tile(desc, smem, bars, stage, b, h_kv, start_n, KEYS_LAST: gl.constexpr = False):
    """TMA copy of the K or V tile starting at key start_n into buffer `stage`; KEYS_LAST: of a
    (batch, head, head_dim, seq) tensor (FP8's V, transposed)."""
    mbarrier.expect(bars.index(stage), desc.block_type.nbytes)
    if KEYS_LAST:
        tma.async_copy_global_to_shared(desc, [b, h_kv, 0, start_n], bars.index(stage), smem.index(stage))
    else:
        tma.async_copy_global_to_shared(desc, [b, h_kv, start_n, 0], bars.index(stage), smem.index(stage))


@gluon.jit
def _load_q(desc_q, q_smem, q_ready, q_empty, b, h, tile_row, tile_iter, BLOCK_M: gl.constexpr,
            NUM_CONSUMERS: gl.constexpr):
    """Each consumer's Q rows of a tile, once the consumer is done with the previous tile's."""
    for c in gl.static_range(NUM_CONSUMERS):
        # A fresh mbarrier counts as having completed the phase before 0: the first wait is free.
        mbarrier.wait(q_empty.index(c), (tile_iter & 1) ^ 1)
        mbarrier.expect(q_ready.index(c), desc_q.block_type.nbytes)
        tma.async_copy_global_to_shared(desc_q, [b, h, tile_row + c * BLOCK_M, 0], q_ready.index(c), q_smem.index(c))


@gluon.jit
def _release(ready, empty, it, NUM_STAGES: gl.constexpr):
    """Give back buffer use `it` unread (a key block outside this consumer's rows' band). The
    wait keeps the arrivals in order: the buffer's previous use has been released by every
    consumer once this one's copy has landed."""
    mbarrier.wait(ready.index(it % NUM_STAGES), (it // NUM_STAGES) & 1)
    mbarrier.arrive(empty.index(it % NUM_STAGES), count=1)


@gluon.jit
def _schedule(rounds_done, num_tiles):
    """The tile a persistent program takes in round `rounds_done`: rounds of one tile per program
    go back and forth over the programs (program p takes tile p of the even rounds and the p-th
    from the end of the odd ones), so on causal tiles, ordered heaviest first, a program with a
    heavy tile in one round gets a light one in the next. Past the last tile: num_tiles or more."""
    pid = gl.program_id(0)
    programs = gl.num_programs(0)
    return rounds_done * programs + pid + (rounds_done & 1) * (programs - 1 - 2 * pid)


@gluon.jit
def _produce_tile(tile, it, tile_iter, desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                  k_empty, v_ready, v_empty, num_heads_q, group_size, seqlen_q, seqlen_k, num_m_blocks, batch_heads,
                  section, diag_lo, diag_hi, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                  NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, NUM_CONSUMERS: gl.constexpr, FP8: gl.constexpr):
    """Copies one tile's Q and K/V blocks in the consumers' order; `it` counts buffer uses across
    tiles, so the next tile's first blocks load while the consumers finish this one. Returns the
    count after this tile."""
    b, h, h_kv, pid_m = _tile_coordinates(tile, num_heads_q, group_size, num_m_blocks, batch_heads, section, CAUSAL)
    tile_row = pid_m * NUM_CONSUMERS * BLOCK_M
    lo, num_blocks = _tile_blocks(tile_row, seqlen_q, seqlen_k, diag_lo, diag_hi, NUM_CONSUMERS * BLOCK_M, BLOCK_N)
    for j in range(num_blocks):
        stage = (it + j) % NUM_STAGES
        phase = ((it + j) // NUM_STAGES) & 1
        mbarrier.wait(k_empty.index(stage), phase ^ 1)
        _load_tile(desc_k, k_smem, k_ready, stage, b, h_kv, lo + j * BLOCK_N)
        if j == 0:  # Q after the first K block: that copy is under way while Q's buffers free up
            _load_q(desc_q, q_smem, q_ready, q_empty, b, h, tile_row, tile_iter, BLOCK_M, NUM_CONSUMERS)
        mbarrier.wait(v_empty.index(stage), phase ^ 1)
        _load_tile(desc_v, v_smem, v_ready, stage, b, h_kv, lo + j * BLOCK_N, FP8)
    if num_blocks == 0:
        _load_q(desc_q, q_smem, q_ready, q_empty, b, h, tile_row, tile_iter, BLOCK_M, NUM_CONSUMERS)
    return it + num_blocks


@gluon.jit
def _producer(desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready, v_empty,
              num_heads_q, group_size, seqlen_q, seqlen_k, num_m_blocks, batch_heads, section, window_left,
              window_right, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, NUM_STAGES: gl.constexpr,
              CAUSAL: gl.constexpr, NUM_CONSUMERS: gl.constexpr, PERSISTENT: gl.constexpr, FP8: gl.constexpr):
    diag_lo, diag_hi = band_diagonals(seqlen_q, seqlen_k, window_left, window_right)
    if PERSISTENT:
        num_tiles = batch_heads * num_m_blocks
        it = 0
        for rounds_done in range(gl.cdiv(num_tiles, gl.num_programs(0))):
            tile = _schedule(rounds_done, num_tiles)
            if tile < num_tiles:
                it = _produce_tile(tile, it, rounds_done, desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready,
                                   q_empty, k_ready, k_empty, v_ready, v_empty, num_heads_q, group_size, seqlen_q,
                                   seqlen_k, num_m_blocks, batch_heads, section, diag_lo, diag_hi, BLOCK_M, BLOCK_N,
                                   NUM_STAGES, CAUSAL, NUM_CONSUMERS, FP8)
    else:
        _produce_tile(gl.program_id(0), 0, 0, desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty,
                      k_ready, k_empty, v_ready, v_empty, num_heads_q, group_size, seqlen_q, seqlen_k, num_m_blocks,
                      batch_heads, section, diag_lo, diag_hi, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, NUM_CONSUMERS,
                      FP8)


@gluon.jit
def _value_operand(v_smem, stage, BLOCK_N: gl.constexpr, BLOCK_DV: gl.constexpr, FP8: gl.constexpr):
    """The V tile of buffer `stage` as the P V product's (BLOCK_N, BLOCK_DV) operand. FP8 products
    read both operands K-major: FP8's V tiles are stored transposed and read through a permuted view."""
    if FP8:
        operand = v_smem.index(stage).reshape([BLOCK_DV, BLOCK_N]).permute((1, 0))
    else:
        operand = v_smem.index(stage).reshape([BLOCK_N, BLOCK_DV])
    return operand


@gluon.jit
def _p_operand(p32, dtype: gl.constexpr, p_layout: gl.constexpr, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
               FP8: gl.constexpr):
    """P as the P V product's register operand. 16-bit: each thread's accumulator values are
    already its operand values. FP8: an operand register holds four consecutive keys where the
    accumulator holds pairs 8 keys apart, so the keys are taken in the order the registers hold
    them (within each 16: key 8h + 2c + e is operand column 4c + 2h + e) and V's keys are stored
    in that order too (`fp8.fp8_value_tiles`): the conversion stays inside each thread. FP8's P is
    converted right where the product reads it, from probabilities carried across iterations in
    fp32 (fp16 up to FP8_P16_CARRY_MAX_D):
    Triton 3.6 holds a loop-carried 8-bit tensor a byte a register, and unpacked and repacked it
    every iteration (about 170 instructions; benchmarks/results/attention_fp8_p_conversion/)."""
    p = p32.to(dtype)
    if FP8:
        p = p.reshape([BLOCK_M, BLOCK_N // 16, 2, 4, 2]).permute((0, 1, 3, 2, 4)).reshape([BLOCK_M, BLOCK_N])
    return gl.convert_layout(p, p_layout)


@gluon.jit
def _wait_pv(o_tok, p, FP8: gl.constexpr):
    """(O, P) once the P V product is done. P, read from registers by the product, is one of the
    wait's dependencies, which keeps the compiler from reusing its registers before then; Triton
    3.6 cannot tie 8-bit registers to the wait, so FP8's P is left to ptxas, which tracks the
    registers of an asynchronous wgmma itself (it serialises the products where it cannot)."""
    if FP8:
        acc = warpgroup_mma_wait(0, deps=[o_tok])
    else:
        acc, p = warpgroup_mma_wait(0, deps=[o_tok, p])
    return acc, p


@gluon.jit
def _consume_tile(tile, it, tile_iter, desc_o, LSE, DESCALE, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready,
                  k_empty, v_ready, v_empty, scale_log2, stride_lb, stride_lh, num_heads_q, group_size, seqlen_q,
                  seqlen_k, num_m_blocks, batch_heads, section, diag_lo, diag_hi, C: gl.constexpr,
                  BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr,
                  BLOCK_DV: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr,
                  NUM_CONSUMERS: gl.constexpr, SEPARATE_O: gl.constexpr, FP8: gl.constexpr):
    """Consumer C's rows [C * BLOCK_M, (C + 1) * BLOCK_M) of one tile; `it` counts buffer uses
    across tiles (returned after this tile). It computes only the key blocks its own rows meet,
    gives the tile's others back unread, and releases each K and V buffer as soon as its own
    product has read it. FP8: descaled per (batch, KV head) from DESCALE, as
    `forward.attention_forward_kernel`."""
    gl.static_assert(BLOCK_M == 16 * gl.num_warps(), "each warp holds 16 query rows")
    INSTR_K: gl.constexpr = 32 if FP8 else 16  # a wgmma's K: 32 bytes of each operand row
    s_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, BLOCK_N, INSTR_K])
    o_layout: gl.constexpr = gl.NVMMADistributedLayout(version=[3, 0], warps_per_cta=[gl.num_warps(), 1],
                                                       instr_shape=[16, BLOCK_DV, INSTR_K])
    # P is an operand in registers: 32 bits of consecutive keys a thread, two 16-bit or four 8-bit.
    p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=o_layout, k_width=4 if FP8 else 2)
    rows_s: gl.constexpr = gl.SliceLayout(1, s_layout)
    cols_s: gl.constexpr = gl.SliceLayout(0, s_layout)
    rows_o: gl.constexpr = gl.SliceLayout(1, o_layout)
    dtype: gl.constexpr = q_smem.dtype  # the products' inputs, P's among them
    P_SHIFT: gl.constexpr = FP8_P_SHIFT if FP8 else 0
    P16_CARRY: gl.constexpr = FP8 and BLOCK_DV <= FP8_P16_CARRY_MAX_D

    ROW_BOUNDS: gl.constexpr = (NUM_CONSUMERS == 2) & (BLOCK_DV <= 128)  # where registers allow (`_softmax_block`)
    b, h, h_kv, pid_m = _tile_coordinates(tile, num_heads_q, group_size, num_m_blocks, batch_heads, section, CAUSAL)
    if FP8:
        descale = DESCALE + (b.to(gl.int64) * (num_heads_q // group_size) + h_kv) * 3
        scale_log2, _ = fp8_scores_scale(gl.load(descale) * gl.load(descale + 1), scale_log2, 0.0)
    tile_row = pid_m * NUM_CONSUMERS * BLOCK_M
    first_row = tile_row + C * BLOCK_M
    lo, num_blocks = _tile_blocks(tile_row, seqlen_q, seqlen_k, diag_lo, diag_hi, NUM_CONSUMERS * BLOCK_M, BLOCK_N)
    # This consumer's own blocks [first, last) of the tile's, and which of them need no mask.
    own_lo, full_lo, full_hi, own_hi = band_blocks(first_row, seqlen_q, seqlen_k, diag_lo, diag_hi, BLOCK_M, BLOCK_N)
    if CAUSAL:
        first = gl.minimum((own_lo - lo) // BLOCK_N, num_blocks)
        last = gl.maximum(first, gl.minimum(gl.cdiv(gl.maximum(own_hi - lo, 0), BLOCK_N), num_blocks))
    else:
        first = 0
        last = num_blocks
    for j in range(first):
        _release(k_ready, k_empty, it + j, NUM_STAGES)
        _release(v_ready, v_empty, it + j, NUM_STAGES)

    q = q_smem.index(C).reshape([BLOCK_M, BLOCK_D])
    offs_m = first_row + gl.arange(0, BLOCK_M, layout=rows_s)
    offs_n = gl.arange(0, BLOCK_N, layout=cols_s)
    s_init = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
    m_i = gl.full([BLOCK_M], float("-inf"), gl.float32, layout=rows_s)
    l_i = gl.zeros([BLOCK_M], gl.float32, layout=rows_s)
    acc = gl.zeros([BLOCK_M, BLOCK_DV], gl.float32, layout=o_layout)
    p = gl.zeros([BLOCK_M, BLOCK_N], dtype, layout=p_layout)
    p32 = s_init.to(gl.float16) if P16_CARRY else s_init
    mbarrier.wait(q_ready.index(C), tile_iter & 1)

    # The first block: S and its softmax, with nothing to overlap.
    if last > first:
        use = it + first
        mbarrier.wait(k_ready.index(use % NUM_STAGES), (use // NUM_STAGES) & 1)
        s_tok = _scores(q, k_smem.index(use % NUM_STAGES).reshape([BLOCK_N, BLOCK_D]), s_init, HEAD_DIM, BLOCK_D)
        s = warpgroup_mma_wait(0, deps=[s_tok])
        mbarrier.arrive(k_empty.index(use % NUM_STAGES), count=1)
        p32, l_i, m_i, alpha = _softmax_block(s, m_i, l_i, offs_m, offs_n, lo + first * BLOCK_N, full_lo, full_hi,
                                              seqlen_k, diag_lo, diag_hi, scale_log2, ROW_BOUNDS, P_SHIFT)
        if not FP8:
            p = _p_operand(p32, dtype, p_layout, BLOCK_M, BLOCK_N, FP8)
        elif P16_CARRY:
            p32 = p32.to(gl.float16)

    for j in range(first + 1, last):
        stage = (it + j) % NUM_STAGES
        prev = (it + j - 1) % NUM_STAGES
        mbarrier.wait(k_ready.index(stage), ((it + j) // NUM_STAGES) & 1)
        s_tok = _scores(q, k_smem.index(stage).reshape([BLOCK_N, BLOCK_D]), s_init, HEAD_DIM, BLOCK_D)
        mbarrier.wait(v_ready.index(prev), ((it + j - 1) // NUM_STAGES) & 1)
        if FP8:  # converted where the product reads it (`_p_operand`)
            p_pv = _p_operand(p32, dtype, p_layout, BLOCK_M, BLOCK_N, FP8)
        else:
            p_pv = p
        o_tok = warpgroup_mma(p_pv, _value_operand(v_smem, prev, BLOCK_N, BLOCK_DV, FP8), acc, is_async=True)
        # S_j is done when at most the P V product is in flight: its softmax overlaps that product.
        s = warpgroup_mma_wait(1, deps=[s_tok])
        mbarrier.arrive(k_empty.index(stage), count=1)
        p32, l_i, m_i, alpha = _softmax_block(s, m_i, l_i, offs_m, offs_n, lo + j * BLOCK_N, full_lo, full_hi,
                                              seqlen_k, diag_lo, diag_hi, scale_log2, ROW_BOUNDS, P_SHIFT)
        if P16_CARRY:
            p32 = p32.to(gl.float16)
        acc, p_pv = _wait_pv(o_tok, p_pv, FP8)
        mbarrier.arrive(v_empty.index(prev), count=1)
        acc = acc * gl.convert_layout(alpha, rows_o)[:, None]
        if not FP8:
            p = _p_operand(p32, dtype, p_layout, BLOCK_M, BLOCK_N, FP8)
    if SEPARATE_O:  # Q is read by the S products only, all complete: the next tile's may load
        mbarrier.arrive(q_empty.index(C), count=1)

    if last > first:
        use = it + last - 1
        mbarrier.wait(v_ready.index(use % NUM_STAGES), (use // NUM_STAGES) & 1)
        if FP8:
            p = _p_operand(p32, dtype, p_layout, BLOCK_M, BLOCK_N, FP8)
        o_tok = warpgroup_mma(p, _value_operand(v_smem, use % NUM_STAGES, BLOCK_N, BLOCK_DV, FP8), acc,
                              is_async=True)
        acc, p = _wait_pv(o_tok, p, FP8)
        mbarrier.arrive(v_empty.index(use % NUM_STAGES), count=1)

    # Rows that saw no key have l = 0: output exactly 0 and lse -inf (`forward.finish`).
    l_o = gl.convert_layout(l_i, rows_o)
    out = gl.where((l_o == 0.0)[:, None], 0.0, acc / gl.where(l_o == 0.0, 1.0, l_o)[:, None])
    if FP8:
        out = out * gl.load(descale + 2)
    o_buf = o_smem.index(C)
    if SEPARATE_O:
        tma.store_wait(0)  # the previous tile's store has read the buffer
    o_buf.reshape([BLOCK_M, BLOCK_DV]).store(out.to(desc_o.dtype))
    fence_async_shared()
    tma.async_copy_shared_to_global(desc_o, [b, h, first_row, 0], o_buf)
    if WRITE_LSE:
        lse = (m_i - P_SHIFT + gl.log2(l_i)) * 0.6931471805599453
        lse_ptrs = LSE + b.to(gl.int64) * stride_lb + h.to(gl.int64) * stride_lh + offs_m
        gl.store(lse_ptrs, lse, mask=offs_m < seqlen_q)
    if not SEPARATE_O:  # O went out through Q's buffer: free it once the store has read it
        tma.store_wait(0)
        mbarrier.arrive(q_empty.index(C), count=1)
    for j in range(last, num_blocks):
        _release(k_ready, k_empty, it + j, NUM_STAGES)
        _release(v_ready, v_empty, it + j, NUM_STAGES)
    return it + num_blocks


@gluon.jit
def _consumer(desc_o, LSE, DESCALE, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
              v_empty, scale_log2, stride_lb, stride_lh, num_heads_q, group_size, seqlen_q, seqlen_k, num_m_blocks,
              batch_heads, section, window_left, window_right, C: gl.constexpr, BLOCK_M: gl.constexpr,
              BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr, BLOCK_DV: gl.constexpr,
              NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr,
              WRITE_LSE: gl.constexpr, NUM_CONSUMERS: gl.constexpr, SEPARATE_O: gl.constexpr,
              PERSISTENT: gl.constexpr, FP8: gl.constexpr):
    diag_lo, diag_hi = band_diagonals(seqlen_q, seqlen_k, window_left, window_right)
    if PERSISTENT:
        num_tiles = batch_heads * num_m_blocks
        it = 0
        for rounds_done in range(gl.cdiv(num_tiles, gl.num_programs(0))):
            tile = _schedule(rounds_done, num_tiles)
            if tile < num_tiles:
                it = _consume_tile(tile, it, rounds_done, desc_o, LSE, DESCALE, q_smem, o_smem, k_smem, v_smem, q_ready,
                                   q_empty, k_ready, k_empty, v_ready, v_empty, scale_log2, stride_lb, stride_lh,
                                   num_heads_q, group_size, seqlen_q, seqlen_k, num_m_blocks, batch_heads, section,
                                   diag_lo, diag_hi, C, BLOCK_M, BLOCK_N, HEAD_DIM, BLOCK_D, BLOCK_DV, NUM_STAGES,
                                   CAUSAL, WRITE_LSE, NUM_CONSUMERS, SEPARATE_O, FP8)
    else:
        _consume_tile(gl.program_id(0), 0, 0, desc_o, LSE, DESCALE, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty,
                      k_ready, k_empty, v_ready, v_empty, scale_log2, stride_lb, stride_lh, num_heads_q, group_size,
                      seqlen_q, seqlen_k, num_m_blocks, batch_heads, section, diag_lo, diag_hi, C, BLOCK_M, BLOCK_N,
                      HEAD_DIM, BLOCK_D, BLOCK_DV, NUM_STAGES, CAUSAL, WRITE_LSE, NUM_CONSUMERS, SEPARATE_O, FP8)
    tma.store_wait(0)


@gluon.jit
def attention_forward_gluon_kernel(
    desc_q, desc_k, desc_v, desc_o, LSE, DESCALE,
    scale_log2, stride_lb, stride_lh,
    num_heads_q, group_size, seqlen_q, seqlen_k, num_m_blocks, batch_heads, section, window_left, window_right,
    BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, BLOCK_D: gl.constexpr,
    BLOCK_DV: gl.constexpr, NUM_STAGES: gl.constexpr, CAUSAL: gl.constexpr, WRITE_LSE: gl.constexpr,
    NUM_CONSUMERS: gl.constexpr, SEPARATE_O: gl.constexpr, PERSISTENT: gl.constexpr, FP8: gl.constexpr,
):
    """num_warps = 4 (the first consumer), NUM_CONSUMERS - 1 more four-warp consumers and a one-warp
    producer; NUM_CONSUMERS * BLOCK_M query rows per tile of `_tile_coordinates`' order. PERSISTENT:
    one program per SM, taking tiles as `_schedule` deals them; else one program per tile. (One
    program per SM either way: the buffers fill shared memory.) The warpgroups share the register
    file: the producer's drops to 24 registers a thread and the consumers split the rest (240 each
    for two, 160 each for three). With SEPARATE_O the output leaves through its own buffers, so the
    next tile's Q loads while this one's last products run; without it (where shared memory is
    short) through Q's. Q and K tiles span BLOCK_D columns (HEAD_DIM of them real), V and O tiles
    BLOCK_DV (v's head dim, which may differ: MLA; O then leaves through its own buffers).

    FP8: Q, K and V in float8 e4m3 (desc_v over V transposed, (batch, head, head_dim, seq), so that
    both products read K-major tiles), DESCALE the float32 (batch, heads_kv, 3) descales of
    `forward.attention_forward_kernel`, O 16-bit through its own buffers. Otherwise DESCALE is
    never read."""
    gl.static_assert((NUM_CONSUMERS == 2) | (NUM_CONSUMERS == 3), "two or three consumers")
    gl.static_assert(SEPARATE_O | (BLOCK_DV == BLOCK_D), "O reuses Q's buffers only at Q's width")
    gl.static_assert(SEPARATE_O | (not FP8), "FP8's 16-bit O needs buffers of its own")
    dtype: gl.constexpr = desc_q.dtype
    q_smem = gl.allocate_shared_memory(dtype, [NUM_CONSUMERS, 1, 1, BLOCK_M, BLOCK_D], desc_q.layout)
    if SEPARATE_O:
        o_smem = gl.allocate_shared_memory(desc_o.dtype, [NUM_CONSUMERS, 1, 1, BLOCK_M, BLOCK_DV], desc_o.layout)
    else:
        o_smem = q_smem
    k_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, BLOCK_D], desc_k.layout)
    if FP8:
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_DV, BLOCK_N], desc_v.layout)
    else:
        v_smem = gl.allocate_shared_memory(dtype, [NUM_STAGES, 1, 1, BLOCK_N, BLOCK_DV], desc_v.layout)
    q_ready = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    q_empty = gl.allocate_shared_memory(gl.int64, [NUM_CONSUMERS, 1], mbarrier.MBarrierLayout())
    k_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    k_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_ready = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    v_empty = gl.allocate_shared_memory(gl.int64, [NUM_STAGES, 1], mbarrier.MBarrierLayout())
    for c in gl.static_range(NUM_CONSUMERS):
        mbarrier.init(q_ready.index(c), count=1)
        mbarrier.init(q_empty.index(c), count=1)
    for i in gl.static_range(NUM_STAGES):
        mbarrier.init(k_ready.index(i), count=1)
        mbarrier.init(v_ready.index(i), count=1)
        mbarrier.init(k_empty.index(i), count=NUM_CONSUMERS)  # every consumer releases each buffer
        mbarrier.init(v_empty.index(i), count=NUM_CONSUMERS)

    # Partition arguments are spelled out: a tuple built with + loses its constexprs.
    if NUM_CONSUMERS == 2:
        gl.warp_specialize([
            (_consumer, (desc_o, LSE, DESCALE, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                         v_ready, v_empty, scale_log2, stride_lb, stride_lh, num_heads_q, group_size, seqlen_q,
                         seqlen_k, num_m_blocks, batch_heads, section, window_left, window_right, 0, BLOCK_M, BLOCK_N,
                         HEAD_DIM, BLOCK_D, BLOCK_DV, NUM_STAGES, CAUSAL, WRITE_LSE, NUM_CONSUMERS, SEPARATE_O,
                         PERSISTENT, FP8)),
            (_consumer, (desc_o, LSE, DESCALE, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                         v_ready, v_empty, scale_log2, stride_lb, stride_lh, num_heads_q, group_size, seqlen_q,
                         seqlen_k, num_m_blocks, batch_heads, section, window_left, window_right, 1, BLOCK_M, BLOCK_N,
                         HEAD_DIM, BLOCK_D, BLOCK_DV, NUM_STAGES, CAUSAL, WRITE_LSE, NUM_CONSUMERS, SEPARATE_O,
                         PERSISTENT, FP8)),
            (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                         v_empty, num_heads_q, group_size, seqlen_q, seqlen_k, num_m_blocks, batch_heads, section,
                         window_left, window_right, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, NUM_CONSUMERS, PERSISTENT,
                         FP8)),
        ], [4, 1], [240, 24])
    else:
        gl.warp_specialize([
            (_consumer, (desc_o, LSE, DESCALE, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                         v_ready, v_empty, scale_log2, stride_lb, stride_lh, num_heads_q, group_size, seqlen_q,
                         seqlen_k, num_m_blocks, batch_heads, section, window_left, window_right, 0, BLOCK_M, BLOCK_N,
                         HEAD_DIM, BLOCK_D, BLOCK_DV, NUM_STAGES, CAUSAL, WRITE_LSE, NUM_CONSUMERS, SEPARATE_O,
                         PERSISTENT, FP8)),
            (_consumer, (desc_o, LSE, DESCALE, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                         v_ready, v_empty, scale_log2, stride_lb, stride_lh, num_heads_q, group_size, seqlen_q,
                         seqlen_k, num_m_blocks, batch_heads, section, window_left, window_right, 1, BLOCK_M, BLOCK_N,
                         HEAD_DIM, BLOCK_D, BLOCK_DV, NUM_STAGES, CAUSAL, WRITE_LSE, NUM_CONSUMERS, SEPARATE_O,
                         PERSISTENT, FP8)),
            (_consumer, (desc_o, LSE, DESCALE, q_smem, o_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty,
                         v_ready, v_empty, scale_log2, stride_lb, stride_lh, num_heads_q, group_size, seqlen_q,
                         seqlen_k, num_m_blocks, batch_heads, section, window_left, window_right, 2, BLOCK_M, BLOCK_N,
                         HEAD_DIM, BLOCK_D, BLOCK_DV, NUM_STAGES, CAUSAL, WRITE_LSE, NUM_CONSUMERS, SEPARATE_O,
                         PERSISTENT, FP8)),
            (_producer, (desc_q, desc_k, desc_v, q_smem, k_smem, v_smem, q_ready, q_empty, k_ready, k_empty, v_ready,
                         v_empty, num_heads_q, group_size, seqlen_q, seqlen_k, num_m_blocks, batch_heads, section,
                         window_left, window_right, BLOCK_M, BLOCK_N, NUM_STAGES, CAUSAL, NUM_CONSUMERS, PERSISTENT,
                         FP8)),
        ], [4, 4, 1], [160, 160, 24])
