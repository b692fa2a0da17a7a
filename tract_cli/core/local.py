"""The node-local segment: a small file in local DRAM (/dev/shm) that every
process of one node maps.  It holds the local tier of the two-tier lock
(robust process-shared mutexes), the node's agent mutex and the node's slot
free list.  Nothing in it is ever read by another host.

A segment appears fully initialized or not at all: it is initialized under
a temporary name and renamed into place, so concurrent first attaches on a
node never see a half-built one.
"""
from __future__ import annotations

import mmap
import os
import uuid as uuidlib

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
                       sharing: tuple[int, int | None] = (0o600, None)) -> "LocalSegment":
        """Maps the node's segment, creating and initializing it if absent
        (with SHARING: the mode and group of the region it belongs to)."""
        path = local_path(region_uuid, node)
        size = lib.tract_local_size(region)
        if not os.path.exists(path):
            tmp = f"{path}.{uuidlib.uuid4().hex[:8]}.tmp"
            fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            try:
                from tract_cli.core.ownership import apply_sharing
                apply_sharing(fd, sharing[1])
                os.ftruncate(fd, size)
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED)
                base = ffi.from_buffer(mm)
                try:
                    raise_for(lib.tract_local_init(base, size, region), path)
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
    """Removes every node's local segment of a region that no longer exists."""
    import glob
    n = 0
    for path in glob.glob(os.path.join(local_dir(), f"tract-{region_uuid}-node*.local")):
        try:
            os.unlink(path)
            n += 1
        except FileNotFoundError:
            pass
    return n
