"""Why bench attention --mode decode timed B 32, Sk 1k, Hkv 8, D 128 at 39 us a layer while
bw_grid.py (same tile, launch_decode with key None) timed 35.2: the public function (cached plan and
launch) against launch_decode with Triton's ordinary launch, in one run, 32-layer graphs."""
import torch
from flashmoe_science.attention.decode import DecodePlan, launch_decode, flash_attention_with_kvcache
from flashmoe_science.bench.attention_decode import graph_us_per_call, _sdpa, _sdpa_backends

cudnn = _sdpa_backends()["sdpa_cudnn"]
for batch, seqlen, hkv, dim in ((32, 1024, 8, 128), (8, 4096, 8, 64), (64, 1024, 8, 64)):
    q = torch.randn(batch, 1, 32, dim, dtype=torch.bfloat16, device="cuda")
    caches = [tuple(torch.randn(batch, seqlen, hkv, dim, dtype=torch.bfloat16, device="cuda") for _ in range(2))
              for _ in range(32)]
    lengths = torch.full((batch,), seqlen, dtype=torch.int32, device="cuda")

    def plain(k, v):
        plan = DecodePlan(q, k, None, True, (-1, -1), 0)
        out = torch.empty_like(q)
        launch_decode(plan, None, q, k, v, out, None, lengths, None, 0, None, 0.0)
        return out
    timing = dict(warmup_ms=25, rep_ms=60, repeats=3)
    for round_ in range(2):
        a = graph_us_per_call(lambda k, v: flash_attention_with_kvcache(q, k, v, cache_seqlens=lengths), caches, **timing)
        b = graph_us_per_call(plain, caches, **timing)
        c = graph_us_per_call(lambda k, v: _sdpa(cudnn, q, k, v), caches, **timing)
        print(f"B={batch} Sk={seqlen} Hkv={hkv} D={dim} round {round_}: public {a:.1f} us, launch_decode {b:.1f}, "
              f"cudnn {c:.1f}", flush=True)
