"""The attention backward: which kernels run for a call, and their launch.

`attention_backward` makes a call's plan (`BackwardPlan`) once per set of shapes, strides,
dtypes, devices and options, caches it under those facts (`plan_key`), and `launch_backward`
allocates the gradients and launches the plan's kernels; packed variable-length calls
(`varlen.py`) launch through it too. Each call runs a dQ kernel, then a dK/dV kernel (the dQ
kernel writes the per-row delta = rowsum(dO * O) the dK/dV kernel needs; when lse has a gradient
of its own, `backward.attention_backward_preprocess_kernel` writes delta first). Which ones
(the kernels live in `_kernels/`, their tables in `configs.py`):

- sm90, dense 16-bit calls without softcap of at least `HOPPER_MIN_FLOPS` whose tensors (and
  gradients) TMA can address, at a head dim `GLUON_BACKWARD` lists: the Gluon kernels,
  `backward_gluon.attention_backward_dq_gluon_kernel` then `..._dkdv_gluon_kernel`
  (`launch_gluon_backward`).
- Every other call: the Triton kernels `backward.attention_backward_dq_kernel` then
  `backward.attention_backward_dkdv_kernel` (`BACKWARD`, and `PACKED_CAUSAL_BACKWARD` for causal
  packed calls), moving their tiles through TMA descriptors (`BackwardConfig.tma`) on sm90 where
  the tensors allow it and the call is large enough, through pointers otherwise.

Every gradient element is summed by one program in a fixed order: gradients are bitwise
reproducible.
"""
from __future__ import annotations

import math

import torch

from ..device import info_for
from ..flops import attention_flops
from ..launch import KernelLauncher, PlanCache
from . import descriptors
from ._kernels.backward import (attention_backward_dkdv_kernel, attention_backward_dq_kernel,
                                attention_backward_preprocess_kernel)
from ._kernels.backward_gluon import attention_backward_dkdv_gluon_kernel, attention_backward_dq_gluon_kernel
from .checks import NO_WINDOW, check_backward_tensors, check_band, check_inputs, check_options
from .configs import (HOPPER_MIN_FLOPS, PREPROCESS_WARPS, backward_config, dkdv_maxnreg, gluon_backward_config,
                      head_dim_block, preprocess_block_m)
from .layouts import LOG2E, cdiv, dense_strides, kernel_window, row_strides, token_totals

_PREPROCESS = KernelLauncher("attention_backward_preprocess", attention_backward_preprocess_kernel)
_DKDV = KernelLauncher("attention_backward_dkdv", attention_backward_dkdv_kernel, fp32_dots=True)
_DQ = KernelLauncher("attention_backward_dq", attention_backward_dq_kernel, fp32_dots=True)
_GLUON_DQ = KernelLauncher("attention_backward_dq_gluon", attention_backward_dq_gluon_kernel)
_GLUON_DKDV = KernelLauncher("attention_backward_dkdv_gluon", attention_backward_dkdv_gluon_kernel)
PLANS = PlanCache()


class BackwardPlan:
    """Everything about a backward call that depends only on its shapes, strides, dtypes and
    options; dense or packed as for `forward.ForwardPlan`."""

    __slots__ = ("empty", "copy_last_dim", "config", "default_scale", "softcap", "packed", "lse_shape",
                 "device_index", "preprocess_grid", "dkdv_grid", "dq_grid", "preprocess_options", "dkdv_options",
                 "dq_options", "tma", "gluon", "window", "dkdv_maxnreg", "grad_strides", "row_strides")

    def __init__(self, tensors, batch, seqlen_q, seqlen_k, causal, window_size, softcap, packed, config=None,
                 grad_strides=None):
        grad_output, q, k, v, out, _ = tensors
        heads_q, heads_kv, head_dim, head_dim_v = q.shape[1], k.shape[1], q.shape[-1], v.shape[-1]
        self.copy_last_dim = any(t.stride(-1) != 1 for t in (grad_output, q, k, v, out))
        # The layouts the kernels see (a tensor whose last dimension is not contiguous is copied
        # first), those of the gradients (`layouts.output_like`, unless the caller gives the
        # gradients' buffers, as `packed.py` does), and the (batch, head, row) strides of
        # grad_output, q, k, v, out, dq, dk, dv: fixed by the plan's key, so not derived per call.
        strides = [t.stride() if t.stride(-1) == 1 else dense_strides(t.shape) for t in (grad_output, q, k, v, out)]
        self.grad_strides = grad_strides or tuple(dense_strides(t.shape, st) for t, st in zip((q, k, v), strides[1:4]))
        self.row_strides = tuple(row_strides(st, packed) for st in strides + list(self.grad_strides))
        self.empty = q.numel() == 0 or k.numel() == 0
        self.default_scale = 1.0 / math.sqrt(head_dim)
        self.softcap = float(softcap)
        self.packed = packed
        self.lse_shape = (heads_q, q.shape[0]) if packed else (batch, heads_q, seqlen_q)
        self.device_index = q.device.index if q.device.type == "cuda" else None
        # Tiles for the larger head dim where v's differs (MLA), as in the forward.
        cfg = self.config = config or backward_config(info_for(q), q.element_size(), max(head_dim, head_dim_v),
                                                      packed and causal)
        block_d, block_dv = head_dim_block(head_dim), head_dim_block(head_dim_v)
        # delta = rowsum(dO * O) needs no sequence structure: packed tokens run as one batch entry.
        rows_batch, rows = (1, q.shape[0]) if packed else (batch, seqlen_q)
        rows_block = preprocess_block_m(block_dv)
        num_row_blocks = cdiv(rows, rows_block)
        self.preprocess_grid = (num_row_blocks * rows_batch * heads_q, 1, 1)
        self.preprocess_options = (heads_q, rows, num_row_blocks, head_dim_v, block_dv, rows_block)
        num_n_blocks = cdiv(seqlen_k, cfg.dkdv.block_n)
        num_m_blocks = cdiv(seqlen_q, cfg.dq.block_m)
        self.dkdv_grid = (num_n_blocks * batch * heads_kv, 1, 1)
        self.dq_grid = (num_m_blocks * batch * heads_q, 1, 1)
        lse_strides = (0, q.shape[0]) if packed else (heads_q * seqlen_q, seqlen_q)
        window = kernel_window(causal, window_size)
        group = heads_q // heads_kv
        totals = token_totals(q, k, packed)
        self.dkdv_options = (*lse_strides, heads_kv, group, seqlen_q, seqlen_k, *totals, num_n_blocks, *window,
                             head_dim, block_d, head_dim_v, block_dv, cfg.dkdv.block_m, cfg.dkdv.block_n, softcap > 0,
                             packed)
        self.dq_options = (*lse_strides, heads_q, group, seqlen_q, seqlen_k, *totals, num_m_blocks, *window, head_dim,
                           block_d, head_dim_v, block_dv, cfg.dq.block_m, cfg.dq.block_n, softcap > 0, packed)
        # Tiles through tensor descriptors (configs.BackwardConfig.tma) where TMA can address the
        # tensors, and the gradients laid out like them, and the call is long enough to hide the
        # host time of building descriptors. Packed batches store their gradients through
        # pointers (a tile's rows past a sequence's end belong to the next one).
        flops = attention_flops(batch, heads_q, seqlen_q, seqlen_k, head_dim, head_dim_v=head_dim_v)
        self.tma = (cfg.tma and not self.copy_last_dim and (config is not None or flops >= HOPPER_MIN_FLOPS)
                    and descriptors.supports_backward(tensors[:5], head_dim, head_dim_v))
        # Dense calls without softcap that take descriptors run the Gluon kernels where
        # `configs.GLUON_BACKWARD` has them (they compute their own grids from the config).
        gluon_ok = self.tma and not packed and not softcap
        if gluon_ok and config is None:
            cfg = self.config = gluon_backward_config(info_for(q), q.element_size(), max(head_dim, head_dim_v)) or cfg
        self.gluon = cfg.gluon and gluon_ok
        self.window = window
        self.dkdv_maxnreg = dkdv_maxnreg(cfg.dkdv, self.tma, softcap > 0, packed)


def plan_key(tensors, *options):
    return (tuple(t.shape for t in tensors), tuple(t.stride() for t in tensors), tuple(t.dtype for t in tensors),
            tuple(t.device for t in tensors), tuple(t.data_ptr() % 16 for t in tensors), options)


def launch_backward(plan: BackwardPlan, key, grad_output, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
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
    # The dQ kernel computes delta itself unless lse has a gradient to add.
    delta_here = grad_lse is None
    if key is not None:  # the dQ kernels specialise on delta_here, which the plan's key leaves open
        key = (key, delta_here)
    if not delta_here:
        _PREPROCESS.launch(key, plan.preprocess_grid,
                           (out, grad_output, lse, delta, lse_log2, *so, *sdo) + plan.preprocess_options,
                           num_warps=PREPROCESS_WARPS, num_stages=1, device_index=plan.device_index)
        delta.sub_(grad_lse)
    scale = plan.default_scale if softmax_scale is None else float(softmax_scale)
    softcap = plan.softcap
    scales = (scale, scale * LOG2E, scale / softcap if softcap else 0.0, softcap * LOG2E)
    cfg = plan.config
    if plan.gluon:
        launch_gluon_backward(grad_output, q, k, v, out, lse, delta, dq, dk, dv, scale, cfg, plan.window,
                              delta_here=delta_here, key=key, device_index=plan.device_index)
        return dq, dk, dv
    # Descriptors hold data pointers, so they are built per call; what Triton specialises a kernel
    # on (their dtype and tile shape) follows from the plan, so `key` holds.
    tma = plan.tma
    built = {}  # the two kernels share a descriptor wherever their tiles of a tensor have the same rows
    if tma:
        (q_, do_, dq_), (k_, v_) = descriptors.backward_descriptors((q, grad_output, dq), (k, v), cfg.dq, built)
        if packed:
            dq_ = dq
    else:
        q_, k_, v_, do_, dq_ = q, k, v, grad_output, dq
    _DQ.launch(  # first: it writes delta for the dK/dV kernel
        key, plan.dq_grid,
        (q_, k_, v_, do_, out, lse, delta, lse_log2, dq_, cu_seqlens_q, cu_seqlens_k, sequence_order, *scales,
         *sq, *sk, *sv, *sdo, *so, *sdq) + plan.dq_options + (tma, delta_here),
        num_warps=cfg.dq.num_warps, num_stages=cfg.dq.num_stages, device_index=plan.device_index)
    if tma:
        (q_, do_), (k_, v_, dk_, dv_) = descriptors.backward_descriptors((q, grad_output), (k, v, dk, dv), cfg.dkdv,
                                                                         built)
        if packed:
            dk_, dv_ = dk, dv
    else:
        q_, k_, v_, do_, dk_, dv_ = q, k, v, grad_output, dk, dv
    _DKDV.launch(
        key, plan.dkdv_grid,
        (q_, k_, v_, do_, lse_log2, delta, dk_, dv_, cu_seqlens_q, cu_seqlens_k, sequence_order, *scales,
         *sq, *sk, *sv, *sdo, *sdk, *sdv) + plan.dkdv_options + (tma,),
        num_warps=cfg.dkdv.num_warps, num_stages=cfg.dkdv.num_stages, device_index=plan.device_index,
        maxnreg=plan.dkdv_maxnreg)
    return dq, dk, dv


def launch_gluon_backward(grad_output, q, k, v, out, lse, delta, dq, dk, dv, scale, config, window, *, delta_here,
                          device_index=None, key=None) -> None:
    """The Gluon backward kernels (`_kernels/backward_gluon.py`) for dense (B, H, S, D) tensors (v,
    out and their gradients with v's head dim):
    the dQ kernel (which writes delta first when `delta_here`), then the dK/dV kernel. `config`
    is a BackwardConfig; `window` and `key` as for `forward.launch_tma`."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k, head_dim_v = k.shape[1], k.shape[2], v.shape[-1]
    block_d, block_dv = head_dim_block(head_dim), head_dim_block(head_dim_v)
    group = heads_q // heads_kv
    lse_strides = (heads_q * seqlen_q, seqlen_q)
    built = {}  # the two kernels share a descriptor wherever their tiles of a tensor have the same rows

    def describe(t, rows):
        if (id(t), rows) not in built:
            built[id(t), rows] = descriptors.gluon_descriptor(t, rows, head_dim_block(t.shape[-1]))
        return built[id(t), rows]

    c = config.dq
    num_m_blocks = cdiv(seqlen_q, c.block_m)
    _GLUON_DQ.launch(
        key, (num_m_blocks * batch * heads_q, 1, 1),
        (describe(q, c.block_m), describe(k, c.block_n), describe(v, c.block_n), describe(grad_output, c.block_m),
         describe(dq, c.block_m), out, lse, delta, scale, scale * LOG2E, *out.stride()[:3],
         *lse_strides, heads_q, group, seqlen_q, seqlen_k, num_m_blocks, *window,
         head_dim, head_dim_v, c.block_m, c.block_n, block_d, block_dv, c.num_stages, delta_here),
        num_warps=c.num_warps, num_stages=1, device_index=device_index)
    c = config.dkdv
    num_n_blocks = cdiv(seqlen_k, c.block_n)
    _GLUON_DKDV.launch(
        key, (num_n_blocks * batch * heads_kv, 1, 1),
        (describe(q, c.block_m), describe(k, c.block_n), describe(v, c.block_n), describe(grad_output, c.block_m),
         describe(dk, c.block_n), describe(dv, c.block_n), lse, delta, scale, scale * LOG2E, *lse_strides, heads_kv,
         group, seqlen_q, seqlen_k, num_n_blocks, *window, head_dim, c.block_m, c.block_n, block_d, block_dv,
         c.num_stages),
        num_warps=c.num_warps, num_stages=1, device_index=device_index)


def attention_backward(grad_output, q, k, v, out, lse, causal: bool, softmax_scale: float | None,
                       window_size=NO_WINDOW, softcap: float = 0.0, grad_lse=None, config=None, grads=None):
    """Runs the backward kernels on dense inputs: returns (dq, dk, dv) with the layouts of q, k, v,
    or written into `grads` (three tensors shaped like q, k, v, the dtype of q, with unit stride
    in D and no two elements in one place: the caller's own buffers, which `packed.py` makes
    views of one dQKV tensor).

    `grad_lse` is lse's own gradient (see `launch_backward`). `config` forces a BackwardConfig (for
    tuning sweeps); such calls take Triton's ordinary, uncached launch path.
    """
    check_options(causal, softmax_scale)  # every call, as in `attention_forward`
    window_size = check_band(window_size, softcap)
    plan, key = backward_plan(grad_output, q, k, v, out, lse, causal, window_size, softcap, config, grads)
    return launch_backward(plan, key, grad_output, q, k, v, out, lse, None, None, softmax_scale, grad_lse, None, grads)


def backward_plan(grad_output, q, k, v, out, lse, causal, window_size, softcap, config=None, grads=None):
    """(plan, key) of a dense backward whose options are checked, as `forward.forward_plan`."""
    tensors = (grad_output, q, k, v, out, lse)
    grad_strides = None if grads is None else tuple(t.stride() for t in grads)
    key = plan = None
    if config is None:
        try:  # with `grads`, their strides and alignment join the key: the kernels specialise on both
            key = plan_key(tensors, causal, window_size, softcap, grad_strides,
                           grads and tuple(t.data_ptr() % 16 for t in grads))
            plan = PLANS.get(key)
        except AttributeError:  # not tensors: the checks say which
            key = None
    if plan is None:
        check_inputs(q, k, v)
        check_backward_tensors(grad_output, q, v, out, lse, q.shape[:3], "(batch, heads_q, seqlen_q)")
        plan = BackwardPlan(tensors, q.shape[0], q.shape[2], k.shape[2], causal, window_size, softcap, False,
                            config, grad_strides)
        if key is not None:
            PLANS.remember(key, plan)
    return plan, key
