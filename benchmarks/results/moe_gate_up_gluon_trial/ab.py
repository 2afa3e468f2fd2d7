"""Gluon gate/up against the Triton kernel inside fused_moe: inference forward and training
forward+backward, outputs and gradients compared bit for bit, each kernel's GPU time
(torch.profiler) and the CUDA-graph replay time of both steps. One H100/H200 call."""
import json, os
from dataclasses import replace
import torch
import triton
from flashmoe_science import fused_moe
from flashmoe_science.bench.timing import graph_replay
from flashmoe_science.moe import backward, configs, experts

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408),
          "olmoe-1b-7b": (64, 8, 2048, 1024), "mixtral-8x7b": (8, 2, 4096, 14336)}
CASES = [c.split(":") for c in os.environ.get("CASES", "qwen3-30b-a3b:4096 qwen3-30b-a3b:16384 deepseek-v2-lite:16384 olmoe-1b-7b:16384 mixtral-8x7b:8192").split()]
STAGES = int(os.environ.get("STAGES", "3"))
GROUP_M = int(os.environ.get("GROUP_M", "8"))
BASE = configs.EXPERTS[90][2]


def use(stages, group_m=GROUP_M):
    bound, cfg = BASE[-1]
    cfg = replace(cfg, gluon_stages=stages, gate_up=replace(cfg.gate_up, group_m=group_m) if stages else cfg.gate_up)
    configs.EXPERTS[90][2] = BASE[:-1] + ((bound, cfg),)
    experts._EXPERTS_PLANS.clear(); experts._MOE_PLANS.clear(); backward._PLANS.clear()


def train(x, w1, w2, logits, k, dy):
    for t in (x, w1, w2, logits):
        t.grad = None
    out = fused_moe(x, w1, w2, logits, k)
    out.backward(dy)
    return out, x.grad, w1.grad, w2.grad, logits.grad


def infer(x, w1, w2, logits, k):
    with torch.no_grad():
        return fused_moe(x, w1, w2, logits, k)


def kernels(fn, n=5):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", 0) / n / 1000
        if t > 0.01:
            out[e.key[:40]] = round(t, 4)
    return out


def main():
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
        res = {}
        for stages in (0, STAGES, 0, STAGES):
            use(stages)
            f_train = lambda: train(x, w1, w2, logits, k, dy)
            f_infer = lambda: infer(x, w1, w2, logits, k)
            outs = [g.detach().clone() for g in f_train()] + [f_infer().clone()]
            kt = kernels(f_train)
            ki = kernels(f_infer)
            gt = triton.testing.do_bench(graph_replay(f_train), warmup=10, rep=150)
            gi = triton.testing.do_bench(graph_replay(f_infer), warmup=10, rep=150)
            res.setdefault(stages, []).append(dict(outs=outs, train_kernels=kt, infer_kernels=ki,
                                                   train_graph_ms=round(gt, 4), infer_graph_ms=round(gi, 4)))
        names = ("out", "dx", "dw1", "dw2", "dlogits", "infer_out")
        same = {n: bool(torch.equal(a, b)) for n, a, b in zip(names, res[0][0]["outs"], res[STAGES][0]["outs"])}
        diffs = {n: float((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-30))
                 for n, a, b in zip(names, res[0][0]["outs"], res[STAGES][0]["outs"])}
        for r in res.values():
            for v in r:
                v.pop("outs")
        row = dict(shape=name, T=T, stages=STAGES, group_m=GROUP_M, same=same, max_rel_diff=diffs,
                   triton=res[0], gluon=res[STAGES])
        print(json.dumps(dict(shape=name, T=T, same=same, diffs=diffs,
                              triton=[(v["train_graph_ms"], v["infer_graph_ms"], v["infer_kernels"].get("gate_up_kernel")) for v in res[0]],
                              gluon=[(v["train_graph_ms"], v["infer_graph_ms"], v["infer_kernels"].get("gate_up_gluon_kernel")) for v in res[STAGES]],
                              tk=res[0][-1]["train_kernels"], gk=res[STAGES][-1]["train_kernels"])), flush=True)
        rows.append(row)
        del x, w1, w2, logits, dy, res
        torch.cuda.empty_cache()
    json.dump(rows, open(f"{os.environ.get('OUT', '/tmp')}/fwd_ab_s{STAGES}_g{GROUP_M}.json", "w"), indent=1)


if __name__ == "__main__":
    main()
