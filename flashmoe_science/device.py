"""Hardware facts in one place: which GPU generation we run on, how much shared memory a
block may take, how many SMs there are, and whether kernels run through Triton's CPU
interpreter instead of a GPU.

Every launcher asks this module; none re-derives a device fact itself.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch

# Shared memory a single block may use after opting in (cudaDevAttrMaxSharedMemoryPerBlockOptin),
# by compute capability (major * 10 + minor). These are the limits the configuration tables are
# checked against on the CPU, for GPUs we cannot see from here.
SHARED_MEMORY_PER_BLOCK = {
    80: 166912,  # A100: 163 KB
    86: 101376,  # RTX 30xx, A10, A40: 99 KB
    87: 166912,  # Jetson Orin: 163 KB
    89: 101376,  # RTX 40xx, L4, L40: 99 KB
    90: 232448,  # H100, H200: 227 KB
}

# The GPU targets every shipped configuration must compile and fit on.
SUPPORTED_TARGETS = (80, 86, 89, 90)


def interpreter_active() -> bool:
    """True when Triton runs kernels on the CPU (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@dataclass(frozen=True)
class DeviceInfo:
    name: str
    capability: int  # major * 10 + minor, e.g. 90 for Hopper
    sm_count: int
    shared_memory_per_block: int  # bytes, with opt-in
    l2_bytes: int

    @property
    def arch_family(self) -> int:
        """The configuration family: 90 (Hopper-class: wgmma and 227 KB of shared memory),
        80 (A100-class, 163 KB) or 89 (the 99 KB parts: sm86, sm89, and consumer sm120)."""
        if self.capability >= 90 and self.shared_memory_per_block >= 200 * 1024:
            return 90
        if self.shared_memory_per_block >= 160 * 1024:
            return 80
        return 89

    @property
    def hopper(self) -> bool:
        """An sm90 GPU: the tensor memory accelerator (TMA), wgmma and the Gluon kernels."""
        return self.capability // 10 == 9


# What the interpreter pretends to be: configurations are picked as for an A100, the most
# conservative generation with large shared memory; sizes do not matter on the CPU.
INTERPRETER_DEVICE = DeviceInfo("Triton CPU interpreter", 80, 4, SHARED_MEMORY_PER_BLOCK[80], 0)


@functools.lru_cache(maxsize=None)
def device_info(index: int | None = None) -> DeviceInfo:
    """Facts about CUDA device `index` (the current device if None), read once and cached."""
    if not torch.cuda.is_available():
        return INTERPRETER_DEVICE
    if index is None:
        index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    capability = props.major * 10 + props.minor
    smem = getattr(props, "shared_memory_per_block_optin", 0) or SHARED_MEMORY_PER_BLOCK.get(
        capability, 101376 if capability < 90 else 232448
    )
    return DeviceInfo(
        name=props.name,
        capability=capability,
        sm_count=props.multi_processor_count,
        shared_memory_per_block=int(smem),
        l2_bytes=int(getattr(props, "L2_cache_size", 0)),
    )


def info_for(tensor: torch.Tensor) -> DeviceInfo:
    """Device facts for the device a tensor lives on (the interpreter's for CPU tensors)."""
    if tensor.device.type != "cuda":
        return INTERPRETER_DEVICE
    return device_info(tensor.device.index if tensor.device.index is not None else torch.cuda.current_device())


def check_runnable(name: str, tensor: torch.Tensor) -> None:
    """Raise a clear error when `tensor` is somewhere our kernels cannot run."""
    if tensor.device.type == "cuda":
        return
    if tensor.device.type == "cpu" and interpreter_active():
        return
    if tensor.device.type == "cpu":
        raise ValueError(
            f"{name} is on the CPU; flashmoe_science kernels run on CUDA GPUs, or on the CPU only "
            "through Triton's interpreter (set TRITON_INTERPRET=1 before importing triton)"
        )
    raise ValueError(f"{name} is on device {tensor.device}; only CUDA devices are supported")


# Triton's input precision for fp32 matrix products, by torch.get_float32_matmul_precision():
# "highest" (PyTorch's default) runs each product as three TF32 products (3xTF32, errors near
# fp32's, as PyTorch's own fp32 matmuls and attention have); "high" and "medium" let PyTorch use
# TF32, and so do we (one TF32 product: about 3x faster, 10 mantissa bits per operand).
FP32_DOT_PRECISION = {"highest": "tf32x3", "high": "tf32", "medium": "tf32"}


def fp32_dot_precision() -> str:
    """The input precision our kernels' fp32 products use now (`FP32_DOT_PRECISION`)."""
    return FP32_DOT_PRECISION.get(torch.get_float32_matmul_precision(), "tf32x3")

