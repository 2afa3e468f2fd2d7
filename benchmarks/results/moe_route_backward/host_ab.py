"""Host issue time and wall time per fwd+bwd call (ours) at T = 1024 and 256, fine-grained shapes."""
import sys, time, torch
import flashmoe_science
from flashmoe_science.moe import fused_moe
from flashmoe_science.bench.moe import make_layer
g = torch.Generator(device="cuda").manual_seed(0)
tag = sys.argv[1]
for name, (E, k, H, I) in {"olmoe": (64, 8, 2048, 1024), "qwen3": (128, 8, 2048, 768)}.items():
    w1, w2 = (w.requires_grad_() for w in make_layer(E, H, I, torch.bfloat16, torch.device("cuda"), g))
    for T in (256, 1024):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
        logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16).requires_grad_()
        go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
        f = lambda: torch.autograd.grad(fused_moe(x, w1, w2, logits, k), (x, w1, w2, logits), go)
        for _ in range(10): f()
        torch.cuda.synchronize()
        best_issue, best_wall = 1e9, 1e9
        for rep in range(5):
            t0 = time.perf_counter()
            for _ in range(40): f()
            t1 = time.perf_counter(); torch.cuda.synchronize(); t2 = time.perf_counter()
            best_issue, best_wall = min(best_issue, (t1 - t0) / 40), min(best_wall, (t2 - t0) / 40)
        print(f"{tag} {name} T={T}: host issue {1e3*best_issue:.3f} ms/call, wall {1e3*best_wall:.3f} ms/call (best of 5 x 40)", flush=True)
