"""Where an expert-parallel call's time goes: a torch.profiler trace (host and GPU) of a few warm
calls of `shard_experts` on each rank, for maintainers reading why EP > 1 loses to EP 1.

    torchrun --nproc-per-node N -m flashmoe_science.bench.sweeps.ep_trace [--shape S] [--tokens T]
        [--mode fwd|fwd+bwd] [--out DIR]

Writes DIR/ep_trace_rank<r>.json.gz (Chrome trace format: open in Perfetto) and prints, for rank
0, the GPU busy time split into NCCL and other kernels, the GPU idle time within the calls, and
the host time the calls took.

    python -m flashmoe_science.bench.sweeps.ep_trace --read DIR/ep_trace_rank0.json.gz [--calls 3]

reads such a trace back (no GPU needed) and prints the middle call's GPU timeline: every kernel
or copy of at least MIN_US, and every gap of at least MIN_US before one, with its stream.
"""
from __future__ import annotations

import argparse
import gzip
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from ..ep import SHAPES, _full_layer, _training_call, _union

MIN_US = 20.0  # the timeline's threshold for kernels and gaps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=list(SHAPES), default="qwen3-30b-a3b")
    parser.add_argument("--tokens", type=int, default=4096, help="tokens per rank")
    parser.add_argument("--mode", choices=("fwd", "fwd+bwd"), default="fwd")
    parser.add_argument("--calls", type=int, default=3, help="calls traced")
    parser.add_argument("--out", default="out/ep_trace")
    parser.add_argument("--read", default=None, help="print the timeline of a trace this tool wrote")
    args = parser.parse_args()
    if args.read:
        print(timeline(args.read, args.calls))
        return
    if "RANK" not in os.environ or not torch.cuda.is_available():
        raise SystemExit("run under torchrun on a machine with GPUs (one process per GPU)")
    from torch.profiler import ProfilerActivity, profile

    from ...parallel import shard_experts

    device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(device)
    dist.init_process_group("nccl", device_id=device)
    rank = dist.get_rank()
    try:
        full = _full_layer(SHAPES[args.shape], torch.bfloat16, device)
        layer = shard_experts(full)
        del full
        x = torch.randn(args.tokens, layer.hidden_size, device=device, dtype=torch.bfloat16)
        if args.mode == "fwd+bwd":
            call = _training_call(layer, layer, x, torch.randn_like(x))
        else:
            def call():
                with torch.no_grad():
                    layer(x)
        for _ in range(3):
            call()
        torch.cuda.synchronize()
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(args.calls):
                call()
            torch.cuda.synchronize()
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        raw = out / f"ep_trace_rank{rank}.json"
        prof.export_chrome_trace(str(raw))
        with raw.open("rb") as src, gzip.open(f"{raw}.gz", "wb") as dst:
            shutil.copyfileobj(src, dst)
        raw.unlink()
        if rank == 0:
            kernels = [(e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                       if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > e.time_range.start]
            nccl = _union([(s, e) for s, e, name in kernels if "nccl" in name.lower()])
            busy = _union([(s, e) for s, e, _ in kernels])
            span = max(e for _, e, _ in kernels) - min(s for s, _, _ in kernels)
            print(f"{args.shape} {args.mode} T {args.tokens} EP {dist.get_world_size()}, {args.calls} calls: "
                  f"GPU span {span / 1e3:.2f} ms, busy {sum(e - s for s, e in busy) / 1e3:.2f} ms "
                  f"(NCCL {sum(e - s for s, e in nccl) / 1e3:.2f}), idle {(span - sum(e - s for s, e in busy)) / 1e3:.2f} ms")
            print(prof.key_averages().table(sort_by="cpu_time_total", row_limit=25))
    finally:
        dist.destroy_process_group()


def timeline(path: str, calls: int = 3) -> str:
    """The GPU timeline of the middle one of `calls` equal calls in a trace this tool wrote: one
    line per kernel or copy of at least MIN_US, or after a gap of at least MIN_US (start from the
    first GPU event of that call, duration, gap since the GPU was last busy, stream, name)."""
    import json

    with gzip.open(path, "rt") as f:
        events = json.load(f)["traceEvents"]
    gpu = sorted((e for e in events if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")),
                 key=lambda e: e["ts"])
    if not gpu:
        return f"{path}: no GPU events"
    rows, busy_until = [], None
    for e in gpu:
        gap = 0.0 if busy_until is None else max(0.0, e["ts"] - busy_until)
        rows.append((e["ts"], e["dur"], gap, e.get("args", {}).get("stream"), e["name"]))
        busy_until = e["ts"] + e["dur"] if busy_until is None else max(busy_until, e["ts"] + e["dur"])
    per_call = len(rows) // calls
    middle = rows[per_call * (calls // 2):per_call * (calls // 2 + 1)]
    start = middle[0][0]
    lines = [f"{path}: call {calls // 2 + 1} of {calls}, {len(middle)} GPU events, span "
             f"{(middle[-1][0] + middle[-1][1] - start) / 1e3:.2f} ms; events or gaps of at least {MIN_US:.0f} us:",
             f"{'start us':>9} {'dur us':>8} {'gap us':>7} stream  name"]
    for ts, dur, gap, stream, name in middle:
        if dur >= MIN_US or gap >= MIN_US:
            lines.append(f"{ts - start:9.1f} {dur:8.1f} {gap:7.1f} {str(stream):>6}  {name[:90]}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
