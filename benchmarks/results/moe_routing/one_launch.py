"""Small calls: routing + layout in one launch ("full") against route + count + align (the
large calls' path), in CUDA graphs and by the profiler. The layout must not change."""
import json
import torch
from flashmoe_science.moe import routing, configs


def run(logits, E, k, one_launch):
    configs.ONE_LAUNCH_TOKENS = 128 if one_launch else 1
    configs.ONE_LAUNCH_PAIRS = 1024 if one_launch else 0
    T = logits.shape[0]
    plan = routing.DispatchPlan(T, E, k, 16 if T <= 64 else 64, logits.device)
    return routing.route_pairs(logits, plan, ("ol", T, E, k, one_launch), sigmoid=False, renormalize=True,
                               with_layout=True)


def graph_us(fn, reps=20):
    fn(); torch.cuda.synchronize()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fn()
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for _ in range(reps):
            fn()
    g.replay(); torch.cuda.synchronize()
    best = float("inf")
    for _ in range(5):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); g.replay(); b.record(); torch.cuda.synchronize()
        best = min(best, a.elapsed_time(b) * 1000 / reps)
    return round(best, 2)


for (name, E, k) in (("qwen3", 128, 8), ("deepseek", 64, 6), ("mixtral", 8, 2)):
    for T in (8, 16, 32, 64, 128):
        logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
        a = run(logits, E, k, True)
        b = run(logits, E, k, False)
        same = torch.equal(a[1], b[1]) and all(torch.equal(x, y) for x, y in zip(a[2][:3], b[2][:3]))
        print(json.dumps(dict(shape=name, T=T, one_launch_us=graph_us(lambda: run(logits, E, k, True)),
                              three_launches_us=graph_us(lambda: run(logits, E, k, False)), same_layout=same,
                              weights_maxdiff=float((a[0] - b[0]).abs().max()))), flush=True)
