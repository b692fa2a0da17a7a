"""Errors of the TraCT library.

Every error carries one line that says what is wrong and what to do; the
command line prints exactly that line (no traceback) and exits non-zero.
"""
from __future__ import annotations


class TractError(Exception):
    """A failure the user can act on: `str(err)` is one line, problem then fix."""

    exit_code = 1

    def __init__(self, problem: str, fix: str | None = None):
        self.problem = problem
        self.fix = fix
        super().__init__(f"{problem}; {fix}" if fix else problem)


class UsageError(TractError):
    """Bad arguments (exit code 2)."""

    exit_code = 2


class NotFormattedError(TractError):
    """The target holds no TraCT format."""


class FormatMismatchError(TractError):
    """The region's format, version, checksum, size or layout is not usable."""


class GeometryMismatchError(TractError):
    """The region was formatted for a different KV geometry or model."""


class AlreadyFormattedError(TractError):
    """Refusing to overwrite an existing TraCT region (or other data) without --force."""


class NoSpaceError(TractError):
    """The file system behind a region file has too little free space."""


class FlushModeError(TractError):
    """The CPU does not support the requested flush mode."""
