"""The region's node table: line 0 of each node's entry, decoded.

Each node's agent publishes its entry every heartbeat (state, pid, epoch,
heartbeat, manager flag and claim, hostname; docs/FORMAT.md §4.2); anyone
reads the table lock-free (`read_nodes`): the agent itself, `ensure_agent`,
`tract inspect`, `tract check`.  The claim a node holds is a fencing token
(`epoch.node`, docs/PROTOCOLS.md §4); the largest one names the current lock
manager: `current_token` asks the C core (`tract_manager_current`, the rule
lock.c and manager.c fence with), `current_manager` applies the same rule to
a table already read (what the agent decides on).
"""
from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tract_cli.core.media import HOSTNAME_MAX, NODE_LINE, VERDICT_LINE  # lines 0 and 1 of an entry
from tract_cli.core.native import ffi, lib, raise_for

if TYPE_CHECKING:
    from tract_cli.core.pool import Pool

# the entry's state and flags (native/format.h's TRACT_NODE_*); NODE_STATES names the states
NODE_NEVER, NODE_ALIVE, NODE_LEFT = lib.TRACT_NODE_NEVER, lib.TRACT_NODE_ALIVE, lib.TRACT_NODE_LEFT
NODE_STATES = {NODE_NEVER: "never", NODE_ALIVE: "alive", NODE_LEFT: "left"}
FLAG_MANAGER = lib.TRACT_NODE_F_MANAGER
FLAG_STANDBY = lib.TRACT_NODE_F_STANDBY
FLAG_AUTOSTOP = lib.TRACT_NODE_F_AUTOSTOP
VERDICT_CLAIMS, VERDICT_PINS = lib.TRACT_VERDICT_CLAIMS, lib.TRACT_VERDICT_PINS
VERDICT_SLOTS = lib.TRACT_VERDICT_SLOTS
STALE_S = 2.0                # a heartbeat older than this: the node's agent is not alive


def hostname() -> str:
    """The name recorded in the node table; TRACT_HOSTNAME lets emulated
    nodes on one machine stand for separate hosts (failure tests)."""
    return os.environ.get("TRACT_HOSTNAME") or socket.gethostname()


def on_this_host(rec: "NodeRecord") -> bool:
    """Whether REC was written by an agent of this host (as the node table keeps it)."""
    return rec.hostname == hostname().encode()[:HOSTNAME_MAX].decode(errors="replace")


@dataclass(frozen=True)
class NodeRecord:
    """Line 0 of one node-table entry, decoded."""

    node: int
    state: int
    agent_pid: int
    epoch: int
    heartbeat_ns: int
    manager: bool
    manager_heartbeat_ns: int
    hostname: str
    manager_epoch: int = 0
    standby: bool = False
    autostop: bool = False      # started by a worker: stops when its node is idle
    # line 1, the verdict (written by the current lock manager's agent)
    dead_epoch: int = 0         # the agent epoch declared dead, 0 = never
    declared_ns: int = 0
    recovered: int = 0          # VERDICT_CLAIMS | _PINS | _SLOTS: its recovery's steps done

    @property
    def dead(self) -> bool:
        """Declared dead: its entry still shows the epoch its verdict names."""
        return bool(self.dead_epoch) and self.dead_epoch == self.epoch

    @property
    def token(self) -> int:
        """The node's lock-manager claim as a fencing token (0: never claimed)."""
        return fencing_token(self.manager_epoch, self.node) if self.manager_epoch else 0

    def heartbeat_age(self, now_ns: int | None = None) -> float:
        """Seconds since the last heartbeat (inf if never)."""
        if not self.heartbeat_ns:
            return float("inf")
        return max(0, (now_ns or time.time_ns()) - self.heartbeat_ns) / 1e9

    def alive(self, stale_s: float = STALE_S) -> bool:
        return self.state == NODE_ALIVE and self.heartbeat_age() < stale_s


def read_nodes(pool: Pool) -> list[NodeRecord]:
    """The node table as this host observes it now."""
    sec = pool.info.section("nodes")
    raw = pool.observe(sec.offset, sec.length)
    out = []
    for n in range(sec.count):
        f = NODE_LINE.unpack_from(raw, n * sec.entry_size)
        v = VERDICT_LINE.unpack_from(raw, n * sec.entry_size + NODE_LINE.size)
        out.append(NodeRecord(n, f[0], f[1], f[2], f[3], bool(f[4] & FLAG_MANAGER), f[6],
                              f[7].rstrip(b"\0").decode(errors="replace"), f[5],
                              bool(f[4] & FLAG_STANDBY), bool(f[4] & FLAG_AUTOSTOP),
                              dead_epoch=v[0], declared_ns=v[1], recovered=v[4]))
    return out


def encode_node_line(state: int, agent_pid: int, epoch: int, heartbeat_ns: int, flags: int,
                     manager_epoch: int, manager_heartbeat_ns: int) -> bytes:
    """Line 0 of a node entry, with this host's name, as `read_nodes` decodes it
    (what the node's agent publishes)."""
    return NODE_LINE.pack(state, agent_pid, epoch, heartbeat_ns, flags, manager_epoch,
                          manager_heartbeat_ns, hostname().encode()[:HOSTNAME_MAX])


_NODE_BITS = lib.TRACT_TOKEN_NODE_BITS      # the token's layout is the C core's (tract.h)


def fencing_token(epoch: int, node: int) -> int:
    """A lock-manager claim as one comparable number: epoch, then node (manager.c)."""
    return (epoch << _NODE_BITS) | node


def token_node(token: int) -> int:
    """The node that a fencing token names."""
    return token & ((1 << _NODE_BITS) - 1)


def token_text(token: int) -> str:
    """A fencing token as `epoch.node` (docs/PROTOCOLS.md §4)."""
    return f"{token >> _NODE_BITS}.{token_node(token)}"


def current_token(pool: Pool) -> int:
    """The current lock manager's fencing token, 0 if no node ever claimed: the
    C core's answer (`tract_manager_current`, native/manager.c), from its own
    read of the node table -- the very rule lock.c fences requesters with."""
    token = ffi.new("uint64_t *")
    raise_for(lib.tract_manager_current(pool._r(), token, ffi.NULL), "current lock manager")
    return int(token[0])


def current_manager(nodes: list[NodeRecord]) -> NodeRecord | None:
    """The node holding the largest claim: the current lock manager, alive or not.

    The rule is `tract_manager_current`'s (native/manager.c; `current_token`),
    applied to NODES, a table the caller has already read: the C function reads
    the table afresh and answers only (token, node), while the agent decides
    on one observed table -- the claimant's record (its state, heartbeats,
    host, pid) and the other standbys' ranks must come from the same read, or
    a claim published between two reads would mix two tables.  NodeRecord.token
    is C's token formula; tests/test_takeover.py checks that both agree."""
    best = max(nodes, key=lambda r: r.token, default=None)
    return best if best is not None and best.token else None
