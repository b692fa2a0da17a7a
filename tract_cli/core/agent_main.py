"""The node agent as a process: `python -m tract_cli.core.agent_main --pool P --node N ...`.

What `ensure_agent` (`core/agent_launch.py`) starts for workers and
benchmarks: the core's own entry point, so the core never calls up into the
command line.  `tract agent` runs the same `agent.run_foreground` with the
same options (and adds CPU pinning).  The agent's log is on stderr
(`agent.log_to_stderr`), errors as one line `tract agent: error: ...`, exit
code 1 (2 for bad options).
"""
from __future__ import annotations

import argparse
import sys

import psutil

from tract_cli.core.agent import (HEARTBEAT_S, TAKEOVER_AFTER_S, log, log_to_stderr,
                                  run_foreground)
from tract_cli.core.cpu import allowed_cpus
from tract_cli.core.errors import TractError


def leave_parent_pinning() -> None:
    """An agent runs where the OS schedules it, not on the CPUs its starter was pinned
    to: vLLM's CPU worker binds itself to one core, and a lock manager inheriting
    that core next to the engine's busy-polling threads answered lock requests
    after up to a second."""
    try:
        psutil.Process().cpu_affinity(sorted(allowed_cpus()))
    except (OSError, ValueError, psutil.Error):
        pass                      # not permitted here: stay where we are


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tract_cli.core.agent_main",
                                description="Run a node agent (as `tract agent`).")
    p.add_argument("--pool", "-p", required=True)
    p.add_argument("--node", "-n", type=int, required=True)
    p.add_argument("--manager", action="store_true")
    p.add_argument("--simulate", action="store_true")
    p.add_argument("--flush-mode")
    p.add_argument("--heartbeat-ms", type=int, default=round(HEARTBEAT_S * 1000))
    p.add_argument("--takeover-after", type=float, default=TAKEOVER_AFTER_S)
    p.add_argument("--no-takeover", action="store_true")
    p.add_argument("--exit-when-idle", type=float, default=None, metavar="SECONDS")
    args = p.parse_args(argv)
    leave_parent_pinning()
    log_to_stderr()
    try:
        run_foreground(args.pool, args.node, args.manager, simulate=args.simulate,
                       flush_mode=args.flush_mode, heartbeat_ms=args.heartbeat_ms,
                       takeover_after=None if args.no_takeover else args.takeover_after,
                       idle_exit=args.exit_when_idle)
    except TractError as err:
        log.error("error: %s", err)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
