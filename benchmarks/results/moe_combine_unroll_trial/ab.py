"""The combine kernel unrolled over the k rows (defined here) against the shipped plain loop, alone:
same bits, time, bandwidth; the unrolled kernel under other tiles. Then the layer's graph-replayed
forward and forward+backward. (`combine_ab.json` ran with the unrolled kernel in combine.py and
the loop here: the same two kernels, the layer's times with the unrolled one.)"""
import json, os
import torch, triton, triton.language as tl
from flashmoe_science import fused_moe
from flashmoe_science.bench.timing import graph_replay
from flashmoe_science.moe import configs, experts
from flashmoe_science.moe._kernels.offsets import wide_offset


@triton.jit(do_not_specialize=["top_k"])
def unrolled_combine_kernel(y_ptr, ids_ptr, out_ptr, T, E, H, top_k, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
                            UNROLL: tl.constexpr):
    """combine_kernel with a token's rows read UNROLL at a time, unrolled; slots past top_k masked."""
    tokens = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_ok = tokens < T
    ok = t_ok[:, None] & (cols < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for j0 in range(0, top_k, UNROLL):
        for j in tl.static_range(UNROLL):
            pairs = tokens * top_k + j0 + j
            e = tl.load(ids_ptr + pairs, mask=t_ok & (j0 + j < top_k), other=-1)
            routed = (e >= 0) & (e < E)
            acc += tl.load(y_ptr + wide_offset(pairs, H)[:, None] + cols[None, :],
                           mask=ok & routed[:, None], other=0.0).to(tl.float32)
    tl.store(out_ptr + wide_offset(tokens, H)[:, None] + cols[None, :], acc.to(out_ptr.dtype.element_ty), mask=ok)


UNROLL = 8
SHAPES = {"qwen3-30b-a3b": (128, 8, 2048, 768), "deepseek-v2-lite": (64, 6, 2048, 1408),
          "olmoe-1b-7b": (64, 8, 2048, 1024), "mixtral-8x7b": (8, 2, 4096, 14336)}
CASES = [c.split(":") for c in os.environ.get("CASES", "qwen3-30b-a3b:4096 qwen3-30b-a3b:16384 deepseek-v2-lite:16384 olmoe-1b-7b:16384 mixtral-8x7b:8192").split()]
rows = []
torch.manual_seed(0)
for name, T in CASES:
    T = int(T)
    E, k, H, I = SHAPES[name]
    y = torch.randn(T * k, H, device="cuda").bfloat16()
    ids = torch.randint(0, E, (T, k), device="cuda", dtype=torch.int32)
    ids[0, 0] = -1
    out_new = torch.empty(T, H, device="cuda", dtype=torch.bfloat16)
    out_old = torch.empty_like(out_new)
    bt, bh = configs.COMBINE_BLOCK_T, configs.COMBINE_BLOCK_H
    grid = (-(-T // bt), -(-H // bh))
    old = lambda: experts.launch_combine(None, y, ids, out_old, E, 0)
    new = lambda: unrolled_combine_kernel[grid](y, ids, out_new, T, E, H, k, bt, bh, UNROLL,
                                                num_warps=configs.COMBINE_WARPS, num_stages=1)
    old(); new(); torch.cuda.synchronize()
    same = bool(torch.equal(out_old, out_new))
    times = {}
    for rep in range(3):
        for label, f in (("loop", old), ("unrolled", new)):
            times.setdefault(label, []).append(round(triton.testing.do_bench(f, warmup=20, rep=100) * 1e3, 2))
    tiles = {}
    for bt2, bh2, w2_ in ((8, 256, 4), (16, 256, 4), (4, 512, 4), (8, 512, 8), (16, 128, 4), (32, 128, 8), (2, 1024, 4)):
        g2 = (-(-T // bt2), -(-H // bh2))
        f2 = lambda: unrolled_combine_kernel[g2](y, ids, out_new, T, E, H, k, bt2, bh2, UNROLL, num_warps=w2_,
                                                 num_stages=1)
        tiles[f"{bt2}x{bh2}w{w2_}"] = round(triton.testing.do_bench(f2, warmup=20, rep=100) * 1e3, 2)
    nbytes = (T * k * H + T * H) * 2
    row = dict(shape=name, T=T, k=k, H=H, same=same, us=times, tiles_us=tiles,
               tb_per_s={l: round(nbytes / (min(v) * 1e-6) / 1e12, 2) for l, v in times.items()})
    x = (torch.randn(T, H, device="cuda") * 0.5).bfloat16().requires_grad_()
    w1 = (torch.randn(E, 2 * I, H, device="cuda") / H ** 0.5).bfloat16().requires_grad_()
    w2 = (torch.randn(E, H, I, device="cuda") / I ** 0.5).bfloat16().requires_grad_()
    logits = torch.randn(T, E, device="cuda").requires_grad_()
    dy = torch.randn(T, H, device="cuda").bfloat16()

    def train():
        for t in (x, w1, w2, logits):
            t.grad = None
        fused_moe(x, w1, w2, logits, k).backward(dy)
        return x.grad, w1.grad, w2.grad, logits.grad

    def infer():
        with torch.no_grad():
            return fused_moe(x, w1, w2, logits, k)
    row["train_graph_ms"] = round(triton.testing.do_bench(graph_replay(train), warmup=10, rep=150), 4)
    row["infer_graph_ms"] = round(triton.testing.do_bench(graph_replay(infer), warmup=10, rep=150), 4)
    print(json.dumps(row), flush=True)
    rows.append(row)
    del y, ids, out_new, out_old, x, w1, w2, logits, dy
    torch.cuda.empty_cache()
json.dump(rows, open(f"{os.environ.get('OUT', '/tmp')}/combine_ab.json", "w"), indent=1)
