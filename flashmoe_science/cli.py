"""`flashmoe-science`: doctor, bench, report and configs commands.

On a machine without a CUDA GPU the command turns on Triton's CPU interpreter before any kernel
is defined, runs at small sizes, and says so.
"""
from __future__ import annotations

import argparse
import os
import sys

BENCHMARKS = ("attention", "moe", "model")


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
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
