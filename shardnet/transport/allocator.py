"""Keep glibc from mmapping (and page-faulting) every large buffer of the data path.

glibc serves allocations above its mmap threshold (128 KiB at start) with a fresh mmap, so each
256 KiB Yamux frame, 1 MiB batch or decrypted message costs dozens of page faults when it is
created and an munmap when freed. glibc raises the threshold by itself after such frees, but
only gradually and not reliably: measured here, a fresh process streamed at ~350 MB/s for its
first passes and ~900 MB/s once warm. Fixing the threshold at 64 MiB (and the trim threshold
above it) makes every node start warm. Applied once per process, Linux/glibc only.

The price is that freed buffers below 64 MiB stay in the heap: ``trim`` gives the heap's free
pages back (a compute peer calls it after a prompt's step, whose transient buffers would otherwise
stay in its RSS; tests/system/test_peer_memory.py).

While a block loads, ``loading()`` lowers the threshold to ``LOADING_MMAP_THRESHOLD``: the
load's transient buffers (quantizing a weight makes several float32 copies of it; checking a
layer against transformers computes with each weight) are then mapped and unmapped one by one
instead of piling up in the heap. Measured (a 4-layer int8 block of a width-2048 llama, one
process): the heap rose by about 320 MiB per layer quantized and the peak reached 945 MiB for
583 MiB once trimmed; with the lower threshold the peak was 740 MiB.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import sys
import threading

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 128 << 20
#: the mmap threshold while a block loads (``loading``)
LOADING_MMAP_THRESHOLD = 1 << 20

_done = False
_loads = 0
_loads_lock = threading.Lock()


def _glibc():
    """glibc's functions here, or None (not Linux, or not glibc: musl has no mallopt)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.mallopt, libc.malloc_trim  # noqa: B018 (both present, or not glibc)
    except (OSError, AttributeError):
        return None
    return libc


_GLIBC = _glibc()


def tune() -> bool:
    """Returns True if the allocator was tuned (now or before)."""
    global _done
    if _done:
        return True
    if _GLIBC is None:
        return False
    mallopt = _GLIBC.mallopt
    ok = mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1 and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
    _done = ok
    log.debug("glibc malloc thresholds %s", "set" if ok else "unchanged")
    return ok


def trim() -> None:
    """Give the heap's free pages back to the system now (glibc's ``malloc_trim``; elsewhere nothing)."""
    if _GLIBC is not None:
        _GLIBC.malloc_trim(0)


@contextlib.contextmanager
def loading():
    """While the block is in: buffers above ``LOADING_MMAP_THRESHOLD`` are mapped of their own
    and go back to the system when freed (loads may overlap: the last one out restores the
    threshold); the heap is trimmed at the end."""
    global _loads
    if _GLIBC is None:
        yield
        return
    with _loads_lock:
        _loads += 1
        if _loads == 1:
            _GLIBC.mallopt(M_MMAP_THRESHOLD, LOADING_MMAP_THRESHOLD)
    try:
        yield
    finally:
        with _loads_lock:
            _loads -= 1
            if _loads == 0:
                # (untuned: glibc's starting threshold, now fixed where it would have moved)
                _GLIBC.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD if _done else 128 << 10)
        trim()
