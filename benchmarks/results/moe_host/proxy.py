"""Host-side proxy on the CPU: fused_moe forward+backward with every kernel launch stubbed out
(TRITON_INTERPRET=1, tiny shapes), so the time is Python, torch dispatch and autograd."""
import os, sys, time, cProfile, pstats, io
os.environ.setdefault("TRITON_INTERPRET", "1")
import torch
from flashmoe_science import launch
from flashmoe_science.moe import fused_moe

from flashmoe_science.moe import routing
launch.KernelLauncher.launch = lambda self, *a, **k: None
routing.allocate = lambda shape, dtype, device: torch.zeros(shape, dtype=dtype, device=device)  # valid ids
torch.manual_seed(0)
torch.set_num_threads(1)
T, E, k, H, I = 8, 4, 2, 64, 32
x = torch.randn(T, H).requires_grad_()
w1 = (torch.randn(E, 2 * I, H) / 8).requires_grad_()
w2 = (torch.randn(E, H, I) / 8).requires_grad_()
logits = torch.randn(T, E).requires_grad_()
dy = torch.randn(T, H)


def step():
    for t in (x, w1, w2, logits):
        t.grad = None
    fused_moe(x, w1, w2, logits, k).backward(dy)


def fwd():
    with torch.no_grad():
        fused_moe(x, w1, w2, logits, k)


for f, name in ((step, "fwd+bwd"), (fwd, "fwd")):
    for _ in range(20):
        f()
    best = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(200):
            f()
        best.append((time.perf_counter() - t0) / 200 * 1e6)
    print(f"{name}: {min(best):.0f} us/step (min of 5 x 200)")
if len(sys.argv) > 1:
    pr = cProfile.Profile(); pr.enable()
    for _ in range(200):
        step()
    pr.disable()
    s = io.StringIO(); pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(30); print(s.getvalue()[:5000])
