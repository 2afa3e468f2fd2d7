"""cProfile of ours fwd+bwd at T = 1024 (OLMoE shape): where the host time goes."""
import cProfile, pstats, torch
from flashmoe_science.moe import fused_moe
from flashmoe_science.bench.moe import make_layer
g = torch.Generator(device="cuda").manual_seed(0)
E, k, H, I, T = 64, 8, 2048, 1024, 1024
w1, w2 = (w.requires_grad_() for w in make_layer(E, H, I, torch.bfloat16, torch.device("cuda"), g))
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16).requires_grad_()
logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16).requires_grad_()
go = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
f = lambda: torch.autograd.grad(fused_moe(x, w1, w2, logits, k), (x, w1, w2, logits), go)
for _ in range(5): f()
torch.cuda.synchronize()
pr = cProfile.Profile(); pr.enable()
for _ in range(50): f()
pr.disable(); torch.cuda.synchronize()
st = pstats.Stats(pr); st.sort_stats("tottime").print_stats(45)
st.sort_stats("cumtime").print_stats(40)
