"""Facts found by reading a tensor's values to the host, remembered until the tensor changes.

Reading values (cumulative lengths, FP8 scales) synchronises with the GPU, so each tensor is read
once. Its facts are kept under the tensor itself: its id with a weak reference to it, so that a
new tensor with a recycled id or storage address is read afresh, and its version counter, so that
one written in place is too. Tensors without a version counter (made under inference mode) are
read every time. Facts go when their tensor does: a fact that is itself a device tensor (the
packed kernels' sequence order) must not outlive the batch it describes, or every call would
leave GPU memory held, and the caching allocator would hand the next call's tensors other
addresses (a static KV cache at a new address makes torch.compile's CUDA graphs record again).
"""
from __future__ import annotations

import weakref

import torch


def version_of(t: torch.Tensor):
    """t's version counter, or None for inference-mode tensors, which keep none."""
    try:
        return t._version
    except RuntimeError:
        return None


class TensorFacts:
    """Facts per tensor, or per tuple of tensors read together, as the module docstring says;
    emptied when `max_entries` are held."""

    def __init__(self, max_entries: int):
        self._max_entries = max_entries
        self._facts: dict = {}

    def get(self, *tensors: torch.Tensor):
        """The facts remembered for `tensors` as they are now, or None."""
        entry = self._facts.get(tuple(map(id, tensors)))
        if entry is None or any(ref() is not t for ref, t in zip(entry[0], tensors)):
            return None
        versions = tuple(map(version_of, tensors))
        return entry[2] if None not in versions and versions == entry[1] else None

    def remember(self, facts, *tensors: torch.Tensor) -> None:
        """Keep `facts` for `tensors` (tensors without a version counter: not kept)."""
        versions = tuple(map(version_of, tensors))
        if None in versions:
            return
        if len(self._facts) >= self._max_entries:
            self._facts.clear()
        key = tuple(map(id, tensors))
        facts_by_key = self._facts

        def forget(dead):
            entry = facts_by_key.get(key)
            if entry is not None and any(ref is dead for ref in entry[0]):
                del facts_by_key[key]

        self._facts[key] = (tuple(weakref.ref(t, forget) for t in tensors), versions, facts)
