"""Shared rendering helpers: consoles, JSON output, progress bars."""
from __future__ import annotations

import json
import sys
from contextlib import contextmanager

from rich.console import Console
from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn

stdout = Console()
stderr = Console(stderr=True)


def print_json(data) -> None:
    """Writes DATA as JSON on stdout (stable keys, for scripts)."""
    sys.stdout.write(json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextmanager
def byte_progress(description: str, enabled: bool = True):
    """Yields a callback(done, total) that drives a progress bar on stderr."""
    if not enabled:
        yield None
        return
    progress = Progress(TextColumn("{task.description}"), BarColumn(), DownloadColumn(),
                        TimeRemainingColumn(), console=stderr, transient=True)
    task = None

    def update(done: int, total: int) -> None:
        nonlocal task
        if task is None:
            task = progress.add_task(description, total=total)
        progress.update(task, completed=done)

    with progress:
        yield update
