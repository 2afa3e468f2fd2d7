"""FP8 (e4m3, per (sequence, KV head) descales) against bf16 KV-cache decode, per layer of a CUDA
graph over several layers' caches, one H200: the tree on PYTHONPATH (argv[1] labels it)."""
import sys, torch
from flashmoe_science.attention.decode import flash_attention_with_kvcache
from flashmoe_science.bench.attention_decode import graph_us_per_call, _fp8_cache
CASES = [(32, 4096, 8, 128), (8, 32768, 8, 128), (32, 8192, 8, 64)]
for batch, seqlen, hkv, dim in CASES:
    torch.manual_seed(0)
    q = torch.randn(batch, 1, 32, dim, dtype=torch.bfloat16, device="cuda")
    k, v = (torch.randn(batch, seqlen, hkv, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    layers = max(1, min(8, (2 << 30) // (4 * k.numel())))
    bf16 = [(k, v)] + [(torch.randn_like(k), torch.randn_like(v)) for _ in range(layers - 1)]
    fp8 = [(*_fp8_cache(a), *_fp8_cache(b)) for a, b in bf16]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")
    ref = flash_attention_with_kvcache(q, k, v, cache_seqlens=lengths)
    k8, ks, v8, vs = fp8[0]
    out8 = flash_attention_with_kvcache(q, k8, v8, cache_seqlens=lengths, k_descale=ks, v_descale=vs)
    err = float((out8.float() - ref.float()).norm() / ref.float().norm())
    t_bf16 = graph_us_per_call(lambda a, b: flash_attention_with_kvcache(q, a, b, cache_seqlens=lengths), bf16,
                               warmup_ms=5, rep_ms=20, repeats=3)
    t_fp8 = graph_us_per_call(lambda a, sa, b, sb: flash_attention_with_kvcache(q, a, b, cache_seqlens=lengths,
                              k_descale=sa, v_descale=sb), fp8, warmup_ms=5, rep_ms=20, repeats=3)
    print(f"{sys.argv[1]} B={batch} Sk={seqlen} Hkv={hkv} D={dim} layers={layers}: bf16 {t_bf16:.1f} us a layer, "
          f"fp8 {t_fp8:.1f} us a layer, fp8/bf16 {t_fp8 / t_bf16:.2f}, rel err vs bf16 {err:.4f}", flush=True)
