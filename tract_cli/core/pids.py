"""Whether a process of this host still lives: the one Python answer.

Pids recorded in the region and in the node-local segment (a lock holder, a
node agent, a process attached to a node) may name a process that died
without cleaning up.  Every Python caller asks the same question of them --
can that process still act (heartbeat, release, come back)? -- so:

- a zombie is dead: it has exited, only its parent has not reaped it yet;
- a process this one may not signal (another user's: EPERM) or whose /proc
  entry it may not read (hidepid) is alive: it exists;
- 0, negative and out-of-range pids (a torn read of a changing line) are dead.

The C core's `tract_pid_dead` (native/util.c), what recovery asks, gives the
same answer: kill(pid, 0) failing with ESRCH, or a zombie by /proc/<pid>/stat,
is dead (a zombie holds nothing, so recovery need not wait for the reap);
EPERM, or a /proc entry it may not read, is alive.  It differs on pid 0 only,
which it calls not dead (0 there means no pid recorded, and its callers check
for it).  Python callers only report, or decide whether to wait for or
replace an agent.
"""
from __future__ import annotations

import psutil

_PID_MAX = 0x7FFFFFFF        # kill(2) takes a signed pid_t


def pid_alive(pid: int) -> bool:
    """Whether PID names a live (not zombie) process on this machine."""
    if not 0 < pid <= _PID_MAX or not psutil.pid_exists(pid):
        return False
    try:
        return psutil.Process(pid).status() not in (psutil.STATUS_ZOMBIE, psutil.STATUS_DEAD)
    except psutil.ZombieProcess:
        return False
    except psutil.NoSuchProcess:
        # gone since, or hidden from this user (hidepid): kill(pid, 0) decides
        return psutil.pid_exists(pid)
    except psutil.AccessDenied:
        return True
