"""The Gluon GEMMs' second consumer started STAGGER K steps behind the first (`moe/_kernels/stagger.py`),
against STAGGER = 0 (both consumers in step, as before): kernel times under torch.profiler inside
fused_moe, variants alternating in one process (two rounds), outputs compared bit for bit.
Usage: python ab.py OUT_JSON [STAGGERS...]. One H100/H200 call."""
import json, sys
import torch
from flashmoe_science import fused_moe
from flashmoe_science.moe import experts, fp8
from flashmoe_science.moe.fp8 import quantize_fp8_blockwise

SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408),
          "olmoe-1b-7b": (64, 8, 2048, 1024), "mixtral-8x7b": (8, 2, 4096, 14336)}
TOKENS = (4096, 16384)
STAGGERS = [int(s) for s in sys.argv[2:]] or [0, 1, 2, 3]
KERNELS = ("down_gluon_kernel", "gate_up_fp8_gluon_kernel", "down_fp8_gluon_kernel")
BASE = {"bf16_down": (experts, "_DOWN_GLUON"), "fp8_gate_up": (fp8, "_GATE_UP_GLUON"), "fp8_down": (fp8, "_DOWN_GLUON")}
ORIGINAL = {name: getattr(mod, attr) for name, (mod, attr) in BASE.items()}


class Staggered:
    """A launcher passing `stagger` as the kernel's last argument (STAGGER), under a key of its own."""

    def __init__(self, base, stagger):
        self.base, self.stagger = base, stagger

    def launch(self, key, grid, args, **options):
        return self.base.launch((key, "stagger", self.stagger), grid, (*args[:-1], self.stagger), **options)


def use(stagger):
    for name, (mod, attr) in BASE.items():
        setattr(mod, attr, Staggered(ORIGINAL[name], stagger))


def kernel_ms(fn, n=10):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    out = {}
    for e in prof.key_averages():
        for k in KERNELS:
            if e.key.startswith(k):
                out[k] = out.get(k, 0.0) + e.device_time_total / n / 1000
    return out


rows = []
for name, (E, k, H, I) in SHAPES.items():
    g = torch.Generator(device="cuda").manual_seed(1)
    w1 = torch.randn(E, 2 * I, H, device="cuda", generator=g) * H ** -0.5
    w2 = torch.randn(E, H, I, device="cuda", generator=g) * I ** -0.5
    q1, s1 = quantize_fp8_blockwise(w1); q2, s2 = quantize_fp8_blockwise(w2)
    variants = {"bf16": (w1.bfloat16(), w2.bfloat16(), {}),
                "fp8_block": (q1, q2, dict(w1_scale=s1, w2_scale=s2, block_shape=(128, 128)))}
    del w1, w2
    for T in TOKENS:
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16, generator=g)
        logits = torch.randn(T, E, device="cuda", generator=g)
        for vname, (a, b, kw) in variants.items():
            f = lambda: fused_moe(x, a, b, logits, k, **kw)
            times, outs = {}, {}
            with torch.no_grad():
                for _ in range(2):
                    for s in STAGGERS:
                        use(s)
                        outs.setdefault(s, f().clone())
                        for kern, ms in kernel_ms(f).items():
                            times.setdefault(s, {}).setdefault(kern, []).append(round(ms, 4))
            same = all(torch.equal(outs[STAGGERS[0]], o) for o in outs.values())
            row = dict(shape=name, T=T, weights=vname, bit_identical=same, ms=times,
                       best_over_0={s: {kern: round(min(v) / min(times[STAGGERS[0]][kern]), 3) for kern, v in t.items()}
                                    for s, t in times.items()})
            rows.append(row)
            print(json.dumps(row), flush=True)
json.dump(rows, open(sys.argv[1], "w"), indent=1)
