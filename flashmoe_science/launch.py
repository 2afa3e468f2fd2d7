"""A lean launch path for Triton kernels, and a record of what actually ran.

Launching a `@triton.jit` function the ordinary way re-binds every argument and recomputes its
specialisation key on each call: about 10 us of host time per launch on an H100 host, more than
a small attention call spends on the GPU. Our launchers know when two calls must compile to the
same kernel (same shapes, strides, dtypes and pointer alignment), so they key a cache on exactly
that and call the compiled kernel's launcher directly on a hit.

Every launch is also recorded (`last_launch(name)`): kernel name, constexprs, warps, stages,
shared memory and grid read off the compiled kernel itself. `flashmoe-science doctor` prints
this record to prove which kernel and configuration ran.
"""
from __future__ import annotations

import ctypes
import functools
import inspect
import threading
from dataclasses import dataclass, field

import torch
from triton import knobs
from triton.runtime import driver

from .device import fp32_dot_precision, interpreter_active

_MAX_ENTRIES = 4096
# Whether kernels were defined for the interpreter: Triton decides when a kernel is defined, so
# this is read once, when the kernel modules are imported.
_INTERPRETED = interpreter_active()


class PlanCache(dict):
    """Plans (what a call's shapes, strides, dtypes and options decide) under their keys. Emptied
    when full, so a program that keeps changing shapes cannot grow it without bound."""

    MAX_ENTRIES = _MAX_ENTRIES

    def remember(self, key, plan):
        if len(self) >= self.MAX_ENTRIES:
            self.clear()
        self[key] = plan
        return plan


def _current_stream(device: int) -> int:
    return driver.active.get_current_stream(device)


_THREAD = threading.local()


@functools.lru_cache(maxsize=None)
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def _bind_context(device: int) -> None:
    """Makes `device`'s primary CUDA context current on this thread if none is, once per thread.
    Triton 3.6 encodes a kernel's TMA descriptors (`cuTensorMapEncodeTiled`) before its launcher
    binds a context, so on a thread that has not touched CUDA through the driver yet (autograd's
    backward thread, when attention's backward is the first node it runs; a user's worker
    thread) the encoding fails with "invalid device context". This is what Triton's launcher
    itself does before a launch."""
    bound = getattr(_THREAD, "devices", None)
    if bound is None:
        bound = _THREAD.devices = set()
    if device in bound:
        return
    cuda = _libcuda()
    ctx = ctypes.c_void_p()
    if cuda.cuCtxGetCurrent(ctypes.byref(ctx)) == 0 and not ctx.value:
        handle = ctypes.c_int()
        if cuda.cuDeviceGet(ctypes.byref(handle), device) == 0 and \
                cuda.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), handle) == 0:
            cuda.cuCtxSetCurrent(ctx)
    bound.add(device)


@dataclass(frozen=True)
class LaunchRecord:
    kernel: str
    grid: tuple
    constexprs: dict
    num_warps: int | None
    num_stages: int | None
    shared_bytes: int | None
    interpreted: bool
    compiled: object = field(default=None, repr=False, compare=False)  # Triton's CompiledKernel


_RECORDS: dict[str, LaunchRecord] = {}


def last_launch(op: str) -> LaunchRecord | None:
    """What the most recent launch of operation `op` ran (None if it never ran)."""
    return _RECORDS.get(op)


def clear_records() -> None:
    _RECORDS.clear()


class KernelLauncher:
    """Launches one `@triton.jit` function for operation `op`.

    `launch(key, grid, args, num_warps=, num_stages=)` takes every kernel argument positionally,
    constexprs included.
    `key` must determine Triton's specialisation of the call: the caller includes the shapes,
    strides and dtypes the arguments derive from, and the 16-byte alignment of each pointer.
    With `key=None` the call always takes Triton's ordinary path.
    """

    def __init__(self, op: str, fn, *, fp32_dots: bool = False):
        """`fp32_dots`: the kernel's last parameter is DOT_PRECISION, the input precision of its
        fp32 products, which follows torch's float32 matmul precision (`device.fp32_dot_precision`):
        read at every launch, appended to the arguments and to the cache key."""
        self.op = op
        self.fn = fn
        self.fp32_dots = fp32_dots
        self._compiled: dict = {}
        params = inspect.signature(getattr(fn, "fn", fn)).parameters.values()
        self._constexpr_idx = [i for i, p in enumerate(params) if "constexpr" in str(p.annotation)]

    def launch(self, key, grid, args, *, num_warps: int, num_stages: int, device_index: int | None = None,
               **options):
        if _INTERPRETED:
            if self.fp32_dots:
                args = (*args, fp32_dot_precision())
            self.fn[grid](*args)
            _RECORDS[self.op] = LaunchRecord(getattr(self.fn, "__name__", self.op), tuple(grid),
                                             self._constexprs_of(args), None, None, None, True)
            return
        device = torch.cuda.current_device()
        if device_index is not None and device_index != device:
            with torch.cuda.device(device_index):
                return self.launch(key, grid, args, num_warps=num_warps, num_stages=num_stages,
                                   device_index=device_index, **options)
        _bind_context(device)
        if self.fp32_dots:
            precision = fp32_dot_precision()
            args = (*args, precision)
            if key is not None:
                key = (key, precision)
        entry = self._compiled.get(key) if key is not None else None
        if entry is None:
            compiled = self.fn[grid](*args, num_warps=num_warps, num_stages=num_stages, **options)
            md = compiled.metadata
            record = LaunchRecord(compiled.name, tuple(grid), self._constexprs_of(args), md.num_warps,
                                  md.num_stages, md.shared, False, compiled)
            if key is not None:
                if len(self._compiled) >= _MAX_ENTRIES:
                    self._compiled.clear()
                self._compiled[key] = (compiled, record)
            _RECORDS[self.op] = record
            return
        compiled, record = entry
        stream = _current_stream(device)
        enter, exit_ = knobs.runtime.launch_enter_hook, knobs.runtime.launch_exit_hook
        if enter.calls or exit_.calls:  # a profiler listens: give it what Triton's own path gives
            metadata = compiled.launch_metadata(grid, stream, *args)
        else:  # nobody listens: skip building launch metadata and calling empty hook chains
            metadata = enter = exit_ = None
        compiled.run(grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
                     metadata, enter, exit_, *args)
        _RECORDS[self.op] = record

    def _constexprs_of(self, args) -> dict:
        return {self.fn.arg_names[i]: args[i] for i in self._constexpr_idx if i < len(args)}
