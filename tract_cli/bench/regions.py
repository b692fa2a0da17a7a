"""The temporary regions the benchmarks run on: a path for one (removed
afterwards) and the check that its file system has room for it."""
from __future__ import annotations

import os
import tempfile
from contextlib import contextmanager

from tract_cli.core import medium
from tract_cli.core.errors import NoSpaceError
from tract_cli.core.region import remove_region
from tract_cli.core.units import format_size


@contextmanager
def temp_region_path(directory: str = "/dev/shm"):
    """A region path in DIRECTORY, removed afterwards (also on Ctrl-C)."""
    fd, path = tempfile.mkstemp(prefix="tract-bench-", suffix=".pool", dir=directory)
    os.close(fd)
    os.unlink(path)
    try:
        yield path
    finally:
        remove_region(path)


def need_space(path: str, size: int, smaller: str = "a smaller --size") -> None:
    """Raises NoSpaceError unless PATH's file system has SIZE bytes free (a
    temporary region's room, checked before anything is written); its fix
    names SMALLER, the option that asks for less."""
    free = medium.free_bytes(path)
    if free < size:
        raise NoSpaceError(f"the benchmark needs {format_size(size)} in "
                           f"{os.path.dirname(path)}, {format_size(free)} free",
                           f"free space or pass {smaller}")
