"""Split count x tile grid at latency-bound decode shapes (bf16, one new token), per layer of a CUDA
graph of up to 32 layers, with SDPA cuDNN in the same run. Writes $OUT/split_grid.json."""
import json, os, statistics
import torch
from flashmoe_science.attention.configs import AttentionConfig
from flashmoe_science.attention.decode import DecodePlan, launch_decode
from flashmoe_science.bench.attention_decode import graph_us_per_call, _sdpa, _sdpa_backends
from flashmoe_science.bench.common import environment, measure_copy_bandwidth

CASES = [(1, 1024, 32, 8, 64), (1, 4096, 32, 8, 64), (1, 16384, 32, 8, 64), (1, 1024, 32, 8, 128),
         (1, 4096, 32, 8, 128), (1, 8192, 32, 8, 128),
         (1, 4096, 32, 4, 128), (1, 8192, 32, 4, 128), (1, 16384, 32, 4, 128), (8, 1024, 32, 8, 128),
         (8, 4096, 32, 4, 128), (32, 4096, 32, 4, 128), (1, 4096, 32, 32, 128), (4, 4096, 32, 8, 128)]
SPLITS = (2, 4, 6, 8, 11, 16, 22, 32, 43, 64, 86, 128)
rows = []
copy_tbps = measure_copy_bandwidth()
cudnn = _sdpa_backends()["sdpa_cudnn"]
for batch, seqlen, hq, hkv, dim in CASES:
    q = torch.randn(batch, 1, hq, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, seqlen, hkv, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    layer_bytes = 2 * k.numel() * 2
    layers = max(1, min(32, (4 << 30) // layer_bytes))
    caches = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(layers - 1)]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    table_plan = DecodePlan(q, k, None, True, (-1, -1), 0)
    tiles = [table_plan.config]
    if dim == 128:
        tiles += [AttentionConfig(16, 64, 4, 3), AttentionConfig(16, 128, 4, 3), AttentionConfig(16, 64, 2, 3)]
    else:
        tiles += [AttentionConfig(16, 64, 2, 3), AttentionConfig(16, 128, 4, 3), AttentionConfig(16, 256, 4, 2)]
    tiles = list(dict.fromkeys(tiles))
    floor_us = layer_bytes / (copy_tbps * 1e12) * 1e6
    cud = statistics.median(graph_us_per_call(lambda kc, vc: _sdpa(cudnn, q, kc, vc), caches, warmup_ms=5,
                                              rep_ms=20, repeats=3) for _ in range(2))
    case = dict(batch=batch, seqlen=seqlen, heads_q=hq, heads_kv=hkv, head_dim=dim, graph_layers=layers,
                floor_us=floor_us, cudnn_us=cud, table_tile=str(table_plan.config), table_splits=table_plan.num_splits)
    print(f"B={batch} Sk={seqlen} Hkv={hkv} D={dim} floor {floor_us:.1f} cudnn {cud:.2f} table "
          f"{table_plan.config.block_n}/{table_plan.config.num_warps}/{table_plan.config.num_stages} x{table_plan.num_splits}")
    for cfg in tiles:
        line = []
        for splits in SPLITS + (0,):
            if splits and splits > seqlen // cfg.block_n:
                continue
            def call(kc, vc, cfg=cfg, splits=splits):
                plan = DecodePlan(q, kc, None, True, (-1, -1), splits, config=cfg)
                out = torch.empty_like(q)
                launch_decode(plan, None, q, kc, vc, out, None, lengths, None, 0, None, 0.0)
                return out
            try:
                us = graph_us_per_call(call, caches, warmup_ms=5, rep_ms=20, repeats=3)
            except Exception as exc:
                line.append(f"{splits}:ERR {type(exc).__name__}"); continue
            n = DecodePlan(q, k, None, True, (-1, -1), splits, config=cfg).num_splits
            rows.append(dict(case, tile=str(cfg), block_n=cfg.block_n, warps=cfg.num_warps, stages=cfg.num_stages,
                             splits=n, heuristic=splits == 0, us=us))
            line.append(f"{n}{'*' if not splits else ''}:{us:.2f}")
        print(f"  {cfg.block_n}/{cfg.num_warps}/{cfg.num_stages}: " + " ".join(line), flush=True)
    json.dump(dict(meta=environment(), rows=rows), open(os.path.join(os.environ.get("OUT", "out"), "split_grid.json"), "w"), indent=1)
