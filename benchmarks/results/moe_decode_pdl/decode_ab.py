"""A/B of MoE decode in CUDA graphs: `fused_moe` bf16 and block-FP8 at decode sizes, a graph of
CALLS calls cycling over LAYERS distinct layers' weights (no L2 reuse between calls), per-call us.
usage: [VARIANT=...] decode_ab.py LABEL OUT_JSON
VARIANT (the trials): the decode entries with pdl off (nopdl), pdl=2 (latetrigger: a PDL constexpr
of 2 waited without releasing in the trial's kernels, 1 released at each program's start), or the
FP8 tokens' fused quantisation off (noquant); "+norelease" also keeps the routing from releasing."""
import json, sys, time
import torch
from flashmoe_science.moe import fused_moe
from flashmoe_science.moe.fp8 import quantize_fp8_blockwise
from flashmoe_science.bench.moe import SHAPES
from flashmoe_science.bench.timing import time_gpu

label, out_path = sys.argv[1], sys.argv[2]
import os
from dataclasses import replace
variant = os.environ.get("VARIANT", "")
if variant:
    from flashmoe_science.moe import configs, routing
    fields = dict(nopdl=dict(pdl=False), noquant=dict(quantize_tokens=False), latetrigger=dict(pdl=2))[variant.split("+")[0]]
    def patch(table, **kw):
        return tuple((b, replace(c, **{f: v for f, v in kw.items() if hasattr(c, f)}) if c.block_m == 16 else c) for b, c in table)
    configs.EXPERTS[90][2] = patch(configs.EXPERTS[90][2], **fields)
    configs.FP8[90] = patch(configs.FP8[90], **fields)
    if "norelease" in variant:
        orig = routing.DispatchPlan.__init__
        def init(self, *a, **kw):
            orig(self, *a, **kw); self.release = False
        routing.DispatchPlan.__init__ = init
    print("variant", variant, configs.EXPERTS[90][2][0], configs.FP8[90][0], flush=True)
CALLS, LAYERS = 16, 4
rows = []
torch.backends.cuda.matmul.allow_tf32 = False
for name in ("qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b"):
    E, k, H, I = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).to(torch.bfloat16)
        (q1, s1), (q2, s2) = quantize_fp8_blockwise(w1), quantize_fp8_blockwise(w2)
        layers.append((w1, w2, q1, s1, q2, s2))
    for T in (1, 4, 16, 64):
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        logits = torch.randn(T, E, device="cuda", generator=g)
        for kind in ("bf16", "fp8"):
            def call(i):
                w1, w2, q1, s1, q2, s2 = layers[i % LAYERS]
                if kind == "bf16":
                    return fused_moe(x, w1, w2, logits, k)
                return fused_moe(x, q1, q2, logits, k, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
            with torch.no_grad():
                ref = call(0).float()
                s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(s):
                    for i in range(CALLS):
                        call(i)
                torch.cuda.current_stream().wait_stream(s); torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    outs = [call(i) for i in range(CALLS)]
                graph.replay(); torch.cuda.synchronize()
                same = all(torch.equal(outs[i].float(), call(i).float()) for i in range(LAYERS))
                t = time_gpu(graph.replay, warmup_ms=20, rep_ms=100, repeats=5)
            us = t.median_ms * 1e3 / CALLS
            rows.append(dict(label=label, shape=name, T=T, kind=kind, us=us,
                             checksum=float(ref.double().abs().sum()), first=ref.flatten()[:4].tolist(),
                             graph_matches_eager=same))
            print(f"{label} {name} T={T} {kind}: {us:.1f} us/call graph==eager {same}", flush=True)
            del graph, outs
    del layers
    torch.cuda.empty_cache()
json.dump(rows, open(out_path, "w"), indent=1)
