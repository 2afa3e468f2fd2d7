"""Train Tc models of candidate options on one fold, to choose the defaults of `tc train`.

    python -m flashmoe_science.bench.sweeps.tc --data supercon.pt [--variants JSON] [--out DIR]

The data is a features file of `flashmoe-science tc featurize`. Every candidate trains on folds
1-4 of the random 5-fold split of the superconductors (Tc > 0) and is scored on fold 0 (R², RMSE,
MAE, accuracy at 10 K), and on 3,000 of its training compounds (`train_r2`: a model that cannot
fit what it trained on needs capacity or better inputs, not regularisation). `--variants`: a JSON
list of [name, model options, training options] (default: VARIANTS). Rows go to
DIR/tc_sweep.json as each candidate finishes, so a run stopped at a time limit keeps the ones
done.
"""
from __future__ import annotations

import argparse
import json
import time

import torch

from ...science import tc
from ..common import environment, write_results

# [name, TcSetTransformer options, train_model options]
VARIANTS = [["log1p", {"target": "log1p", "fraction_frequencies": 0}, {"epochs": 60, "lr": 2e-3}],
            ["kelvin", {"target": "kelvin", "fraction_frequencies": 0}, {"epochs": 60, "lr": 2e-3}],
            ["kelvin-fourier16", {"target": "kelvin", "fraction_frequencies": 16}, {"epochs": 60, "lr": 2e-3}],
            ["kelvin-fourier16-d256-L4", {"target": "kelvin", "fraction_frequencies": 16, "dim": 256, "depth": 4},
             {"epochs": 100, "lr": 1e-3}],
            ["d256-L4-stats", {"dim": 256, "depth": 4, "composition_stats": True}, {"epochs": 100, "lr": 1e-3}],
            ["d256-L4-stats-dropout0.1", {"dim": 256, "depth": 4, "composition_stats": True, "dropout": 0.1},
             {"epochs": 100, "lr": 1e-3}]]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="features file written by `flashmoe-science tc featurize`")
    parser.add_argument("--variants", default=None, help="JSON list of [name, model options, training options]")
    parser.add_argument("--out", default="out/results")
    args = parser.parse_args(argv)
    variants = json.loads(args.variants) if args.variants else VARIANTS
    compounds, table, _ = tc.load_features(args.data)
    superconductors = [c for c in compounds if c.tc > 0]
    fold_of = tc.assign_folds(superconductors, 5, "random", 0)
    train = [c for c, f in zip(superconductors, fold_of) if f != 0]
    test = [c for c, f in zip(superconductors, fold_of) if f == 0]
    device = "cuda" if torch.cuda.is_available() else "cpu"
    backend = "kernels" if device == "cuda" else "torch"
    meta = {**environment(), "data": args.data, "train": len(train), "test": len(test), "backend": backend}
    rows = []
    for name, model_options, train_options in variants:
        start = time.perf_counter()
        row = {"name": name, "model_options": model_options, "train_options": train_options}
        try:
            model, losses, *_ = tc.train_model(train, table, device, backend=backend, model_options=model_options,
                                                 **train_options)
        except (RuntimeError, ValueError) as exc:  # a candidate that diverges, does not fit, or is malformed
            row["error"] = f"{type(exc).__name__}: {exc}"[:300]
        else:
            row.update(tc.metrics(tc.predict(model, test, device), [c.tc for c in test]))
            row["train_r2"] = tc.metrics(tc.predict(model, train[:3000], device), [c.tc for c in train[:3000]])["r2"]
            row["last_loss"] = losses[-1]
        row["seconds"] = time.perf_counter() - start
        rows.append(row)
        print(name, {k: round(v, 4) if isinstance(v, float) else v for k, v in row.items() if k != "name"}, flush=True)
        write_results(args.out, "tc_sweep", rows, meta)


if __name__ == "__main__":
    main()
