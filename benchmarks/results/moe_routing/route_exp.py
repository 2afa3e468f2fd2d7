"""Prefill routing: the shipped route (count) + align against routing on a fine grid ("none",
E padded to its power of two) + count + align; and the FP8 token quantisation with software
rounding (shipped) against the hardware conversion. Kernel times by torch.profiler, outputs
compared. One H100/H200 call."""
import json
import torch, triton, triton.language as tl
from flashmoe_science.moe import routing, configs
from flashmoe_science.moe._kernels.dispatch import route_kernel
from flashmoe_science.moe._kernels.fp8 import quantize_groups_kernel, FP8_MAX, MIN_SCALE
from flashmoe_science.moe._kernels.offsets import wide_offset
from flashmoe_science.float8 import to_e4m3


def prof_ms(fn, n=20):
    fn(); torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(n):
            fn()
        torch.cuda.synchronize()
    return {e.key: round(e.device_time_total / n, 2) for e in prof.key_averages() if e.device_time_total > 0}


def shipped(logits, E, k, block_m=128):
    plan = routing.DispatchPlan(logits.shape[0], E, k, block_m, logits.device)
    return routing.route_pairs(logits, plan, ("exp", logits.shape, E, k), sigmoid=False, renormalize=True,
                               with_layout=True)


def fine(logits, E, k, rows_per_program, warps, block_m=128):
    T = logits.shape[0]
    pad = max(16, triton.next_power_of_2(E))
    rows = max(1, min(configs.ROUTE_TILE // pad, rows_per_program))
    weights = torch.empty(T, k, device="cuda", dtype=torch.float32)
    ids = torch.empty(T, k, device="cuda", dtype=torch.int32)
    route_kernel[(triton.cdiv(T, rows_per_program),)](
        logits, weights, ids, ids, ids, ids, ids, T, E, logits.stride(0), k, 0, 1, rows_per_program, block_m, 0,
        E_PAD=pad, K_PAD=8, ROWS=rows, LAYOUT="none", PAIRS=64, TILE_B=16, num_warps=warps, num_stages=1)
    plan = routing.DispatchPlan(T, E, k, block_m, logits.device)
    layout = routing.align_pairs(ids, plan, ("exp-align", T, E, k))
    return weights, ids, layout


@triton.jit
def quantize_hw_kernel(x_ptr, q_ptr, s_ptr, T, H, stride_xt, BLOCK_T: tl.constexpr, GROUP: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * GROUP + tl.arange(0, GROUP)
    ok = (rows < T)[:, None]
    x = tl.load(x_ptr + wide_offset(rows, stride_xt)[:, None] + cols[None, :], mask=ok, other=0.0).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(x), axis=1) / FP8_MAX, MIN_SCALE)
    q = to_e4m3(x / scale[:, None])
    tl.store(q_ptr + wide_offset(rows, H)[:, None] + cols[None, :], q, mask=ok)
    tl.store(s_ptr + wide_offset(rows, H // GROUP) + tl.program_id(1), scale, mask=rows < T)


def same_layout(a, b):
    return all(torch.equal(x, y) for x, y in zip(a[:3], b[:3]))


for (name, E, k) in (("qwen3", 128, 8), ("deepseek", 64, 6), ("mixtral", 8, 2)):
    for T in (256, 1024, 4096, 16384):
        logits = torch.randn(T, E, device="cuda", dtype=torch.bfloat16)
        w0, i0, l0 = shipped(logits, E, k)
        row = dict(shape=name, T=T, shipped=prof_ms(lambda: shipped(logits, E, k)))
        for rpp in (8, 16, 32, 64):
            for warps in (2, 4, 8):
                w1, i1, l1 = fine(logits, E, k, rpp, warps)
                ok = torch.equal(i0, i1) and torch.equal(w0, w1) and same_layout(l0, l1)
                t = prof_ms(lambda: fine(logits, E, k, rpp, warps))
                row[f"fine rows={rpp} warps={warps}"] = dict(t, same=ok, w_maxdiff=float((w0 - w1).abs().max()))
        print(json.dumps(row), flush=True)

for T in (4096, 16384):
    for H in (2048, 4096):
        x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16) * 3
        x[0, :5] = torch.tensor([1e-30, 448.0, -3e4, 0.0, 7.0])
        res = {}
        for label, kern in (("sw", quantize_groups_kernel), ("hw", quantize_hw_kernel)):
            for bt in (8, 16, 32, 64):
                q = torch.empty(T, H, device="cuda", dtype=torch.float8_e4m3fn)
                s = torch.empty(T, H // 128, device="cuda", dtype=torch.float32)
                f = lambda: kern[(triton.cdiv(T, bt), H // 128)](x, q, s, T, H, x.stride(0), BLOCK_T=bt, GROUP=128,
                                                                 num_warps=4, num_stages=1)
                t = prof_ms(f)
                res[(label, bt)] = (q.view(torch.uint8).clone(), s.clone(), t)
        ref = res[("sw", 16)]
        print(json.dumps(dict(T=T, H=H, **{f"{l} BLOCK_T={bt}": dict(v[2], same=bool(torch.equal(v[0], ref[0])
                                                                               and torch.equal(v[1], ref[1])))
                                          for (l, bt), v in res.items()})), flush=True)
