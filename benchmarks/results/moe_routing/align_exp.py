"""The align step's tiles: chunk size, pairs ranked per step, warps; route + count + align as
shipped (package) and align variants launched directly. The layout must not change."""
import json
import torch, triton
from flashmoe_science.moe import routing
from flashmoe_science.moe._kernels.dispatch import align_pairs_kernel, count_pairs_kernel


def prof_ms(fn, n=20):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return {e.key.split("_kernel")[0]: round(e.device_time_total / n, 2) for e in prof.key_averages()
            if e.device_time_total > 0}


def variant(ids, T, E, k, chunk, pairs, warps, block_m=128):
    N = T * k
    num_chunks = triton.cdiv(T, chunk)
    num_blocks = routing.layout_blocks(N, E, block_m)
    sp = torch.empty(num_blocks * block_m, device="cuda", dtype=torch.int32)
    be = torch.empty(num_blocks, device="cuda", dtype=torch.int32)
    br = torch.empty(num_blocks, device="cuda", dtype=torch.int32)
    counts = torch.empty(num_chunks, 256, device="cuda", dtype=torch.int32)
    count_pairs_kernel[(num_chunks,)](ids, counts, N, E, chunk * k, E_PAD=256, COUNT_TILE=1024, num_warps=4)
    align_pairs_kernel[(num_chunks,)](ids, counts, sp, be, br, N, E, block_m, chunk * k, num_chunks,
                                      triton.cdiv(num_blocks, num_chunks), num_blocks, E_PAD=256, PAIRS=pairs,
                                      TILE_B=16, COUNT_TILE=1024, TABLE_ROWS=16, COUNT_HERE=False, num_warps=warps)
    return sp, be, br


for (name, E, k) in (("qwen3", 128, 8), ("deepseek", 64, 6), ("mixtral", 8, 2)):
    for T in (256, 1024, 4096, 16384):
        logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
        plan = routing.DispatchPlan(T, E, k, 128, logits.device)
        f = lambda: routing.route_pairs(logits, plan, ("x", T, E, k), sigmoid=False, renormalize=True,
                                        with_layout=True)
        w, ids, lay = f()
        row = dict(shape=name, T=T, shipped=prof_ms(f))
        for chunk in (16, 32, 64, 128):
            if triton.cdiv(T, chunk) > 512:
                continue
            for pairs in (64, 128):
                for warps in (4, 8):
                    out = variant(ids, T, E, k, chunk, pairs, warps)
                    same = all(torch.equal(a, b) for a, b in zip(out, lay[:3]))
                    t = prof_ms(lambda: variant(ids, T, E, k, chunk, pairs, warps))
                    row[f"chunk={chunk} pairs={pairs} warps={warps}"] = dict(t, same=same)
        print(json.dumps(row), flush=True)
