"""`bench moe` end to end on a tiny shape (the interpreter on the CPU), so that a mistake in the
benchmark shows here rather than after a GPU run."""
import argparse
import math

import pytest
import torch

from flashmoe_science.bench import moe


def parse(*argv):
    parser = argparse.ArgumentParser()
    moe.add_arguments(parser)
    args = parser.parse_args(["--quick", *argv])
    args.repeats, args.warmup, args.rep, args.out = 1, 1, 1, None
    args.progress = lambda items, desc="": items
    return args


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run covers this at real shapes")
def test_bench_rows_and_correctness_columns():
    result = moe.run(parse("--tokens", "5"))
    rows = {r["impl"]: r for r in result["rows"]}
    assert result["name"] == "moe" and set(rows) == {"ours", "gmm", "naive"}
    ours = rows["ours"]
    assert ours["path"] == "decode" and "BLOCK_M=" in ours["config"]
    assert ours["rel_error"] < 1e-5 and rows["naive"]["rel_error"] < 1e-5  # fp32 on the CPU
    assert ours["touched_experts"] >= 2 and ours["ms_lo"] <= ours["ms"] <= ours["ms_hi"]
    assert rows["gmm"]["speedup_vs_gmm"] == pytest.approx(1.0)
    assert math.isclose(ours["tflops"], 6 * 5 * 2 * 64 * 32 / (ours["ms"] * 1e-3) / 1e12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run covers this at real shapes")
def test_sweep_prints_a_table_for_each_bucket():
    result = moe.run(parse("--sweep", "--tokens", "1", "33"))
    table = result["meta"]["best_configs"]
    assert table.splitlines()[1] == "EXPERTS[80][4] = ("
    assert "    (8, X(" in table and "    (None, X(" in table
    assert {r["gemm"] for r in result["rows"]} == {"gate_up", "down"}


def test_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"shape": "s", "impl": impl, "T": T, "tflops": float(T)} for impl in moe.IMPLS for T in (1, 16)]
    moe.plot(rows, tmp_path / "moe.png")
    assert (tmp_path / "moe.png").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run covers this at real shapes")
def test_fwd_bwd_rows_and_gradient_columns():
    result = moe.run(parse("--mode", "fwd+bwd", "--tokens", "33"))
    rows = {r["impl"]: r for r in result["rows"]}
    assert result["name"] == "moe_fwd_bwd" and set(rows) == {"ours", "gmm", "naive"}
    ours = rows["ours"]
    assert ours["mode"] == "fwd+bwd" and "grad_w1" in ours["backward_config"]
    assert math.isclose(ours["tflops"], 18 * 33 * 2 * 64 * 32 / (ours["ms"] * 1e-3) / 1e12)
    for impl, row in rows.items():  # fp32 on the CPU: every gradient close to float64
        assert row["rel_error"] < 1e-5, impl
        assert row["rel_error"] == max(row[f"rel_error_d{g}"] for g in ("x", "w1", "w2", "router_logits"))
    assert ours["torch_rel_error"] == rows["naive"]["rel_error"]
    assert "tiny 33" in moe.summarize(result)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run covers this at real shapes")
def test_train_rows_loss_curves_and_step_times():
    result = moe.run(parse("--mode", "train", "--steps", "2", "--log-every", "1"))
    assert result["name"] == "moe_train"
    curves = {impl: [(r["step"], r["loss"]) for r in result["rows"] if r["impl"] == impl] for impl in ("ours", "torch")}
    assert [s for s, _ in curves["ours"]] == [s for s, _ in curves["torch"]] == [1, 2]
    # fp32 on the CPU, same initial weights and batches: the curves agree closely.
    for (_, a), (_, b) in zip(curves["ours"], curves["torch"]):
        assert abs(a - b) < 1e-4 * b
    meta = result["meta"]
    assert meta["curves_match"] and meta["max_loss_gap"] < 1e-4
    assert meta["speedup"] == pytest.approx(meta["torch_step_ms"] / meta["ours_step_ms"])
    assert "final loss ours" in moe.summarize(result)


def test_train_plot(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [{"mode": "train", "impl": impl, "step": step, "loss": 1.0 / step, "step_ms": 2.0}
            for impl in ("ours", "torch") for step in (10, 20)]
    moe.plot(rows, tmp_path / "moe_train.png")
    assert (tmp_path / "moe_train.png").stat().st_size > 0
