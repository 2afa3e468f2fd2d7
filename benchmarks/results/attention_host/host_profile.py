"""Host time of packed attention training calls, by function (cProfile), on the GPU host."""
import cProfile, pstats, time, io
import torch
from flashmoe_science.attention import flash_attention_qkvpacked

def run(B, H, S, D, n=200):
    qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)
    def step():
        out = flash_attention_qkvpacked(qkv, causal=True)
        out.backward(g)
    for _ in range(20): step()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n): step()
    host = (time.perf_counter() - t) / n * 1e6
    torch.cuda.synchronize()
    pr = cProfile.Profile()
    pr.enable()
    for _ in range(n): step()
    pr.disable()
    torch.cuda.synchronize()
    s = io.StringIO()
    pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(25)
    print(f"== B={B} H={H} S={S} D={D}: host {host:.0f} us/call (issue, no sync)")
    print("\n".join(s.getvalue().splitlines()[:45]))
    # SDPA for scale
    q = torch.randn(B, H, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn_like(q, requires_grad=True); v = torch.randn_like(q, requires_grad=True)
    def sdpa():
        o = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        o.backward(torch.ones_like(o))
    for _ in range(20): sdpa()
    torch.cuda.synchronize(); t = time.perf_counter()
    for _ in range(n): sdpa()
    print(f"   SDPA host {(time.perf_counter() - t) / n * 1e6:.0f} us/call"); torch.cuda.synchronize()

for shape in ((1, 8, 256, 64), (8, 16, 1024, 64)):
    run(*shape)
