"""Host time of fused_moe forward+backward (eager) and where it goes (cProfile)."""
import cProfile, pstats, io, time, os
import torch
from flashmoe_science import fused_moe

torch.manual_seed(0)
for T, E, k, H, I in ((4096, 128, 8, 2048, 768), (256, 128, 8, 2048, 768)):
    x = (torch.randn(T, H, device="cuda") * 0.5).bfloat16().requires_grad_()
    w1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).bfloat16().requires_grad_()
    logits = torch.randn(T, E, device="cuda").requires_grad_()
    dy = torch.randn(T, H, device="cuda").bfloat16()

    def step():
        for t in (x, w1, w2, logits):
            t.grad = None
        fused_moe(x, w1, w2, logits, k).backward(dy)

    def fwd():
        with torch.no_grad():
            fused_moe(x, w1, w2, logits, k)
    for f, label in ((step, "fwd+bwd"), (fwd, "fwd")):
        for _ in range(5):
            f()
        torch.cuda.synchronize()
        n = 50
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        t1 = time.perf_counter()
        torch.cuda.synchronize()
        t2 = time.perf_counter()
        print(f"T={T} {label}: host {1e3*(t1-t0)/n:.3f} ms/step, loop {1e3*(t2-t0)/n:.3f} ms/step")
        # host only: GPU work is queued; keep the queue from filling by syncing every 10
        pr = cProfile.Profile()
        pr.enable()
        for i in range(n):
            f()
            if i % 10 == 9:
                torch.cuda.synchronize()
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
        print("\n".join(l for l in s.getvalue().splitlines() if l.strip())[:6000])
