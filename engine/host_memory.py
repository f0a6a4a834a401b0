"""How a CPU engine holds host memory: the KV cache on huge pages, and what a step frees kept for the next step
instead of going back to the kernel.

The KV cache is gigabytes that decoding reads a block (6 KiB per layer for this model) at a time from anywhere in
it: on 4 KiB pages nearly every block read starts with a TLB miss and a page walk, on 2 MiB pages few do. 128
decodes of 100-760 tokens whose blocks are scattered over the pool, 30 layers, two cores (bfloat16): 50-55 ms of
attention against 57-62; the decode steps of the w1 benchmark: 5.7-5.9 s of attention against 6.0-6.2.

A step allocates its activations and frees them again, tens of megabytes in blocks of every size. With glibc's
defaults, blocks above a threshold that follows the largest block freed so far are mapped and unmapped one by one,
the heap hands its free top back to the kernel, and a thread other than the main one (the server's engine loop) gets
heaps of at most 64 MiB that are unmapped once they empty. The next step then touches fresh pages: a fault and a
page the kernel zeroes per 4 KiB. In the server's w1 benchmark that was 1.9 million faults (about 7,000 a step) and
7 s of system time in a 54 s run; with the memory kept, 12,000 faults and 0.4 s. The resident size stays at the
largest step's, which a server that runs such steps all day holds at its peak anyway.
"""

from __future__ import annotations

import contextlib
import ctypes
import math
import mmap

import torch

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


_HUGE_PAGE_BYTES = 2 << 20


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zeroed CPU tensor on anonymous memory the kernel is asked (``madvise``) to back with transparent huge pages,
    aligned to 2 MiB, every page touched now (a host short of memory fails at start, not in the middle of serving).
    Plain ``torch.zeros`` where the platform has no such advice or the tensor is smaller than a huge page; the
    kernel's own setting (``/sys/kernel/mm/transparent_hugepage/enabled``: never) still has the last word."""
    nbytes = math.prod(shape) * dtype.itemsize
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes < _HUGE_PAGE_BYTES:
        return torch.zeros(shape, dtype=dtype)
    region = mmap.mmap(-1, nbytes + _HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    with contextlib.suppress(OSError):  # a kernel built without transparent huge pages: 4 KiB pages then
        region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)  # keeps the mapping alive as long as any view of it
    start = -raw.data_ptr() % _HUGE_PAGE_BYTES
    return raw[start : start + nbytes].view(dtype).view(shape).zero_()
