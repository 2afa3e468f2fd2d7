"""Where an MoE layer's time goes at decode sizes, for maintainers choosing what to speed up.

    python -m flashmoe_science.bench.sweeps.moe_decode profile [--shapes S ...]
        fused_moe (bf16, and block-scaled FP8 weights) at T = 1 and 4 captured in a CUDA graph:
        the graph's time, then a torch.profiler record of 50 replays: each kernel's median GPU
        time and the replay's span (first kernel start to last kernel end; the rest of the graph
        time is the graph's own launch).
    python -m flashmoe_science.bench.sweeps.moe_decode route
        the routing launch alone (top-k and the layout) at T 1 to 64 for Qwen3-30B-A3B's,
        DeepSeek-V2-Lite's and Mixtral's E and k, under each expert padding (256, or E's next
        power of two) and warp count, timed per call in a CUDA graph of 20 calls, its outputs
        compared bit for bit with the first setting's (DIFF where they differ).

The output format is that of benchmarks/results/moe_decode/.
"""
from __future__ import annotations

import argparse

import torch

from ...moe import configs, fused_moe, routing
from ..moe import SHAPES
from ..timing import graph_replay, time_gpu
from .moe_fp8_decode import layer_weights

PROFILED_REPLAYS = 50
ROUTE_CASES = ((128, 8), (64, 6), (8, 2))  # (E, k) of Qwen3-30B-A3B, DeepSeek-V2-Lite, Mixtral
ROUTE_TOKENS = (1, 2, 4, 8, 16, 64)
ROUTE_CALLS_PER_GRAPH = 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=("profile", "route"))
    parser.add_argument("--shapes", nargs="+", default=["qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite"],
                        choices=list(SHAPES))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("this sweep times kernels on a GPU")
    if args.what == "profile":
        for name in args.shapes:
            _profile_shape(name)
    else:
        _route_sweep()


def _profile_shape(name: str) -> None:
    from torch.profiler import ProfilerActivity, profile

    E, k, H, I = SHAPES[name]
    g, w1, w2, (q1, s1), (q2, s2) = layer_weights(SHAPES[name])
    for T in (1, 4):
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        logits = torch.randn(T, E, device="cuda", generator=g)
        calls = (("bf16", lambda: fused_moe(x, w1, w2, logits, k)),
                 ("fp8", lambda: fused_moe(x, q1, q2, logits, k, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))))
        for label, fn in calls:
            replay = graph_replay(fn)
            us = time_gpu(replay, warmup_ms=10, rep_ms=60, repeats=5).median_ms * 1e3
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for _ in range(PROFILED_REPLAYS):
                    replay()
                torch.cuda.synchronize()
            events = sorted((e for e in prof.events() if e.device_type.name == "CUDA"),
                            key=lambda e: e.time_range.start)
            per_replay = len(events) // PROFILED_REPLAYS
            spans = sorted(events[(r + 1) * per_replay - 1].time_range.end - events[r * per_replay].time_range.start
                           for r in range(PROFILED_REPLAYS))
            print(f"{name} T={T} {label}: graph {us:.1f} us, {per_replay} kernels, "
                  f"span median {spans[len(spans) // 2]:.1f} us")
            durations: dict = {}
            for e in events:
                durations.setdefault(e.name, []).append(e.time_range.end - e.time_range.start)
            for kernel, ds in durations.items():
                ds.sort()
                print(f"    {ds[len(ds) // 2]:7.1f} us x{len(ds) // PROFILED_REPLAYS}  {kernel[:90]}", flush=True)


def _route_sweep() -> None:
    table_warps, table_pad = configs.route_warps, configs.route_expert_pad
    try:
        for E, k in ROUTE_CASES:
            for T in ROUTE_TOKENS:
                logits = torch.randn(T, E, device="cuda")
                plan = routing.DispatchPlan(T, E, k, 16, logits.device)
                first, line = None, []
                for pad in (configs.MAX_EXPERTS, max(16, 1 << (E - 1).bit_length())):
                    for warps in (1, 2, 4, 8):
                        configs.route_expert_pad = lambda *_, pad=pad: pad
                        configs.route_warps = lambda *_, warps=warps: warps
                        routing._ROUTE._compiled.clear()

                        def call(key=("route-sweep", T, E, k, warps, pad)):
                            return routing.route_pairs(logits, plan, key, sigmoid=False, renormalize=True,
                                                       with_layout=True)
                        weights, ids, layout = call()
                        got = [t.clone() for t in (weights, ids, layout.sorted_pairs, layout.block_expert,
                                                   layout.block_rows)]
                        first = got if first is None else first
                        same = all(torch.equal(a, b) for a, b in zip(got, first))
                        line.append(f"pad{pad}/w{warps} {_us_per_call(call):5.2f}{'' if same else ' DIFF'}")
                print(f"E={E} k={k} T={T}: " + "  ".join(line), flush=True)
    finally:
        configs.route_warps, configs.route_expert_pad = table_warps, table_pad
        routing._ROUTE._compiled.clear()


def _us_per_call(fn) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(ROUTE_CALLS_PER_GRAPH):
            fn()
    return time_gpu(graph.replay, warmup_ms=10, rep_ms=50, repeats=5).median_ms * 1e3 / ROUTE_CALLS_PER_GRAPH


if __name__ == "__main__":
    main()
