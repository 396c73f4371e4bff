"""Host memory for the tensors a loader hands to a training loop on the CPU, reused once the loop lets go of them.

A batch handed out must be the loop's own (it may keep it, stack it, save it for backward), so each one is
fresh memory. But a 38.5 MB float batch taken fresh from glibc is mapped, page-faulted (about 9,400 minor
faults) and unmapped every time: that costs the training process more than the normalisation that fills it.
`RecycledBuffers.empty` hands out a tensor over a kept buffer that returns to the pool only when the last
tensor, view or autograd record over it is gone (the buffer's lease dies with the tensor storage that holds
it), so a loop that keeps a batch keeps its memory, and one that drops it gets the pages back already mapped.
"""

from __future__ import annotations

import ctypes
import math
import weakref
from collections import deque
from typing import Any

import numpy as np
import torch

# Free buffers kept per size beyond those handed out: enough for a loop that drops each batch before the next.
KEPT_FREE = 2


class _Lease:
    """The base of every lease type: a ctypes char array over a pooled buffer that puts it back when it dies."""

    buffer: np.ndarray
    home: weakref.ReferenceType[deque[np.ndarray]]

    def __del__(self) -> None:
        free = self.home()
        if free is not None and len(free) < KEPT_FREE:
            free.append(self.buffer)


class RecycledBuffers:
    """Fresh-looking CPU tensors whose memory is reused once every tensor and view over it is gone."""

    def __init__(self) -> None:
        self._free: dict[int, deque[np.ndarray]] = {}
        self._lease_types: dict[int, type[ctypes.Array[ctypes.c_char]]] = {}

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """An uninitialised contiguous CPU tensor of `shape` and `dtype`, the caller's until it drops it."""
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        if nbytes == 0:
            return torch.empty(shape, dtype=dtype)
        free = self._free.setdefault(nbytes, deque())
        try:
            buffer = free.pop()
        except IndexError:
            buffer = np.empty(nbytes, np.uint8)
        lease: Any = self._lease_type(nbytes).from_buffer(buffer.data)
        lease.buffer, lease.home = buffer, weakref.ref(free)
        # The tensor's storage holds the NumPy array, which holds the lease: the lease dies with the last view.
        return torch.from_numpy(np.frombuffer(lease, np.uint8)).view(dtype).view(shape)

    def free_buffers(self) -> int:
        """How many buffers wait to be handed out again."""
        return sum(len(free) for free in self._free.values())

    def _lease_type(self, nbytes: int) -> type[ctypes.Array[ctypes.c_char]]:
        lease_type = self._lease_types.get(nbytes)
        if lease_type is None:
            lease_type = self._lease_types[nbytes] = type(f"Lease{nbytes}", (_Lease, ctypes.c_char * nbytes), {})
        return lease_type
