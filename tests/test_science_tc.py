"""Superconductor Tc screening (`flashmoe_science.science.tc`): parsing, duplicate merging, folds,
the set transformer on both backends, a training run that learns, the outputs' schema and
determinism, on a few hundred synthetic rows of real formulas (CPU)."""
import csv
import json
import random
import warnings

import pytest
import torch

pytest.importorskip("pymatgen.core")
pytest.importorskip("matminer")
pytest.importorskip("sklearn")

from flashmoe_science.science import tc  # noqa: E402

ELEMENTS = ["Cu", "O", "Ba", "Y", "Fe", "As", "Nb", "Sn", "Mg", "B", "La", "Sr", "K", "Se"]


def synthetic_rows(n, seed=0):
    """(formula, Tc) with a learnable rule: cuprates warm, pnictides middling, the rest cold."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        elements = rng.sample(ELEMENTS, rng.randint(2, 5))
        formula = "".join(f"{el}{rng.choice([1, 2, 3, 0.5, 1.5])}" for el in elements)
        tc_k = 60.0 if {"Cu", "O"} <= set(elements) else 20.0 if {"Fe", "As"} <= set(elements) else 1.0
        rows.append((formula, round(tc_k * rng.uniform(0.8, 1.2), 2)))
    return rows


def write_csv(path, rows):
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["name", "Tc"])
        writer.writerows(rows)
    return path


def test_parsing_merges_duplicates_and_names_malformed_rows(tmp_path):
    path = write_csv(tmp_path / "d.csv", [("Ba0.4K0.6Fe2As2", 31.0), ("K0.6Ba0.4Fe2As2", 33.0), ("MgB2", 39.0),
                                          ("Xx2O3", 5.0), ("Nb3Sn", "n/a"), ("YBa2Cu3O7", 92.0)])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        compounds = tc.load_supercon(path)
    messages = [str(w.message) for w in caught]
    assert any("line 5" in m and "Xx2O3" in m for m in messages)
    assert any("line 6" in m and "Tc" in m for m in messages)
    by_formula = {c.formula: c for c in compounds}
    assert set(by_formula) == {"K0.6Ba0.4Fe2As2", "MgB2", "Ba2YCu3O7"}  # pymatgen's reduced formulas
    merged = by_formula["K0.6Ba0.4Fe2As2"]
    assert merged.count == 2 and merged.tc == pytest.approx(32.0)
    assert sum(merged.fractions) == pytest.approx(1.0)
    with pytest.raises(ValueError, match="line 5"):
        tc.load_supercon(path, on_error="stop")


def test_cluster_folds_keep_each_element_set_in_one_fold(tmp_path):
    compounds = tc.load_supercon(write_csv(tmp_path / "d.csv", synthetic_rows(300)))
    folds = tc.assign_folds(compounds, 4, "cluster")
    fold_of_set = {}
    for c, f in zip(compounds, folds):
        assert fold_of_set.setdefault(c.element_set, f) == f
    sizes = [folds.count(f) for f in range(4)]
    assert min(sizes) > 0
    for bad in (0, 1, 2.0, True):
        with pytest.raises(ValueError, match="folds must be an int >= 2"):
            tc.assign_folds(compounds, bad)
    random_folds = tc.assign_folds(compounds, 4, "random")
    assert max(random_folds.count(f) for f in range(4)) - min(random_folds.count(f) for f in range(4)) <= 1


@pytest.mark.parametrize("stats", [False, True], ids=["tokens", "composition_stats"])
@pytest.mark.parametrize("backend", ["torch", "torch_grouped_mm"])
def test_kernel_and_pytorch_backends_compute_the_same_model(backend, stats, device):
    compounds = [tc.Compound(f, *tc.parse_formula(f)[1:], tc=1.0) for f in ("YBa2Cu3O7", "MgB2", "Nb3Sn", "Fe")]
    table = tc.element_table()
    torch.manual_seed(0)
    options = dict(dim=32, heads=2, depth=2, experts=4, expert_dim=16, composition_stats=stats)
    ours = tc.TcSetTransformer(table, **options).to(device)
    plain = tc.TcSetTransformer(table, **options, backend=backend).to(device)
    plain.load_state_dict(ours.state_dict())
    batch = tc.pack(compounds, device)[:4]
    tol = 3e-2 if backend == "torch_grouped_mm" and device.type == "cuda" else 1e-4  # bf16 grouped_mm on a GPU
    torch.testing.assert_close(ours(*batch), plain(*batch), atol=tol, rtol=tol)


def test_composition_statistics_are_each_compounds_weighted_mean_deviation_min_and_max():
    formulas = ("YBa2Cu3O7", "MgB2", "Nb3Sn", "Fe", "La1.85Sr0.15CuO4")
    compounds = [tc.Compound(f, *tc.parse_formula(f)[1:], tc=1.0) for f in formulas]
    table = tc.element_table()
    model = tc.TcSetTransformer(table, dim=32, heads=2, depth=1, experts=2, expert_dim=16, composition_stats=True)
    z, frac, cu, _, _ = tc.pack(compounds, "cpu")
    seq = torch.repeat_interleave(torch.arange(len(compounds)), (cu[1:] - cu[:-1]).long())
    stats = model._composition_stats(z, frac, seq, len(compounds))
    for i, c in enumerate(compounds):
        props = table[torch.tensor(c.elements)].double()
        w = torch.tensor(c.fractions, dtype=torch.float64)[:, None]
        mean = (w * props).sum(0)
        expected = torch.cat([mean, (w * (props - mean).abs()).sum(0), props.min(0).values, props.max(0).values])
        torch.testing.assert_close(stats[i].double(), expected, atol=1e-5, rtol=1e-5)
    model.eval()  # dropout is off outside training: predictions repeat
    with_dropout = tc.TcSetTransformer(table, dim=32, heads=2, depth=1, experts=2, expert_dim=16, dropout=0.5).eval()
    batch = tc.pack(compounds, "cpu")[:4]
    torch.testing.assert_close(with_dropout(*batch), with_dropout(*batch))


def test_backend_speed_comparison_times_each_backend(tmp_path):
    compounds = tc.load_supercon(write_csv(tmp_path / "d.csv", synthetic_rows(16)))
    speed = tc.compare_backends(compounds, "cpu", batch_size=16, model_options=dict(dim=32, heads=2, depth=1,
                                                                                    experts=4, expert_dim=16))
    assert set(speed) == set(tc.SPEED_SIDES)
    assert all(row["seconds_per_epoch"] > 0 and row["tokens_per_s"] > 0 for row in speed.values())


def test_training_learns_and_is_deterministic(tmp_path):
    compounds = tc.load_supercon(write_csv(tmp_path / "d.csv", synthetic_rows(240)))
    # The plain fraction encoding: the synthetic Tc is smooth in the fractions, and 120 training
    # compounds are too few for the Fourier fraction features not to overfit.
    options = dict(dim=32, heads=2, depth=1, experts=4, expert_dim=16, fraction_frequencies=0)
    runs = []
    for _ in range(2):
        folds, mean, models, predictions = tc.run_cross_validation(compounds, folds=2, split="random", epochs=30,
                                                                   device="cpu", backend="torch", batch_size=16,
                                                                   model_options=options)
        runs.append((folds, mean))
    folds, mean = runs[0]
    assert all(row["losses"][-1] < 0.5 * row["losses"][0] for row in folds)
    assert mean["model"]["r2"] > 0.5 and -1 < mean["baseline"]["r2"] <= 1
    assert [r["model"] for r in runs[0][0]] == [r["model"] for r in runs[1][0]]
    meta = {"model_options": {**options, "backend": "torch"}}
    assert models[0].options == {**models[0].options, **meta["model_options"]}
    path = tc.write_outputs(tmp_path / "out", folds, mean, models, predictions, meta)
    saved = json.loads(path.read_text())
    for side in ("model", "baseline"):
        assert set(saved["mean"][side]) == {"r2", "rmse_k", "mae_k", "accuracy_10k"}
    assert {"train_seconds", "tokens_per_s", "losses"} <= set(saved["folds"][0])
    ensemble = tc.load_ensemble(tmp_path / "out" / "model.pt", "cpu")
    predicted, spread = tc.predict_formulas(ensemble, ["YBa2Cu3O7", "MgB2"], "cpu")
    assert predicted[0] > predicted[1] and spread.shape == (2,)


def test_featurized_file_trains_without_pymatgen_or_matminer(tmp_path):
    """tc featurize writes what training needs once; tc train reads it where neither library is
    installed (blocked here in a subprocess), with the same metrics as from the CSV."""
    import subprocess
    import sys

    data = write_csv(tmp_path / "d.csv", synthetic_rows(60))
    compounds = tc.load_supercon(data)
    features_path = tc.featurize(compounds, tmp_path / "features.pt")
    loaded, table, features = tc.load_features(features_path)
    assert [vars(c) for c in loaded] == [vars(c) for c in compounds]
    assert torch.equal(table, tc.element_table()) and (features == tc.magpie_features(compounds)).all()
    with pytest.raises(ValueError, match="not a features file"):
        torch.save({"rows": []}, tmp_path / "other.pt")
        tc.load_features(tmp_path / "other.pt")

    options = ["--folds", "2", "--epochs", "2", "--dim", "32", "--depth", "1", "--experts", "4", "--device", "cpu",
               "--backend", "torch"]
    code = ("import sys; sys.modules['pymatgen'] = sys.modules['matminer'] = None\n"
            "from flashmoe_science.cli import main\n"
            f"sys.exit(main(['tc', 'train', '--data', {str(features_path)!r}, '--out', {str(tmp_path / 'a')!r}, "
            f"*{options!r}]))")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    from flashmoe_science.cli import main

    assert main(["tc", "train", "--data", str(data), "--out", str(tmp_path / "b"), *options]) == 0
    metrics = [json.loads((tmp_path / side / "metrics.json").read_text())["mean"] for side in ("a", "b")]
    assert metrics[0] == metrics[1]


def test_option_sweep_scores_each_candidate_on_the_held_out_fold(tmp_path):
    """bench/sweeps/tc.py: each candidate's held-out and training scores, written as it finishes;
    a candidate that fails is a row with its error, and the sweep goes on."""
    from flashmoe_science.bench.sweeps import tc as sweep

    compounds = tc.load_supercon(write_csv(tmp_path / "d.csv", synthetic_rows(60)))
    features = tc.featurize(compounds, tmp_path / "features.pt", baseline=False)
    tiny = {"dim": 16, "heads": 2, "depth": 1, "experts": 4, "expert_dim": 16}
    variants = [["tiny", tiny, {"epochs": 2, "batch_size": 16}],
                ["bad", {**tiny, "target": "celsius"}, {"epochs": 1}]]
    sweep.main(["--data", str(features), "--variants", json.dumps(variants), "--out", str(tmp_path)])
    rows = json.loads((tmp_path / "tc_sweep.json").read_text())["rows"]
    assert [r["name"] for r in rows] == ["tiny", "bad"]
    assert {"r2", "rmse_k", "mae_k", "accuracy_10k", "train_r2", "last_loss"} <= set(rows[0])
    assert "target must be one of" in rows[1]["error"]
