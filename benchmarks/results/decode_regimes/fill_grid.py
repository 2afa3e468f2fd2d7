"""Decode calls whose (sequence, KV head) tiles fill the SMs or nearly: split counts 1-3 and the
dispatcher's against deep tiles, per layer of a CUDA graph (up to 32 layers), cuDNN beside.
Writes $OUT/fill_grid.json."""
import json, os, statistics
import torch
from flashmoe_science.attention.configs import AttentionConfig
from flashmoe_science.attention.decode import DecodePlan, launch_decode
from flashmoe_science.bench.attention_decode import graph_us_per_call, paged_copy, _sdpa, _sdpa_backends
from flashmoe_science.bench.common import environment, measure_copy_bandwidth

C = AttentionConfig
CASES = [  # batch, seqlen, hq, hkv, dim, page
    (12, 4096, 32, 8, 128, 0), (20, 4096, 32, 8, 128, 0), (24, 4096, 32, 8, 128, 0), (32, 1024, 32, 4, 128, 0),
    (32, 16384, 32, 4, 128, 0), (64, 4096, 32, 8, 128, 0), (128, 1024, 32, 8, 128, 0), (16, 4096, 32, 4, 128, 0),
    (32, 4096, 32, 8, 128, 16), (32, 4096, 32, 8, 128, 256), (32, 4096, 32, 4, 128, 16),
    (16, 4096, 32, 8, 64, 0), (32, 4096, 32, 8, 64, 0), (128, 1024, 32, 8, 64, 0)]
D128 = [None, C(16, 32, 2, 4), C(16, 64, 4, 3), C(16, 64, 4, 4), C(16, 128, 4, 3)]
D64 = [None, C(16, 64, 2, 4), C(16, 128, 4, 3), C(16, 256, 4, 3), C(16, 64, 4, 4)]
rows = []
copy_tbps = measure_copy_bandwidth()
cudnn = _sdpa_backends()["sdpa_cudnn"]
for batch, seqlen, hq, hkv, dim, page in CASES:
    q = torch.randn(batch, 1, hq, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, seqlen, hkv, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    layer_bytes = 2 * k.numel() * 2
    layers = max(1, min(32, (4 << 30) // layer_bytes))
    caches = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(layers - 1)]
    floor_us = layer_bytes / (copy_tbps * 1e12) * 1e6
    cud = statistics.median(graph_us_per_call(lambda kc, vc: _sdpa(cudnn, q, kc, vc), caches, warmup_ms=5,
                                              rep_ms=20, repeats=3) for _ in range(2))
    table = None
    if page:
        pc = [paged_copy(a, b, page) for a, b in caches]
        caches = [(a, b) for a, b, _ in pc]
        table = pc[0][2]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    plan0 = DecodePlan(q, caches[0][0], table, True, (-1, -1), 0)
    print(f"B={batch} Sk={seqlen} Hkv={hkv} D={dim} page={page}: floor {floor_us:.1f} cudnn {cud:.2f} "
          f"table {plan0.config.block_n}/{plan0.config.num_warps}/{plan0.config.num_stages} x{plan0.num_splits}", flush=True)
    for cfg in (D128 if dim == 128 else D64):
        line = []
        for splits in (0, 1, 2, 3):
            def call(kc, vc, cfg=cfg, splits=splits):
                plan = DecodePlan(q, kc, table, True, (-1, -1), splits, config=cfg)
                out = torch.empty_like(q)
                launch_decode(plan, None, q, kc, vc, out, None, lengths, table, 0, None, 0.0)
                return out
            try:
                us = graph_us_per_call(call, caches, warmup_ms=5, rep_ms=20, repeats=3)
            except Exception as exc:
                line.append(f"{splits}:ERR {type(exc).__name__}"); continue
            n = DecodePlan(q, caches[0][0], table, True, (-1, -1), splits, config=cfg).num_splits
            c = cfg or plan0.config
            rows.append(dict(batch=batch, seqlen=seqlen, heads_q=hq, heads_kv=hkv, head_dim=dim, page_size=page,
                             tile=str(c), block_n=c.block_n, warps=c.num_warps, stages=c.num_stages, splits=n,
                             heuristic=splits == 0, table_tile=cfg is None, us=us, floor_us=floor_us, cudnn_us=cud))
            line.append(f"{n}{'*' if not splits else ''}:{us:.2f}")
        c = cfg or plan0.config
        print(f"  {'T ' if cfg is None else ''}{c.block_n}/{c.num_warps}/{c.num_stages}: " + " ".join(line), flush=True)
    json.dump(dict(meta=environment(), rows=rows), open(os.path.join(os.environ.get("OUT", "out"), "fill_grid.json"), "w"), indent=1)
