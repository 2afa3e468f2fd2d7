"""Time candidate KV-cache (decode) configurations on a GPU, to tune `configs.DECODE` and the
tile and split rules (`configs.decode_schedule`).

    python -m flashmoe_science.bench.sweeps.attention_decode [--quick] [--cases SET] [--out DIR]

For each case (batch, cached length, heads, head dim, page size; bf16, one new token) it times,
in two phases:
1. the table's tile (what the dispatcher, `DecodePlan`, picks for the call), then every other
   (`decode_candidates`: keys per block, warps, stages), with the table's split count,
   forced through `DecodePlan(config=...)`;
2. the table's tile, and the fastest of phase 1 where that is another, with each split count
   from 1 up to what the cache allows (the split heuristic is tuned for the table's tile).
Each row holds the GPU time per call of a CUDA graph of calls, each against its own cache
(enough layers that the L2 holds none of the next; no host time, no launch gaps, which leave
single eager calls tens of percent apart from run to run), and the fraction of the copy bandwidth
measured in the same run (the bytes of K and V read over the time), and the candidate's error
against the table configuration's output. Rows go to DIR/attention_decode_sweep.json; the best
tile and split count per case are printed.
"""
from __future__ import annotations

import argparse
import sys
from itertools import product

import torch

from ...attention.configs import AttentionConfig, head_dim_block
from ...attention.decode import DecodePlan, launch_decode
from ...device import SHARED_MEMORY_PER_BLOCK, info_for
from ..attention_decode import graph_us_per_call, paged_copy
from ..common import environment, measure_copy_bandwidth, progress, rel_error, write_results

# (batch, cached length, Hq, Hkv, head dim, page size): serving's regimes, one long sequence to
# many short ones, GQA and MHA, contiguous and paged (each head dim and page size compiles every
# tile anew, so the cases keep to two).
CASES = ((1, 4096, 32, 8, 128, 0), (1, 65536, 32, 8, 128, 0), (8, 8192, 32, 8, 128, 0), (20, 4096, 32, 8, 128, 0),
         (24, 4096, 32, 8, 128, 0), (32, 4096, 32, 8, 128, 0),
         (64, 4096, 32, 8, 128, 0), (128, 2048, 32, 8, 128, 0), (8, 8192, 32, 32, 128, 0), (8, 8192, 32, 8, 128, 16),
         (64, 4096, 32, 8, 128, 16))
# Head dim 64 (`--cases d64`), where the table's tile doubles BLOCK_N to keep D = 128's bytes a
# step: the bandwidth-bound rows of the decode benchmark, one long sequence to many short ones.
D64_CASES = ((1, 131072, 32, 8, 64, 0), (1, 32768, 32, 8, 64, 0), (8, 8192, 32, 8, 64, 0), (32, 4096, 32, 8, 64, 0),
             (32, 1024, 32, 8, 64, 0), (128, 1024, 32, 8, 64, 0))
# Qwen3-30B-A3B's attention (`--cases hkv4`): eight query heads a KV head, so half the (sequence, KV
# head) tiles of Hkv 8 at the same batch, each of eight query rows; one sequence to many, the
# shapes of the decode benchmark's CUDA-graph rows for that model.
HKV4_CASES = ((1, 4096, 32, 4, 128, 0), (8, 4096, 32, 4, 128, 0), (32, 4096, 32, 4, 128, 0),
              (1, 32768, 32, 4, 128, 0), (32, 4096, 32, 4, 128, 16))
# Latency-bound calls (`--cases short`): one to eight sequences of 1k-16k keys, where the split
# count trades programs against each split's fixed cost and the combine's partials.
SHORT_CASES = ((1, 1024, 32, 8, 64, 0), (1, 4096, 32, 8, 64, 0), (1, 1024, 32, 8, 128, 0), (1, 8192, 32, 8, 128, 0),
               (1, 8192, 32, 4, 128, 0), (1, 16384, 32, 4, 128, 0), (8, 1024, 32, 8, 128, 0), (1, 4096, 32, 32, 128, 0))
# The stream regime's calls (`--cases stream`, `configs.DECODE_STREAM_TILES`): tiles filling 70% of
# the SMs to two an SM, in one split, and few tiles over long caches split for a program an SM.
STREAM_CASES = ((12, 4096, 32, 8, 128, 0), (24, 4096, 32, 8, 128, 0), (32, 4096, 32, 4, 128, 0),
                (32, 4096, 32, 8, 128, 0), (16, 4096, 32, 8, 64, 0), (32, 4096, 32, 8, 64, 0),
                (1, 65536, 32, 8, 128, 0), (1, 131072, 32, 8, 64, 0), (8, 8192, 32, 8, 64, 0))
CASE_SETS = {"d128": (CASES, "attention_decode_sweep"), "d64": (D64_CASES, "attention_decode_sweep_d64"),
             "hkv4": (HKV4_CASES, "attention_decode_sweep_hkv4"),
             "short": (SHORT_CASES, "attention_decode_sweep_short"),
             "stream": (STREAM_CASES, "attention_decode_sweep_stream")}
# K and V bytes of a timed graph's layers together, at most GRAPH_LAYERS layers: enough that the
# graph's fixed cost is a small share of each call, as in the decode benchmark's 32-layer graphs
# (with 1-3 layers of these sizes, calls measured 5-10% longer).
GRAPH_BYTES = 4 << 30
GRAPH_LAYERS = 32
MAX_REL_DIFF = 1e-2  # a candidate whose output differs more from the table's is wrong, not fast


def decode_candidates(family: int, element_size: int, block_d: int, block_m: int):
    """Tiles worth timing: keys per block 32 to 256, 2 to 8 warps, 2 to 4 stages, kept where one
    K and one V tile per stage (and the query tile) fit the family's shared memory."""
    budget = SHARED_MEMORY_PER_BLOCK[family] - 8 * 1024
    for block_n, warps, stages in product((32, 64, 128, 256), (2, 4, 8), (2, 3, 4)):
        if element_size * block_d * (2 * block_n * stages + block_m) <= budget:
            yield AttentionConfig(block_m, block_n, warps, stages)


def sweep(cases=CASES, dtype=torch.bfloat16, device="cuda", checkpoint=lambda rows: None) -> list[dict]:
    """The rows of every case; `checkpoint(rows)` after each case (a run stopped early keeps them)."""
    rows = []
    copy_tbps = measure_copy_bandwidth()
    for batch, seqlen, heads_q, heads_kv, dim, page_size in progress(cases, desc="decode sweep"):
        q = torch.randn(batch, 1, heads_q, dim, dtype=dtype, device=device)
        k_cache, v_cache = (torch.randn(batch, seqlen, heads_kv, dim, dtype=dtype, device=device) for _ in range(2))
        table = None
        if page_size:
            k_cache, v_cache, table = paged_copy(k_cache, v_cache, page_size)
        lengths = torch.full((batch,), seqlen, dtype=torch.int32, device=device)
        floor_ms = 2 * k_cache.numel() * k_cache.element_size() / (copy_tbps * 1e12) * 1e3
        case = dict(batch=batch, seqlen=seqlen, heads_q=heads_q, heads_kv=heads_kv, head_dim=dim,
                    page_size=page_size, floor_us=floor_ms * 1e3)
        block_d = head_dim_block(dim)
        table_cfg = DecodePlan(q, k_cache, table, True, (-1, -1), 0).config  # what the dispatcher picks

        def run(cfg, splits, k=k_cache, v=v_cache):
            plan = DecodePlan(q, k, table, True, (-1, -1), splits, config=cfg)
            out = torch.empty_like(q)
            launch_decode(plan, None, q, k, v, out, None, lengths, table, 0, None, 0.0)
            return plan, out

        layer_bytes = 2 * k_cache.numel() * k_cache.element_size()
        layers = max(1, min(GRAPH_LAYERS, GRAPH_BYTES // layer_bytes))
        caches = [(k_cache, v_cache)] + [(torch.randn_like(k_cache), torch.randn_like(v_cache))
                                         for _ in range(layers - 1)]

        table_plan, reference = run(table_cfg, 0)

        def timed(phase, cfg, splits):
            row = dict(case, phase=phase, block_n=cfg.block_n, warps=cfg.num_warps, stages=cfg.num_stages,
                       table_config=cfg == table_cfg)
            try:
                plan, out = run(cfg, splits)
                us = graph_us_per_call(lambda k, v: run(cfg, splits, k, v), caches, warmup_ms=5, rep_ms=20,
                                       repeats=3)
            except Exception as exc:  # a candidate that does not fit this GPU
                row.update(splits=splits, error=f"{type(exc).__name__}: {exc}"[:200])
            else:
                row.update(splits=plan.num_splits, table_splits=table_plan.num_splits, us=us, graph_layers=layers,
                           copy_fraction=floor_ms * 1e3 / us, rel_diff_vs_table=rel_error(out, reference))
            rows.append(row)
            return row

        candidates = [c for c in decode_candidates(info_for(q).arch_family, q.element_size(), block_d,
                                                   table_cfg.block_m) if c != table_cfg]
        tiles = [timed("tile", cfg, 0) for cfg in (table_cfg, *candidates)]
        good = [r for r in tiles if "us" in r and r["rel_diff_vs_table"] < MAX_REL_DIFF]
        best = min(good, key=lambda r: r["us"])
        best_cfg = AttentionConfig(table_cfg.block_m, best["block_n"], best["warps"], best["stages"])
        for cfg in dict.fromkeys((table_cfg, best_cfg)):  # what ships, and the fastest tile if another
            most = -(-seqlen // cfg.block_n)
            for splits in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96, 128):
                if splits <= most:
                    timed("splits", cfg, splits)
        checkpoint(rows)
    return rows


def best_per_case(rows) -> list[str]:
    lines = []
    keys = ("batch", "seqlen", "heads_q", "heads_kv", "head_dim", "page_size")
    for case in dict.fromkeys(tuple(r[k] for k in keys) for r in rows):
        group = [r for r in rows if tuple(r[k] for k in keys) == case and "us" in r and
                 r["rel_diff_vs_table"] < MAX_REL_DIFF]
        table = next(r for r in group if r["table_config"] and r["phase"] == "tile")
        best = min(group, key=lambda r: r["us"])
        lines.append(f"B={case[0]} Sk={case[1]} Hq={case[2]} Hkv={case[3]} D={case[4]} page={case[5]}: table "
                     f"{table['us']:.1f} us ({table['copy_fraction']:.0%} of copy, {table['splits']} splits), best "
                     f"{best['us']:.1f} us ({best['copy_fraction']:.0%}) with BLOCK_N={best['block_n']} "
                     f"warps={best['warps']} stages={best['stages']} splits={best['splits']}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one case")
    parser.add_argument("--cases", choices=tuple(CASE_SETS), default="d128",
                        help="d128: head dim 128, GQA and MHA, contiguous and paged (default); d64: head dim 64; "
                             "hkv4: Qwen3-30B-A3B's 32 query and 4 KV heads; short: latency-bound calls; "
                             "stream: the stream regime's calls")
    parser.add_argument("--out", default="out/results")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("the decode sweep times GPU kernels; no GPU here", file=sys.stderr)
        return 2
    meta = {"environment": environment()}
    cases, name = CASE_SETS[args.cases]
    rows = sweep(cases[:1] if args.quick else cases,
                 checkpoint=lambda rows: write_results(args.out, name, rows, meta))
    print("\n".join(best_per_case(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
