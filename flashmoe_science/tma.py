"""What the tensor memory accelerator (TMA, sm90) needs, for every kernel that moves tiles through
tensor descriptors (attention's and the MoE GEMMs'): which tensors it can address, and descriptors
built without re-running the checks their classes repeat."""
from __future__ import annotations

import functools

import torch
from triton.experimental.gluon import language as gl
from triton.experimental.gluon.nvidia.hopper import TensorDescriptor as GluonDescriptor


def addressable(*tensors: torch.Tensor) -> bool:
    """Whether TMA can address these tensors: base 16-byte aligned, every stride but the last a
    multiple of 16 bytes, the last 1, no empty dimension (which device they are on is the
    caller's question)."""
    for t in tensors:
        if t.stride(-1) != 1 or t.data_ptr() % 16 or t.numel() == 0:
            return False
        if any(s * t.element_size() % 16 for s in t.stride()[:-1]):
            return False
    return True


def unchecked_descriptor(cls, base, shape, strides, block_shape, *layout):
    """A tensor descriptor of `cls` (Triton's or Gluon's, whose `layout` comes last) over a tensor
    `addressable` has passed, without the class's own checks: those repeat what `addressable`
    checked (alignment, positive shape, unit last stride) and cost several microseconds of host
    time per descriptor, for a dozen descriptors an attention backward call (skipping them took
    an H100 backward call at B = 32, S = 512 from 300 to 251 us of host time). Block shapes are
    the tables' powers of two, which the compile-and-fit test builds."""
    desc = object.__new__(cls)
    desc.__dict__.update(zip(cls.__dataclass_fields__, (base, shape, strides, block_shape, *layout)), padding="zero")
    return desc


@functools.lru_cache(maxsize=None)
def gluon_box_layout(rows: int, cols: int):
    """The shared-memory layout of a 16-bit TMA box of a Gluon kernel, as wgmma reads it."""
    return gl.NVMMASharedLayout.get_default_for([rows, cols], gl.bfloat16)


def gluon_descriptor(t: torch.Tensor, rows: int, cols: int):
    """A Gluon TMA descriptor of 2-D 16-bit tensor t (`addressable`) in boxes of (rows, cols)."""
    return unchecked_descriptor(GluonDescriptor, t, list(t.shape), list(t.stride()), [rows, cols],
                                gluon_box_layout(rows, cols))
