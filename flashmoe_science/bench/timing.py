"""Timing with intervals, as shared/MEASURING.md asks: GPU time from CUDA events
(`triton.testing.do_bench` medians, repeated for an interval), wall-clock per call from
back-to-back calls between two synchronisations (the host overhead users feel on small calls),
and ratios with a bootstrap 95% interval taken in the same run. Imports no benchmark, so
`doctor` uses it too.
"""
from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass, field

import torch


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


def captured_graph(fn):
    """(graph, fn's outputs as the graph writes them): fn called once on a side stream, as capture
    asks, then captured in a CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outputs = fn()
    return graph, outputs


def graph_replay(fn):
    """fn captured in a CUDA graph (after two warm calls, one on a side stream, as capture asks);
    returns the replay: time it for GPU time without host work or launch gaps."""
    fn()
    return captured_graph(fn)[0].replay


def time_wall(fn, *, calls: int = 200, repeats: int = 5, host_samples: list | None = None) -> Timing:
    """Wall-clock per call, host and GPU together: `calls` back-to-back calls between syncs.
    `host_samples`, a list, also receives each repeat's host time per call: until the last call
    returns, before the synchronisation (what the host spends issuing a call, while the GPU queue
    has room)."""
    fn()
    synchronize()
    samples = []
    for _ in range(repeats):
        synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        issued = time.perf_counter()
        synchronize()
        samples.append((time.perf_counter() - start) * 1e3 / calls)
        if host_samples is not None:
            host_samples.append((issued - start) * 1e3 / calls)
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
