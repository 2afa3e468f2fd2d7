"""Decode tile A/B in one run: the table's old D = 128 tile (64 keys, 4 warps, 2 stages, its split
count) against what the dispatcher picks now, and SDPA cuDNN, per layer of a CUDA graph of up to
32 layers (each its own cache), rounds alternating. Writes $OUT/decode_tile_ab.json."""
import json, os, statistics
import torch
from flashmoe_science.attention.configs import AttentionConfig
from flashmoe_science.attention.decode import DecodePlan, launch_decode
from flashmoe_science.bench.attention_decode import graph_us_per_call, paged_copy, _sdpa, _sdpa_backends
from flashmoe_science.bench.common import environment, measure_copy_bandwidth

CASES = [(1, 1024, 32, 8, 128, 0), (1, 4096, 32, 8, 128, 0), (1, 8192, 32, 8, 128, 0), (1, 65536, 32, 8, 128, 0),
         (8, 1024, 32, 8, 128, 0), (8, 8192, 32, 8, 128, 0), (1, 4096, 32, 32, 128, 0),
         (1, 4096, 32, 4, 128, 0), (1, 8192, 32, 4, 128, 0), (1, 32768, 32, 4, 128, 0), (8, 4096, 32, 4, 128, 0),
         (32, 4096, 32, 4, 128, 0),
         (32, 4096, 32, 8, 128, 0), (8, 8192, 32, 8, 128, 16)]  # controls: 256 tiles; paged
OLD = AttentionConfig(16, 64, 4, 2)
ROUNDS = 3
rows = []
copy_tbps = measure_copy_bandwidth()
cudnn = _sdpa_backends()["sdpa_cudnn"]
for batch, seqlen, hq, hkv, dim, page in CASES:
    q = torch.randn(batch, 1, hq, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, seqlen, hkv, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    layer_bytes = 2 * k.numel() * 2
    layers = max(1, min(32, (4 << 30) // layer_bytes))
    caches = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(layers - 1)]
    table = None
    if page:
        pc = [paged_copy(a, b, page) for a, b in caches]
        caches = [(a, b) for a, b, _ in pc]
        table = pc[0][2]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")

    def ours(cfg):
        def call(kc, vc):
            plan = DecodePlan(q, kc, table, True, (-1, -1), 0, config=cfg)
            out = torch.empty_like(q)
            launch_decode(plan, None, q, kc, vc, out, None, lengths, table, 0, None, 0.0)
            return out
        return call
    plan_new = DecodePlan(q, caches[0][0], table, True, (-1, -1), 0)
    plan_old = DecodePlan(q, caches[0][0], table, True, (-1, -1), 0, config=OLD)
    times = {"old": [], "new": [], "cudnn": []}
    outs = {"old": ours(OLD)(*caches[0]), "new": ours(None)(*caches[0])}
    for _ in range(ROUNDS):
        times["old"].append(graph_us_per_call(ours(OLD), caches, warmup_ms=5, rep_ms=20, repeats=3))
        times["new"].append(graph_us_per_call(ours(None), caches, warmup_ms=5, rep_ms=20, repeats=3))
        if not page:
            times["cudnn"].append(graph_us_per_call(lambda kc, vc: _sdpa(cudnn, q, kc, vc), caches, warmup_ms=5,
                                                    rep_ms=20, repeats=3))
    med = {name: statistics.median(t) for name, t in times.items() if t}
    floor_us = layer_bytes / (copy_tbps * 1e12) * 1e6
    diff = ((outs["new"].float() - outs["old"].float()).norm() / outs["old"].float().norm()).item()
    row = dict(batch=batch, seqlen=seqlen, heads_q=hq, heads_kv=hkv, head_dim=dim, page_size=page, graph_layers=layers,
               old_tile=str(plan_old.config), old_splits=plan_old.num_splits, new_tile=str(plan_new.config),
               new_splits=plan_new.num_splits, us=med, us_rounds=times, floor_us=floor_us, rel_diff_new_vs_old=diff)
    rows.append(row)
    print(f"B={batch} Sk={seqlen} Hkv={hkv} page={page}: old {med['old']:.1f} us ({plan_old.num_splits} splits) "
          f"new {med['new']:.1f} ({plan_new.config.block_n}/{plan_new.config.num_warps}/{plan_new.config.num_stages}, "
          f"{plan_new.num_splits} splits) new/old {med['new'] / med['old']:.3f}"
          + (f" cudnn {med['cudnn']:.1f} (cudnn/new {med['cudnn'] / med['new']:.2f})" if 'cudnn' in med else "")
          + f" floor {floor_us:.1f}", flush=True)
    del caches
    torch.cuda.empty_cache()
os.makedirs(os.environ.get("OUT", "out"), exist_ok=True)
json.dump({"meta": {"environment": environment(), "script": "decode tile A/B (see README)"}, "rows": rows},
          open(os.path.join(os.environ.get("OUT", "out"), "decode_tile_ab.json"), "w"), indent=1)
