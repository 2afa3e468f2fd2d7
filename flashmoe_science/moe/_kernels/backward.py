"""The backward of the expert GEMMs, over the forward's expert-sorted, block-aligned layout.

Forward, for pair p = t * top_k + j routed to expert e with weight w_p (grouped_gemm.py):
    g_p, u_p = w1[e, :I] @ x_t, w1[e, I:] @ x_t
    h_p = act(g_p) * u_p              (stored: h[row], the down GEMM's input)
    dh/dg_p = u_p act'(g_p), dh/du_p = act(g_p)   (stored: h_grads[row])
    out_t = sum_j w_p * (w2[e] @ h_p)
Given dY = d out (T, H), with a_p = w2[e].T @ dY_t (the gradient reaching h_p, before w_p):
    d w_p = <dY_t, w2[e] @ h_p> = <a_p, h_p>
    d h_p = w_p * a_p;  d g_p = d h_p * dh/dg_p;  d u_p = d h_p * dh/du_p
    d x_t = sum_j w1[e].T @ [d g_p, d u_p]
    d w1[e] = sum over e's pairs of [d g_p, d u_p] (x) x_t;  d w2[e] = sum of dY_t (x) (w_p h_p)

Four kernels, each output element written by exactly one program, every sum in a fixed order
(no atomics: the gradients are bitwise reproducible):
- grad_gate_up_kernel: row blocks x I columns, K = H. Gathers dY rows by token inside the K
  loop (as the forward gathers x), multiplies by w2[e]; the epilogue scales by the stored
  activation derivatives and writes [d g, d u] (rows, 2I) in layout order (its columns in
  w1's row order: gate rows then up rows, or interleaved), this column
  tile's share of d w_p, and for the weight gradients w_p * h_p and each row's pair index.
- grad_x_kernel: row blocks x H columns, K = 2I: [d g, d u] @ w1[e], each row written to its
  pair's slot p, so the forward's combine kernel sums a token's k rows in a fixed order.
- grad_w1_kernel, grad_w2_kernel: one program per (expert, output tile), summing over that
  expert's layout rows in order. One operand is read in layout order, the other gathered
  by token in the loads through the row's pair index (no permuted copy of x or dY), except
  where a configuration asks grad_w1 to read a layout-order copy of x that
  gather_rows_kernel writes first (BackwardConfig.gather_x). An expert without tokens gets a
  zero gradient.
Padding rows of the layout are masked on load (or hold zeros where a kernel reads them
unmasked, as documented at each); blocks past the last expert exit at once.

With TMA (sm90) the operands read as dense tiles (the layout-order operand of the weight
gradients, w2 in grad_gate_up, both of grad_x) come through tensor descriptors instead of
pointer loads; the operand gathered by token stays a pointer load. A descriptor load fills
elements past the tensor's bounds with zeros, where the pointer path masks them to zeros; the
weight tensors' descriptors are 3-D, (E, rows, columns), so a tile never reaches into the next
expert; a weight-gradient step that passes its expert's last row is masked as the pointer
path masks it (`_past_expert_zeroed`). So the same tiles meet the same products in the same
order, and the results are the same bits. The caller passes a
`triton.tools.tensor_descriptor.TensorDescriptor` in the operand's pointer argument, with the
block shape given at each kernel.
"""
import triton
import triton.language as tl

from .grouped_gemm import _tile, _tile_coordinates
from .offsets import wide_offset


@triton.jit(do_not_specialize=["num_blocks_m", "num_pairs", "top_k", "weight_grad_operands"])
def grad_gate_up_kernel(
    grad_out_ptr, w2_ptr, h_ptr, h_grads_ptr, weights_ptr, grad_gate_up_ptr, weighted_h_ptr, row_tokens_ptr,
    grad_weights_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    num_blocks_m, num_pairs, H, I, top_k, weight_grad_operands,
    stride_gt, stride_we, stride_wn, stride_wi,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA: tl.constexpr, INTERLEAVED: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """grad_out: (T, H), row stride stride_gt; w2: (E, H, I), strides (stride_we, stride_wn,
    stride_wi): I contiguous (stride_wi 1; TMA: a descriptor of it, blocks (1, BLOCK_K, BLOCK_N)),
    or H (a transposed view, as transformers stores gpt-oss's; the pointer path);
    h: (rows, I) and h_grads: (rows, 2I) [dh/dgate, dh/dup], the forward's, layout order;
    weights: (T * top_k,) fp32.

    Writes, in layout order: grad_gate_up (rows, 2I), d gate and d up in w1's row order (column
    n's d gate at column n and its d up at I + n, or with INTERLEAVED 2n and 2n + 1), so the
    gate/up backward reads w1 and writes d w1 row for row; when
    weight_grad_operands (the weight gradients follow) weighted_h (rows, I) = w_p * h_p, the
    B operand of grad_w2, and row_tokens (rows,) int32, each row's token or -1 on padding rows
    (the column-tile-0 programs write it). grad_weights: (cdiv(I, BLOCK_N), T * top_k) fp32,
    row pid_n receives this column tile's part of d w_p. Padding rows of grad_gate_up and
    weighted_h are zeros (their dY rows load as zeros, their stored h and h_grads are zeros);
    so are grad_gate_up's rows in the unused blocks past the last expert.

    The epilogue needs no activation function, only products with loaded tiles: with the
    sigmoid and its derivative recomputed here the (BLOCK_M, BLOCK_N) fp32 tiles alive at once
    overflow the registers of a 128 x 128 tile (ptxas spills); stored derivatives do not.
    """
    expert, rows, row_ok, pairs, pid_n = _tile(sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, num_blocks_m, I,
                                               BLOCK_M, BLOCK_N, GROUP_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    if expert < 0:  # the layout's unused blocks: grad_gate_up (the op's output) holds zeros there too
        zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=grad_gate_up_ptr.dtype.element_ty)
        _store_gate_up(grad_gate_up_ptr, rows, pid_n, offs_n, n_ok, I, zeros, zeros, INTERLEAVED)
        return
    offs_k = tl.arange(0, BLOCK_K)
    dy_ptrs = grad_out_ptr + wide_offset(pairs // top_k, stride_gt)[:, None] + offs_k[None, :]
    # The (BLOCK_K, BLOCK_N) tile w2[e, k, n]: row-major (I contiguous) or column-major (transposed).
    if not TMA:
        w_ptrs = (w2_ptr + wide_offset(expert, stride_we) + wide_offset(offs_k, stride_wn)[:, None]
                  + wide_offset(offs_n, stride_wi)[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k < H - k0
        a = tl.load(dy_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if TMA:
            b = w2_ptr.load([expert, k0, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
        else:
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        dy_ptrs += BLOCK_K
        if not TMA:
            w_ptrs += BLOCK_K * stride_wn
    if weight_grad_operands:
        if pid_n == 0:
            tl.store(row_tokens_ptr + rows, tl.where(row_ok, pairs // top_k, -1))
    # acc holds a = dY @ w2[e], before the routing weight.
    route_weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)[:, None]
    out_dtype = grad_gate_up_ptr.dtype.element_ty
    h_offs = wide_offset(rows, I)
    h = tl.load(h_ptr + h_offs[:, None] + offs_n[None, :], mask=n_ok[None, :], other=0.0).to(tl.float32)
    tl.store(grad_weights_ptr + wide_offset(pid_n, num_pairs) + pairs, tl.sum(acc * h, axis=1), mask=row_ok)
    if weight_grad_operands:
        tl.store(weighted_h_ptr + h_offs[:, None] + offs_n[None, :], (h * route_weight).to(out_dtype),
                 mask=n_ok[None, :])
    grad_h = acc * route_weight
    h_grads_offs = wide_offset(rows, 2 * I)[:, None] + offs_n[None, :]
    dh_dgate = tl.load(h_grads_ptr + h_grads_offs, mask=n_ok[None, :], other=0.0)
    dh_dup = tl.load(h_grads_ptr + I + h_grads_offs, mask=n_ok[None, :], other=0.0)
    _store_gate_up(grad_gate_up_ptr, rows, pid_n, offs_n, n_ok, I, (grad_h * dh_dgate.to(tl.float32)).to(out_dtype),
                   (grad_h * dh_dup.to(tl.float32)).to(out_dtype), INTERLEAVED)


@triton.jit
def _store_gate_up(ptr, rows, pid_n, offs_n, n_ok, I, gate, up, INTERLEAVED: tl.constexpr):
    """Stores the (BLOCK_M, BLOCK_N) tiles `gate` and `up` of columns offs_n into the layout rows
    `rows` of a (rows, 2I) buffer in w1's row order: gate columns then up columns, or with
    INTERLEAVED alternating, as one contiguous (BLOCK_M, 2 BLOCK_N) tile."""
    row_offs = wide_offset(rows, 2 * I)[:, None]
    if INTERLEAVED:
        BLOCK_M: tl.constexpr = gate.shape[0]
        BLOCK_N: tl.constexpr = gate.shape[1]
        cols = pid_n * (2 * BLOCK_N) + tl.arange(0, 2 * BLOCK_N)
        tl.store(ptr + row_offs + cols[None, :], tl.reshape(tl.join(gate, up), (BLOCK_M, 2 * BLOCK_N)),
                 mask=(cols < 2 * I)[None, :])
    else:
        tl.store(ptr + row_offs + offs_n[None, :], gate, mask=n_ok[None, :])
        tl.store(ptr + I + row_offs + offs_n[None, :], up, mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_blocks_m"])
def grad_x_kernel(
    grad_gate_up_ptr, w1_ptr, grad_x_pairs_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    num_blocks_m, H, I,
    stride_we, stride_wn, stride_wh,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """grad_gate_up: (rows, 2I) contiguous, layout order, columns in w1's row order; w1: (E, 2I, H),
    strides (stride_we, stride_wn, stride_wh): H contiguous (stride_wh 1), or 2I (a transposed
    view, the pointer path); grad_x_pairs: (T * top_k, H) contiguous, row p =
    w1[e].T @ grad_gate_up[row of p].
    TMA: grad_gate_up and w1 are descriptors, blocks (BLOCK_M, BLOCK_K) and (1, BLOCK_K, BLOCK_N)."""
    expert, rows, row_ok, pairs, pid_n = _tile(sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, num_blocks_m, H,
                                               BLOCK_M, BLOCK_N, GROUP_M)
    if expert < 0:
        return
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    if TMA:
        # The block's first layout row, from _tile's pid_m (the same arithmetic, which the
        # compiler shares).
        first_row = _tile_coordinates(tl.program_id(0), num_blocks_m, tl.cdiv(H, BLOCK_N), GROUP_M)[0] * BLOCK_M
    else:
        a_ptrs = grad_gate_up_ptr + wide_offset(rows, 2 * I)[:, None] + offs_k[None, :]
        # The (BLOCK_K, BLOCK_N) tile w1[e, k, n]: row-major (H contiguous) or column-major (transposed).
        w_ptrs = (w1_ptr + wide_offset(expert, stride_we) + wide_offset(offs_k, stride_wn)[:, None]
                  + wide_offset(offs_n, stride_wh)[None, :])
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, 2 * I, BLOCK_K):
        if TMA:
            a = grad_gate_up_ptr.load([first_row, k0])
            b = w1_ptr.load([expert, k0, pid_n * BLOCK_N]).reshape(BLOCK_K, BLOCK_N)
        else:
            k_ok = offs_k < 2 * I - k0
            a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wn
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    tl.store(grad_x_pairs_ptr + wide_offset(pairs, H)[:, None] + offs_n[None, :],
             acc.to(grad_x_pairs_ptr.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _expert_rows(pid, expert_blocks_ptr, block_m, num_tiles_m, num_tiles_n, GROUP_M: tl.constexpr):
    """The expert, output tile (pid_m, pid_n) and layout row range [first_row, end_row) of
    weight-gradient program `pid`. Programs go expert by expert (an expert's rows stay in L2
    while its tiles run), in grouped order within an expert."""
    per_expert = num_tiles_m * num_tiles_n
    expert = pid // per_expert
    pid_m, pid_n = _tile_coordinates(pid % per_expert, num_tiles_m, num_tiles_n, GROUP_M)
    first_row = tl.load(expert_blocks_ptr + expert) * block_m
    end_row = tl.load(expert_blocks_ptr + expert + 1) * block_m
    return expert, pid_m, pid_n, first_row, end_row


@triton.jit
def _row_step(row_tokens_ptr, r0, end_row, offs_k, ROWS_ALIGNED: tl.constexpr):
    """Layout rows r0 + offs_k of a weight-gradient K step, whether each is inside the expert's
    range, and each one's token (-1: padding). With ROWS_ALIGNED (BLOCK_K divides the layout's
    BLOCK_M) a step never passes the expert's last block, so nothing needs the range mask."""
    rows = r0 + offs_k
    if ROWS_ALIGNED:  # a constant mask: folded away
        return rows, tl.full(offs_k.shape, 1, tl.int1), tl.load(row_tokens_ptr + rows)
    in_range = rows < end_row
    return rows, in_range, tl.load(row_tokens_ptr + rows, mask=in_range, other=-1)


@triton.jit
def _past_expert_zeroed(tile, in_range):
    """A layout-order tile loaded through a descriptor with its rows past the expert's range set
    to zero, as the pointer path's mask does. A descriptor only zero-fills past the tensor's end;
    before it, a step that passes the expert's last block (BLOCK_K not dividing the layout's
    BLOCK_M) reads the next expert's rows, or rows of unused blocks that nothing writes, and a
    zero from the gathered operand does not cancel an inf or NaN there."""
    return tl.where(in_range, tile, tl.zeros_like(tile))


# In both weight-gradient kernels one operand is gathered by token through the row's token
# index, loaded in the same K step. Triton pipelines such an indirect load num_stages - 2 deep on
# Hopper and num_stages - 3 deep elsewhere (configs.py sets the stages accordingly), given what
# the asynchronous copies need: rows known 16-byte aligned, i.e. a row stride Triton specialises
# as a multiple of 16 (H is one, so contiguous rows always are). The indices are tokens, not
# pairs, so no integer division sits between the index load and the gathered load (with
# unmasked row steps, 15-18% faster on an H100 at 16k tokens: Qwen3-30B-A3B's dW1 2.12 -> 1.74 ms).
@triton.jit(do_not_specialize=["block_m"])
def grad_w1_kernel(
    grad_gate_up_ptr, x_ptr, grad_w1_ptr, row_tokens_ptr, expert_blocks_ptr,
    H, I, block_m, stride_xt, stride_oe, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr, TMA: tl.constexpr, X_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """grad_w1: (E, 2I, H), strides (stride_oe, stride_om, stride_on) (w1's: contiguous, or a
    transposed view; H * stride_on < 2**31), grad_w1[e] = grad_gate_up[rows of e].T @ x[tokens of e].

    grad_gate_up: (rows, 2I) contiguous, layout order, zero on padding rows (read unmasked
    there; TMA: a descriptor of it, blocks (BLOCK_K, BLOCK_M)); x: (T, H), row stride stride_xt;
    row_tokens: (rows,) int32, -1 on padding rows; expert_blocks: (E + 1,) int32, expert e's
    layout blocks are [expert_blocks[e], expert_blocks[e + 1]).
    X_ROWS (with TMA): x is already in layout order, `gather_rows_kernel`'s (rows, H) copy with
    zero padding rows, read through a descriptor of (BLOCK_K, BLOCK_N) blocks like the other
    operand; row_tokens is not read. The same tiles meet in the same order: the same bits."""
    num_tiles_m = tl.cdiv(2 * I, BLOCK_M)
    expert, pid_m, pid_n, first_row, end_row = _expert_rows(tl.program_id(0), expert_blocks_ptr, block_m,
                                                            num_tiles_m, tl.cdiv(H, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < 2 * I
    n_ok = offs_n < H
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(first_row, end_row, BLOCK_K):
        if X_ROWS:  # no token to look up: a dense step
            in_range = r0 + offs_k < end_row
        else:
            rows, in_range, tokens = _row_step(row_tokens_ptr, r0, end_row, offs_k, ROWS_ALIGNED)
        # The A tile is read transposed straight from memory ((BLOCK_M, BLOCK_K), features
        # contiguous), so it goes to shared memory without a pass through registers.
        if TMA:
            a = tl.trans(grad_gate_up_ptr.load([r0, pid_m * BLOCK_M]))
            if not ROWS_ALIGNED:
                a = _past_expert_zeroed(a, in_range[None, :])
        else:
            a = tl.load(grad_gate_up_ptr + wide_offset(rows, 2 * I)[None, :] + offs_m[:, None],
                        mask=m_ok[:, None] & in_range[None, :], other=0.0)
        if X_ROWS:
            b = x_ptr.load([r0, pid_n * BLOCK_N])
            if not ROWS_ALIGNED:
                b = _past_expert_zeroed(b, in_range[:, None])
        else:
            b = tl.load(x_ptr + wide_offset(tokens, stride_xt)[:, None] + offs_n[None, :],
                        mask=(tokens >= 0)[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    out_offs = (wide_offset(expert, stride_oe) + wide_offset(offs_m, stride_om)[:, None]
                + (offs_n * stride_on)[None, :])
    tl.store(grad_w1_ptr + out_offs, acc.to(grad_w1_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


@triton.jit
def gather_rows_kernel(x_ptr, row_tokens_ptr, x_rows_ptr, num_rows, H, stride_xt,
                       BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr):
    """x_rows (num_rows, H) contiguous: row r = x[row_tokens[r]], zero where row_tokens[r] < 0
    (padding). x: (T, H), row stride stride_xt. For grad_w1_kernel's X_ROWS: where a weight
    gradient's gathered loads cost more than one copy of x in layout order (configs.py)."""
    rows = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    row_ok, col_ok = rows < num_rows, cols < H
    tokens = tl.load(row_tokens_ptr + rows, mask=row_ok, other=-1)
    values = tl.load(x_ptr + wide_offset(tokens, stride_xt)[:, None] + cols[None, :],
                     mask=(tokens >= 0)[:, None] & col_ok[None, :], other=0.0)
    tl.store(x_rows_ptr + wide_offset(rows, H)[:, None] + cols[None, :], values,
             mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["block_m"])
def grad_w2_kernel(
    grad_out_ptr, weighted_h_ptr, grad_w2_ptr, row_tokens_ptr, expert_blocks_ptr,
    H, I, block_m, stride_gt, stride_oe, stride_om, stride_on,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    ROWS_ALIGNED: tl.constexpr, TMA: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """grad_w2: (E, H, I), strides (stride_oe, stride_om, stride_on) (w2's: contiguous, or a
    transposed view; I * stride_on < 2**31), grad_w2[e] = grad_out[tokens of e].T @ weighted_h[rows of e].

    grad_out: (T, H), row stride stride_gt; weighted_h: (rows, I) contiguous, w_p * h_p in
    layout order, zero on padding rows (read unmasked there; TMA: a descriptor of it, blocks
    (BLOCK_K, BLOCK_N)); row_tokens, expert_blocks as for grad_w1_kernel."""
    num_tiles_m = tl.cdiv(H, BLOCK_M)
    expert, pid_m, pid_n, first_row, end_row = _expert_rows(tl.program_id(0), expert_blocks_ptr, block_m,
                                                            num_tiles_m, tl.cdiv(I, BLOCK_N), GROUP_M)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_ok = offs_m < H
    n_ok = offs_n < I
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(first_row, end_row, BLOCK_K):
        rows, in_range, tokens = _row_step(row_tokens_ptr, r0, end_row, offs_k, ROWS_ALIGNED)
        # dY rows gathered by token and read transposed ((BLOCK_M, BLOCK_K), H contiguous).
        a = tl.load(grad_out_ptr + wide_offset(tokens, stride_gt)[None, :] + offs_m[:, None],
                    mask=m_ok[:, None] & (tokens >= 0)[None, :], other=0.0)
        if TMA:
            b = weighted_h_ptr.load([r0, pid_n * BLOCK_N])
            if not ROWS_ALIGNED:
                b = _past_expert_zeroed(b, in_range[:, None])
        else:
            b = tl.load(weighted_h_ptr + wide_offset(rows, I)[:, None] + offs_n[None, :],
                        mask=in_range[:, None] & n_ok[None, :], other=0.0)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    out_offs = (wide_offset(expert, stride_oe) + wide_offset(offs_m, stride_om)[:, None]
                + (offs_n * stride_on)[None, :])
    tl.store(grad_w2_ptr + out_offs, acc.to(grad_w2_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
