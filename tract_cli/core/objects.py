"""The object store: named roots in the region (the paper's cxl_shm_put/get)."""
from __future__ import annotations

from typing import NamedTuple

from tract_cli.core.errors import CorruptRegion, PoolFull, UsageError
from tract_cli.core.locks import DEFAULT_TIMEOUT_S
from tract_cli.core.media import c_fields
from tract_cli.core.native import lib, ffi, raise_for


# a name fills the entry's field but for its NUL (native/format.h); the
# directory holds TRACT_OBJDIR_ENTRIES of them
NAME_MAX = c_fields("tract_objdir_entry")["name"][1] - 1
ENTRIES = lib.TRACT_OBJDIR_ENTRIES


class ObjectRef(NamedTuple):
    """Where a named object lives (a tuple: `offset, size = ...` works)."""

    offset: int             # region offset
    size: int               # bytes


class ObjectStore:
    """put(name, offset, size) under the directory lock; get(name) without it."""

    def __init__(self, pool):
        self._pool = pool

    @staticmethod
    def _name(name: str) -> bytes:
        raw = name.encode()
        if not 1 <= len(raw) <= NAME_MAX or b"\0" in raw:
            raise UsageError(f"object name {name!r} must be 1 to {NAME_MAX} bytes without NUL",
                             "shorten the name")
        return raw

    def put(self, name: str, offset: int, size: int, timeout: float = DEFAULT_TIMEOUT_S) -> None:
        """Publishes NAME -> (OFFSET, SIZE bytes) in the region."""
        rc = lib.tract_obj_put(self._pool._r(), self._name(name), offset, size, int(timeout * 1e9))
        if rc == lib.TRACT_E_FULL:
            raise PoolFull(f"the object directory is full ({ENTRIES} names)",
                           "delete unused names")
        raise_for(rc, f"object {name!r}")

    def get(self, name: str) -> ObjectRef | None:
        """Where NAME lives, or None if absent."""
        off, size = ffi.new("uint64_t *"), ffi.new("uint64_t *")
        rc = lib.tract_obj_get(self._pool._r(), self._name(name), off, size)
        if rc == lib.TRACT_E_NOT_FOUND:
            return None
        if rc == lib.TRACT_E_CORRUPT:
            raise CorruptRegion(f"object {name!r} points outside the region (corrupt directory)",
                             "run `tract check` on the region")
        raise_for(rc, f"object {name!r}")
        return ObjectRef(off[0], size[0])

    def delete(self, name: str, timeout: float = DEFAULT_TIMEOUT_S) -> bool:
        """Removes NAME; returns False if it was absent."""
        rc = lib.tract_obj_delete(self._pool._r(), self._name(name), int(timeout * 1e9))
        if rc == lib.TRACT_E_NOT_FOUND:
            return False
        raise_for(rc, f"object {name!r}")
        return True
