"""FP8 experts at decode sizes under candidate tilings, to choose `moe/configs.py`'s FP8 decode
entry: `fused_moe` with block-scaled FP8 weights, each tiling forced in turn (down BLOCK_N,
stages, warps), timed as CUDA-graph replays, its output compared bit for bit with the table's,
next to the 16-bit path's time on the same layer.

    python -m flashmoe_science.bench.sweeps.moe_fp8_decode [--shapes mixtral-8x7b ...] [--tokens 1 16]

Prints one line per case and tiling (the format of benchmarks/results/moe_fp8_decode_sweep.txt).
"""
from __future__ import annotations

import argparse
from dataclasses import replace

import torch

from ...device import info_for
from ...moe import configs, fp8, fused_moe
from ...moe.fp8 import quantize_fp8_blockwise
from ..moe import SHAPES
from ..timing import graph_replay, time_gpu

C = configs.FP8Config
# (BLOCK_M, GROUP_M, gate/up warps, down warps, stages, down BLOCK_N, ...). Below 64 rows Triton runs
# the products on sm90 as mma.sync with both FP8 operands converted to fp16 in registers each K step
# (their tilings, 3-6 stages, down tiles of 32-128 columns, 4 or 8 warps, were swept on an H100:
# benchmarks/results/moe_fp8_decode_sweep.txt); swap_ab puts the weight tile on the MMA's M side, so
# they run as FP8 wgmma from shared memory with the token rows as N. BLOCK_M 64 in the plain order
# (FP8 wgmma, 63 of 64 rows padding at T = 1) measured 0-13% slower than the table at T = 1-64 but
# for Mixtral-8x7B at T = 64 (benchmarks/results/moe_fp8_decode_swap_ab/sweep_block_m64.txt).
# down_split_k: more down programs where a few experts hold the work (Mixtral-8x7B's 14336-wide K).
CANDIDATES = ([C(16, 1, 8, 4, 4, 64), C(16, 1, 4, 4, 4, 128)]
              + [C(16, 1, warps, 4, stages, n, swap_ab=True)
                 for warps in (4, 8) for stages in (4, 6) for n in (64, 128)]
              + [C(16, 1, 4, 4, stages, n, swap_ab=True, down_split_k=split)
                 for split in (2, 4) for stages in (4, 6) for n in (64, 128)]
              + [C(32, 1, 8, 4, stages, n, swap_ab=True) for stages in (3, 4) for n in (64, 128)])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shapes", nargs="+", default=["mixtral-8x7b", "qwen3-30b-a3b", "deepseek-v2-lite"],
                        choices=list(SHAPES))
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 16])
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("the sweep times kernels on a GPU")
    table = configs.fp8_config
    try:
        for name in args.shapes:
            _sweep_shape(name, SHAPES[name], args.tokens, table)
    finally:
        configs.fp8_config = table
        fp8.PLANS.clear()


def layer_weights(shape):
    """(generator, w1, w2 in bf16, (q1, s1), (q2, s2): their block-FP8 forms) of a layer of `shape`
    (E, k, H, I), seeded alike on every call."""
    E, k, H, I = shape
    g = torch.Generator(device="cuda").manual_seed(0)
    w1 = (torch.randn(E, 2 * I, H, device="cuda", generator=g) * H**-0.5).to(torch.bfloat16)
    w2 = (torch.randn(E, H, I, device="cuda", generator=g) * I**-0.5).to(torch.bfloat16)
    return g, w1, w2, quantize_fp8_blockwise(w1), quantize_fp8_blockwise(w2)


def _sweep_shape(name, shape, tokens, table) -> None:
    E, k, H, I = shape
    g, w1, w2, (q1, s1), (q2, s2) = layer_weights(shape)
    for T in tokens:
        x = torch.randn(T, H, device="cuda", generator=g).to(torch.bfloat16)
        logits = torch.randn(T, E, device="cuda", generator=g)
        print(f"{name} T={T} bf16: {graph_us(lambda: fused_moe(x, w1, w2, logits, k)):.1f} us", flush=True)
        reference = None
        chained = table(info_for(x), T, k, E).pdl  # candidates launch as the table's entry does
        for cfg in [None, *CANDIDATES]:
            cfg = cfg and replace(cfg, pdl=chained)
            configs.fp8_config = table if cfg is None else (lambda *_, cfg=cfg: cfg)
            fp8.PLANS.clear()  # plans keep the configuration they were made with

            def call():
                return fused_moe(x, q1, q2, logits, k, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
            out = call()
            reference = out.clone() if reference is None else reference
            label = f"table {table(info_for(x), T, k, E)}" if cfg is None else str(cfg)
            print(f"{name} T={T} {label}: {graph_us(call):.1f} us same bits {torch.equal(out, reference)}",
                  flush=True)


def graph_us(fn) -> float:
    """GPU time of a CUDA-graph replay of fn, µs (median of 5 timings)."""
    return time_gpu(graph_replay(fn), warmup_ms=10, rep_ms=60, repeats=5).median_ms * 1e3


if __name__ == "__main__":
    main()
