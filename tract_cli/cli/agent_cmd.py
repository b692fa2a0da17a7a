"""`tract agent`: run a node's agent in the foreground (heartbeat, lock manager)."""
from __future__ import annotations

import os
import signal
import sys
import threading
from typing import Optional

import typer

from tract_cli.core.agent import Agent
from tract_cli.core.errors import UsageError
from tract_cli.provision.topology import pin


def agent(
    pool: str = typer.Option(..., "--pool", "-p", help="Region file or /dev/daxX.Y."),
    node: int = typer.Option(..., "--node", "-n", help="This host's node id."),
    manager: bool = typer.Option(False, "--manager", help="Run the region's lock manager here."),
    simulate: bool = typer.Option(False, "--simulate", help="Non-coherence simulator (tests)."),
    flush_mode: Optional[str] = typer.Option(None, "--flush-mode", help="Override the header's."),
    heartbeat_ms: int = typer.Option(100, "--heartbeat-ms", help="Heartbeat period."),
    takeover_after: float = typer.Option(
        2.0, "--takeover-after", metavar="SECONDS",
        help="Take the lock manager over when its heartbeat has not moved for this long."),
    no_takeover: bool = typer.Option(False, "--no-takeover",
                                     help="Never take the lock manager over."),
    numa_node: Optional[int] = typer.Option(None, "--numa-node", help="Pin to this node's CPUs."),
    cpus: Optional[str] = typer.Option(None, "--cpus", help="Pin to these CPUs (e.g. 0-3,8)."),
) -> None:
    """Run the node agent until SIGTERM or Ctrl-C; logs to stderr."""
    if not 10 <= heartbeat_ms <= 10000:
        raise UsageError(f"--heartbeat-ms {heartbeat_ms} is outside 10..10000",
                         "give the heartbeat period in milliseconds, e.g. 100")
    if not 0.2 <= takeover_after <= 3600:
        raise UsageError(f"--takeover-after {takeover_after:g} is outside 0.2..3600 seconds",
                         "give the seconds a manager heartbeat may stand still, e.g. 2")
    if takeover_after * 1000 < 3 * heartbeat_ms:
        raise UsageError(f"--takeover-after {takeover_after:g} s is under three heartbeats "
                         f"({heartbeat_ms} ms each)", "raise it, or lower --heartbeat-ms")
    pin(numa_node, cpus)      # before touching the region
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    a = Agent(pool, node, manager, simulate=simulate or None, flush_mode=flush_mode,
              heartbeat_s=heartbeat_ms / 1000,
              takeover_after_s=None if no_takeover else takeover_after).start()
    role = ", lock manager" if manager else (", standby manager" if not no_takeover else "")
    print(f"tract agent: node {node} pid {os.getpid()} epoch {a.epoch}{role}: running",
          file=sys.stderr, flush=True)
    try:
        a.wait(stop)
    finally:
        stats = a.manager_stats()
        a.stop()
        extra = f" ({stats['grants']} grants in {stats['scans']} scans)" if stats else ""
        print(f"tract agent: node {node}: stopped{extra}", file=sys.stderr, flush=True)
