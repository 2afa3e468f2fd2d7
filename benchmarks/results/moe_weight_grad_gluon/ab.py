"""Gluon weight gradients (d w1, d w2) against the Triton kernels inside fused_moe's forward+backward:
gradients compared, fwd+bwd time and each weight-gradient kernel's time (torch.profiler)."""
import json, os, sys
from dataclasses import replace
import torch
import triton
from flashmoe_science import fused_moe
from flashmoe_science.moe import backward, configs

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408),
          "olmoe-1b-7b": (64, 8, 2048, 1024), "mixtral-8x7b": (8, 2, 4096, 14336)}
CASES = [c.split(":") for c in os.environ.get("CASES", "qwen3-30b-a3b:4096 qwen3-30b-a3b:16384 deepseek-v2-lite:16384 olmoe-1b-7b:16384 mixtral-8x7b:8192").split()]
STAGES = int(os.environ.get("STAGES", "3"))
GROUP_M = int(os.environ.get("GROUP_M", "8"))
base = dict(configs.BACKWARD[90][2])
base_gx = dict(configs.BACKWARD_GATHER_X[90][2])


def use(stages, group_m=GROUP_M):
    for table, orig in ((configs.BACKWARD[90][2], base), (configs.BACKWARD_GATHER_X[90][2], base_gx)):
        cfg = orig[128]
        cfg = replace(cfg, gluon_weight_grad_stages=stages, grad_w1=replace(cfg.grad_w1, group_m=group_m),
                      grad_w2=replace(cfg.grad_w2, group_m=group_m)) if stages else replace(cfg, gluon_weight_grad_stages=0)
        table[128] = cfg
    backward._PLANS.clear()


def run(x, w1, w2, logits, k, dy):
    for t in (x, w1, w2, logits):
        t.grad = None
    out = fused_moe(x, w1, w2, logits, k)
    out.backward(dy)
    return out, x.grad, w1.grad, w2.grad, logits.grad


def kernel_ms(fn, n=5):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    tot = {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        name = e.name
        if "weight_grad_gluon" in name:  # d w2 runs first in each step, then d w1
            seen = tot.setdefault("_wg", 0)
            tot["_wg"] += 1
            name = "grad_w2_gluon" if seen % 2 == 0 else "grad_w1_gluon"
        for short in ("grad_w1", "grad_w2", "gather_rows", "grad_gate_up", "grad_x", "gate_up_kernel", "down_kernel"):
            if short in name:
                tot[name[:40]] = tot.get(name[:40], 0) + e.device_time / 1000 / n
                break
    tot.pop("_wg", None)
    return {k: round(v, 4) for k, v in tot.items()}


def main():
    rows = []
    torch.manual_seed(0)
    for name, T in CASES:
        T = int(T)
        E, k, H, I = SHAPES[name]
        dev = "cuda"
        x = (torch.randn(T, H, device=dev) * 0.5).bfloat16().requires_grad_()
        w1 = (torch.randn(E, 2 * I, H, device=dev) / H ** 0.5).bfloat16().requires_grad_()
        w2 = (torch.randn(E, H, I, device=dev) / I ** 0.5).bfloat16().requires_grad_()
        logits = torch.randn(T, E, device=dev).requires_grad_()
        dy = torch.randn(T, H, device=dev).bfloat16()
        res = {}
        for stages in (0, STAGES, 0, STAGES):
            use(stages)
            grads = [g.detach().clone() for g in run(x, w1, w2, logits, k, dy)]
            ms = triton.testing.do_bench(lambda: run(x, w1, w2, logits, k, dy), warmup=25, rep=200)
            kern = kernel_ms(lambda: run(x, w1, w2, logits, k, dy))
            res.setdefault(stages, []).append((grads, ms, kern))
        g0, g1 = res[0][0][0], res[STAGES][0][0]
        same = {n: bool(torch.equal(a, b)) for n, a, b in zip(("out", "dx", "dw1", "dw2", "dlogits"), g0, g1)}
        diffs = {n: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30)) for n, a, b in
                 zip(("out", "dx", "dw1", "dw2", "dlogits"), g0, g1)}
        row = dict(shape=name, T=T, stages=STAGES, group_m=GROUP_M,
                   triton_ms=[round(r[1], 4) for r in res[0]], gluon_ms=[round(r[1], 4) for r in res[STAGES]],
                   triton_kernels=res[0][-1][2], gluon_kernels=res[STAGES][-1][2], bit_identical=same,
                   max_rel_diff=diffs, peak_gb=round(torch.cuda.max_memory_allocated() / 1e9, 2))
        print(json.dumps(row), flush=True)
        rows.append(row)
        del x, w1, w2, logits, dy, res, g0, g1, grads
        torch.cuda.empty_cache()
    out = os.environ.get("OUT", "/tmp")
    json.dump(rows, open(f"{out}/wg_ab_s{STAGES}_g{GROUP_M}.json", "w"), indent=1)


if __name__ == "__main__":
    main()
