"""Every kernel's GPU time in fused_moe fwd+bwd with Triton and Gluon weight gradients, plus eager
wall (do_bench), CUDA-graph replay time and host time per step."""
import json, os, time
import torch, triton
from ab import SHAPES, run, use
from flashmoe_science.bench.timing import graph_replay

CASES = [c.split(":") for c in os.environ.get("CASES", "qwen3-30b-a3b:4096 deepseek-v2-lite:16384").split()]


def profile(fn, n=10):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) / n / 1000
        if t > 0:
            out[e.key[:60]] = round(t, 4)
    return out


def host_ms(fn, n=20):
    fn(); torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    return round((t1 - t0) / n * 1e3, 4), round((t2 - t0) / n * 1e3, 4)


rows = []
torch.manual_seed(0)
for name, T in CASES:
    T = int(T)
    E, k, H, I = SHAPES[name]
    x = (torch.randn(T, H, device="cuda") * 0.5).bfloat16().requires_grad_()
    w1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).bfloat16().requires_grad_()
    logits = torch.randn(T, E, device="cuda").requires_grad_()
    dy = torch.randn(T, H, device="cuda").bfloat16()
    res = {}
    for rep in range(2):
        for stages in (0, 3):
            use(stages)
            f = lambda: run(x, w1, w2, logits, k, dy)
            kern = profile(f)
            ms = triton.testing.do_bench(f, warmup=25, rep=200)
            replay = graph_replay(f)
            graph_ms = triton.testing.do_bench(replay, warmup=10, rep=200)
            host, wall = host_ms(f)
            res.setdefault(stages, []).append(dict(wall_ms=round(ms, 4), graph_ms=round(graph_ms, 4), host_ms=host,
                                                   loop_ms=wall, kernels=kern, kernel_sum=round(sum(kern.values()), 4)))
    for stages in (0, 3):
        r = res[stages]
        print(name, T, stages, [(v["wall_ms"], v["graph_ms"], v["host_ms"], v["loop_ms"], v["kernel_sum"]) for v in r])
    a, b = res[0][-1]["kernels"], res[3][-1]["kernels"]
    for kname in sorted(set(a) | set(b), key=lambda n: -max(a.get(n, 0), b.get(n, 0)))[:22]:
        print("   ", kname, a.get(kname), b.get(kname))
    rows.append(dict(shape=name, T=T, runs={str(g): v for g, v in res.items()}))
json.dump(rows, open(f"{os.environ.get('OUT', '/tmp')}/wg_prof.json", "w"), indent=1)
