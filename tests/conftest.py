"""Test setup: without a GPU, kernels run through Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton compiles any `@triton.jit` function, so it is set
here, before the package is imported. Tests marked `gpu` are skipped where there is no GPU.
"""
import json
import os
import subprocess
import sys
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402
from hypothesis import HealthCheck, settings  # noqa: E402

# Property tests (test_properties.py): a few examples per test through the interpreter, many on
# a GPU; HYPOTHESIS_PROFILE picks one explicitly. "cpu" (CI's) draws the same examples every run,
# so a result is reproducible; "explore" draws fresh ones on the CPU, and "gpu" fresh ones on the
# GPU. A failure prints the example and how to reproduce it.
_PROFILE_SETTINGS = dict(deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("cpu", max_examples=12, derandomize=True, **_PROFILE_SETTINGS)
settings.register_profile("explore", max_examples=60, **_PROFILE_SETTINGS)
settings.register_profile("gpu", max_examples=150, **_PROFILE_SETTINGS)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "gpu" if torch.cuda.is_available() else "cpu"))


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def device():
    """Where kernels run in this session: the GPU if there is one, else the CPU interpreter."""
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


@pytest.fixture
def poisoned_allocations():
    """Every torch.empty is filled with NaN (deterministic mode fills new memory), so an output
    element the kernels never write shows."""
    previous = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    yield
    torch.use_deterministic_algorithms(previous)


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Each test draws fresh random inputs, but reproducibly from its own name."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))


@pytest.fixture(scope="session")
def compiled_rows():
    """Every shipped build of every operation compiled for sm80, sm86, sm89 and sm90 (rows of
    `python -m flashmoe_science.target_compile`). Compiling for a GPU target needs Triton's
    compiler, not its interpreter, so it runs in subprocesses without TRITON_INTERPRET: two at
    once, half of the targets each."""
    from flashmoe_science.device import SUPPORTED_TARGETS

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    half = len(SUPPORTED_TARGETS) // 2
    procs = [subprocess.Popen([sys.executable, "-m", "flashmoe_science.target_compile", *(f"sm{c}" for c in caps)],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for caps in (SUPPORTED_TARGETS[:half], SUPPORTED_TARGETS[half:])]
    rows = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=1800)
        assert stdout, stderr[-3000:]
        rows += json.loads(stdout)
    return rows
