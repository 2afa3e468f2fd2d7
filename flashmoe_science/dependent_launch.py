"""Programmatic dependent launch (PDL: PTX griddepcontrol, sm90 and newer), shared by the kernels
that launch so.

A kernel launched with `launch_pdl=True` may start while the kernel before it in the stream is
still running: as soon as every program of that kernel has released its dependents
(`gdc_launch_dependents`), or has finished. Its launch, and its programs' start, then pass under
the earlier kernel's tail. Before it reads or writes anything the earlier kernel touches, it must
wait (`gdc_wait`: the earlier grid has finished and its memory is visible). Waiting is
transitive along a chain of such kernels: a kernel cannot finish before its own wait returned,
so the wait of the next one also covers every kernel before.
"""
from __future__ import annotations

import triton
import triton.language as tl

from .device import DeviceInfo, interpreter_active

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait
except ImportError:  # a Triton without programmatic dependent launch (before 3.4): never PDL
    gdc_launch_dependents = gdc_wait = None

PDL_AVAILABLE = gdc_wait is not None
PDL_MIN_CAPABILITY = 90  # griddepcontrol: sm90 and newer


def pdl_compiles(capability: int) -> bool:
    """Whether kernels for `capability` are built to launch as programmatic dependents."""
    return PDL_AVAILABLE and capability >= PDL_MIN_CAPABILITY


def pdl_runs(device: DeviceInfo) -> bool:
    """Whether kernels on `device` launch as programmatic dependents (never in the interpreter)."""
    return pdl_compiles(device.capability) and not interpreter_active()


def launch_options(pdl: bool) -> dict:
    """The launcher's options of a kernel that launches as a programmatic dependent (or not)."""
    return {"launch_pdl": True} if pdl else {}


@triton.jit
def chain_start(PDL: tl.constexpr):
    """The first statement of a kernel launched as a programmatic dependent (PDL): wait for the
    kernels before it. Every program runs it, including those with nothing to do, so the kernel
    never finishes before the ones it depends on. Its own dependents launch as it finishes (the
    trigger a finishing grid implies); releasing them as each program starts measured slower
    where they then sat on the SMs (MoE decode, `moe/configs.py`)."""
    if PDL:
        gdc_wait()


@triton.jit
def chain_end(PDL: tl.constexpr):
    """The last statement of a programmatic dependent that touches nothing the kernels before it
    write (it reads what was ready before the chain began): its work runs beside theirs, and it
    waits for them only before it finishes, so the chain's waits stay transitive."""
    if PDL:
        gdc_wait()


@triton.jit
def release_dependents(PDL: tl.constexpr):
    """Let the next kernel, a programmatic dependent, launch (the first kernel of a chain, which
    itself launches the ordinary way)."""
    if PDL:
        gdc_launch_dependents()
