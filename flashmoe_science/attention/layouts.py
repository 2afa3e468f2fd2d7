"""How a call's tensors and options become the kernels' arguments: the (batch, head, row) strides
of dense and packed tensors, the layout of outputs, the band and the scale as the kernels take
them, and the token totals packed batches clamp their cumulative lengths to."""
from __future__ import annotations

import torch

from ._kernels.forward import MIN_SCALE

LOG2E = 1.4426950408889634  # the kernels work in base 2: they take scale * log2(e)

# A window bound this wide is unbounded for any sequence the kernels can address; wider ones are
# clamped to it so that the kernels' int32 band arithmetic (row + bound) cannot overflow.
WIDEST_WINDOW = 1 << 30


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def row_strides(s: tuple, packed: bool) -> tuple:
    """The (batch, head, row) strides the kernels take from a tensor's strides s: those of a
    (B, H, S, D) tensor, or for a packed (total, H, D) one batch stride 0 (programs find a
    sequence by its first row)."""
    return (0, s[1], s[0]) if packed else tuple(s[:3])


def token_totals(q, k, packed: bool) -> tuple[int, int]:
    """(total_q, total_k) of a packed batch, the bounds the kernels clamp cu_seqlens to
    (`_kernels/forward.sequence_bounds`); (0, 0), unused, for a dense one."""
    return (q.shape[0], k.shape[0]) if packed else (0, 0)


def kernel_window(causal: bool, window_size) -> tuple[int, int]:
    """(window_left, window_right) as the kernels take them: -1 unbounded, right = 0 when causal."""
    left, right = (min(w, WIDEST_WINDOW) for w in window_size)
    return left, 0 if causal else right


def output_like(q: torch.Tensor, head_dim: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """A dense tensor shaped like q (with last dimension `head_dim` if given: v's, where it differs
    from q's; of `dtype`, q's if None) whose dimensions lie in memory in the order of q's strides, so a (B, S, H,
    D).transpose(1, 2) view gets a (B, S, H, D) result: also when q is a slice of a packed QKV
    projection, where empty_like falls back to a contiguous (B, H, S, D) tensor and the caller's
    transpose back to (B, S, H * D) would cost a copy."""
    shape = q.shape if head_dim is None else (*q.shape[:-1], head_dim)
    return torch.empty_strided(shape, dense_strides(shape, q.stride()), dtype=dtype or q.dtype, device=q.device)


def dense_strides(shape, strides=None) -> tuple:
    """The strides of `output_like` for a tensor of this shape and these strides: its dimensions'
    memory order, densely packed; contiguous where strides is None or its last stride is not 1."""
    last = len(shape) - 1
    if strides is None or strides[last] != 1:
        strides = range(len(shape), 0, -1)  # any decreasing strides: row-major order
    # Outermost first, stable on ties; a size-1 head dim with a tied stride stays innermost.
    order = sorted(range(last), key=lambda i: -strides[i]) + [last]
    dense, step = [0] * len(shape), 1
    for i in reversed(order):
        dense[i] = step
        step *= max(shape[i], 1)
    return tuple(dense)


def positive_scale(q, scale: float):
    """(q, scale) as the forward kernels take them: a positive scale. They take row maxima over
    unscaled scores and mask scores to -inf before scaling them (`forward.softmax_step`), so a
    negative scale runs as (-q).k * -scale, with -q in q's own strides (the caller's plan key and
    launch strides still describe it), and a zero one at MIN_SCALE (the same uniform weights)."""
    if scale < 0:
        q, scale = _negated_in_place_layout(q), -scale
    return q, max(scale, MIN_SCALE)


def _negated_in_place_layout(q: torch.Tensor) -> torch.Tensor:
    """-q with q's shape and strides: the span of memory q's elements cover, negated into a new
    buffer and viewed with q's strides. Works for every strided q, also expanded (stride 0) or
    otherwise overlapping ones, which no tensor written element by element can share strides with."""
    if q.numel() == 0:
        return q
    span = 1 + sum((n - 1) * st for n, st in zip(q.shape, q.stride()))
    region = q.as_strided((span,), (1,), q.storage_offset())
    return torch.neg(region).as_strided(q.shape, q.stride())
