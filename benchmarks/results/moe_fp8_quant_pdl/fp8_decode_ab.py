"""A/B of MoE decode in CUDA graphs: `fused_moe` bf16 and block-FP8, a graph of CALLS calls cycling
over LAYERS distinct layers' weights (no L2 reuse between calls), per-call us, and the FP8 output's
relative error against the bf16 layer's. usage: fp8_decode_ab.py LABEL OUT_JSON"""
import json, sys
import torch
from flashmoe_science.moe import fused_moe
from flashmoe_science.moe.fp8 import quantize_fp8_blockwise
from flashmoe_science.bench.moe import SHAPES
from flashmoe_science.bench.timing import time_gpu

label, out_path = sys.argv[1], sys.argv[2]
CALLS, LAYERS = 16, 4
rows = []
for name in ("qwen3-30b-a3b", "deepseek-v2-lite", "mixtral-8x7b"):
    E, k, H, I = SHAPES[name]
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H**-0.5).to(torch.bfloat16)
        w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).to(torch.bfloat16)
        (q1, s1), (q2, s2) = quantize_fp8_blockwise(w1), quantize_fp8_blockwise(w2)
        layers.append((w1, w2, q1, s1, q2, s2))
    for T in (1, 4, 16, 64, 256):
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        logits = torch.randn(T, E, device="cuda", generator=g)
        outs0 = {}
        for kind in ("bf16", "fp8"):
            def call(i):
                w1, w2, q1, s1, q2, s2 = layers[i % LAYERS]
                if kind == "bf16":
                    return fused_moe(x, w1, w2, logits, k)
                return fused_moe(x, q1, q2, logits, k, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
            with torch.no_grad():
                ref = call(0).float()
                outs0[kind] = ref
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
            err = float((outs0["fp8"] - outs0["bf16"]).norm() / outs0["bf16"].norm()) if kind == "fp8" else None
            rows.append(dict(label=label, shape=name, T=T, kind=kind, us=us, rel_err_vs_bf16=err,
                             checksum=float(ref.double().abs().sum()), graph_matches_eager=same))
            print(f"{label} {name} T={T} {kind}: {us:.1f} us/call graph==eager {same}" + (f" err {err:.4f}" if err else ""), flush=True)
            del graph, outs
    del layers
    torch.cuda.empty_cache()
json.dump(rows, open(out_path, "w"), indent=1)
