"""bf16 decode entry tilings on the H200: fused_moe at T tokens in a CUDA graph of 16 calls cycling
over 4 layers' weights (no L2 reuse from one call to the next), each tiling forced through
configs.experts_config, outputs compared bit for bit with the table's."""
import json, sys
from dataclasses import replace
import torch
from flashmoe_science import fused_moe
from flashmoe_science.device import info_for
from flashmoe_science.moe import configs, experts
from flashmoe_science.bench.timing import time_gpu

G = configs.GemmConfig
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408),
          "mixtral-8x7b": (8, 2, 4096, 14336)}
GATE_UP = [G(32, 128, 1, 4, 4), G(32, 128, 1, 4, 6), G(32, 256, 1, 4, 3), G(32, 256, 1, 4, 4), G(16, 128, 1, 4, 4),
           G(16, 128, 1, 4, 6), G(64, 128, 1, 4, 4), G(32, 128, 1, 8, 4)]
DOWN = [G(64, 128, 1, 4, 4), G(64, 128, 1, 4, 6), G(64, 256, 1, 4, 3), G(64, 256, 1, 4, 4), G(32, 128, 1, 4, 4),
        G(32, 128, 1, 4, 6), G(128, 128, 1, 4, 4), G(32, 256, 1, 4, 4)]
tokens = [int(t) for t in sys.argv[2:]] or [1, 4]
table = configs.experts_config
rows = []
for name, (E, k, H, I) in SHAPES.items():
    g = torch.Generator(device="cuda").manual_seed(0)
    layers = [(torch.randn(E, 2 * I, H, device="cuda", generator=g, dtype=torch.bfloat16) * H ** -0.5,
               torch.randn(E, H, I, device="cuda", generator=g, dtype=torch.bfloat16) * I ** -0.5) for _ in range(4)]
    for T in tokens:
        x = torch.randn(T, H, device="cuda", generator=g).bfloat16()
        logits = torch.randn(T, E, device="cuda", generator=g)
        base = table(info_for(x), 2, T, k, E, H, I)
        variants = [("table", base)] + [(f"gate_up {c}", replace(base, gate_up=c)) for c in GATE_UP[1:]] + \
                   [(f"down {c}", replace(base, down=c)) for c in DOWN[1:]]
        ref = None
        for label, cfg in variants:
            configs.experts_config = lambda *a, cfg=cfg: cfg
            experts._EXPERTS_PLANS.clear(); experts._MOE_PLANS.clear()
            calls = lambda: [fused_moe(x, w1, w2, logits, k) for _ in range(4) for w1, w2 in layers]
            try:
                with torch.no_grad():
                    out = calls()[0].clone()
                    graph = torch.cuda.CUDAGraph()
                    s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
                    with torch.cuda.stream(s):
                        calls()
                    torch.cuda.current_stream().wait_stream(s)
                    with torch.cuda.graph(graph):
                        calls()
                us = time_gpu(graph.replay, warmup_ms=10, rep_ms=80, repeats=5).median_ms * 1e3 / 16
            except Exception as e:  # a tiling that does not fit
                print(json.dumps(dict(shape=name, T=T, variant=label, error=str(e)[:100])), flush=True)
                continue
            ref = out if ref is None else ref
            row = dict(shape=name, T=T, variant=label, us=round(us, 2), same=bool(torch.equal(out, ref)))
            rows.append(row)
            print(json.dumps(row), flush=True)
    del layers
configs.experts_config = table
json.dump(rows, open(sys.argv[1], "w"), indent=1)
