"""What every benchmark shares: timing with intervals, error measures, FLOP counts, the
environment record and the results files.

Timing follows shared/MEASURING.md: GPU time from CUDA events (`triton.testing.do_bench`
medians, repeated for an interval), wall-clock per call from back-to-back calls between two
synchronisations (the host overhead users feel on small calls), and ratios with a bootstrap
95% interval taken in the same run.
"""
from __future__ import annotations

import csv
import datetime
import json
import os
import platform
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from ..device import interpreter_active


@dataclass
class Timing:
    """A time in milliseconds: the median of `samples` and its 95% bootstrap interval."""

    median_ms: float
    lo_ms: float
    hi_ms: float
    samples: list = field(default_factory=list, repr=False)

    @classmethod
    def from_samples(cls, samples):
        samples = sorted(samples)
        lo, hi = bootstrap_interval(samples, statistics.median)
        return cls(statistics.median(samples), lo, hi, samples)


def bootstrap_interval(samples, stat, *, resamples: int = 2000, seed: int = 0):
    if len(samples) < 2:
        return samples[0], samples[0]
    rng = random.Random(seed)
    n = len(samples)
    values = sorted(stat([samples[rng.randrange(n)] for _ in range(n)]) for _ in range(resamples))
    return values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def synchronize() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def time_gpu(fn, *, warmup_ms: float = 25, rep_ms: float = 100, repeats: int = 5) -> Timing:
    """GPU time of `fn` from CUDA events: `repeats` independent do_bench medians.

    Without a GPU (the interpreter) it falls back to host timing of synchronous calls.
    """
    if not torch.cuda.is_available():
        return time_wall(fn, calls=1, repeats=repeats)
    from triton.testing import do_bench

    fn()  # compile / autotune outside the timed region
    synchronize()
    return Timing.from_samples(
        [do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median") for _ in range(repeats)])


def time_wall(fn, *, calls: int = 200, repeats: int = 5) -> Timing:
    """Wall-clock per call, host and GPU together: `calls` back-to-back calls between syncs."""
    fn()
    synchronize()
    samples = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        synchronize()
        samples.append((time.perf_counter() - start) * 1e3 / calls)
    return Timing.from_samples(samples)


def speedup_interval(ours: Timing, theirs: Timing, *, resamples: int = 2000, seed: int = 0):
    """theirs / ours (above 1: we are faster) with a bootstrap 95% interval."""
    ratio = theirs.median_ms / ours.median_ms
    if len(ours.samples) < 2 or len(theirs.samples) < 2:
        return ratio, ratio, ratio
    rng = random.Random(seed)
    a, b = ours.samples, theirs.samples
    values = sorted(
        statistics.median([b[rng.randrange(len(b))] for _ in b]) /
        statistics.median([a[rng.randrange(len(a))] for _ in a]) for _ in range(resamples))
    return ratio, values[int(0.025 * resamples)], values[int(0.975 * resamples) - 1]


def paired_speedup_interval(ours, theirs, *, resamples: int = 2000, seed: int = 0):
    """theirs / ours (above 1: we are faster) from timings taken in pairs, ours[i] and theirs[i]
    back to back in round i: the median of the rounds' ratios with a bootstrap 95% interval that
    resamples whole rounds. A drift (clocks, temperature) shared by a round's two timings cancels
    in its ratio, where `speedup_interval`, which resamples each side on its own, counts it as
    spread."""
    if len(ours) != len(theirs) or not ours:
        raise ValueError(f"paired timings need as many rounds on each side, got {len(ours)} and {len(theirs)}")
    ratios = [b / a for a, b in zip(ours, theirs)]
    lo, hi = bootstrap_interval(ratios, statistics.median, resamples=resamples, seed=seed)
    return statistics.median(ratios), lo, hi


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; inf if out has NaN."""
    out, ref = out.double(), ref.double()
    if torch.isnan(out).any():
        return float("inf")
    return ((out - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def max_abs_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (out.double() - ref.double()).abs().max().item() if out.numel() else 0.0


def attention_pairs(seqlen_q, seqlen_k, causal=False, window_size=(-1, -1)) -> int:
    """Query-key pairs attention computes: those in the band of query i, keys c - left <= j <=
    c + right with c = i + Sk - Sq (bottom-right alignment; -1 unbounded; causal: right = 0)."""
    left, right = window_size
    if causal:
        right = 0
    c = torch.arange(seqlen_q, dtype=torch.float64) + (seqlen_k - seqlen_q)
    lo = (c - left).clamp(min=0) if left >= 0 else torch.zeros_like(c)
    hi = (c + right).clamp(max=seqlen_k - 1) if right >= 0 else torch.full_like(c, seqlen_k - 1)
    return int((hi - lo + 1).clamp(min=0).sum().item())


def attention_flops(batch, heads_q, seqlen_q, seqlen_k, head_dim, causal, mode="fwd", window_size=(-1, -1)) -> float:
    """4*B*H*D per computed pair for the forward, counting only the unmasked pairs (causal,
    bottom-right, and sliding windows: `attention_pairs`); the backward counts 2.5x the forward,
    forward+backward 3.5x."""
    fwd = 4.0 * batch * heads_q * attention_pairs(seqlen_q, seqlen_k, causal, window_size) * head_dim
    return fwd * {"fwd": 1.0, "bwd": 2.5, "fwd+bwd": 3.5}[mode]


def moe_flops(tokens, top_k, hidden, expert_dim, mode="fwd") -> float:
    """6*T*k*H*I for the forward of SwiGLU experts; 18*T*k*H*I forward+backward."""
    return {"fwd": 6.0, "fwd+bwd": 18.0}[mode] * tokens * top_k * hidden * expert_dim


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
        ms = time_gpu(lambda: torch.matmul(a, b, out=c), repeats=3).median_ms
        best = max(best, 2.0 * n ** 3 / (ms * 1e-3) / 1e12)
        del a, b, c
    torch.cuda.empty_cache()
    return best


def write_results(out_dir, name: str, rows: list[dict], meta: dict) -> tuple[Path, Path]:
    """Writes <out_dir>/<name>.json ({"meta", "rows"}) and <name>.csv (one line per row)."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    json_path, csv_path = out / f"{name}.json", out / f"{name}.csv"
    json_path.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1, default=str) + "\n")
    columns = list(dict.fromkeys(key for row in rows for key in row))
    with open(csv_path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns)
        writer.writeheader()
        writer.writerows(rows)
    return json_path, csv_path


def progress(iterable, desc: str = ""):
    """A progress bar on stderr (tqdm when installed; a plain counter otherwise)."""
    items = list(iterable)
    try:
        from tqdm import tqdm
    except ImportError:
        def plain():
            for i, item in enumerate(items):
                print(f"\r{desc} {i + 1}/{len(items)}", end="", flush=True, file=sys.stderr)
                yield item
            print(file=sys.stderr)
        return plain()
    return tqdm(items, desc=desc, disable=os.environ.get("FLASHMOE_NO_PROGRESS") == "1")
