"""Host memory a CPU step frees is kept for the next step instead of going back to the kernel.

A step allocates its activations and frees them again, tens of megabytes in blocks of every size. With glibc's
defaults, blocks above a threshold that follows the largest block freed so far are mapped and unmapped one by one,
the heap hands its free top back to the kernel, and a thread other than the main one (the server's engine loop) gets
heaps of at most 64 MiB that are unmapped once they empty. The next step then touches fresh pages: a fault and a
page the kernel zeroes per 4 KiB. In the server's w1 benchmark that was 1.9 million faults (about 7,000 a step) and
7 s of system time in a 54 s run; with the memory kept, 12,000 faults and 0.4 s. The resident size stays at the
largest step's, which a server that runs such steps all day holds at its peak anyway.
"""

from __future__ import annotations

import ctypes

# mallopt's parameters (glibc's malloc.h).
_M_TRIM_THRESHOLD = -1
_M_TOP_PAD = -2
_M_MMAP_THRESHOLD = -3
_HEAP_MAX_BYTES = 64 << 20  # a thread's heap on 64-bit hosts
_SETTINGS = (
    # Blocks below this come from the heaps and are reused: the largest threshold glibc accepts.
    (_M_MMAP_THRESHOLD, _HEAP_MAX_BYTES // 2),
    # A heap's free top goes back to the kernel only beyond this.
    (_M_TRIM_THRESHOLD, 1 << 30),
    # An emptied thread heap is unmapped only when the heap before it has this much room to spare: never, at this.
    (_M_TOP_PAD, _HEAP_MAX_BYTES),
)


def keep_freed_host_memory() -> None:
    """Set glibc's thresholds for the whole process (once is enough; again is harmless). Nothing where the C library
    is not glibc (musl, macOS), whose allocators this does not concern."""
    libc = ctypes.CDLL(None)
    if hasattr(libc, "gnu_get_libc_version"):
        for parameter, value in _SETTINGS:
            libc.mallopt(parameter, value)
