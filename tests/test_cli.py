"""The command line: doctor, bench, report and configs run and say what they did."""
import json
import os
import subprocess
import sys

import pytest
import torch


def run_cli(*args, env_extra=None, timeout=600):
    env = {**os.environ, "FLASHMOE_NO_PROGRESS": "1", **(env_extra or {})}
    return subprocess.run([sys.executable, "-m", "flashmoe_science", *args], capture_output=True, text=True,
                          env=env, timeout=timeout)


def test_doctor_reports_the_launched_kernel_and_passes():
    proc = run_cli("doctor", "--quick")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "attention_forward_kernel" in proc.stdout and "BLOCK_M=" in proc.stdout
    assert "error vs float64" in proc.stdout and "all checks passed" in proc.stdout
    if not torch.cuda.is_available():
        assert "interpreter" in proc.stdout + proc.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback of the benchmark")
def test_bench_attention_on_cpu_uses_the_interpreter_and_writes_results(tmp_path):
    proc = run_cli("bench", "attention", "--repeats", "2", "--out", str(tmp_path), "--no-plot")
    assert proc.returncode == 0, proc.stderr
    assert "interpreter" in proc.stderr
    result = json.loads((tmp_path / "attention_interpreter.json").read_text())
    assert result["meta"]["interpreter"] is True and result["rows"]
    for row in result["rows"]:
        assert row["ours_rel_err"] < 2 * row["sdpa_rel_err"] + 1e-4
    # The rows written as they came (attention_partial) are gone once the whole file is written.
    assert sorted(p.name for p in tmp_path.iterdir()) == ["attention_interpreter.json"]


def test_unknown_command_fails_cleanly():
    proc = run_cli("nonsense")
    assert proc.returncode != 0 and "invalid choice" in proc.stderr
