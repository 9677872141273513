"""The API process gives large freed blocks back to the system when it frees them.

glibc maps a block of 128 KiB or more on its own and unmaps it when freed, but after the first
such free it raises that bound to the freed block's size (up to 32 MiB): later blocks as large come
from the arena of the thread that asks, and stay in the process once freed. The API reads records
of tens of MB on many threads (a stream's job, its result as Redis sent it), so each thread's
arena kept about twice the largest it had read: 1.9 times a result per unread stream, where the
streams held it once (``bench/stream_memory.py``). A fixed bound keeps every block from
:data:`LARGE_BLOCK_BYTES` up mapped on its own.
"""

from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
LARGE_BLOCK_BYTES = 1 << 20


def return_large_blocks() -> bool:
    """Set the bound for this process and those it forks (gunicorn's workers); False where the C
    library has no ``mallopt`` (not glibc), which changes nothing. By hand through ctypes: no
    library sets glibc's malloc parameters."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return mallopt(M_MMAP_THRESHOLD, LARGE_BLOCK_BYTES) == 1
