"""OpenMP worker threads when decoding runs on a thread other than the one that loaded the model.

torch's CPU operators and spirit's kernels (model/kernels) run their parallel parts on
OpenMP: GNU libgomp in torch's Linux wheels. libgomp keeps a pool of worker threads for each
thread that has started parallel work. Once the process holds more of its threads than there
are CPUs, libgomp stops spin-waiting between parallel regions: each region then wakes
sleeping workers, and a decoding pass runs hundreds of regions.

A server loads the model on one thread and decodes on a worker thread (server/scheduler.py).
The loading thread's pool stays behind, idle, and the worker's passes pay for it. Measured
with qwen2.5-coder-1.5b on a 2-core Xeon:
- a 1-row pass took 75 ms on the worker thread against 61 ms on the loading thread;
- an 8-row pass took 129 ms against 107 ms;
- 16 requests over 8 batched slots took 59.0 s against 47.7 s.
After the loading thread freed its pool, the worker's passes matched the loading thread's.

OpenMP 5's `omp_pause_resource_all` frees the calling thread's pool. The next parallel region
of that thread builds a new one, which costs microseconds. So a thread that is about to hand
work over, or to sit idle, calls `release_openmp_workers`.
"""

from __future__ import annotations

import ctypes
import os
from functools import cache

OMP_PAUSE_SOFT = 1  # omp_pause_resource_t: free the threads, keep what the runtime needs to start again


@cache
def _libgomp() -> ctypes.CDLL | None:
    """The GNU OpenMP runtime already in this process (torch's), or None.

    RTLD_NOLOAD: the runtime torch loaded is the one to free, never a second copy. Only
    libgomp is used: LLVM's and Intel's runtimes pause the whole process, not one thread."""
    import torch  # noqa: F401 - loads torch's OpenMP runtime first

    try:
        library = ctypes.CDLL("libgomp.so.1", mode=os.RTLD_NOLOAD)
    except (OSError, AttributeError):  # not loaded (another runtime, or none); no RTLD_NOLOAD
        return None
    if not hasattr(library, "omp_pause_resource_all"):  # older than OpenMP 5 (GCC 9)
        return None
    library.omp_pause_resource_all.argtypes = [ctypes.c_int]
    library.omp_pause_resource_all.restype = ctypes.c_int
    return library


def release_openmp_workers() -> bool:
    """Free the calling thread's idle OpenMP worker threads, so that another thread's parallel
    work runs at full speed. Call it outside any parallel region: from Python, always.
    Returns True where GNU libgomp answered (with or without a pool to free); elsewhere it
    does nothing and returns False."""
    library = _libgomp()
    return library is not None and library.omp_pause_resource_all(OMP_PAUSE_SOFT) == 0
