"""The node-local segment: a small file in local DRAM (/dev/shm) that every
process of one node maps.  It holds the local tier of the two-tier lock
(robust process-shared mutexes), the node's agent mutex and the node's slot
free list.  Nothing in it is ever read by another host.

A segment appears fully initialized or not at all: it is initialized under
a temporary name and renamed into place, so concurrent first attaches on a
node never see a half-built one.

A segment records where its region lives (its origin: the region file's
path, or that it is a device), so that one left behind once its region is
gone can be told from one in use: `sweep_segments` removes every segment
whose region file is gone and that no live process uses; the node agent
removes its own node's when it stops for that reason (docs/PROTOCOLS.md §7).
"""
from __future__ import annotations

import glob
import mmap
import os
import re
import stat
import uuid as uuidlib
from dataclasses import dataclass

from tract_cli.core.errors import TractError
from tract_cli.core.native import ffi, lib, raise_for


def local_dir() -> str:
    """Where local segments live (TRACT_LOCAL_DIR overrides /dev/shm)."""
    return os.environ.get("TRACT_LOCAL_DIR", "/dev/shm")


def local_path(region_uuid: str, node: int) -> str:
    """Path of the local segment of NODE for the region with REGION_UUID."""
    return os.path.join(local_dir(), f"tract-{region_uuid}-node{node}.local")


class LocalSegment:
    """A mapped local segment, bound to a region handle."""

    def __init__(self, path: str, mm: mmap.mmap, base):
        self.path = path
        self._mm = mm
        self._base = base

    @classmethod
    def open_or_create(cls, region, region_uuid: str, node: int,
                       sharing: tuple[int, int | None] = (0o600, None), *,
                       region_path: str | None = None,
                       device: bool = False) -> "LocalSegment":
        """Maps the node's segment, creating and initializing it if absent
        (with SHARING: the mode and group of the region it belongs to; a new
        segment records REGION_PATH, a file unless DEVICE, as its origin)."""
        path = local_path(region_uuid, node)
        size = lib.tract_local_size(region)
        if not os.path.exists(path):
            origin = _origin(region_path, device)
            tmp = f"{path}.{uuidlib.uuid4().hex[:8]}.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                from tract_cli.core.ownership import apply_sharing
                apply_sharing(fd, sharing[1])
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
                base = ffi.from_buffer(mm)
                try:
                    raise_for(lib.tract_local_init(base, size, region, origin), path)
                finally:
                    ffi.release(base)
                    mm.close()
                try:
                    os.link(tmp, path)       # atomic; fails if another process won
                except FileExistsError:
                    pass
            finally:
                os.close(fd)
                os.unlink(tmp)
        try:
            fd = os.open(path, os.O_RDWR)
        except PermissionError:
            raise TractError(f"local segment {path} belongs to another user",
                             "run as that user, or have the region shared with --group and "
                             "remove the segment once no process of the node runs") from None
        try:
            if os.fstat(fd).st_size < size:
                raise TractError(f"local segment {path} is smaller than this region needs",
                                 "stop the node's processes and remove it")
            mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
        finally:
            os.close(fd)
        base = ffi.from_buffer(mm)
        rc = lib.tract_bind_local(region, base, size)
        if rc != 0:
            ffi.release(base)
            mm.close()
            if rc in (lib.TRACT_E_LAYOUT, lib.TRACT_E_NOT_FORMATTED):
                raise TractError(f"local segment {path} belongs to another region or node, "
                                 "or to another version of TraCT",
                                 "remove it once no process of this node runs")
            raise_for(rc, path)
        return cls(path, mm, base)

    def close(self) -> None:
        if self._base is not None:
            ffi.release(self._base)
            self._base = None
            self._mm.close()


def remove_segments(region_uuid: str) -> int:
    """Removes every node's local segment of a region that no longer exists
    (and any a process was killed creating); returns how many segments."""
    n = 0
    base = os.path.join(local_dir(), f"tract-{region_uuid}-node")
    for path in glob.glob(base + "*.local") + glob.glob(base + "*.local.*.tmp"):
        try:
            os.unlink(path)
            n += path.endswith(".local")
        except FileNotFoundError:
            pass
    return n


# ---- segments whose region is gone ----

# a segment's name, or the name it is built under (open_or_create)
_NAME = re.compile(r"tract-([0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12})"
                   r"-node([0-9]+)\.local(\.[0-9a-f]{8}\.tmp)?")


def _namespaces() -> tuple[int, int]:
    """This process's pid and mount namespaces (their inodes; 0: unknown)."""
    out = []
    for ns in ("pid", "mnt"):
        try:
            out.append(os.stat(f"/proc/self/ns/{ns}").st_ino)
        except OSError:
            out.append(0)
    return out[0], out[1]


def _origin(region_path: str | None, device: bool):
    """The origin a new segment records: REGION_PATH made absolute (a path too
    long to record, or none, is an unknown origin, never judged gone)."""
    o = ffi.new("struct tract_local_origin *")
    if region_path is None:
        return o
    real = os.fsencode(os.path.realpath(region_path))
    if len(real) >= lib.TRACT_LOCAL_PATH_MAX:
        return o
    o.kind = lib.TRACT_LOCAL_REGION_DEVICE if device else lib.TRACT_LOCAL_REGION_FILE
    o.pid_ns, o.mnt_ns = _namespaces()
    o.path = real
    return o


def region_holds(path: str, region_uuid: str) -> bool | None:
    """Whether the file at PATH is the region REGION_UUID: False when PATH is
    missing or holds anything else (the region is gone: removed, replaced,
    reformatted or moved away), None when that cannot be told (not ours to
    read, not a regular file)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
    except (FileNotFoundError, NotADirectoryError):
        return False
    except OSError:
        return None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            return None
        head = os.pread(fd, 32, 0)
    except OSError:
        return None
    finally:
        os.close(fd)
    return head[:8] == b"TRACTPOL" and head[16:32] == uuidlib.UUID(region_uuid).bytes


@dataclass(frozen=True)
class SegmentInfo:
    """What a local segment (a file in `local_dir()`) says of itself."""

    path: str
    region_uuid: str
    node: int
    kind: int                  # lib.TRACT_LOCAL_REGION_*
    region_path: str           # "" when unknown
    namespaces: tuple[int, int]
    pids: tuple[int, ...]      # the processes its journal names (alive or not)


def describe_segment(path: str) -> SegmentInfo | None:
    """Reads the segment at PATH without binding it; None when it is no
    segment of this layout version (another version's, half built, not a
    regular file, not ours to read)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW | os.O_NONBLOCK)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size < 32:
            return None
        mm = mmap.mmap(fd, st.st_size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
    except (OSError, ValueError):
        return None
    finally:
        os.close(fd)
    cap = 64                   # more than a journal has entries
    desc, pids = ffi.new("struct tract_local_desc *"), ffi.new("uint32_t[]", cap)
    base = ffi.from_buffer(mm)
    try:
        rc = lib.tract_local_describe(base, st.st_size, desc, pids, cap)
    finally:
        ffi.release(base)
        mm.close()
    if rc != 0:
        return None
    o = desc.origin
    return SegmentInfo(path, str(uuidlib.UUID(bytes=bytes(ffi.buffer(desc.region_uuid)))),
                       int(desc.node), int(o.kind), os.fsdecode(ffi.string(o.path)),
                       (int(o.pid_ns), int(o.mnt_ns)),
                       tuple(int(p) for p in pids[0:min(int(desc.pid_count), cap)]))


def stale(seg: SegmentInfo) -> bool:
    """Whether SEG's region is gone and no other process its journal names
    lives (what a live process maps, this one's mappings included, is the
    caller's to check: `sweep_segments`).  A device's segment, one of
    unknown origin, and one made in another pid or mount namespace (its
    pids and path mean other things there) are never stale."""
    from tract_cli.core.pids import pid_alive
    if seg.kind != lib.TRACT_LOCAL_REGION_FILE or not seg.region_path:
        return False
    if 0 in seg.namespaces or seg.namespaces != _namespaces():
        return False
    if region_holds(seg.region_path, seg.region_uuid) is not False:
        return False
    me = os.getpid()
    return not any(pid_alive(p) for p in seg.pids if p != me)


def sweep_segments() -> list[str]:
    """Removes the local segments whose region file is gone and that no live
    process uses -- none its journal names, none maps it for writing, as
    every attached process does (a sweep's own look is read-only) -- and
    returns their paths.  Never raises: a segment it cannot judge stays.
    What `tract init`, `Pool.create`, `remove_region` and every agent's
    start and stop run."""
    try:
        names = os.listdir(local_dir())
    except OSError:
        return []
    candidates = []
    for name in names:
        m = _NAME.fullmatch(name)
        if m is None:
            continue
        path = os.path.join(local_dir(), name)
        seg = describe_segment(path)
        if seg is not None and seg.region_uuid == m.group(1) and seg.node == int(m.group(2)) \
                and stale(seg):
            candidates.append(path)
    if not candidates:
        return []
    from tract_cli.core.medium import processes_mapping
    try:
        mapped = processes_mapping(candidates, writable=True)
    except OSError:
        return []                     # no /proc to look in: nothing is known unused
    removed = []
    for path in candidates:
        if mapped[path]:
            continue
        try:
            os.unlink(path)
        except OSError:
            continue                  # gone meanwhile, or not ours to remove
        removed.append(path)
    return removed
