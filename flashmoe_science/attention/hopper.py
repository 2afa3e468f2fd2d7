"""The Hopper (sm90) paths: TMA tensor descriptors for the Q, K, V and O tiles of the forward
kernel, and for the tiles the backward kernels load and store (`backward_descriptors`); the Gluon
forward (`launch_gluon`) and backward (`launch_gluon_backward`) kernels.

The forward takes dense inputs only; the backward packed ones too. The tensor memory accelerator needs every base
pointer 16-byte aligned and every stride but the last a multiple of 16 bytes; `supports` says
whether a call's tensors qualify. The dispatcher (`interface._ForwardPlan`) takes this path for
large 16-bit calls at padded head dims 64, 128 and 256 on sm90 (`configs.hopper_forward_config`);
`attention_forward_hopper` runs it (or the Gluon kernel) with an explicit configuration for sweeps.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..device import info_for
from ..launch import KernelLauncher
from ._kernels.backward_fused import attention_backward_fused_kernel
from ._kernels.backward_gluon import attention_backward_dkdv_gluon_kernel, attention_backward_dq_gluon_kernel
from ._kernels.forward import MIN_SCALE
from ._kernels.forward_gluon import attention_forward_gluon_kernel
from ._kernels.forward_hopper import attention_forward_hopper_kernel
from .configs import (fused_backward_maxnreg, gluon_forward_section, gluon_forward_tiles, gluon_persistent,
                      gluon_separate_output, head_dim_block)

_LOG2E = 1.4426950408889634
_HOPPER = KernelLauncher("attention_forward_hopper", attention_forward_hopper_kernel)
_GLUON = KernelLauncher("attention_forward_gluon", attention_forward_gluon_kernel)
_GLUON_DQ = KernelLauncher("attention_backward_dq_gluon", attention_backward_dq_gluon_kernel)
_GLUON_DKDV = KernelLauncher("attention_backward_dkdv_gluon", attention_backward_dkdv_gluon_kernel)
_GLUON_FUSED = KernelLauncher("attention_backward_fused", attention_backward_fused_kernel)


def _checked_descriptor(cls, base, shape, strides, block_shape, *layout):
    """A tensor descriptor of `cls` (Triton's or Gluon's, whose `layout` comes last) over a tensor
    `supports` (or `supports_backward`, `supports_reduce`) has passed, without the class's own
    checks: those repeat what `supports` checked (alignment, positive shape, unit last stride)
    and cost several microseconds of host time per descriptor, for a dozen descriptors a
    backward call. Block shapes are the tables' powers of two, which the compile-and-fit test
    builds. With the one-op output allocation of `interface._output_like`, a one-off A/B on an
    H100 (causal bf16, B = 32, S = 512, 100 back-to-back calls, five rounds) took the host time
    of a backward call from 301 to 260 us at D = 64, 300 to 251 at D = 128, 240 to 218 at
    D = 256 (SDPA's backward: 103 to 115 us at these shapes)."""
    desc = object.__new__(cls)
    desc.__dict__.update(zip(cls.__dataclass_fields__, (base, shape, strides, block_shape, *layout)), padding="zero")
    return desc


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the tensor memory accelerator can address these (B, H, S, D) CUDA tensors."""
    for t in tensors:
        if not t.is_cuda or t.stride(-1) != 1 or t.data_ptr() % 16 or t.numel() == 0:
            return False
        if any((s * t.element_size()) % 16 for s in t.stride()[:-1]):
            return False
    return True


def supports_backward(tensors, head_dim: int) -> bool:
    """Whether the backward kernels can move tiles through descriptors: the tensors (grad_output,
    q, k, v, out) qualify, on an sm90 GPU, and so do the gradients, laid out like q, k, v (rows
    of head_dim 16-bit values a multiple of 16 bytes apart)."""
    q = tensors[1]
    return (supports(*tensors) and q.element_size() == 2 and head_dim % 8 == 0
            and torch.cuda.get_device_capability(q.device)[0] == 9)


def backward_descriptors(row_tensors, key_tensors, config, built=None):
    """Descriptors for one backward kernel: `row_tensors` in tiles of config.block_m rows,
    `key_tensors` of config.block_n (an AttentionConfig). Dense (B, H, S, D) tensors as they are;
    packed (total, H, D) ones as one batch entry (1, H, total, D). `built`, a dict shared by the
    calls for one backward's kernels, hands a tensor's descriptor to every kernel whose tiles of it
    have the same rows."""
    block_d = head_dim_block(row_tensors[0].shape[-1])
    built = {} if built is None else built

    def describe(t, rows):
        desc = built.get((id(t), rows))
        if desc is not None:
            return desc
        if t.dim() == 3:
            total, heads, head_dim = t.shape
            shape, strides = [1, heads, total, head_dim], [t.numel(), t.stride(1), t.stride(0), 1]
        else:
            shape, strides = list(t.shape), list(t.stride())
        desc = built[id(t), rows] = _checked_descriptor(TensorDescriptor, t, shape, strides, [1, 1, rows, block_d])
        return desc

    return (tuple(describe(t, config.block_m) for t in row_tensors),
            tuple(describe(t, config.block_n) for t in key_tensors))


def supports_reduce(q: torch.Tensor, head_dim: int) -> bool:
    """Whether the backward can add dQ tiles into an fp32 accumulator like q with TMA reduce-adds:
    an sm90 GPU, and rows of head_dim fp32 values a multiple of 16 bytes."""
    return q.is_cuda and torch.cuda.get_device_capability(q.device)[0] == 9 and head_dim % 4 == 0


def reduce_descriptor(acc: torch.Tensor, packed: bool, rows: int) -> TensorDescriptor:
    """A (B, H, S, D) descriptor of the fp32 dQ accumulator, tiles of `rows` rows: a dense (B, H, S, D)
    tensor, or packed (total, H, D) seen as one batch entry (1, H, total, D)."""
    if packed:
        total, heads, head_dim = acc.shape
        shape, strides = [1, heads, total, head_dim], [acc.numel(), acc.stride(1), acc.stride(0), 1]
    else:
        shape, strides = list(acc.shape), list(acc.stride())
    return _checked_descriptor(TensorDescriptor, acc, shape, strides, [1, 1, rows, head_dim_block(shape[-1])])


def launch(q, k, v, out, lse, scale, softcap, config, window, *, causal, warp_specialize=False,
           device_index=None, key=None) -> None:
    """Writes out (and lse, (B, Hq, Sq) float32, unless None) for dense q (B, Hq, Sq, D) and k, v
    (B, Hkv, Sk, D); `window` is the kernel's (window_left, window_right); scale >= 0 (callers
    negate q for a negative one). `key` as for `KernelLauncher.launch`: the descriptors are built
    per call (they hold data pointers), and what Triton specialises on, their dtype and tile
    shape, follows from the dtypes and `config`, which the caller's key determines."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    block_d = head_dim_block(head_dim)

    def describe(t, rows):
        return _checked_descriptor(TensorDescriptor, t, list(t.shape), list(t.stride()), [1, 1, rows, block_d])

    num_m_blocks = -(-seqlen_q // config.block_m)
    _HOPPER.launch(
        key, (num_m_blocks * batch * heads_q, 1, 1),
        (describe(q, config.block_m), describe(k, config.block_n), describe(v, config.block_n),
         describe(out, config.block_m), out if lse is None else lse,
         scale * _LOG2E, scale / softcap if softcap else 0.0, softcap * _LOG2E, heads_q * seqlen_q, seqlen_q,
         heads_q, heads_q // k.shape[1], seqlen_q, k.shape[2], num_m_blocks, *window,
         block_d, config.block_m, config.block_n, causal, softcap > 0, lse is not None, warp_specialize,
         config.exp_poly),
        num_warps=config.num_warps, num_stages=config.num_stages, device_index=device_index)


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


def attention_forward_hopper(q, k, v, causal: bool, softmax_scale: float, config, *, warp_specialize: bool = False,
                             gluon: bool = False, persistent: bool | None = None, write_lse: bool = False,
                             window_size=(-1, -1)):
    """Forward through the Hopper Triton kernel, or the Gluon kernel with `gluon` (`persistent` as
    for `launch_gluon`), with an explicit AttentionConfig (for sweeps); returns (out, lse).

    q: (B, Hq, Sq, D), k and v: (B, Hkv, Sk, D), fp16 or bf16, on an sm90 GPU, `supports` true;
    window_size as for `flash_attention_science` (with causal, the right bound is 0).
    """
    q, softmax_scale = positive_scale(q, softmax_scale)
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[:3], dtype=torch.float32, device=q.device) if write_lse else None
    left, right = window_size
    window = (left, 0 if causal else right)
    if gluon:
        launch_gluon(q, k, v, out, lse, softmax_scale, config, window, causal=causal, persistent=persistent,
                     device_index=q.device.index)
    else:
        launch(q, k, v, out, lse, softmax_scale, 0.0, config, window, causal=causal,
               warp_specialize=warp_specialize, device_index=q.device.index)
    return out, lse


@functools.lru_cache(maxsize=None)
def _gluon_layout(rows: int, block_d: int, dtype: torch.dtype):
    """The shared-memory layout wgmma (or, for fp32, the dQ reduce) wants for a (1, 1, rows,
    block_d) tile: the widest swizzle its rows allow."""
    element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, block_d], element)


def _gluon_descriptor(t: torch.Tensor, rows: int, block_d: int):
    """A Gluon TMA descriptor over dense (B, H, S, D) `t` in tiles of `rows` x block_d."""
    return _checked_descriptor(GluonDescriptor, t, list(t.shape), list(t.stride()), [1, 1, rows, block_d],
                               _gluon_layout(rows, block_d, t.dtype))


def launch_gluon(q, k, v, out, lse, scale, config, window, *, causal, persistent=None, device_index=None,
                 key=None) -> None:
    """As `launch`, through the Gluon kernel (`_kernels/forward_gluon.py`): no softcap;
    config.block_m query rows per tile, 16 per warp of its four-warp consumers (config.num_warps
    is a consumer's), so block_m = 128 runs two consumers and 192 three. `persistent` (default:
    `configs.gluon_persistent`): one program per SM walks the tiles; else one program per tile."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    block_d = head_dim_block(head_dim)
    rows, consumers = gluon_forward_tiles(config)
    num_m_blocks = -(-seqlen_q // config.block_m)
    tiles = num_m_blocks * batch * heads_q
    if persistent is None:
        persistent = gluon_persistent(causal, seqlen_k)
    programs = min(tiles, info_for(q).sm_count) if persistent else tiles
    section = gluon_forward_section(heads_q // heads_kv, seqlen_k, block_d, q.element_size(), causal and not persistent)
    _GLUON.launch(
        key, (programs, 1, 1),
        (_gluon_descriptor(q, rows, block_d), _gluon_descriptor(k, config.block_n, block_d),
         _gluon_descriptor(v, config.block_n, block_d), _gluon_descriptor(out, rows, block_d),
         out if lse is None else lse, scale * _LOG2E, heads_q * seqlen_q, seqlen_q,
         heads_q, heads_q // heads_kv, seqlen_q, seqlen_k, num_m_blocks, batch * heads_q, section, *window,
         rows, config.block_n, block_d, config.num_stages, causal, lse is not None, consumers,
         gluon_separate_output(config, block_d), persistent, config.exp_poly),
        num_warps=4, num_stages=1, device_index=device_index)


def launch_gluon_backward(grad_output, q, k, v, out, lse, delta, dq, dk, dv, scale, config, window, *, delta_here,
                          device_index=None, key=None) -> None:
    """The Gluon backward kernels (`_kernels/backward_gluon.py`) for dense (B, H, S, D) tensors:
    the dQ kernel (which writes delta first when `delta_here`), then the dK/dV kernel. A fused
    config (`BackwardConfig.fused`) runs the dK/dV kernel alone, which adds dQ into a zeroed fp32
    accumulator with TMA reduce-adds; dq is that times the scale (delta must be given: not
    `delta_here`). `config` is a BackwardConfig; `window` and `key` as for `launch`."""
    batch, heads_q, seqlen_q, head_dim = q.shape
    heads_kv, seqlen_k = k.shape[1], k.shape[2]
    block_d = head_dim_block(head_dim)
    group = heads_q // heads_kv
    lse_strides = (heads_q * seqlen_q, seqlen_q)
    built = {}  # the two kernels share a descriptor wherever their tiles of a tensor have the same rows

    def describe(t, rows):
        if (id(t), rows) not in built:
            built[id(t), rows] = _gluon_descriptor(t, rows, block_d)
        return built[id(t), rows]

    fused = config.fused
    if not fused:
        c = config.dq
        num_m_blocks = -(-seqlen_q // c.block_m)
        _GLUON_DQ.launch(
            key, (num_m_blocks * batch * heads_q, 1, 1),
            (describe(q, c.block_m), describe(k, c.block_n), describe(v, c.block_n), describe(grad_output, c.block_m),
             describe(dq, c.block_m), out, lse, delta, scale, scale * _LOG2E, *out.stride()[:3],
             *lse_strides, heads_q, group, seqlen_q, seqlen_k, num_m_blocks, *window,
             head_dim, c.block_m, c.block_n, block_d, c.num_stages, delta_here),
            num_warps=c.num_warps, num_stages=1, device_index=device_index)
    elif delta_here:
        raise ValueError("the fused Gluon backward needs delta computed before it (delta_here=False)")
    c = config.dkdv
    num_n_blocks = -(-seqlen_k // c.block_n)
    grid = (num_n_blocks * batch * heads_kv, 1, 1)
    inputs = (describe(q, c.block_m), describe(k, c.block_n), describe(v, c.block_n), describe(grad_output, c.block_m),
              describe(dk, c.block_n), describe(dv, c.block_n))
    rest = (lse, delta, scale, scale * _LOG2E, *lse_strides, heads_kv, group, seqlen_q, seqlen_k, num_n_blocks,
            *window, c.block_m, c.block_n, block_d, c.num_stages)
    if not fused:
        _GLUON_DKDV.launch(key, grid, (*inputs, *rest), num_warps=c.num_warps, num_stages=1, device_index=device_index)
        return
    dq_acc = torch.zeros(q.shape, dtype=torch.float32, device=q.device)
    _GLUON_FUSED.launch(key, grid, (*inputs, _gluon_descriptor(dq_acc, c.block_m, block_d), *rest),
                        num_warps=c.num_warps, num_stages=1, device_index=device_index,
                        maxnreg=fused_backward_maxnreg(block_d, c))
    torch.mul(dq_acc, scale, out=dq)
