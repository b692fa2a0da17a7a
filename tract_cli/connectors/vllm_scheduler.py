"""The scheduler half of TraCT's vLLM connector: each request's pool state,
what to load and save each step, and the handoffs a prefill publishes
(docs/VLLM.md; the worker half, vllm_worker.py, moves the bytes).

Nothing here waits on a pool lock inside vLLM's scheduler loop beyond a
bound: a prompt whose first block the pool does not hold is answered by a
look without a lock (`Index.peek`); any other prompt's lookup (lookup and
pin, one C call) runs on this half's lookup thread, and `get_num_new_matched_tokens` answers "not yet" (None) if
it is not back within `lookup_wait_s` (2 ms, waited only by the call that
starts it), so vLLM asks again next step and
schedules the others meanwhile; a lookup not back within
`lookup_patience_s` is given up (the request computed, new requests not
looked up for as long again); unpins and acknowledgements are queued
(retry.py); a P/D prefill's handoff is published by the worker after the
step that completes the prompt (its record reserved in that step, published
after the commit, off it), in a record chosen here without a lock when that
step is planned, so `request_finished` returns its ticket with no pool call;
a handoff that cannot be planned so (no record looking free, or max_handoffs
reached, when its step is planned) is not made: its decode computes the
prompt.  A decode whose ticket names a record still reserved, not yet
published, is answered "not yet" for at most `handoff_wait_s`.  So no pool
call of this half waits on a lock in the scheduler loop, and a stalled lock
manager delays hits, never scheduling.

Keys carry the worker's page layout (vllm_meta.TractHandshake): until vLLM
has handed it over, at start-up, the pool is not used.
"""
from __future__ import annotations

import collections
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from tract_cli.connectors import vllm_events
from tract_cli.connectors.keys import MAX_SALT_BYTES, key_tag, prompt_keys
from tract_cli.core.events import MAX_RECORD_SALT, Described, describe_span
from tract_cli.connectors.retry import Releases, queue_ack, queue_pair_lost
from tract_cli.connectors.throttle import Throttle
from tract_cli.connectors.vllm_meta import (HandoffSpec, LoadSpec, SaveSpec,
                                            TractConnectorMetadata, TractWorkerMeta)
from tract_cli.core import kvlog, transfer_params
from tract_cli.core.errors import (HandoffError, HandoffGone, HandoffLost, HandoffPending,
                                   TractError)
from tract_cli.core.handoff import Ticket, check_pair, named_by_pair, pair_key, request_key
from tract_cli.core.index import Lookup

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

    from tract_cli.connectors.model_identity import ModelIdentity
    from tract_cli.connectors.settings import ConnectorSettings
    from tract_cli.core.pool import Pool

log = logging.getLogger("vllm.tract")

PARAMS_KEY = transfer_params.TICKET
PAIR_KEY = transfer_params.PAIR
PAIR_POLL_S = 0.001        # how often an idle engine step looks for a paired decode's record
# how often (at most) a prefill instance at its handoff bound reads its records
# to find those acknowledged since (each is a lock-free read of one record)
PRUNE_INTERVAL_S = 0.1
# a warning every request may have cause for (a flood at the handoff bound, a
# stalled lookup) is logged at most this often
WARN_EVERY_S = 10.0


def _as_names(names) -> np.ndarray:
    """Record names (16 bytes each) as the (n, 16) uint8 array Handoffs.find takes."""
    return np.frombuffer(b"".join(names), np.uint8).reshape(-1, 16)


@dataclass
class _Request:
    """Scheduler-side state of one request."""

    prompt_len: int
    keys: np.ndarray                   # (n_full, 16) keys of the full blocks
    tail_key: np.ndarray | None        # (1, 16) key of the partial tail block, if any
    tail_tokens: int
    cacheable: bool
    # what its blocks' records say (KV events): the full blocks' hashes as the
    # scheme made them, the prompt's tokens and its cache salt; hashes None: not
    # described (a salt longer than a record holds)
    hashes: np.ndarray | None = None
    tokens: np.ndarray | None = None
    salt: str | None = None
    lookup: Lookup | None = None       # pins this process holds for the request
    looking: Future | None = None      # a lookup running off the scheduler loop
    first_asked: float = 0.0           # when vLLM first asked for its match
    started: list | None = None        # [when the lookup thread took its lookup up]
    idle_steps: int = 0                # steps its lookup has been back and not asked for
    received: Any = None               # an opened handoff (core.handoff.Received)
    ticket: Ticket | None = None
    matched_from: int = 0              # num_computed_tokens the last match was asked from
    loading: bool = False              # a load was handed to the worker, not yet finished
    saved: int = 0                     # region blocks planned for saving so far
    tail_saved: bool = False
    handoff_failed: bool = False
    want_handoff: bool = False         # a prefill for a remote decode (do_remote_decode)
    # why the step that completed its prompt planned no handoff for it (None:
    # it did, or has not run): said when it finishes, its decode computing
    no_handoff: str | None = None
    load_pages: frozenset = frozenset()  # vLLM pages of the load in flight
    load_failed: bool = False          # a load of it failed: compute it, never load again
    handoff: Ticket | None = None      # its handoff, published by the worker in-step (planned)
    name: bytes = b""                  # the 16-byte name of its handoff's record (a prefill's)
    # a paired decode: the name of its prefill's record, looked for each step
    # (its prefill may not have taken one yet), since when
    pair: bytes | None = None
    pair_since: float = 0.0
    # the pair's reserved record was given back: looked for by name again until
    # then, for the record of no blocks its prefill leaves (Handoffs.publish_lost)
    pair_relook_until: float = 0.0
    # a decode's ticket whose record is reserved, not yet published (its prefill
    # commits the blocks off its step): asked again each step, since when
    pending: Ticket | None = None
    pending_since: float = 0.0
    # its kv_transfer_params ask the worker to time a memcpy beside its copies
    # (kvlog.REFERENCE_PARAM: the bench's warm-up requests; the worker honours
    # it only where TRACT_CONNECTOR_REFERENCE=1)
    reference: bool = False



class SchedulerSide:
    """Request state and the step's plan (one per engine core)."""

    def __init__(self, pool: "Pool", settings: "ConnectorSettings", vllm_config: "VllmConfig",
                 identity: "ModelIdentity", releases: Releases, engine_id: str,
                 kv_cache_manager_of):
        self.pool, self.settings, self.identity = pool, settings, identity
        self.releases, self.engine_id = releases, engine_id
        self._kv_cache_manager_of = kv_cache_manager_of   # vLLM's, set after construction
        self.g = pool.geometry.block_tokens
        self.page_tokens = vllm_config.cache_config.block_size
        self.r = self.page_tokens // self.g
        self.timeout = settings.lookup_timeout_s
        self.layout: str | None = None      # the worker's page layout (hex; "": canonical)
        self.key_tag: bytes | None = None
        self._no_layout_logged = False
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="tract-lookups")
        self._reqs: dict[str, _Request] = {}
        self._loading_done: dict[str, _Request] = {}   # finished while their load ran
        self._pending_loads: list[LoadSpec] = []
        self._matched: set[str] = set()     # pinned this step, no vLLM pages yet
        self._looking: set[str] = set()     # requests with a lookup on the lookup thread
        self._stalled_until = 0.0           # no new lookups before (a lookup ran out of patience)
        self._stall_said = Throttle(WARN_EVERY_S)
        # this instance's published handoffs not known released
        self._handoffs: collections.deque = collections.deque()
        # records promised to handoffs the worker publishes in a step not yet
        # answered (request_finished): never chosen twice
        self._planned: set[int] = set()
        # in-step handoffs of requests gone before their step's output came back
        # (an abort while the step runs, with asynchronous scheduling): given
        # back once it has (update_connector_output), their records still
        # promised meanwhile
        self._orphaned: list[Ticket] = []
        # where this instance looks for a free record first: its node's share of
        # the table, so instances on other nodes rarely choose the same one
        records = pool.info.section("transfer").count
        self._record_cursor = settings.node * records // max(1, pool.info.max_nodes)
        self._pruned_at = 0.0
        self._denied, self._denied_said = 0, Throttle(WARN_EVERY_S)
        # the region's blocks in vLLM's KV event stream, once the key tag is known
        self._events_wanted = vllm_events.wanted(vllm_config, settings)
        self._hash_algo = str(vllm_config.cache_config.prefix_caching_hash_algo)
        self._events: vllm_events.RegionEvents | None = None
        # paired decodes whose prefill's record is not found yet: {request id:
        # the pair's name}, and the last pass over the table for them (the step
        # it ran in, what it found: {request id: record, -1 none})
        self._pairs_waiting: dict[str, bytes] = {}
        self._pairs_seen: dict[str, int] = {}
        self._steps, self._pairs_seen_step = 0, -1

    def set_layout(self, layouts: set[str]) -> None:
        """The workers' page layout, from vLLM's handshake: it enters every key."""
        if len(layouts) != 1:
            raise TractError(f"vLLM's workers keep KV pages in {len(layouts)} layouts",
                             "serve with one worker per instance (tensor-parallel size 1)")
        self.layout = layouts.pop()
        self.key_tag = key_tag(self.identity.digest,
                               bytes.fromhex(self.layout) if self.layout else None)
        log.info("TraCT connector scheduler: worker KV page layout %s, key tag %s",
                 self.layout[:16] or "canonical", self.key_tag.hex()[:16])
        if self._events_wanted and self._events is None:
            self._events = vllm_events.RegionEvents(self.pool, self.settings, self.key_tag,
                                                    self.page_tokens, self._hash_algo)

    def take_events(self) -> list:
        """vLLM KV events for the region's blocks changed since the last step."""
        return self._events.take() if self._events is not None else []

    def retell_events(self) -> None:
        """Tells every region block again at the next step (vLLM reset the
        connector's cache: a router told to forget the instance's blocks)."""
        if self._events is not None:
            self._events.retell()

    def _state(self, request: "Request") -> _Request:
        st = self._reqs.get(request.request_id)
        if st is not None:
            return st
        tokens = request.prompt_token_ids
        cacheable = (tokens is not None and not request.lora_request and
                     not getattr(request, "mm_features", None))
        if cacheable and self.key_tag is None:
            if not self._no_layout_logged:
                self._no_layout_logged = True
                log.warning("TraCT: vLLM has not handed the worker's KV page layout to the "
                            "scheduler (its KV connector handshake): the pool is not used")
            cacheable = False
        salt = getattr(request, "cache_salt", None)
        if cacheable and salt and len(salt.encode()) > MAX_SALT_BYTES:
            log.warning("request %s: its cache_salt is over %d bytes: it is computed by vLLM "
                        "and not cached in the pool", request.request_id, MAX_SALT_BYTES)
            cacheable = False
        hashes = arr = None
        if cacheable:
            # vLLM's prompt is a list: made an array once (~0.1 ms at 6000 tokens)
            arr = np.asarray(tokens, dtype=np.int64)
            keys, tail_key, tail, hashes = prompt_keys(self.pool.info, self.key_tag, self.g,
                                                       arr, salt)
            if salt and len(salt.encode()) > MAX_RECORD_SALT:
                hashes = arr = None
        else:
            keys = np.zeros((0, 16), np.uint8)
            tail, tail_key = 0, None
        params = request.kv_transfer_params or {}
        st = _Request(len(tokens or ()), keys, tail_key, tail, cacheable, hashes, arr,
                      salt or None, want_handoff=bool(params.get("do_remote_decode")),
                      reference=params.get(kvlog.REFERENCE_PARAM) is True,
                      name=request_key(request.request_id))
        if params.get(PAIR_KEY) is not None and cacheable:
            self._pair(request, st, params)
        self._reqs[request.request_id] = st
        return st

    def _pair(self, request: "Request", st: _Request, params: dict) -> None:
        """A paired request's name (PAIR_KEY): a prefill's record is named by it,
        a decode without a ticket looks for that record.  A bad name (network
        input) is not used: the prefill's record is named by its request id
        (its reply's ticket still works), the decode computes the prompt."""
        try:
            name = pair_key(check_pair(params[PAIR_KEY]))
        except TractError as exc:
            log.warning("request %s: its %s is not used: %s", request.request_id, PAIR_KEY, exc)
            return
        if st.want_handoff:
            st.name = name
        elif params.get("do_remote_prefill") and PARAMS_KEY not in params:
            st.pair = name

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        """Tokens the pool holds beyond NUM_COMPUTED_TOKENS (loaded as load_mode says);
        None while its lookup runs (vLLM asks again next step)."""
        st = self._state(request)
        if not st.cacheable or st.load_failed:
            return 0, False
        if st.loading:
            # a load of it is in flight, its report not in yet (a request preempted
            # right after a synchronous load's step, with asynchronous scheduling):
            # no second load is planned for it (update_state_after_alloc), so
            # nothing may be promised; it is computed
            return 0, False
        st.matched_from = num_computed_tokens
        params = request.kv_transfer_params or {}
        if params.get("do_remote_prefill") and (PARAMS_KEY in params or st.pair is not None):
            if st.received is None and not st.handoff_failed:
                if PARAMS_KEY in params:
                    self._open_handoff(request, st, params)
                else:
                    ticket = st.pending or self._find_paired(request, st)
                    if ticket is None and not st.handoff_failed:
                        return None, False  # not yet: its prefill has taken no record
                    if ticket is not None:
                        self._open_ticket(request, st, ticket)
                        if st.received is None and st.pending is None and \
                                not st.handoff_failed:
                            return None, False      # looked for by name again
            if st.received is not None:
                return self._answer(request, num_computed_tokens, st.received.token_count)
            if st.pending is not None:
                return None, False      # not yet: its prefill still commits the blocks
        if not self.settings.prefix_cache or not len(st.keys):
            return 0, False
        if st.lookup is None:
            got = self._lookup_result(request.request_id, st)
            if got is not True:
                return got
        count, load_async = self._answer(request, num_computed_tokens, st.lookup.hits * self.g)
        if count <= 0:
            self._unpin(st)
            return 0, False
        # pinned for this step only: if vLLM gives it no pages now (a queued request),
        # build_connector_meta gives the pins back, so pinned capacity never grows
        # with the queue
        self._matched.add(request.request_id)
        return count, load_async

    def _answer(self, request: "Request", computed: int, end: int) -> tuple[int, bool]:
        """vLLM's answer for a pool hit of the prompt up to token END: (tokens to
        load, asynchronously?).  A synchronous load (load_mode sync) is copied in
        the step that computes the rest of the prompt, so it leaves that step at
        least the last token to compute (vLLM schedules no step of none)."""
        load_async = self.settings.load_mode == "async"
        if not load_async:
            end = min(end, request.num_tokens - 1)
        count = end - computed
        return (count, load_async) if count > 0 else (0, False)

    def _lookup_result(self, req_id: str, st: _Request):
        """The request's lookup, run on the lookup thread: True once st.lookup
        holds it, else vLLM's answer meanwhile: (None, False), not yet; (0, False),
        compute it without the pool.  Only a lookup started by this call is waited
        for (lookup_wait_s).  A request not matched within lookup_patience_s of
        vLLM's first ask is computed without the pool (a lookup still out gives
        its pins back when it returns); if its lookup itself ran that long, new
        requests are not looked up for as long again: a stalled lock manager
        delays each request by at most the patience and never fills the lookup
        queue."""
        now = time.monotonic()
        patience = self.settings.lookup_patience_s
        wait = 0.0
        if not st.first_asked:
            st.first_asked = now
        if st.looking is None:
            if now < self._stalled_until or now - st.first_asked >= patience:
                return 0, False
            # a prompt the pool does not hold is answered here, by a look without a
            # lock (the lookup's own first step; its locked pass would find none
            # and take no lock): no thread handoff for every new prompt
            try:
                if self.pool.index.peek(st.keys[:1]) == 0:
                    return 0, False
            except TractError as exc:
                log.warning("TraCT lookup of request %s failed, computing it: %s", req_id, exc)
                return 0, False
            started = st.started = [0.0]          # when the lookup thread takes it up

            def lookup(keys):
                started[0] = time.monotonic()
                return self.pool.index.lookup(keys, timeout=self.timeout)

            st.looking = self._lookups.submit(lookup, st.keys)
            st.idle_steps = 0
            self._looking.add(req_id)
            wait = self.settings.lookup_wait_s
        try:
            st.lookup = st.looking.result(timeout=wait)
        except FutureTimeout:
            now = time.monotonic()
            if now - st.first_asked < patience:
                return None, False             # not yet: vLLM schedules the others
            # given up: computed without the pool; a lookup that has *run* this long
            # (not one queued behind others) means stalled locks: new requests are
            # not looked up for as long again
            running = st.started[0] and now - st.started[0] >= patience
            self._forget_lookup(st)
            self._looking.discard(req_id)
            if running:
                self._stalled_until = now + patience
            if running and self._stall_said.due():
                log.warning("TraCT lookup of request %s not back within %.3f s (lookup_"
                            "patience_s): computed without the pool, and new requests are "
                            "not looked up for %.3f s (a stalled lock manager? `tract "
                            "inspect --locks`)", req_id, patience, patience)
            return 0, False
        except Exception as exc:               # a pool error, or any other: computed
            st.looking = None
            self._looking.discard(req_id)
            log.warning("TraCT lookup of request %s failed, computing it: %s", req_id, exc)
            return 0, False
        st.looking = None
        self._looking.discard(req_id)
        st.first_asked = 0.0                   # answered: its patience starts again
        return True

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
            if raw.get("layout") != self.layout:
                raise HandoffError("the handoff's blocks are in another KV page layout "
                                   f"({str(raw.get('layout'))[:16] or 'canonical'}, this "
                                   f"instance's is {self.layout[:16] or 'canonical'}: another "
                                   "attention backend, CPU instruction set or block size)",
                                   "pair prefill and decode instances of the same hardware "
                                   "and --block-size")
            if raw.get("model") != self.identity.digest.hex():
                # the keys check below refuses it too (they carry the identity); this
                # says why, for the operator
                raise HandoffError("the handoff was computed by another model (model identity "
                                   f"{str(raw.get('model'))[:16]}, this instance serves "
                                   f"{self.identity.short()})",
                                   "send decode requests to instances of the prefill's model")
        except (TractError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            # a ticket is network input: whatever is wrong with it, the request is computed
            st.handoff_failed = True
            log.warning("TraCT handoff of request %s not used, computing it: %s",
                        request.request_id, exc)
            return
        self._open_ticket(request, st, ticket)

    def _open_ticket(self, request: "Request", st: _Request, ticket: Ticket) -> None:
        """Opens the handoff TICKET names (a prefill's reply's, or the record a
        paired decode found), if it is of this prompt: st.received; st.pending
        while it is reserved, not yet published; else st.handoff_failed."""
        try:
            expected = st.keys if st.tail_key is None else np.vstack([st.keys, st.tail_key])
            if ticket.blocks != len(expected):
                raise HandoffError("the handoff is of another prompt",
                                   "send the decode request with the prefill's prompt")
            try:
                rec = self.pool.handoffs.open(ticket)
            except HandoffGone:
                if st.pair is None or st.pair_relook_until:
                    raise
                # the pair's reserved record was given back: its prefill lost the
                # handoff, and the record that says so (no blocks, under the pair's
                # name) follows, queued right after; looked for by name again, at
                # most handoff_wait_s, so that it is read and given back
                st.pending = None
                st.pair_relook_until = time.monotonic() + self.settings.handoff_wait_s
                self._pairs_waiting[request.request_id] = st.pair
                self._pairs_seen.pop(request.request_id, None)
                return
            except HandoffPending:
                if ticket.tokens != st.prompt_len:
                    raise HandoffError("the handoff is of another prompt",
                                       "send the decode request with the prefill's prompt")
                self._wait_published(request, st, ticket)
                return
            except HandoffLost as exc:
                # its prefill's record of no blocks (Handoffs.publish_lost): read,
                # so given back at once (queued) rather than at its TTL
                st.handoff_failed = True
                st.pending = None
                log.warning("TraCT handoff of request %s lost by its prefill, computing it: %s",
                            request.request_id, exc)
                queue_ack(self.releases, self.pool, Ticket(ticket.record, ticket.request_id, 0, 0))
                return
            st.pending = None
            # the record's own key list, not anything the ticket says, names the blocks:
            # only a request whose prompt (and salt) has exactly these keys loads them
            if rec.token_count != st.prompt_len or not np.array_equal(rec.keys, expected):
                raise HandoffError("the handoff is of another prompt (or another tenant's salt)",
                                   "send the decode request with the prefill's prompt")
        except (TractError, TypeError, ValueError, AttributeError, OverflowError) as exc:
            st.handoff_failed = True
            st.pending = None
            log.warning("TraCT handoff of request %s not used, computing it: %s",
                        request.request_id, exc)
            return
        st.received, st.ticket = rec, ticket

    def _idle_for_pairs(self) -> None:
        """An engine step that scheduled nothing while paired decodes wait for
        their prefills: the engine loop would step again at once (vLLM sleeps
        1 ms between such steps), each step a round trip to the worker, taking
        a core's share from whatever shares the host (on one host, the prefill
        itself).  Waits instead until one of their records is in the table,
        looked for every PAIR_POLL_S, for at most pair_idle_s: a request that
        arrives meanwhile waits that long at most, and only when nothing else
        was running."""
        deadline = time.monotonic() + self.settings.pair_idle_s
        keys = _as_names(self._pairs_waiting.values())
        while time.monotonic() < deadline:
            time.sleep(PAIR_POLL_S)   # waiting for another host's store, bounded
            try:
                if (self.pool.handoffs.find(keys) >= 0).any():
                    return
            except TractError:
                return

    def _find_paired(self, request: "Request", st: _Request) -> Ticket | None:
        """The record of a paired decode's prefill, looked for by the pair's name:
        its ticket once found (PUBLISHED, or RESERVED and published soon), None
        while not (its prefill has not reached the step that completes the
        prompt), for at most pair_wait_s from vLLM's first ask; past that the
        request is computed (st.handoff_failed).  Every paired decode still
        waiting is looked for in one pass over the transfer table a step
        (one C call, no lock), and again only for one that arrived since."""
        req_id, now = request.request_id, time.monotonic()
        if not st.pair_since:
            st.pair_since = now
            self._pairs_waiting[req_id] = st.pair
        if self._pairs_seen_step != self._steps or req_id not in self._pairs_seen:
            ids = list(self._pairs_waiting.items())
            keys = _as_names(k for _, k in ids)
            try:
                recs = self.pool.handoffs.find(keys)
            except TractError as exc:
                log.warning("TraCT: the handoff table could not be read for paired "
                            "requests: %s", exc)
                recs = np.full(len(ids), -1)
            self._pairs_seen = {rid: int(rec) for (rid, _), rec in zip(ids, recs)}
            self._pairs_seen_step = self._steps
        record = self._pairs_seen.get(req_id, -1)
        blocks = len(st.keys) + (st.tail_key is not None)
        if record >= 0:
            self._pairs_waiting.pop(req_id, None)
            return Ticket(record, st.pair.hex(), blocks, st.prompt_len)
        if st.pair_relook_until:            # bounded by that alone, not pair_wait_s
            if now >= st.pair_relook_until:
                self._pairs_waiting.pop(req_id, None)
                st.handoff_failed = True
                log.warning("TraCT handoff of paired request %s given back by its prefill, "
                            "computing it", req_id)
        elif now - st.pair_since >= self.settings.pair_wait_s:
            self._pairs_waiting.pop(req_id, None)
            st.handoff_failed = True
            log.warning("TraCT handoff of paired request %s not found within %.1f s "
                        "(pair_wait_s), computing it: its prefill did not reach the end of "
                        "the prompt", req_id, self.settings.pair_wait_s)
        return None

    def _wait_published(self, request: "Request", st: _Request, ticket: Ticket) -> None:
        """The ticket's record is reserved, not yet published: its prefill's step
        let the reply go before the commit that publishes it (off that step).
        vLLM is told "not yet" until it is published, for at most
        handoff_wait_s; past that the request is computed and the reservation
        given back (queued), so a publish after it is refused and pins nothing
        for a decode that will not come."""
        now = time.monotonic()
        if st.pending is None:
            st.pending, st.pending_since = ticket, now
            return
        relooked_out = st.pair_relook_until and now >= st.pair_relook_until
        if now - st.pending_since < self.settings.handoff_wait_s and not relooked_out:
            return
        st.pending, st.handoff_failed = None, True
        log.warning("TraCT handoff of request %s not published within %.1f s (handoff_wait_s) "
                    "of its prefill's reply, computing it", request.request_id,
                    self.settings.handoff_wait_s)
        self._release_handoff(ticket, reserved=True)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        self._matched.discard(request.request_id)
        st = self._reqs.get(request.request_id)
        if st is None or st.loading:
            return
        st.first_asked = 0.0                   # scheduled: a later wait (preempted) is new
        if num_external_tokens == 0:
            self._unpin(st)
            if st.ticket is not None:              # not needed (e.g. a local hit): release now
                self._release_handoff(st.ticket)
                st.received = st.ticket = None
                # used up: asked again (preempted), it is not looked for again
                st.handoff_failed = True
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
                                            None if tags is None else tags[first:last],
                                            sync=self.settings.load_mode == "sync",
                                            reference=st.reference,
                                            past_end=end_tokens % self.g != 0))
        st.loading = True
        st.load_pages = frozenset(int(p) for p in np.unique(page_ids[idx // self.r]))
        st.saved = max(st.saved, min(last, len(st.keys)))
        st.tail_saved = st.tail_saved or last > len(st.keys)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> TractConnectorMetadata:
        meta = TractConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        self._steps += 1
        if (self._pairs_waiting and self.settings.pair_idle_s and not meta.loads
                and scheduler_output.total_num_scheduled_tokens == 0 and not self._looking
                and not any(st.loading or st.pending for st in self._reqs.values())):
            self._idle_for_pairs()
        for req_id in self._matched:          # matched, but vLLM had no pages for it
            st = self._reqs.get(req_id)
            if st is not None and not st.loading:
                self._unpin(st)
        self._matched.clear()
        # a lookup back with its pins that vLLM has not asked for since (it stopped
        # short of the request in its queue): given back after a second step, so
        # pins never grow with the queue; asked again, it is looked up again
        for req_id in list(self._looking):
            st = self._reqs.get(req_id)
            if st is None or st.looking is None:
                self._looking.discard(req_id)
            elif st.looking.done():
                st.idle_steps += 1
                if st.idle_steps >= 2:
                    self._forget_lookup(st)
                    self._looking.discard(req_id)
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
            handoff = self._plan_handoff(req_id, st, end)
            if handoff is not None:
                spec = spec or SaveSpec(req_id, np.zeros((0, 16), np.uint8),
                                        np.zeros(0, np.uint32), np.zeros(0, np.int64),
                                        np.zeros(0, np.int64))
                spec.handoff = handoff
                # published in the step (handoff_publish in_step): the step waits for
                # its commit; otherwise its record is reserved in the step, and it is
                # published after the commit, off the step
                spec.handoff_follows = self.settings.handoff_publish == "in_step"
            if spec is not None:
                meta.saves.append(spec)
        return meta

    def _plan_handoff(self, req_id: str, st: _Request, end: int):
        """The handoff of a prefill for a remote decode, published by the worker in
        the step that completes its prompt, with the pins of the save's own claim
        and commit (a block another handoff of the step holds too is pinned again
        for it there: no lock walk in the scheduler loop): a record is chosen now
        (read without a lock) and promised in the ticket request_finished
        returns.  None where the request publishes no handoff; where it would but
        cannot (max_handoffs in flight, no record looking free, a load of it
        that failed), why is kept for request_finished to say."""
        if (not self.settings.save or not st.want_handoff or st.handoff is not None
                or end < st.prompt_len):
            return None
        if st.load_failed:
            st.no_handoff = "a load of its prompt failed"
            return None
        if not self._handoff_room(planned=True):
            st.no_handoff = (f"{self.settings.max_handoffs} handoffs of this instance in "
                             "flight (max_handoffs)")
            return None
        try:
            record = self._choose_record()
        except TractError as exc:
            st.no_handoff = f"no handoff record could be looked for: {exc}"
            return None
        if record is None:
            st.no_handoff = "no handoff record looked free"
            return None
        st.no_handoff = None
        keys = st.keys if st.tail_key is None else np.vstack([st.keys, st.tail_key])
        self._planned.add(record)
        st.handoff = Ticket(record, st.name.hex(), len(keys), st.prompt_len)
        return HandoffSpec(record, req_id, np.ascontiguousarray(keys), st.prompt_len,
                           self.settings.handoff_ttl_s, st.name)

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
        described = self._describe(req_id, st, st.saved, full, with_tail)
        if with_tail:
            idx.append(len(st.keys))
            keys = np.vstack([keys, st.tail_key])
            tokens = np.append(tokens, np.uint32(st.tail_tokens))
            st.tail_saved = True
        st.saved = max(st.saved, full)
        page_ids = np.asarray(self._kv_cache_manager_of().get_block_ids(req_id)[0],
                              dtype=np.int64)
        blocks = np.asarray(idx, dtype=np.int64)
        return SaveSpec(req_id, np.ascontiguousarray(keys), tokens, page_ids[blocks // self.r],
                        blocks % self.r, described=described, reference=st.reference)

    def _describe(self, req_id: str, st: _Request, lo: int, hi: int,
                  with_tail: bool) -> Described | None:
        """What the records of full blocks LO..HI of a request (and its tail,
        with WITH_TAIL: not described, a handoff's block only) say for KV events;
        None for a prompt not described (a salt longer than a record holds)."""
        if st.hashes is None:
            return None
        try:
            got = describe_span(st.hashes, st.tokens, lo, hi, self.g, self.key_tag, st.salt)
        except Exception as exc:     # a description never stops a save, nor the step
            log.warning("TraCT: the blocks of request %s are saved without their KV event "
                        "description: %s", req_id, exc)
            st.hashes = None
            return None
        if not with_tail:
            return got
        return Described(np.concatenate([got.records, np.zeros(1, got.records.dtype)]),
                         np.vstack([got.token_ids, np.zeros((1, self.g), np.uint32)]))

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        orphaned, self._orphaned = self._orphaned, []
        for ticket in orphaned:
            self._planned.discard(ticket.record)
            self._release_handoff(ticket, reserved=True)
        invalid = connector_output.invalid_block_ids or set()
        # loads done: the asynchronous ones the worker reported finished, and the
        # synchronous ones it copied in the step of this output
        worker = connector_output.kv_connector_worker_meta
        synced = worker.loaded if isinstance(worker, TractWorkerMeta) else set()
        for req_id in set(connector_output.finished_recving or ()) | synced:
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
        self._pairs_waiting.pop(request.request_id, None)
        if st is None:
            return False, None
        if st.loading:
            self._loading_done[request.request_id] = st   # the worker still reads its pins
        else:
            self._unpin(st)
        self._forget_lookup(st)
        self._looking.discard(request.request_id)
        if st.ticket is not None:                       # opened, never loaded
            self._release_handoff(st.ticket)
        if st.pending is not None:                      # waited for, never published
            self._release_handoff(st.pending, reserved=True)
        # only an instance that saves publishes: its own step saved the blocks. A
        # client of a decode-only instance asking do_remote_decode pins nothing
        finished = request.status in (RequestStatus.FINISHED_LENGTH_CAPPED,
                                      RequestStatus.FINISHED_STOPPED)
        if st.handoff is not None:
            # published by the worker in the step that completed the prompt, which
            # ran before this call: its ticket, with no pool call here
            if not finished:
                # aborted, perhaps while that step still runs: given back once the
                # next step output is in (by then the step has reserved its record or
                # not: its reservation given back, or what its publish made released)
                self._orphaned.append(st.handoff)
                return False, None
            self._planned.discard(st.handoff.record)
            self._handoffs.append(st.handoff)
            return False, self._ticket_params(request, st.handoff)
        if self.settings.save and st.want_handoff and st.cacheable and finished:
            # no handoff planned in the step that completed its prompt: none is made
            # here either (no pool call in the scheduler loop); its decode computes
            self._denied += 1
            if self._denied_said.due():
                log.warning("TraCT: request %s answered without a handoff (%s), its decode "
                            "computes the prompt (%d so far; said at most every %.0f s)",
                            request.request_id, st.no_handoff or "its prompt's last step "
                            "was not planned with one", self._denied, WARN_EVERY_S)
            if st.load_failed and named_by_pair(st.name, request.request_id):
                # a paired decode has no ticket to find none: told by a record of no
                # blocks under the pair's name (queued), so it computes at once, not
                # after pair_wait_s.  Not where max_handoffs or a full table stopped
                # the handoff: a client must not make records past that bound
                queue_pair_lost(self.releases, self.pool, st.name,
                                self.settings.handoff_ttl_s, request.request_id)
        return False, None

    def _choose_record(self) -> int | None:
        """A handoff record that looks free (read without a lock) from this
        instance's cursor on, none promised to a planned handoff or held by one
        in flight; None if none looks free."""
        skip = self._planned | {t.record for t in self._handoffs}
        record = self.pool.handoffs.peek_free(self._record_cursor, skip)
        if record is not None:
            self._record_cursor = record + 1
        return record

    def _ticket_params(self, request: "Request", ticket: Ticket) -> dict:
        """The kv_transfer_params a prefill's reply carries to the decode side."""
        raw = ticket.to_dict() | {"region": self.pool.info.uuid,
                                  "model": self.identity.digest.hex(), "layout": self.layout}
        # a request that asked for the memcpy reference asks it of its decode's load too
        asked = (request.kv_transfer_params or {}).get(kvlog.REFERENCE_PARAM) is True
        return {"do_remote_prefill": True, "do_remote_decode": False,
                "remote_engine_id": self.engine_id, "remote_request_id": request.request_id,
                "remote_block_ids": [], "remote_host": "tract", "remote_port": 0,
                "tp_size": 1, PARAMS_KEY: raw} | ({kvlog.REFERENCE_PARAM: True} if asked else {})

    def _handoff_room(self, planned: bool = False) -> bool:
        """Whether this instance may publish one more handoff (max_handoffs),
        counting those PLANNED in-step and not answered yet. One
        stops counting once its record is gone (acknowledged, or expired and
        reclaimed: until then its pins hold, whatever the clock says), as a
        lock-free read of each record finds, at most every PRUNE_INTERVAL_S."""
        cap, now = self.settings.max_handoffs, time.monotonic()
        if planned:
            cap -= len(self._planned)
        if len(self._handoffs) < cap or now - self._pruned_at < PRUNE_INTERVAL_S:
            return len(self._handoffs) < cap
        self._pruned_at = now
        kept = collections.deque()
        for ticket in self._handoffs:
            try:
                self.pool.handoffs.open(ticket)     # metadata only, no lock
                kept.append(ticket)
            except HandoffPending:
                kept.append(ticket)                 # reserved, its publish still to come
            except HandoffError:
                pass                                # released
            except TractError:
                kept.append(ticket)
        self._handoffs = kept
        return len(kept) < cap

    def _forget_lookup(self, st: _Request) -> None:
        """A lookup still running for a request that is gone: its pins are given
        back when it returns."""
        looking, st.looking = st.looking, None
        if looking is None or looking.cancel():     # cancelled before it ran: no pins
            return

        def unpin(done: Future) -> None:
            try:
                lookup = done.result()
            except Exception:          # a failed lookup pinned nothing
                return
            self._unpin(_Request(0, np.zeros((0, 16), np.uint8), None, 0, False, lookup=lookup))

        looking.add_done_callback(unpin)

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

    def shutdown(self) -> None:
        orphaned, self._orphaned = self._orphaned, []
        for ticket in orphaned:    # perhaps still reserved: the save thread publishes after
            self._release_handoff(ticket, reserved=True)
        for st in list(self._reqs.values()):
            self._forget_lookup(st)
            if st.pending is not None:              # a decode waiting for a publish
                self._release_handoff(st.pending, reserved=True)
                st.pending = None
            if st.ticket is not None:               # opened, never loaded
                self._release_handoff(st.ticket)
                st.received = st.ticket = None
        self._lookups.shutdown(wait=True, cancel_futures=True)
        if self._events is not None:
            self._events.close()

    def _release_handoff(self, ticket: Ticket, reserved: bool = False) -> None:
        """Acknowledges (queued) a handoff this instance will not load (RESERVED:
        its record may still be reserved, its publish to come: the reservation
        is given back first, and the publish then refused)."""
        queue_ack(self.releases, self.pool, ticket, reserved=reserved)

