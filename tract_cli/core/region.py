"""Creating and formatting regions, and reading what a target already holds.

`format_region` is what `tract init` and `Pool.create` run: validate every
parameter, check what is on the target, reserve a file's pages, map it
MAP_SHARED and let the C core write the metadata.  Nothing is written until
every check has passed.
"""
from __future__ import annotations

import mmap
import os
import secrets
import time
import uuid as uuidlib
from dataclasses import dataclass
from typing import Callable

from tract_cli.core import medium
from tract_cli.core.errors import AlreadyFormattedError, FlushModeError, TractError, UsageError
from tract_cli.core.geometry import ModelProfile
from tract_cli.core.header import HASH_SCHEMES, RegionInfo, Section, SECTION_NAMES, decode_header
from tract_cli.core.native import FLUSH_MODES, ffi, flush_mode_supported, lib, raise_for
from tract_cli.core.units import format_size

HEADER_SIZE = lib.TRACT_HEADER_SIZE
# the layout's defaults, the C core's (tract.h)
DEFAULT_INDEX_STRIPES = lib.TRACT_DEFAULT_INDEX_STRIPES
DEFAULT_TRANSFER_ENTRIES = lib.TRACT_DEFAULT_TRANSFER_ENTRIES


@dataclass(frozen=True)
class FormatOptions:
    """What `tract init` was asked for."""

    model: ModelProfile
    max_nodes: int = 4
    flush_mode: str | None = None    # None: clflush on device-DAX, none on a file
    hash_scheme: str = "tract"
    index_stripes: int = DEFAULT_INDEX_STRIPES
    transfer_entries: int = DEFAULT_TRANSFER_ENTRIES
    zero_on_free: bool = False       # freed slots are cleared before reuse (tenant isolation)


def _params(size: int, alignment: int, opts: FormatOptions, flush_mode: str):
    g = opts.model.geometry
    p = ffi.new("struct tract_format_params *")
    p.region_size = size
    p.alignment = alignment
    p.max_nodes = opts.max_nodes
    p.flush_mode = FLUSH_MODES[flush_mode]
    p.block_tokens = g.block_tokens
    p.num_layers = g.num_layers
    p.num_kv_heads = g.num_kv_heads
    p.head_dim = g.head_dim
    p.dtype = g.dtype_code
    p.dtype_bytes = g.dtype_bytes
    p.hash_scheme = HASH_SCHEMES[opts.hash_scheme]
    p.index_stripes = opts.index_stripes
    p.transfer_entries = opts.transfer_entries
    p.flags = lib.TRACT_HDR_ZERO_ON_FREE if opts.zero_on_free else 0
    ffi.memmove(p.uuid, uuidlib.uuid4().bytes, 16)
    ffi.memmove(p.hash_seed, secrets.token_bytes(16), 16)
    ffi.memmove(p.model_fingerprint, opts.model.fingerprint(), 32)
    ffi.memmove(p.model_name, opts.model.name.encode()[:31], len(opts.model.name.encode()[:31]))
    p.created_ns = time.time_ns()
    return p


def validate_options(opts: FormatOptions) -> None:
    """Raises UsageError for parameters the format cannot hold."""
    if not 1 <= opts.max_nodes <= lib.TRACT_MAX_NODES:
        raise UsageError(f"--nodes {opts.max_nodes} is out of range",
                         f"give 1 to {lib.TRACT_MAX_NODES} nodes")
    if opts.flush_mode is not None and opts.flush_mode not in FLUSH_MODES:
        raise UsageError(f"unknown flush mode {opts.flush_mode!r}",
                         f"use one of {', '.join(FLUSH_MODES)}")
    if opts.hash_scheme not in HASH_SCHEMES:
        raise UsageError(f"unknown hash scheme {opts.hash_scheme!r}",
                         f"use one of {', '.join(HASH_SCHEMES)}")
    s = opts.index_stripes
    if s < 1 or s > 4096 or s & (s - 1):
        raise UsageError(f"index stripes {s} must be a power of two from 1 to 4096",
                         "e.g. 64")
    if not 1 <= opts.transfer_entries <= 1 << 20:
        raise UsageError(f"transfer entries {opts.transfer_entries} out of range",
                         "give 1 to 1048576")


def compute_layout(size: int, alignment: int, opts: FormatOptions,
                   flush_mode: str = "none") -> tuple[list[Section], int]:
    """The sections and slot count a region of SIZE would get (touches nothing)."""
    validate_options(opts)
    p = _params(size, alignment, opts, flush_mode)
    out = ffi.new("struct tract_section[]", lib.TRACT_MAX_SECTIONS)
    count = ffi.new("uint32_t *")
    slots = ffi.new("uint64_t *")
    rc = lib.tract_layout_compute(p, out, count, slots, ffi.NULL)
    if rc == lib.TRACT_E_ALIGN:
        raise UsageError(f"size {format_size(size)} is not a multiple of the alignment "
                         f"{format_size(alignment)}",
                         f"round --size to a multiple of {format_size(alignment)}")
    if rc == lib.TRACT_E_TOO_SMALL:
        raise UsageError(f"size {format_size(size)} is too small for the metadata and one "
                         f"{format_size(opts.model.geometry.block_bytes)} block slot",
                         "give a larger --size or fewer --nodes")
    if rc == lib.TRACT_E_INVAL:
        raise UsageError("the model geometry or format parameters are out of range",
                         "check the model profile (block must be at most 4 GiB)")
    raise_for(rc, "layout")
    sections = [Section(SECTION_NAMES[s.kind], s.kind, s.offset, s.length, s.count, s.entry_size)
                for s in (out[i] for i in range(count[0]))]
    return sections, slots[0]


def probe(path: str, target: medium.Target) -> tuple[str, RegionInfo | None]:
    """What TARGET holds now: ("empty"|"tract"|"tract-corrupt"|"other", info)."""
    if target.kind == "missing" or target.size == 0:
        return "empty", None
    try:
        head = medium.read_head(path, HEADER_SIZE, target.alignment, target.kind == "devdax")
    except OSError as exc:
        raise TractError(f"{path}: cannot read its first page: {exc.strerror}",
                         "check permissions (and that a device is in devdax mode)") from None
    if len(head) < HEADER_SIZE:
        return ("empty" if not any(head) else "other"), None
    if head[:8] == b"TRACTPOL":
        hdr = ffi.new("struct tract_header *")
        buf = ffi.from_buffer(head)
        # the header claims a size; only the header page is checked here
        rc = lib.tract_verify_header(buf, 1 << 62, hdr)
        return ("tract", decode_header(hdr)) if rc == 0 else ("tract-corrupt", None)
    return ("empty" if not any(head) else "other"), None


def describe_existing(kind: str, info: RegionInfo | None, target: medium.Target) -> str:
    """One phrase saying what is on a target, for refusals."""
    if kind == "tract" and info:
        created = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(info.created_ns / 1e9))
        return (f"a TraCT region (format v{info.format_version}, uuid {info.uuid}, "
                f"{format_size(info.region_size)}, model {info.model_name}, created {created})")
    if kind == "tract-corrupt":
        return "a TraCT region with a damaged or unknown-version header"
    return f"{format_size(target.size)} of other data (not a TraCT region)"


def format_region(path: str, size: int | None, opts: FormatOptions, force: bool = False,
                  progress: Callable[[int, int], None] | None = None,
                  timings: dict | None = None, group: str | None = None,
                  sparse: bool = False) -> RegionInfo:
    """Creates (for files) and formats a region at PATH; returns its header.

    A new region file is 0600; GROUP shares it (0660, that group).

    SPARSE leaves a region file's pages unreserved (`medium.size_file`: they
    appear where written, so formatting touches the metadata pages only):
    for measuring format alone (`tract microbench format`), never for a
    region that will be used.

    TIMINGS, if given, receives reserve_s (file page reservation, grows with
    size) and format_s (metadata only, does not).
    """
    timings = {} if timings is None else timings
    validate_options(opts)
    target = medium.inspect_target(path, for_write=True)
    if target.kind == "missing" and os.path.basename(path).startswith("dax") and \
            os.path.dirname(os.path.abspath(path)) == "/dev":
        raise UsageError(f"{path} does not exist",
                         "create it with `tract init PATH --provision` (see `tract devices`)")
    if target.kind == "devdax":
        if size is None:
            size = target.size
        if size > target.size:
            raise UsageError(f"--size {format_size(size)} exceeds {target.dax_name}'s "
                             f"{format_size(target.size)}", "give a smaller --size or omit it")
    elif size is None:
        raise UsageError("a region file needs --size", "e.g. --size 8G")
    flush_mode = opts.flush_mode or ("clflush" if target.kind == "devdax" else "none")
    if not flush_mode_supported(flush_mode):
        raise FlushModeError(f"this CPU does not support flush mode {flush_mode}",
                             "choose another with --flush-mode (see `tract doctor`)")
    compute_layout(size, target.alignment, opts, flush_mode)   # all checks before any write

    users = medium.processes_using(path) if target.kind != "missing" else []
    if users and not force:
        raise AlreadyFormattedError(f"{path} is mapped by running processes (pids "
                                    f"{', '.join(map(str, users[:8]))})",
                                    "stop them first, or pass --force")
    kind, info = probe(path, target)
    if kind != "empty" and not force:
        raise AlreadyFormattedError(f"{path} already holds {describe_existing(kind, info, target)}",
                                    "pass --force to overwrite it")

    if kind == "tract" and info is not None:
        # the old region's node-local segments (locks, free lists) die with it
        from tract_cli.core.local import remove_segments
        remove_segments(info.uuid)
    created = False
    t0 = time.perf_counter()
    gid = None
    if group is not None:
        if target.kind == "devdax":
            raise UsageError("--group applies to region files; a device's access is its device "
                             "node's", f"set the group of {path} with a udev rule")
        from tract_cli.core.ownership import group_id
        gid = group_id(group)
    if target.kind != "devdax":
        created = medium.size_file(path, size, gid=gid) if sparse else \
            medium.reserve_file(path, size, progress, gid=gid)
    timings["reserve_s"] = time.perf_counter() - t0
    try:
        fd = os.open(path, os.O_RDWR)
        try:
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        finally:
            os.close(fd)
        base = ffi.from_buffer(mm)
        try:
            params = _params(size, target.alignment, opts, flush_mode)
            t0 = time.perf_counter()
            raise_for(lib.tract_format(base, params), path)
            timings["format_s"] = time.perf_counter() - t0
            hdr = ffi.new("struct tract_header *")
            raise_for(lib.tract_verify_header(base, size, hdr), path)
            if target.kind != "devdax":
                # a file's pages to its backing store; device-DAX has no page
                # cache (msync gives EINVAL): the core's line flushes are what
                # put the metadata on the device
                mm.flush()
        finally:
            ffi.release(base)
            mm.close()
    except BaseException:
        if created:
            os.unlink(path)
        raise
    # what regions removed since left behind (a natural moment: a user who
    # makes regions is one who removes them)
    from tract_cli.core.local import sweep_segments
    sweep_segments()
    return decode_header(hdr)


def remove_region(path: str) -> None:
    """Removes a region file and its nodes' local segments (the region's own,
    whoever still maps them: nothing can attach to it again), then the
    segments other regions left behind (`local.sweep_segments`)."""
    from tract_cli.core.local import remove_segments, sweep_segments
    if os.path.exists(path):
        with open(path, "rb") as f:
            head = f.read(32)
        os.unlink(path)         # first: no process attaches and makes a segment after
        if head[:8] == b"TRACTPOL":
            remove_segments(str(uuidlib.UUID(bytes=head[16:32])))
    sweep_segments()
