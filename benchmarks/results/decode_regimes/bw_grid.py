"""Bandwidth-bound decode calls that trail cuDNN on the H200 (bench attention --mode decode): the
dispatcher's choice against deeper tiles and other split counts, per layer of a CUDA graph (up to
32 layers), cuDNN beside. Writes $OUT/bw_grid.json."""
import json, os, statistics
import torch
from flashmoe_science.attention.configs import AttentionConfig as C
from flashmoe_science.attention.decode import DecodePlan, launch_decode
from flashmoe_science.bench.attention_decode import graph_us_per_call, _sdpa, _sdpa_backends
from flashmoe_science.bench.common import environment, measure_copy_bandwidth

T128 = [C(16, 32, 2, 3), C(16, 64, 4, 3), C(16, 128, 4, 3), C(16, 64, 4, 4), C(16, 64, 4, 2)]
T64 = [C(16, 128, 4, 2), C(16, 256, 4, 3), C(16, 128, 4, 3), C(16, 128, 4, 4), C(16, 64, 4, 2)]
CASES = [  # batch, seqlen, hkv, dim, split counts
    (1, 65536, 8, 128, (8, 16, 33, 66)), (1, 32768, 8, 128, (16, 33, 66)), (1, 131072, 8, 64, (16, 33, 66)),
    (1, 32768, 8, 64, (16, 33, 66)), (8, 4096, 8, 64, (1, 2, 4, 8)), (8, 8192, 8, 64, (2, 4, 8)),
    (32, 1024, 8, 128, (1, 2, 3)), (64, 1024, 8, 64, (1, 2)), (8, 4096, 8, 128, (2, 4, 8)), (32, 1024, 8, 64, (1, 2))]
rows = []
copy_tbps = measure_copy_bandwidth()
cudnn = _sdpa_backends()["sdpa_cudnn"]
for batch, seqlen, hkv, dim, split_counts in CASES:
    q = torch.randn(batch, 1, 32, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, seqlen, hkv, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    layer_bytes = 2 * k.numel() * 2
    layers = max(1, min(32, (4 << 30) // layer_bytes))
    caches = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(layers - 1)]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    floor_us = layer_bytes / (copy_tbps * 1e12) * 1e6
    cud = statistics.median(graph_us_per_call(lambda kc, vc: _sdpa(cudnn, q, kc, vc), caches, warmup_ms=5,
                                              rep_ms=20, repeats=3) for _ in range(2))
    now = DecodePlan(q, k, None, True, (-1, -1), 0)
    print(f"B={batch} Sk={seqlen} Hkv={hkv} D={dim}: floor {floor_us:.1f} cudnn {cud:.2f} now {now.config.block_n}/"
          f"{now.config.num_warps}/{now.config.num_stages} x{now.num_splits}", flush=True)
    for cfg in [None] + (T128 if dim == 128 else T64):
        line = []
        for splits in ((0,) if cfg is None else split_counts):
            def call(kc, vc, cfg=cfg, splits=splits):
                plan = DecodePlan(q, kc, None, True, (-1, -1), splits, config=cfg)
                out = torch.empty_like(q)
                launch_decode(plan, None, q, kc, vc, out, None, lengths, None, 0, None, 0.0)
                return out
            try:
                us = graph_us_per_call(call, caches, warmup_ms=5, rep_ms=20, repeats=3)
            except Exception as exc:
                line.append(f"{splits}:ERR {type(exc).__name__}"); continue
            plan = DecodePlan(q, k, None, True, (-1, -1), splits, config=cfg)
            rows.append(dict(batch=batch, seqlen=seqlen, heads_q=32, heads_kv=hkv, head_dim=dim, tile=str(plan.config),
                             block_n=plan.config.block_n, warps=plan.config.num_warps, stages=plan.config.num_stages,
                             splits=plan.num_splits, dispatcher=cfg is None, us=us, floor_us=floor_us, cudnn_us=cud))
            line.append(f"{plan.num_splits}:{us:.2f}")
        c = cfg or now.config
        print(f"  {'now ' if cfg is None else ''}{c.block_n}/{c.num_warps}/{c.num_stages}: " + " ".join(line), flush=True)
    json.dump(dict(meta=environment(), copy_tbps=copy_tbps, rows=rows),
              open(os.path.join(os.environ.get("OUT", "out"), "bw_grid.json"), "w"), indent=1)
