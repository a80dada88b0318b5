"""Large zero-filled word buffers backed by transparent huge pages.

A fresh numpy array of hundreds of MiB is faulted in one 4 KiB page at a time on first write:
on these machines filling a new 256 MiB array took 120-925 ms, against 72-78 ms for the same
bytes in an anonymous map advised MADV_HUGEPAGE (2 MiB pages, 512 times fewer faults;
tools/bench_codec.py). The
writer's baseline of a new tensor, a replayed state and a receiver's new tensors are such
buffers. Small ones stay ordinary arrays. Pure: no I/O.
"""

from __future__ import annotations

import mmap

import numpy as np

# Below this a buffer is an ordinary numpy array (a huge page would be mostly empty).
HUGE_MIN_BYTES = 4 << 20


def zeros(count: int, dtype) -> np.ndarray:
    """``np.zeros(count, dtype)``; buffers of HUGE_MIN_BYTES or more come from an anonymous
    map advised to use huge pages (zero-filled by the kernel, unmapped with the array)."""
    dtype = np.dtype(dtype)
    nbytes = count * dtype.itemsize
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if nbytes < HUGE_MIN_BYTES or advice is None:
        return np.zeros(count, dtype=dtype)
    area = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    try:
        area.madvise(advice)
    except OSError:
        pass  # huge pages off: ordinary pages, as np.zeros would give
    return np.frombuffer(area, dtype=dtype, count=count)
