"""Measure what autograd keeps for the backward pass: the activation memory of a training step.

    with SavedForBackward(exclude=model.parameters()) as saved:
        loss = model(x).sum()
    saved.nbytes, saved.tensors  # distinct storages; per storage, the last tensor saved on it

Each storage is counted once however many saved tensors view it, and the excluded tensors
(usually the parameters, which autograd saves by reference) are not counted. It is the CPU proxy
for a GPU's activation memory used by ``multipath-bench`` and the tests.
"""
from typing import Dict, Iterable

import torch


class SavedForBackward:
    """Context manager recording the storages that autograd saves for backward inside it."""

    def __init__(self, exclude: Iterable[torch.Tensor] = ()):
        self._excluded = {t.untyped_storage().data_ptr() for t in exclude}
        self._by_storage: Dict[int, torch.Tensor] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda tensor: tensor)

    def _pack(self, tensor):
        storage = tensor.untyped_storage().data_ptr()
        if storage not in self._excluded:
            self._by_storage[storage] = tensor
        return tensor

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)

    @property
    def tensors(self):
        """One saved tensor per distinct storage."""
        return list(self._by_storage.values())

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in self._by_storage.values())
