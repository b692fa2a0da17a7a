"""The node agent as a process: `python -m tract_cli.core.agent_main OPTIONS_JSON`.

What `ensure_agent` (`core/agent_launch.py`) starts for workers and
benchmarks: the core's own entry point, so the core never calls up into the
command line.  `tract agent` runs the same `agent.run_foreground` with the
same options (`agent.AgentOptions`, whose JSON this process takes: the
options are defined once, and parsed as flags only by the command line),
and adds CPU pinning.  The agent's log is on stderr
(`agent.log_to_stderr`), errors as one line `tract agent: error: ...`, exit
code 1 (2 for bad options).
"""
from __future__ import annotations

import argparse
import sys

import psutil

from tract_cli.core.agent import AgentOptions, log, log_to_stderr, run_foreground
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
                                description="Run a node agent (as `tract agent`) with the options "
                                            "ensure_agent gives it.")
    p.add_argument("options", help="core.agent.AgentOptions as JSON")
    args = p.parse_args(argv)
    leave_parent_pinning()
    log_to_stderr()
    try:
        run_foreground(AgentOptions.from_json(args.options))
    except TractError as err:
        log.error("error: %s", err)
        return err.exit_code
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
