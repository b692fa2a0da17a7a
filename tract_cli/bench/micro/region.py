"""Micro-benchmarks of the region layer: attach/pre-fault, format, block copies.

Machines here are shared and noisy, so copies are reported against glibc
`memcpy` of the same bytes measured in the same run, interleaved round by
round, and as the median over rounds.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np
from cffi import FFI

from tract_cli.bench.regions import need_space, temp_region_path
from tract_cli.core.geometry import load_model
from tract_cli.core.pool import Pool
from tract_cli.core.region import FormatOptions, format_region

# the reference the core's copies are measured against here: glibc memcpy per
# block between raw pointers (into the pool's slot views), through an FFI of
# its own (the core's C library plays no part in it); `tract bench`'s
# reference is a different measurement, whole-request numpy copies between
# private buffers (stats.memcpy_reference)
_libc_ffi = FFI()
_libc_ffi.cdef("void *memcpy(void *dst, const void *src, size_t n);")
_libc = _libc_ffi.dlopen(None)


def c_pointer(buf, writable: bool = False):
    """A `char *` to BUF (a C-contiguous buffer: numpy array, a pool's slot view)
    for `memcpy`; pointer arithmetic in bytes.  `release` it when done: it holds
    BUF's buffer, and a pool does not close while its views are held."""
    return _libc_ffi.from_buffer(buf, require_writable=writable)


def release(*pointers) -> None:
    """Lets go of the buffers `c_pointer` took."""
    for p in pointers:
        _libc_ffi.release(p)


def memcpy(dst, src, n: int) -> None:
    """glibc memcpy of N bytes between `c_pointer`s: the reference copy."""
    _libc.memcpy(dst, src, n)


@dataclass
class CopyResult:
    block_bytes: int
    rounds: int
    blocks_per_round: int
    gbps: dict          # name -> median GB/s
    best_gbps: dict     # name -> best round GB/s
    flush_mode: str = "none"    # the mode the pool ran with (header, or TRACT_FLUSH_MODE)

    def ratio(self, name: str, ref: str) -> float:
        return self.gbps[name] / self.gbps[ref]


def bench_copy(model: str = "llama-3-8b", region_size: int = 1 << 30, rounds: int = 15,
               directory: str = "/dev/shm") -> CopyResult:
    """Copies blocks into and out of distinct slots with the core and with memcpy."""
    profile = load_model(model)
    block = profile.geometry.block_bytes
    with temp_region_path(directory) as path:
        need_space(path, region_size)
        with Pool.create(path, region_size, profile, nodes=1, flush_mode="none", progress=None) as pool:
            n = min(pool.slot_count, 256)
            mode = pool.flush_mode
            rng = np.random.default_rng(1)
            src = rng.integers(0, 255, size=block, dtype=np.uint8)
            dst = np.empty(block, dtype=np.uint8)
            slots = range(n)
            # memcpy's targets: the slots' zero-copy views, the bytes the core copies
            views = [pool.slot_bytes(i) for i in slots]
            csrc, cdst = c_pointer(src), c_pointer(dst, writable=True)
            cslots = [c_pointer(v, writable=True) for v in views]
            # one process, nothing another host wrote: the copies out need no
            # eviction, and are measured without one (invalidate=False)
            pool.acquire_payload(list(slots))

            def run(kind: str) -> float:
                t0 = time.perf_counter()
                if kind == "memcpy_in":
                    for p in cslots:
                        memcpy(p, csrc, block)
                elif kind == "memcpy_out":
                    for p in cslots:
                        memcpy(cdst, p, block)
                elif kind == "tract_in":
                    for i in slots:
                        pool.copy_in(i, src)
                elif kind == "tract_out":
                    for i in slots:
                        pool.copy_out(i, dst, invalidate=False)
                return n * block / (time.perf_counter() - t0) / 1e9

            kinds = ("memcpy_in", "tract_in", "memcpy_out", "tract_out")
            samples = {k: [] for k in kinds}
            try:
                for k in kinds:          # warm-up round
                    run(k)
                for _ in range(rounds):
                    for k in kinds:
                        samples[k].append(run(k))
            finally:
                release(csrc, cdst, *cslots)
                del views, cslots       # the pool closes only once no view of it is left
    return CopyResult(block, rounds, n, {k: statistics.median(v) for k, v in samples.items()},
                      {k: max(v) for k, v in samples.items()}, mode)


@dataclass
class AttachResult:
    region_size: int
    attach_s: float            # attach without pre-fault
    attach_prefault_s: float   # attach with pre-fault
    first_copy_cold_gbps: float  # first copy into 64 untouched slots, no pre-fault
    first_copy_warm_gbps: float  # same after pre-fault
    flush_mode: str = "none"     # the mode the pool ran with


def bench_attach(region_size: int = 8 << 30, model: str = "llama-3-8b",
                 directory: str = "/dev/shm") -> AttachResult:
    """Attach time with and without pre-fault, and what a first request pays without it."""
    profile = load_model(model)
    with temp_region_path(directory) as path:
        need_space(path, region_size)
        format_region(path, region_size, FormatOptions(model=profile, max_nodes=2, flush_mode="none"))
        src = np.ones(profile.geometry.block_bytes, dtype=np.uint8)

        def first_copies(pool: Pool) -> float:
            t0 = time.perf_counter()
            count = min(64, pool.slot_count)
            for i in range(count):
                pool.copy_in(pool.slot_count - 1 - i, src)
            return count * src.nbytes / (time.perf_counter() - t0) / 1e9

        t0 = time.perf_counter()
        pool = Pool.attach(path, prefault=False)
        cold_attach = time.perf_counter() - t0
        cold_copy = first_copies(pool)
        pool.close()
        t0 = time.perf_counter()
        pool = Pool.attach(path, prefault=True)
        warm_attach = time.perf_counter() - t0
        warm_copy = first_copies(pool)
        mode = pool.flush_mode
        pool.close()
    return AttachResult(region_size, cold_attach, warm_attach, cold_copy, warm_copy, mode)


@dataclass
class FormatResult:
    region_size: int
    metadata_bytes: int
    slot_count: int
    format_s: float
    flush_mode: str = "clflush"  # the mode written into the header


def bench_format(region_size: int, model: str = "llama-3-8b",
                 directory: str = "/dev/shm") -> FormatResult:
    """Time of the C core's format on a sparse file: it writes metadata only."""
    profile = load_model(model)
    opts = FormatOptions(model=profile, max_nodes=4, flush_mode="clflush")
    timings: dict = {}
    with temp_region_path(directory) as path:
        # sparse: pages appear only where written; format_s times the C core's format alone
        info = format_region(path, region_size, opts, timings=timings, sparse=True)
    return FormatResult(region_size, info.metadata_bytes, info.slot_count, timings["format_s"],
                        info.flush_mode)
