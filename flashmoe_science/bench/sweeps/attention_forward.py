"""Sweeps of the attention forward's configurations on the throughput shapes (16k tokens per
batch, Hq * D = 2048, bf16), to tune `configs.FORWARD`, `HOPPER_FORWARD` and `GLUON_FORWARD`.

- `sweep` (`bench attention --sweep`, results attention_sweep): every candidate tile of the
  generic kernel (`forward_candidates`).
- `hopper_sweep` (`bench attention --sweep-hopper`, results attention_hopper_sweep): the Triton
  TMA kernel's candidates and the Gluon kernel's, persistent and one program per tile, against
  the generic kernel's shipped configuration, with each output's error against the generic one;
  with --sweep-gluon only the shipped TMA configuration and the Gluon candidates.
With --window W both time causal sliding-window calls of left window W (window_size=(W, 0)).
"""
from __future__ import annotations

import itertools
from dataclasses import astuple

import torch

from ...attention.configs import HOPPER_FORWARD, AttentionConfig, forward_config, head_dim_block
from ...attention.forward import attention_forward, attention_forward_hopper
from ...device import info_for
from ...flops import attention_flops
from ..attention import HIDDEN, TOKENS, ints, make_inputs
from ..common import rel_error
from ..timing import time_gpu


def forward_candidates(element_size, block_d):
    """Forward configurations worth timing on Hopper for a head dim (shared memory permitting)."""
    for bm, bn, warps, stages in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4)):
        smem = element_size * block_d * (bm + 2 * bn * stages)  # Q plus K and V per stage
        if smem <= 220 * 1024 and not (bm == 128 and warps == 4 and block_d >= 128):
            yield AttentionConfig(bm, bn, warps, stages)


def _sweep_cases(args):
    """(head dim, sequence length, causal, window_size) of a sweep: plain and causal calls, or
    causal calls with the left window of --window."""
    if args.window is None:
        variants = [(False, (-1, -1)), (True, (-1, -1))]
    else:
        variants = [(True, (args.window, 0))]
    return [(d, s, causal, window) for d, s, (causal, window) in
            itertools.product(ints(args.head_dims), ints(args.seqlens), variants)]


def _sweep_row(section, head_dim, seqlen, causal, window_size, **fields) -> dict:
    return dict(section=section, head_dim=head_dim, seqlen=seqlen, causal=causal,
                window=None if window_size[0] < 0 else window_size[0], **fields)


def sweep(args, device):
    rows = []
    for head_dim, seqlen, causal, window in args.progress(_sweep_cases(args), desc="attention sweep"):
        heads, batch = HIDDEN // head_dim, max(1, TOKENS // seqlen)
        q, k, v = make_inputs(batch, heads, seqlen, head_dim, torch.bfloat16, device)
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal, "fwd", window)
        for cfg in forward_candidates(2, head_dim_block(head_dim)):
            row = _sweep_row("sweep", head_dim, seqlen, causal, window, mode="fwd", block_m=cfg.block_m,
                             block_n=cfg.block_n, num_warps=cfg.num_warps, num_stages=cfg.num_stages)
            try:
                t = time_gpu(lambda: attention_forward(q, k, v, causal, None, False, cfg, window),
                             warmup_ms=5, rep_ms=25, repeats=1)
            except Exception as exc:  # out of resources for this candidate
                row.update(error=type(exc).__name__)
            else:
                row.update(ms=t.median_ms, tflops=flops / (t.median_ms * 1e-3) / 1e12)
            rows.append(row)
    return rows


# Candidates by head dim. Four-warp programs that do not share barriers overlap one program's
# softmax with another's wgmma, so the list spans how many fit on an SM (registers and shared
# memory: the Q tile plus K and V per stage) as well as the tile shapes.
HOPPER_CANDIDATES = {64: [(64, 64, 4, 2), (64, 64, 4, 3), (64, 64, 4, 4), (64, 32, 4, 4), (64, 128, 4, 2),
                          (64, 128, 4, 3), (128, 64, 4, 2), (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)],
                     128: [(64, 64, 4, 3), (64, 64, 4, 2), (64, 32, 4, 3), (64, 32, 4, 4), (64, 128, 4, 2),
                           (128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2)],
                     256: [(128, 64, 8, 2), (64, 64, 4, 2), (64, 32, 4, 2), (64, 32, 4, 3), (128, 32, 8, 2)]}
# The Gluon kernel's candidates: (rows per tile, BLOCK_N, stages), 64 rows per consumer
# warpgroup (two or three); Q plus K and V per stage fill at most 227 KB, and three consumers get
# 160 registers a thread against two's 240. Each is timed persistent (one program per SM) and
# with one program per tile ("grid=tiles"); `configs.gluon_persistent` says which one ships.
GLUON_CANDIDATES = {64: [(128, 128, 2), (128, 128, 3), (192, 128, 2), (192, 128, 3), (192, 64, 3), (192, 64, 4)],
                    128: [(128, 128, 2), (128, 64, 3), (192, 64, 2), (192, 64, 3)],
                    256: [(128, 64, 2), (128, 32, 3)]}


# The Gluon kernel's FP8 candidates (`configs.GLUON_FP8_FORWARD`): tiles of half the bytes leave
# room for more stages or wider key blocks than the 16-bit ones.
GLUON_FP8_CANDIDATES = {64: [(128, 128, 2), (128, 128, 4), (192, 128, 2), (128, 256, 2)],
                        128: [(128, 128, 2), (128, 128, 4), (192, 64, 3), (192, 128, 2)],
                        256: [(128, 64, 2), (128, 64, 3), (128, 128, 2)]}


def _candidate_row(section, case, impl, fn, flops, reference, error_key) -> dict:
    """One candidate's sweep row: its time of `fn` (which returns (out, lse)) and its output's
    error against `reference` under `error_key`, or the error it raised. case: (head dim, S,
    causal, window_size)."""
    row = _sweep_row(section, *case, impl=impl)
    try:
        out, _ = fn()
        t = time_gpu(fn, warmup_ms=5, rep_ms=25, repeats=1)
    except Exception as exc:
        row.update(error=f"{type(exc).__name__}: {exc}"[:200])
    else:
        row.update({"ms": t.median_ms, "tflops": flops / (t.median_ms * 1e-3) / 1e12,
                    error_key: rel_error(out, reference)})
    return row


def fp8_sweep(args, device):
    """The Gluon kernel's FP8 candidates (persistent or not as `configs.gluon_persistent` ships)
    against our bf16 forward as the dispatcher runs it, on the throughput shapes (inputs from
    `fp8_attention_inputs`); errors relative to the bf16 output."""
    from ...attention import flash_attention_science, fp8_attention_inputs
    from ...attention.configs import gluon_persistent
    from ...attention.fp8 import fp8_descales

    rows = []
    for head_dim, seqlen, causal, window in args.progress(_sweep_cases(args), desc="attention fp8 sweep"):
        heads, batch = HIDDEN // head_dim, max(1, TOKENS // seqlen)
        q, k, v = make_inputs(batch, heads, seqlen, head_dim, torch.bfloat16, device)
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal, "fwd", window)
        fp8 = fp8_attention_inputs(q, k, v)
        descales = fp8_descales(**fp8, softmax_scale=None)
        reference = flash_attention_science(q, k, v, causal=causal, window_size=window)
        t = time_gpu(lambda: flash_attention_science(q, k, v, causal=causal, window_size=window), warmup_ms=5,
                     rep_ms=25, repeats=1)
        rows.append(_sweep_row("fp8_sweep", head_dim, seqlen, causal, window, impl="ours bf16", ms=t.median_ms,
                               tflops=flops / (t.median_ms * 1e-3) / 1e12))
        persistent = gluon_persistent(causal, seqlen)
        for bm, bn, stages in GLUON_FP8_CANDIDATES.get(head_dim, []):
            cfg = AttentionConfig(bm, bn, 4, stages)
            rows.append(_candidate_row(
                "fp8_sweep", (head_dim, seqlen, causal, window),
                f"gluon fp8 {bm}x{bn} s{stages}{'' if persistent else ' grid=tiles'}",
                lambda: attention_forward_hopper(fp8["q"], fp8["k"], fp8["v"], causal, head_dim ** -0.5, cfg,
                                                 gluon=True, persistent=persistent, window_size=window,
                                                 descales=descales),
                flops, reference, "rel_err_vs_bf16"))
        args.checkpoint(rows)
    return rows


def hopper_sweep(args, device):
    """The Hopper TMA kernel and the Gluon kernel against the generic kernel's shipped
    configuration, on the throughput shapes; errors are relative to the generic output."""
    tiles = None if args.gluon_tiles is None else set(args.gluon_tiles.split(","))
    rows = []
    for head_dim, seqlen, causal, window in args.progress(_sweep_cases(args), desc="attention hopper sweep"):
        heads, batch = HIDDEN // head_dim, max(1, TOKENS // seqlen)
        q, k, v = make_inputs(batch, heads, seqlen, head_dim, torch.bfloat16, device)
        flops = attention_flops(batch, heads, seqlen, seqlen, head_dim, causal, "fwd", window)
        scale = head_dim ** -0.5
        table = forward_config(info_for(q), q.element_size(), head_dim, seqlen, batch * heads)

        def generic_call():  # the generic kernel with the table's configuration, whatever the dispatcher picks
            return attention_forward(q, k, v, causal, None, False, table, window)[0]

        generic = generic_call()
        t = time_gpu(generic_call, warmup_ms=5, rep_ms=25, repeats=1)
        rows.append(_sweep_row("hopper_sweep", head_dim, seqlen, causal, window, impl=f"generic {table}",
                               ms=t.median_ms, tflops=flops / (t.median_ms * 1e-3) / 1e12))

        def timed(impl, fn):  # one candidate's row: its time and its error against the generic output
            return _candidate_row("hopper_sweep", (head_dim, seqlen, causal, window), impl, fn, flops, generic,
                                  "rel_err_vs_generic")

        triton_candidates = HOPPER_CANDIDATES.get(head_dim, [])
        if args.sweep_gluon:
            shipped = HOPPER_FORWARD.get(head_dim)
            triton_candidates = [] if shipped is None else [astuple(shipped)[:4]]
        for bm, bn, warps, stages in triton_candidates:
            cfg = AttentionConfig(bm, bn, warps, stages)
            rows.append(timed(f"hopper {bm}x{bn} w{warps} s{stages}",
                              lambda: attention_forward_hopper(q, k, v, causal, scale, cfg, window_size=window)))
        gluon_candidates = [c for c in GLUON_CANDIDATES.get(head_dim, [])
                            if tiles is None or "%dx%ds%d" % c in tiles]
        for (bm, bn, stages), persistent in itertools.product(gluon_candidates, (True, False)):
            cfg = AttentionConfig(bm, bn, 4, stages)
            rows.append(timed(f"gluon {bm}x{bn} s{stages}{'' if persistent else ' grid=tiles'}",
                              lambda: attention_forward_hopper(q, k, v, causal, scale, cfg, gluon=True,
                                                               persistent=persistent, window_size=window)))
        args.checkpoint(rows)
    return rows
