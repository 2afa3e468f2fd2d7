"""The two expert GEMMs over the expert-sorted, block-aligned layout (see dispatch.py).

Both kernels map one program to one (BLOCK_M rows of the layout) x (BLOCK_N output columns)
tile. Every BLOCK_M block belongs to a single expert (`block_expert`), so a tile is an ordinary
dense GEMM tile against that expert's weights; blocks past the last expert (-1) exit at once
(gate_up_kernel writes zeros there first when it stores for a backward), and the rows of a
block past `block_rows[b]` are padding: masked on load and store.

gate_up_kernel: h[row] = act(x[t] @ w1[e, :I].T) * (x[t] @ w1[e, I:].T) for the pair p =
sorted_pairs[row], t = p // top_k. The token rows are gathered straight from x inside the
K loop (no permuted copy of the activations); the gate and up rows of the same columns are
interleaved in one B tile, so one product per K step yields both, the gated activation is an
epilogue, and the (rows, I) intermediate is written once (padding rows: zeros). When a backward pass will
follow (store_h_grads), the epilogue also writes the local derivatives of the gated
activation, dh/dgate = up * act'(gate) and dh/dup = act(gate), to a (rows, 2I) buffer
(padding rows: zeros): the backward multiplies them by dh instead of recomputing the gate/up
GEMM or the activation. store_h_grads is a runtime flag (a uniform branch in the epilogue),
so inference and training share one build.

down_kernel: y[p] = w[p] * (h[row] @ w2[e].T), reading h contiguously (rows in layout order)
and writing each row to its pair's slot p, so a token's k rows end up adjacent for the
deterministic combine (combine.py).

num_blocks_m and top_k are never value-specialised (they only index), so a build compiled for
one token count serves every other.

With TMA (sm90) the dense operands come through tensor descriptors instead of pointer loads: the
weight tiles of both kernels and the down kernel's h tile (the gathered token rows of gate_up
stay pointer loads). gate_up's descriptor views w1 (E, 2I, H) as (E, I, 2, H), so one box of
(1, BLOCK_N, 2, BLOCK_K) is the interleaved gate/up B tile of the pointer path, row for row; a
descriptor load fills what lies past I or H with zeros, as the pointer path's masks do, so the
same tiles meet the same products and the results are the same bits. The caller passes the
`triton.tools.tensor_descriptor.TensorDescriptor`s in the operands' pointer arguments.

Launch order: programs are grouped GROUP_M row blocks at a time over all column tiles
("swizzled"), so the tiles in flight share an expert's weight columns and the gathered token
rows in L2. With fp32 inputs tl.dot runs DOT_PRECISION (`device.fp32_dot_precision`: 3xTF32 or TF32).
"""
import triton
import triton.language as tl

from .. import configs
from ...dependent_launch import chain_start
from .offsets import wide_offset


# GELU's tanh approximation as a logistic: gelu(x) = x * sigmoid(GELU_SCALE * (x + GELU_CUBIC * x^3)),
# GELU_SCALE = 2 * sqrt(2 / pi) (the backward kernels differentiate the same expression).
GELU_SCALE = tl.constexpr(1.5957691216057308)
GELU_CUBIC = tl.constexpr(0.044715)
# gpt-oss's clamped SwiGLU ("swiglu_oai", `_clamped_swiglu`): configs.py's constants.
SWIGLU_OAI_ALPHA = tl.constexpr(configs.SWIGLU_OAI_ALPHA)
SWIGLU_OAI_LIMIT = tl.constexpr(configs.SWIGLU_OAI_LIMIT)


@triton.jit
def _tile_coordinates(pid, num_blocks_m, num_blocks_n, GROUP_M: tl.constexpr):
    """(row block, column tile) of tile `pid` in grouped launch order."""
    per_group = GROUP_M * num_blocks_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(num_blocks_m - first_m, GROUP_M)
    return first_m + (pid % per_group) % group_rows, (pid % per_group) // group_rows


@triton.jit
def _tile(sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, num_blocks_m, n_out,
          BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's tile: its expert (-1: nothing to do), layout rows (BLOCK_M,), which of
    them hold pairs, their pair indices, and its column tile (BLOCK_N columns out of n_out)."""
    return _tile_of(tl.program_id(0), sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, num_blocks_m, n_out,
                    BLOCK_M, BLOCK_N, GROUP_M)


@triton.jit
def _tile_of(pid, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, num_blocks_m, n_out,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """`_tile` of tile `pid` (where programs share a tile)."""
    pid_m, pid_n = _tile_coordinates(pid, num_blocks_m, tl.cdiv(n_out, BLOCK_N), GROUP_M)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = tl.arange(0, BLOCK_M) < tl.load(block_rows_ptr + pid_m)
    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_ok, other=0)
    return tl.load(block_expert_ptr + pid_m), rows, row_ok, pairs, pid_n


@triton.jit
def _expert_tile_ptrs(w_ptr, expert, stride_we, offs_n, stride_wn, offs_k, stride_wk):
    """Pointers to the (BLOCK_K, BLOCK_N) B-operand tile w[expert, offs_n, offs_k] of a weight
    tensor (E, N, K) of strides (stride_we, stride_wn, stride_wk): K contiguous as our weights
    are stored, or N contiguous (a transposed view, as transformers' gpt-oss stores them). The
    K offsets stay 32-bit (the launcher keeps BLOCK_K x stride_wk far below 2**31; with K
    contiguous, stride_wk is the constant 1)."""
    return (w_ptr + wide_offset(expert, stride_we) + wide_offset(offs_n, stride_wn)[None, :]
            + (offs_k * stride_wk)[:, None])


@triton.jit
def _activation_sigmoid(gate, ACTIVATION: tl.constexpr):
    """s with act(gate) = gate * s. silu: s = sigmoid(gate). GELU, tanh approximation, written
    as x * sigmoid(2u) (= 0.5 x (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3)):
    s = sigmoid(GELU_SCALE (gate + GELU_CUBIC gate^3))."""
    if ACTIVATION == "silu":
        return tl.sigmoid(gate)
    return tl.sigmoid(GELU_SCALE * (gate + GELU_CUBIC * gate * gate * gate))


@triton.jit
def _clamped_swiglu(gate, up):
    """gpt-oss's gated activation ("swiglu_oai") and its local derivatives: (h, dh/dgate, dh/dup)
    of h = (u + 1) * g * sigmoid(SWIGLU_OAI_ALPHA g), g = min(gate, SWIGLU_OAI_LIMIT),
    u = clamp(up, -SWIGLU_OAI_LIMIT, SWIGLU_OAI_LIMIT). Where a clamp holds its input at a bound
    the derivative through it is 0, as torch.clamp's (bounds included)."""
    g = tl.minimum(gate, SWIGLU_OAI_LIMIT)
    s = tl.sigmoid(SWIGLU_OAI_ALPHA * g)
    glu = g * s
    up1 = tl.minimum(tl.maximum(up, -SWIGLU_OAI_LIMIT), SWIGLU_OAI_LIMIT) + 1.0
    # s (1 + alpha g (1 - s)) = s + alpha glu (1 - s)
    dh_dgate = tl.where(gate <= SWIGLU_OAI_LIMIT, up1 * (s + SWIGLU_OAI_ALPHA * glu * (1.0 - s)), 0.0)
    dh_dup = tl.where(tl.abs(up) <= SWIGLU_OAI_LIMIT, glu, 0.0)
    return up1 * glu, dh_dgate, dh_dup


@triton.jit
def _gated_activation(gate, up, ACTIVATION: tl.constexpr):
    """SwiGLU: silu(gate) * up. GeGLU: gelu(gate) * up (tanh approximation). swiglu_oai:
    `_clamped_swiglu`."""
    if ACTIVATION == "swiglu_oai":
        return _clamped_swiglu(gate, up)[0]
    return gate * _activation_sigmoid(gate, ACTIVATION) * up


@triton.jit
def _gated_activation_grads(gate, up, ACTIVATION: tl.constexpr):
    """(dh/dgate, dh/dup) of h = act(gate) * up: (up * act'(gate), act(gate)). With
    act = gate * s, s = sigmoid(z): act' = s (1 + gate (1 - s) z'), where z = gate and z' = 1
    for silu, z = GELU_SCALE (gate + GELU_CUBIC gate^3) and z' = GELU_SCALE (1 + 3 GELU_CUBIC
    gate^2) for GELU. swiglu_oai: `_clamped_swiglu`'s."""
    if ACTIVATION == "swiglu_oai":
        _, dh_dgate, dh_dup = _clamped_swiglu(gate, up)
        return dh_dgate, dh_dup
    s = _activation_sigmoid(gate, ACTIVATION)
    if ACTIVATION == "silu":
        slope = gate * (1.0 - s)
    else:
        slope = gate * (1.0 - s) * (GELU_SCALE + (3.0 * GELU_SCALE * GELU_CUBIC) * gate * gate)
    return up * s * (1.0 + slope), gate * s


@triton.jit(do_not_specialize=["num_blocks_m", "top_k", "store_h_grads"])
def gate_up_kernel(
    x_ptr, w1_ptr, b1_ptr, h_ptr, h_grads_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    num_blocks_m, H, I, top_k, store_h_grads,
    stride_xt, stride_we, stride_wn, stride_wk, stride_be,
    ACTIVATION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA: tl.constexpr, HAS_BIAS: tl.constexpr, INTERLEAVED: tl.constexpr, PDL: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    """x: (T, H), row stride stride_xt; w1: (E, 2I, H), strides (stride_we, stride_wn,
    stride_wk) (TMA: a descriptor of its (E, I, 2, H) view, blocks (1, BLOCK_N, 2, BLOCK_K));
    column n's gate row is n and its up row I + n, or with INTERLEAVED (gate, up, gate, ...) 2n
    and 2n + 1. b1 (HAS_BIAS): (E, 2I) in w1's row order, strides (stride_be, 1), added to the
    products before the activation.
    h: (num_blocks_m * BLOCK_M, I) contiguous, in x's dtype; h_grads (written when
    store_h_grads is 1): (num_blocks_m * BLOCK_M, 2I) contiguous, in x's dtype,
    [dh/dgate, dh/dup]. PDL: launched as a programmatic dependent (`dependent_launch`)."""
    chain_start(PDL)
    expert, rows, row_ok, pairs, pid_n = _tile(sorted_pairs_ptr, block_expert_ptr, block_rows_ptr, num_blocks_m, I,
                                               BLOCK_M, BLOCK_N, GROUP_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < I
    if expert < 0:
        if store_h_grads:  # the layout's unused blocks, saved for the backward: zeros, never stale memory
            zeros = tl.zeros((BLOCK_M, BLOCK_N), dtype=h_ptr.dtype.element_ty)
            h_grads_offs = wide_offset(rows, 2 * I)[:, None] + offs_n[None, :]
            tl.store(h_grads_ptr + h_grads_offs, zeros, mask=n_ok[None, :])
            tl.store(h_grads_ptr + I + h_grads_offs, zeros, mask=n_ok[None, :])
            tl.store(h_ptr + wide_offset(rows, I)[:, None] + offs_n[None, :], zeros, mask=n_ok[None, :])
        return
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + wide_offset(pairs // top_k, stride_xt)[:, None] + offs_k[None, :]
    # One B tile of 2 * BLOCK_N columns alternating the gate and up rows of w1: a single product
    # per K step (9-21% faster on an H100 at 16k tokens than a gate and an up product sharing
    # the A tile), whose accumulator splits into gate and up in registers.
    offs_c = tl.arange(0, 2 * BLOCK_N)
    col_n = pid_n * BLOCK_N + offs_c // 2
    if INTERLEAVED:  # the tile's rows are consecutive: unit-stride loads where w1 is stored transposed
        w_rows = pid_n * (2 * BLOCK_N) + offs_c
    else:
        w_rows = (offs_c % 2) * I + col_n
    if not TMA:
        w_ptrs = _expert_tile_ptrs(w1_ptr, expert, stride_we, w_rows, stride_wn, offs_k, stride_wk)
    acc = tl.zeros((BLOCK_M, 2 * BLOCK_N), dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        k_ok = offs_k < H - k0
        a = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if TMA:
            b = tl.trans(w1_ptr.load([expert, pid_n * BLOCK_N, 0, k0]).reshape(2 * BLOCK_N, BLOCK_K))
        else:
            b = tl.load(w_ptrs, mask=k_ok[:, None] & (col_n < I)[None, :], other=0.0)
            w_ptrs += BLOCK_K * stride_wk
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        x_ptrs += BLOCK_K
    if HAS_BIAS:
        bias = tl.load(b1_ptr + wide_offset(expert, stride_be) + w_rows, mask=col_n < I, other=0.0)
        acc += bias.to(tl.float32)[None, :]
    acc_gate, acc_up = tl.split(tl.reshape(acc, (BLOCK_M, BLOCK_N, 2)))
    if store_h_grads:
        if ACTIVATION == "swiglu_oai":
            h, dh_dgate, dh_dup = _clamped_swiglu(acc_gate, acc_up)
        else:
            dh_dgate, dh_dup = _gated_activation_grads(acc_gate, acc_up, ACTIVATION)
            h = dh_dup * acc_up  # act(gate) * up
        h_grads_offs = wide_offset(rows, 2 * I)
        tl.store(h_grads_ptr + h_grads_offs[:, None] + offs_n[None, :], dh_dgate.to(h_grads_ptr.dtype.element_ty),
                 mask=n_ok[None, :])
        tl.store(h_grads_ptr + I + h_grads_offs[:, None] + offs_n[None, :], dh_dup.to(h_grads_ptr.dtype.element_ty),
                 mask=n_ok[None, :])
    else:
        h = _gated_activation(acc_gate, acc_up, ACTIVATION)
    tl.store(h_ptr + wide_offset(rows, I)[:, None] + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=n_ok[None, :])


@triton.jit(do_not_specialize=["num_blocks_m"])
def down_kernel(
    h_ptr, w2_ptr, b2_ptr, y_ptr, weights_ptr, sorted_pairs_ptr, block_expert_ptr, block_rows_ptr,
    num_blocks_m, H, I,
    stride_we, stride_wn, stride_wk, stride_be,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
    TMA: tl.constexpr, HAS_BIAS: tl.constexpr, PDL: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """h: (num_blocks_m * BLOCK_M, I) contiguous; w2: (E, H, I), strides (stride_we,
    stride_wn, stride_wk); b2 (HAS_BIAS): (E, H), strides (stride_be, 1), added to each
    product before the routing weight scales it; weights: (T * top_k,) fp32 routing weights;
    y: (T * top_k, H) contiguous. TMA: h and w2 are descriptors, blocks (BLOCK_M, BLOCK_K) and
    (1, BLOCK_N, BLOCK_K). PDL: launched as a programmatic dependent (`dependent_launch`)."""
    chain_start(PDL)
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
        h_ptrs = h_ptr + wide_offset(rows, I)[:, None] + offs_k[None, :]
        w_ptrs = _expert_tile_ptrs(w2_ptr, expert, stride_we, offs_n, stride_wn, offs_k, stride_wk)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        if TMA:
            a = h_ptr.load([first_row, k0])
            b = tl.trans(w2_ptr.load([expert, pid_n * BLOCK_N, k0]).reshape(BLOCK_N, BLOCK_K))
        else:
            k_ok = offs_k < I - k0
            a = tl.load(h_ptrs, mask=k_ok[None, :], other=0.0)
            b = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            h_ptrs += BLOCK_K
            w_ptrs += BLOCK_K * stride_wk
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    if HAS_BIAS:
        acc += tl.load(b2_ptr + wide_offset(expert, stride_be) + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    route_weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0)
    y = acc * route_weight[:, None]
    tl.store(y_ptr + wide_offset(pairs, H)[:, None] + offs_n[None, :], y.to(y_ptr.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])
