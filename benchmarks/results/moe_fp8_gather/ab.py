"""The FP8 layer at prefill sizes (Hopper's Gluon path), timed from whichever package is on
PYTHONPATH: ms per call (CUDA events around 20 back-to-back calls, median of 5), peak memory
beyond the inputs, the kernels' GPU times (torch.profiler) and a checksum of the output.
Usage: python ab.py LABEL OUT_JSON [--down-stagger N] (N: the FP8 down GEMM's consumers
staggered by N K steps, `moe/_kernels/stagger.py`, through a launcher that swaps the last argument)."""
import json, statistics, sys
import torch
from flashmoe_science import fused_moe
from flashmoe_science.moe import fp8
from flashmoe_science.moe.fp8 import quantize_fp8_blockwise, quantize_fp8_per_channel

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408),
          "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = (4096, 16384)
label, out_path = sys.argv[1], sys.argv[2]
stagger = int(sys.argv[sys.argv.index("--down-stagger") + 1]) if "--down-stagger" in sys.argv else 0
if stagger:
    base = fp8._DOWN_GLUON

    class Staggered:
        def launch(self, key, grid, args, **options):
            return base.launch((key, "stagger", stagger), grid, (*args[:-1], stagger), **options)

    fp8._DOWN_GLUON = Staggered()


def ms_per_call(f):
    f(); torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    runs = []
    for _ in range(5):
        start.record()
        for _ in range(20):
            f()
        end.record(); end.synchronize()
        runs.append(start.elapsed_time(end) / 20)
    return statistics.median(runs)


def kernels(f):
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            f()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / 10 / 1000, 4) for e in prof.key_averages() if e.device_time_total > 0}


rows = []
for name, (E, k, H, I) in SHAPES.items():
    g = torch.Generator(device="cuda").manual_seed(1)
    w1 = torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5
    (q1, s1), (q2, s2) = quantize_fp8_blockwise(w1), quantize_fp8_blockwise(w2)
    variants = {"block": (q1, q2, dict(w1_scale=s1, w2_scale=s2, block_shape=(128, 128)))}
    if name == "qwen3-30b-a3b":
        (c1, cs1), (c2, cs2) = quantize_fp8_per_channel(w1), quantize_fp8_per_channel(w2)
        variants["channel"] = (c1, c2, dict(w1_scale=cs1, w2_scale=cs2))
    del w1, w2
    for T in TOKENS:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(T, E, device="cuda", generator=g)
        for scales, (a, b, kw) in variants.items():
            with torch.no_grad():
                f = lambda: fused_moe(x, a, b, logits, k, **kw)
                out = f()
                torch.cuda.synchronize(); torch.cuda.reset_peak_memory_stats()
                base_mem = torch.cuda.memory_allocated()
                f(); torch.cuda.synchronize()
                peak = (torch.cuda.max_memory_allocated() - base_mem) / 2**20
                ms = ms_per_call(f)
                row = dict(label=label, shape=name, T=T, scales=scales, ms=round(ms, 4),
                           tflops=round(6 * T * k * H * I / ms / 1e9, 1), peak_mib=round(peak, 1),
                           checksum=float(out.double().sum()), first=out.flatten()[:4].tolist(),
                           kernels_ms=kernels(f))
            rows.append(row)
            print(json.dumps(row), flush=True)
json.dump(rows, open(out_path, "w"), indent=1)
