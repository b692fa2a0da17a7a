"""What prefill and decode workers share: the attached pool, the node agent,
the pool lock, the common metrics.

A worker is one process on one (emulated) node.  Its requests are served on
the HTTP stack's thread pool (serve/app.py: handlers block, the event loop
must not) and share one attached `Pool`, calling into it concurrently with
no Python lock: the C
core is thread-safe (the two-tier lock orders processes and nodes, and a
process's threads too -- its local tier is a mutex; the handle's held-lock
table, journal, simulator cache and the node's claimed-slot free list each
have their own mutex), and nothing in the Python wrappers is shared mutable
state.  A lock here would serialize every request's pool calls behind the
slowest (a lock wait, a block copy) and let a `/metrics` scrape stall them.
"""
from __future__ import annotations

import numpy as np

from tract_cli.core.agent_launch import AgentWatch, start_node_agent
from tract_cli.core.errors import UsageError
from tract_cli.core.events import MAX_RECORD_SALT, Described, describe_span
from tract_cli.core.hashing import pool_root, request_keys, tag_keys
from tract_cli.core.index import as_keys
from tract_cli.core.pool import Pool
from tract_cli.serve.api import ApiError, field
from tract_cli.serve.engine import Engine
from tract_cli.serve.metrics import CONTENT_TYPE, Metrics

# a handoff's key list holds 32 bytes per block in one slot (FORMAT.md)
HANDOFF_ENTRY_BYTES = 32
MAX_SALT_BYTES = 256


def cache_salt(body: dict) -> str | None:
    """The request's `cache_salt` (vLLM's name): None, or 1..256 bytes."""
    salt = field(body, "cache_salt", str)
    if salt is not None and not 1 <= len(salt.encode()) <= MAX_SALT_BYTES:
        raise ApiError(400, f"cache_salt must be 1 to {MAX_SALT_BYTES} bytes", param="cache_salt")
    return salt


class PoolWorker:
    role = "worker"

    def __init__(self, pool_path: str, node: int, engine: Engine, *, simulate: bool = False,
                 flush_mode: str | None = None, start_agent: bool = True,
                 salt: str | None = None):
        self.engine = engine
        self.node = node
        self.agent_proc = None
        self.agent_watch = None
        if start_agent:
            self.agent_proc = start_node_agent(pool_path, node, simulate=simulate,
                                               flush_mode=flush_mode)
            # and keeps it running: a node whose agent stays gone is declared dead
            self.agent_watch = AgentWatch(pool_path, node, simulate=simulate,
                                          flush_mode=flush_mode)
        self.pool = Pool.attach(pool_path, node=node, simulate=simulate, flush_mode=flush_mode,
                                expect=engine.profile.geometry)
        if self.pool.info.model_name != engine.profile.name:
            name = self.pool.info.model_name
            self.pool.close()
            raise UsageError(f"{pool_path} was formatted for model {name}, this worker runs "
                             f"{engine.profile.name}",
                             f"format it with `tract init {pool_path} --model {engine.profile.name}`")
        # the engine's weights enter every key: the tract scheme's root, or each
        # vLLM-scheme key (tag_keys), so engines of one geometry share no block
        self.model_tag = engine.identity[:16]
        self.root = pool_root(self.pool.info, salt, self._root_tag())
        self.slots = self.pool.slots_tensor()
        info = self.pool.info
        self.max_context = min(engine.cfg.max_positions,
                               info.block_bytes // HANDOFF_ENTRY_BYTES * info.geometry.block_tokens)
        self.metrics = Metrics()
        m = self.metrics
        m.gauge("pool_slots_used", "Slots of the pool in use (all nodes)", self._slots_used)
        m.gauge("pool_slots_total", "Slots of the pool", lambda: self.pool.slot_count)
        m.gauge("lock_wait_seconds", "Seconds this node spent waiting for pool locks",
                self._lock_wait)
        m.gauge("lock_acquisitions", "Pool lock acquisitions by this node", self._lock_count)

    def root_for(self, salt: str | None) -> bytes:
        """The hash chain root of a request: the worker's, or a tenant's
        (`cache_salt`): tenants never share, or probe, each other's prefixes."""
        if salt is None:
            return self.root
        roots = self.__dict__.setdefault("_tenant_roots", {})
        if salt not in roots:
            if len(roots) > 4096:
                roots.clear()
            roots[salt] = pool_root(self.pool.info, salt, self._root_tag())
        return roots[salt]

    def _root_tag(self) -> bytes | None:
        return None if self.pool.info.hash_scheme == "vllm" else self.model_tag

    def keys_and_hashes(self, tokens: np.ndarray, salt: str | None):
        """The pool keys of TOKENS' full blocks for a tenant's SALT, with this
        engine's model identity, and the blocks' hashes as the scheme made them
        (untagged: what KV events tell, `describe`)."""
        hashes = request_keys(self.pool.info, tokens, self.engine.block_tokens, salt,
                              root=self.root_for(salt))
        keys = hashes
        if self.pool.info.hash_scheme == "vllm":
            keys = tag_keys(as_keys(hashes), self.model_tag) if len(hashes) else hashes
        return keys, hashes

    def describe(self, tokens: np.ndarray, hashes: np.ndarray, lo: int, hi: int,
                 salt: str | None) -> "Described | None":
        """What the records of full blocks LO..HI say for KV events (none for a
        salt longer than a record holds)."""
        if hi <= lo or (salt and len(salt.encode()) > MAX_RECORD_SALT):
            return None
        return describe_span(hashes, tokens, lo, hi, self.engine.block_tokens, self.model_tag,
                             salt)

    # a scrape reads the pool without any lock: one observed line for the
    # slots in use (not a copy of the bitmap), this node's counters for locks

    def _slots_used(self) -> float:
        return self.pool.slots_in_use()

    def _lock_totals(self) -> tuple[int, float]:
        return self.pool.locks.totals()

    def _lock_wait(self) -> float:
        return self._lock_totals()[1]

    def _lock_count(self) -> float:
        return self._lock_totals()[0]

    def health(self) -> dict:
        return {"status": "ok", "role": self.role, "node": self.node,
                "model": self.engine.profile.name, "pool": self.pool.path,
                "max_context": self.max_context}

    def metrics_text(self):
        return (CONTENT_TYPE, self.metrics.render())

    def close(self) -> None:
        self.slots = None
        if self.agent_watch is not None:
            self.agent_watch.stop()
            self.agent_watch = None
        if not self.pool.closed:
            self.pool.close()
