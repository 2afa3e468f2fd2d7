"""The Gluon down GEMM against the Triton one inside fused_moe (forward and forward+backward),
alternating twice in one process: the down kernel's time (torch.profiler) and every output and
gradient compared bit for bit. OUT: where down_ab.json goes. One H100/H200 call."""
import dataclasses, json, os
import torch
from flashmoe_science import fused_moe
from flashmoe_science.moe import configs, experts

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408),
          "olmoe-1b-7b": (64, 8, 2048, 1024), "mixtral-8x7b": (8, 2, 4096, 14336), "h-1440": (8, 2, 1440, 640)}
TOKENS = [int(t) for t in os.environ.get("TOKENS", "4096 16384").split()]
TABLE = configs.EXPERTS[90][2]
PREFILL = dict(TABLE)[None]
STAGES = PREFILL.gluon_down_stages


def use_gluon(on: bool):
    """The prefill entry with its Gluon down (the table's stages) or without (the Triton kernel)."""
    configs.EXPERTS[90][2] = TABLE[:-1] + ((None, dataclasses.replace(PREFILL, gluon_down_stages=STAGES * on)),)
    experts._EXPERTS_PLANS.clear()
    experts._MOE_PLANS.clear()


def kernel_ms(fn, name, n=10):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return sum(e.device_time_total for e in prof.key_averages() if e.key.startswith(name)) / n / 1000


rows = []
torch.manual_seed(0)
for name, (E, k, H, I) in SHAPES.items():
    for T in TOKENS:
        x = (torch.randn(T, H, device="cuda") * 0.5).bfloat16().requires_grad_()
        w1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).bfloat16().requires_grad_()
        w2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).bfloat16().requires_grad_()
        logits = torch.randn(T, E, device="cuda").requires_grad_()
        dy = torch.randn(T, H, device="cuda").bfloat16()

        def train():
            for t in (x, w1, w2, logits):
                t.grad = None
            out = fused_moe(x, w1, w2, logits, k)
            out.backward(dy)
            return [out, x.grad, w1.grad, w2.grad, logits.grad]

        def infer():
            with torch.no_grad():
                return fused_moe(x, w1, w2, logits, k)
        res = {}
        for g in (False, True, False, True):
            use_gluon(g)
            outs = [t.detach().clone() for t in train()] + [infer().clone()]
            kname = "down_gluon_kernel" if g else "down_kernel"
            res.setdefault(g, []).append((outs, kernel_ms(infer, kname), kernel_ms(train, kname)))
        ref = res[False][0][0]
        same = [all(torch.equal(a, b) for a, b in zip(ref, r[0])) for r in res[True]]
        row = dict(shape=name, T=T, triton_fwd_ms=[round(r[1], 4) for r in res[False]],
                   gluon_fwd_ms=[round(r[1], 4) for r in res[True]],
                   triton_train_ms=[round(r[2], 4) for r in res[False]],
                   gluon_train_ms=[round(r[2], 4) for r in res[True]], bit_identical=same,
                   max_abs_diff=max(float((a.float() - b.float()).abs().max()) for a, b in zip(ref, res[True][0][0])),
                   tflops_gluon=round(2 * T * k * H * I / min(r[1] for r in res[True]) / 1e9, 1), stages=STAGES)
        print(json.dumps(row), flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
json.dump(rows, open(os.path.join(os.environ.get("OUT", "/tmp"), "down_ab.json"), "w"), indent=1)
