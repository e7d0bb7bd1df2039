"""The split of an SM's 256 KB between shared memory and L1 for one compiled kernel.

Triton asks the driver to prefer shared memory for every kernel that uses more than 48 KB of it
(``CU_FUNC_CACHE_PREFER_SHARED``), which on an H100 leaves 28 KB of L1 whatever the kernel needs.  A kernel
that spills registers keeps them in local memory, cached in L1: with 28 KB its reloads miss and wait on
L2.  ``fit_shared_memory`` asks instead for the smallest shared-memory capacity that
still holds the programs an SM runs at once, so the rest is L1.
"""
from __future__ import annotations

import ctypes
import functools

# sm_90's shared-memory capacities per SM, KB, and the driver's shared memory per block
CAPACITIES_KB = (0, 8, 16, 32, 64, 100, 132, 164, 196, 228)
RESERVED_PER_BLOCK = 1024
_CARVEOUT_ATTRIBUTE = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT
_fitted: set = set()


@functools.cache
def _libcuda():
    return ctypes.CDLL("libcuda.so.1")


def carveout_percent(shared_bytes: int, programs_per_sm: int) -> int:
    """The carveout (percent of the largest capacity) whose capacity is the smallest one holding
    ``programs_per_sm`` programs of ``shared_bytes`` each: the driver rounds a percentage up to the next
    capacity, so the percentage is rounded down."""
    need = programs_per_sm * (shared_bytes + RESERVED_PER_BLOCK)
    kb = next((c for c in CAPACITIES_KB if c * 1024 >= need), CAPACITIES_KB[-1])
    return kb * 100 // CAPACITIES_KB[-1]


def fit_shared_memory(compiled, programs_per_sm: int) -> None:
    """Set ``compiled``'s (a launched Triton kernel's) preferred carveout once (``carveout_percent``); it
    applies from the next launch on."""
    handle = compiled.function
    if handle in _fitted:
        return
    percent = carveout_percent(compiled.metadata.shared, programs_per_sm)
    err = _libcuda().cuFuncSetAttribute(ctypes.c_void_p(handle), _CARVEOUT_ATTRIBUTE, ctypes.c_int(percent))
    if err:
        raise RuntimeError(f"cuFuncSetAttribute(carveout={percent}) failed with CUDA error {err}")
    _fitted.add(handle)
