"""Public attention functions: argument checks, output allocation, dispatch and launch.

The kernels live in `_kernels/`; this module is the contract for dense (B, H, S, D) batches, and
holds the launch path `varlen.py` shares for packed variable-length ones. A call with the same
shapes, strides, dtypes, devices and options as an earlier one skips every check and
configuration decision (a dictionary lookup on a key of those facts) and launches the cached
compiled kernel directly, because on small inputs host time decides the speed users feel.

Calls that need gradients run under a torch.autograd.Function; calls traced by torch.compile
go through the torch.library custom ops of `ops.py`, which carry fake implementations and the
same backward.
"""
from __future__ import annotations

import math
import numbers

import torch

from ..device import check_runnable, info_for
from ..launch import KernelLauncher
from ._kernels.backward import (DQ_MODES, attention_backward_dkdv_kernel, attention_backward_dq_kernel,
                                attention_backward_preprocess_kernel)
from ._kernels.forward import attention_forward_kernel
from . import hopper
from .configs import (HOPPER_MIN_FLOPS, PREPROCESS_WARPS, backward_config, dkdv_maxnreg, forward_config,
                      gluon_backward_config, head_dim_block, hopper_forward_config, preprocess_block_m)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_LOG2E = 1.4426950408889634
NO_WINDOW = (-1, -1)
# A window bound this wide is unbounded for any sequence the kernels can address; wider ones are
# clamped to it so that the kernels' int32 band arithmetic (row + bound) cannot overflow.
_WIDEST_WINDOW = 1 << 30

_FORWARD = KernelLauncher("attention_forward", attention_forward_kernel, fp32_dots=True)
_BACKWARD_PREPROCESS = KernelLauncher("attention_backward_preprocess", attention_backward_preprocess_kernel)
_BACKWARD_DKDV = KernelLauncher("attention_backward_dkdv", attention_backward_dkdv_kernel, fp32_dots=True)
_BACKWARD_DQ = KernelLauncher("attention_backward_dq", attention_backward_dq_kernel, fp32_dots=True)
_MAX_PLANS = 4096


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def _row_strides(s: tuple, packed: bool) -> tuple:
    """The (batch, head, row) strides the kernels take from a tensor's strides s: those of a
    (B, H, S, D) tensor, or for a packed (total, H, D) one batch stride 0 (programs find a
    sequence by its first row)."""
    return (0, s[1], s[0]) if packed else tuple(s[:3])


def _token_totals(q, k, packed: bool) -> tuple[int, int]:
    """(total_q, total_k) of a packed batch, the bounds the kernels clamp cu_seqlens to
    (`forward.sequence_bounds`); (0, 0), unused, for a dense one."""
    return (q.shape[0], k.shape[0]) if packed else (0, 0)


def _kernel_window(causal: bool, window_size) -> tuple[int, int]:
    """(window_left, window_right) as the kernels take them: -1 unbounded, right = 0 when causal."""
    left, right = (min(w, _WIDEST_WINDOW) for w in window_size)
    return left, 0 if causal else right


class _ForwardPlan:
    """Everything about a forward call that depends only on its shapes, strides, dtypes and options.

    Dense calls: q (B, Hq, Sq, D), k and v (B, Hkv, Sk, D). Packed variable-length calls: q
    (total_q, Hq, D), k and v (total_k, Hkv, D), `batch` sequences of at most `seqlen_q` queries
    and `seqlen_k` keys; lse is then (Hq, total_q).
    """

    __slots__ = ("empty", "contiguous", "config", "grid", "default_scale", "softcap", "packed", "lse_shape",
                 "device_index", "kernel_options", "launch_tail", "hopper", "window", "causal", "out_strides")

    def __init__(self, q, k, v, batch, seqlen_q, seqlen_k, causal, window_size, softcap, write_lse, packed,
                 config=None):
        heads_q, head_dim = q.shape[1], q.shape[-1]
        self.contiguous = q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1
        # `_output_like` of the q the kernel runs on (a contiguous copy where `contiguous`)
        self.out_strides = _dense_strides(q.shape, None if self.contiguous else q.stride())
        self.empty = q.numel() == 0
        self.default_scale = 1.0 / math.sqrt(head_dim)
        self.softcap = float(softcap)
        self.packed = packed
        self.lse_shape = (heads_q, q.shape[0]) if packed else (batch, heads_q, seqlen_q)
        self.device_index = q.device.index if q.device.type == "cuda" else None
        cfg = self.config = config or forward_config(info_for(q), q.element_size(), head_dim, seqlen_q,
                                                     batch * heads_q, packed)
        num_m_blocks = _cdiv(seqlen_q, cfg.block_m)
        self.grid = (num_m_blocks * batch * heads_q, 1, 1)
        lse_strides = (0, q.shape[0]) if packed else (heads_q * seqlen_q, seqlen_q)
        # The kernel arguments after the tensors' strides; the strides join them at the first
        # launch, once the output (whose layout follows q's) exists.
        self.kernel_options = (*lse_strides, heads_q, heads_q // k.shape[1], seqlen_q, seqlen_k,
                               *_token_totals(q, k, packed), num_m_blocks,
                               *_kernel_window(causal, window_size), head_dim, head_dim_block(head_dim),
                               cfg.block_m, cfg.block_n, causal, softcap > 0, packed, write_lse)
        self.launch_tail = None
        self.causal = causal
        self.window = _kernel_window(causal, window_size)
        # Large dense 16-bit calls on sm90 take the TMA kernel when the tensors allow it.
        flops = 4.0 * batch * heads_q * seqlen_q * seqlen_k * head_dim
        self.hopper = None
        if config is None and not packed and not self.contiguous and q.is_cuda:
            masked = causal or any(w >= 0 for w in window_size)
            hopper_cfg = hopper_forward_config(info_for(q), q.element_size(), head_dim, flops, softcap > 0, masked,
                                               seqlen_k)
            if hopper_cfg is not None and hopper.supports(q, k, v):
                self.hopper = hopper_cfg


_PLANS: dict = {}


def _remember(plans: dict, key, plan) -> None:
    if len(plans) >= _MAX_PLANS:
        plans.clear()
    plans[key] = plan


def _plan_key(q, k, v, causal, window_size, softcap, write_lse):
    return (q.shape, k.shape, v.shape, q.stride(), k.stride(), v.stride(), q.dtype, k.dtype, v.dtype,
            q.device, k.device, v.device, causal, window_size, softcap, write_lse,
            q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)


def _check_inputs(q, k, v, packed: bool = False) -> None:
    """q, k, v of a dense call (4-D), or of a packed variable-length call (3-D)."""
    ndim, dims = (3, "(total_tokens, heads, head_dim)") if packed else (4, "(batch, heads, seqlen, head_dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != ndim:
            raise ValueError(f"{name} must have {ndim} dimensions {dims}, got shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: float16, bfloat16, float32")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k and v must be on one device, got {q.device}, {k.device}, {v.device}")
    check_runnable("q", q)
    if k.shape != v.shape:
        raise ValueError(f"k and v must have the same shape, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if not packed and q.shape[0] != k.shape[0]:
        raise ValueError(f"q and k must have the same batch size, got {q.shape[0]} and {k.shape[0]}")
    if q.shape[-1] != k.shape[-1]:
        raise ValueError(f"q, k and v must have the same head_dim, got q {q.shape[-1]} and k/v {k.shape[-1]}")
    head_dim = q.shape[-1]
    if not 16 <= head_dim <= 256:
        raise ValueError(f"head_dim (last dimension of q, k, v) must be between 16 and 256, got {head_dim}")
    heads_q, heads_kv = q.shape[1], k.shape[1]
    if heads_kv == 0 or heads_q % heads_kv != 0:
        raise ValueError(f"the number of query heads ({heads_q}) must be a multiple of the number of "
                         f"key/value heads ({heads_kv})")


def check_bool(name: str, value) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def _is_symbolic(x) -> bool:
    """A value torch.compile traces symbolically: its checks run again when the op runs."""
    return isinstance(x, (torch.SymInt, torch.SymFloat))


def _check_options(causal, softmax_scale) -> None:
    check_bool("causal", causal)
    if softmax_scale is not None:
        if isinstance(softmax_scale, bool) or not isinstance(softmax_scale, (int, float, torch.SymFloat)):
            raise TypeError(f"softmax_scale must be a float or None, got {type(softmax_scale).__name__}")
        if not _is_symbolic(softmax_scale) and not -math.inf < softmax_scale < math.inf:  # NaN fails too
            raise ValueError(f"softmax_scale must be finite, got {softmax_scale}")


def _is_int(x) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def check_band(window_size, softcap) -> tuple[int, int]:
    """Checks the sliding window and the softcap; returns window_size as a tuple of two ints."""
    if (not isinstance(window_size, (tuple, list)) or len(window_size) != 2
            or not all(_is_int(w) or isinstance(w, torch.SymInt) for w in window_size)):
        raise TypeError(f"window_size must be a pair of ints (left, right), got {window_size!r}")
    if not any(map(_is_symbolic, window_size)) and min(window_size) < -1:
        raise ValueError(f"window_size entries must be >= 0, or -1 for unbounded, got {tuple(window_size)}")
    if isinstance(softcap, bool) or not isinstance(softcap, (int, float, torch.SymFloat)):
        raise TypeError(f"softcap must be a float, got {type(softcap).__name__}")
    if _is_symbolic(softcap):
        return tuple(window_size)
    if not 0 <= softcap < math.inf:  # comparisons, not math.isfinite, which torch.compile cannot trace
        raise ValueError(f"softcap must be a finite number >= 0 (0 turns it off), got {softcap}")
    if any(map(_is_symbolic, window_size)):
        return tuple(window_size)
    return int(window_size[0]), int(window_size[1])


def _output_like(q: torch.Tensor) -> torch.Tensor:
    """A dense tensor shaped like q whose dimensions lie in memory in the order of q's strides,
    so a (B, S, H, D).transpose(1, 2) view gets a (B, S, H, D) result: also when q is a slice of
    a packed QKV projection, where empty_like falls back to a contiguous (B, H, S, D) tensor and
    the caller's transpose back to (B, S, H * D) would cost a copy."""
    return torch.empty_strided(q.shape, _dense_strides(q.shape, q.stride()), dtype=q.dtype, device=q.device)


def _dense_strides(shape, strides=None) -> tuple:
    """The strides of `_output_like` for a tensor of this shape and these strides: its dimensions'
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


def run_forward(plan: _ForwardPlan, key, q, k, v, cu_seqlens_q, cu_seqlens_k, softmax_scale, write_lse,
                sequence_order=None):
    """Launches the forward kernel for a plan: returns (out, lse), lse None unless `write_lse`.
    `key` (None: Triton's ordinary launch path) must determine the plan, as `_plan_key` does.
    Packed batches pass their cumulative lengths and `sequence_order` (`varlen.longest_first`)."""
    if plan.contiguous:
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty_strided(q.shape, plan.out_strides, dtype=q.dtype, device=q.device)
    lse = torch.empty(plan.lse_shape, dtype=torch.float32, device=q.device) if write_lse else None
    if plan.empty:
        return out, lse
    scale = plan.default_scale if softmax_scale is None else float(softmax_scale)
    q, scale = hopper.positive_scale(q, scale)
    softcap = plan.softcap
    if plan.hopper is not None:
        gluon, cfg = plan.hopper
        if gluon:
            hopper.launch_gluon(q, k, v, out, lse, scale, cfg, plan.window, causal=plan.causal,
                                device_index=plan.device_index, key=key)
        else:
            hopper.launch(q, k, v, out, lse, scale, softcap, cfg, plan.window, causal=plan.causal,
                          device_index=plan.device_index, key=key)
        return out, lse
    tail = plan.launch_tail
    if tail is None:
        packed = plan.packed
        tail = plan.launch_tail = (*_row_strides(q.stride(), packed), *_row_strides(k.stride(), packed),
                                   *_row_strides(v.stride(), packed), *_row_strides(out.stride(), packed)
                                   ) + plan.kernel_options
    cfg = plan.config
    _FORWARD.launch(key, plan.grid, (q, k, v, out, lse if write_lse else out, cu_seqlens_q, cu_seqlens_k,
                                     sequence_order, scale * _LOG2E, scale / softcap if softcap else 0.0, softcap * _LOG2E) + tail,
                    num_warps=cfg.num_warps, num_stages=cfg.num_stages, device_index=plan.device_index)
    return out, lse


def attention_forward(q, k, v, causal: bool, softmax_scale: float | None, write_lse: bool, config=None,
                      window_size=NO_WINDOW, softcap: float = 0.0):
    """Runs the forward kernel on dense inputs: returns (out, lse) with lse None unless `write_lse`.

    `config` forces an AttentionConfig (for tuning sweeps); such calls take Triton's ordinary,
    uncached launch path, as do calls whose window_size is a list rather than a tuple.
    """
    # The options' types and values are checked on every call (a cached plan's key compares
    # causal=1 equal to True and window (1.0, 2) equal to (1, 2)); the tensors' facts are the key.
    _check_options(causal, softmax_scale)
    window_size = check_band(window_size, softcap)
    key = plan = None
    if config is None:
        try:
            key = _plan_key(q, k, v, causal, window_size, softcap, write_lse)
            plan = _PLANS.get(key)
        except AttributeError:  # not tensors: the checks say which
            key = None
    if plan is None:
        _check_inputs(q, k, v)
        plan = _ForwardPlan(q, k, v, q.shape[0], q.shape[2], k.shape[2], causal, window_size, softcap, write_lse,
                            False, config)
        if key is not None:
            _remember(_PLANS, key, plan)
    return run_forward(plan, key, q, k, v, None, None, softmax_scale, write_lse)


class _BackwardPlan:
    """Everything about a backward call that depends only on its shapes, strides, dtypes and
    options; dense or packed as for `_ForwardPlan`."""

    __slots__ = ("empty", "copy_last_dim", "config", "default_scale", "softcap", "packed", "lse_shape",
                 "device_index", "preprocess_grid", "dkdv_grid", "dq_grid", "preprocess_options", "dkdv_options",
                 "dq_options", "dq_mode", "tma", "gluon", "window", "dkdv_maxnreg", "grad_strides", "row_strides")

    def __init__(self, tensors, batch, seqlen_q, seqlen_k, causal, window_size, softcap, packed, config=None,
                 grad_strides=None):
        grad_output, q, k, v, out, _ = tensors
        heads_q, heads_kv, head_dim = q.shape[1], k.shape[1], q.shape[-1]
        self.copy_last_dim = any(t.stride(-1) != 1 for t in (grad_output, q, k, v, out))
        # The layouts the kernels see (a tensor whose last dimension is not contiguous is copied
        # first), those of the gradients (`_output_like`, unless the caller gives the gradients'
        # buffers, as `packed.py` does), and the (batch, head, row) strides of grad_output, q, k,
        # v, out, dq, dk, dv: fixed by the plan's key, so not derived per call.
        strides = [t.stride() if t.stride(-1) == 1 else _dense_strides(t.shape) for t in (grad_output, q, k, v, out)]
        self.grad_strides = grad_strides or tuple(_dense_strides(t.shape, st) for t, st in zip((q, k, v), strides[1:4]))
        self.row_strides = tuple(_row_strides(st, packed) for st in strides + list(self.grad_strides))
        self.empty = q.numel() == 0 or k.numel() == 0
        self.default_scale = 1.0 / math.sqrt(head_dim)
        self.softcap = float(softcap)
        self.packed = packed
        self.lse_shape = (heads_q, q.shape[0]) if packed else (batch, heads_q, seqlen_q)
        self.device_index = q.device.index if q.device.type == "cuda" else None
        cfg = self.config = config or backward_config(info_for(q), q.element_size(), head_dim, packed and causal)
        block_d = head_dim_block(head_dim)
        # delta = rowsum(dO * O) needs no sequence structure: packed tokens run as one batch entry.
        rows_batch, rows = (1, q.shape[0]) if packed else (batch, seqlen_q)
        rows_block = preprocess_block_m(block_d)
        num_row_blocks = _cdiv(rows, rows_block)
        self.preprocess_grid = (num_row_blocks * rows_batch * heads_q, 1, 1)
        self.preprocess_options = (heads_q, rows, num_row_blocks, head_dim, block_d, rows_block)
        num_n_blocks = _cdiv(seqlen_k, cfg.dkdv.block_n)
        num_m_blocks = _cdiv(seqlen_q, cfg.dq.block_m)
        self.dkdv_grid = (num_n_blocks * batch * heads_kv, 1, 1)
        self.dq_grid = (num_m_blocks * batch * heads_q, 1, 1)
        lse_strides = (0, q.shape[0]) if packed else (heads_q * seqlen_q, seqlen_q)
        window = _kernel_window(causal, window_size)
        group = heads_q // heads_kv
        totals = _token_totals(q, k, packed)
        self.dkdv_options = (*lse_strides, heads_kv, group, seqlen_q, seqlen_k, *totals, num_n_blocks, *window,
                             head_dim, block_d, cfg.dkdv.block_m, cfg.dkdv.block_n, softcap > 0, packed)
        self.dq_options = (*lse_strides, heads_q, group, seqlen_q, seqlen_k, *totals, num_m_blocks, *window, head_dim,
                           block_d, cfg.dq.block_m, cfg.dq.block_n, softcap > 0, packed)
        path = cfg.dq_path
        if path == "tma" and not hopper.supports_reduce(q, head_dim):
            path = "atomic"
        self.dq_mode = DQ_MODES[path]
        # Tiles through tensor descriptors (configs.BackwardConfig.tma) where TMA can address the
        # tensors, and the gradients laid out like them, and the call is long enough to hide the
        # host time of building descriptors. Packed batches store their gradients through
        # pointers (a tile's rows past a sequence's end belong to the next one), and need the dQ
        # kernel: a fused dQ would sum the next sequence's keys into it.
        flops = 4.0 * batch * heads_q * seqlen_q * seqlen_k * head_dim
        self.tma = (cfg.tma and not self.copy_last_dim and (config is not None or flops >= HOPPER_MIN_FLOPS)
                    and not (packed and self.dq_mode != DQ_MODES["kernel"])
                    and hopper.supports_backward(tensors[:5], head_dim))
        # Dense calls without softcap that take descriptors run the Gluon kernels where
        # `configs.GLUON_BACKWARD` has them (they compute their own grids from the config); a
        # sweep may force the fused one (`BackwardConfig.fused`), which takes delta from the
        # preprocess kernel as the Triton fused paths do.
        gluon_ok = self.tma and not packed and not softcap and (self.dq_mode == DQ_MODES["kernel"] or cfg.fused)
        if gluon_ok and config is None:
            cfg = self.config = gluon_backward_config(info_for(q), q.element_size(), head_dim) or cfg
        self.gluon = cfg.gluon and gluon_ok
        self.window = window
        self.dkdv_maxnreg = dkdv_maxnreg(cfg.dkdv, self.tma, softcap > 0, packed)


_BACKWARD_PLANS: dict = {}


def _backward_key(tensors, *options):
    return (tuple(t.shape for t in tensors), tuple(t.stride() for t in tensors), tuple(t.dtype for t in tensors),
            tuple(t.device for t in tensors), tuple(t.data_ptr() % 16 for t in tensors), options)


def check_backward_tensors(grad_output, q, out, lse, lse_shape, lse_description) -> None:
    """grad_output and output like q; lse float32 of `lse_shape`."""
    for name, t in (("grad_output", grad_output), ("output", out)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.shape != q.shape:
            raise ValueError(f"{name} must have the shape of q {tuple(q.shape)}, got {tuple(t.shape)}")
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


def run_backward(plan: _BackwardPlan, key, grad_output, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                 softmax_scale, grad_lse, sequence_order=None, grads=None):
    """Launches the backward kernels for a plan: returns (dq, dk, dv) with the layouts of q, k, v,
    or written into `grads`, three tensors shaped like q, k, v with the plan's `grad_strides`.
    Packed batches pass their cumulative lengths and `sequence_order` as for `run_forward`.

    `grad_lse`, the gradient of lse when a caller differentiated it too, enters through delta:
    d lse_i / d s_ij = p_ij, so it adds p * grad_lse to dS.
    """
    if plan.copy_last_dim:
        grad_output, q, k, v, out = (t if t.stride(-1) == 1 else t.contiguous() for t in (grad_output, q, k, v, out))
    dq, dk, dv = grads or (torch.empty_strided(t.shape, st, dtype=t.dtype, device=t.device)
                           for t, st in zip((q, k, v), plan.grad_strides))
    if plan.empty:
        return dq.zero_(), dk.zero_(), dv.zero_()
    lse = lse.contiguous()
    # Per query row: delta, and lse in base 2 with +inf for rows that saw no key (what the dK/dV
    # kernel subtracts), both written by the dQ or the preprocess kernel.
    delta, lse_log2 = torch.empty((2, *plan.lse_shape), dtype=torch.float32, device=q.device).unbind(0)
    packed = plan.packed
    sdo, sq, sk, sv, so, sdq, sdk, sdv = plan.row_strides
    mode = plan.dq_mode
    # The dQ kernel computes delta itself unless it does not run or lse has a gradient to add.
    delta_here = mode == DQ_MODES["kernel"] and grad_lse is None
    if key is not None:  # the dQ kernels specialise on delta_here, which the plan's key leaves open
        key = (key, delta_here)
    if not delta_here:
        _BACKWARD_PREPROCESS.launch(key, plan.preprocess_grid,
                                    (out, grad_output, lse, delta, lse_log2, *so, *sdo) + plan.preprocess_options,
                                    num_warps=PREPROCESS_WARPS, num_stages=1, device_index=plan.device_index)
        if grad_lse is not None:
            delta.sub_(grad_lse)
    scale = plan.default_scale if softmax_scale is None else float(softmax_scale)
    softcap = plan.softcap
    scales = (scale, scale * _LOG2E, scale / softcap if softcap else 0.0, softcap * _LOG2E)
    cfg = plan.config
    if plan.gluon:
        hopper.launch_gluon_backward(grad_output, q, k, v, out, lse, delta, dq, dk, dv, scale, cfg, plan.window,
                                     delta_here=delta_here, key=key, device_index=plan.device_index)
        return dq, dk, dv
    tma = plan.tma  # descriptors hold data pointers, so they are built per call; what Triton
    # specialises a kernel on (their dtype and tile shape) follows from the plan, so `key` holds
    built = {}  # the two kernels share a descriptor wherever their tiles of a tensor have the same rows
    if mode == DQ_MODES["kernel"]:  # first: it writes delta for the dK/dV kernel
        if tma:
            (q_, do_, dq_), (k_, v_) = hopper.backward_descriptors((q, grad_output, dq), (k, v), cfg.dq, built)
            if packed:
                dq_ = dq
        else:
            q_, k_, v_, do_, dq_ = q, k, v, grad_output, dq
        _BACKWARD_DQ.launch(
            key, plan.dq_grid,
            (q_, k_, v_, do_, out, lse, delta, lse_log2, dq_, cu_seqlens_q, cu_seqlens_k, sequence_order, *scales,
             *sq, *sk, *sv, *sdo, *so, *sdq) + plan.dq_options + (tma, delta_here),
            num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages, device_index=plan.device_index)
        dq_acc, dq_target, sacc = None, None, (0, 0, 0)
    else:  # fp32 accumulator with dq's layout, scaled in the kernel
        dq_acc = torch.zeros_like(dq, dtype=torch.float32)
        sacc = _row_strides(dq_acc.stride(), packed)
        dq_target = hopper.reduce_descriptor(dq_acc, packed, cfg.dkdv.block_m) if mode == DQ_MODES["tma"] else dq_acc
    if tma:
        (q_, do_), (k_, v_, dk_, dv_) = hopper.backward_descriptors((q, grad_output), (k, v, dk, dv), cfg.dkdv,
                                                                    built)
        if packed:
            dk_, dv_ = dk, dv
    else:
        q_, k_, v_, do_, dk_, dv_ = q, k, v, grad_output, dk, dv
    _BACKWARD_DKDV.launch(
        key, plan.dkdv_grid,
        (q_, k_, v_, do_, lse_log2, delta, dk_, dv_, dq_target, cu_seqlens_q, cu_seqlens_k, sequence_order, *scales,
         *sq, *sk, *sv, *sdo, *sdk, *sdv, *sacc) + plan.dkdv_options + (mode, tma),
        num_warps=cfg.dkdv.num_warps, num_stages=cfg.dkdv.num_stages, device_index=plan.device_index,
        maxnreg=plan.dkdv_maxnreg)
    if dq_acc is not None:
        dq.copy_(dq_acc)
    return dq, dk, dv


def attention_backward(grad_output, q, k, v, out, lse, causal: bool, softmax_scale: float | None,
                       window_size=NO_WINDOW, softcap: float = 0.0, grad_lse=None, config=None, grads=None):
    """Runs the backward kernels on dense inputs: returns (dq, dk, dv) with the layouts of q, k, v,
    or written into `grads` (three tensors shaped like q, k, v, the dtype of q, with unit stride
    in D and no two elements in one place: the caller's own buffers, which `packed.py` makes
    views of one dQKV tensor).

    `grad_lse` is lse's own gradient (see `run_backward`). `config` forces a BackwardConfig (for
    tuning sweeps); such calls take Triton's ordinary, uncached launch path.
    """
    tensors = (grad_output, q, k, v, out, lse)
    grad_strides = None if grads is None else tuple(t.stride() for t in grads)
    _check_options(causal, softmax_scale)  # every call, as in `attention_forward`
    window_size = check_band(window_size, softcap)
    key = plan = None
    if config is None:
        try:  # with `grads`, their strides and alignment join the key: the kernels specialise on both
            key = _backward_key(tensors, causal, window_size, softcap, grad_strides,
                                grads and tuple(t.data_ptr() % 16 for t in grads))
            plan = _BACKWARD_PLANS.get(key)
        except AttributeError:  # not tensors: the checks say which
            key = None
    if plan is None:
        _check_inputs(q, k, v)
        check_backward_tensors(grad_output, q, out, lse, q.shape[:3], "(batch, heads_q, seqlen_q)")
        plan = _BackwardPlan(tensors, q.shape[0], q.shape[2], k.shape[2], causal, window_size, softcap, False,
                             config, grad_strides)
        if key is not None:
            _remember(_BACKWARD_PLANS, key, plan)
    return run_backward(plan, key, grad_output, q, k, v, out, lse, None, None, softmax_scale, grad_lse, None, grads)


def save_for_backward(ctx, tensors, options) -> None:
    """What the backward needs, saved on an autograd context (shared with the custom ops): the
    tensors (q, k, v, out, lse, then any more the backward takes) and the call's other
    arguments, in the order the backward takes them after the tensors."""
    ctx.save_for_backward(*tensors)
    ctx.options = options
    # An output the loss does not use gets None instead of a tensor of zeros.
    ctx.set_materialize_grads(False)


def gradients_from_context(ctx, grad_out, grad_lse, backward):
    """(dq, dk, dv) from a context `save_for_backward` filled: runs
    `backward(grad_out, *tensors, *options, grad_lse)`."""
    tensors = ctx.saved_tensors
    if grad_out is None:  # only lse was used
        grad_out = torch.zeros_like(tensors[3])
    return backward(grad_out, *tensors, *ctx.options, grad_lse)


def refuse_double_backward(name: str) -> None:
    """The kernels' gradients have no graph of their own: a gradient penalty would silently
    drop dq's own dependence on q, k and v."""
    if torch.is_grad_enabled():  # create_graph=True
        raise RuntimeError(f"{name} has no second derivative; backward with create_graph=True is not supported")


class _AttentionFunction(torch.autograd.Function):
    """Eager autograd over the kernels. It skips the custom ops' dispatcher round trips (which
    about double the host time of a small training call); torch.compile uses the ops instead."""

    @staticmethod
    def forward(ctx, q, k, v, causal, softmax_scale, window_size, softcap):
        out, lse = attention_forward(q, k, v, causal, softmax_scale, True, None, window_size, softcap)
        save_for_backward(ctx, (q, k, v, out, lse), (causal, softmax_scale, window_size, softcap))
        return out, lse

    @staticmethod
    def backward(ctx, grad_out, grad_lse):
        refuse_double_backward("flash_attention_science")
        return (*gradients_from_context(ctx, grad_out, grad_lse, attention_backward), None, None, None, None)


def flash_attention_forward(q, k, v, causal=False, softmax_scale=None, *, window_size=NO_WINDOW, softcap=0.0):
    """Fused attention forward; returns (out, lse). See `flash_attention_science` for the contract.

    lse: (B, Hq, Sq) float32, the natural-log sum of exponentials of each query row's scaled
    scores (-inf for rows that see no key); the backward pass takes it.
    """
    return attention_forward(q, k, v, causal, softmax_scale, True, None, window_size, softcap)


def flash_attention_backward(grad_output, q, k, v, output, softmax_lse, causal=False, softmax_scale=None, *,
                             window_size=NO_WINDOW, softcap=0.0, deterministic=False):
    """Gradients of fused attention; returns (dq, dk, dv).

    Args:
        grad_output: (B, Hq, Sq, D) gradient of the attention output, the dtype of q; any strides.
        q, k, v, causal, softmax_scale, window_size, softcap: the forward call's arguments (see
            `flash_attention_science`).
        output: (B, Hq, Sq, D) the forward's output.
        softmax_lse: (B, Hq, Sq) float32, the lse `flash_attention_forward` returned.
        deterministic: accepted for compatibility with flash-attn. Gradients are always bitwise
            reproducible here: every element of dq, dk and dv is summed by one program in a fixed
            order (dQ has its own kernel instead of atomic adds), so True costs nothing.

    dq has q's layout and dtype, dk and dv those of k and v: (B, Hkv, Sk, D), summed over the
    query heads of each group under GQA/MQA. Rows that saw no key get zero gradients. fp32
    inputs' products follow torch's float32 matmul precision (see `flash_attention_science`).
    Memory beyond the outputs is O(B * Hq * Sq).
    """
    check_bool("deterministic", deterministic)
    return attention_backward(grad_output, q, k, v, output, softmax_lse, causal, softmax_scale, window_size, softcap)


def flash_attention_science(q, k, v, causal=False, softmax_scale=None, *, window_size=NO_WINDOW, softcap=0.0,
                            return_lse=False, deterministic=False):
    """Fused scaled-dot-product attention, differentiable in q, k and v.

    Args:
        q: (B, Hq, Sq, D) query, fp16, bf16 or fp32. fp32 products on the GPU follow
            `torch.get_float32_matmul_precision()`: "highest" (PyTorch's default) runs 3xTF32,
            with errors near fp32's; "high" or "medium" one TF32 product (about 3x faster).
        k, v: (B, Hkv, Sk, D) keys and values, the dtype of q. Hq must be a multiple of Hkv
            (grouped-query / multi-query attention); K and V are never repeated in memory.
        causal: mask scores above the diagonal. The diagonal is aligned bottom-right: query i sees
            keys j <= i + (Sk - Sq), as in flash-attn >= 2.1 and as decoding with a KV cache needs.
            This differs from `scaled_dot_product_attention(is_causal=True)` when Sq != Sk (SDPA
            aligns top-left). Query rows that see no key return 0 (and lse -inf), never NaN.
        softmax_scale: multiplies q.k^T before the softmax; default 1/sqrt(D).
        window_size: (left, right) sliding window, as in flash-attn: with c = i + Sk - Sq (the
            same bottom-right alignment), query i sees keys c - left <= j <= c + right; -1 leaves
            a side unbounded, and causal=True sets right = 0 whatever is passed. Key blocks
            outside the window are skipped, so the cost grows with the window, not with Sk.
        softcap: when > 0, scores s (after softmax_scale) become softcap * tanh(s / softcap)
            before the softmax (Gemma-2, Grok), forward and backward. 0 turns it off.
        return_lse: also return lse (B, Hq, Sq) float32, natural log. It is differentiable too.
        deterministic: accepted for compatibility with flash-attn. The backward is always bitwise
            reproducible (no atomic adds: dQ has its own kernel), so True costs nothing.

    Any Sq, Sk >= 0 and any D from 16 to 256. Inputs may have any strides with unit stride in D
    (such as (B, S, H, D).transpose(1, 2) views), which are read in place; a tensor whose last
    dimension is not contiguous is copied first. The output has q's layout and dtype.

    Gradients flow when autograd is on and q, k or v requires grad. Under torch.compile the call
    goes through the torch.library ops `flashmoe_science::attention_forward` and
    `::attention_backward` (`fullgraph=True` works, forward and backward); eager calls launch the
    same kernels directly. The backward keeps memory O(S): it recomputes the attention weights
    from q, k and lse instead of storing them.

    Returns:
        out (B, Hq, Sq, D), or (out, lse) when return_lse.
    """
    check_flags(deterministic, return_lse)
    try:
        differentiable = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    except AttributeError:  # not tensors: the lean path's checks say which argument is wrong
        differentiable = False
    if torch.compiler.is_compiling():
        _check_options(causal, softmax_scale)
        window_left, window_right = check_band(window_size, softcap)
        out, lse = torch.ops.flashmoe_science.attention_forward(q, k, v, causal, softmax_scale, window_left,
                                                                window_right, float(softcap))
    elif differentiable:
        out, lse = _AttentionFunction.apply(q, k, v, causal, softmax_scale, window_size, softcap)
    else:
        out, lse = attention_forward(q, k, v, causal, softmax_scale, return_lse, None, window_size, softcap)
    return (out, lse) if return_lse else out
