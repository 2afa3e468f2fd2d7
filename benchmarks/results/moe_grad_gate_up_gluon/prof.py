"""Per-kernel GPU time of fused_moe fwd+bwd with the Triton and the Gluon grad_gate_up, alternating."""
import json, os
import torch, triton
from ab import SHAPES, run, use

CASES = [("qwen3-30b-a3b", 4096), ("deepseek-v2-lite", 16384)]


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


rows = []
torch.manual_seed(0)
for name, T in CASES:
    E, k, H, I = SHAPES[name]
    x = (torch.randn(T, H, device="cuda") * 0.5).bfloat16().requires_grad_()
    w1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).bfloat16().requires_grad_()
    logits = torch.randn(T, E, device="cuda").requires_grad_()
    dy = torch.randn(T, H, device="cuda").bfloat16()
    res = {}
    for rep in range(2):
        for gluon in (False, True):
            use(gluon, 5, 8)
            f = lambda: run(x, w1, w2, logits, k, dy)
            kern = profile(f)
            ms = triton.testing.do_bench(f, warmup=25, rep=200)
            g = torch.cuda.CUDAGraph()
            f()
            torch.cuda.synchronize()
            res.setdefault(gluon, []).append(dict(wall_ms=ms, kernels=kern, kernel_sum=round(sum(kern.values()), 4)))
    for gluon in (False, True):
        r = res[gluon]
        print(name, T, "gluon" if gluon else "triton", [round(v["wall_ms"], 4) for v in r], [v["kernel_sum"] for v in r])
    a, b = res[False][-1]["kernels"], res[True][-1]["kernels"]
    for kname in sorted(set(a) | set(b), key=lambda n: -max(a.get(n, 0), b.get(n, 0)))[:16]:
        print("   ", kname, a.get(kname), b.get(kname))
    rows.append(dict(shape=name, T=T, runs={str(g): v for g, v in res.items()}))
json.dump(rows, open(f"{os.environ.get('OUT', '/tmp')}/ggu_prof.json", "w"), indent=1)
