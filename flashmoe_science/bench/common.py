"""What every benchmark shares besides timing (`timing.py`) and FLOP counts (`flops.py`): error
measures, the environment record, the device's measured ceilings and the results files."""
from __future__ import annotations

import datetime
import functools
import json
import os
import platform
import sys
from pathlib import Path

import torch

from ..device import interpreter_active
from .timing import time_gpu


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf if out has NaN."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0


def environment() -> dict:
    """The facts a results file needs to be read later: device, versions, date."""
    import triton

    env = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "interpreter": interpreter_active(),
    }
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        env.update(gpu=props.name, capability=f"{props.major}.{props.minor}",
                   sm_count=props.multi_processor_count, gpu_memory_gb=round(props.total_memory / 2**30, 1))
    else:
        env.update(gpu=None, capability=None)
    return env


def measure_copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in TB/s, counting bytes read plus bytes written."""
    if not torch.cuda.is_available():
        return float("nan")
    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda").normal_()
    dst = torch.empty_like(src)
    ms = time_gpu(lambda: dst.copy_(src), repeats=3).median_ms
    return 2 * nbytes / (ms * 1e-3) / 1e12


def measure_matmul_ceiling(sizes=(4096, 8192, 16384)) -> float:
    """The bf16 matmul ceiling in TFLOP/s: the fastest cuBLAS product of square bf16 matrices of
    `sizes`, what the tensor cores reach on a plain GEMM; throughput figures are reported as a
    fraction of it."""
    if not torch.cuda.is_available():
        return float("nan")
    best = 0.0
    for n in sizes:
        a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
        b, c = torch.randn_like(a), torch.empty_like(a)
        ms = time_gpu(functools.partial(torch.matmul, a, b, out=c), repeats=3).median_ms
        best = max(best, 2.0 * n ** 3 / (ms * 1e-3) / 1e12)
        del a, b, c
    torch.cuda.empty_cache()
    return best


def write_results(out_dir, name: str, rows: list[dict], meta: dict) -> Path:
    """Writes <out_dir>/<name>.json: {"meta": the run's environment and options, "rows": one dict
    per measurement}."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path = out / f"{name}.json"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    return json_path


def progress(iterable, desc: str = ""):
    """Progress on stderr: a bar on a terminal (tqdm when installed, else a counter); in a log (not
    a terminal, or FLASHMOE_NO_PROGRESS=1) one line per tenth of the items, so lines never run
    together."""
    items = list(iterable)
    quiet = os.environ.get("FLASHMOE_NO_PROGRESS") == "1" or not sys.stderr.isatty()
    if not quiet:
        try:
            from tqdm import tqdm
        except ImportError:
            pass
        else:
            return tqdm(items, desc=desc)

    def plain():
        step = max(1, len(items) // 10)
        for i, item in enumerate(items):
            done = i + 1
            if not quiet:
                print(f"\r{desc} {done}/{len(items)}", end="", flush=True, file=sys.stderr)
            elif done % step == 0 or done == len(items):
                print(f"{desc} {done}/{len(items)}", flush=True, file=sys.stderr)
            yield item
        if not quiet:
            print(file=sys.stderr)
    return plain()
