"""`flashmoe-science bench ep`: expert parallelism over the GPUs of one host (torch.distributed,
NCCL), tokens per second per GPU, side by side with torchtitan's all-to-all + `torch._grouped_mm`
dispatcher in the same run.

Launch: `flashmoe-science bench ep [--gpus N]` starts itself under torchrun
(`torch.distributed.run`, one process per GPU, N default every GPU); a run already under torchrun
(`torchrun --nproc-per-node N -m flashmoe_science bench ep`) measures directly. Rank 0 writes the
results ("ep").

Weak scaling: every rank has its own T tokens (--tokens) at each EP size e (--ep, up to the
world size); the world splits into world/e groups of e ranks (`dist.new_subgroups`), each one
expert-parallel layer holding E/e experts a rank, every group at once (data x expert parallel, as
a training job runs them). The per-rank work is the same at every e and the exchange grows, so
`weak_scaling` (tokens/s per GPU at e over that at e = 1) measures what the exchange costs.

Implementations, same weights, same tokens:
- ours: `parallel.shard_experts` of a `FlashMoELayer` (routing kernel; all_to_all of the counts,
  then of the rows, each token once per rank owning any of its experts, with its local expert
  ids and weights; `fused_experts`; all_to_all back;
  the shared experts computed while the rows travel); at EP 1 the unsharded layer's path, with
  no exchange;
- ours_chunked: the same with the tokens pipelined in chunks of CHUNK_TOKENS (`chunk_tokens`):
  one chunk computed while the next travels, what overlapping the exchange gains or costs;
- ours_capacity: the same with a fixed capacity per rank pair, CAPACITY_FACTOR times the even
  share T k / e: no count exchange, no host synchronisation; `dropped` is the fraction of
  assignments past it;
- reference: torchtitan's token dispatcher: routing in PyTorch (softmax top-k), the assignments
  sorted by expert, all_to_all of the per-expert counts and of the rows, the received rows
  permuted to expert order, `torch._grouped_mm` for both expert matmuls, back to source order,
  all_to_all back, the weighted sum, then the shared experts; at EP 1 the same with no exchange.

Modes: fwd (prefill) and fwd+bwd (gradients for the tokens and every parameter). Time: `iters`
calls between barriers, CUDA events on every rank, the slowest rank's time (every rank waits for
it at its next exchange); `repeats` such timings give the median and its interval.

Load: for ours at EP > 1, `rows_received_max_over_mean`, the most rows any rank's experts
computed (the layer's `rows_received`) over the mean across ranks, from the same forward.

Correctness on every row: each rank's output on its first REFERENCE_TOKENS tokens against the
float64 forward of the unsharded layer (routed from the same bf16 logits): `rel_error`, the
largest over ranks, next to the reference implementation's (`torch_rel_error`).

Overlap (meta "overlap"): one profiled forward of ours and ours_chunked per case, rank 0's
GPU time in NCCL kernels, in compute kernels, and the time both ran at once.

Without a GPU, `--quick` runs two processes over gloo through Triton's interpreter at a tiny
fp32 shape to exercise the code; the timings mean nothing.
"""
from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from ..device import interpreter_active
from ..moe.reference import fused_moe_torch, gated_activation_torch, moe_route_torch
from . import common
from .timing import Timing, speedup_interval

# name: (E, top_k, H, I, shared experts (width S I), renormalize the top-k weights)
SHAPES = {
    "qwen3-30b-a3b": (128, 8, 2048, 768, 0, True),
    "deepseek-v2-lite": (64, 6, 2048, 1408, 2, False),
}
TINY_SHAPE = {"tiny": (8, 2, 64, 32, 1, True)}
TOKENS = (4096, 16384)
QUICK_TOKENS = (4096,)
EP_SIZES = (1, 2, 4, 8)
IMPLS = ("ours", "ours_chunked", "ours_capacity", "reference")
CHUNK_TOKENS = 4096
MODES = ("fwd", "fwd+bwd")
CAPACITY_FACTOR = 1.25
REFERENCE_TOKENS = 128
WARMUP_CALLS = 3


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--gpus", type=int, default=None,
                        help="processes to start under torchrun (default: every GPU; 2 on the CPU)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None, help="default: all")
    parser.add_argument("--tokens", nargs="+", type=int, default=None,
                        help=f"tokens per rank (default: {' '.join(map(str, TOKENS))})")
    parser.add_argument("--ep", nargs="+", type=int, default=None,
                        help="EP sizes, each dividing the world size (default: 1 2 4 8 up to the world size)")
    parser.add_argument("--modes", nargs="+", choices=MODES, default=list(MODES))
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(IMPLS))
    parser.add_argument("--iters", type=int, default=10, help="calls per timing")


def run(args) -> dict | None:
    """Under torchrun: measure (the results on rank 0, None elsewhere); otherwise start torchrun."""
    if "RANK" not in os.environ:
        return _launch(args)
    on_gpu = torch.cuda.is_available()
    if not on_gpu and not (args.quick and interpreter_active()):
        raise SystemExit("bench ep needs CUDA GPUs; without one, --quick with TRITON_INTERPRET=1 runs a tiny "
                         "shape through Triton's interpreter over gloo to exercise the code")
    if on_gpu:
        local_rank = int(os.environ["LOCAL_RANK"])
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
        dist.init_process_group("nccl", device_id=device)
    else:
        device = torch.device("cpu")
        dist.init_process_group("gloo")
    try:
        return _measure_all(args, device)
    finally:
        dist.destroy_process_group()


def _launch(args) -> None:
    gpus = args.gpus or (torch.cuda.device_count() if torch.cuda.is_available() else 2)
    if gpus < 1:
        raise SystemExit(f"--gpus must be at least 1, got {gpus}")
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={gpus}",
               "-m", "flashmoe_science", *args.argv]
    print("running " + " ".join(command[2:]), file=sys.stderr)
    code = subprocess.run(command).returncode
    if code:
        raise SystemExit(f"bench ep under torchrun failed (exit code {code})")
    return None


def _measure_all(args, device) -> dict | None:
    rank, world = dist.get_rank(), dist.get_world_size()
    on_gpu = device.type == "cuda"
    if on_gpu:
        shapes = {name: SHAPES[name] for name in (args.shapes or SHAPES)}
        tokens = args.tokens or (QUICK_TOKENS if args.quick else TOKENS)
        dtype = torch.bfloat16
    else:
        shapes, tokens, dtype = dict(TINY_SHAPE), args.tokens or (16,), torch.float32
    sizes = args.ep or [e for e in EP_SIZES if e <= world]
    bad = [e for e in sizes if e < 1 or world % e]
    if bad:
        raise SystemExit(f"--ep sizes must divide the world size {world}, got {bad}")
    groups = {e: dist.new_subgroups(group_size=e)[0] for e in sizes}
    iters = args.iters if on_gpu else 1
    rows, overlap = [], []
    cases = [(name, T, e, mode) for name in shapes for T in tokens for e in sizes for mode in args.modes]
    show = args.progress if rank == 0 else (lambda it, desc="": it)
    for name, T, e, mode in show(cases, "bench ep"):
        shape = shapes[name]
        generator = torch.Generator(device).manual_seed(1000 + rank)
        full = _full_layer(shape, dtype, device)
        x = torch.randn(T, full.hidden_size, device=device, dtype=dtype, generator=generator)
        grad_out = torch.randn(T, full.hidden_size, device=device, dtype=dtype, generator=generator)
        expected = _float64_forward(full, x)
        impls = _implementations(full, groups[e], e, T, args.impls)
        del full
        timed = {}
        for impl, (layer, forward) in impls.items():
            with torch.no_grad():
                out = forward(x)
            errors = {"rel_error": _largest(common.rel_error(out[:REFERENCE_TOKENS], expected), device)}
            del out
            if getattr(layer, "rows_received", None) is not None and impl != "reference":
                errors["rows_received_max_over_mean"] = _rows_imbalance(layer.rows_received, device)
            call = _training_call(layer, forward, x, grad_out) if mode == "fwd+bwd" else _inference_call(forward, x)
            timing = _time(call, iters, args.repeats, device)
            timed[impl] = timing
            row = {"shape": name, "mode": mode, "tokens_per_rank": T, "ep": e, "world": world, "impl": impl,
                   "dtype": str(dtype).replace("torch.", ""), "ms": timing.median_ms,
                   "ms_ci": [timing.lo_ms, timing.hi_ms], "tokens_per_s_per_gpu": T / timing.median_ms * 1e3,
                   **errors}
            if impl == "ours_capacity":
                row["capacity"] = layer.capacity
                row["dropped"] = _largest(layer.dropped_assignments.item() / (T * layer.top_k), device)
            rows.append(row)
        _compare(rows[-len(impls):], timed)
        if mode == "fwd" and on_gpu:
            overlap += [{"shape": name, "tokens_per_rank": T, "ep": e, "impl": impl, **_overlap(forward, x)}
                        for impl, (_, forward) in impls.items() if impl in ("ours", "ours_chunked")]
        del impls
        if rank == 0:
            args.checkpoint(rows)
    _weak_scaling(rows)
    if rank != 0:
        return None
    return {"name": "ep", "rows": rows,
            "meta": {"world": world, "iters": iters, "capacity_factor": CAPACITY_FACTOR,
                     "reference_tokens": REFERENCE_TOKENS, "shapes": {k: list(v) for k, v in shapes.items()},
                     "backend": dist.get_backend(), "overlap": overlap}}


def _full_layer(shape, dtype, device):
    """The unsharded layer, the same on every rank (seeded), weights ~ N(0, 1/fan_in)."""
    from ..layers import FlashMoELayer

    E, k, H, I, shared, renormalize = shape
    torch.manual_seed(0)
    return FlashMoELayer(H, E, I, top_k=k, renormalize=renormalize, num_shared_experts=shared, dtype=dtype,
                         device=device)


def _float64_forward(full, x) -> torch.Tensor:
    """The unsharded layer in float64 on the first REFERENCE_TOKENS tokens, routed from the bf16
    logits that every implementation computes (the router over all of x, as theirs run)."""
    with torch.no_grad():
        logits = full.router(x)[:REFERENCE_TOKENS].double()
        rows = x[:REFERENCE_TOKENS].double()
        out = fused_moe_torch(rows, full.w1.double(), full.w2.double(), logits, full.top_k,
                              renormalize=full.renormalize, activation=full.activation)
        if full.shared_w1 is not None:
            gate, up = torch.nn.functional.linear(rows, full.shared_w1.double()).chunk(2, dim=-1)
            out += torch.nn.functional.linear(gated_activation_torch(gate, up, full.activation), full.shared_w2.double())
    return out


def _implementations(full, group, e, T, names) -> dict:
    """name: (the module whose parameters train, its forward on this rank's tokens)."""
    from ..parallel import shard_experts

    impls = {}
    if "ours" in names or "reference" in names:
        ours = shard_experts(full, group)
        if "ours" in names:
            impls["ours"] = (ours, ours)
    if "ours_chunked" in names:
        chunked = shard_experts(full, group, chunk_tokens=CHUNK_TOKENS)
        impls["ours_chunked"] = (chunked, chunked)
    if "ours_capacity" in names:
        capped = shard_experts(full, group, capacity=math.ceil(CAPACITY_FACTOR * T * full.top_k / e))
        impls["ours_capacity"] = (capped, capped)
    if "reference" in names:
        impls["reference"] = (ours, lambda x, layer=ours: reference_forward(layer, x))
    return impls


def reference_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """torchtitan's expert-parallel token dispatcher on `layer`'s parameters (an
    ExpertParallelMoE; a group of one exchanges nothing): PyTorch routing, all_to_all of the per-expert counts (the one host
    synchronisation), of the rows sorted by expert, the received rows permuted from source order
    to expert order, torch._grouped_mm for both expert matmuls, back, all_to_all back, the
    weighted sum, then the shared experts."""
    group = layer.group or dist.group.WORLD
    W, L, k = layer.world_size, layer.local_experts, layer.top_k

    def exchange(t, output_sizes, input_sizes):
        return t if W == 1 else funcol.all_to_all_single_autograd(t, output_sizes, input_sizes, group)

    weights, ids = moe_route_torch(layer.router(x), k, renormalize=layer.renormalize)
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.histc(flat.float(), bins=layer.num_experts, min=0, max=layer.num_experts).long()  # no sync
    received_counts = exchange(counts, None, None).view(W, L)  # (source, local expert)
    send, recv = counts.view(W, L).sum(1).tolist(), received_counts.sum(1).tolist()
    received = exchange(x[order // k], recv, send)
    local_ids = torch.repeat_interleave(torch.arange(L, device=x.device).repeat(W), received_counts.reshape(-1),
                                        output_size=sum(recv))
    by_expert = torch.argsort(local_ids, stable=True)
    offsets = torch.cumsum(received_counts.sum(0), 0).to(torch.int32)
    h = torch._grouped_mm(received[by_expert], layer.w1.transpose(1, 2), offs=offsets)
    gate, up = h.chunk(2, dim=-1)
    y = torch._grouped_mm(gated_activation_torch(gate, up, layer.activation), layer.w2.transpose(1, 2), offs=offsets)
    returned = exchange(y[torch.argsort(by_expert)], send, recv)
    out = (returned[torch.argsort(order)].view(-1, k, layer.hidden_size) * weights.unsqueeze(-1).to(x.dtype)).sum(1)
    return out if layer.shared_w1 is None else out + layer._shared(x)


def _inference_call(forward, x):
    def call():
        with torch.no_grad():
            forward(x)
    return call


def _training_call(layer, forward, x, grad_out):
    x = x.detach().requires_grad_()
    inputs = [x, *(p for p in layer.parameters() if p.requires_grad)]

    def call():
        torch.autograd.grad(forward(x), inputs, grad_out)
    return call


def _time(call, iters: int, repeats: int, device) -> Timing:
    """`repeats` timings of `iters` calls each, started together on every rank after a
    barrier, each the slowest rank's milliseconds per call."""
    for _ in range(WARMUP_CALLS):
        call()
    samples = []
    for _ in range(repeats):
        dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                call()
            end.record()
            end.synchronize()
            ms = start.elapsed_time(end) / iters
        else:
            begin = time.perf_counter()
            for _ in range(iters):
                call()
            ms = (time.perf_counter() - begin) * 1e3 / iters
        samples.append(_largest(ms, device))
    return Timing.from_samples(samples)


def _rows_imbalance(rows: int, device) -> float:
    """The most rows any rank's experts computed over the mean across ranks (1: an even load; the
    slowest rank sets every exchange's pace)."""
    total = torch.tensor([float(rows)], dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return _largest(rows, device) / max(total.item() / dist.get_world_size(), 1.0)


def _largest(value: float, device) -> float:
    """The largest `value` over all ranks."""
    t = torch.tensor([float(value)], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _compare(rows, timed) -> None:
    """Each row's speedup against the reference of the same case (with its interval), and the
    reference's own error on the same tokens."""
    if "reference" not in timed:
        return
    reference = next(r for r in rows if r["impl"] == "reference")
    for row in rows:
        row["torch_rel_error"] = reference["rel_error"]
        if row["impl"] != "reference":
            ratio, lo, hi = speedup_interval(timed[row["impl"]], timed["reference"])
            row["speedup_vs_reference"], row["speedup_vs_reference_ci"] = ratio, [lo, hi]


def _weak_scaling(rows) -> None:
    """tokens/s per GPU at each EP size over that at EP 1 of the same case."""
    single = {(r["shape"], r["mode"], r["tokens_per_rank"], r["impl"]): r["tokens_per_s_per_gpu"]
              for r in rows if r["ep"] == 1}
    for r in rows:
        base = single.get((r["shape"], r["mode"], r["tokens_per_rank"], r["impl"]))
        if base:
            r["weak_scaling"] = r["tokens_per_s_per_gpu"] / base


def _overlap(forward, x) -> dict:
    """One profiled forward (already warm): rank 0's GPU milliseconds in NCCL kernels, in the
    other kernels, and the time both kinds ran at once (on different streams)."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    dist.barrier()
    with profile(activities=[ProfilerActivity.CUDA]) as prof, torch.no_grad():
        forward(x)
        torch.cuda.synchronize()
    nccl, compute = [], []
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA and event.time_range.end > event.time_range.start:
            span = (event.time_range.start, event.time_range.end)
            (nccl if "nccl" in event.name.lower() else compute).append(span)
    nccl, compute = _union(nccl), _union(compute)
    both = sum(max(0, min(a_end, b_end) - max(a_start, b_start))
               for a_start, a_end in nccl for b_start, b_end in compute)
    return {"nccl_ms": sum(e - s for s, e in nccl) / 1e3, "compute_ms": sum(e - s for s, e in compute) / 1e3,
            "overlapped_ms": both / 1e3}


def _union(spans):
    """Sorted disjoint intervals covering `spans`."""
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def summarize(result: dict) -> str:
    lines = [f"{'shape':<18} {'mode':<8} {'T/rank':>7} {'EP':>3} {'impl':<14} {'ms':>8} {'tok/s/GPU':>10} "
             f"{'vs ref':>7} {'weak':>6} {'rel err':>9}"]
    for r in result["rows"]:
        lines.append(f"{r['shape']:<18} {r['mode']:<8} {r['tokens_per_rank']:>7} {r['ep']:>3} {r['impl']:<14} "
                     f"{r['ms']:>8.3f} {r['tokens_per_s_per_gpu']:>10.0f} "
                     f"{r.get('speedup_vs_reference', float('nan')):>7.2f} {r.get('weak_scaling', float('nan')):>6.2f} "
                     f"{r['rel_error']:>9.2e}")
    for o in result["meta"]["overlap"]:
        lines.append(f"overlap {o['shape']} T {o['tokens_per_rank']} EP {o['ep']} {o['impl']}: NCCL {o['nccl_ms']:.3f} ms, "
                     f"compute {o['compute_ms']:.3f} ms, both at once {o['overlapped_ms']:.3f} ms")
    return "\n".join(lines)
