"""TMA tensor descriptors (sm90) over the attention tensors, for the Triton kernels that move
their tiles through descriptors and for the Gluon kernels.

The tensor memory accelerator needs every base pointer 16-byte aligned and every stride but the
last a multiple of 16 bytes; `supports` and `supports_backward` say whether a call's tensors
qualify. A descriptor load fills rows past the tensor's end, and columns past head_dim, with
zeros; a descriptor store drops them.
"""
from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor
from triton.tools.tensor_descriptor import TensorDescriptor

from ..device import info_for
from ..tma import addressable, unchecked_descriptor
from .configs import head_dim_block


def supports(*tensors: torch.Tensor) -> bool:
    """Whether the tensor memory accelerator can address these (B, H, S, D) CUDA tensors."""
    return all(t.is_cuda for t in tensors) and addressable(*tensors)


def supports_backward(tensors, head_dim: int, head_dim_v: int | None = None) -> bool:
    """Whether the backward kernels can move tiles through descriptors: the tensors (grad_output,
    q, k, v, out) qualify, on an sm90 GPU, and so do the gradients, laid out like q, k, v (rows
    of head_dim, and v's head_dim_v, 16-bit values a multiple of 16 bytes apart)."""
    q = tensors[1]
    dims_ok = head_dim % 8 == 0 and (head_dim_v or head_dim) % 8 == 0
    return supports(*tensors) and q.element_size() == 2 and dims_ok and info_for(q).hopper


def tma_descriptor(t: torch.Tensor, rows: int, block_d: int) -> TensorDescriptor:
    """A Triton TMA descriptor in tiles of `rows` x block_d over dense (B, H, S, D) `t`, or packed
    (total, H, D) `t` seen as one batch entry (1, H, total, D)."""
    if t.dim() == 3:
        total, heads, head_dim = t.shape
        shape, strides = [1, heads, total, head_dim], [t.numel(), t.stride(1), t.stride(0), 1]
    else:
        shape, strides = list(t.shape), list(t.stride())
    return unchecked_descriptor(TensorDescriptor, t, shape, strides, [1, 1, rows, block_d])


def backward_descriptors(row_tensors, key_tensors, config, built=None):
    """Descriptors for one backward kernel: `row_tensors` in tiles of config.block_m rows,
    `key_tensors` of config.block_n (an AttentionConfig). Dense (B, H, S, D) tensors as they are;
    packed (total, H, D) ones as one batch entry (1, H, total, D). `built`, a dict shared by the
    calls for one backward's kernels, hands a tensor's descriptor to every kernel whose tiles of it
    have the same rows. Each tile spans its tensor's padded head dim (v's may differ: MLA)."""
    built = {} if built is None else built

    def describe(t, rows):
        if (id(t), rows) not in built:
            built[id(t), rows] = tma_descriptor(t, rows, head_dim_block(t.shape[-1]))
        return built[id(t), rows]

    return (tuple(describe(t, config.block_m) for t in row_tensors),
            tuple(describe(t, config.block_n) for t in key_tensors))


@functools.lru_cache(maxsize=None)
def _gluon_layout(rows: int, block_d: int, dtype: torch.dtype):
    """The shared-memory layout wgmma (or, for fp32, the dQ reduce) wants for a (1, 1, rows,
    block_d) tile: the widest swizzle its rows allow."""
    element = {torch.float16: gl.float16, torch.bfloat16: gl.bfloat16, torch.float32: gl.float32,
               torch.float8_e4m3fn: gl.float8e4nv}[dtype]
    return gl.NVMMASharedLayout.get_default_for([1, 1, rows, block_d], element)


def gluon_descriptor(t: torch.Tensor, rows: int, block_d: int):
    """A Gluon TMA descriptor over dense (B, H, S, D) `t` in tiles of `rows` x block_d."""
    return unchecked_descriptor(GluonDescriptor, t, list(t.shape), list(t.stride()), [1, 1, rows, block_d],
                               _gluon_layout(rows, block_d, t.dtype))
