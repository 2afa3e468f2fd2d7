"""Kernel times of ours fwd+bwd (torch.profiler) at T = 1024 for fine-grained shapes."""
import sys, torch
from flashmoe_science.moe import fused_moe
from flashmoe_science.bench.moe import make_layer
shapes = {"olmoe": (64, 8, 2048, 1024), "qwen3": (128, 8, 2048, 768)}
g = torch.Generator(device="cuda").manual_seed(0)
for name, (E, k, H, I) in shapes.items():
    for T in (1024, 4096):
        w1, w2 = (w.requires_grad_() for w in make_layer(E, H, I, torch.bfloat16, torch.device("cuda"), g))
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
        logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16).requires_grad_()
        go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        f = lambda: torch.autograd.grad(fused_moe(x, w1, w2, logits, k), (x, w1, w2, logits), go)
        for _ in range(5): f()
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as p:
            for _ in range(10): f()
            torch.cuda.synchronize()
        tot = {}
        for e in p.events():
            if e.device_type == torch.autograd.DeviceType.CUDA:
                tot[e.name] = tot.get(e.name, 0) + e.device_time / 10
        print(f"== {name} T={T}: total {sum(tot.values()):.0f} us per call")
        for n, t in sorted(tot.items(), key=lambda a: -a[1])[:14]:
            print(f"  {t:8.1f} us  {n[:110]}")
