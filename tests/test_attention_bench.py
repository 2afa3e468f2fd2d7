"""`bench attention` varlen and window sections end to end at the interpreter's tiny size, so that
a mistake in them shows here rather than after a GPU run (FlexAttention, GPU-only, is left out);
the train section's block on each side; and the statistics and report lines of the GPU-only
sections."""
import argparse
import itertools
import math
import random

import pytest
import torch

from flashmoe_science.bench import attention, attention_workloads, report, timing
from flashmoe_science.bench.sweeps import attention_forward as attention_sweeps
from flashmoe_science.flops import attention_flops, attention_pairs


def parse(*argv):
    parser = argparse.ArgumentParser()
    attention.add_arguments(parser)
    parser.add_argument("--quick", action="store_true")  # the CLI gives every benchmark this one
    args = parser.parse_args(list(argv))
    args.repeats, args.warmup, args.rep = 2, 1, 1
    args.progress = lambda items, desc="": items
    return args


def test_attention_pairs_count_the_band():
    assert attention_pairs(4, 4) == 16 and attention_pairs(4, 4, causal=True) == 10
    assert attention_pairs(3, 5, causal=True) == 3 + 4 + 5 and attention_pairs(5, 3, causal=True) == 1 + 2 + 3
    assert attention_pairs(10, 10, True, (2, -1)) == 1 + 2 + 3 * 8
    assert attention_pairs(8, 3, False, (0, 0)) == 3 and attention_pairs(6, 6, False, (1, 2)) == 3 + 4 + 4 + 4 + 3 + 2
    assert attention_flops(2, 3, 10, 10, 16, True, "fwd+bwd", (2, -1)) == 3.5 * 4 * 2 * 3 * 27 * 16


def test_varlen_lengths_are_reproducible_and_fit():
    lengths = attention_workloads.varlen_lengths(16384, (64, 2048))
    assert lengths == attention_workloads.varlen_lengths(16384, (64, 2048))
    assert all(64 <= n <= 2048 for n in lengths) and 16384 - 2048 < sum(lengths) <= 16384


@pytest.mark.skipif(torch.cuda.is_available(), reason="the GPU run covers this at real sizes")
def test_varlen_and_window_sections_rows_and_report():
    args = parse("--mode", "fwd+bwd", "--sections", "varlen,window")
    saved = []
    args.checkpoint = lambda rows: saved.append(list(rows))
    result = attention.run(args)
    assert result["name"] == "attention_varlen_window_fwd_bwd"
    # Each section's end hands over every row so far: a run cut in the second keeps the first's.
    assert saved[-1] == result["rows"] and saved[0] == [r for r in result["rows"] if r["section"] == "varlen"]
    work = attention_workloads.INTERPRETER_WORKLOAD
    varlen = [r for r in result["rows"] if r["section"] == "varlen"]
    assert {(r["impl"], r["causal"]) for r in varlen} == set(itertools.product(("ours", "sdpa_padded"), (False, True)))
    lengths = attention_workloads.varlen_lengths(work.tokens, work.lengths)
    for r in varlen:
        assert r["tokens"] == sum(lengths) and r["padded_tokens"] == len(lengths) * max(lengths)
        assert r["rel_err"] < 1e-5  # fp32: out, dq, dk and dv of the longest sequence
        flops = sum(attention_flops(1, work.heads, n, n, work.head_dim, r["causal"], "fwd+bwd") for n in lengths)
        assert math.isclose(r["tflops"], flops / (r["ms"] * 1e-3) / 1e12)
        assert (r.get("ours_speedup") is None) == (r["impl"] == "ours")
    window = [r for r in result["rows"] if r["section"] == "window"]
    assert [r["window"] for r in window] == [None, *work.windows]
    assert all(r["rel_err"] < 1e-5 for r in window)
    assert window[0]["work_vs_full"] == 1 and "speedup_vs_full" not in window[0]
    for r in window[1:]:
        pairs = attention_pairs(work.seqlen, work.seqlen, True, (r["window"], -1))
        assert r["work_vs_full"] == pairs / attention_pairs(work.seqlen, work.seqlen, True)
        assert r["speedup_vs_full"] == pytest.approx(window[0]["ms"] / r["ms"])
    text = attention.summarize(result)
    assert "varlen fwd+bwd causal=True" in text and "faster than full causal" in text
    rendered = report.render(result["name"], result)
    assert "Variable-length batch (fwd+bwd)" in rendered and "Causal sliding window (fwd+bwd)" in rendered
    assert "SDPA padded + mask" in rendered


def test_packed_layouts_hold_the_measured_sequence_and_flex_documents():
    lengths, index = [5, 130, 7], 1
    documents, layouts = attention_workloads._packed_layouts(lengths, index, torch.device("cpu"))
    packed = torch.randn(sum(lengths), 2, 4)
    for name, layout in layouts.items():
        assert torch.equal(layout.sequence(layout.to_layout(packed)), packed[5:135]), name
    # FlexAttention's rows: the packed tokens, then padding to its block size as one more document.
    flex = layouts["flex_document"].to_layout(packed)
    assert flex.shape == (1, 2, 256, 4) and len(documents) == 256
    assert documents[:142].tolist() == [0] * 5 + [1] * 130 + [2] * 7 and set(documents[142:].tolist()) == {3}
    assert not flex[0, :, 142:].any()
    causal = attention_workloads._document_mask(documents, True)
    rows = torch.arange(256)
    visible = causal(0, 0, rows[:, None], rows[None, :])
    assert visible[140, 136] and not visible[136, 140] and not visible[142, 141] and visible[200, 150]


def test_sweep_cases_plain_and_causal_or_one_sliding_window():
    assert attention_sweeps._sweep_cases(parse("--sweep", "--head-dims", "64", "--seqlens", "128")) == [
        (64, 128, False, (-1, -1)), (64, 128, True, (-1, -1))]
    windowed = attention_sweeps._sweep_cases(parse("--sweep", "--head-dims", "64,128", "--seqlens", "16384",
                                            "--window", "1024"))
    assert windowed == [(64, 16384, True, (1024, 0)), (128, 16384, True, (1024, 0))]
    assert attention_sweeps._sweep_row("sweep", 64, 16384, True, (1024, 0))["window"] == 1024


def test_throughput_table_gives_shares_of_the_runs_matmul_ceiling():
    """With the run's bf16 matmul ceiling in the results' meta, the throughput table gives ours and
    cuDNN as shares of it; files without it keep the table they had."""
    def row(impl, tflops, **extra):
        return dict(section="throughput", mode="bwd", impl=impl, batch=4, heads=16, seqlen=4096, head_dim=128,
                    causal=True, dtype="bfloat16", ms=1.0, tflops=tflops, **extra)

    rows = [row("ours", 400.0), row("sdpa_cudnn", 440.0, ours_speedup=0.91, ours_speedup_ci=[0.9, 0.92])]
    meta = {"mode": "bwd", "gpu": "H100", "capability": "9.0"}
    plain = report.render("attention_bwd", {"rows": rows, "meta": meta})
    assert "/ matmul" not in plain
    shared = report.render("attention_bwd", {"rows": rows, "meta": {**meta, "matmul_tflops": 800.0}})
    header = next(line for line in shared.splitlines() if line.startswith("| D |"))
    assert header.endswith("| ours / matmul | SDPA cuDNN / matmul |")
    line = next(line for line in shared.splitlines() if line.startswith("| 128 | 4096 | yes |"))
    assert line.endswith("| 0.91 [0.90, 0.92] | 50% | 55% |")
    assert "ceiling measured in the same run, 800 TFLOP/s" in shared


def test_paired_interval_cancels_a_drift_both_sides_share():
    # Rounds whose clocks drift by up to +-5% alike on both sides, ours 2% faster in every round:
    # the rounds' ratios are all 1.02, while each side alone spreads over the drift.
    rng = random.Random(1)
    drift = [1 + rng.uniform(-0.05, 0.05) for _ in range(20)]
    ours = [1.0 * d for d in drift]
    theirs = [1.02 * d * (1 + rng.uniform(-0.001, 0.001)) for d in drift]
    ratio, lo, hi = timing.paired_speedup_interval(ours, theirs)
    assert lo <= ratio <= hi
    assert 1.015 < lo and hi < 1.025
    _, unpaired_lo, unpaired_hi = timing.speedup_interval(timing.Timing.from_samples(ours),
                                                          timing.Timing.from_samples(theirs))
    assert unpaired_lo < 1.0 < unpaired_hi
    # Swapping the sides inverts the ratio; the rounds must pair up.
    assert timing.paired_speedup_interval(theirs, ours)[0] == pytest.approx(1 / 1.02, rel=2e-3)
    with pytest.raises(ValueError, match="as many rounds"):
        timing.paired_speedup_interval(ours, theirs[:-1])


def test_train_lines_give_each_sides_paired_ratio_to_three_decimals():
    base = dict(section="train", mode="fwd+bwd", batch=8, seqlen=2048, dim=1024, heads=16, rounds=40)
    rows = [dict(base, impl="ours_packed", ms=3.65, ours_speedup=1.0192, ours_speedup_ci=[1.0151, 1.0233]),
            dict(base, impl="ours", ms=3.69, ours_speedup=1.0081, ours_speedup_ci=[1.0042, 1.0113]),
            dict(base, impl="sdpa_default", ms=3.72, ours_speedup=None)]
    lines = report._attention_extra(rows).splitlines()
    assert lines[0].endswith("ours, `flash_attention_qkvpacked` on the projection 3.650 ms, 1.019 [1.015, 1.023]x "
                             "SDPA default's speed (median of 40 interleaved rounds' ratios)")
    assert "ours, `flash_attention_science` on q, k, v views 3.690 ms, 1.008 [1.004, 1.011]x" in lines[1]
    assert lines[2].endswith("SDPA default 3.720 ms")
    # Files from before the packed side carry ours' ratio on SDPA's row.
    old = [dict(base, impl="ours", ms=3.69, ours_speedup=None),
           dict(base, impl="sdpa_default", ms=3.72, ours_speedup=1.0081, ours_speedup_ci=[1.0042, 1.0113])]
    assert "SDPA default 3.720 ms, ours 1.008 [1.004, 1.011]x faster" in report._attention_extra(old)


def test_train_sides_compute_the_same_block(device):
    """The train section's three sides differ only in how attention is called: one loss and
    the same parameter gradients (float32, small)."""
    block = attention.Block(64, 2, None).to(device)
    x = torch.randn(2, 24, 64, device=device)
    results = {}
    for name, side in attention.train_attentions().items():
        block.attention = side
        loss = block(x).square().mean()
        results[name] = (loss, torch.autograd.grad(loss, list(block.parameters())))
    ref_loss, ref_grads = results.pop("sdpa_default")
    tol = 1e-2 if x.is_cuda else 1e-4  # tf32 products on the GPU
    for name, (loss, grads) in results.items():
        torch.testing.assert_close(loss, ref_loss, rtol=tol, atol=tol * 1e-2)
        for g, r in zip(grads, ref_grads):
            torch.testing.assert_close(g, r, rtol=tol, atol=tol * 1e-1)


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the section runs at full size: the benchmark")
def test_calls_section_rows_and_report():
    """Run alone, the calls section writes a file of its own: each side's wall-clock per training
    call, and ours' ratio to SDPA's."""
    args = parse("--mode", "fwd+bwd", "--sections", "calls")
    result = attention.run(args)
    assert result["name"] == "attention_calls_fwd_bwd"
    rows = result["rows"]
    assert [r["impl"] for r in rows] == list(attention.train_attentions())
    for r in rows:
        assert r["mode"] == "fwd+bwd" and 0 < r["host_us"] <= r["wall_us"]
        assert (r["ours_speedup"] is None) == (r["impl"] == "sdpa_default") == ("host_vs_sdpa" not in r)
    assert "calls fwd+bwd (B, H, S, D) = (1, 2, 24, 32)" in attention.summarize(result)
    rendered = report.render(result["name"], result)
    assert "| B, H, S, D | ours packed µs/call | ours on views µs/call | SDPA µs/call |" in rendered
    assert "host µs/call: ours packed / ours on views / SDPA | ours packed host time / SDPA's |" in rendered
    assert "| 1, 2, 24, 32 |" in rendered


def test_decode_mode_checks_each_cache_layout_against_float64():
    """The decode mode's tiny grid (--quick; the interpreter's): every cache layout's error, and
    on a GPU timings with the fastest SDPA backend's row beside ours."""
    result = attention.run(parse("--mode", "decode", "--quick"))
    rows = result["rows"]
    assert result["name"] == "attention_decode"
    ours = [r for r in rows if r["impl"] in ("ours", "ours_paged16")]
    fp8 = [r for r in rows if r["impl"] == "ours_fp8_cache"]
    assert {r["impl"] for r in ours} == {"ours", "ours_paged16"} and len(fp8) == len(ours) // 2
    assert all(r["rel_err"] < 0.08 for r in fp8)  # e4m3's rounding of K and V, at most
    if not torch.cuda.is_available():
        assert len(ours) + len(fp8) == len(rows) and all(r["rel_err"] < 1e-5 for r in ours)
        return
    sdpa = {(r["batch"], r["seqlen"]): r for r in rows if r["impl"] == "sdpa_best"}
    for r in ours:
        assert r["rel_err"] <= 2 * sdpa[r["batch"], r["seqlen"]]["rel_err"] + 1e-3 and r["us"] > 0
    assert all(r["us"] > 0 and r["time_vs_bf16_cache"] > 0 for r in fp8)



def test_decode_report_has_each_layout_and_the_graph_timings():
    base = dict(section="decode", mode="decode", batch=1, seqlen=4096, heads_q=32, heads_kv=8, head_dim=128)
    rows = [dict(base, impl="ours", us=20.0, floor_us=5.6, graph_us=9.0, speedup_vs_sdpa=0.95,
                 speedup_vs_sdpa_ci=[0.9, 1.0]),
            dict(base, impl="ours_paged16", us=22.0, floor_us=5.6),
            dict(base, impl="sdpa_best", backend="sdpa_cudnn", us=19.0, floor_us=5.6, graph_us=10.8)]
    rendered = report.render("attention_decode", {"rows": rows, "meta": {"mode": "decode"}})
    assert "| 1 | 4096 | 32 / 8 / 128 | 20.0 | 22.0 |  | 19.0 (sdpa_cudnn) | 5.6 | 0.28 |" in rendered
    assert "| 9.0 / 10.8 (1.20x) |" in rendered


def test_headline_decode_row_reads_both_batches_graph_times(tmp_path):
    """The README's KV-cache decode row: Qwen3's shapes at batch 1 and 32, per layer of the CUDA
    graph, ours against SDPA's fastest backend there; no row unless both batches have graph times."""
    import json

    def rows(batches):
        out = []
        for b in batches:
            case = dict(section="decode", batch=b, seqlen=4096, heads_q=32, heads_kv=4, head_dim=128)
            out += [dict(case, impl="ours", us=20.0 * b, graph_us=10.0 * b),
                    dict(case, impl="sdpa_best", us=21.0 * b, graph_us=12.0 * b, graph_backend="sdpa_cudnn")]
        return out

    path = tmp_path / "attention_decode.json"
    path.write_text(json.dumps(dict(meta=dict(gpu="probe"), rows=rows((1, 32)))))
    row = ("| attention decode, KV cache, CUDA graph | Hq 32 / Hkv 4 / D 128 (qwen3-30b-a3b), Sk 4096, batch 1 / 32 "
           "| 10.0 / 320.0 µs a layer | 12.0 / 384.0 (SDPA cuDNN) | 1.20x / 1.20x |")
    assert row in report.render_headline(tmp_path)
    path.write_text(json.dumps(dict(meta=dict(gpu="probe"), rows=rows((1,)))))
    assert "attention decode" not in report.render_headline(tmp_path)


def test_headline_rows_from_another_gpu_name_it(tmp_path):
    """A headline whose files ran on two GPUs: its note names the first file's, and each row from
    another names that GPU in its file cell; one GPU, no cell names it."""
    import json

    case = dict(section="decode", seqlen=4096, heads_q=32, heads_kv=4, head_dim=128)
    decode = [dict(case, batch=b, impl=impl, us=1.0, graph_us=1.0, graph_backend="sdpa_cudnn")
              for b in (1, 32) for impl in ("ours", "sdpa_best")]
    fp8 = [dict(section="throughput", head_dim=d, causal=False, seqlen=16384, impl=impl, tflops=1.0)
           for d in (128, 256) for impl in ("ours_fp8", "sdpa_cudnn")]
    (tmp_path / "attention_fp8.json").write_text(json.dumps(dict(meta=dict(gpu="GPU A"), rows=fp8)))
    (tmp_path / "attention_decode.json").write_text(json.dumps(dict(meta=dict(gpu="GPU A"), rows=decode)))
    single = report.render_headline(tmp_path)
    assert single.startswith("_GPU A; bf16") and "(GPU A)" not in single
    (tmp_path / "attention_decode.json").write_text(json.dumps(dict(meta=dict(gpu="GPU B"), rows=decode)))
    mixed = report.render_headline(tmp_path)
    assert mixed.startswith("_GPU A unless the file names another; bf16")
    assert "`attention_decode.json` (GPU B) |" in mixed and "`attention_fp8.json` |" in mixed
