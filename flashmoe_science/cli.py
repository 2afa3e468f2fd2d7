"""`flashmoe-science`: doctor, bench, report and configs commands.

On a machine without a CUDA GPU the command turns on Triton's CPU interpreter before any kernel
is defined, runs at small sizes, and says so.
"""
from __future__ import annotations

import argparse
import os
import sys

BENCHMARKS = ("attention", "moe", "model", "ep")


def _use_interpreter_without_gpu(announce: bool) -> bool:
    """Without a GPU, run kernels through Triton's interpreter; `announce` says so on stderr (the
    doctor says it in its own report)."""
    import torch

    if torch.cuda.is_available():
        return False
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        os.environ["TRITON_INTERPRET"] = "1"
    if announce:
        print("No CUDA GPU found: kernels run through Triton's CPU interpreter (TRITON_INTERPRET=1) at small "
              "sizes. Correctness is real; timings are CPU timings, not GPU figures.", file=sys.stderr)
    return True


def _bench(args) -> int:
    import importlib

    from .bench.common import environment, progress, write_results

    module = importlib.import_module(f"flashmoe_science.bench.{args.op}")
    args.progress = progress
    command = " ".join(sys.argv[1:])
    partial = f"{args.op}_partial"
    # Rows measured so far, rewritten as they come (`bench.attention.run`), removed once the run ends.
    partial_meta = {**environment(), "command": command, "partial": True}
    args.checkpoint = lambda rows: write_results(args.out, partial, rows, partial_meta)
    result = module.run(args)
    if result is None:  # a rank other than 0 of a distributed benchmark, or its launcher: rank 0 writes
        return 0
    meta = {**environment(), **result.get("meta", {}), "command": command}
    json_path = write_results(args.out, result["name"], result["rows"], meta)
    (json_path.parent / f"{partial}.json").unlink(missing_ok=True)
    written = [json_path]
    if not args.no_plot and hasattr(module, "plot"):
        png = json_path.with_suffix(".png")
        try:
            module.plot(result["rows"], png)
        except ImportError as exc:
            print(f"plot skipped ({exc}): pip install 'flashmoe-science[bench]' for plots", file=sys.stderr)
        else:
            if png.exists():
                written.append(png)
    if hasattr(module, "summarize"):
        print(module.summarize(result))
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _doctor(args) -> int:
    from .doctor import run

    return run(quick=args.quick)


def _report(args) -> int:
    from .bench.report import update_readme

    stale = []
    for document in args.documents:
        changed = update_readme(args.results, document, check=args.check)
        stale += [document] if changed else []
        if not args.check:
            print(f"{document} {'updated' if changed else 'already up to date'}")
    if args.check and stale:
        print(f"{', '.join(stale)} out of date with {args.results}: run `flashmoe-science report`", file=sys.stderr)
        return 1
    return 0


def _tc(args) -> int:
    import torch

    from .science import tc
    from .bench.common import environment, progress

    if args.tc_command == "featurize":
        compounds = tc.load_supercon(args.data, limit=args.limit, on_error=args.on_error)
        path = tc.featurize(compounds, args.out, baseline=args.baseline != "none")
        print(f"wrote {path}: {len(compounds)} compounds")
        return 0

    gpu = torch.cuda.is_available() and args.device != "cpu"
    device = torch.device("cuda" if gpu else "cpu")
    backend = args.backend or ("kernels" if gpu else "torch")
    if not gpu:
        print(f"No GPU: the model runs on the CPU through PyTorch's reference paths (backend {backend}); use "
              "--limit to keep it small", file=sys.stderr)
    if args.tc_command == "train":
        table = features = None
        if str(args.data).endswith(".pt"):  # written by tc featurize: no pymatgen or matminer needed
            compounds, table, features = tc.load_features(args.data)
            if args.limit is not None:
                compounds, features = compounds[:args.limit], None if features is None else features[:args.limit]
            if features is None and args.baseline != "none":
                raise SystemExit(f"{args.data} holds no baseline features (featurized with --baseline none): "
                                 "train with --baseline none, or featurize again")
        else:
            compounds = tc.load_supercon(args.data, limit=args.limit, on_error=args.on_error)
        if args.superconductors_only:
            keep = [i for i, c in enumerate(compounds) if c.tc > 0]
            compounds = [compounds[i] for i in keep]
            features = None if features is None else features[keep]
        options = dict(dim=args.dim, depth=args.depth, experts=args.experts,
                       composition_stats=args.composition_stats, dropout=args.dropout)
        folds, mean, models, predictions = tc.run_cross_validation(
            compounds, folds=args.folds, split=args.split, epochs=args.epochs, device=device, backend=backend,
            baseline=args.baseline != "none", seed=args.seed, lr=args.lr, model_options=options, progress=progress,
            table=table, features=features, cuda_graphs=args.cuda_graphs, ensemble=args.ensemble)
        meta = {**environment(), "data": str(args.data), "compounds": len(compounds), "split": args.split, "folds": args.folds,
                "epochs": args.epochs, "lr": args.lr, "device": str(device), "seed": args.seed,
                "superconductors_only": args.superconductors_only, "cuda_graphs": args.cuda_graphs,
                "ensemble": args.ensemble,
                "model_options": models[0].options}
        if args.compare_backends:
            meta["speed"] = tc.compare_backends(compounds, device, model_options=options, seed=args.seed, table=table)
            for name, row in meta["speed"].items():
                print(f"{name}: " + (row["error"] if "error" in row else
                                     f"{row['seconds_per_epoch']:.2f} s per epoch, {row['tokens_per_s']:.0f} tokens/s"))
        path = tc.write_outputs(args.out, folds, mean, models, predictions, meta)
        for side, m in mean.items():
            print(f"{side}: R2 {m['r2']:.3f}  RMSE {m['rmse_k']:.2f} K  MAE {m['mae_k']:.2f} K  "
                  f"accuracy at 10 K {m['accuracy_10k']:.3f}")
        print(f"wrote {path}")
        return 0
    models = tc.load_ensemble(args.model, device)
    if args.tc_command == "predict":
        formulas = args.formulas
    else:
        import csv

        with open(args.candidates, newline="") as f:
            formulas = [row[0] for row in csv.reader(f) if row and row[0] not in ("name", "formula")]
    mean, spread = tc.predict_formulas(models, formulas, device)
    ranked = sorted(zip(formulas, mean.tolist(), spread.tolist()), key=lambda r: -r[1])
    for formula, tc_k, sd in ranked[:args.top] if args.tc_command == "screen" else zip(formulas, mean.tolist(),
                                                                                       spread.tolist()):
        print(f"{formula}\t{tc_k:.1f} K\t± {sd:.1f}")
    return 0


def _configs(args) -> int:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "flashmoe_science.target_compile", *args.targets],
                          env=env, capture_output=True, text=True)
    if not proc.stdout:
        print(proc.stderr, file=sys.stderr)
        return 1
    import json

    rows = json.loads(proc.stdout)
    for r in rows:
        status = "fits" if r["fits"] else ("ERROR " + r["error"] if r["error"] else "DOES NOT FIT")
        registers = f"{r.get('registers')} regs, {r.get('spill_stores')} B spilled" if r["fits"] else ""
        print(f"{r['target']:>5}  {str(r['shared']):>7} / {r['limit']:>6} B  {status:<5}  {registers:<24}  "
              f"{r['label']}")
    return proc.returncode


def build_parser():
    """The argument parser, and the bench subparsers by operation (to which each benchmark
    module adds its own options once it is imported)."""
    parser = argparse.ArgumentParser(prog="flashmoe-science", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    doctor = sub.add_parser("doctor", help="environment, which kernels and configs run, correctness, speed")
    doctor.add_argument("--quick", action="store_true", help="fewer shapes")
    doctor.set_defaults(func=_doctor)

    bench = sub.add_parser("bench", help="benchmark against PyTorch, writing JSON and a plot")
    bench_sub = bench.add_subparsers(dest="op", required=True)
    op_parsers = {}
    for op in BENCHMARKS:
        p = op_parsers[op] = bench_sub.add_parser(op, help=f"{op} benchmark")
        p.add_argument("--repeats", type=int, default=5, help="independent timings per measurement (interval)")
        p.add_argument("--warmup", type=float, default=25, help="warm-up per timing, ms")
        p.add_argument("--rep", type=float, default=100, help="timed time per timing, ms")
        p.add_argument("--out", default="benchmarks/results", help="output folder")
        p.add_argument("--quick", action="store_true", help="a small subset")
        p.add_argument("--no-plot", action="store_true", help="skip the PNG plot")
        p.set_defaults(func=_bench)
    report = sub.add_parser("report", help="regenerate the benchmark tables of the README and docs from results files")
    report.add_argument("--results", default="benchmarks/results")
    report.add_argument("--documents", nargs="+", default=["README.md", "docs/benchmarks.md"])
    report.add_argument("--check", action="store_true", help="fail if the README is out of date")
    report.set_defaults(func=_report)

    tc = sub.add_parser("tc", help="superconductor Tc from composition (SuperCon; the science extra)")
    tc_sub = tc.add_subparsers(dest="tc_command", required=True)
    train = tc_sub.add_parser("train", help="cross-validated training, against a Magpie gradient-boosting baseline")
    train.add_argument("--data", required=True,
                       help="SuperCon CSV (columns name, Tc), or a .pt file written by tc featurize")
    train.add_argument("--out", required=True,
                       help="output folder: metrics.json, predictions.csv, model.pt, parity.png")
    train.add_argument("--epochs", type=int, default=100)
    train.add_argument("--folds", type=int, default=5)
    train.add_argument("--split", choices=["random", "cluster"], default="random")
    train.add_argument("--limit", type=int, default=None,
                       help="read only the first N rows (compounds of a features file)")
    train.add_argument("--superconductors-only", action="store_true", help="drop compounds with Tc = 0")
    train.add_argument("--baseline", choices=["gbt", "none"], default="gbt")
    train.add_argument("--on-error", choices=["skip", "stop"], default="skip", help="on a malformed row")
    train.add_argument("--dim", type=int, default=256)
    train.add_argument("--depth", type=int, default=4)
    train.add_argument("--experts", type=int, default=8)
    train.add_argument("--lr", type=float, default=1e-3, help="peak learning rate of the one-cycle schedule")
    train.add_argument("--composition-stats", action="store_true",
                       help="also feed the head Magpie's composition statistics (weighted mean and deviation, "
                            "minimum, maximum of the elemental properties)")
    train.add_argument("--dropout", type=float, default=0.0, help="dropout on each block's residual branches")
    train.add_argument("--seed", type=int, default=0)
    train.add_argument("--ensemble", type=int, default=3,
                       help="models per fold, each from a seed of its own, scored on their mean prediction (one "
                            "model: about a third of the time; on SuperCon 0.008-0.018 R² less)")
    train.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=None,
                       help="replay each full batch's training step as a CUDA graph (default: on the kernels on a GPU)")
    train.add_argument("--compare-backends", action="store_true",
                       help="also time training epochs with our kernels (with and without CUDA graphs), PyTorch "
                            "(padded SDPA, per-expert loop) and PyTorch with torch._grouped_mm, from the same weights")
    featurize = tc_sub.add_parser("featurize", help="parse the formulas and compute the baseline's features once, "
                                                    "into a file tc train reads without pymatgen or matminer")
    featurize.add_argument("--data", required=True, help="SuperCon CSV (columns name, Tc)")
    featurize.add_argument("--out", required=True, help="the features file (.pt)")
    featurize.add_argument("--limit", type=int, default=None, help="read only the first N rows")
    featurize.add_argument("--baseline", choices=["gbt", "none"], default="gbt",
                           help="gbt: also the Magpie features the baseline trains on")
    featurize.add_argument("--on-error", choices=["skip", "stop"], default="skip", help="on a malformed row")
    featurize.set_defaults(func=_tc)
    for p in (train, tc_sub.add_parser("predict", help="predicted Tc of formulas, with the ensemble's spread"),
              tc_sub.add_parser("screen", help="the highest predicted Tc among candidate compositions")):
        p.add_argument("--device", choices=["cpu", "cuda"], default=None)
        p.add_argument("--backend", choices=["kernels", "torch"], default=None,
                       help="our kernels (default on a GPU) or PyTorch's reference paths (default on the CPU)")
        p.set_defaults(func=_tc)
    tc_sub.choices["predict"].add_argument("model", help="model.pt written by tc train")
    tc_sub.choices["predict"].add_argument("formulas", nargs="+")
    tc_sub.choices["screen"].add_argument("model", help="model.pt written by tc train")
    tc_sub.choices["screen"].add_argument("candidates", help="CSV whose first column holds formulas")
    tc_sub.choices["screen"].add_argument("--top", type=int, default=20)

    configs = sub.add_parser("configs", help="compile every shipped kernel config for GPU targets: shared memory, "
                                             "registers, spills")
    configs.add_argument("targets", nargs="*", help="e.g. sm80 sm89 (default: all supported)")
    configs.set_defaults(func=_configs)
    return parser, op_parsers


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] in (["doctor"], ["bench"]):
        _use_interpreter_without_gpu(announce=argv[:1] == ["bench"])
    parser, op_parsers = build_parser()
    if argv[:1] == ["bench"] and len(argv) > 1 and argv[1] in BENCHMARKS:
        # Imported only now, after the interpreter decision, since importing defines kernels.
        import importlib

        importlib.import_module(f"flashmoe_science.bench.{argv[1]}").add_arguments(op_parsers[argv[1]])
    args = parser.parse_args(argv)
    args.argv = argv  # what `bench ep` passes on when it starts itself under torchrun
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
