"""FP8 facts shared by the FP8 paths (the MoE experts' `moe/fp8.py`, attention's `attention/fp8.py`):
the storage type, its range, the GPUs with FP8 tensor cores, and the exact e4m3 rounding the
kernels use where Triton's own conversion cannot be trusted."""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from .device import info_for, interpreter_active

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite float8_e4m3fn
# FP8 tensor cores: sm89 (Ada) and sm90 (Hopper); sm80 and sm86 have none.
FP8_MIN_CAPABILITY = 89
# Kernels that quantise values they computed (attention's P) round them with `round_to_e4m3` first
# under Triton's interpreter, whose conversion to FP8 is wrong; the GPU's conversion rounds to
# nearest even itself. Read when the kernel modules are imported, as Triton decides then too.
SOFTWARE_FP8_ROUNDING = tl.constexpr(interpreter_active())


def check_fp8_device(what: str, tensor: torch.Tensor) -> None:
    """Raise a clear error where `tensor`'s GPU has no FP8 tensor cores (the CPU interpreter runs FP8)."""
    device = info_for(tensor)
    if tensor.is_cuda and device.capability < FP8_MIN_CAPABILITY:
        raise RuntimeError(f"{what} need FP8 tensor cores (compute capability 8.9 or newer); "
                           f"{device.name} is sm{device.capability}")


@triton.jit
def round_to_e4m3(v):
    """v (|v| <= 448) rounded to the nearest e4m3 value, ties to even, in fp32: the grid step
    is 2^(e - 3) for |v| in [2^e, 2^(e + 1)), 2^-9 below 2^-6 (subnormals). Converting the result
    to FP8 is then exact; rounding here rather than in the conversion gives the same values on
    every GPU and in Triton's interpreter, whose conversion drops the carry into the exponent
    (124.3 -> 64)."""
    step = tl.exp2(tl.maximum(tl.floor(tl.log2(tl.maximum(tl.abs(v), 1e-30))), -6.0) - 3.0)
    r = v / step
    nearest = tl.floor(r + 0.5)
    tie_to_odd = (nearest - r == 0.5) & (nearest - 2.0 * tl.floor(nearest * 0.5) == 1.0)
    return tl.where(tie_to_odd, nearest - 1.0, nearest) * step


@triton.jit
def to_e4m3(v):
    """v (fp32, |v| <= 448 or NaN) as float8 e4m3, rounded to nearest even, NaN kept NaN: the
    GPU's conversion, or under Triton's interpreter `round_to_e4m3` and NaN's bits set by hand
    (the interpreter's conversion gets both wrong)."""
    if SOFTWARE_FP8_ROUNDING:
        bits = round_to_e4m3(v).to(tl.float8e4nv).to(tl.uint8, bitcast=True)
        return tl.where(v == v, bits, 0x7F).to(tl.uint8).to(tl.float8e4nv, bitcast=True)
    return v.to(tl.float8e4nv)
