"""Forward+backward of fused_moe at training sizes where the weight gradients' K (an expert's rows)
is short, under backward configurations chosen by VARIANT (patched into `moe.configs` before any
call): the wall time per call (CUDA events around back-to-back calls, median of 5), the weight
gradients' kernel times (torch.profiler) and checksums of every gradient.
Usage: python ab.py VARIANT OUT_JSON. VARIANT: shipped; g64 (the Gluon weight-gradient kernel on
the 64-row layout's entry too); g64_w1 (and for d w1 where H < I, Mixtral-8x7B's entry)."""
import json, statistics, sys
from dataclasses import replace
import torch
from flashmoe_science import fused_moe
from flashmoe_science.bench.moe import make_layer
from flashmoe_science.moe import configs

variant, out_path = sys.argv[1], sys.argv[2]
if variant in ("g64", "g64_w1"):
    table = configs.BACKWARD[90][2]
    table[64] = replace(table[64], gluon_weight_grad_stages=3)
if variant == "g64_w1":
    entry = configs.BACKWARD_GATHER_X[90][2]
    entry[128] = replace(entry[128], gluon_weight_grads=("grad_w1", "grad_w2"))

CASES = [("mixtral-8x7b", (8, 2, 4096, 14336), T) for T in (256, 512, 1024, 2048, 4096)]
CASES += [("qwen3-30b-a3b", (128, 8, 2048, 768), T) for T in (1024, 1536)]
CASES += [("deepseek-v2-lite", (64, 6, 2048, 1408), 1024), ("olmoe-1b-7b", (64, 8, 2048, 1024), 1024)]


def wall_ms(f, n=10):
    f(); torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runs = []
    for _ in range(5):
        s.record()
        for _ in range(n):
            f()
        e.record(); e.synchronize()
        runs.append(s.elapsed_time(e) / n)
    return statistics.median(runs)


rows = []
for name, (E, k, H, I), T in CASES:
    g = torch.Generator(device="cuda").manual_seed(0)
    w1, w2 = (w.requires_grad_() for w in make_layer(E, H, I, torch.bfloat16, "cuda", g))
    x = torch.randn(T, H, device="cuda", generator=g).bfloat16().requires_grad_()
    logits = torch.randn(T, E, device="cuda", generator=g).bfloat16().requires_grad_()
    dy = torch.randn(T, H, device="cuda", generator=g).bfloat16()
    ins = (x, w1, w2, logits)
    f = lambda: torch.autograd.grad(fused_moe(*ins, k), ins, dy)
    grads = f()
    ms = wall_ms(f)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            f()
        torch.cuda.synchronize()
    kern = {e.key[:40]: round(e.device_time_total / 10 / 1000, 4) for e in prof.key_averages()
            if "grad_w" in e.key or "weight_grad" in e.key or "gather_rows" in e.key}
    row = dict(variant=variant, shape=name, T=T, ms=round(ms, 4), kernels_ms=kern,
               checksums=[float(t.double().sum()) for t in grads], first=[t.flatten()[:3].tolist() for t in grads])
    rows.append(row)
    print(json.dumps(row), flush=True)
    del w1, w2, grads
json.dump(rows, open(out_path, "w"), indent=1)
