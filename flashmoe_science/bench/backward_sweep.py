"""Time the candidate attention-backward configurations on a GPU, to tune `configs.BACKWARD`.

    python -m flashmoe_science.bench.backward_sweep [--head-dims 64,128,256] [--seqlens 4096]
                                                    [--window W] [--dq-paths P,...] [--gluon] [--out DIR]

For each head dim, sequence length and causal flag, at the throughput benchmark's shapes (16k
tokens per batch, Hq * D = 2048, bf16, (B, S, H, D) layout), it times the backward alone
(preprocess, dK/dV and dQ kernels) of the table's configuration and of every alternative
`backward_candidates` proposes, each forced through `attention_backward(config=...)`. TFLOP/s
count 2.5x the forward FLOPs, and each candidate's gradients are compared with the table
configuration's. The rows go to DIR/attention_backward_sweep.{json,csv}; the best correct
configuration per case is printed in the table's notation. Each candidate compiles once (a few
seconds); the causal flag does not recompile. With --window W the cases are causal sliding-window
calls of left window W instead (window_size=(W, 0)), written to attention_backward_sweep_windowW.
With --dq-paths only the table's configuration and the candidates of those dQ paths run
(`BackwardConfig.dq_path`), written to a file named after them (attention_backward_sweep_dq_tma).
With --gluon the table's configuration and the Gluon kernels' candidates run (sm90, 16-bit),
written to attention_backward_sweep_gluon; with --gluon --dq-paths tma, the split Gluon kernels'
table entry and the fused Gluon kernel's candidates (attention_backward_sweep_gluon_dq_tma).
"""
from __future__ import annotations

import argparse
import itertools
import sys

import torch

from ..attention.configs import (GLUON_BACKWARD, backward_candidates, gluon_backward_candidates,
                                 gluon_fused_backward_candidates, head_dim_block)
from ..attention.interface import attention_backward, attention_forward
from ..device import info_for
from .common import attention_flops, environment, progress, rel_error, time_gpu, write_results

TOKENS = 16384
HIDDEN = 2048  # Hq * D
MAX_REL_DIFF = 1e-2  # a candidate whose gradients differ more from the table's is wrong, not fast


def sweep(head_dims=(64, 128, 256), seqlens=(4096,), causals=(False, True), dtype=torch.bfloat16,
          device="cuda", tokens=TOKENS, window=None, hidden=HIDDEN, dq_paths=None, gluon=False) -> list[dict]:
    """One row per (head dim, sequence length, causal, candidate): ms and TFLOP/s, or the error
    that kept the candidate from running (such as too little shared memory). With `window`, the
    calls are causal with that left window (`causals` is ignored). `dq_paths` limits the
    candidates to those dQ paths (`configs.backward_candidates`); `gluon` times the table's
    configuration and the Gluon kernels' candidates (`configs.gluon_backward_candidates`) instead."""
    rows = []
    window_size = (-1, -1) if window is None else (window, 0)
    cases = list(itertools.product(head_dims, seqlens, causals if window is None else (True,)))
    for head_dim, seqlen, causal in progress(cases, desc="backward sweep"):
        heads, batch = hidden // head_dim, max(1, tokens // seqlen)
        q, k, v, grad_out = (torch.randn(batch, seqlen, heads, head_dim, dtype=dtype, device=device).transpose(1, 2)
                             for _ in range(4))
        out, lse = attention_forward(q, k, v, causal, None, True, window_size=window_size)
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal, "bwd", window_size)
        family = info_for(q).arch_family
        table_grads = None

        def backward(cfg):
            return attention_backward(grad_out, q, k, v, out, lse, causal, None, window_size, config=cfg)

        candidates = backward_candidates(family, q.element_size(), head_dim_block(head_dim), dq_paths)
        if gluon:
            block_d = head_dim_block(head_dim)
            if dq_paths is not None and "tma" in dq_paths:  # the fused kernel, after the split one
                extra = [c for c in (GLUON_BACKWARD.get(block_d),) if c] + gluon_fused_backward_candidates(block_d)
            else:
                extra = list(gluon_backward_candidates(block_d))
            candidates = [next(candidates), *extra]
        for rank, cfg in enumerate(candidates):
            row = dict(head_dim=head_dim, seqlen=seqlen, causal=causal, window=window, table_config=rank == 0,
                       config=str(cfg), dkdv=_fields(cfg.dkdv), dq=_fields(cfg.dq), dq_path=cfg.dq_path,
                       gluon=cfg.gluon)
            try:
                grads = backward(cfg)
                t = time_gpu(lambda: backward(cfg), warmup_ms=5, rep_ms=25, repeats=1)
            except Exception as exc:  # a candidate that does not fit this GPU
                row.update(error=f"{type(exc).__name__}: {exc}"[:200])
            else:
                table_grads = table_grads or grads
                # Every configuration sums in its own order, so results differ by rounding only.
                row.update(ms=t.median_ms, tflops=flops / (t.median_ms * 1e-3) / 1e12,
                           rel_diff_vs_table=max(rel_error(g, ref) for g, ref in zip(grads, table_grads)))
            rows.append(row)
    return rows


def _fields(cfg) -> tuple:
    return cfg.block_m, cfg.block_n, cfg.num_warps, cfg.num_stages


def _case(row) -> tuple:
    return row["head_dim"], row["seqlen"], row["causal"]


def _notation(row) -> str:
    path = row.get("dq_path", "kernel")
    options = ("" if path == "kernel" else f", {path!r}") + (", tma=True, gluon=True" if row.get("gluon") else "")
    return f"B(C{tuple(row['dkdv'])}, C{tuple(row['dq'])}{options})"


def best_per_case(rows) -> list[str]:
    """A line per case: the table's TFLOP/s and the fastest candidate's, in the table's notation."""
    lines = []
    for case, group in itertools.groupby(sorted(rows, key=_case), key=_case):
        timed = [r for r in group if "tflops" in r and r["rel_diff_vs_table"] < MAX_REL_DIFF]
        if not timed:
            continue
        best = max(timed, key=lambda r: r["tflops"])
        table = next((r for r in timed if r["table_config"]), None)
        table_text = f"{table['tflops']:.0f}" if table else "failed"
        lines.append(f"D={case[0]} S={case[1]} causal={case[2]}: table {table_text} TFLOP/s, best "
                     f"{best['tflops']:.0f} with {_notation(best)}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--head-dims", default="64,128,256")
    parser.add_argument("--seqlens", default="4096")
    parser.add_argument("--window", type=int, default=None, help="causal sliding-window calls of this left window")
    parser.add_argument("--dq-paths", default=None,
                        help="comma-separated dQ paths to sweep (kernel, atomic, tma; default all this GPU runs)")
    parser.add_argument("--gluon", action="store_true", help="time the Gluon kernels' candidates (sm90)")
    parser.add_argument("--out", default="out/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the backward sweep times GPU kernels; no GPU here", file=sys.stderr)
        return 2
    rows = sweep(tuple(int(x) for x in args.head_dims.split(",")), tuple(int(x) for x in args.seqlens.split(",")),
                 window=args.window, dq_paths=None if args.dq_paths is None else tuple(args.dq_paths.split(",")),
                 gluon=args.gluon)
    name = "attention_backward_sweep" + ("_gluon" if args.gluon else "") + (
        "" if args.window is None else f"_window{args.window}")
    if args.dq_paths is not None:
        name += "_dq_" + args.dq_paths.replace(",", "_")
    write_results(args.out, name, rows, {"environment": environment()})
    print("\n".join(best_per_case(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
