"""GPU A/B: paged decode with key blocks on page bounds (ALIGNED_PAGES: one page id a block, slots
known at compile time, page ids loaded a block ahead) against the per-key path,
under the paged dispatcher's plan and the contiguous call's tile and splits. 32-layer graphs,
rounds alternating; contiguous and cuDNN controls. Writes $OUT/paged_aligned_ab.json."""
import json, os, statistics
import torch
from flashmoe_science.attention import decode
from flashmoe_science.attention.configs import AttentionConfig as C
from flashmoe_science.attention.decode import DecodePlan, launch_decode
from flashmoe_science.bench.attention_decode import graph_us_per_call, paged_copy, _sdpa, _sdpa_backends
from flashmoe_science.bench.common import environment

CASES = [(1, 8192, 8, 128), (1, 65536, 8, 128), (8, 4096, 8, 128), (32, 4096, 4, 128), (32, 4096, 8, 128),
         (64, 4096, 8, 128), (8, 8192, 8, 64), (32, 4096, 8, 64), (128, 1024, 8, 64), (1, 131072, 8, 64),
         (16, 2048, 8, 128), (4, 16384, 8, 128)]
T = dict(warmup_ms=5, rep_ms=20, repeats=3)
# `ahead`: the shipped ALIGNED_PAGES (aligned blocks, page ids a block ahead). The committed JSON
# also has `aligned` columns, from a kernel that could align the blocks without the prefetch.
MODES = {"perkey": False, "ahead": True}
rows = []
cudnn = _sdpa_backends()["sdpa_cudnn"]
for batch, seqlen, hkv, dim in CASES:
    q = torch.randn(batch, 1, 32, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, seqlen, hkv, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    layers = max(1, min(32, (4 << 30) // (4 * k.numel())))
    caches = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(layers - 1)]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    cplan = DecodePlan(q, k, None, True, (-1, -1), 0)
    row = dict(batch=batch, seqlen=seqlen, heads_q=32, heads_kv=hkv, head_dim=dim, graph_layers=layers, us={},
               contiguous_plan=f"{cplan.config} x{cplan.num_splits}")
    row["us"]["contiguous"] = [graph_us_per_call(lambda kc, vc: decode.flash_attention_with_kvcache(
        q, kc, vc, cache_seqlens=lengths), caches, **T)]
    row["us"]["cudnn"] = [graph_us_per_call(lambda kc, vc: _sdpa(cudnn, q, kc, vc), caches, **T)]
    ref = decode.flash_attention_with_kvcache(q, k, v, cache_seqlens=lengths).float()
    tiles = {"own": (None, 0), "ctile": (cplan.config, cplan.num_splits), "n64s3": (C(16, 64, 4, 3), 0),
             "n128s3": (C(16, 128, 4, 3), 0)}
    runs = [("own", m) for m in MODES] + [(t, "ahead") for t in ("ctile", "n64s3", "n128s3")]
    for page in (16, 256):
        pc = [paged_copy(a, b, page) for a, b in caches]
        paged = [(a, b) for a, b, _ in pc]
        table = pc[0][2]
        for rnd in range(2):
            for tname, mode in runs:
                cfg, splits = tiles[tname]
                plan = DecodePlan(q, paged[0][0], table, True, (-1, -1), splits, config=cfg)
                plan.aligned_pages = MODES[mode]
                name = f"page{page}_{tname}_{mode}"
                row[name + "_plan"] = f"{plan.config} x{plan.num_splits}"

                def call(kc, vc, plan=plan):
                    out = torch.empty_like(q)
                    launch_decode(plan, None, q, kc, vc, out, None, lengths, table, 0, None, 0.0)
                    return out
                if rnd == 0:
                    row[name + "_err"] = (call(*paged[0]).float() - ref).abs().max().item()
                row["us"].setdefault(name, []).append(graph_us_per_call(call, paged, **T))
        del pc, paged
    med = {name: statistics.median(t) for name, t in row["us"].items()}
    row["median_us"] = med
    rows.append(row)
    c = med["contiguous"]
    print(f"B={batch} Sk={seqlen} Hkv={hkv} D={dim}: contiguous {c:.1f} ({row['contiguous_plan']}) cudnn {med['cudnn']:.1f}", flush=True)
    for page in (16, 256):
        print(f"  page {page}: " + " | ".join(
            f"{t}/{m} {row[f'page{page}_{t}_{m}_plan'].split('BLOCK_N=')[1].replace('warps=4 stages=', 's')}: "
            f"{med[f'page{page}_{t}_{m}'] / c:.2f}" for t, m in runs), flush=True)
    bad = {k: v for k, v in row.items() if k.endswith("_err") and not v < 0.05}
    if bad:
        print("  LARGE ERRORS", bad, flush=True)
    json.dump(dict(meta=environment(), rows=rows), open(os.path.join(os.environ.get("OUT", "out"), "paged_aligned_ab.json"), "w"), indent=1)
