"""TraCT as a vLLM KV connector: P/D handoffs and a rack-wide prefix cache.

Loaded by vLLM out of tree:

    --kv-transfer-config '{"kv_connector": "TractConnector",
        "kv_connector_module_path": "tract_cli.connectors.vllm", "kv_role": "kv_both",
        "kv_connector_extra_config": {"pool": "/dev/shm/tract.pool", "node": 1}}'

vLLM makes one connector per role: the *scheduler* side (in the engine core)
decides what to load and save, the *worker* side (next to the KV cache) moves
bytes.  Both attach the region as the configured node (one `Pool` per
process).  docs/VLLM.md is the user's guide; the lifecycle in short:

- **Lookup** (scheduler, `get_num_new_matched_tokens`): a prompt's chained
  block keys are computed in one C call; a request carrying a TraCT handoff
  (`kv_transfer_params.tract_ticket`, from a prefill instance) opens the
  handoff record (metadata only); any other is one lookup+pin of its keys.
  Hits load asynchronously (the request waits one engine step), so pins are
  held only by the scheduler process that took them.
- **Load** (worker, `start_load_kv`): the slots are invalidated and their
  checksums compared in one C call each, then one torch scatter per layer
  writes them into vLLM's pages; a bad block is reported through
  `get_block_ids_with_load_errors` and vLLM recomputes from there.  A
  handoff is acknowledged once its bytes are in vLLM's pages; prefix pins are
  given back by the scheduler when the worker reports the load finished.
- **Save** (worker, `save_kv_layer` / `wait_for_save`): before the forward,
  one reserve call claims the step's new full blocks (keys already in the
  pool are skipped); each layer is one torch gather from vLLM's pages into
  the claimed slots; after the forward one C call checksums the slots and one
  commit publishes them READY.  A full pool skips the save (vLLM computes as
  ever; nothing is an error to the user).
- **Handoff** (scheduler, `request_finished` of a `do_remote_decode`
  request): the prompt's blocks, and its partial tail block (stored under a
  key of its own), are pinned under a handoff record; the returned
  `kv_transfer_params` follow NixlConnector's protocol (`do_remote_prefill`)
  and add `tract_ticket`, so vLLM's proxy, Dynamo and llm-d pass them on
  unchanged.  vLLM's own blocks are freed at once: the pool has the bytes.
"""
from __future__ import annotations

import collections
import logging
import os
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tract_cli.connectors.keys import MAX_SALT_BYTES, prompt_keys
from tract_cli.connectors.paged import PageMap
from tract_cli.connectors.retry import Releases
from tract_cli.connectors.settings import ConnectorSettings
from tract_cli.connectors.vllm_setup import (ConnectorError, check_engine_geometry,
                                             check_kv_cache_groups, engine_page_map,
                                             served_identity, shared_pool)
from tract_cli.core import kvlog
from tract_cli.core.errors import HandoffError, PoolFull, TractError
from tract_cli.core.handoff import Ticket
from tract_cli.core.index import PUT_CLAIMED, Lookup

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# a child of vLLM's logger: our lines appear in its log, in its format
log = logging.getLogger("vllm.tract")

# TRACT_CONNECTOR_TIMINGS=1: one INFO line per load and per save with its time
# (what `tract bench --engine vllm` reads); otherwise those lines are DEBUG
TIMINGS = logging.INFO if os.environ.get("TRACT_CONNECTOR_TIMINGS") == "1" else logging.DEBUG
PARAMS_KEY = "tract_ticket"
# how often (at most) a prefill instance at its handoff bound reads its records
# to find those acknowledged since (each is a lock-free read of one record)
PRUNE_INTERVAL_S = 0.1
DENIED_LOG_S = 10.0        # a flood at the handoff bound logs at most this often


# ---- what the scheduler tells the worker each step ----

@dataclass
class LoadSpec:
    """Copy region blocks (slots) into vLLM pages; ack TICKET afterwards."""

    req_id: str
    slots: np.ndarray          # uint32 region slots, in request block order
    checksums: np.ndarray      # uint32 recorded CRC-32C (0: none)
    pages: np.ndarray          # int64 vLLM block id of each region block
    subs: np.ndarray           # int64 sub-block of each region block in its page
    ticket: dict | None = None
    tags: np.ndarray | None = None   # uint64 payload tags (None: evict every slot)


@dataclass
class SaveSpec:
    """Write the request's region blocks KEYS (from vLLM pages) into the pool."""

    req_id: str
    keys: np.ndarray           # (n, 16) uint8
    tokens: np.ndarray         # uint32 tokens of each block (g, or fewer for a partial tail)
    pages: np.ndarray
    subs: np.ndarray


@dataclass
class TractConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class _Request:
    """Scheduler-side state of one request."""

    prompt_len: int
    keys: np.ndarray                   # (n_full, 16) keys of the full blocks
    tail_key: np.ndarray | None        # (1, 16) key of the partial tail block, if any
    tail_tokens: int
    cacheable: bool
    lookup: Lookup | None = None       # pins this process holds for the request
    received: Any = None               # an opened handoff (core.handoff.Received)
    ticket: Ticket | None = None
    matched_from: int = 0              # num_computed_tokens the last match was asked from
    loading: bool = False              # a load was handed to the worker, not yet finished
    saved: int = 0                     # region blocks planned for saving so far
    tail_saved: bool = False
    handoff_failed: bool = False
    want_handoff: bool = False         # a prefill for a remote decode (do_remote_decode)
    load_pages: frozenset = frozenset()  # vLLM pages of the load in flight
    load_failed: bool = False          # a load of it failed: compute it, never load again


class TractConnector(KVConnectorBase_V1):
    """vLLM KV connector over a TraCT region (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        ktc = self._kv_transfer_config
        try:
            self.settings = ConnectorSettings.parse(ktc.kv_connector_extra_config, ktc.kv_role)
            check_kv_cache_groups(kv_cache_config)
            self.pool = shared_pool(self.settings)
            check_engine_geometry(self.pool, vllm_config, self.settings)
            self.identity = served_identity(vllm_config, self.settings)
        except TractError as exc:
            # vLLM prints the traceback; the last line is what to fix
            raise ConnectorError(f"TraCT connector: {exc.problem}", exc.fix) from None
        self.role_name = ktc.kv_role
        self.engine_id = ktc.engine_id
        self.g = self.pool.geometry.block_tokens
        self.page_tokens = vllm_config.cache_config.block_size
        self.r = self.page_tokens // self.g
        self.scheme = self.pool.info.hash_scheme
        self.timeout = self.settings.lookup_timeout_s
        self.releases = Releases(self.timeout)
        if role == KVConnectorRole.SCHEDULER:
            self._reqs: dict[str, _Request] = {}
            self._loading_done: dict[str, _Request] = {}   # finished while their load ran
            self._pending_loads: list[LoadSpec] = []
            self._matched: set[str] = set()     # pinned this step, no vLLM pages yet
            # this instance's published handoffs not known released
            self._handoffs: collections.deque = collections.deque()
            self._pruned_at = 0.0
            self._denied, self._denied_logged = 0, -DENIED_LOG_S
        else:
            self._layers: dict[str, int] = {}
            self._flat: dict[str, torch.Tensor] = {}
            self._page_map: PageMap | None = None
            self._slots_t = None
            self._plan = None
            self._recvd: set[str] = set()
            self._load_errors: set[int] = set()
        log.info("TraCT connector (%s, %s): region %s node %d, %s, %d-token blocks, vLLM block "
                 "%d, accessors %s, model identity %s (%d weight files, %d tensors, %.0f ms)",
                 role.name.lower(), self.role_name, self.settings.pool, self.settings.node,
                 self.pool.info.model_name, self.g, self.page_tokens, self.pool.accessors,
                 self.identity.short(), self.identity.weight_files, self.identity.tensors,
                 self.identity.seconds * 1e3)

    # ================= scheduler side =================

    def _state(self, request: "Request") -> _Request:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        tokens = request.prompt_token_ids
        cacheable = (tokens is not None and not request.lora_request and
                     not getattr(request, "mm_features", None))
        salt = getattr(request, "cache_salt", None)
        if cacheable and salt and len(salt.encode()) > MAX_SALT_BYTES:
            log.warning("request %s: its cache_salt is over %d bytes: it is computed by vLLM "
                        "and not cached in the pool", request.request_id, MAX_SALT_BYTES)
            cacheable = False
        if cacheable:
            keys, tail_key, tail = prompt_keys(self.pool.info, self.identity.tag, self.g, tokens,
                                               salt)
        else:
            keys = np.zeros((0, 16), np.uint8)
            tail, tail_key = 0, None
        params = request.kv_transfer_params or {}
        st = _Request(len(tokens or ()), keys, tail_key, tail, cacheable,
                      want_handoff=bool(params.get("do_remote_decode")))
        self._reqs[request.request_id] = st
        return st

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens the pool holds beyond NUM_COMPUTED_TOKENS (loaded asynchronously)."""
        st = self._state(request)
        if not st.cacheable or st.load_failed:
            return 0, False
        st.matched_from = num_computed_tokens
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and PARAMS_KEY in params and not st.loading:
            if st.received is None and not st.handoff_failed:
                self._open_handoff(request, st, params)
            if st.received is not None:
                count = st.received.token_count - num_computed_tokens
                return (count, True) if count > 0 else (0, False)
        if not self.settings.prefix_cache or not len(st.keys):
            return 0, False
        if st.lookup is None:
            try:
                st.lookup = self.pool.index.lookup(st.keys, timeout=self.timeout)
            except TractError as exc:
                log.warning("TraCT lookup of request %s failed, computing it: %s",
                            request.request_id, exc)
                return 0, False
        count = st.lookup.hits * self.g - num_computed_tokens
        if count <= 0:
            self._unpin(st)
            return 0, False
        # pinned for this step only: if vLLM gives it no pages now (a queued request),
        # build_connector_meta gives the pins back, so pinned capacity never grows
        # with the queue
        self._matched.add(request.request_id)
        return count, True

    def _open_handoff(self, request: "Request", st: _Request, params: dict) -> None:
        """Opens the handoff a prefill instance published for this prompt, if it is one."""
        try:
            raw = params[PARAMS_KEY]
            if not isinstance(raw, dict):
                raise HandoffError("the ticket is not an object", "pass it unchanged")
            ticket = Ticket.from_dict(raw)
            if raw.get("region") != self.pool.info.uuid:
                raise HandoffError("the handoff is in another region",
                                   "point prefill and decode at the same pool")
            if raw.get("model") != self.identity.digest.hex():
                # the keys check below refuses it too (they carry the identity); this
                # says why, for the operator
                raise HandoffError("the handoff was computed by another model (model identity "
                                   f"{str(raw.get('model'))[:16]}, this instance serves "
                                   f"{self.identity.short()})",
                                   "send decode requests to instances of the prefill's model")
            expected = st.keys if st.tail_key is None else np.vstack([st.keys, st.tail_key])
            if ticket.blocks != len(expected):
                raise HandoffError("the handoff is of another prompt",
                                   "send the decode request with the prefill's prompt")
            rec = self.pool.handoffs.open(ticket)
            # the record's own key list, not anything the ticket says, names the blocks:
            # only a request whose prompt (and salt) has exactly these keys loads them
            if rec.token_count != st.prompt_len or not np.array_equal(rec.keys, expected):
                raise HandoffError("the handoff is of another prompt (or another tenant's salt)",
                                   "send the decode request with the prefill's prompt")
        except (TractError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            # a ticket is network input: whatever is wrong with it, the request is computed
            st.handoff_failed = True
            log.warning("TraCT handoff of request %s not used, computing it: %s",
                        request.request_id, exc)
            return
        st.received, st.ticket = rec, ticket

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        self._matched.discard(request.request_id)
        st = self._reqs.get(request.request_id)
        if st is None or st.loading:
            return
        if num_external_tokens == 0:
            self._unpin(st)
            if st.ticket is not None:              # not needed (e.g. a local hit): release now
                self._release_handoff(st.ticket)
                st.received = st.ticket = None
            return
        first = st.matched_from // self.g
        end_tokens = st.matched_from + num_external_tokens
        last = -(-end_tokens // self.g)
        if st.received is not None:
            slots, sums, tags = st.received.slots, st.received.checksums, st.received.tags
            ticket = st.ticket.to_dict()
            params = request.kv_transfer_params
            if params is not None:
                params["do_remote_prefill"] = False   # one transfer per request
            st.received = st.ticket = None            # the worker acknowledges it now
        else:
            slots, sums, tags = st.lookup.slots, st.lookup.checksums, st.lookup.tags
            ticket = None
        page_ids = np.asarray(blocks.get_block_ids()[0], dtype=np.int64)
        idx = np.arange(first, last, dtype=np.int64)
        self._pending_loads.append(LoadSpec(request.request_id, slots[first:last],
                                            sums[first:last], page_ids[idx // self.r],
                                            idx % self.r, ticket,
                                            None if tags is None else tags[first:last]))
        st.loading = True
        st.load_pages = frozenset(int(p) for p in np.unique(page_ids[idx // self.r]))
        st.saved = max(st.saved, min(last, len(st.keys)))
        st.tail_saved = st.tail_saved or last > len(st.keys)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = TractConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        for req_id in self._matched:          # matched, but vLLM had no pages for it
            st = self._reqs.get(req_id)
            if st is not None and not st.loading:
                self._unpin(st)
        self._matched.clear()
        if not self.settings.save:
            return meta
        cached = scheduler_output.scheduled_cached_reqs
        computed = {r.req_id: r.num_computed_tokens for r in scheduler_output.scheduled_new_reqs}
        computed.update(zip(cached.req_ids, cached.num_computed_tokens))
        for req_id, done in computed.items():
            st = self._reqs.get(req_id)
            if st is None or not st.cacheable:
                continue
            end = done + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            spec = self._plan_save(req_id, st, end)
            if spec is not None:
                meta.saves.append(spec)
        return meta

    def _plan_save(self, req_id: str, st: _Request, end: int) -> SaveSpec | None:
        """The blocks of REQ_ID whose KV is complete after this step and not yet saved."""
        full = min(end, st.prompt_len) // self.g
        idx = list(range(st.saved, full)) if full > st.saved else []
        with_tail = (st.tail_key is not None and not st.tail_saved and end >= st.prompt_len
                     and st.want_handoff)
        if not idx and not with_tail:
            return None
        keys = st.keys[st.saved:full]
        tokens = np.full(len(idx), self.g, np.uint32)
        if with_tail:
            idx.append(len(st.keys))
            keys = np.vstack([keys, st.tail_key])
            tokens = np.append(tokens, np.uint32(st.tail_tokens))
            st.tail_saved = True
        st.saved = max(st.saved, full)
        page_ids = np.asarray(self._kv_cache_manager.get_block_ids(req_id)[0], dtype=np.int64)
        blocks = np.asarray(idx, dtype=np.int64)
        return SaveSpec(req_id, np.ascontiguousarray(keys), tokens, page_ids[blocks // self.r],
                        blocks % self.r)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        invalid = connector_output.invalid_block_ids or set()
        for req_id in connector_output.finished_recving or ():
            st = self._reqs.get(req_id) or self._loading_done.pop(req_id, None)
            if st is not None:
                st.loading = False
                # a bad block stays in the index until evicted: vLLM recomputes this
                # request, and it is not offered the same blocks again
                st.load_failed = st.load_failed or bool(st.load_pages & invalid)
                self._unpin(st)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        from vllm.v1.request import RequestStatus
        st = self._reqs.pop(request.request_id, None)
        self._matched.discard(request.request_id)
        if st is None:
            return False, None
        if st.loading:
            self._loading_done[request.request_id] = st   # the worker still reads its pins
        else:
            self._unpin(st)
        if st.ticket is not None:                       # opened, never loaded
            self._release_handoff(st.ticket)
        # only an instance that saves publishes: its own step saved the blocks. A
        # client of a decode-only instance asking do_remote_decode pins nothing
        if not (self.settings.save and st.want_handoff and st.cacheable and request.status in (
                RequestStatus.FINISHED_LENGTH_CAPPED, RequestStatus.FINISHED_STOPPED)):
            return False, None
        if not self._handoff_room():
            self._denied += 1
            if time.monotonic() - self._denied_logged < DENIED_LOG_S:
                return False, None
            self._denied_logged = time.monotonic()
            log.warning("TraCT: %d handoffs of this instance in flight (max_handoffs): request "
                        "%s answered without one, its decode computes the prompt (%d so far; "
                        "logged at most every %.0f s)", len(self._handoffs), request.request_id,
                        self._denied, DENIED_LOG_S)
            return False, None
        keys = st.keys if st.tail_key is None else np.vstack([st.keys, st.tail_key])
        try:
            # no waiting here (the engine's scheduler loop): the step that computed the
            # blocks committed them before its output reached the scheduler, so a block
            # not READY now was not saved (pool full) or is another writer's: computed
            ticket = self.pool.handoffs.publish(request.request_id, keys, st.prompt_len,
                                                ttl=self.settings.handoff_ttl_s,
                                                timeout=self.timeout)
        except TractError as exc:
            log.warning("TraCT handoff of request %s not published, decode will compute it: %s",
                        request.request_id, exc)
            return False, None
        self._handoffs.append(ticket)
        raw = ticket.to_dict() | {"region": self.pool.info.uuid,
                                  "model": self.identity.digest.hex()}
        return False, {"do_remote_prefill": True, "do_remote_decode": False,
                       "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                       "remote_block_ids": [], "remote_host": "tract", "remote_port": 0,
                       "tp_size": 1, PARAMS_KEY: raw}

    def _handoff_room(self) -> bool:
        """Whether this instance may publish one more handoff (max_handoffs). One
        stops counting once its record is gone (acknowledged, or expired and
        reclaimed: until then its pins hold, whatever the clock says), as a
        lock-free read of each record finds, at most every PRUNE_INTERVAL_S."""
        cap, now = self.settings.max_handoffs, time.monotonic()
        if len(self._handoffs) < cap or now - self._pruned_at < PRUNE_INTERVAL_S:
            return len(self._handoffs) < cap
        self._pruned_at = now
        kept = collections.deque()
        for ticket in self._handoffs:
            try:
                self.pool.handoffs.open(ticket)     # metadata only, no lock
                kept.append(ticket)
            except HandoffError:
                pass                                # released
            except TractError:
                kept.append(ticket)
        self._handoffs = kept
        return len(kept) < cap

    def _unpin(self, st: _Request) -> None:
        """Gives a request's lookup pins back (queued: never waits on a lock here)."""
        if st.lookup is None:
            return
        lookup, st.lookup = st.lookup, None
        if lookup.hits:
            # resumable: a retry after a timeout partway unpins only what is left
            done = np.zeros(lookup.hits, np.uint8)
            self.releases.submit(f"unpin of {lookup.hits} blocks",
                                 lambda timeout: self.pool.index.unpin(lookup, timeout=timeout,
                                                                       done=done))

    def _release_handoff(self, ticket: Ticket, read=None) -> None:
        """Acknowledges a handoff (queued): one this instance will not load, or the
        retry of one whose acknowledgement timed out (READ: the slots it loaded)."""
        self.releases.submit(f"acknowledgement of handoff {ticket.record}",
                             lambda timeout: self._ack_once(ticket, timeout, read))

    def _ack_once(self, ticket: Ticket, timeout: float, read=None) -> None:
        """One attempt of a queued acknowledgement (resuming its own earlier
        attempt that timed out partway)."""
        try:
            self.pool.handoffs.ack(ticket, timeout=timeout, read=read, resume=True)
        except HandoffError as exc:            # gone already: expired and reclaimed
            log.warning("TraCT handoff %d not acknowledged: %s", ticket.record, exc)

    # ================= worker side =================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        from vllm.model_executor.models.utils import extract_layer_index
        g = self.pool.geometry
        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != g.num_layers:
            raise ConnectorError(f"TraCT connector: vLLM registered {len(names)} KV cache layers, "
                                 f"the region holds {g.num_layers}",
                                 "format the region for this model (tract init --model DIR)")
        first = kv_caches[names[0]]
        try:
            page_map = engine_page_map(first, self.page_tokens, g, self._vllm_config, names[0])
        except TractError as exc:
            raise ConnectorError(f"TraCT connector: {exc.problem}", exc.fix) from None
        for name in names:
            t = kv_caches[name]
            if t.shape != first.shape or t.dtype != first.dtype or not t.is_contiguous():
                raise ConnectorError(f"TraCT connector: KV cache layer {name} differs from "
                                     f"{names[0]} ({list(t.shape)})",
                                     "serve a model whose attention layers are all alike")
        self._layers = {name: i for i, name in enumerate(names)}
        self._flat = {name: kv_caches[name].view(-1) for name in names}
        self._page_map = page_map
        if first.device.type == "cuda":
            # the mapping registered once (cudaHostRegister): slot views are pinned
            # host memory, so the per-layer copies to and from the GPU are DMA
            from tract_cli.core.gpu import CudaPool
            self._cuda = CudaPool(self.pool, device=str(first.device))
            self._slots_t = self._cuda.slots
        else:
            self._slots_t = self.pool.slots_tensor()
        self._device = first.device

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        self._plan = None
        if isinstance(connector_metadata, TractConnectorMetadata) and connector_metadata.saves:
            self._plan = self._reserve(connector_metadata.saves)

    def _reserve(self, saves: list[SaveSpec]) -> "_SavePlan | None":
        """One reserve call for the step's blocks to save (duplicates within it once)."""
        keys = np.vstack([s.keys for s in saves])
        tokens = np.concatenate([s.tokens for s in saves])
        pages = np.concatenate([s.pages for s in saves])
        subs = np.concatenate([s.subs for s in saves])
        _, first = np.unique(keys.view("V16").reshape(-1), return_index=True)
        first.sort()
        keys, tokens, pages, subs = keys[first], tokens[first], pages[first], subs[first]
        try:
            status, slots = self.pool.index.reserve(keys, timeout=self.timeout)
        except PoolFull:
            log.info("TraCT pool full: %d blocks not saved this step", len(keys))
            return None
        except TractError as exc:
            log.warning("TraCT reserve failed, %d blocks not saved: %s", len(keys), exc)
            return None
        mine = np.flatnonzero(status == PUT_CLAIMED)
        if not mine.size:
            return _SavePlan(keys, status, slots, tokens, mine, None, None)
        index = self._page_map.gather_index(pages[mine], subs[mine])
        return _SavePlan(keys, status, slots, tokens, mine,
                         torch.from_numpy(slots[mine].astype(np.int64)),
                         torch.from_numpy(index).to(self._device))

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if not isinstance(meta, TractConnectorMetadata):
            return
        for spec in meta.loads:
            self._load(spec)

    def _load(self, spec: LoadSpec) -> None:
        """Copies one request's blocks into vLLM's pages (all layers), then acks."""
        n = len(spec.slots)
        valid = n
        t0 = time.perf_counter()
        try:
            if spec.ticket is not None:          # still published: its pins hold the slots
                self.pool.handoffs.open(Ticket.from_dict(spec.ticket))
            self.pool.acquire_payload(spec.slots, spec.tags)
            if self.settings.checksums and n:
                sums = self.pool.checksum_slots(spec.slots)
                bad = np.flatnonzero((spec.checksums != 0) & (sums != spec.checksums))
                if bad.size:
                    valid = int(bad[0])
                    log.warning("TraCT: block %d of request %s fails its checksum; vLLM "
                                "recomputes from there", valid, spec.req_id)
            if valid:
                slots = torch.from_numpy(spec.slots[:valid].astype(np.int64))
                index = torch.from_numpy(self._page_map.gather_index(
                    spec.pages[:valid], spec.subs[:valid])).to(self._device)
                for name, layer in self._layers.items():
                    src = self._slots_t[slots, layer].reshape(valid, -1)
                    self._flat[name][index] = src.to(self._device)
        except Exception as exc:      # a pool or a torch error: recomputed, never fatal
            log.warning("TraCT load of request %s failed, vLLM recomputes it: %s", spec.req_id, exc)
            valid = 0
        if spec.ticket is not None and not self._ack_loaded(Ticket.from_dict(spec.ticket),
                                                            spec.slots):
            valid = 0                            # expired meanwhile: its slots may be reused
        if valid < n:
            self._load_errors.update(int(p) for p in np.unique(spec.pages[valid:]))
        self._recvd.add(spec.req_id)
        log.log(TIMINGS, kvlog.LOADED, valid, valid * self.pool.info.block_bytes, spec.req_id,
                (time.perf_counter() - t0) * 1e3)

    def _ack_loaded(self, ticket: Ticket, read: np.ndarray) -> bool:
        """Acknowledges a handoff this worker loaded from; whether the load stands.
        Acknowledged is proof the record outlived the copy; an acknowledgement that
        timed out proves nothing (the load is recomputed) and is retried off this
        step until it succeeds."""
        try:
            self.pool.handoffs.ack(ticket, timeout=self.timeout, read=read)
            return True
        except HandoffError as exc:
            log.warning("TraCT handoff %d not acknowledged: %s", ticket.record, exc)
            return False
        except TractError as exc:
            log.warning("TraCT handoff %d not acknowledged yet (%s): its load is recomputed",
                        ticket.record, exc)
            self._release_handoff(ticket, read)
            return False

    def wait_for_layer_load(self, layer_name: str) -> None:
        return        # loads are asynchronous: done before the request is scheduled

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        plan = self._plan
        if plan is None or plan.slots_t is None:
            return
        layer = self._layers.get(layer_name)
        if layer is None:
            return
        t0 = time.perf_counter()
        block = self._slots_t.shape[2:]
        src = kv_layer.view(-1)[plan.index_t].to("cpu")
        self._slots_t[plan.slots_t, layer] = src.view(-1, *block)
        plan.layers_done.add(layer)
        plan.seconds += time.perf_counter() - t0

    def wait_for_save(self):
        plan, self._plan = self._plan, None
        if plan is None:
            return
        complete = len(plan.layers_done) == len(self._layers) or plan.slots_t is None
        sums = None
        t0 = time.perf_counter()
        try:
            if complete and plan.mine.size:
                self._zero_partial_tails(plan)
                if self.settings.checksums:
                    sums = np.zeros(len(plan.keys), np.uint32)
                    sums[plan.mine] = self.pool.checksum_slots(plan.slots[plan.mine])
            self.pool.index.commit(plan.keys, plan.status, plan.slots, publish=complete,
                                   tokens=plan.tokens, checksums=sums, timeout=self.timeout)
        except TractError as exc:
            # never leave claims PENDING behind a live process: abandoned off this step,
            # tried again until it succeeds
            log.warning("TraCT commit of %d blocks failed, abandoning them: %s", plan.mine.size,
                        exc)
            self.releases.submit(
                f"abandon of {plan.mine.size} claimed blocks",
                lambda timeout: self.pool.index.commit(plan.keys, plan.status, plan.slots,
                                                       publish=False, timeout=timeout))
            return
        if plan.mine.size:
            log.log(TIMINGS, kvlog.SAVED, plan.mine.size, plan.mine.size * self.pool.info.block_bytes,
                    (plan.seconds + time.perf_counter() - t0) * 1e3)

    def _zero_partial_tails(self, plan: "_SavePlan") -> None:
        """Clears a partial tail's slot past its tokens: vLLM's page may hold another
        request's stale KV there, which must not reach the pool."""
        for i in np.flatnonzero(plan.tokens[plan.mine] < self.g):
            slot, used = int(plan.slots[plan.mine[i]]), int(plan.tokens[plan.mine[i]])
            self._slots_t[slot, :, :, used:] = 0

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        done, self._recvd = self._recvd, set()
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self):
        self.releases.close(timeout=max(5.0, 2 * self.timeout))    # logs what is left


@dataclass
class _SavePlan:
    keys: np.ndarray
    status: np.ndarray
    slots: np.ndarray
    tokens: np.ndarray
    mine: np.ndarray                  # indices this step claimed (and writes)
    slots_t: Any                      # their slots (torch int64)
    index_t: Any                      # their elements in one layer's tensor (PageMap)
    layers_done: set = field(default_factory=set)
    seconds: float = 0.0              # time spent writing and committing them
