"""One process-wide pool of host threads for per-item work that releases the GIL (Pillow resizes, seeded torch
noise draws): a vector env's step does such work for every slot, and on one core it was tens of milliseconds of a
step at 256 slots while the other cores idled."""

from __future__ import annotations

import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np

T = TypeVar("T")

THREADS = min(16, os.cpu_count() or 1)
_pools: dict[int, ThreadPoolExecutor] = {}  # by process id: a forked child gets a pool of its own


def _pool() -> ThreadPoolExecutor:
    # A pool inherited through fork has no threads in the child: work handed to it would never run.
    pid = os.getpid()
    if pid not in _pools:
        _pools.clear()
        _pools[pid] = ThreadPoolExecutor(THREADS, thread_name_prefix="cosmos3_gym_host")
    return _pools[pid]


def map_in_threads(function: Callable[[Any], T], items: Sequence[Any], min_per_thread: int = 8) -> list[T]:
    """``[function(item) for item in items]``, in order, split over the pool in contiguous parts of at least
    ``min_per_thread`` items (a hand-off to a thread costs about as much as one small item); in the calling thread
    when that leaves one part."""
    parts = min(THREADS, len(items) // max(1, min_per_thread))
    if parts <= 1:
        return [function(item) for item in items]
    bounds = np.linspace(0, len(items), parts + 1).astype(int)
    chunks = [items[start:stop] for start, stop in zip(bounds[:-1], bounds[1:])]
    return [result for part in _pool().map(lambda chunk: [function(item) for item in chunk], chunks) for result in part]
