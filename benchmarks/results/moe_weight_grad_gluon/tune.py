"""Weight-gradient kernels alone (torch.profiler inside fused_moe fwd+bwd) per Gluon config."""
import json, os
import torch
from ab import SHAPES, run, use, kernel_ms, CASES

CONFIGS = [tuple(map(int, c.split(","))) for c in os.environ.get("CONFIGS", "0,8 3,8 4,8 4,4 4,16 3,16").split()]
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
    ref = None
    for rep in range(2):
        for stages, group_m in CONFIGS:
            use(stages, group_m)
            f = lambda: run(x, w1, w2, logits, k, dy)
            grads = [g.detach().clone() for g in f()]
            if ref is None:
                ref = grads
            same = all(torch.equal(a, b) for a, b in zip(ref, grads))
            kern = kernel_ms(f)
            w = {n: v for n, v in kern.items() if "grad_w" in n or "gather_rows" in n}
            row = dict(shape=name, T=T, stages=stages, group_m=group_m, rep=rep, same=same, kernels=w,
                       weight_grads_ms=round(sum(w.values()), 4))
            print(json.dumps(row), flush=True)
            rows.append(row)
    del x, w1, w2, logits, dy, ref, grads
    torch.cuda.empty_cache()
json.dump(rows, open(f"{os.environ.get('OUT', '/tmp')}/wg_tune.json", "w"), indent=1)
