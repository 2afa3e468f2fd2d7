"""Host time per packed attention training call (issue until return, no sync), and a check that
gradients stay right when new inputs land at the same addresses (cached descriptors)."""
import statistics, sys, time
import torch
import torch.nn.functional as F
from flashmoe_science.attention import flash_attention_qkvpacked

label = sys.argv[1]
for B, H, S, D in ((8, 16, 1024, 64), (4, 16, 2048, 128)):
    qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    g = torch.randn(B, S, H, D, device="cuda", dtype=torch.bfloat16)

    def step():
        flash_attention_qkvpacked(qkv, causal=True).backward(g)
    for _ in range(30):
        step()
    torch.cuda.synchronize()
    rounds = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(100):
            step()
        rounds.append((time.perf_counter() - t) / 100 * 1e6)
        torch.cuda.synchronize()
    # new values at the same addresses, then a new tensor: gradients against SDPA's
    errs = []
    for fresh in (False, True):
        with torch.no_grad():
            if fresh:
                qkv = torch.randn(B, S, 3, H, D, device="cuda", dtype=torch.bfloat16, requires_grad=True)
            else:
                qkv.copy_(torch.randn_like(qkv))
        qkv.grad = None
        step()
        ref = qkv.detach().clone().requires_grad_()
        q, k, v = (ref[:, :, i].transpose(1, 2) for i in range(3))
        F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).backward(g)
        errs.append(((qkv.grad.float() - ref.grad.float()).norm() / ref.grad.float().norm()).item())
    print(f"{label} B={B} H={H} S={S} D={D}: host {statistics.median(rounds):.0f} us/call "
          f"(rounds {' '.join(f'{r:.0f}' for r in rounds)}); grad rel err vs SDPA same-address {errs[0]:.2e} "
          f"new-tensor {errs[1]:.2e}", flush=True)
