"""Where the bandwidth-bound mid-size decode call (B 32, Sk 4k, Hkv 4/8) loses to cuDNN: split
counts 1-3 over deep tiles, the split kernel alone (combine skipped), PDL off; per layer of a
32-layer CUDA graph. Writes $OUT/b32_gap.json."""
import json, os, statistics
import torch
from flashmoe_science.attention import decode as dec
from flashmoe_science.attention.configs import AttentionConfig
from flashmoe_science.attention.decode import DecodePlan, launch_decode
from flashmoe_science.bench.attention_decode import graph_us_per_call, _sdpa, _sdpa_backends
from flashmoe_science.bench.common import environment, measure_copy_bandwidth

CASES = [(32, 4096, 32, 4, 128), (32, 4096, 32, 8, 128), (16, 4096, 32, 8, 128), (64, 2048, 32, 4, 128)]
TILES = [None, AttentionConfig(16, 32, 2, 4), AttentionConfig(16, 32, 2, 6), AttentionConfig(16, 64, 4, 3),
         AttentionConfig(16, 64, 4, 4), AttentionConfig(16, 64, 2, 4), AttentionConfig(16, 128, 4, 3),
         AttentionConfig(16, 128, 8, 3), AttentionConfig(16, 32, 1, 4), AttentionConfig(16, 64, 1, 3)]
rows = []
copy_tbps = measure_copy_bandwidth()
cudnn = _sdpa_backends()["sdpa_cudnn"]
real_combine = dec._COMBINE.launch
for batch, seqlen, hq, hkv, dim in CASES:
    q = torch.randn(batch, 1, hq, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, seqlen, hkv, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    layer_bytes = 2 * k.numel() * 2
    layers = max(1, min(32, (4 << 30) // layer_bytes))
    caches = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(layers - 1)]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    floor_us = layer_bytes / (copy_tbps * 1e12) * 1e6
    cud = statistics.median(graph_us_per_call(lambda kc, vc: _sdpa(cudnn, q, kc, vc), caches, warmup_ms=5,
                                              rep_ms=20, repeats=3) for _ in range(2))
    table = DecodePlan(q, k, None, True, (-1, -1), 0)
    print(f"B={batch} Sk={seqlen} Hkv={hkv}: floor {floor_us:.1f} cudnn {cud:.2f} table {table.config} x{table.num_splits}", flush=True)
    for cfg in TILES:
        line = []
        for splits, variant in ((1, ""), (2, ""), (3, ""), (2, "nocombine"), (2, "nopdl"), (4, "")):
            def call(kc, vc, cfg=cfg, splits=splits, variant=variant):
                plan = DecodePlan(q, kc, None, True, (-1, -1), splits, config=cfg)
                if variant == "nopdl":
                    plan.pdl = False; plan.combine_options = {}
                out = torch.empty_like(q)
                launch_decode(plan, None, q, kc, vc, out, None, lengths, None, 0, None, 0.0)
                return out
            try:
                if variant == "nocombine":
                    dec._COMBINE.launch = lambda *a, **kw: None
                us = graph_us_per_call(call, caches, warmup_ms=5, rep_ms=20, repeats=3)
            except Exception as exc:
                line.append(f"{splits}{variant}:ERR {type(exc).__name__}")
                continue
            finally:
                dec._COMBINE.launch = real_combine
            rows.append(dict(batch=batch, seqlen=seqlen, heads_kv=hkv, tile=str(cfg or table.config), splits=splits,
                             variant=variant, us=us, floor_us=floor_us, cudnn_us=cud))
            line.append(f"{splits}{variant}:{us:.2f}")
        c = cfg or table.config
        print(f"  {c.block_n}/{c.num_warps}/{c.num_stages}: " + " ".join(line), flush=True)
    json.dump(dict(meta=environment(), rows=rows), open(os.path.join(os.environ.get("OUT", "out"), "b32_gap.json"), "w"), indent=1)
