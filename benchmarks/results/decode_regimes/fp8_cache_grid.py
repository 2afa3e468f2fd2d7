"""FP8 (e4m3, per-(sequence, KV head) descales) KV-cache decode on the H200: the shipped tile against
deeper ones and split counts, per layer of a 32-layer CUDA graph, the bf16 cache's dispatcher choice
and cuDNN (bf16) beside. Writes $OUT/fp8_cache_grid.json."""
import json, os
import torch
from flashmoe_science.attention.configs import AttentionConfig as C
from flashmoe_science.attention.decode import DecodePlan, launch_decode, flash_attention_with_kvcache
from flashmoe_science.attention._kernels.decode import HEAD_SCALES
from flashmoe_science.bench.attention_decode import graph_us_per_call, _fp8_cache, _sdpa, _sdpa_backends
from flashmoe_science.bench.common import environment

CASES = [(32, 4096, 8, 128), (32, 4096, 4, 128), (8, 32768, 8, 128), (1, 65536, 8, 128), (64, 1024, 8, 64),
         (32, 8192, 8, 64)]
TILES = {128: [None, C(16, 64, 4, 3), C(16, 64, 4, 4), C(16, 128, 4, 3), C(16, 128, 4, 4), C(16, 32, 2, 4),
               C(16, 128, 8, 3)],
         64: [None, C(16, 128, 4, 3), C(16, 128, 4, 4), C(16, 256, 4, 3), C(16, 64, 4, 4), C(16, 256, 8, 3)]}
rows = []
cudnn = _sdpa_backends()["sdpa_cudnn"]
for batch, seqlen, hkv, dim in CASES:
    q = torch.randn(batch, 1, 32, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, seqlen, hkv, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    layers = max(1, min(32, (4 << 30) // (4 * k.numel())))
    bf16 = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(layers - 1)]
    fp8 = [(_fp8_cache(a), _fp8_cache(b)) for a, b in bf16]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    base = dict(batch=batch, seqlen=seqlen, heads_q=32, heads_kv=hkv, head_dim=dim, graph_layers=layers)
    ref_bf16 = graph_us_per_call(lambda a, b: flash_attention_with_kvcache(q, a, b, cache_seqlens=lengths), bf16,
                                 warmup_ms=5, rep_ms=20, repeats=3)
    ref_cudnn = graph_us_per_call(lambda a, b: _sdpa(cudnn, q, a, b), bf16, warmup_ms=5, rep_ms=20, repeats=3)
    k8 = fp8[0][0][0]
    now = DecodePlan(q, k8, None, True, (-1, -1), 0)
    print(f"B={batch} Sk={seqlen} Hkv={hkv} D={dim}: bf16 {ref_bf16:.1f} cudnn {ref_cudnn:.1f} fp8 now "
          f"{now.config.block_n}/{now.config.num_warps}/{now.config.num_stages} x{now.num_splits}", flush=True)
    for cfg in TILES[dim]:
        line = []
        for splits in (0, 1, 2, max(132 // (batch * hkv), 1)) if cfg is not None else (0,):
            def call(kd, vd, cfg=cfg, splits=splits):
                (k8, ks), (v8, vs) = kd, vd
                plan = DecodePlan(q, k8, None, True, (-1, -1), splits, config=cfg)
                out = torch.empty_like(q)
                launch_decode(plan, None, q, k8, v8, out, None, lengths, None, 0, None, 0.0, scales=HEAD_SCALES,
                              k_descale=ks, v_descale=vs)
                return out
            try:
                us = graph_us_per_call(call, fp8, warmup_ms=5, rep_ms=20, repeats=3)
            except Exception as exc:
                line.append(f"{splits}:ERR {type(exc).__name__}")
                continue
            plan = DecodePlan(q, k8, None, True, (-1, -1), splits, config=cfg)
            rows.append(dict(base, tile=str(plan.config), splits=plan.num_splits, dispatcher=cfg is None, us=us,
                             bf16_us=ref_bf16, cudnn_us=ref_cudnn))
            line.append(f"{plan.num_splits}:{us:.1f}")
        c = cfg or now.config
        print(f"  {'now ' if cfg is None else ''}{c.block_n}/{c.num_warps}/{c.num_stages}: " + " ".join(line), flush=True)
    json.dump(dict(meta=environment(), rows=rows), open(os.path.join(os.environ.get("OUT", "out"), "fp8_cache_grid.json"), "w"), indent=1)
