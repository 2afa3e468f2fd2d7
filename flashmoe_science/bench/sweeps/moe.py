"""Sweeps of the MoE grouped GEMMs' configurations, to tune `moe/configs.py` (`bench moe --sweep`).

`sweep` (results moe_sweep) times a grid of GEMM configurations per shape and token count
(CUDA-graph replays of each kernel alone) and prints, per load bucket of configs.EXPERTS, the
configuration with the best total time relative to each case's best, as a table to paste into
configs.py. `backward_sweep` (with --mode fwd+bwd, results moe_backward_sweep) runs the training
forward once per case and times each of the four backward GEMMs alone with its own candidates
(the others at the table's values), checks each candidate's output against the table
configuration's, and prints per forward BLOCK_M the best entry of configs.BACKWARD. On Hopper the
d [gate, up] GEMM's candidates include the Gluon kernel at several pipeline depths, a choice of
its own beside the Triton kernel's tilings.
"""
from __future__ import annotations

import dataclasses
import functools
import itertools
import math

import torch

from ...device import info_for
from ...moe import backward, configs, experts, moe_route, routing
from .. import common
from ..timing import graph_replay, time_gpu
from ..moe import make_layer

# Sweep candidates: (BLOCK_N, BLOCK_K, GROUP_M, warps, stages) per GEMM, by BLOCK_M, and the
# BLOCK_M values tried for each load bucket of the table (its own and its neighbours).
_SMALL_M = [(bn, bk, 1, w, st) for bn in (32, 64, 128) for bk in (128, 256) for w in (4, 8) for st in (3, 5)]
SWEEP_CANDIDATES = {
    16: _SMALL_M,
    32: _SMALL_M,
    64: [(bn, bk, gm, 4, st) for bn in (64, 128, 256) for bk in (64, 128) for gm in (1, 8) for st in (3, 4)],
    128: [(bn, bk, gm, 8, st) for bn in (64, 128, 256) for bk in (64, 128) for gm in (1, 8) for st in (3, 4)],
}
SWEEP_BLOCK_M = {8: (16, 32), 32: (16, 32, 64), 96: (32, 64, 128), None: (64, 128)}
# Backward sweep: the four GEMMs of backward.py, in launch order (each reads its predecessors'
# outputs). The row GEMMs (grad_gate_up, grad_x) try the forward's candidates for the layout's
# BLOCK_M; the weight gradients (BLOCK_M, BLOCK_N, BLOCK_K, GROUP_M, warps, stages) these output
# tiles. Stages 3 compile to the same weight-gradient kernels as 4 (identical PTX on sm80 and
# sm90, Triton 3.6: the gathered operand pipelines num_stages - 2 or - 3 deep), so 4 and 5.
BACKWARD_KERNELS = ("grad_gate_up", "grad_x", "grad_w1", "grad_w2")
_WEIGHT_GRAD_TILES = ((64, 128, 4), (128, 128, 8), (128, 256, 8), (256, 128, 8))
WEIGHT_GRAD_CANDIDATES = [(bm, bn, bk, 8, w, st) for bm, bn, w in _WEIGHT_GRAD_TILES for bk in (32, 64, 128)
                          for st in (4, 5)]
# On Hopper, grad_gate_up also tries its Gluon kernel (`BackwardConfig.gluon_stages`) and each weight
# gradient the Gluon weight-gradient kernel (`BackwardConfig.gluon_weight_grad_stages` and
# `gluon_weight_grads`) at these pipeline depths (three buffers are all that fit either) where a case
# suits it; their Triton candidates run without.
GLUON_STAGES = {"grad_gate_up": (3,), "grad_w1": (3,), "grad_w2": (3,)}


def _gluon_changes(kernel, stages) -> dict:
    """The BackwardConfig fields that run backward GEMM `kernel` on its Gluon kernel with `stages`
    buffers (0: on the Triton kernel)."""
    if kernel == "grad_gate_up":
        return {"gluon_stages": stages}
    return {"gluon_weight_grad_stages": stages, "gluon_weight_grads": (kernel,) if stages else ()}
# Candidates whose outputs differ more than this from the table configuration's are marked wrong.
SWEEP_MAX_REL_DIFF = 1e-2


def _bucket_name(bound) -> str:
    return "any" if bound is None else f"<={bound}"


def _fits(block_m, cand, operands, element_size, shared_memory) -> bool:
    """Whether a candidate can run well: the A tile and `operands` B tiles of every pipeline stage
    fit shared memory (an upper bound), and the fp32 accumulators need at most 128 registers
    per thread (beyond that they spill)."""
    block_n, block_k, _, num_warps, stages = cand
    smem = stages * block_k * (block_m + operands * block_n) * element_size
    return smem <= shared_memory and operands * block_m * block_n <= 128 * 32 * num_warps


def _weight_grad_fits(cand, element_size, device) -> bool:
    """Whether a weight-gradient candidate fits: the pipeline buffers of both tiles that Triton
    keeps for a loop with a gathered operand (max(2, stages - 2) on Hopper, max(1, stages - 3)
    elsewhere: what the compiled kernels ask for, see configs.BACKWARD) fit shared memory, and
    the fp32 accumulator needs at most 128 registers per thread."""
    block_m, block_n, block_k, _, num_warps, stages = cand
    buffers = max(2, stages - 2) if device.arch_family == 90 else max(1, stages - 3)
    smem = buffers * block_k * (block_m + block_n) * element_size
    return smem <= device.shared_memory_per_block and block_m * block_n <= 128 * 32 * num_warps


def _sweep_timer(fn):
    """GPU time of fn alone: a CUDA-graph replay on the GPU, plain calls in the interpreter."""
    if torch.cuda.is_available():
        fn = graph_replay(fn)
    return time_gpu(fn, warmup_ms=5, rep_ms=20, repeats=1).median_ms


def _time_candidate(fn) -> tuple[float, str | None]:
    """(ms, None), or (inf, the error) for a candidate that does not compile or fit."""
    try:
        return _sweep_timer(fn), None
    except Exception as exc:  # a candidate that does not compile or fit is skipped
        return math.inf, f"{type(exc).__name__}: {exc}"[:200]


def _sweep_cases(args, shapes, tokens, device, dtype, desc):
    """(name, (E, k, H, I), T, w1, w2, x, logits) for each case of a sweep, fresh random inputs
    each time (the caller drops them before the next)."""
    generator = torch.Generator(device=device).manual_seed(0)
    for name, T in args.progress([(n, T) for n in shapes for T in tokens], desc=desc):
        E, k, H, I = shapes[name]
        w1, w2 = make_layer(E, H, I, dtype, device, generator)
        x = torch.randn(T, H, device=device, generator=generator).to(dtype)
        logits = torch.randn(T, E, device=device, generator=generator).to(dtype)
        yield name, shapes[name], T, w1, w2, x, logits


def sweep(args, shapes, tokens, device, dtype):
    """Times the candidate GEMM configurations of SWEEP_CANDIDATES on each (shape, T), for the
    BLOCK_M values of its load bucket; returns (rows, the best-per-bucket table as Python source
    for configs.EXPERTS)."""
    info = info_for(torch.empty(0, device=device))
    element_size = torch.empty(0, dtype=dtype).element_size()
    table = configs.EXPERTS[info.arch_family][element_size]
    rows = []
    for name, (E, k, H, I), T, w1, w2, x, logits in _sweep_cases(args, shapes, tokens, device, dtype, "sweep moe"):
        bound = configs.load_bound(table, T, k, E)
        for block_m in SWEEP_BLOCK_M[bound]:
            plan = routing.DispatchPlan(T, E, k, block_m, device)
            weights, ids, layout = routing.route_pairs(logits, plan, None, sigmoid=False, renormalize=True,
                                                       with_layout=True)
            h = torch.empty(layout.num_blocks * block_m, I, device=device, dtype=dtype)
            y = torch.empty(T * k, H, device=device, dtype=dtype)
            # Descriptor (TMA) loads are a candidate where the table could take them: sm90.
            tma_options = (False, True) if info.arch_family == 90 else (False,)
            for (gemm, operands), tma in itertools.product((("gate_up", 2), ("down", 1)), tma_options):
                cands = [c for c in SWEEP_CANDIDATES[block_m]
                         if _fits(block_m, c, operands, element_size, info.shared_memory_per_block)]
                for cand in cands[: 2 if args.quick else None]:
                    cfg = configs.ExpertsConfig(block_m, configs.GemmConfig(*cand), configs.GemmConfig(*cand), tma)
                    if gemm == "gate_up":
                        fn = functools.partial(experts.launch_gate_up, None, cfg, layout, x, w1, h, k, "silu",
                                               plan.device_index)
                    else:
                        fn = functools.partial(experts.launch_down, None, cfg, layout, h, w2, y, weights,
                                               plan.device_index)
                    ms, error = _time_candidate(fn)
                    rows.append({"shape": name, "T": T, "bucket": _bucket_name(bound), "gemm": gemm,
                                 "block_m": block_m, "tma": tma, **dataclasses.asdict(cfg.gate_up), "ms": ms,
                                 "error": error})
        del w1, w2, x, logits
    return rows, _best_table(rows, table, info.arch_family, element_size, dtype)


def _config_values(cls, row) -> tuple:
    """The fields of configuration class `cls` (GemmConfig, WeightGradConfig) in a sweep row."""
    return tuple(row[f.name] for f in dataclasses.fields(cls))


def _best_times(rows, case) -> dict:
    """The least time of each case (rows grouped by the key function `case`)."""
    best = {}
    for r in rows:
        best[case(r)] = min(best.get(case(r), math.inf), r["ms"])
    return best


def _least_total(rows, best, case, cls, num_cases, extra=()):
    """(score, config values) of the configuration of class `cls` among `rows` with the least
    score, the sum over cases of time / (that case's time in `best`); only configurations that ran
    on all `num_cases` cases compete. None when none did. `extra`: row fields that tell apart
    configurations with the same values (their values follow the class's)."""
    scores = {}
    for r in rows:
        scores.setdefault(_config_values(cls, r) + tuple(r[f] for f in extra), []).append(r["ms"] / best[case(r)])
    complete = [(sum(v), cfg) for cfg, v in scores.items() if len(v) == num_cases]
    return min(complete) if complete else None


def _best_table(rows, table, family, element_size, dtype) -> str:
    """Per bucket, the BLOCK_M and the gate/up and down configurations that minimise the sum
    over the bucket's cases of time / (that case's best time), written as configs.EXPERTS source."""
    def case(r):
        return r["shape"], r["T"], r["gemm"]
    ok = [r for r in rows if math.isfinite(r["ms"])]
    best_case = _best_times(ok, case)
    lines = [f"# measured: family {family}, {str(dtype).replace('torch.', '')}, bench moe --sweep",
             f"EXPERTS[{family}][{element_size}] = ("]
    for bound, _ in table:
        in_bucket = [r for r in ok if r["bucket"] == _bucket_name(bound)]
        num_cases = len({(r["shape"], r["T"]) for r in in_bucket})
        choice = None
        for block_m, tma in sorted({(r["block_m"], r.get("tma", False)) for r in in_bucket}):
            picked = [_least_total([r for r in in_bucket if r["block_m"] == block_m and r.get("tma", False) == tma
                                    and r["gemm"] == gemm], best_case, case, configs.GemmConfig, num_cases)
                      for gemm in ("gate_up", "down")]
            if None in picked:
                continue
            total = sum(score for score, _ in picked)
            if choice is None or total < choice[0]:
                choice = (total, block_m, tma, [cfg for _, cfg in picked])
        if choice is not None:
            _, block_m, tma, (gate_up, down) = choice
            # The sweep times the Triton kernels; a table entry's Gluon down (timed against them apart)
            # stays where the pick keeps its blocks and descriptors.
            entry = dict(table).get(bound)
            gluon = (f", gluon_down_stages={entry.gluon_down_stages}" if entry is not None and entry.gluon_down_stages
                     and (block_m, tma) == (entry.block_m, entry.tma) else "")
            lines.append(f"    ({bound}, X({block_m}, G{gate_up}, G{down}{', tma=True' if tma else ''}{gluon})),")
    lines.append(")")
    return "\n".join(lines)


def _backward_candidates(current, block_m, element_size, device, quick) -> list:
    """The configurations a backward GEMM is timed with: the table's (`current`) first, then those
    of the grid that fit (the row GEMMs: the forward's candidates for `block_m` at their largest
    GROUP_M, with one accumulator). --quick: two."""
    if isinstance(current, configs.GemmConfig):
        grid = SWEEP_CANDIDATES[block_m]
        group_m = max(c[2] for c in grid)
        cands = [configs.GemmConfig(*c) for c in grid
                 if c[2] == group_m and _fits(block_m, c, 1, element_size, device.shared_memory_per_block)]
    else:
        cands = [configs.WeightGradConfig(*c) for c in WEIGHT_GRAD_CANDIDATES
                 if _weight_grad_fits(c, element_size, device)]
    return list(dict.fromkeys([current, *cands]))[: 2 if quick else None]


def _gluon_suits(kernel, table_plan, t, out) -> bool:
    """Whether backward GEMM `kernel`'s Gluon kernel can run this case (`out`: its output buffers)."""
    if kernel == "grad_gate_up":
        return backward.gluon_grad_gate_up_ok(table_plan, t["grad_out"], t["w2"], False)
    if kernel == "grad_w1":
        return backward.gluon_weight_grad_ok(table_plan, kernel, t["x"], t["grad_gate_up"], out["grad_w1"])
    return backward.gluon_weight_grad_ok(table_plan, kernel, t["grad_out"], t["weighted_h"], out["grad_w2"])


def _kernel_candidates(kernel, current, table_plan, t, out, device, element_size, quick) -> list:
    """(configuration, Gluon stages) pairs a backward GEMM is timed with: `_backward_candidates` on
    the Triton kernel (stages 0), then the kernel's Gluon one (if it has one) at GLUON_STAGES where
    the case suits it (sm90, 16-bit, its layout)."""
    cands = [(c, 0) for c in _backward_candidates(current, table_plan.block_m, element_size, device, quick)]
    if (kernel in GLUON_STAGES and device.capability == 90 and element_size == 2
            and _gluon_suits(kernel, table_plan, t, out)):
        cands += [(current, stages) for stages in GLUON_STAGES[kernel]]
    return cands


def _backward_outputs(kernel, plan, dtype, device) -> dict:
    """Zeroed output buffers of backward GEMM `kernel` under `plan` (zeros: elements a kernel
    does not write compare equal between configurations)."""
    rows, T, H, I, E = plan.num_blocks * plan.block_m, plan.num_tokens, plan.hidden, plan.inter, plan.num_experts
    shapes = {"grad_gate_up": {"grad_gate_up": ((rows, 2 * I), dtype), "weighted_h": ((rows, I), dtype),
                               "row_tokens": ((rows,), torch.int32),
                               "grad_weight_parts": ((plan.grad_gate_up_tiles, T * plan.top_k), torch.float32)},
              "grad_x": {"grad_x_pairs": ((T * plan.top_k, H), dtype)},
              "grad_w1": {"grad_w1": ((E, 2 * I, H), dtype)},
              "grad_w2": {"grad_w2": ((E, H, I), dtype)}}[kernel]
    return {name: torch.zeros(shape, dtype=dt, device=device) for name, (shape, dt) in shapes.items()}


def _backward_launch(kernel, plan, t, out):
    """A launch of backward GEMM `kernel` alone under `plan`, reading `t` (the forward's tensors
    and the table configuration's outputs of the earlier kernels) and writing `out`."""
    if kernel == "grad_gate_up":
        return functools.partial(backward.launch_grad_gate_up, None, plan, t["grad_out"], t["w2"], t["h"],
                                 t["h_grads"], t["weights"], *t["layout"], out["grad_gate_up"], out["weighted_h"],
                                 out["row_tokens"], out["grad_weight_parts"], True)
    if kernel == "grad_x":
        return functools.partial(backward.launch_grad_x, None, plan, t["grad_gate_up"], t["w1"], out["grad_x_pairs"],
                                 *t["layout"])
    if kernel == "grad_w1":
        return functools.partial(backward.launch_grad_w1, None, plan, t["grad_gate_up"], t["x"], out["grad_w1"],
                                 t["row_tokens"], t["expert_blocks"])
    return functools.partial(backward.launch_grad_w2, None, plan, t["grad_out"], t["weighted_h"], out["grad_w2"],
                             t["row_tokens"], t["expert_blocks"])


def _outputs_rel_diff(out, ref) -> float:
    """The largest relative difference of a candidate's outputs from the table configuration's
    (d topk_weights: the column tiles' parts summed, as the backward does)."""
    def value(name, t):
        return t.sum(dim=0) if name == "grad_weight_parts" else t
    return max(common.rel_error(value(n, out[n]), value(n, ref[n])) for n in ref)


def backward_sweep(args, shapes, tokens, device, dtype):
    """Runs the training forward once on each (shape, T), then times each backward GEMM alone
    with its candidate configurations, the other three at the table's; returns (rows, the best
    entry per forward BLOCK_M as Python source for configs.BACKWARD)."""
    info = info_for(torch.empty(0, device=device))
    element_size = torch.empty(0, dtype=dtype).element_size()
    rows = []
    cases = _sweep_cases(args, shapes, tokens, device, dtype, "sweep moe backward")
    for name, (E, k, _, _), T, w1, w2, x, logits in cases:
        weights, ids = moe_route(logits, k)
        h, h_grads, sorted_pairs, block_expert, block_rows = experts.gate_up_for_backward(
            x, w1, w2, weights, ids, "silu")
        table_plan = backward.BackwardPlan(x, w1, w2, ids, block_expert, sorted_pairs)
        t = {"grad_out": torch.randn_like(x), "x": x, "w1": w1, "w2": w2, "weights": weights, "h": h,
             "h_grads": h_grads, "layout": (sorted_pairs, block_expert, block_rows),
             "expert_blocks": backward.expert_block_ranges(block_expert, E)}
        for kernel in BACKWARD_KERNELS:
            ref = _backward_outputs(kernel, table_plan, dtype, device)
            _backward_launch(kernel, table_plan, t, ref)()
            current = getattr(table_plan.config, kernel)
            for cand, gluon_stages in _kernel_candidates(kernel, current, table_plan, t, ref, info, element_size,
                                                         args.quick):
                changes = {kernel: cand, **(_gluon_changes(kernel, gluon_stages) if kernel in GLUON_STAGES else {})}
                plan = backward.BackwardPlan(x, w1, w2, ids, block_expert, sorted_pairs,
                                             dataclasses.replace(table_plan.config, **changes))
                out = _backward_outputs(kernel, plan, dtype, device)
                ms, error = _time_candidate(_backward_launch(kernel, plan, t, out))
                rel_diff = _outputs_rel_diff(out, ref) if error is None else None
                if rel_diff is not None and not rel_diff < SWEEP_MAX_REL_DIFF:
                    error = f"wrong: outputs differ from the table configuration's by {rel_diff:.1e}"
                # block_m: the kernel's BLOCK_M (the weight gradients' own, the layout's for the others).
                rows.append({"shape": name, "T": T, "forward_block_m": table_plan.block_m, "kernel": kernel,
                             "block_m": table_plan.block_m, **dataclasses.asdict(cand),
                             "gluon_stages": gluon_stages, "ms": ms, "rel_diff": rel_diff, "error": error})
                del out
            t.update(ref)  # the next kernels read these
            del ref
        del w1, w2, x, logits, h, h_grads, t
    return rows, _best_backward_table(rows, configs.BACKWARD[info.arch_family][element_size], info.arch_family,
                                      element_size, dtype)


def _best_backward_table(rows, table, family, element_size, dtype) -> str:
    """Per forward BLOCK_M, each backward GEMM's configuration with the least sum over cases of
    time / (that case's best time) among those right on every case (else the table's, said so),
    written as configs.BACKWARD entries."""
    def case(r):
        return r["shape"], r["T"], r["kernel"]
    ok = [r for r in rows if r["error"] is None]
    best = _best_times(ok, case)
    lines = [f"# measured: family {family}, {str(dtype).replace('torch.', '')}, bench moe --sweep --mode fwd+bwd"]
    for block_m in sorted({r["forward_block_m"] for r in rows}):
        in_bucket = [r for r in ok if r["forward_block_m"] == block_m]
        num_cases = len({(r["shape"], r["T"]) for r in rows if r["forward_block_m"] == block_m})
        picked, kept = [], []
        entry = table[block_m]
        # Each kernel with a Gluon one: the table's stages for it unless its rows pick.
        gluon = {"grad_gate_up": entry.gluon_stages,
                 **{k: entry.gluon_weight_grad(k) for k in ("grad_w1", "grad_w2")}}
        for kernel in BACKWARD_KERNELS:
            current = getattr(entry, kernel)
            # The rows of a kernel with a Gluon one tell the Triton kernel (gluon_stages 0) from it.
            extra = ("gluon_stages",) if kernel in GLUON_STAGES else ()
            choice = _least_total([r for r in in_bucket if r["kernel"] == kernel], best, case, type(current),
                                  num_cases, extra)
            if choice is None:
                kept.append(kernel)
                values = dataclasses.astuple(current)
            else:
                values = choice[1][:len(choice[1]) - len(extra)]
                if extra:
                    gluon[kernel] = choice[1][-1]
            picked.append(("G" if isinstance(current, configs.GemmConfig) else "W") + str(values))
        if gluon["grad_gate_up"]:
            picked.append(f"gluon_stages={gluon['grad_gate_up']}")
        weight_grads = tuple(k for k in ("grad_w1", "grad_w2") if gluon[k])
        if weight_grads:  # one kernel, one depth for both: the deeper picked
            picked.append(f"gluon_weight_grad_stages={max(gluon[k] for k in weight_grads)}")
            if weight_grads != ("grad_w1", "grad_w2"):
                picked.append(f"gluon_weight_grads={weight_grads!r}")
        note = f"  # the table's {', '.join(kept)}: no candidate right on every case" if kept else ""
        lines.append(f"BACKWARD[{family}][{element_size}][{block_m}] = B({', '.join(picked)}){note}")
    return "\n".join(lines)
