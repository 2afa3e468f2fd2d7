"""Host time of ours fwd+bwd at T = 1024 (OLMoE): wall per call, events per call, top CPU ops."""
import time, torch
from flashmoe_science.moe import fused_moe
from flashmoe_science.bench.moe import make_layer
g = torch.Generator(device="cuda").manual_seed(0)
E, k, H, I = 64, 8, 2048, 1024
for T in (1024, 4096):
    w1, w2 = (w.requires_grad_() for w in make_layer(E, H, I, torch.bfloat16, torch.device("cuda"), g))
    x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
    logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16).requires_grad_()
    go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
    f = lambda: torch.autograd.grad(fused_moe(x, w1, w2, logits, k), (x, w1, w2, logits), go)
    for _ in range(5): f()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(20): f()
    t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
    print(f"T={T}: host issue {1e3*(t1-t0)/20:.3f} ms/call, wall {1e3*(t2-t0)/20:.3f} ms/call", flush=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]) as p:
        for _ in range(10): f()
        torch.cuda.synchronize()
    print(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18, max_name_column_width=60))
