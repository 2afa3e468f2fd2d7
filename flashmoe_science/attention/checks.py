"""Argument checks shared by the attention functions: each names the argument that is wrong and
what is allowed. The options are checked on every call, the tensors' shapes, dtypes and devices
when a call's plan is made (a later call with the same facts reuses the plan)."""
from __future__ import annotations

import math
import numbers

import torch

from ..device import check_runnable
from ..float8 import FP8_DTYPE

DTYPES = (torch.float16, torch.bfloat16, torch.float32)
NO_WINDOW = (-1, -1)


def check_tensor(name: str, t, ndim: int, dims: str, dtypes=DTYPES) -> None:
    """`t` is a tensor of `ndim` dimensions (named `dims` in the message) and one of `dtypes`."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {dims}, got shape {tuple(t.shape)}")
    if t.dtype not in dtypes:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {', '.join(str(d)[6:] for d in dtypes)}")


def check_inputs(q, k, v, packed: bool = False, fp8: bool = False) -> None:
    """q, k, v of a dense call (4-D), or of a packed variable-length call (3-D). v's head dim
    may differ from q's and k's (MLA: 192 and 128). fp8: float8 e4m3 inputs are allowed too (a
    forward whose descales `fp8.fp8_descales` checked)."""
    ndim, dims = (3, "(total_tokens, heads, head_dim)") if packed else (4, "(batch, heads, seqlen, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, t, ndim, dims, DTYPES + (FP8_DTYPE,) if fp8 else DTYPES)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_runnable("q", q)
    if k.shape[:-1] != v.shape[:-1]:
        raise ValueError(f"k and v must have the same shape but for the head dim, got k {tuple(k.shape)} and "
                         f"v {tuple(v.shape)}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q and k must have the same head_dim, got q {q.shape[-1]} and k {k.shape[-1]}")
    for name, head_dim in (("q, k", q.shape[-1]), ("v", v.shape[-1])):
        if not 16 <= head_dim <= 256:
            raise ValueError(f"head_dim of {name} (last dimension) must be between 16 and 256, got {head_dim}")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"the number of query heads ({heads_q}) must be a multiple of the number of "
                         f"key/value heads ({heads_kv})")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def is_symbolic(x) -> bool:
    """A value torch.compile traces symbolically: its checks run again when the op runs."""
    return isinstance(x, (torch.SymInt, torch.SymFloat))


def check_options(causal, softmax_scale) -> None:
    check_bool("causal", causal)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, torch.SymFloat)):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not is_symbolic(softmax_scale) and not -math.inf < softmax_scale < math.inf:  # NaN fails too
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")


def is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_band(window_size, softcap) -> tuple[int, int]:
    """Checks the sliding window and the softcap; returns window_size as a tuple of two ints."""
    if window_size is NO_WINDOW and softcap.__class__ is float and softcap == 0.0:  # the defaults
        return NO_WINDOW
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(is_int(w) or isinstance(w, torch.SymInt) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if not any(map(is_symbolic, window_size)) and min(window_size) < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded, got {tuple(window_size)}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, torch.SymFloat)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if is_symbolic(softcap):
        return tuple(window_size)
    if not 0 <= softcap < math.inf:  # comparisons, not math.isfinite, which torch.compile cannot trace
        raise ValueError(f"softcap must be a finite number >= 0 (0 turns it off), got {softcap}")
    if any(map(is_symbolic, window_size)):
        return tuple(window_size)
    return int(window_size[0]), int(window_size[1])


def check_backward_tensors(grad_output, q, v, out, lse, lse_shape, lse_description) -> None:
    """grad_output and output shaped like q with v's head dim, q's dtype and device; lse float32
    of `lse_shape`."""
    out_shape = (*q.shape[:-1], v.shape[-1])
    for name, t in (("grad_output", grad_output), ("output", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != out_shape:
            raise ValueError(f"{name} must have the shape of q with v's head dim {out_shape}, got {tuple(t.shape)}")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} must have the dtype of q ({q.dtype}), got {t.dtype}")
        if t.device != q.device:
            raise ValueError(f"{name} must be on the device of q ({q.device}), got {t.device}")
    if not isinstance(lse, torch.Tensor):
        raise TypeError(f"softmax_lse must be a torch.Tensor, got {type(lse).__name__}")
    if lse.shape != lse_shape:
        raise ValueError(f"softmax_lse must have shape {lse_description} = {tuple(lse_shape)}, "
                         f"got {tuple(lse.shape)}")
    if lse.dtype != torch.float32:
        raise TypeError(f"softmax_lse must be float32 (as the forward returns it), got {lse.dtype}")
    if lse.device != q.device:
        raise ValueError(f"softmax_lse must be on the device of q ({q.device}), got {lse.device}")


def check_flags(deterministic, return_lse) -> None:
    """The public functions' keyword flags."""
    check_bool("deterministic", deterministic)
    check_bool("return_lse", return_lse)
