"""Routing and dispatch kernels: top-k over router scores, then the expert-sorted layout.

Token-expert pairs are numbered p = t * top_k + j (the order of topk_ids.flatten()). The
grouped GEMMs read them through a block-aligned layout (the "moe_align_block_size" layout of
vLLM): expert e owns the rows [start[e], start[e] + roundup(count[e], BLOCK_M)) of
`sorted_pairs`, its pairs first, in increasing p, so every BLOCK_M-row block belongs to one
expert. `block_expert[b]` names the expert of block b (-1 for the blocks past the last expert,
up to the bound cdiv(N, BLOCK_M) + min(E, N) the host sizes the grids with) and `block_rows[b]`
how many of its rows hold pairs; the rest of the block is padding the GEMMs mask. Nothing here
is read back by the host, so the whole layer can be captured in a CUDA graph.

The layout is built in chunks of consecutive pairs, one program per chunk:
1. count: each chunk's per-expert histogram goes to row c of a (chunks, E_PAD) table
   (`count_pairs_kernel`, from the ids the routing launch wrote);
2. align: each program sums the table (all rows for the totals, rows before c for its prefix),
   derives the expert starts, and writes its pairs at
   start[e] + prefix[c, e] + (rank of the pair among its chunk's earlier pairs of expert e):
   a stable counting sort, deterministic, no atomics. The rank is found 64 pairs at a time
   (a 64 x 64 comparison within the tile plus a per-expert running count), so a chunk takes a
   few wide steps rather than one step per pair. Each program also writes its share of the
   block tables.
The routing launch itself runs on programs of a few rows each (routing is independent per
token). For small calls (`configs.route_layout`: decode), one program routes every token and does
both steps too: one launch; for a single token it writes the layout straight from the token's k
picks (rank by expert id).
Ids outside [0, E) are dropped from the layout (their pairs contribute nothing). The routing's
backward (`route_backward_kernel`) forms the scores again as the routing launch does and writes
d logits, on programs of the same rows.

Compile-time constants are only the tile sizes (E_PAD: 256 for the count table and the align
kernels; for the routing launch, E's next power of two, at least 16:
`configs.route_expert_pad`), the layout mode and whether align counts its own pairs. top_k, the
scoring, the renormalisation and BLOCK_M are runtime arguments (never value-specialised), so the
few builds `builds.shipped_builds` lists are every variant the launchers can run.
"""
import triton
import triton.language as tl

from ...dependent_launch import release_dependents
from .offsets import wide_offset


@triton.jit
def _scores(x, col_ok, sigmoid):
    """The routing scores of fp32 logits x (ROWS, E_PAD) whose columns col_ok are experts: their
    sigmoid, or their softmax over those columns (the others' values are not defined)."""
    if sigmoid:
        scores = tl.sigmoid(x)
    else:
        x = tl.where(col_ok[None, :], x, float("-inf"))
        e = tl.exp(x - tl.max(x, axis=1)[:, None])
        scores = e / tl.sum(e, axis=1)[:, None]
    return scores


@triton.jit
def _route_rows(logits_ptr, stride_lt, rows, T, E, top_k, sigmoid, renormalize, cols, kcols):
    """Top-k routing of a (ROWS, E_PAD) block of logits; returns weights (ROWS, K_PAD) fp32 and
    ids (ROWS, K_PAD) int32, zero beyond top_k. Scores are formed in fp32; ties go to the lower
    expert index; the k picks come out in decreasing score."""
    row_ok = rows < T
    col_ok = cols < E
    x = tl.load(logits_ptr + wide_offset(rows, stride_lt)[:, None] + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
    scores = _scores(x, col_ok, sigmoid)
    # Scores lie in [0, 1]: -1 marks padding columns and experts already taken. A NaN score (from
    # NaN or infinite logits) ranks as 2, above every score, as torch.topk ranks NaN first, and its
    # weight is NaN: the pick stays an expert of [0, E) and the NaN reaches the output (a NaN
    # compared inside the max could pick a padding column instead).
    scores = tl.where(col_ok[None, :], tl.where(scores != scores, 2.0, scores), -1.0)
    weights = tl.zeros((rows.shape[0], kcols.shape[0]), dtype=tl.float32)
    ids = tl.zeros((rows.shape[0], kcols.shape[0]), dtype=tl.int32)
    for j in range(top_k):
        best, pick = tl.max(scores, axis=1, return_indices=True, return_indices_tie_break_left=True)
        best = tl.where(best > 1.0, float("nan"), best)
        weights = tl.where(kcols[None, :] == j, best[:, None], weights)
        ids = tl.where(kcols[None, :] == j, pick[:, None], ids)
        scores = tl.where(cols[None, :] == pick[:, None], -1.0, scores)
    if renormalize:
        weights = weights / tl.sum(weights, axis=1)[:, None]
    return weights, ids


PAD_COLS = tl.constexpr(32)  # padding rows of sorted_pairs written per step, per block


@triton.jit
def _chunk_counts(ids_ptr, first, last, E, E_PAD: tl.constexpr, COUNT_TILE: tl.constexpr):
    """Per-expert counts (E_PAD,) int32 of the pairs [first, last) with ids in [0, E)."""
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for p0 in range(first, last, COUNT_TILE):
        pairs = p0 + tl.arange(0, COUNT_TILE)
        ok = pairs < last
        e = tl.load(ids_ptr + pairs, mask=ok, other=0).to(tl.int32)
        counts += tl.histogram(e, E_PAD, mask=ok & (e >= 0) & (e < E))
    return counts


@triton.jit
def _place_pairs(ids_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, counts, prefix, E, block_m,
                 first, last, first_block, last_block, cols, PAIRS: tl.constexpr, TILE_B: tl.constexpr):
    """Writes the pairs [first, last) into their sorted rows, and the block tables for the blocks
    [first_block, last_block).

    counts: (E_PAD,) pairs per expert over all chunks; prefix: (E_PAD,) pairs per expert in the
    chunks before this one.
    """
    padded = (counts + block_m - 1) // block_m * block_m
    end = tl.cumsum(padded, 0)
    start = end - padded
    # Stable counting sort of this chunk, PAIRS at a time: a pair's row is its expert's next free
    # row plus the number of earlier pairs of the same expert within the tile.
    next_row = start + prefix
    lane = tl.arange(0, PAIRS)
    earlier = lane[None, :] < lane[:, None]
    for p0 in range(first, last, PAIRS):
        pairs = p0 + lane
        e = tl.load(ids_ptr + pairs, mask=pairs < last, other=0).to(tl.int32)
        ok = (pairs < last) & (e >= 0) & (e < E)
        e = tl.where(ok, e, 0)
        same = (e[:, None] == e[None, :]) & ok[None, :] & earlier
        row = tl.gather(next_row, e, 0) + tl.sum(same.to(tl.int32), axis=1)
        tl.store(sorted_pairs_ptr + row, pairs, mask=ok)
        next_row += tl.histogram(e, cols.shape[0], mask=ok)
    # Block b belongs to the expert whose range holds row b * block_m: ends are non-decreasing,
    # so that expert's index is the number of experts ending at or before it.
    in_range = cols < E
    for b0 in range(first_block, last_block, TILE_B):
        blocks = b0 + tl.arange(0, TILE_B)
        b_ok = blocks < last_block
        row0 = blocks * block_m
        expert = tl.sum(((end[None, :] <= row0[:, None]) & in_range[None, :]).to(tl.int32), axis=1)
        used = expert < E
        expert = tl.where(used, expert, 0)
        rows = tl.minimum(tl.gather(start, expert, 0) + tl.gather(counts, expert, 0) - row0, block_m)
        rows = tl.where(used, rows, 0)
        tl.store(block_expert_ptr + blocks, tl.where(used, expert, -1), mask=b_ok)
        tl.store(block_rows_ptr + blocks, rows, mask=b_ok)
        # The block's padding rows hold -1: no value of the layout is left undefined.
        for r0 in range(0, block_m, PAD_COLS):
            r = r0 + tl.arange(0, PAD_COLS)
            pad = b_ok[:, None] & (r[None, :] >= rows[:, None]) & (r[None, :] < block_m)
            tl.store(sorted_pairs_ptr + row0[:, None] + r[None, :], tl.full((TILE_B, PAD_COLS), -1, tl.int32),
                     mask=pad)


@triton.jit
def _place_one_token(ids, top_k, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, block_m, max_blocks,
                     kcols, PAD_ROWS: tl.constexpr):
    """The layout of one token's picks `ids` (K_PAD,) (the first top_k distinct experts of [0, E)),
    as `_place_pairs` builds it, without a sort: each pair has a block of its own, and the pair
    whose expert has rank r among the picks takes block r (its first row; the rest hold -1).
    PAD_ROWS = 2 * K_PAD covers every layout: max_blocks = cdiv(top_k, block_m) + min(E, top_k)
    is at most 2 * top_k."""
    picked = kcols < top_k
    below = (ids[None, :] < ids[:, None]) & picked[None, :]
    rank = tl.sum(below.to(tl.int32), axis=1)
    blocks = tl.arange(0, PAD_ROWS)
    at = (rank[None, :] == blocks[:, None]) & picked[None, :]  # (block, pair)
    used = tl.sum(at.to(tl.int32), axis=1) > 0
    expert = tl.sum(tl.where(at, ids[None, :], 0), axis=1)
    pair = tl.sum(tl.where(at, kcols[None, :], 0), axis=1)
    b_ok = blocks < max_blocks
    tl.store(block_expert_ptr + blocks, tl.where(used, expert, -1), mask=b_ok)
    tl.store(block_rows_ptr + blocks, used.to(tl.int32), mask=b_ok)
    for r0 in range(0, block_m, PAD_COLS):
        r = r0 + tl.arange(0, PAD_COLS)
        value = tl.where(used[:, None] & (r[None, :] == 0), pair[:, None], -1)
        tl.store(sorted_pairs_ptr + blocks[:, None] * block_m + r[None, :], value,
                 mask=b_ok[:, None] & (r[None, :] < block_m))


@triton.jit(do_not_specialize=["top_k", "sigmoid", "renormalize", "block_m"])
def route_kernel(
    logits_ptr, weights_ptr, ids_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    T, E, stride_lt, top_k, sigmoid, renormalize, program_tokens, block_m, max_blocks,
    E_PAD: tl.constexpr, K_PAD: tl.constexpr, ROWS: tl.constexpr, LAYOUT: tl.constexpr,
    PAIRS: tl.constexpr, TILE_B: tl.constexpr, RELEASE: tl.constexpr,
):
    """Routes the tokens [c * program_tokens, (c + 1) * program_tokens) of program c.

    logits: (T, E) any float dtype, row stride stride_lt; weights: (T, top_k) fp32 and ids:
    (T, top_k) int32, contiguous. sigmoid, renormalize: 0 or 1. LAYOUT selects what else the
    program does: "none": routing only; "full" (one program covers every token): also builds
    the whole layout (sorted_pairs, block_expert, block_rows) itself; "one_token" (T = 1,
    ROWS = 1): the same layout from the token's picks alone, no sort. RELEASE: the next kernel
    (the gate/up GEMM) launches as a programmatic dependent (`dependent_launch`) and may start now.
    """
    release_dependents(RELEASE)
    c = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    kcols = tl.arange(0, K_PAD)
    first_row = c * program_tokens
    last_row = tl.minimum(first_row + program_tokens, T)
    counts = tl.zeros((E_PAD,), dtype=tl.int32)
    for r0 in range(first_row, last_row, ROWS):
        rows = r0 + tl.arange(0, ROWS)
        weights, ids = _route_rows(logits_ptr, stride_lt, rows, last_row, E, top_k, sigmoid, renormalize,
                                   cols, kcols)
        out_ok = (rows < last_row)[:, None] & (kcols < top_k)[None, :]
        out_offs = rows[:, None] * top_k + kcols[None, :]
        tl.store(weights_ptr + out_offs, weights, mask=out_ok)
        tl.store(ids_ptr + out_offs, ids, mask=out_ok)
        if LAYOUT == "one_token":
            _place_one_token(tl.reshape(ids, (K_PAD,)), top_k, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
                             block_m, max_blocks, kcols, 2 * K_PAD)
        elif LAYOUT == "full":
            counts += tl.histogram(tl.reshape(ids, (ROWS * K_PAD,)), E_PAD,
                                   mask=tl.reshape(out_ok, (ROWS * K_PAD,)))
    if LAYOUT == "full":
        # The ids just stored are read back by other threads of this program.
        tl.debug_barrier()
        _place_pairs(ids_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, counts, tl.zeros_like(counts),
                     E, block_m, 0, T * top_k, 0, max_blocks, cols, PAIRS, TILE_B)


@triton.jit
def count_pairs_kernel(ids_ptr, counts_ptr, N, E, chunk_pairs, E_PAD: tl.constexpr, COUNT_TILE: tl.constexpr):
    """Row c of counts (chunks, E_PAD) int32: the expert histogram of the pairs of chunk c.
    ids: (N,) int32, the flattened topk_ids."""
    c = tl.program_id(0)
    first = c * chunk_pairs
    counts = _chunk_counts(ids_ptr, first, tl.minimum(first + chunk_pairs, N), E, E_PAD, COUNT_TILE)
    tl.store(counts_ptr + c * E_PAD + tl.arange(0, E_PAD), counts)


@triton.jit(do_not_specialize=["top_k", "sigmoid", "renormalize"])
def route_backward_kernel(
    grad_weights_ptr, logits_ptr, weights_ptr, ids_ptr, grad_logits_ptr,
    T, E, stride_lt, stride_gt, top_k, sigmoid, renormalize,
    E_PAD: tl.constexpr, ROWS: tl.constexpr,
):
    """d logits (T, E), row stride stride_gt, in the logits' dtype, for ROWS tokens a program,
    from d weights, the weights and the ids (T, top_k: fp32, fp32 and int32, contiguous) that
    `route_kernel` wrote for logits (row stride stride_lt). The scores p are formed as there
    (fp32 softmax or sigmoid); with chosen scores s_j = p[id_j] and weights w = s / sum(s)
    (renormalize) or s: d s_j = (d w_j - <d w, w>) / sum(s) or d w_j; d p is d s at the chosen
    experts (a token's ids are distinct), zero elsewhere; softmax: d logits = p (d p - <d p, p>),
    sigmoid: d logits = d p p (1 - p)."""
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.arange(0, E_PAD)
    row_ok = rows < T
    col_ok = cols < E
    x = tl.load(logits_ptr + wide_offset(rows, stride_lt)[:, None] + cols[None, :],
                mask=row_ok[:, None] & col_ok[None, :], other=0.0)
    out_dtype = x.dtype
    p = tl.where(col_ok[None, :], _scores(x.to(tl.float32), col_ok, sigmoid), 0.0)
    slots = wide_offset(rows, top_k)
    dot = tl.zeros((ROWS,), dtype=tl.float32)
    total = tl.zeros((ROWS,), dtype=tl.float32)
    if renormalize:
        for j in range(top_k):
            w = tl.load(weights_ptr + slots + j, mask=row_ok, other=0.0)
            dw = tl.load(grad_weights_ptr + slots + j, mask=row_ok, other=0.0)
            chosen = tl.load(ids_ptr + slots + j, mask=row_ok, other=-1)
            dot += dw * w
            total += tl.sum(tl.where(cols[None, :] == chosen[:, None], p, 0.0), axis=1)
        total = tl.where(row_ok, total, 1.0)
    grad_p = tl.zeros((ROWS, E_PAD), dtype=tl.float32)
    for j in range(top_k):
        dw = tl.load(grad_weights_ptr + slots + j, mask=row_ok, other=0.0)
        chosen = tl.load(ids_ptr + slots + j, mask=row_ok, other=-1)
        if renormalize:
            dw = (dw - dot) / total
        grad_p = tl.where(cols[None, :] == chosen[:, None], dw[:, None], grad_p)
    if sigmoid:
        grad_x = grad_p * p * (1.0 - p)
    else:
        grad_x = p * (grad_p - tl.sum(grad_p * p, axis=1)[:, None])
    tl.store(grad_logits_ptr + wide_offset(rows, stride_gt)[:, None] + cols[None, :], grad_x.to(out_dtype),
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["block_m"])
def align_pairs_kernel(
    ids_ptr, counts_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    N, E, block_m, chunk_pairs, num_chunks, blocks_per_program, max_blocks,
    E_PAD: tl.constexpr, PAIRS: tl.constexpr, TILE_B: tl.constexpr, COUNT_TILE: tl.constexpr,
    TABLE_ROWS: tl.constexpr, COUNT_HERE: tl.constexpr,
):
    """Places the pairs of chunk c (program c) and its share of the block tables.

    ids: (N,) int32; counts: (num_chunks, E_PAD) int32 from the count step, read TABLE_ROWS
    rows at a time, unless COUNT_HERE (a single chunk): the program counts its own pairs.
    """
    c = tl.program_id(0)
    cols = tl.arange(0, E_PAD)
    first = c * chunk_pairs
    last = tl.minimum(first + chunk_pairs, N)
    if COUNT_HERE:
        counts = _chunk_counts(ids_ptr, first, last, E, E_PAD, COUNT_TILE)
        prefix = tl.zeros_like(counts)
    else:
        counts = tl.zeros((E_PAD,), dtype=tl.int32)
        prefix = tl.zeros((E_PAD,), dtype=tl.int32)
        for r0 in range(0, num_chunks, TABLE_ROWS):
            r = r0 + tl.arange(0, TABLE_ROWS)
            table = tl.load(counts_ptr + r[:, None] * E_PAD + cols[None, :], mask=(r < num_chunks)[:, None],
                            other=0)
            counts += tl.sum(table, axis=0)
            prefix += tl.sum(tl.where((r < c)[:, None], table, 0), axis=0)
    first_block = c * blocks_per_program
    _place_pairs(ids_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, counts, prefix, E, block_m,
                 first, last, first_block, tl.minimum(first_block + blocks_per_program, max_blocks), cols,
                 PAIRS, TILE_B)
