"""Down GEMMs with the epilogue's routing loads issued before the products (package) against the
same kernels with them after (fp8_gluon_old / forward_gluon_old): kernel time (torch.profiler,
alternating twice) and outputs compared bit for bit. One H100/H200 call."""
import json, os, sys
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from flashmoe_science import fused_moe
from flashmoe_science.launch import KernelLauncher
from flashmoe_science.moe import experts, fp8
from flashmoe_science.moe.fp8 import quantize_fp8_blockwise, quantize_fp8_per_channel
import fp8_gluon_old, forward_gluon_old

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408),
          "olmoe-1b-7b": (64, 8, 2048, 1024), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = [int(t) for t in os.environ.get("TOKENS", "4096 16384").split()]
NEW = {"fp8": fp8._DOWN_GLUON, "bf16": experts._DOWN_GLUON}
OLD = {"fp8": KernelLauncher("moe_fp8_down_gluon_old", fp8_gluon_old.down_fp8_gluon_kernel),
       "bf16": KernelLauncher("moe_down_gluon_old", forward_gluon_old.down_gluon_kernel)}


def use(new):
    fp8._DOWN_GLUON = (NEW if new else OLD)["fp8"]
    experts._DOWN_GLUON = (NEW if new else OLD)["bf16"]


def kernel_ms(fn, n=10):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    ev = [e for e in prof.key_averages() if "down" in e.key and "gluon" in e.key]
    return sum(e.device_time_total for e in ev) / n / 1000, [e.key for e in ev]


torch.manual_seed(0)
for name, (E, k, H, I) in SHAPES.items():
    g = torch.Generator(device="cuda").manual_seed(1)
    w1 = torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5
    variants = {"bf16": (w1.bfloat16(), w2.bfloat16(), {}),
                "fp8_block": (*[quantize_fp8_blockwise(w)[0] for w in (w1, w2)], None)}
    q1, s1 = quantize_fp8_blockwise(w1); q2, s2 = quantize_fp8_blockwise(w2)
    variants["fp8_block"] = (q1, q2, dict(w1_scale=s1, w2_scale=s2, block_shape=(128, 128)))
    if name == "qwen3-30b-a3b":
        c1, cs1 = quantize_fp8_per_channel(w1); c2, cs2 = quantize_fp8_per_channel(w2)
        variants["fp8_channel"] = (c1, c2, dict(w1_scale=cs1, w2_scale=cs2))
    for T in TOKENS:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(T, E, device="cuda", generator=g)
        for vname, (a, b, kw) in variants.items():
            f = lambda: fused_moe(x, a, b, logits, k, **kw)
            res = {}
            with torch.no_grad():
                for new in (False, True, False, True):
                    use(new)
                    out = f().clone()
                    ms, keys = kernel_ms(f)
                    res.setdefault(new, []).append((out, ms, keys))
            same = all(torch.equal(res[False][0][0], r[0]) for r in res[True] + res[False])
            flops = 2 * T * k * H * I
            row = dict(shape=name, T=T, weights=vname, old_ms=[round(r[1], 4) for r in res[False]],
                       new_ms=[round(r[1], 4) for r in res[True]], bit_identical=same,
                       new_over_old=round(min(r[1] for r in res[True]) / min(r[1] for r in res[False]), 3),
                       tflops_new=round(flops / min(r[1] for r in res[True]) / 1e9, 1),
                       kernels=sorted(set(res[True][0][2] + res[False][0][2])))
            print(json.dumps(row), flush=True)

# Where the FP8 layer's time goes (new kernels), Qwen3-30B-A3B at 16k tokens.
E, k, H, I = SHAPES["qwen3-30b-a3b"]
use(True)
g = torch.Generator(device="cuda").manual_seed(1)
q1, s1 = quantize_fp8_blockwise(torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5)
q2, s2 = quantize_fp8_blockwise(torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5)
x = torch.randn(16384, H, device="cuda", dtype=torch.bfloat16, generator=g)
logits = torch.randn(16384, E, device="cuda", generator=g)
with torch.no_grad():
    f = lambda: fused_moe(x, q1, q2, logits, k, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    f(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            f()
        torch.cuda.synchronize()
print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60))
