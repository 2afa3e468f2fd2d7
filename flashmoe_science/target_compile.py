"""Compile shipped kernel configurations for GPU targets we may not have, and check they fit.

Triton compiles for any CUDA target without a GPU. Each operation's builds module
(`attention/builds.py`, `moe/builds.py`) lists the builds its dispatcher can pick
(`shipped_builds(capability)`); this module compiles every one for sm80, sm86, sm89 and sm90 and
compares the shared memory the compiled kernel asks for with the target's per-block limit (a tile
needing 160 KB on a part that allows 99 KB fails at launch there), and records each build's
registers and spills.

Run as `python -m flashmoe_science.target_compile` (prints JSON). It must run without
TRITON_INTERPRET, because the interpreter replaces kernels with Python functions.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import multiprocessing
import os
import re
import sys
from concurrent.futures import ProcessPoolExecutor
from .device import SHARED_MEMORY_PER_BLOCK, SUPPORTED_TARGETS
from .kernel_build import KernelBuild


def compile_build(build: KernelBuild, capability: int):
    """Compile `build` for sm_<capability>; returns Triton's CompiledKernel."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from triton.experimental.gluon._runtime import GluonASTSource

    names = build.fn.arg_names
    if "DOT_PRECISION" in names and "DOT_PRECISION" not in build.constexprs:
        # fp32 products as shipped by default (`device.fp32_dot_precision`: 3xTF32); 16-bit
        # builds are unchanged by it.
        build = dataclasses.replace(build, constexprs={**build.constexprs, "DOT_PRECISION": "tf32x3"},
                                    signature={**build.signature, "DOT_PRECISION": "constexpr"})
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in build.aligned}
    source = GluonASTSource if build.fn.is_gluon() else ASTSource
    src = source(build.fn, build.signature, build.constexprs, attrs=attrs)
    options = {"num_warps": build.num_warps, "num_stages": build.num_stages}
    if build.maxnreg is not None:
        options["maxnreg"] = build.maxnreg
    return triton.compile(src, target=GPUTarget("cuda", capability, 32), options=options)


def _registers_and_spills(ptxas_log: str) -> tuple[int | None, int | None]:
    """(registers a thread, bytes of spill stores) from ptxas's verbose log."""
    registers = re.search(r"Used (\d+) registers", ptxas_log)
    spills = re.search(r"(\d+) bytes spill stores", ptxas_log)
    return (int(registers.group(1)) if registers else None), (int(spills.group(1)) if spills else None)


def shipped_builds(capability: int) -> list[KernelBuild]:
    """Every build of every operation that the dispatchers can pick on `capability`."""
    from .attention import builds as attention_builds
    from .moe import builds as moe_builds

    return list(attention_builds.shipped_builds(capability)) + list(moe_builds.shipped_builds(capability))


def _compile_row(capability: int, index: int) -> dict:
    """Compile build `index` of `shipped_builds(capability)` and report whether it fits."""
    build = shipped_builds(capability)[index]
    limit = SHARED_MEMORY_PER_BLOCK[capability]
    row = {"target": f"sm{capability}", "label": build.label, "num_warps": build.num_warps,
           "num_stages": build.num_stages, "launch_maxnreg": build.maxnreg, "limit": limit}
    from triton import knobs

    log = io.StringIO()
    try:
        # Triton runs ptxas verbosely and prints its log (registers, spills) when asked.
        with knobs.nvidia.scope(), knobs.compilation.scope(), contextlib.redirect_stdout(log):
            knobs.nvidia.dump_ptxas_log = True
            knobs.compilation.always_compile = True  # a cached build runs no ptxas, so reports nothing
            kernel = compile_build(build, capability)
    except Exception as exc:  # reported, and the test fails on it
        row.update(shared=None, fits=False, error=f"{type(exc).__name__}: {exc}"[:500])
    else:
        ptx = kernel.asm.get("ptx", "")
        bound = re.search(r"^\s*\.maxnreg (\d+)", ptx, re.M)  # the launch's, or Triton's own
        registers, spills = _registers_and_spills(log.getvalue())
        # byte_unpacks: 16-bit halves widened to 32 bits, how the PTX pulls 8-bit values out of packed
        # registers one at a time (an FP8 tensor held a byte a register across a loop).
        row.update(shared=kernel.metadata.shared, fits=kernel.metadata.shared <= limit,
                   wgmma="wgmma" in ptx, tma="cp.async.bulk.tensor" in ptx, griddepcontrol="griddepcontrol" in ptx,
                   byte_unpacks=ptx.count("cvt.u32.u16"),
                   maxnreg=int(bound.group(1)) if bound else None, registers=registers, spill_stores=spills,
                   error=None)
    return row


def check(capabilities=SUPPORTED_TARGETS, workers: int | None = None) -> list[dict]:
    """One row per (target, build), in order. Compiling is CPU-bound and independent per build,
    so `workers` processes (default: one per CPU core) share the list; each process rebuilds the
    list itself, because Triton's JIT functions do not pickle."""
    jobs = [(cap, index) for cap in capabilities for index in range(len(shipped_builds(cap)))]
    workers = min(workers or os.cpu_count() or 1, len(jobs))
    if workers <= 1:
        return [_compile_row(cap, index) for cap, index in jobs]
    # spawn, not fork: a parent that has touched CUDA or Triton's driver must not be forked.
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=context) as pool:
        return list(pool.map(_compile_row, *zip(*jobs)))


def main(argv=None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("unset TRITON_INTERPRET: the interpreter cannot compile for GPU targets", file=sys.stderr)
        return 2
    argv = sys.argv[1:] if argv is None else argv
    caps = tuple(int(a.replace("sm", "")) for a in argv) or SUPPORTED_TARGETS
    rows = check(caps)
    json.dump(rows, sys.stdout, indent=1)
    print()
    return 0 if all(r["fits"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
