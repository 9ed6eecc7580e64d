"""A stand-in for a CUDA GPU's memory, for code that probes it (model_utils.resolve.micro_batch_probe) on a machine without one.

The memory is the real bytes of the CPU tensors created while it is active (a TorchDispatchMode sees every op's
outputs; a tensor's bytes are freed when it is collected), against a given capacity: an allocation beyond it
raises torch.OutOfMemoryError at that op, as CUDA's caching allocator does, and the high-water mark is what
torch.cuda.max_memory_reserved reports. `install` points the torch.cuda queries the probe makes at it.
"""

from __future__ import annotations

import types
import weakref
from typing import Any

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class FakeGpuMemory(TorchDispatchMode):
    def __init__(self, total_memory: int, name: str = "Fake GPU") -> None:
        super().__init__()
        self.total_memory, self.name = total_memory, name
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}  # storage address -> bytes

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key, 0)

    def __torch_dispatch__(self, func: Any, types_: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t._is_view():
                continue
            storage = t.untyped_storage()
            key = storage.data_ptr()
            if key == 0 or key in self._sizes:  # empty, or in place / an alias of a tensor already counted
                continue
            self._sizes[key] = storage.nbytes()
            self.live += storage.nbytes()
            weakref.finalize(t, self._free, key)
            if self.live > self.total_memory:
                raise torch.OutOfMemoryError(
                    f"fake GPU: {self.live} bytes in use of {self.total_memory} (allocating {storage.nbytes()})"
                )
            self.peak = max(self.peak, self.live)
        return out

    def install(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """torch.cuda's memory queries answer from this fake; the rest of torch.cuda is untouched."""
        props = types.SimpleNamespace(name=self.name, total_memory=self.total_memory)
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: self._reset_peak())
        monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda device=None: self.peak)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
        monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)

    def _reset_peak(self) -> None:
        self.peak = self.live
