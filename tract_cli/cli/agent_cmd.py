"""`tract agent`: run a node's agent in the foreground (heartbeat, lock manager)."""
from __future__ import annotations

from typing import Optional

import typer

from tract_cli.core.agent import AgentOptions, run_foreground
from tract_cli.provision.topology import pin


def agent(
    pool: str = typer.Option(..., "--pool", "-p", help="Region file or /dev/daxX.Y."),
    node: int = typer.Option(..., "--node", "-n", help="This host's node id."),
    manager: bool = typer.Option(False, "--manager", help="Run the region's lock manager here."),
    simulate: bool = typer.Option(False, "--simulate", help="Non-coherence simulator (tests)."),
    flush_mode: Optional[str] = typer.Option(None, "--flush-mode", help="Override the header's."),
    heartbeat_ms: int = typer.Option(AgentOptions.heartbeat_ms, "--heartbeat-ms",
                                     help="Heartbeat period."),
    takeover_after: float = typer.Option(
        AgentOptions.takeover_after, "--takeover-after", metavar="SECONDS",
        help="Take the lock manager over when its heartbeat has not moved for this long."),
    no_takeover: bool = typer.Option(False, "--no-takeover",
                                     help="Never take the lock manager over."),
    exit_when_idle: Optional[float] = typer.Option(
        None, "--exit-when-idle", metavar="SECONDS",
        help="Stop once the node has had no process for this long (what workers' agents do); "
             "default: run until stopped."),
    host_dead_after: float = typer.Option(
        AgentOptions.host_dead_after, "--host-dead-after", metavar="SECONDS",
        help="As the lock manager: declare a node of another host dead when its heartbeat has "
             "not moved for this long (its locks taken back, its writes and pins given back)."),
    never_declare_dead: bool = typer.Option(False, "--never-declare-dead",
                                            help="Never declare a host dead (recover it offline)."),
    numa_node: Optional[int] = typer.Option(None, "--numa-node", help="Pin to this node's CPUs."),
    cpus: Optional[str] = typer.Option(None, "--cpus", help="Pin to these CPUs (e.g. 0-3,8)."),
) -> None:
    """Run the node agent until SIGTERM or Ctrl-C (or its region file is removed); logs to stderr."""
    opts = AgentOptions(pool, node, manager, simulate, flush_mode, heartbeat_ms,
                        None if no_takeover else takeover_after, exit_when_idle,
                        None if never_declare_dead else host_dead_after)
    opts.check()
    pin(numa_node, cpus)      # before touching the region
    run_foreground(opts)
