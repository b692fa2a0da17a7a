"""What a region lives on: a regular file (/dev/shm, hugetlbfs, any path) or a
device-DAX character device, and the checks and reservations each needs.

Device facts come from sysfs (/sys/bus/dax/devices/<dev>/{size,align}); the
root of sysfs can be moved with TRACT_SYSFS_ROOT so tests can point it at a
recorded tree.
"""
from __future__ import annotations

import errno
import mmap
import os
import stat
from dataclasses import dataclass
from typing import Callable

import psutil

from tract_cli.core.errors import NoSpaceError, TractError, UsageError
from tract_cli.core.units import format_size

FILE_ALIGNMENT = 2 << 20  # region files use the device-DAX default, so layouts port
RESERVE_CHUNK = 64 << 20


def sysfs_root() -> str:
    """Root of sysfs (TRACT_SYSFS_ROOT overrides it for tests)."""
    return os.environ.get("TRACT_SYSFS_ROOT", "/sys")


@dataclass(frozen=True)
class Target:
    """A path a region lives on, as found on disk."""

    path: str
    kind: str            # "file", "devdax" or "missing"
    size: int            # current bytes (0 when missing)
    alignment: int       # bytes every length and offset must be a multiple of
    dax_name: str | None = None

    @property
    def medium(self) -> str:
        """Human name of the medium, for reports."""
        if self.kind == "devdax":
            return f"device-DAX {self.dax_name}"
        if self.path.startswith("/dev/shm/"):
            return "emulated /dev/shm region"
        return "emulated region file"


def read_int(path: str) -> int | None:
    """An integer from a sysfs file (decimal or 0x hex), or None."""
    try:
        with open(path) as f:
            return int(f.read().strip(), 0)
    except (OSError, ValueError):
        return None


def _dax_name_of(st: os.stat_result) -> str | None:
    """Finds daxX.Y for a character device by its major:minor in sysfs."""
    link = os.path.join(sysfs_root(), "dev", "char", f"{os.major(st.st_rdev)}:{os.minor(st.st_rdev)}")
    try:
        name = os.path.basename(os.path.realpath(link))
    except OSError:
        return None
    if os.path.isdir(os.path.join(sysfs_root(), "bus", "dax", "devices", name)):
        return name
    return None


def dax_device(name: str) -> tuple[int, int]:
    """Returns (size, align) in bytes of /sys/bus/dax/devices/NAME."""
    base = os.path.join(sysfs_root(), "bus", "dax", "devices", name)
    size = read_int(os.path.join(base, "size"))
    align = read_int(os.path.join(base, "align")) or FILE_ALIGNMENT
    if size is None:
        raise TractError(f"cannot read the size of {name} from {base}/size",
                         "check that the dax modules are loaded (modprobe device_dax)")
    return size, align


def inspect_target(path: str, for_write: bool) -> Target:
    """Classifies PATH; raises a one-line error for anything a region cannot live on."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        parent = os.path.dirname(os.path.abspath(path))
        if not os.path.isdir(parent):
            raise UsageError(f"{path}: directory {parent} does not exist",
                             "create it or choose a path in an existing directory") from None
        if for_write and not os.access(parent, os.W_OK | os.X_OK):
            raise TractError(f"{path}: no permission to create files in {parent}",
                             "choose a writable directory or run with the needed rights") from None
        return Target(path, "missing", 0, FILE_ALIGNMENT)
    except PermissionError:
        raise TractError(f"{path}: permission denied", "run with the needed rights") from None
    except OSError as exc:
        raise TractError(f"{path}: {exc.strerror}", "check the path") from None

    if stat.S_ISDIR(st.st_mode):
        raise UsageError(f"{path} is a directory",
                         f"give a file path inside it, e.g. {os.path.join(path, 'tract.pool')}")
    mode = os.R_OK | (os.W_OK if for_write else 0)
    if not os.access(path, mode):
        need = "read and write" if for_write else "read"
        raise TractError(f"{path}: no permission to {need} it",
                         "run as its owner or root, or change its permissions")
    if stat.S_ISREG(st.st_mode):
        return Target(path, "file", st.st_size, FILE_ALIGNMENT)
    if stat.S_ISCHR(st.st_mode):
        name = _dax_name_of(st)
        if not name:
            raise UsageError(f"{path} is a character device but not a device-DAX device",
                             "give a /dev/daxX.Y device or a regular file")
        size, align = dax_device(name)
        return Target(path, "devdax", size, align, name)
    raise UsageError(f"{path} is neither a regular file nor a device-DAX device",
                     "give a file (e.g. /dev/shm/tract.pool) or /dev/daxX.Y")


MEMORY_FILESYSTEMS = ("tmpfs", "hugetlbfs", "ramfs")


def filesystem_type(path: str) -> str:
    """Type of the file system holding PATH: that of the longest mount point
    above it, of all mounts (psutil; tmpfs and hugetlbfs are not "physical")."""
    target = os.path.realpath(os.path.dirname(os.path.abspath(path)))
    best, fstype = "", "unknown"
    try:
        mounts = psutil.disk_partitions(all=True)
    except OSError:
        return fstype
    for part in mounts:
        mnt = part.mountpoint
        inside = target == mnt or target.startswith(mnt.rstrip("/") + "/")
        if inside and len(mnt) >= len(best):
            best, fstype = mnt, part.fstype
    return fstype


def read_head(path: str, length: int, alignment: int, devdax: bool) -> bytes:
    """The first LENGTH bytes of PATH (at most its size).

    A device-DAX character device has no read(): pread gives EINVAL. It is
    mapped instead, read-only, over one alignment unit (its mappings must be
    aligned: 4 KiB fails with EINVAL too).
    """
    fd = os.open(path, os.O_RDONLY)
    try:
        if not devdax:
            return os.pread(fd, length, 0)
        mm = mmap.mmap(fd, max(alignment, length, 2 << 20), flags=mmap.MAP_SHARED,
                       prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        return mm[:length]
    finally:
        mm.close()


def _materialize(fd: int, offset: int, length: int) -> None:
    """Faults in and zero-fills the pages of a fresh memory-backed file range.

    fallocate on tmpfs reserves pages but leaves them to be cleared at first
    touch, which costs microseconds per 4 KiB page (more inside a VM, where
    the host also backs the page on first touch).  Paying it here, at init,
    means no attach and no request ever pays it.
    """
    from tract_cli.core.native import ffi, lib

    mm = mmap.mmap(fd, length, flags=mmap.MAP_SHARED, offset=offset)
    base = ffi.from_buffer(mm)
    try:
        lib.tract_prefault(base, length, 1)
    finally:
        ffi.release(base)
        mm.close()


def free_bytes(path: str) -> int:
    """Bytes available to this user on the file system holding PATH."""
    vfs = os.statvfs(os.path.dirname(os.path.abspath(path)))
    return vfs.f_bavail * vfs.f_frsize


def mem_available() -> int | None:
    """Bytes of memory available to new allocations (the kernel's MemAvailable,
    by psutil), None where it cannot be read."""
    try:
        return psutil.virtual_memory().available
    except (OSError, RuntimeError):
        return None


def reserve_file(path: str, size: int, progress: Callable[[int, int], None] | None = None,
                 gid: int | None = None) -> bool:
    """Creates or resizes PATH to SIZE and reserves all its pages (fallocate).

    A new file is 0600, or 0660 in group GID (ownership.py); an existing one
    keeps its mode unless GID is given.

    A full tmpfs is reported here, at init, never hit mid-run.  Returns True
    if the file was created by this call (the caller removes it on failure).
    Raises NoSpaceError before writing anything when free space is short.
    """
    existing = os.path.exists(path)
    allocated = os.stat(path).st_blocks * 512 if existing else 0
    need = size - min(allocated, size)
    have = free_bytes(path)
    if need > have:
        fs = os.path.dirname(os.path.abspath(path))
        raise NoSpaceError(
            f"{fs} has {format_size(have)} free but the region needs {format_size(need)} more",
            "free space there, give a smaller --size, or grow the tmpfs "
            "(mount -o remount,size=... /dev/shm)")
    in_memory = filesystem_type(path) in MEMORY_FILESYSTEMS
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    created = not existing
    try:
        if created or gid is not None:
            from tract_cli.core.ownership import apply_sharing
            apply_sharing(fd, gid)
        os.ftruncate(fd, size)
        done = 0
        while done < size:
            step = min(RESERVE_CHUNK, size - done)
            os.posix_fallocate(fd, done, step)
            if in_memory:
                _materialize(fd, done, step)
            done += step
            if progress:
                progress(done, size)
    except OSError as exc:
        os.close(fd)
        if created:
            os.unlink(path)
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            raise NoSpaceError(f"{path}: ran out of space while reserving {format_size(size)}",
                               "free space or give a smaller --size") from None
        raise TractError(f"{path}: cannot reserve {format_size(size)}: {exc.strerror}",
                         "check the file system") from None
    os.close(fd)
    return created


def size_file(path: str, size: int, gid: int | None = None) -> bool:
    """Creates or resizes PATH to SIZE and reserves nothing: a sparse file whose
    pages appear where they are first written (no free-space check).

    What a measurement of format alone wants (`format_region(sparse=True)`):
    a region that is used needs `reserve_file`, so a full tmpfs is reported
    at init, not hit mid-run.  Modes and GID as for `reserve_file`; returns
    True if the file was created by this call.
    """
    existing = os.path.exists(path)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as exc:
        raise TractError(f"{path}: cannot create it: {exc.strerror}",
                         "check the directory and its permissions") from None
    created = not existing
    try:
        if created or gid is not None:
            from tract_cli.core.ownership import apply_sharing
            apply_sharing(fd, gid)
        os.ftruncate(fd, size)
    except OSError as exc:
        if created:
            os.unlink(path)
        raise TractError(f"{path}: cannot size it to {format_size(size)}: {exc.strerror}",
                         "check the file system") from None
    finally:
        os.close(fd)
    return created


def processes_using(path: str) -> list[int]:
    """Pids (other than this one) that have PATH mapped (psutil's memory maps).

    A process that exits meanwhile is skipped by process_iter; one that is
    not ours to read (AccessDenied, or a zombie) gets no maps and is skipped
    too: only what can be seen is reported, as `fuser` does.  (psutil reads
    /proc/<pid>/smaps, some 100 ms for all processes of a small host; only a
    reformat of an existing target pays it.)"""
    real = os.path.realpath(path)
    me = os.getpid()
    pids = []
    for proc in psutil.process_iter(["memory_maps"], ad_value=None):
        maps = proc.info["memory_maps"]
        if proc.pid != me and maps and any(m.path == real for m in maps):
            pids.append(proc.pid)
    return sorted(pids)


def processes_mapping(paths, writable: bool = False) -> dict[str, list[int]]:
    """For each of PATHS (files that exist), the pids that map *that* file
    (WRITABLE: for writing), this one's included: a mapping of a file
    unlinked since, even one that had the same name, is another file's (the
    kernel shows it "(deleted)").

    Reads /proc/<pid>/maps (cheaper than psutil's smaps): a process whose
    maps are not ours to read is skipped, as in `processes_using`, so a
    caller that must not miss a user checks its pids too (a segment's
    journal)."""
    want = {os.fsencode(os.path.realpath(p)): p for p in paths}
    found: dict[str, list[int]] = {p: [] for p in paths}
    if not want:
        return found
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/maps", "rb") as f:
                maps = f.read()
        except OSError:
            continue                  # gone meanwhile, or not ours to read
        if not any(w in maps for w in want):
            continue
        seen = set()
        for line in maps.splitlines():
            fields = line.split(None, 5)      # address perms offset dev inode path
            if len(fields) == 6 and fields[5] in want and fields[5] not in seen and \
                    (not writable or b"w" in fields[1]):
                seen.add(fields[5])
                found[want[fields[5]]].append(int(name))
    return found
