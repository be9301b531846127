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
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

log = logging.getLogger(__name__)

M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 64 << 20
TRIM_THRESHOLD = 128 << 20

_done = False


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
