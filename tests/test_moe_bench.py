"""`bench moe` end to end on a tiny shape (the interpreter on the CPU), so that a mistake in the
benchmark shows here rather than after a GPU run."""
import argparse
import math
from dataclasses import asdict, astuple

import pytest
import torch

from flashmoe_science.bench import moe
from flashmoe_science.bench.sweeps import moe as moe_sweeps
from flashmoe_science.moe import configs


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
    assert result["meta"]["sonic"] == "SonicMoE needs a CUDA GPU"  # a default side, skipped with its reason
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


def test_sweep_table_keeps_the_entrys_gluon_down_where_its_blocks_and_descriptors_stay():
    """The forward sweep times the Triton kernels: a picked prefill entry with the table's BLOCK_M
    and descriptors keeps the table's Gluon down stages; another pick drops them."""
    table = configs.EXPERTS[90][2]
    entry = dict(table)[None]
    assert entry.gluon_down_stages

    def rows(block_m, tma):
        return [{"shape": "s", "T": 1, "bucket": moe_sweeps._bucket_name(bound), "gemm": gemm, "block_m": block_m,
                 "tma": tma, **asdict(configs.GemmConfig(128, 64, 8, 8, 4)), "ms": 1.0, "error": None}
                for bound, _ in table for gemm in ("gate_up", "down")]
    kept = moe_sweeps._best_table(rows(entry.block_m, True), table, 90, 2, torch.bfloat16).splitlines()[-2]
    assert kept.startswith("    (None, X(128, ") and kept.endswith(f", tma=True, gluon_down_stages={entry.gluon_down_stages})),")
    dropped = moe_sweeps._best_table(rows(entry.block_m, False), table, 90, 2, torch.bfloat16).splitlines()[-2]
    assert "gluon_down_stages" not in dropped


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run covers this at real shapes")
def test_backward_sweep_times_each_kernel_and_prints_table_entries():
    result = moe.run(parse("--sweep", "--mode", "fwd+bwd", "--tokens", "33", "40"))
    rows = result["rows"]
    assert result["name"] == "moe_backward_sweep"
    # --quick: two candidates per kernel (the table's first), both right (fp32 on the CPU).
    for kernel in moe_sweeps.BACKWARD_KERNELS:
        for T in (33, 40):
            ran = [r for r in rows if r["kernel"] == kernel and r["T"] == T]
            assert len(ran) == 2 and all(r["error"] is None and r["rel_diff"] < 1e-5 for r in ran), ran
    table = result["meta"]["best_configs"]
    assert moe.summarize(result) == table
    # Every case lays out blocks of 64 rows (fp32 table), so one BACKWARD entry, naming timed configurations.
    (line,) = [line for line in table.splitlines() if not line.startswith("#")]
    target, source = line.split(" = ")
    assert target == "BACKWARD[80][4][64]"
    entry = eval(source, {"B": configs.BackwardConfig, "G": configs.GemmConfig, "W": configs.WeightGradConfig})
    for kernel in moe_sweeps.BACKWARD_KERNELS:
        cfg = getattr(entry, kernel)
        assert type(cfg) is type(getattr(configs.BACKWARD[80][4][64], kernel))
        assert {r["T"] for r in rows if r["kernel"] == kernel and moe_sweeps._config_values(type(cfg), r) == astuple(cfg)} \
            == {33, 40}, kernel


def test_backward_best_table_marks_kept_entries_and_skips_wrong_candidates():
    """Picks by the sum of time over each case's best; a wrong or failed candidate never wins, and a
    kernel with no candidate right on every case keeps the table's entry."""
    table = configs.BACKWARD[90][2]
    def row(kernel, T, cfg, ms, error=None, gluon_stages=0):
        return {"shape": "s", "T": T, "forward_block_m": 128, "kernel": kernel, "block_m": 128, **asdict(cfg),
                "gluon_stages": gluon_stages, "ms": ms, "error": error}
    fast, slow = configs.GemmConfig(64, 64, 8, 8, 3), configs.GemmConfig(256, 64, 8, 8, 4)
    rows = [row("grad_gate_up", 1, fast, 1.0), row("grad_gate_up", 2, fast, 4.0),
            row("grad_gate_up", 1, slow, 1.5), row("grad_gate_up", 2, slow, 2.0),  # 1 + 2 > 1.5 + 1
            row("grad_x", 1, fast, 0.1, "wrong: outputs differ"), row("grad_x", 1, slow, 1.0),
            row("grad_x", 2, fast, 1.0), row("grad_x", 2, slow, 1.0)]
    w = configs.WeightGradConfig(64, 128, 32, 8, 4, 4)
    rows += [row("grad_w1", T, w, 1.0) for T in (1, 2)] + [row("grad_w2", 1, w, 1.0)]
    text = moe_sweeps._best_backward_table(rows, table, 90, 2, torch.bfloat16)
    w2 = astuple(table[128].grad_w2)
    # grad_w1's rows picked its Triton kernel; grad_w2, kept, keeps the table's Gluon kernel.
    assert text.splitlines()[1] == (f"BACKWARD[90][2][128] = B(G(256, 64, 8, 8, 4), G(256, 64, 8, 8, 4), "
                                    f"W(64, 128, 32, 8, 4, 4), W{w2}, gluon_weight_grad_stages=3, "
                                    f"gluon_weight_grads=('grad_w2',))  # the table's grad_w2: no candidate "
                                    f"right on every case")
    # The Gluon d [gate, up] (its rows carry the table's GemmConfig) is a choice of its own.
    gluon = table[128].grad_gate_up
    rows += [row("grad_gate_up", T, gluon, 0.5, gluon_stages=3) for T in (1, 2)]
    text = moe_sweeps._best_backward_table(rows, table, 90, 2, torch.bfloat16)
    assert text.splitlines()[1].startswith(f"BACKWARD[90][2][128] = B(G{astuple(gluon)}, G(256, 64, 8, 8, 4), ")
    assert ", gluon_stages=3, gluon_weight_grad_stages=3, gluon_weight_grads=('grad_w2',))  # the table's grad_w2" \
        in text.splitlines()[1]
    # So is the Gluon weight-gradient kernel for each weight gradient.
    rows += [row("grad_w1", T, table[128].grad_w1, 0.5, gluon_stages=3) for T in (1, 2)]
    text = moe_sweeps._best_backward_table(rows, table, 90, 2, torch.bfloat16)
    assert (f"W{astuple(table[128].grad_w1)}, W{w2}, gluon_stages=3, gluon_weight_grad_stages=3)  # the table's "
            "grad_w2") in text.splitlines()[1]


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


def test_scaled_grouped_mm_reference_pads_groups_and_restores_token_order(monkeypatch):
    """PyTorch's FP8 path (the `scaled_gmm` comparator), with torch._scaled_grouped_mm emulated in
    float where the GPU kernel is missing: padded groups, scales and the token order come out
    right (within FP8's error of the float64 layer), and the padding is a multiple of 16."""
    from flashmoe_science.moe.fp8 import quantize_fp8_per_channel
    from flashmoe_science.moe.reference import fused_moe_scaled_grouped_mm, fused_moe_torch

    seen = []

    def emulated(a, b, scale_a, scale_b, offs, out_dtype):
        seen.append(offs.clone())
        out, start = torch.zeros(a.shape[0], b.shape[2]), 0
        for g, end in enumerate(offs.tolist()):
            out[start:end] = (a[start:end].float() * scale_a[start:end, None]) @ (b[g].float() * scale_b[g][None, :])
            start = end
        return out.to(out_dtype)

    monkeypatch.setattr(torch, "_scaled_grouped_mm", emulated)
    torch.manual_seed(0)
    x, logits = torch.randn(13, 64), torch.randn(13, 4)
    w1, w2 = torch.randn(4, 64, 64) / 8, torch.randn(4, 64, 32) / 6
    out = fused_moe_scaled_grouped_mm(x, *quantize_fp8_per_channel(w1), *quantize_fp8_per_channel(w2), logits, 2)
    ref = fused_moe_torch(x.double(), w1.double(), w2.double(), logits.double(), 2)
    assert ((out.double() - ref).norm() / ref.norm()) < 0.12
    assert all(int(v) % 16 == 0 for v in seen[0]) and len(seen) == 2


def test_fwd_bwd_table_reports_peak_memory_where_measured():
    """The forward+backward table adds each implementation's peak memory (measured on a GPU) as
    a second table, and leaves it out where no row has it (the CPU)."""
    from flashmoe_science.bench.report import render

    rows = [dict(shape="tiny", E=4, top_k=2, H=64, I=32, T=5, impl=impl, ms=1.0, tflops=1.0, peak_extra_mib=mib)
            for impl, mib in (("ours", 12.0), ("gmm", 30.0))]
    meta = {"gpu": "GPU", "command": "bench moe --mode fwd+bwd"}
    text = render("moe_fwd_bwd", {"rows": rows, "meta": meta})
    assert "| model | T | ours | grouped-mm |" in text and "| tiny | 5 | 12 | 30 |" in text
    for r in rows:
        del r["peak_extra_mib"]
    assert "Peak memory" not in render("moe_fwd_bwd", {"rows": rows, "meta": meta})


def test_sonic_side_gets_columns_and_a_speedup_with_interval():
    """Where SonicMoE ran, each of our rows carries its speed against it with a bootstrap interval
    and the table shows SonicMoE's time, TFLOP/s and that ratio; without it the table is as before."""
    from flashmoe_science.bench.report import render
    from flashmoe_science.bench.timing import Timing

    timings = {"ours": Timing(1.0, 0.99, 1.01, [0.99, 1.0, 1.01]), "gmm": Timing(2.0, 1.98, 2.02, [1.98, 2.0, 2.02]),
               "sonic": Timing(1.25, 1.24, 1.26, [1.24, 1.25, 1.26])}
    rows = {impl: dict(shape="tiny", E=4, top_k=2, H=64, I=32, T=5, impl=impl, ms=t.median_ms, tflops=1.0 / t.median_ms)
            for impl, t in timings.items()}
    moe._add_speedups(timings, rows)
    ours = rows["ours"]
    assert ours["speedup_vs_gmm"] == pytest.approx(2.0) and ours["speedup_vs_sonic"] == pytest.approx(1.25)
    assert ours["speedup_sonic_lo"] <= 1.25 <= ours["speedup_sonic_hi"] and ours["speedup_lo"] <= 2.0
    meta = {"gpu": "GPU", "command": "bench moe --mode fwd+bwd", "sonic": "sonic-moe 0.1.2.post1"}
    text = render("moe_fwd_bwd", {"rows": list(rows.values()), "meta": meta})
    assert "SonicMoE ms | SonicMoE TFLOP/s | ours / SonicMoE [95% CI] |" in text
    assert "| 1.250 | 1 | 1.25 [" in text and "SonicMoE: sonic-moe 0.1.2.post1" in text
    assert "SonicMoE" not in render("moe_fwd_bwd", {"rows": [rows["ours"], rows["gmm"]], "meta": meta})


def test_headline_moe_rows_name_sonic_where_the_run_had_it(tmp_path):
    """The README's MoE rows give ours against grouped_mm and, where the run timed it, SonicMoE,
    each with its ratio; without SonicMoE the row is as before."""
    import json

    from flashmoe_science.bench import report

    def write(impls):
        rows = [dict(shape="mixtral-8x7b", E=8, top_k=2, H=4096, I=14336, T=16384, impl=impl, ms=ms)
                for impl, ms in impls]
        (tmp_path / "moe_fwd_bwd.json").write_text(json.dumps({"rows": rows, "meta": {"gpu": "H100"}}))

    write([("ours", 50.0), ("gmm", 60.0), ("sonic", 45.0)])
    assert ("| MoE layer forward+backward | mixtral-8x7b T=16384 | 50.000 ms | 60.000 ms (grouped-mm) / "
            "45.000 ms (SonicMoE) | 1.20x / 0.90x | `moe_fwd_bwd.json` |") in report.render_headline(tmp_path)
    write([("ours", 50.0), ("gmm", 60.0)])
    assert ("| mixtral-8x7b T=16384 | 50.000 ms | 60.000 ms (grouped-mm) | 1.20x | `moe_fwd_bwd.json` |"
            in report.render_headline(tmp_path))


def test_sonic_autotuning_subset_keeps_the_listed_sm90_candidates_only(monkeypatch):
    """`--sonic-autotune subset` leaves each QuACK autotuner the sm90 candidates of
    `sonic.AUTOTUNE_SUBSET` (and every other GPU's); "all" leaves them as they are; anything else
    is refused by name. QuACK does not install on the CPU: a stand-in module of two autotuners."""
    import sys
    import types
    from dataclasses import dataclass

    from flashmoe_science.bench import sonic

    @dataclass(frozen=True)
    class Config:
        tile_m: int
        tile_n: int
        pingpong: bool
        cluster_m: int
        cluster_n: int
        device_capacity: int = 9

    class Candidate:
        def __init__(self, config):
            self.kwargs = {"config": config}

    class Tuner:
        def __init__(self, configs):
            self.configs = [Candidate(c) for c in configs]

        def prune_configs(self, kwargs):
            return self.configs

    every = [Config(m, n, p, cm, cn) for m, n in ((128, 128), (128, 192), (256, 128), (128, 256), (128, 208))
             for p in (True, False) for cm, cn in ((2, 1), (1, 2))] + [Config(256, 256, False, 2, 1, 10)]
    module = types.ModuleType("quack.gemm_interface")
    module.gemm_tuned, module.gemm_gated_tuned, module.default_config = Tuner(every), Tuner(every[:8]), object()
    monkeypatch.setitem(sys.modules, "quack", types.ModuleType("quack"))
    monkeypatch.setitem(sys.modules, "quack.gemm_interface", module)
    monkeypatch.setattr(sys.modules["quack"], "gemm_interface", module, raising=False)

    assert "all" in sonic.narrow_autotuning("all") and len(module.gemm_tuned.configs) == len(every)
    assert "narrowed" in sonic.narrow_autotuning("subset")
    kept = [c.kwargs["config"] for c in module.gemm_tuned.configs]
    assert {(c.tile_m, c.tile_n, c.pingpong, c.cluster_m, c.cluster_n) for c in kept if c.device_capacity == 9} \
        == set(sonic.AUTOTUNE_SUBSET)
    assert any(c.device_capacity == 10 for c in kept)  # other GPUs' candidates are left alone
    assert len(module.gemm_gated_tuned.configs) == sum(
        (c.tile_m, c.tile_n, c.pingpong, c.cluster_m, c.cluster_n) in sonic.AUTOTUNE_SUBSET for c in every[:8])
    with pytest.raises(ValueError, match="SonicMoE autotuning must be one of"):
        sonic.narrow_autotuning("fast")
