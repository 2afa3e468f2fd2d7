"""Test setup: without a GPU, kernels run through Triton's CPU interpreter.

TRITON_INTERPRET must be set before triton compiles any `@triton.jit` function, so it is set
here, before the package is imported. Tests marked `gpu` are skipped where there is no GPU.
"""
import os
import zlib

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402


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


@pytest.fixture(autouse=True)
def _fresh_seed(request):
    """Each test draws fresh random inputs, but reproducibly from its own name."""
    torch.manual_seed(zlib.crc32(request.node.nodeid.encode()))
