"""Freed heap pages handed back to the system once a model has loaded, and whenever the engine goes idle.

Loading reads each tensor's bytes, parses an 11 MB tokenizer file and builds rotary tables: temporaries
that glibc's allocator frees into its heap but keeps mapped, where the process's resident size still
counts them (25-45 MiB on a 0.5B GGUF, measured with /proc/self/status before and after). Steps leave the
same behind: a prompt's activations and the kernels' row buffers, freed, kept mapped (about 60 MiB after
256-token prompts on a 0.5B GGUF). malloc_trim(0) returns every whole free page inside the heap, not only
its top; EngineCore calls it when its last question ends (a few milliseconds, once per burst; the next
burst's first step faults those pages in again). Elsewhere (musl, macOS) there is no such call and nothing
is done.
"""

from __future__ import annotations

import ctypes


def give_back_freed_pages() -> bool:
    """glibc's malloc_trim(0); whether it released anything (False where the C library has no such call)."""
    try:
        trim = ctypes.CDLL(None).malloc_trim
    except (AttributeError, OSError):
        return False
    trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return bool(trim(0))
