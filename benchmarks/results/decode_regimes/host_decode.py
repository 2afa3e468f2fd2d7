"""Host time of flash_attention_with_kvcache's Python path (kernel launches replaced by no-ops),
on the CPU under the interpreter: median of 7 rounds of 4000 calls."""
import statistics, time, sys
import torch
from flashmoe_science.attention import decode
from flashmoe_science import flash_attention_with_kvcache
decode._SPLIT.launch = decode._COMBINE.launch = lambda *a, **k: None
q = torch.randn(1, 1, 32, 128, dtype=torch.bfloat16)
k = torch.randn(1, 1024, 8, 128, dtype=torch.bfloat16)
L = torch.full((1,), 1024, dtype=torch.int32)
pages = torch.randn(64, 16, 8, 128, dtype=torch.bfloat16)
table = torch.arange(64, dtype=torch.int32).view(1, 64)
calls = {"one split": lambda: flash_attention_with_kvcache(q, k, k, cache_seqlens=L, num_splits=1),
         "splits": lambda: flash_attention_with_kvcache(q, k, k, cache_seqlens=L, num_splits=8),
         "paged": lambda: flash_attention_with_kvcache(q, pages, pages, cache_seqlens=L, block_table=table)}
for name, f in calls.items():
    for _ in range(200):
        f()
    rounds = []
    for _ in range(7):
        t = time.perf_counter()
        for _ in range(4000):
            f()
        rounds.append((time.perf_counter() - t) / 4000 * 1e6)
    print(f"{sys.argv[1] if len(sys.argv) > 1 else ''} {name}: {statistics.median(rounds):.2f} us a call")
