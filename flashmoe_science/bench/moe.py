"""`flashmoe-science bench moe`: the fused MoE layer side by side with what users run today.

Modes (--mode):
- fwd (results "moe"): the forward, every shape at T in {1, ..., 16384} (below);
- fwd+bwd (results "moe_fwd_bwd"): forward and backward (gradients for hidden_states, w1, w2
  and the router logits) at T = 4096 and 16384, TFLOP/s counted as 18*T*k*H*I, with the
  gradients' relative errors against float64 on REFERENCE_TOKENS tokens (fp32 logits there, so
  every implementation routes them alike): `rel_error_d<x|w1|w2|router_logits>`, their largest
  as `rel_error`, next to PyTorch's own bf16 error (the naive loop's) as `torch_rel_error`;
- train (results "moe_train"): a small transformer of our layers trained against the same
  model in plain PyTorch ops, loss curves and step times (see moe_training.py).

Implementations, on the same inputs in one process:
- ours: `fused_moe` (routing, dispatch, two grouped GEMMs and the combine in Triton kernels);
- gmm: routing in PyTorch, a stable sort of the token-expert pairs by expert, and
  `torch._grouped_mm` for both expert matmuls, then index_add back (torchtitan's path);
- naive: the per-expert loop of most model code (index, two matmuls, index_add), which is
  `reference.fused_experts_torch` after PyTorch routing;
- sonic: SonicMoE (`sonic-moe`, CuTe DSL on Hopper and Blackwell) on the same logits and weights
  (`sonic.py`), where it imports and runs (else the results' meta says why);
- fp8 (only when asked, forward only): `fused_moe` with the same weights quantised to FP8 per
  128 x 128 block (`moe.fp8`); its `rel_error` against the float64 layer of the unquantised
  weights is the FP8 error itself, and its weight bandwidth counts one byte a weight;
- scaled_gmm (only when asked, forward only): PyTorch's FP8 path, `torch._scaled_grouped_mm`
  on the weights quantised per output channel, tokens and intermediate per row
  (`reference.fused_moe_scaled_grouped_mm`).
With --mode fwd+bwd each runs under autograd: ours through its custom ops and backward
kernels, gmm through torch._grouped_mm's own backward, naive through PyTorch's, sonic through
its own.

Each row: GPU time (do_bench medians over `repeats` runs, 95% interval), TFLOP/s counted as
6*T*k*H*I, wall-clock per call up to 1024 tokens, the time of a CUDA-graph replay up to 128
tokens (how decode is served; ours and gmm, the naive loop synchronises), and for T <= 64 the
weight bandwidth: bytes of the experts the call touches (3*H*I*2 each) over the time, as a
fraction of a device copy measured in the same run. The speedup against gmm comes with a
bootstrap interval. Correctness: `rel_error`, the relative error of the first 128 tokens
against the float64 reference of the formula (with our routing: bf16 logits can tie, and
gmm/naive break ties their own way), next to `torch_rel_error`, PyTorch's own error in the
input precision (bf16 on the GPU) on the same rows.

`--sweep` times candidate GEMM configurations instead (`sweeps/moe.py`), for maintainers
tuning the tables.

On a machine without a GPU the kernels run in Triton's interpreter: `--quick` then runs a tiny
shape in fp32 to exercise the code, and the timings mean nothing.
"""
from __future__ import annotations

import argparse

import torch

from ..device import interpreter_active
from ..flops import moe_flops
from ..moe import backward, configs, experts, fused_moe, moe_route
from ..moe.fp8 import quantize_fp8_blockwise, quantize_fp8_per_channel
from ..moe.reference import (fused_experts_torch, fused_moe_grouped_mm, fused_moe_scaled_grouped_mm,
                             fused_moe_torch, moe_route_torch)
from . import common, moe_training, sonic
from .timing import graph_replay, speedup_interval, time_gpu, time_wall

# name: (E, top_k, H, I)
SHAPES = {
    "mixtral-8x7b": (8, 2, 4096, 14336),
    "qwen3-30b-a3b": (128, 8, 2048, 768),
    "deepseek-v2-lite": (64, 6, 2048, 1408),
    "olmoe-1b-7b": (64, 8, 2048, 1024),
}
TINY_SHAPE = {"tiny": (8, 2, 64, 32)}
TOKENS = (1, 16, 128, 1024, 4096, 16384)
QUICK_SHAPES = ("qwen3-30b-a3b", "mixtral-8x7b")
QUICK_TOKENS = (1, 4096)
IMPLS = ("ours", "gmm", "naive", "sonic", "fp8", "scaled_gmm")
DEFAULT_IMPLS = ("ours", "gmm", "naive", "sonic")
MODES = ("fwd", "fwd+bwd", "train")
RESULT_NAMES = {"fwd": "moe", "fwd+bwd": "moe_fwd_bwd", "train": "moe_train"}
FWD_BWD_TOKENS = (4096, 16384)
FWD_BWD_QUICK_TOKENS = (4096,)
REFERENCE_TOKENS = 128
WALL_MAX_TOKENS = 1024
GRAPH_MAX_TOKENS = 128
# The naive loop costs 5 to 20 ms a call at E = 128 (ANCHORS.md): beyond this many tokens it is
# timed with at most two repeats, which keeps the whole run to a few minutes.
NAIVE_FEW_REPEATS_TOKENS = 1024
# --sweep (`sweeps/moe.py`): its default token counts, and its results files by mode.
SWEEP_TOKENS = (1, 128, 1024, 16384)
SWEEP_RESULT_NAMES = {"fwd": "moe_sweep", "fwd+bwd": "moe_backward_sweep"}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--mode", choices=MODES, default="fwd",
                        help="fwd: the forward; fwd+bwd: forward and backward; train: a small model trained with "
                             "our layers and with plain PyTorch (default: fwd)")
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=None,
                        help="model shapes (default: all; --quick: qwen3-30b-a3b, mixtral-8x7b)")
    parser.add_argument("--tokens", nargs="+", type=int, default=None,
                        help=f"token counts T (default: {' '.join(map(str, TOKENS))}; --sweep: "
                             f"{' '.join(map(str, SWEEP_TOKENS))}; fwd+bwd: {' '.join(map(str, FWD_BWD_TOKENS))})")
    parser.add_argument("--impls", nargs="+", choices=IMPLS, default=list(DEFAULT_IMPLS),
                        help="implementations to time (sonic: SonicMoE where it imports; fp8, the forward only: our "
                             "FP8 path on the same weights quantised per 128 x 128 block; scaled_gmm: "
                             "torch._scaled_grouped_mm on them quantised per output channel)")
    parser.add_argument("--sonic-autotune", choices=sonic.AUTOTUNE_CHOICES, default="all",
                        help="SonicMoE's GEMM autotuning: all of QuACK's sm90 candidates, or a subset of four "
                             "(`bench/sonic.py`: the full set compiles for more than ten minutes)")
    parser.add_argument("--sweep", action="store_true",
                        help="time candidate GEMM configurations and print the best per load bucket (with "
                             "--mode fwd+bwd: the backward GEMMs', per forward BLOCK_M)")
    try:
        parser.add_argument("--quick", action="store_true", help="a small subset (a tiny shape on the CPU)")
    except argparse.ArgumentError:  # the CLI already gives every benchmark --quick
        pass
    moe_training.add_arguments(parser)


def make_layer(E, H, I, dtype, device, generator):
    """Weights ~ N(0, 1/fan_in), drawn in place so Mixtral's 2.8 GB never exist in fp32."""
    w1 = torch.empty(E, 2 * I, H, dtype=dtype, device=device).normal_(0, H**-0.5, generator=generator)
    w2 = torch.empty(E, H, I, dtype=dtype, device=device).normal_(0, I**-0.5, generator=generator)
    return w1, w2


def naive_forward(x, w1, w2, router_logits, top_k):
    weights, ids = moe_route_torch(router_logits, top_k)
    return fused_experts_torch(x, w1, w2, weights, ids)


def _gmm_unavailable(device, dtype, with_backward: bool = False) -> str | None:
    """None when torch._grouped_mm runs here (and differentiates, with_backward), else why not."""
    if not hasattr(torch, "_grouped_mm"):
        return f"torch {torch.__version__} has no torch._grouped_mm"
    try:
        inputs = [torch.randn(8, 32, device=device, dtype=dtype), torch.randn(2, 32, 32, device=device, dtype=dtype),
                  torch.randn(2, 32, 16, device=device, dtype=dtype), torch.randn(8, 2, device=device)]
        for t in inputs:
            t.requires_grad_(with_backward)
        out = fused_moe_grouped_mm(*inputs, 1)
        if with_backward:
            torch.autograd.grad(out, inputs, torch.randn_like(out))
    except Exception as exc:  # recorded in the results instead of failing the run
        what = "torch._grouped_mm backward" if with_backward else "torch._grouped_mm"
        return f"{what} failed: {type(exc).__name__}: {exc}"[:300]
    return None


def _scaled_gmm_unavailable(device) -> str | None:
    """None when torch._scaled_grouped_mm runs here, else why not (recorded in the results)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return f"torch {torch.__version__} has no torch._scaled_grouped_mm"
    try:
        w1, w2 = torch.randn(2, 32, 32, device=device), torch.randn(2, 32, 16, device=device)
        fused_moe_scaled_grouped_mm(torch.randn(8, 32, device=device, dtype=torch.bfloat16),
                                    *quantize_fp8_per_channel(w1), *quantize_fp8_per_channel(w2),
                                    torch.randn(8, 2, device=device), 1)
    except Exception as exc:  # recorded in the results instead of failing the run
        return f"torch._scaled_grouped_mm failed: {type(exc).__name__}: {exc}"[:300]
    return None


def _setup(args):
    on_gpu = torch.cuda.is_available()
    if on_gpu:
        names = args.shapes or (list(QUICK_SHAPES) if args.quick else list(SHAPES))
        shapes = {name: SHAPES[name] for name in names}
        if args.mode == "fwd+bwd":
            default_tokens = FWD_BWD_QUICK_TOKENS if args.quick else FWD_BWD_TOKENS
        else:
            default_tokens = QUICK_TOKENS if args.quick else (SWEEP_TOKENS if args.sweep else TOKENS)
        return shapes, list(args.tokens or default_tokens), torch.device("cuda"), torch.bfloat16
    if not (args.quick and interpreter_active()):
        raise SystemExit("bench moe needs a CUDA GPU; without one, --quick with TRITON_INTERPRET=1 runs a "
                         "tiny shape through Triton's interpreter to exercise the code")
    return dict(TINY_SHAPE), list(args.tokens or (1, 33)), torch.device("cpu"), torch.float32


def run(args) -> dict:
    if args.sweep and args.mode not in SWEEP_RESULT_NAMES:
        raise SystemExit("--sweep times GEMM configurations: use it with --mode fwd or fwd+bwd")
    if args.mode == "train":
        return moe_training.run(args)
    shapes, tokens, device, dtype = _setup(args)
    meta = {"mode": args.mode, "dtype": str(dtype).replace("torch.", ""), "shapes": shapes, "tokens": tokens,
            "interpreter": interpreter_active()}
    if interpreter_active():
        meta["note"] = "Triton interpreter on the CPU, tiny shape: the timings mean nothing"
    if args.sweep:
        from .sweeps import moe as sweeps
        sweep = sweeps.backward_sweep if args.mode == "fwd+bwd" else sweeps.sweep
        rows, table = sweep(args, shapes, tokens, device, dtype)
        meta["best_configs"] = table
        print(table)
        return {"name": SWEEP_RESULT_NAMES[args.mode], "rows": rows, "meta": meta}
    with_backward = args.mode == "fwd+bwd"
    if not with_backward:
        meta["copy_tbps"] = common.measure_copy_bandwidth()
    gmm_reason = _gmm_unavailable(device, dtype, with_backward) if "gmm" in args.impls else "not requested"
    meta["gmm"] = gmm_reason or "torch._grouped_mm" + (" with its autograd backward" if with_backward else "")
    scaled_reason = _scaled_gmm_unavailable(device) if "scaled_gmm" in args.impls and not with_backward else None
    meta["scaled_gmm"] = scaled_reason or "torch._scaled_grouped_mm, rowwise scales"
    sonic_reason = sonic.unavailable(device, dtype, args.sonic_autotune) if "sonic" in args.impls else "not requested"
    meta["sonic"] = sonic_reason or sonic.versions()
    if "sonic" in args.impls and sonic_reason is None:
        meta["sonic_autotune"] = sonic.autotuning_description(args.sonic_autotune)  # applied by `unavailable`
    skipped = {"gmm": gmm_reason, "scaled_gmm": scaled_reason, "sonic": sonic_reason}
    impls = [i for i in args.impls if skipped.get(i) is None and (i not in ("fp8", "scaled_gmm") or not with_backward)]
    generator = torch.Generator(device=device).manual_seed(0)
    checkpoint = getattr(args, "checkpoint", None) or (lambda rows: None)  # rows so far, where `cli` sets it
    rows = []
    if with_backward:
        for name in args.progress(list(shapes), desc="bench moe fwd+bwd"):
            if device.type == "cuda":
                torch.cuda.empty_cache()
            rows += _bench_fwd_bwd_shape(args, name, shapes[name], tokens, impls, device, dtype, generator)
            checkpoint(rows)
        return {"name": RESULT_NAMES[args.mode], "rows": rows, "meta": meta}
    cases = [(name, T) for name in shapes for T in tokens]
    current = w1 = w2 = w64 = None
    for name, T in args.progress(cases, desc="bench moe"):
        E, k, H, I = shapes[name]
        if current != name:
            w1 = w2 = w64 = None  # free the previous shape's weights (Mixtral's are 14 GB with the fp64 copy)
            if device.type == "cuda":
                torch.cuda.empty_cache()
            current, (w1, w2) = name, make_layer(E, H, I, dtype, device, generator)
            w64 = (w1.double(), w2.double())
            fp8_weights = {}
            if "fp8" in impls:
                fp8_weights["fp8"] = (*quantize_fp8_blockwise(w1), *quantize_fp8_blockwise(w2))
            if "scaled_gmm" in impls:
                fp8_weights["scaled_gmm"] = (*quantize_fp8_per_channel(w1), *quantize_fp8_per_channel(w2))
        rows += _bench_case(args, name, (E, k, H, I), T, impls, w1, w2, w64, meta["copy_tbps"], generator,
                            fp8_weights)
        checkpoint(rows)
    # FP8 comparisons have their own results file and table (report.render_moe_fp8)
    fp8_run = any(i in ("fp8", "scaled_gmm") for i in impls)
    return {"name": "moe_fp8" if fp8_run else RESULT_NAMES[args.mode], "rows": rows, "meta": meta}


FORWARDS = {"ours": fused_moe, "gmm": fused_moe_grouped_mm, "naive": naive_forward, "sonic": sonic.fused_moe_sonic}
# Each row of ours carries its speed against these, where they ran: speedup_vs_<name> [lo, hi].
COMPARED = ("gmm", "sonic")


def _add_speedups(timings: dict, rows: dict) -> None:
    """Every row's speed against each compared implementation timed beside it (bootstrap interval)."""
    for other in COMPARED:
        if other in timings:
            for impl, row in rows.items():
                ratio, lo, hi = speedup_interval(timings[impl], timings[other])
                suffix = "" if other == "gmm" else f"_{other}"
                row.update({f"speedup_vs_{other}": ratio, f"speedup{suffix}_lo": lo, f"speedup{suffix}_hi": hi})
GRADIENT_NAMES = ("x", "w1", "w2", "router_logits")


def _forward_backward(impl, inputs, top_k, grad_out):
    """A call of forward and backward of `impl`: the gradients of all four inputs."""
    forward = FORWARDS[impl]
    return lambda: torch.autograd.grad(forward(*inputs, top_k), inputs, grad_out)


def _peak_extra_mib(fn) -> float:
    """MiB that one call of `fn` allocates at its peak beyond what was allocated before it (its
    activations, saved tensors, gradients and temporaries; the inputs not counted)."""
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def _gradient_errors(impls, shape, w1, w2, generator) -> dict:
    """Per implementation, the relative error of each gradient on REFERENCE_TOKENS tokens against
    float64 autograd through the formula (fp32 logits: every implementation routes alike)."""
    E, k, H, _ = shape
    device, dtype = w1.device, w1.dtype
    x = torch.randn(REFERENCE_TOKENS, H, device=device, generator=generator).to(dtype)
    logits = torch.randn(REFERENCE_TOKENS, E, device=device, generator=generator)
    grad_out = torch.randn(REFERENCE_TOKENS, H, device=device, generator=generator).to(dtype)
    ref_inputs = [t.detach().double().requires_grad_() for t in (x, w1, w2, logits)]
    ref = torch.autograd.grad(fused_moe_torch(*ref_inputs, k), ref_inputs, grad_out.double())
    del ref_inputs
    inputs = [t.detach().requires_grad_() for t in (x, w1, w2, logits)]
    errors = {}
    for impl in impls:
        grads = _forward_backward(impl, inputs, k, grad_out)()
        errors[impl] = {name: common.rel_error(g, r) for name, g, r in zip(GRADIENT_NAMES, grads, ref)}
    return errors


def _bench_fwd_bwd_shape(args, name, shape, tokens, impls, device, dtype, generator):
    """Forward+backward rows of one model shape at each T; the weights are made once. The
    gradient errors are measured first, so the float64 copies are gone before the timings."""
    E, k, H, I = shape
    w1, w2 = (w.requires_grad_() for w in make_layer(E, H, I, dtype, device, generator))
    errors = _gradient_errors(list(dict.fromkeys([*impls, "naive"])), shape, w1, w2, generator)
    torch_errors = errors["naive"]  # PyTorch's own error in the input precision
    rows = []
    for T in tokens:
        x = torch.randn(T, H, device=device, generator=generator).to(dtype).requires_grad_()
        logits = torch.randn(T, E, device=device, generator=generator).to(dtype).requires_grad_()
        grad_out = torch.randn(T, H, device=device, generator=generator).to(dtype)
        inputs = (x, w1, w2, logits)
        flops = moe_flops(T, k, H, I, "fwd+bwd")
        timings, by_impl = {}, {}
        for impl in impls:
            repeats = args.repeats if impl != "naive" or T <= NAIVE_FEW_REPEATS_TOKENS else min(args.repeats, 2)
            timing = time_gpu(_forward_backward(impl, inputs, k, grad_out), warmup_ms=args.warmup,
                                     rep_ms=args.rep, repeats=repeats)
            timings[impl] = timing
            row = {"mode": "fwd+bwd", "shape": name, "E": E, "top_k": k, "H": H, "I": I, "T": T, "impl": impl,
                   "ms": timing.median_ms, "ms_lo": timing.lo_ms, "ms_hi": timing.hi_ms,
                   "tflops": flops / (timing.median_ms * 1e-3) / 1e12,
                   "rel_error": max(errors[impl].values()), "torch_rel_error": max(torch_errors.values()),
                   **{f"rel_error_d{g}": e for g, e in errors[impl].items()}}
            if device.type == "cuda":
                row["peak_extra_mib"] = _peak_extra_mib(_forward_backward(impl, inputs, k, grad_out))
            if impl == "ours":
                row.update(experts.describe(x, w1, k), **backward.describe(x, w1, k))
            by_impl[impl] = row
        _add_speedups(timings, by_impl)
        rows += by_impl.values()
        del x, logits, grad_out, inputs
    return rows


def _bench_case(args, name, shape, T, impls, w1, w2, w64, copy_tbps, generator, fp8_weights=None):
    E, k, H, I = shape
    device, dtype = w1.device, w1.dtype
    x = torch.randn(T, H, device=device, generator=generator).to(dtype)
    logits = torch.randn(T, E, device=device, generator=generator).to(dtype)
    fns = {"ours": lambda: fused_moe(x, w1, w2, logits, k), "gmm": lambda: fused_moe_grouped_mm(x, w1, w2, logits, k),
           "naive": lambda: naive_forward(x, w1, w2, logits, k),
           "sonic": lambda: sonic.fused_moe_sonic(x, w1, w2, logits, k)}
    if "fp8" in (fp8_weights or {}):
        q1, s1, q2, s2 = fp8_weights["fp8"]
        fns["fp8"] = lambda: fused_moe(x, q1, q2, logits, k, w1_scale=s1, w2_scale=s2, block_shape=(128, 128))
    if "scaled_gmm" in (fp8_weights or {}):
        c1, cs1, c2, cs2 = fp8_weights["scaled_gmm"]
        fns["scaled_gmm"] = lambda: fused_moe_scaled_grouped_mm(x, c1, cs1, c2, cs2, logits, k)
    # Correctness on the first rows, all with our routing (see the module docstring).
    S = min(T, REFERENCE_TOKENS)
    weights, ids = moe_route(logits[:S], k)
    ref = fused_experts_torch(x[:S].double(), *w64, weights.double(), ids)
    torch_error = common.rel_error(fused_experts_torch(x[:S], w1, w2, weights, ids), ref)
    touched = torch.unique(ids).numel() if T <= configs.DECODE_MAX_TOKENS else None
    flops = moe_flops(T, k, H, I)
    timings, rows = {}, {}
    for impl in impls:
        repeats = args.repeats if impl != "naive" or T <= NAIVE_FEW_REPEATS_TOKENS else min(args.repeats, 2)
        timing = time_gpu(fns[impl], warmup_ms=args.warmup, rep_ms=args.rep, repeats=repeats)
        timings[impl] = timing
        row = {"shape": name, "E": E, "top_k": k, "H": H, "I": I, "T": T, "impl": impl,
               "ms": timing.median_ms, "ms_lo": timing.lo_ms, "ms_hi": timing.hi_ms,
               "tflops": flops / (timing.median_ms * 1e-3) / 1e12,
               "rel_error": common.rel_error(fns[impl]()[:S], ref), "torch_rel_error": torch_error}
        if T <= WALL_MAX_TOKENS:
            calls = max(1, min(200, int(100 / max(timing.median_ms, 1e-3))))
            row["wall_ms"] = time_wall(fns[impl], calls=calls, repeats=args.repeats).median_ms
        if T <= GRAPH_MAX_TOKENS and impl != "naive" and device.type == "cuda":
            try:
                row["graph_ms"] = time_gpu(graph_replay(fns[impl]), warmup_ms=args.warmup, rep_ms=args.rep,
                                           repeats=args.repeats).median_ms
            except RuntimeError as exc:  # a peer's call that cannot be captured: say so, time it eagerly only
                if impl == "ours":
                    raise
                row["graph_error"] = f"{type(exc).__name__}: {exc}"[:300]
        if touched is not None:
            weight_bytes = touched * 3 * H * I * (1 if impl in ("fp8", "scaled_gmm") else w1.element_size())
            row["touched_experts"] = touched
            row["weight_tbps"] = weight_bytes / (timing.median_ms * 1e-3) / 1e12
            row["weight_fraction_of_copy"] = row["weight_tbps"] / copy_tbps
            if "graph_ms" in row:
                row["weight_tbps_graph"] = weight_bytes / (row["graph_ms"] * 1e-3) / 1e12
        if impl == "ours":
            row.update(experts.describe(x, w1, k))
        rows[impl] = row
    _add_speedups(timings, rows)
    return list(rows.values())


def plot(rows, path_png) -> None:
    """TFLOP/s against T, one panel per shape, one line per implementation (train rows: the
    loss curves and step times, see moe_training.plot)."""
    if any(r.get("mode") == "train" for r in rows):
        moe_training.plot(rows, path_png)
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    shapes = list(dict.fromkeys(r["shape"] for r in rows if "tflops" in r))
    if not shapes:
        return
    flops = "18·T·k·H·I, fwd+bwd" if any(r.get("mode") == "fwd+bwd" for r in rows) else "6·T·k·H·I"
    fig, axes = plt.subplots(1, len(shapes), figsize=(4.5 * len(shapes), 3.6), squeeze=False)
    for ax, shape in zip(axes[0], shapes):
        for impl in IMPLS:
            points = sorted((r["T"], r["tflops"]) for r in rows if r["shape"] == shape and r["impl"] == impl)
            if points:
                ax.plot(*zip(*points), marker="o", label=impl)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(shape)
        ax.set_xlabel("tokens T")
        ax.set_ylabel(f"TFLOP/s ({flops})")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)


def summarize(result: dict) -> str:
    """A short text table of the result, printed last by the command."""
    if result["name"] == RESULT_NAMES["train"]:
        return moe_training.summarize(result)
    if result["name"] in SWEEP_RESULT_NAMES.values():
        return result["meta"]["best_configs"]
    error = "largest gradient rel error" if result["name"] == RESULT_NAMES["fwd+bwd"] else "rel error"
    impls = [i for i in IMPLS if any(r["impl"] == i for r in result["rows"])]
    versus = " | speedup vs gmm [95% CI]" + (" | vs sonic" if "sonic" in impls else "")
    lines = [f"shape T | TFLOP/s {' / '.join(impls)}{versus} | {error} ours (PyTorch's)"]
    cases = dict.fromkeys((r["shape"], r["T"]) for r in result["rows"])
    for shape, T in cases:
        by_impl = {r["impl"]: r for r in result["rows"] if r["shape"] == shape and r["T"] == T}
        ours = by_impl.get("ours")
        tflops = " / ".join(f"{by_impl[i]['tflops']:.0f}" if i in by_impl else "-" for i in impls)
        line = f"{shape} {T} | {tflops}"
        if ours is not None and "speedup_vs_gmm" in ours:
            line += f" | {ours['speedup_vs_gmm']:.2f} [{ours['speedup_lo']:.2f}, {ours['speedup_hi']:.2f}]"
        if ours is not None and "speedup_vs_sonic" in ours:
            line += (f" | {ours['speedup_vs_sonic']:.2f} [{ours['speedup_sonic_lo']:.2f}, "
                     f"{ours['speedup_sonic_hi']:.2f}]")
        if ours is not None:
            line += f" | {ours['rel_error']:.1e} ({ours['torch_rel_error']:.1e})"
        lines.append(line)
    return "\n".join(lines)
