"""FP8 attention: q, k and v in float8 e4m3 with FlashAttention-3's per-(batch, KV head) descales.

`flash_attention_science`, `flash_attention_forward` and `flash_attention_varlen` (descales per
sequence) take FP8 q, k, v (all three) with
`q_descale`, `k_descale`, `v_descale`, float32 tensors of shape (B, Hkv): the stored values times
their descale are the real ones. Both products run on the FP8 tensor cores with fp32
accumulation; the output is bf16 and lse is returned as usual. Which kernel runs is the forward's
choice (`forward.py`): on sm90 the Gluon kernel, whose FP8 products read V transposed, its keys
in the order P's registers hold them (`fp8_value_tiles`, a copy of v per call, by a kernel of its
own); on sm89 and in
Triton's CPU interpreter the generic kernel. The kernels' side of the descales,
and how P is quantised, is described at `_kernels/forward.attention_forward_kernel`.

From 16-bit tensors to an FP8 call in one line:

    out = flash_attention_science(**fp8_attention_inputs(q, k, v, rotate=True), causal=True)

`fp8_attention_inputs` quantises with one scale per (batch, KV head) (the KV head's whole group
of query heads for q), after an optional `hadamard_rotate` of q and k: the same random orthogonal
matrix on both leaves every score q.k unchanged in exact arithmetic and spreads an outlier channel
over all of them, which FP8's few mantissa bits then represent better (FlashAttention-3's
incoherent processing).
"""
from __future__ import annotations

import functools

import torch

from ..float8 import FP8_DTYPE, FP8_MAX, check_fp8_device
from ..launch import KernelLauncher
from ._kernels.value_tiles import KEY_GROUP, fp8_value_tiles_kernel
from .configs import FP8_MIN_HEAD_DIM, head_dim_block

# The output dtype of FP8 attention (FlashAttention-3's).
FP8_OUT_DTYPE = torch.bfloat16
DESCALE_NAMES = ("q_descale", "k_descale", "v_descale")


def is_fp8(*tensors) -> bool:
    """Whether any of `tensors` is FP8 (then the FP8 checks say whether all are)."""
    return any(getattr(t, "dtype", None) == FP8_DTYPE for t in tensors)


def fp8_descales(q, k, v, q_descale, k_descale, v_descale, softmax_scale, packed_batch=None) -> torch.Tensor | None:
    """The descales the kernels read, a float32 (B, Hkv, 3) tensor of (q, k, v) descales (ones
    where None), after checking the FP8 arguments of a dense call (q (B, Hq, Sq, D), k and v
    (B, Hkv, Sk, D)) or, with `packed_batch` = B sequences, of a packed one (q (total_q, Hq, D), k
    and v (total_k, Hkv, D)); None for a call without FP8 tensors or descales."""
    given = (q_descale, k_descale, v_descale)
    if not is_fp8(q, k, v):
        for name, t in zip(DESCALE_NAMES, given):
            if t is not None:
                raise ValueError(f"{name} applies to FP8 inputs only (q, k and v in torch.float8_e4m3fn); "
                                 f"q is {getattr(q, 'dtype', type(q).__name__)}")
        return None
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or t.dtype != FP8_DTYPE:
            raise TypeError(f"FP8 attention needs q, k and v all in torch.float8_e4m3fn; "
                            f"{name} is {getattr(t, 'dtype', type(t).__name__)}")
        if packed_batch is None and t.dim() != 4:
            raise ValueError(f"{name} must have 4 dimensions (batch, heads, seqlen, head_dim), got shape "
                             f"{tuple(t.shape)}")
        if packed_batch is not None and t.dim() != 3:
            raise ValueError(f"{name} must have 3 dimensions (total_tokens, heads, head_dim), got shape "
                             f"{tuple(t.shape)}")
    if softmax_scale is not None and not isinstance(softmax_scale, bool) and \
            isinstance(softmax_scale, (int, float)) and softmax_scale < 0:
        raise ValueError(f"FP8 attention takes softmax_scale >= 0, got {softmax_scale}")
    check_fp8_device("FP8 attention", q)
    for name, head_dim in (("q, k", q.shape[-1]), ("v", v.shape[-1])):
        if not FP8_MIN_HEAD_DIM <= head_dim <= 256:
            raise ValueError(f"FP8 attention needs head dims from {FP8_MIN_HEAD_DIM} to 256 (an FP8 product sums "
                             f"at least 32 along K); head_dim of {name} is {head_dim}")
    batch, heads_kv = (k.shape[0], k.shape[1]) if packed_batch is None else (packed_batch, k.shape[1])
    columns = []
    for name, t in zip(DESCALE_NAMES, given):
        if t is None:
            columns.append(None)
            continue
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
        if t.dtype != torch.float32:
            raise TypeError(f"{name} must be float32, got {t.dtype}")
        if tuple(t.shape) != (batch, heads_kv):
            raise ValueError(f"{name} must have shape (batch, heads_kv) = {(batch, heads_kv)}, got {tuple(t.shape)}")
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device}; it must be on q's device ({q.device})")
        columns.append(t)
    ones = torch.ones((batch, heads_kv), dtype=torch.float32, device=q.device)
    return torch.stack([ones if t is None else t for t in columns], dim=-1)


def refuse_fp8_gradients(q, k, v) -> None:
    """FP8 attention is a forward: a clear error for tensors that require grad."""
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v)):
        raise RuntimeError("FP8 attention is forward only: q, k and v must not require grad")


# The sm90 kernel's FP8 P V product reads V keys-last in groups of this many keys (`fp8_value_tiles`).
VALUE_KEY_GROUP = KEY_GROUP.value
VALUE_TILE_KEYS = 64  # keys a program of the copy moves
_VALUE_TILES = KernelLauncher("attention_fp8_value_tiles", fp8_value_tiles_kernel)


def fp8_value_tiles(v: torch.Tensor) -> torch.Tensor:
    """v (B, Hkv, Sk, D) in FP8, any strides, as the sm90 kernel's FP8 P V product reads it:
    (B, Hkv, D, Sk') with the keys the unit-stride dimension (FP8 products read both operands
    K-major), Sk' = Sk padded with zero keys to a multiple of 16, and within each 16 keys the
    order in which P's registers hold them (`forward_gluon._p_operand`): position 4c + 2h + e
    holds key 8h + 2c + e. One copy of v per call (`_kernels/value_tiles.py`)."""
    batch, heads, seqlen, head_dim = v.shape
    padded = -(-seqlen // VALUE_KEY_GROUP) * VALUE_KEY_GROUP
    out = torch.empty((batch, heads, head_dim, padded), dtype=v.dtype, device=v.device)
    if out.numel():
        source = v.view(torch.uint8)  # bytes: the copy converts nothing
        # What the build specialises on (shape, strides, alignment): the launcher's cache key.
        key = (tuple(v.shape), v.stride(), v.data_ptr() % 16, v.device)
        _VALUE_TILES.launch(key, (batch * heads, -(-padded // VALUE_TILE_KEYS), 1),
                            (source, out.view(torch.uint8), *source.stride(), heads, seqlen, padded, head_dim,
                             head_dim_block(head_dim), VALUE_TILE_KEYS),
                            num_warps=4, num_stages=1, device_index=v.device.index if v.is_cuda else None)
    return out


def _power_of_two_blocks(n: int) -> list[int]:
    """n as a sum of powers of two, largest first (its binary digits)."""
    return [1 << b for b in range(n.bit_length() - 1, -1, -1) if n >> b & 1]


@functools.lru_cache(maxsize=32)
def _rotation(head_dim: int, seed: int) -> torch.Tensor:
    blocks = []
    for size in _power_of_two_blocks(head_dim):
        h = torch.ones((1, 1), dtype=torch.float64)
        while h.shape[0] < size:  # Sylvester's construction
            h = torch.cat((torch.cat((h, h), 1), torch.cat((h, -h), 1)), 0)
        blocks.append(h / size ** 0.5)
    signs = torch.randint(0, 2, (head_dim,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64)
    return (1.0 - 2.0 * signs.to(torch.float64))[:, None] * torch.block_diag(*blocks)


def hadamard_matrix(head_dim: int, *, seed: int = 0, device=None, dtype=torch.float32) -> torch.Tensor:
    """An orthogonal (head_dim, head_dim) matrix R = diag(s) H: random signs s (from `seed`) times
    the normalised Walsh-Hadamard matrix H, block-diagonal over the powers of two that sum to
    head_dim when it is not one (96 = 64 + 32, 192 = 128 + 64). Rows x become x R."""
    if not isinstance(head_dim, int) or isinstance(head_dim, bool) or head_dim < 1:
        raise ValueError(f"head_dim must be a positive int, got {head_dim!r}")
    return _rotation(head_dim, int(seed)).to(device=device, dtype=dtype)


def hadamard_rotate(q: torch.Tensor, k: torch.Tensor, *, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(q R, k R) for `hadamard_matrix` R of their head dim: every score q.k is unchanged (R is
    orthogonal), and an outlier channel spreads over all channels. Computed in fp32, returned in the
    inputs' dtypes."""
    for name, t in (("q", q), ("k", k)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == FP8_DTYPE:
            raise TypeError(f"{name} must be a 16- or 32-bit floating-point tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got {q.shape[-1]} and {k.shape[-1]}")
    r = hadamard_matrix(q.shape[-1], seed=seed, device=q.device)
    return (q.float() @ r).to(q.dtype), (k.float() @ r).to(k.dtype)


# Elements quantize_per_kv_head converts at once: its fp32 temporaries stay near 1 GiB however
# large the tensor (a serving-sized KV cache is tens of GiB in bf16).
_QUANTIZE_CHUNK = 1 << 28


def _quantize(grouped: torch.Tensor, expand: torch.Tensor) -> torch.Tensor:
    return (grouped.float() / expand).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def quantize_per_kv_head(x: torch.Tensor, heads_kv: int, cu_seqlens=None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in FP8, descale (B, heads_kv)): one scale per batch entry (sequence, for a packed x with
    `cu_seqlens`) and KV head, over the head's group of heads, its largest magnitude mapped to
    FP8_MAX. x: (B, H, S, D), or packed (total, H, D); the result keeps x's strides. A dense x is
    converted a few (batch entry, KV head) slices at a time."""
    grouped = x.unflatten(1, (heads_kv, x.shape[1] // heads_kv))
    if cu_seqlens is not None:  # (total, Hkv, G, D): each token's largest magnitude, then each sequence's
        batch = cu_seqlens.numel() - 1
        lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).long()
        sequence = torch.repeat_interleave(torch.arange(batch, device=x.device), lengths)
        token_amax = grouped.abs().amax(dim=(2, 3)).float() if x.numel() else x.new_zeros((0, heads_kv),
                                                                                           dtype=torch.float32)
        amax = torch.zeros((batch, heads_kv), dtype=torch.float32, device=x.device).scatter_reduce_(
            0, sequence[:, None].expand(-1, heads_kv), token_amax, reduce="amax")
        descale = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        return _quantize(grouped, descale[sequence][:, :, None, None]).flatten(1, 2), descale
    out = torch.empty_like(x, dtype=FP8_DTYPE)
    out_grouped = out.unflatten(1, grouped.shape[1:3])
    batch = x.shape[0]
    descale = torch.ones((batch, heads_kv), dtype=torch.float32, device=x.device)
    per_head = max(grouped[0, 0].numel(), 1) if batch and heads_kv else 1
    heads_at_once = max(1, min(heads_kv, _QUANTIZE_CHUNK // per_head))
    batch_at_once = max(1, _QUANTIZE_CHUNK // (per_head * heads_kv)) if heads_at_once == heads_kv else 1
    for b in range(0, batch, batch_at_once):
        for h in range(0, heads_kv, heads_at_once):
            part = grouped[b:b + batch_at_once, h:h + heads_at_once]
            if not part.numel():
                continue
            amax = part.abs().amax(dim=(2, 3, 4)).float()
            scale = descale[b:b + batch_at_once, h:h + heads_at_once]
            scale.copy_(torch.where(amax > 0, amax / FP8_MAX, scale))
            out_grouped[b:b + batch_at_once, h:h + heads_at_once] = _quantize(part, scale[:, :, None, None, None])
    return out, descale


def fp8_attention_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, rotate: bool = False,
                         seed: int = 0, cu_seqlens_q=None, cu_seqlens_k=None) -> dict:
    """q (B, Hq, Sq, D), k (B, Hkv, Sk, D), v (B, Hkv, Sk, D_v), 16- or 32-bit, as the keyword
    arguments of an FP8 attention call: {"q", "k", "v"} in float8 e4m3 and {"q_descale",
    "k_descale", "v_descale"} float32 (B, Hkv). rotate: `hadamard_rotate` q and k first (`seed`
    picks the signs). A packed batch, as `flash_attention_varlen` takes it: q (total_q, Hq, D),
    k and v (total_k, Hkv, D) with their int32 `cu_seqlens_q`, `cu_seqlens_k`; one scale per
    sequence and KV head (the sequences' lengths are read to the host). Non-finite inputs give
    non-finite scales, hence NaN outputs."""
    packed = cu_seqlens_q is not None or cu_seqlens_k is not None
    ndim, dims = (3, "(total_tokens, heads, head_dim)") if packed else (4, "(batch, heads, seqlen, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor) or not t.is_floating_point() or t.dtype == FP8_DTYPE:
            raise TypeError(f"{name} must be a 16- or 32-bit floating-point tensor, got "
                            f"{getattr(t, 'dtype', type(t).__name__)}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions {dims}, got shape {tuple(t.shape)}")
    if packed:
        for name, cu, t in (("cu_seqlens_q", cu_seqlens_q, q), ("cu_seqlens_k", cu_seqlens_k, k)):
            if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.numel() < 1 or cu.is_floating_point():
                raise ValueError(f"{name} must be a 1-D integer tensor of batch + 1 cumulative lengths (both or "
                                 f"neither given), got {cu!r:.80}")
            if int(cu[0]) != 0 or int(cu[-1]) != t.shape[0] or bool((cu[1:] < cu[:-1]).any()):
                raise ValueError(f"{name} must rise from 0 to {t.shape[0]} (the tokens of its tensor)")
        if cu_seqlens_q.numel() != cu_seqlens_k.numel():
            raise ValueError("cu_seqlens_q and cu_seqlens_k must count the same sequences")
    heads_kv = k.shape[1]
    if heads_kv == 0 or q.shape[1] % heads_kv or v.shape[1] != heads_kv:
        raise ValueError(f"q's heads ({q.shape[1]}) must be a multiple of k's ({heads_kv}), and v must have k's")
    if rotate:
        q, k = hadamard_rotate(q, k, seed=seed)
    (q8, qd), (k8, kd), (v8, vd) = (quantize_per_kv_head(t, heads_kv, cu) for t, cu in
                                    ((q, cu_seqlens_q), (k, cu_seqlens_k), (v, cu_seqlens_k)))
    return dict(q=q8, k=k8, v=v8, q_descale=qd, k_descale=kd, v_descale=vd)
