"""Time the candidate attention-backward configurations on a GPU, to tune `configs.BACKWARD`
and `configs.GLUON_BACKWARD`.

    python -m flashmoe_science.bench.sweeps.attention_backward [--head-dims 64,128,256]
        [--seqlens 4096] [--window W] [--gluon] [--out DIR]

For each head dim, sequence length and causal flag, at the throughput benchmark's shapes (16k
tokens per batch, Hq * D = 2048, bf16, (B, S, H, D) layout), it times the backward alone
(preprocess, dK/dV and dQ kernels) of the table's configuration and of every alternative
`backward_candidates` proposes, each forced through `attention_backward(config=...)`. TFLOP/s
count 2.5x the forward FLOPs, and each candidate's gradients are compared with the table
configuration's. The rows go to DIR/attention_backward_sweep.json; the best correct
configuration per case is printed in the table's notation. Each candidate compiles once (a few
seconds); the causal flag does not recompile. With --window W the cases are causal sliding-window
calls of left window W instead (window_size=(W, 0)), written to attention_backward_sweep_windowW.
With --gluon the table's configuration and the Gluon kernels' candidates run (sm90, 16-bit),
written to attention_backward_sweep_gluon.
"""
from __future__ import annotations

import argparse
import itertools
import sys
from itertools import product

import torch

from ...attention.backward import attention_backward
from ...attention.configs import BACKWARD, AttentionConfig, BackwardConfig, head_dim_block
from ...attention.forward import attention_forward
from ...device import SHARED_MEMORY_PER_BLOCK, info_for
from ...flops import attention_flops
from ..attention import HIDDEN, TOKENS
from ..common import environment, progress, rel_error, write_results
from ..timing import time_gpu

MAX_REL_DIFF = 1e-2  # a candidate whose gradients differ more from the table's is wrong, not fast


def backward_candidates(family: int, element_size: int, block_d: int):
    """Backward configurations worth timing for a padded head dim on a device family.

    For the "kernel" dQ path the two kernels run one after the other and are tuned
    independently: the candidates are the table's configuration with its dK/dV kernel replaced
    by each alternative, then with its dQ kernel replaced. Alternatives span the resident block
    (64, 128), the streamed block (32, 64, 128), 4 or 8 warps and 2 or 3 stages, keeping those
    whose shared memory (the resident pair plus one streamed pair per stage) fits and whose fp32
    tiles (accumulators and the two score tiles) stay at or below 192 registers per thread. At
    D = 256, where those limits leave few of them, blocks of 32 (resident) and 16 (streamed) rows
    are tried as well. The table's configuration comes first, and every candidate moves its
    tiles as the table's does (`tma`).
    """

    base = BACKWARD[family][element_size][block_d]
    budget = SHARED_MEMORY_PER_BLOCK[family] - 8 * 1024  # room for the compiler's conversion scratch
    if block_d >= 256:
        resident_blocks, streamed_blocks = (32, 64, 128), (16, 32, 64, 128)
    else:
        resident_blocks, streamed_blocks = (64, 128), (32, 64, 128)

    def alternatives(accumulators: int):
        for resident, streamed, warps, stages in product(resident_blocks, streamed_blocks, (4, 8), (2, 3)):
            smem = element_size * block_d * 2 * (resident + streamed * stages)
            tile_regs = resident * (accumulators * block_d + 2 * streamed) // (32 * warps)
            if smem <= budget and tile_regs <= 192:
                yield resident, streamed, warps, stages

    yield base
    for keys, rows, warps, stages in alternatives(accumulators=2):
        cfg = AttentionConfig(rows, keys, warps, stages)
        if cfg != base.dkdv:
            yield BackwardConfig(cfg, base.dq, tma=base.tma)
    for rows, keys, warps, stages in alternatives(accumulators=1):
        cfg = AttentionConfig(rows, keys, warps, stages)
        if cfg != base.dq:
            yield BackwardConfig(base.dkdv, cfg, tma=base.tma)


def gluon_backward_candidates(block_d: int):
    """Gluon backward configurations worth timing at a padded head dim (16-bit, sm90): the
    starting point, then one kernel varied at a time. The resident block is one warpgroup's 64
    rows, two warpgroups' 128, or 64 rows split between two warpgroups by columns (8 warps);
    streamed blocks of 32, 64 or 128 rows in 2 or 3 stages. Kept are those whose shared memory
    (the resident pair, one streamed pair per stage, room for layout conversions) fits an H100
    and whose fp32 tiles per thread (a warpgroup's share of the accumulators and of the two
    score tiles) stay at or below 192 registers, which compile without spilling."""

    budget = SHARED_MEMORY_PER_BLOCK[90] - 8 * 1024

    def fits(resident, streamed, warps, stages, accumulators):
        column_split = warps * 16 // resident  # warpgroups sharing one 64-row block by columns
        regs = 64 * (accumulators * block_d + 2 * streamed) // (128 * column_split)
        return 4 * block_d * (resident + streamed * stages) <= budget and regs <= 192

    def variants(accumulators):
        for (resident, warps), streamed, stages in product(((64, 4), (64, 8), (128, 8)), (32, 64, 128), (2, 3)):
            if fits(resident, streamed, warps, stages, accumulators):
                yield resident, streamed, warps, stages

    if block_d <= 128:
        base = BackwardConfig(AttentionConfig(64, 64, 4, 2), AttentionConfig(64, 64, 4, 2), tma=True, gluon=True)
    else:
        base = BackwardConfig(AttentionConfig(64, 64, 8, 2), AttentionConfig(128, 32, 8, 2), tma=True, gluon=True)
    yield base
    for resident, streamed, warps, stages in variants(accumulators=2):
        dkdv = AttentionConfig(streamed, resident, warps, stages)
        if dkdv != base.dkdv:
            yield BackwardConfig(dkdv, base.dq, tma=True, gluon=True)
    for resident, streamed, warps, stages in variants(accumulators=1):
        dq = AttentionConfig(resident, streamed, warps, stages)
        if dq != base.dq:
            yield BackwardConfig(base.dkdv, dq, tma=True, gluon=True)


def sweep(head_dims=(64, 128, 256), seqlens=(4096,), causals=(False, True), dtype=torch.bfloat16,
          device="cuda", tokens=TOKENS, window=None, hidden=HIDDEN, gluon=False, limit=None) -> list[dict]:
    """One row per (head dim, sequence length, causal, candidate): ms and TFLOP/s, or the error
    that kept the candidate from running (such as too little shared memory). With `window`, the
    calls are causal with that left window (`causals` is ignored). `gluon` times the table's
    configuration and the Gluon kernels' candidates (`gluon_backward_candidates`) instead.
    `limit`: at most this many candidates per case, the table's first (each compiles anew)."""
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

        candidates = backward_candidates(family, q.element_size(), head_dim_block(head_dim))
        if gluon:
            candidates = [next(candidates), *gluon_backward_candidates(head_dim_block(head_dim))]
        for rank, cfg in enumerate(itertools.islice(candidates, limit)):
            row = dict(head_dim=head_dim, seqlen=seqlen, causal=causal, window=window, table_config=rank == 0,
                       config=str(cfg), dkdv=_fields(cfg.dkdv), dq=_fields(cfg.dq), gluon=cfg.gluon)
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
    options = ", tma=True, gluon=True" if row.get("gluon") else ""
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
    parser.add_argument("--gluon", action="store_true", help="time the Gluon kernels' candidates (sm90)")
    parser.add_argument("--out", default="out/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the backward sweep times GPU kernels; no GPU here", file=sys.stderr)
        return 2
    rows = sweep(tuple(int(x) for x in args.head_dims.split(",")), tuple(int(x) for x in args.seqlens.split(",")),
                 window=args.window, gluon=args.gluon)
    name = "attention_backward_sweep" + ("_gluon" if args.gluon else "") + (
        "" if args.window is None else f"_window{args.window}")
    write_results(args.out, name, rows, {"environment": environment()})
    print("\n".join(best_per_case(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
