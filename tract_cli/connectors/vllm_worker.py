"""The worker half of TraCT's vLLM connector: moves KV bytes between vLLM's
paged KV cache and the region, as the scheduler half planned (docs/VLLM.md,
"The data path").

- **Layout**: at `register_kv_caches` the attention backend's page layout is
  measured (`vllm_setup.engine_page_map`) and told to the scheduler through
  vLLM's handshake (its digest enters every key: core/kvpages.py).
- **Load**: a request's blocks are copied in one C call (`PagedKV.load`, the
  GIL released) that checksums as it copies: with load_mode sync in
  `start_load_kv`, before the forward of the step that computes the rest of
  the prompt, reported with that step's output (`worker_meta`; what the step
  computes for a request whose load failed is not saved); with async on this
  worker's loader thread while the engine runs its next step, reported by
  `get_finished` once its bytes are in vLLM's pages.  A bad block's pages
  (`get_block_ids_with_load_errors`) go to vLLM to recompute from there.
  A handoff's copy stands if its record is still published after it (read
  without a lock); its acknowledgement is queued once the request is
  reported, off the request's path.
- **Save**: the step's new full blocks are claimed during the forward (one
  reserve, on the save thread), copied from vLLM's pages after it in one C
  call that checksums as it copies with streaming stores (`PagedKV.save`), and
  published by one commit on the save thread, off the step: the copy is all
  the step waits for (vLLM may reuse the pages once it is done).  On the CPU
  path the commit waits until the step's output has left (COMMIT_DEFER_S, or
  the next step's bind).  A step that publishes its handoffs in it
  (`handoff_publish` in_step: `SaveSpec.handoff_follows`) waits for its
  commit too.  The save thread runs a step's
  claim after the previous step's commit.  The commit and the claim each wait
  at most `step_timeout_s` for a lock: past it the blocks are not saved (vLLM
  computes as ever) and the claims are given back, retried until it succeeds.
  A step waits for its claim (a P/D prefill's: and its handoffs' records
  reserved) `claim_wait_s` at most past the forward (on a GPU from its
  first layer), then goes on without saving (the claim given back once
  done, its handoffs not published, and no step queues a claim while it is
  out); a step that waits for its commit waits `claim_wait_s` at most for
  that too.
- **Handoffs**: a P/D prefill's handoff planned for the step (SaveSpec.handoff)
  has the record the scheduler chose reserved with the step's claim, during
  the forward, so its ticket may leave with the step's output; it is
  published after the commit, on the save thread, off the step, with the pins
  the step's pinning claim and commit took (`publish_pinned`: no lock walk of
  its own; a block an earlier handoff of the step took that pin of is pinned
  again for it by a lookup there).  A decode instance that opens the record before is told to wait
  (vllm_scheduler.py).  Pins no published handoff took over go back off the
  step, and a reservation not published is given back.
- On a GPU (`core/gpupages.py`): the slots are registered host memory and
  each layer moves by DMA on a side stream: a save's as vLLM hands the layer
  over (overlapping the rest of the forward; `wait_for_save` waits for it), a
  load's queued in `start_load_kv` and waited for by the layer's attention
  (`wait_layer`); the CPU checksums the slots meanwhile, and the load's
  verdict (checksums, a handoff still published) is settled in
  `wait_for_save`, before the step's output is reported.
"""
from __future__ import annotations

import contextlib
import logging
import os
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from tract_cli.connectors.retry import Releases, queue_ack, queue_pair_lost
from tract_cli.connectors.throttle import Throttle
from tract_cli.connectors.vllm_meta import LoadSpec, SaveSpec, TractHandshake, TractWorkerMeta
from tract_cli.connectors.vllm_setup import ConnectorError, engine_page_map
from tract_cli.core import kvlog
from tract_cli.core.cpu import checksum_path
from tract_cli.core.errors import (FlushModeError, HandoffGone, PoolFull, ReservationGone,
                                   TractError)
from tract_cli.core.events import Described
from tract_cli.core.handoff import Ticket
from tract_cli.core.index import PUT_CLAIMED, PUT_NO_ROOM, PUT_STORED, PUT_WAS_READY
from tract_cli.core.gpupages import (DIRECT_MIN_RUN_BYTES, CudaPagedKV, gpu_batch_copy,
                                     staging_capacity)
from tract_cli.core.kvpages import PagedKV, huge_page_share
from tract_cli.core.media import BLOCK_RECORD_DTYPE

if TYPE_CHECKING:
    from vllm.config import VllmConfig

    from tract_cli.connectors.settings import ConnectorSettings
    from tract_cli.core.pool import Pool

log = logging.getLogger("vllm.tract")


class ReferenceMismatch(TractError):
    """The memcpy reference's checksummed copy read other bytes than the load
    it follows: the load fails, and vLLM recomputes it."""


# TRACT_CONNECTOR_REFERENCE=1 (what `tract bench --engine vllm` sets): time a memcpy
# of the same bytes beside the copies of a request that asks for it
# (kvlog.REFERENCE_PARAM: the bench's warm-up requests), at the cost of
# 4 x REFERENCE_ROUNDS more copies in its step; without it the ask does nothing
REFERENCE = os.environ.get("TRACT_CONNECTOR_REFERENCE") == "1"
# rounds of (memcpy, checksummed copy), each cold and warm, the reference times,
# interleaved: only a warm-up pays them, so enough for a median that one
# preemption does not move
REFERENCE_ROUNDS = 5

# CPU path: a step's commit (run off the step, on the save thread) starts this
# long after the step's copy, or at the next step's bind if that comes first.
# vLLM binds its CPU worker to its cores, and the save thread shares them: a
# commit started at once took the core and the GIL from the rest of the step
# (0.32 ms returning from wait_for_save and 0.36 ms more to the step's
# output, medians traced at 6000 tokens); by then the output has left.  A
# handoff's publish follows its commit: its decode instance, a request and a
# front end away, asks later than this (docs/VLLM.md, "Saves wait for the
# step's output").
COMMIT_DEFER_S = 0.003

# a step that saves nothing because its claim was late (claim_wait_s) logs at
# most this often
GAVE_UP_LOG_S = 10.0


def _described(saves: list, rest: int, block_tokens: int) -> Described:
    """The descriptions of a step's saves, in their keys' order, and REST rows
    not described (a handoff's blocks: in the pool already, or its tail)."""
    parts = [s.described if s.described is not None and len(s.described.records) == len(s.keys)
             else Described(np.zeros(len(s.keys), BLOCK_RECORD_DTYPE),
                            np.zeros((len(s.keys), block_tokens), np.uint32)) for s in saves]
    parts.append(Described(np.zeros(rest, BLOCK_RECORD_DTYPE),
                           np.zeros((rest, block_tokens), np.uint32)))
    return Described(np.concatenate([p.records for p in parts]),
                     np.vstack([p.token_ids for p in parts]))


@dataclass
class _SavePlan:
    keys: np.ndarray
    status: np.ndarray
    slots: np.ndarray
    tokens: np.ndarray
    pages: np.ndarray
    subs: np.ndarray
    mine: np.ndarray                  # indices this step claimed (and writes)
    described: Any = None             # core.events.Described of every key (KV events)
    # in-step handoffs: (spec, indices of its keys); their keys were claimed with
    # pins (pinned: the reserve pinned those READY already, the commit pins the rest)
    handoffs: list = field(default_factory=list)
    pinned: bool = False
    rows: dict = field(default_factory=dict)  # request id -> the rows of its blocks to save
    reference: set = field(default_factory=set)  # request ids that ask for the memcpy reference
    # the request ids of the in-step handoffs whose records this plan reserved
    reserved: set = field(default_factory=set)
    # the step's handoffs are published in it (SaveSpec.handoff_follows: handoff_
    # publish in_step): the step waits for the commit, and they are published into
    # records not reserved
    handoff_follows: bool = False
    # the step stopped waiting for that commit (past its bound): the save thread
    # publishes none of its unreserved handoffs after that (one whose publish
    # had begun stands: its blocks are READY, so a decode that opens it later
    # loads it, and one that found no record computed, leaving it to its TTL)
    step_gone: bool = False
    reserve_s: float = 0.0
    batch: Any = None                 # GPU path: the claimed blocks (gpupages._Batch)
    batch_rows: Any = None            # ... their rows (mine when the batch was made)
    batch_sums: Any = None            # ... their checksums, in batch_rows' order
    layers_done: set = field(default_factory=set)
    gpu_failed: bool = False          # GPU path: a layer's copy could not be queued
    copy_s: float = 0.0

    @property
    def commit_in_step(self) -> bool:
        """Whether the step waits for this plan's commit: its handoffs are
        published in it (handoff_publish in_step); otherwise an in-step
        handoff's record is reserved, and published after the commit, off the
        step."""
        return self.handoff_follows


@dataclass
class _GpuLoad:
    """A GPU load queued in start_load_kv, settled in wait_for_save."""
    spec: LoadSpec
    ticket: Ticket | None
    batch: Any                        # its blocks (checksummed by the checksum threads)
    started: float
    queue_s: float


class WorkerSide:
    """Data movement between vLLM's KV cache tensors and the pool (one per worker)."""

    def __init__(self, pool: "Pool", settings: "ConnectorSettings", vllm_config: "VllmConfig",
                 releases: Releases, timings: int):
        self.pool, self.settings, self._vllm_config = pool, settings, vllm_config
        self.releases, self._timings = releases, timings
        self.g = pool.geometry.block_tokens
        self.page_tokens = vllm_config.cache_config.block_size
        self.layout = None
        self._layers: dict[str, int] = {}
        self._paged: PagedKV | None = None      # the CPU path
        self._gpu: CudaPagedKV | None = None    # the GPU path
        self._gpu_loads: list[_GpuLoad] = []
        self._plan: _SavePlan | None = None
        # the saves' pool calls, in order on one thread: a step's reserve (during its
        # forward) and its commit (after its copy, off the step unless it publishes
        # a handoff), so a step's claims always follow the previous step's commit
        self._reserving: Future | None = None
        # the step's in-step handoffs' records reserved, queued right after its claim
        # (the GPU path's first layer waits for the claim alone)
        self._records: Future | None = None
        # a step waits for its claim (and its handoffs' records) until then:
        # claim_wait_s from its first wait, so a stalled lock manager costs the
        # engine's step that much, never step_timeout_s a lock
        self._claim_deadline: float | None = None
        # set once the claim of a step that did not wait for it is done and its
        # give-back queued; until then no step queues a claim
        self._late: threading.Event | None = None
        self._gave_up_said = Throttle(GAVE_UP_LOG_S)
        self._saver = ThreadPoolExecutor(1, thread_name_prefix="tract-save")
        # set when a deferred commit should start now (COMMIT_DEFER_S): the next
        # step's bind, or shutdown
        self._next_step = threading.Event()
        self._load_errors: set[int] = set()
        # loads run on one thread; what it finished waits here for get_finished
        self._loads: queue.Queue = queue.Queue()
        self._done_lock = threading.Lock()
        self._done: list[tuple[str, set]] = []
        self._loader: threading.Thread | None = None
        self._sync_loaded: set[str] = set()      # copied in this step (LoadSpec.sync)
        self._sync_failed: set[str] = set()      # ... of which a block failed

    # ---- start-up ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.model_executor.models.utils import extract_layer_index
        g = self.pool.geometry
        names = sorted(kv_caches, key=extract_layer_index)
        if len(names) != g.num_layers:
            raise ConnectorError(f"TraCT connector: vLLM registered {len(names)} KV cache layers, "
                                 f"the region holds {g.num_layers}",
                                 "format the region for this model (tract init --model DIR)")
        first = kv_caches[names[0]]
        for name in names:
            t = kv_caches[name]
            # a CPU layer is one contiguous tensor; vLLM 0.32's GPU views are
            # strided as its KV cache layout orders them (each alike)
            if (t.shape != first.shape or t.dtype != first.dtype or t.device != first.device
                    or (not t.is_contiguous() if t.device.type == "cpu"
                        else t.stride() != first.stride())):
                raise ConnectorError(f"TraCT connector: KV cache layer {name} differs from "
                                     f"{names[0]} ({list(t.shape)})",
                                     "serve a model whose attention layers are all alike")
        try:
            self.layout = engine_page_map(first, self.page_tokens, g, self._vllm_config,
                                          names[0])
            if first.device.type == "cpu":
                self._paged = PagedKV(self.pool, self.layout, [kv_caches[n] for n in names])
                self._warn_small_pages([kv_caches[n] for n in names])
            if first.device.type == "cuda":
                # the mapping registered once (cudaHostRegister): each layer moves by
                # DMA, with vLLM's batched copy straight between its pages and the
                # slots; without one, through a staging buffer of one step's blocks
                layer_bytes = self.pool.info.block_bytes // g.num_layers
                capacity = staging_capacity(
                    self._vllm_config.scheduler_config.max_num_batched_tokens,
                    g.block_tokens, layer_bytes)
                copy, why = gpu_batch_copy(self.settings.gpu_copy)
                forced = self.settings.gpu_copy == "direct"
                self._gpu = CudaPagedKV(self.pool, self.layout, [kv_caches[n] for n in names],
                                        capacity, batch_copy=copy,
                                        min_run_bytes=0 if forced else DIRECT_MIN_RUN_BYTES)
                if self._gpu.direct:
                    if why:        # forced on a CUDA that makes it a call a copy
                        log.warning("TraCT connector worker: %s", why)
                    log.info("TraCT connector worker: GPU DMA straight between vLLM's pages and "
                             "the region (vLLM's swap_blocks_batch), no GPU memory of its own")
                else:
                    if copy is not None:
                        why = (f"the page layout's runs are shorter than "
                               f"{DIRECT_MIN_RUN_BYTES} bytes (\"gpu_copy\": \"direct\" copies "
                               "them one by one anyway)")
                    say = log.info if self.settings.gpu_copy == "staging" else log.warning
                    say("TraCT connector worker: GPU DMA through %.1f MiB of staging (%d blocks "
                        "of a layer), beyond what vLLM profiled: %s",
                        self._gpu.gpu_bytes / 2**20, capacity, why)
        except TractError as exc:
            raise ConnectorError(f"TraCT connector: {exc.problem}", exc.fix) from None
        self._layers = {name: i for i, name in enumerate(names)}
        log.info("TraCT connector worker: KV pages of %d tokens, %d region block(s) a page, "
                 "%d run(s) a block's layer, %s order (%s)", self.page_tokens,
                 self.layout.blocks_per_page, self.layout.run_count // self.layout.blocks_per_page,
                 "the region's canonical" if self.layout.digest is None else "the engine's page",
                 f"C copy, checksummed as it copies: {checksum_path()}" if self._paged
                 else "GPU DMA, layer by layer, "
                 + ("direct" if self._gpu.direct else "through a staging buffer"))

    @staticmethod
    def _warn_small_pages(tensors: list) -> None:
        """Says so where vLLM's CPU KV cache is not in huge pages: each 4 KiB
        page a save or load meets then costs a page walk, which made the copy
        2-5x memcpy inside vLLM on a VM (docs/VLLM.md "The data path")."""
        try:
            share = huge_page_share(tensors)
        except Exception as exc:   # a report only: never a reason not to start
            log.warning("TraCT connector worker: could not read how vLLM's KV cache is "
                        "mapped: %s", exc)
            return
        if share is None:
            return
        if share >= 0.5:
            log.info("TraCT connector worker: %.0f%% of vLLM's KV cache in huge pages",
                     share * 100)
            return
        log.warning("TraCT connector worker: vLLM's KV cache is in 4 KiB pages (%.0f%% in huge "
                    "pages): every page a KV save or load touches costs a page walk. Start "
                    "vLLM with THP_MEM_ALLOC_ENABLE=1 (torch maps large CPU tensors in 2 MiB "
                    "pages; /sys/kernel/mm/transparent_hugepage/enabled must not be never)",
                    share * 100)

    def handshake(self) -> TractHandshake:
        digest = self.layout.digest if self.layout is not None else None
        return TractHandshake(layout=digest.hex() if digest else "")

    # ---- saves ----

    def bind(self, saves: list[SaveSpec]) -> None:
        """Claims the step's blocks to save, on the save thread during the
        forward (after the previous step's commit, if still queued): its lock
        round trips overlap the engine's compute instead of adding to the step
        (the CPU path needs the slots in wait_for_save, the GPU path at the first
        layer's save_layer)."""
        self._drop_pending_save("a step that never waited for its save")
        self._next_step.set()        # a commit still deferred starts: this step's claim follows it
        self._claim_deadline = None
        if not saves:
            return
        if self._late is not None and not self._late.is_set():
            # a claim a step did not wait for is still out (a stalled lock
            # manager): this step saves nothing rather than queue behind it,
            # and its handoffs are lost (their decodes compute; a paired one is
            # told by a record of no blocks, queued)
            self._said_gave_up("the save thread still waits for an earlier step's claim")
            self._handoffs_lost([s.handoff for s in saves if s.handoff is not None],
                                "the save thread still waits for an earlier step's claim")
            return
        self._late = None
        self._reserving = self._saver.submit(self._reserve, saves)
        # (a step that waits for its commit publishes its handoffs before its
        # output leaves: nothing to reserve)
        if any(s.handoff is not None for s in saves) and \
                not any(s.handoff_follows for s in saves):
            self._records = self._saver.submit(self._reserve_records, self._reserving)

    def _claim_wait(self) -> float:
        """What is left of the step's wait for its claim and its handoffs'
        records: claim_wait_s from the first time it waits.  A P/D prefill's
        step is no exception: a block not saved loses its handoff, and its
        decode computes, so a stalled lock manager delays the handoff, never
        the engine's step (docs/VLLM.md, "A step waits for its claim
        `claim_wait_s` at most, a P/D prefill's too")."""
        now = time.monotonic()
        if self._claim_deadline is None:
            self._claim_deadline = now + self.settings.claim_wait_s
        return max(0.0, self._claim_deadline - now)

    def _claimed(self) -> _SavePlan | None:
        """The step's save plan, waiting for its claim (the reserve, and the
        previous step's commit queued ahead of it, each wait at most
        step_timeout_s for a lock) claim_wait_s at most; None if none, it
        failed, or the step gave up on it."""
        if self._reserving is not None:
            reserving = self._reserving
            t0 = time.perf_counter()
            try:
                plan = reserving.result(timeout=self._claim_wait())
            except FutureTimeout:
                self._give_up()
                return None
            except Exception as exc:     # never into the engine: the blocks are not saved
                log.warning("TraCT reserve failed, the step's blocks are not saved: %s", exc)
                plan = None
            self._reserving = None
            if plan is not None:
                # what the step waited for: the part of the reserve the forward did not hide
                plan.reserve_s = time.perf_counter() - t0
            self._plan = plan
        return self._plan

    def _give_up(self, what: str = "its claim") -> None:
        """The step goes on without its save: WHAT (its claim, or its handoffs'
        records) not done within claim_wait_s.  What the claim takes is given
        back once it is done, and its handoffs' records (they are not
        published: their decodes compute); until then no step queues a claim
        (bind)."""
        wait_ms = self.settings.claim_wait_s * 1e3
        self._late = threading.Event()
        self._said_gave_up(f"{what} not done within {wait_ms:.0f} ms of the forward")
        self._drop_pending_save(f"the step did not wait {wait_ms:.0f} ms for {what}",
                                then=self._late.set)

    def _said_gave_up(self, why: str) -> None:
        """Says (at most every GAVE_UP_LOG_S) that a step saved nothing, and why."""
        if self._gave_up_said.due():
            log.warning("TraCT: a step's blocks are not saved, its step went on (%s: a stalled "
                        "lock manager? `tract inspect --locks`); said at most every %.0f s",
                        why, GAVE_UP_LOG_S)

    def _drop_pending_save(self, why: str, then=None) -> None:
        """Gives back, off the step, the claims of a save bound and never waited
        for (vLLM calls wait_for_save after every forward, so only a step that
        failed, one that gave up on its claim, or shutdown, leaves one): a claim
        left PENDING in a live process would stay so until it dies.  THEN is
        called once that is queued."""
        plan, self._plan = self._plan, None
        reserving, self._reserving = self._reserving, None
        records, self._records = self._records, None
        last = records or reserving           # the save thread's last job of the step
        if last is None:
            if plan is not None:
                self._abandon(plan, why)
            if then is not None:
                then()
            return

        def abandon_when_done(done: Future) -> None:
            # once the step's claim and its records' reservations are done (a
            # reservation made after an abandon would be given back by nobody)
            try:
                got = plan
                if got is None and reserving is not None and not reserving.cancelled() \
                        and reserving.exception() is None:
                    got = reserving.result()
                if got is not None:
                    self._abandon(got, why)
            finally:
                if then is not None:
                    then()
        last.add_done_callback(abandon_when_done)

    def _abandon(self, plan: _SavePlan, why: str) -> None:
        """The plan's claims given back off the step, retried until it succeeds,
        and the pins a pinning claim (an in-step handoff's) took or committed."""
        if plan.batch is not None:     # no DMA or write-back may still touch slots given back
            self._gpu.quiesce(plan.batch)
        self._handoffs_lost([spec for spec, _ in plan.handoffs], why, plan)
        self._unpin_handoff_keys(plan, np.arange(len(plan.keys)), why)
        if not plan.mine.size:
            return
        log.warning("TraCT: %d claimed blocks abandoned (%s)", plan.mine.size, why)
        self.releases.submit(
            f"abandon of {plan.mine.size} claimed blocks",
            lambda timeout: self.pool.index.commit(plan.keys, plan.status, plan.slots,
                                                   publish=False, timeout=timeout))

    def _drop_failed_loads(self, plan: _SavePlan, failed: set) -> None:
        """This step computed the requests FAILED on top of a synchronous load that
        failed (vLLM discards the step's output for them and recomputes): the
        blocks it computed for them are not saved (their claims given back) and
        their handoffs are not published.  (The scheduler counts those blocks as
        saved: they are computed again, and not saved again.)"""
        rows = [r for req in failed for r in plan.rows.get(req, ())]
        if rows:
            drop = np.intersect1d(np.concatenate(rows), plan.mine)
            if drop.size:
                plan.mine = np.setdiff1d(plan.mine, drop)
                self._abandon_claims(plan, drop, "computed on a load that failed")
        lost = [spec for spec, _ in plan.handoffs if spec.request_id in failed]
        if lost:
            self._handoffs_lost(lost, "its prompt was computed on a load that failed", plan)
            plan.handoffs = [(spec, idx) for spec, idx in plan.handoffs
                             if spec.request_id not in failed]

    def _handoffs_lost(self, handoffs: list, why: str, plan: _SavePlan | None = None,
                       tell_pair: bool = True) -> None:
        """HANDOFFS will not be published: said, and the records PLAN reserved
        for them given back (queued, retried), so their decode instances stop
        waiting once it is done (the release's defer, 50 ms) rather than at
        handoff_wait_s; a paired one's name then gets a record of no blocks
        (queued after it), so its paired decode, which has no ticket to find
        the record gone, computes at once rather than at pair_wait_s (not
        with TELL_PAIR False: its decode gave the reservation back, and
        computes already)."""
        for spec in handoffs:
            log.warning("TraCT handoff of request %s not published (%s), its decode computes "
                        "the prompt", spec.request_id, why)
            if plan is not None and spec.request_id in plan.reserved:
                plan.reserved.discard(spec.request_id)
                self.releases.submit(
                    f"reservation of handoff record {spec.record}",
                    lambda timeout, spec=spec: self.pool.handoffs.unreserve(
                        spec.record, spec.name, timeout=timeout))
            if spec.paired and tell_pair:
                queue_pair_lost(self.releases, self.pool, spec.name, spec.ttl_s, spec.request_id)

    def _abandon_claims(self, plan: _SavePlan, idx: np.ndarray, why: str) -> None:
        """Gives back (off the step) the claims IDX of PLAN that will not be
        written; they are then the plan's no more."""
        keys, status, slots = plan.keys[idx], plan.status[idx].copy(), plan.slots[idx]
        plan.status[idx] = PUT_NO_ROOM
        log.warning("TraCT: %d claimed blocks abandoned (%s)", len(idx), why)
        self.releases.submit(f"abandon of {len(idx)} claimed blocks",
                             lambda timeout: self.pool.index.commit(keys, status, slots,
                                                                    publish=False,
                                                                    timeout=timeout))

    def _unpin_handoff_keys(self, plan: _SavePlan, idx: np.ndarray, why: str) -> None:
        """Gives back (off the step) the pins a pinning claim holds on keys IDX of
        PLAN: those READY before it (pinned by the claim) and those its commit
        published (pinned by the commit)."""
        if not plan.pinned or not len(idx):
            return
        held = idx[np.isin(plan.status[idx], (PUT_WAS_READY, PUT_STORED))]
        if not held.size:
            return
        self._unpin_keys(plan.keys[held], why)

    def _reserve(self, saves: list[SaveSpec]) -> _SavePlan | None:
        """One reserve call for the step's blocks to save and the blocks of its
        in-step handoffs (duplicates within it once); with a handoff, a pinning
        one (each key pinned once: a block two handoffs share is pinned again
        for the second when it is published, `_publish_handoffs`)."""
        handoffs = [s.handoff for s in saves if s.handoff is not None]
        keys = np.vstack([s.keys for s in saves] + [h.keys for h in handoffs])
        saved = sum(len(s.keys) for s in saves)
        rest = len(keys) - saved              # a handoff's blocks: no pages to copy (-1)
        tokens = np.concatenate([s.tokens for s in saves] + [np.zeros(rest, np.uint32)])
        pages = np.concatenate([s.pages for s in saves] + [np.full(rest, -1, np.int64)])
        subs = np.concatenate([s.subs for s in saves] + [np.zeros(rest, np.int64)])
        described = _described(saves, len(keys) - saved, self.pool.geometry.block_tokens)
        # each key once, in order of first appearance; WHERE: the row each key went to
        _, first, inverse = np.unique(keys.view("V16").reshape(-1), return_index=True,
                                      return_inverse=True)
        order = np.argsort(first)
        row = np.empty(len(first), np.int64)
        row[order] = np.arange(len(first))
        where = row[inverse.reshape(-1)]
        first = first[order]
        keys, tokens, pages, subs = keys[first], tokens[first], pages[first], subs[first]
        described = Described(described.records[first], described.token_ids[first])
        t0 = time.perf_counter()
        try:
            status, slots = self.pool.index.reserve(keys, pin=bool(handoffs),
                                                    timeout=self.settings.step_timeout_s)
        except PoolFull:
            log.info("TraCT pool full: %d blocks not saved this step", len(keys))
            self._handoffs_lost(handoffs, "the pool is full")
            return None
        except TractError as exc:
            log.warning("TraCT reserve failed, %d blocks not saved: %s", len(keys), exc)
            self._handoffs_lost(handoffs, "its blocks' claim failed")
            return None
        claimed = status == PUT_CLAIMED
        mine = np.flatnonzero(claimed & (pages >= 0))
        plan = _SavePlan(keys, status, slots, tokens, pages, subs, mine, described,
                         pinned=bool(handoffs),
                         handoff_follows=any(s.handoff_follows for s in saves))
        plan.reserve_s = time.perf_counter() - t0
        at = 0
        for sv in saves:
            plan.rows.setdefault(sv.req_id, []).append(where[at:at + len(sv.keys)])
            at += len(sv.keys)
            if sv.reference:
                plan.reference.add(sv.req_id)
        for h in handoffs:
            plan.handoffs.append((h, where[at:at + len(h.keys)]))
            at += len(h.keys)
        orphans = np.flatnonzero(claimed & (pages < 0))
        if orphans.size:
            # a handoff's block saved by an earlier step and evicted since: claimed
            # here with nothing to write, so given back (its handoff is not published)
            self._abandon_claims(plan, orphans, "a handoff block no longer in the pool")
        return plan

    def _reserve_records(self, reserving: Future) -> None:
        """On the save thread, right after the step's claim (RESERVING, done by
        then): each in-step handoff's record reserved for its request, before
        the forward ends, so its ticket may leave with the step's output before
        the commit that publishes it (a decode that opens it meanwhile waits).
        A record that cannot be reserved (taken, a lock not granted): that
        handoff is not published, and its pins go back after the commit."""
        if reserving.cancelled() or reserving.exception() is not None:
            return
        plan = reserving.result()
        if plan is None:
            return
        kept = []
        for spec, idx in plan.handoffs:
            if not np.isin(plan.status[idx], (PUT_CLAIMED, PUT_WAS_READY)).all():
                # a block of it is another writer's, or no longer in the pool (given
                # back by the claim): never published, so its decode is told at once
                # (its pins go back with the others no record takes, after the commit)
                self._handoffs_lost([spec], "a block of it is not this step's to save")
                continue
            try:
                self.pool.handoffs.reserve_record(spec.record, spec.name, len(spec.keys),
                                                  spec.token_count, ttl=spec.ttl_s,
                                                  timeout=self.settings.step_timeout_s)
                plan.reserved.add(spec.request_id)
                kept.append((spec, idx))
            except Exception as exc:   # a pool error, or any other: the claims stand
                self._handoffs_lost([spec], "its record could not be reserved: "
                                    f"{getattr(exc, 'problem', exc)}")
        # only the reserved are published (read by the engine's thread once this job is done)
        plan.handoffs = kept

    def save_layer(self, layer_name: str, kv_layer: torch.Tensor) -> None:
        """GPU path: queues one layer's claimed blocks from vLLM's pages into
        their slots (DMA on the side stream, after the layer's attention)."""
        if self._gpu is None:
            return
        plan = self._claimed()
        if plan is not None:
            self._save_layer(plan, layer_name)

    def _save_layer(self, plan: _SavePlan, layer_name: str) -> None:
        layer = self._layers.get(layer_name)
        if not plan.mine.size or plan.gpu_failed or layer is None:
            return
        if layer != len(plan.layers_done):
            # each slot's checksum is carried from layer to layer, in order: a
            # layer out of order (or twice) leaves the step's blocks unsaved
            log.warning("TraCT: vLLM handed over layer %s out of order, the step's blocks "
                        "are not saved", layer_name)
            plan.gpu_failed = True
            return
        t0 = time.perf_counter()
        mine = plan.mine
        try:
            if plan.batch is None:
                # checksummed and written back by the checksum threads as each layer lands
                plan.batch = self._gpu.batch(plan.slots[mine], plan.pages[mine],
                                             plan.subs[mine], plan.tokens[mine], checksum=True)
                plan.batch_rows = mine.copy()
            self._gpu.save_layer(plan.batch, layer)
            plan.layers_done.add(layer)
        except Exception as exc:       # never into the engine: the blocks are not saved
            log.warning("TraCT save of layer %s failed, the step's blocks are not saved: %s",
                        layer_name, exc)
            plan.gpu_failed = True
        plan.copy_s += time.perf_counter() - t0

    def wait_for_save(self) -> None:
        self._settle_gpu_loads()
        failed, self._sync_failed = self._sync_failed, set()
        plan = self._claimed()
        if self._records is not None:
            # the reservations, queued after the claim (done during the forward
            # unless a lock was slow): made before the step's output, and its
            # ticket, leave; waited for within the claim's deadline, past which
            # the step goes on and its handoffs are lost (the decode that opens
            # a ticket's record not reserved computes at once)
            t0 = time.perf_counter()
            try:
                self._records.result(timeout=self._claim_wait())
            except FutureTimeout:
                if plan is not None and plan.batch is not None:
                    # on this thread, before the slots are given back: no DMA
                    # or write-back of the layers handed over may touch them
                    self._gpu.quiesce(plan.batch)
                    plan.batch = None
                self._give_up("its handoffs' records' reservation")
                return
            except Exception as exc:   # never into the engine (it logs its own errors)
                log.warning("TraCT: reserving the step's handoff records failed: %s", exc)
            self._records = None
            if plan is not None:
                plan.reserve_s += time.perf_counter() - t0
        self._plan = None
        if plan is None:
            return
        if self._gpu is not None and plan.mine.size and not plan.layers_done \
                and not plan.gpu_failed:
            # no layer handed over during the forward (a step vLLM replayed as one
            # FULL CUDA graph runs no attention wrapper): every layer now, after
            # the forward the engine's stream has queued
            for name in self._layers:        # in layer order
                self._save_layer(plan, name)
        if plan.batch is not None:
            # the DMA queued layer by layer and its checksums and write-back: done
            # before the slots are committed or (a failed load's) given back
            t0 = time.perf_counter()
            try:
                self._gpu.finish()
                plan.batch_sums = self._gpu.checksums(plan.batch)
            except Exception as exc:   # a CUDA error: nothing of this step is saved
                log.warning("TraCT save failed, the step's blocks are not saved: %s", exc)
                plan.gpu_failed = True
                self._gpu.quiesce(plan.batch)
            plan.copy_s += time.perf_counter() - t0
            if len(plan.layers_done) != len(self._layers) and not plan.gpu_failed:
                log.warning("TraCT: %d of %d layers handed over, the step's blocks are not "
                            "saved", len(plan.layers_done), len(self._layers))
        if failed:
            self._drop_failed_loads(plan, failed)
        plan.batch = None       # its DMA, checksums and write-back are done (above)
        try:
            sums, complete = self._copy(plan)
        except TractError as exc:
            self._abandon(plan, f"its copy failed: {exc}")
            return
        # the blocks are in their slots: vLLM may reuse its pages now, and the
        # commit that makes them READY runs on the save thread
        defer = COMMIT_DEFER_S if self._paged is not None and not plan.commit_in_step else 0.0
        if defer:
            self._next_step.clear()
        job = self._saver.submit(self._commit, plan, sums, complete, defer)
        if not plan.commit_in_step:
            return
        # handoffs published in the step (handoff_publish in_step) need the blocks
        # READY first: the step waits for its commit and their publish.  Nothing
        # is queued ahead of it (the step's claim,
        # which followed any earlier commit, is done): claim_wait_s at most, as
        # for its claim, not step_timeout_s a lock (the commit's, each in-step
        # handoff's publish)
        bound = self.settings.claim_wait_s
        try:
            job.result(timeout=bound)
        except FutureTimeout:
            plan.step_gone = True
            log.warning("TraCT: the commit of a step that publishes its handoffs in it "
                        "(handoff_publish in_step) not done within %.0f ms (claim_wait_s); "
                        "the step goes on, and its handoffs are not published (their "
                        "decodes compute)", bound * 1e3)

    def _copy(self, plan: _SavePlan) -> tuple[np.ndarray | None, bool]:
        """The step's claimed blocks copied from vLLM's pages (CPU path: one C call
        that checksums as it copies; GPU path: the DMA done, its checksums in
        PLAN): (the checksum of each key, 0 for the keys not copied; whether the
        blocks are all in, so the commit publishes them)."""
        mine = plan.mine
        if not mine.size:
            return None, True
        sums = np.zeros(len(plan.keys), np.uint32)
        if self._paged is not None:
            full = in_step_s = None
            if REFERENCE and plan.reference:
                # the blocks of the requests that ask for the reference; full blocks
                # only (a partial one's slot holds zeros past its tokens, which a
                # plain copy of the page would overwrite)
                asked = np.concatenate([r for req in plan.reference for r in plan.rows[req]])
                full = np.intersect1d(mine[plan.tokens[mine] == self.g], asked)
                _, in_step_s = self._memcpy_in_step("save", plan.slots[full],
                                                    plan.pages[full], plan.subs[full])
            t0 = time.perf_counter()
            # one C call: every layer of every claimed block, checksummed as it copies
            sums[mine] = self._paged.save(plan.slots[mine], plan.pages[mine], plan.subs[mine],
                                          plan.tokens[mine])
            plan.copy_s = time.perf_counter() - t0
            if full is not None:
                self._reference("save", plan.slots[full], plan.pages[full], plan.subs[full],
                                in_step_s=in_step_s)
            return sums, True
        if len(plan.layers_done) != len(self._layers) or plan.gpu_failed:
            return None, False
        sums[plan.batch_rows] = plan.batch_sums      # the CPU's CRC-32C of what the DMA wrote
        return sums, True

    def _commit(self, plan: _SavePlan, sums: np.ndarray | None, complete: bool,
                defer: float = 0.0) -> None:
        """On the save thread: `_commit_plan`, whose errors never reach vLLM's
        step nor go unseen (a job whose future nobody waits for would drop them),
        after waiting DEFER seconds at most once started (COMMIT_DEFER_S: the
        next step's bind or shutdown ends the wait)."""
        if defer:
            self._next_step.wait(defer)
        try:
            self._commit_plan(plan, sums, complete)
        except Exception:              # a bug, not a pool error: said, never raised
            log.exception("TraCT: a save's commit or publish failed; what it claimed or "
                          "pinned may stay so until this process ends, and is then given back")

    def _commit_plan(self, plan: _SavePlan, sums: np.ndarray | None, complete: bool) -> None:
        """Commits the step's copied blocks (READY; not COMPLETE: given back) and
        publishes its in-step handoffs, with the pins the claim and commit took.
        The commit waits at most step_timeout_s for a lock; a failure gives the
        claims back, off this thread, retried until it succeeds (the blocks are
        not saved; vLLM computes them as ever)."""
        mine = plan.mine
        t1 = time.perf_counter()
        try:
            if mine.size or not plan.handoffs:
                self.pool.index.commit(plan.keys, plan.status, plan.slots, publish=complete,
                                       pin=plan.pinned and complete, tokens=plan.tokens,
                                       described=plan.described,
                                       checksums=sums if self.settings.checksums else None,
                                       # the CPU path's copy streams; the GPU's
                                       # checksum threads wrote every layer back
                                       streamed=self._paged is not None or complete,
                                       timeout=self.settings.step_timeout_s)
        except Exception as exc:      # never lost on this thread: the claims given back
            self._abandon(plan, f"its commit failed: {exc}")
            return
        commit_s = time.perf_counter() - t1
        if mine.size:
            log.log(self._timings, kvlog.SAVED, mine.size, mine.size * self.pool.info.block_bytes,
                    (plan.reserve_s + plan.copy_s + commit_s) * 1e3, plan.copy_s * 1e3,
                    (plan.reserve_s + commit_s) * 1e3, plan.reserve_s * 1e3, commit_s * 1e3,
                    kvlog.IN_STEP if plan.commit_in_step else kvlog.OFF_STEP)
        if plan.pinned:
            self._publish_handoffs(plan, complete)

    def _publish_handoffs(self, plan: _SavePlan, complete: bool) -> None:
        """Publishes the step's in-step handoffs (their blocks are in now), each in
        the record its ticket already names, with the pins the save's claim and
        commit took; pins no handoff took over are given back off the step.  A
        record holds one pin of each of its blocks, and the claim took one: a
        block an earlier handoff of the step has that pin for (two prompts with
        a prefix in common) is pinned again for the next, by a lookup (a walk
        of its stripes' locks, off the step unless the step waits for this
        publish), before any is published, while the claim's pins still hold
        every block.  A handoff that cannot be published is not: its decode
        instance finds no record for the ticket and computes the prompt."""
        kept = np.zeros(len(plan.keys), bool)
        ready: list = []      # (spec, its rows, reserved, rows pinned again, their keys)
        try:
            taken = np.zeros(len(plan.keys), bool)
            for spec, idx in plan.handoffs:
                reserved = spec.request_id in plan.reserved
                if not (reserved or plan.handoff_follows):
                    continue          # its record was not reserved (said then): not published
                if plan.step_gone and not reserved:
                    # the step stopped waiting (its bound passed): its reply may have
                    # left, and a decode that found no record computed the prompt; a
                    # record published now would only hold pins until it expired
                    self._handoffs_lost([spec], "its step stopped waiting for the commit")
                    continue
                if not (complete and np.isin(plan.status[idx], (PUT_WAS_READY, PUT_STORED)).all()):
                    self._handoffs_lost([spec], "a block of it was not saved", plan)
                    continue
                shared = taken[idx]           # the claim's pin is an earlier handoff's
                extra = None
                if shared.any():
                    extra = self._pin_again(spec, plan.keys[idx[shared]], plan)
                    if extra is False:
                        continue              # said, and lost
                taken[idx] = True
                ready.append((spec, idx, reserved, shared, extra))
            while ready:
                spec, idx, reserved, shared, extra = ready[0]
                t0 = time.perf_counter()
                try:
                    self.pool.handoffs.publish_pinned(spec.record, spec.name, spec.keys,
                                                      spec.token_count, ttl=spec.ttl_s,
                                                      timeout=self.settings.step_timeout_s,
                                                      reserved=reserved)
                except Exception as exc:      # a pool error, or any other: not published
                    ready.pop(0)
                    if extra is not None:
                        self._unpin_keys(extra, "a handoff not published")
                    self._handoffs_lost([spec], f"its publish failed: {exc}", plan,
                                        tell_pair=not isinstance(exc, ReservationGone))
                    continue
                ready.pop(0)
                kept[idx[~shared]] = True     # the claim's pins it took over
                plan.reserved.discard(spec.request_id)
                log.log(self._timings, kvlog.PUBLISHED, spec.request_id, len(spec.keys),
                        (time.perf_counter() - t0) * 1e3)
        finally:       # whatever happened above, the pins no record took are given back
            for spec, _, _, _, extra in ready:         # left by an error above (a bug)
                if extra is not None:
                    self._unpin_keys(extra, "a handoff not published")
                self._handoffs_lost([spec], "its publish was not reached", plan)
            self._unpin_handoff_keys(plan, np.flatnonzero(~kept), "not a published handoff's")

    def _pin_again(self, spec, keys: np.ndarray, plan: _SavePlan):
        """One more pin of each of KEYS (blocks of SPEC's handoff whose claim pin
        an earlier handoff of PLAN's step has), for SPEC's record: the keys
        pinned, or False where they could not all be (a lock not granted, a
        block gone: the handoff is lost, said, its reservation given back, and
        what was pinned given back)."""
        try:
            got = self.pool.index.lookup(keys, timeout=self.settings.step_timeout_s)
        except Exception as exc:      # a pool error, or any other: nothing pinned
            self._handoffs_lost([spec], "its blocks shared with another handoff could not be "
                                f"pinned for it: {getattr(exc, 'problem', exc)}", plan)
            return False
        if got.hits < len(keys):
            self._unpin_keys(keys[:got.hits], "a handoff not published")
            self._handoffs_lost([spec], "a block it shares with another handoff is no longer "
                                "in the pool", plan)
            return False
        return keys

    def _unpin_keys(self, keys: np.ndarray, why: str) -> None:
        """Gives back one pin of each of KEYS, off the step (queued, retried)."""
        if not len(keys):
            return
        done = np.zeros(len(keys), np.uint8)
        log.info("TraCT: %d handoff pins given back (%s)", len(keys), why)
        self.releases.submit(f"unpin of {len(keys)} blocks",
                             lambda timeout: self.pool.index.unpin(keys, timeout=timeout,
                                                                   done=done))

    def _memcpy_in_step(self, kind: str, slots, pages, subs) -> tuple[float, float | None]:
        """With TRACT_CONNECTOR_REFERENCE=1, for a request that asks for the
        reference: a plain memcpy of the same bytes between the same buffers where
        the copy runs, right before it (a save's right after its forward, a
        load's right after its acquire), so that it meets what the copy meets:
        translations and caches a forward that streamed the model and the KV
        cache left behind.  The memcpy in the step: the reference the copy is
        held to (docs/VLLM.md "The data path").  A save's stores go into slots
        still claimed, which the checksummed save right after overwrites with
        streaming stores; a load's into the pages the load right after writes
        with the same bytes.  (The seconds it took, kept off the copy's and the
        load's or save's logged times; the same as its time, or None: not asked, or it failed,
        said, and the copy goes on.)"""
        if not REFERENCE or not len(slots):
            return 0.0, None
        t0 = time.perf_counter()
        try:
            getattr(self._paged, kind)(slots, pages, subs, checksum=False)
        except TractError as exc:
            log.warning("TraCT reference copy (TRACT_CONNECTOR_REFERENCE) failed: %s", exc)
            return time.perf_counter() - t0, None
        took = time.perf_counter() - t0
        return took, took

    def _reference(self, kind: str, slots, pages, subs, crcs=None,
                   in_step_s: float | None = None) -> float:
        """With TRACT_CONNECTOR_REFERENCE=1 (`tract bench --engine vllm`), for a request
        that asks for it (kvlog.REFERENCE_PARAM): a plain memcpy of the same
        bytes between the same buffers, right after the real copy, and the real
        (checksummed) copy once more, each timed twice a round: from cold caches
        (every line of the slots and pages evicted first) and warm (right after
        the same kind of copy), REFERENCE_ROUNDS rounds interleaved, their
        medians logged (a cold time 0: this CPU cannot evict, not timed) beside
        IN_STEP_S (`_memcpy_in_step`; 0: not timed): the references the copy is
        measured against.  Both write the bytes the copy
        just wrote (a save's into slots still claimed, before the commit, the
        last write of each round a checksummed save with streaming stores; a
        load's while its pins or handoff still hold the slots, and every copy's
        checksums must equal the first's, CRCS).  Returns the seconds it took
        (kept out of the copy's own timing)."""
        if not REFERENCE or not len(slots):
            return 0.0
        copy = getattr(self._paged, kind)
        start = time.perf_counter()
        cold_ok = True
        # a save's slots hold a memcpy's plain stores (in this host's cache,
        # which the commit does not write back) until a checksummed save
        # streams them again, or they are written back below
        dirty = False
        # [memcpy cold, memcpy warm, copy cold, copy warm] per round: each warm
        # one right after its own kind (a save's streaming stores leave no line
        # of the slots in the cache, a memcpy's plain stores leave them dirty)
        times = [[], [], [], []]
        try:
            for _ in range(REFERENCE_ROUNDS):
                for i, (cold, checksum) in enumerate(((True, False), (False, False),
                                                      (True, True), (False, True))):
                    if cold and cold_ok:
                        try:
                            self._paged.evict(slots, pages, subs)
                        except FlushModeError:      # no flush instruction: warm only
                            cold_ok = False
                    dirty = dirty or (kind == "save" and not checksum)
                    t0 = time.perf_counter()
                    sums = copy(slots, pages, subs, checksum=checksum)
                    if not cold or cold_ok:
                        times[i].append(time.perf_counter() - t0)
                    dirty = dirty and not checksum
                    if checksum and crcs is not None and not np.array_equal(sums, crcs):
                        # at once: the load fails (its caller's) and vLLM recomputes it
                        raise ReferenceMismatch("the reference copy read other bytes than the "
                                                "load", "report it: the slots changed under "
                                                "a held pin")
        except ReferenceMismatch:
            raise
        except TractError as exc:
            log.warning("TraCT reference copy (TRACT_CONNECTOR_REFERENCE) failed: %s", exc)
            return time.perf_counter() - start
        finally:
            if dirty:
                # a memcpy's stores are the last in the slots: on the device before
                # the commit (a CPU that cannot evict runs flush mode none only)
                with contextlib.suppress(TractError):
                    self._paged.evict(slots, pages, subs)
        log.info(kvlog.REFERENCE, kind, len(slots), (in_step_s or 0.0) * 1e3,
                 *(float(np.median(times[i])) * 1e3 if times[i] else 0.0 for i in (0, 1, 2, 3)))
        return time.perf_counter() - start

    # ---- loads ----

    def start_loads(self, loads: list[LoadSpec], whole: bool = False) -> None:
        """Synchronous loads are copied here, before the step's forward, which
        computes the rest of their prompts; asynchronous ones go to the loader
        thread.  On a GPU every load is queued here, layer by layer, and settled
        in wait_for_save; vLLM's stream waits for every layer at once where the
        step writes into a loaded block (a synchronous load past_end) or calls
        no wait_for_layer_load (WHOLE: a step replayed as one CUDA graph)."""
        if not loads:
            return
        if self._gpu is not None:
            for spec in loads:
                self._start_gpu_load(spec)
            # a synchronous load whose last block holds positions this step
            # computes (past_end: the prompt's last token, a partial tail): vLLM
            # writes their KV on its stream before the layer's
            # wait_for_layer_load, so that write must come after the DMA, or
            # the DMA may land over it
            if whole or any(spec.sync and spec.past_end for spec in loads):
                self._gpu.wait_all()
            return
        later = []
        for spec in loads:
            if not spec.sync and self._paged is not None:
                later.append(spec)
                continue
            try:
                bad = self._load(spec)
            except Exception as exc:      # never into the engine: recomputed
                log.warning("TraCT load of request %s failed, vLLM recomputes it: %s",
                            spec.req_id, exc)
                bad = set(np.unique(spec.pages).tolist())
            self._report(spec, bad)
        if not later:
            return
        if self._loader is None:
            self._loader = threading.Thread(target=self._load_loop, name="tract-loads",
                                            daemon=True)
            self._loader.start()
        for spec in later:
            self._loads.put(spec)

    def _report(self, spec: LoadSpec, bad: set) -> None:
        """A load copied in this step: a synchronous one reported with the step's
        output (worker_meta), an asynchronous one by get_finished; then its
        handoff's acknowledgement is queued."""
        if spec.sync:
            self._sync_loaded.add(spec.req_id)
            self._load_errors |= bad
            if bad:               # what this step computes on it is not saved
                self._sync_failed.add(spec.req_id)
        else:
            self._finish(spec.req_id, bad)
        if spec.ticket is not None:
            self._queue_ack(spec)

    def _start_gpu_load(self, spec: LoadSpec) -> None:
        """GPU path: queues the request's blocks into its pages (every layer, by
        DMA on the side stream) and checksums the slots on the CPU while the DMA
        runs; the verdict waits for _settle_gpu_loads."""
        t0 = time.perf_counter()
        ticket = Ticket.from_dict(spec.ticket) if spec.ticket is not None else None
        try:
            self._check_still_published(ticket, spec.req_id)
            self.pool.acquire_payload(spec.slots, spec.tags)
            batch = self._gpu.batch(spec.slots, spec.pages, spec.subs,
                                    checksum=self.settings.checksums)
            self._gpu.load(batch)         # and its checksums, on the checksum threads
            queued = time.perf_counter() - t0
        except Exception as exc:      # a pool or a CUDA error: recomputed, never fatal
            log.warning("TraCT load of request %s failed, vLLM recomputes it: %s", spec.req_id,
                        exc)
            try:                      # nothing of it may land on the pages vLLM recomputes
                self._gpu.finish()
            except Exception:         # a CUDA error: nothing more runs on the stream
                pass
            self._report(spec, {int(p) for p in np.unique(spec.pages)})
            return
        self._gpu_loads.append(_GpuLoad(spec, ticket, batch, t0, queued))

    def _settle_gpu_loads(self) -> None:
        """GPU path: waits for the loads queued this step, then judges each (its
        checksums; a handoff's record still published after the copy) and
        reports it, before the step's output is asked for."""
        loads, self._gpu_loads = self._gpu_loads, []
        if not loads:
            return
        t0 = time.perf_counter()
        try:
            self._gpu.finish()
            broken = None
        except Exception as exc:      # a CUDA error: every load of the step recomputed
            broken = exc
        wait_s = time.perf_counter() - t0
        for load in loads:
            spec, n = load.spec, len(load.spec.slots)
            sums, failed = None, broken
            try:
                sums = self._gpu.checksums(load.batch)
            except Exception as exc:  # the blocks cannot be vouched for: recomputed
                failed = failed or exc
            valid = 0 if failed is not None else n
            if failed is not None:
                log.warning("TraCT load of request %s failed, vLLM recomputes it: %s",
                            spec.req_id, failed)
            if valid and sums is not None:
                bad = np.flatnonzero((spec.checksums != 0) & (sums != spec.checksums))
                if bad.size:
                    valid = int(bad[0])
                    log.warning("TraCT: block %d of request %s fails its checksum; vLLM "
                                "recomputes from there", valid, spec.req_id)
            if load.ticket is not None:
                try:
                    published = self.pool.handoffs.still_published(load.ticket)
                except TractError:
                    published = False
                if not published:
                    log.warning("TraCT handoff %d of request %s was released during its "
                                "load: vLLM recomputes it", load.ticket.record, spec.req_id)
                    valid = 0
                    try:
                        self.pool.forget_payload(spec.slots)
                    except TractError as exc:
                        log.warning("TraCT payload ledger not updated: %s", exc)
            bad_pages = {int(p) for p in np.unique(spec.pages[valid:])} if valid < n else set()
            total = time.perf_counter() - load.started
            # copy: queueing it and the wait for its DMA (the checksum ran meanwhile)
            copy_s = load.queue_s + wait_s
            log.log(self._timings, kvlog.LOADED, valid, valid * self.pool.info.block_bytes,
                    spec.req_id, total * 1e3, copy_s * 1e3, (total - copy_s) * 1e3)
            self._report(spec, bad_pages)

    def wait_layer(self, layer_name: str) -> None:
        """GPU path: vLLM's stream waits for this layer of the step's loads."""
        if self._gpu is not None:
            layer = self._layers.get(layer_name)
            if layer is not None:
                self._gpu.wait_layer(layer)

    def _load_loop(self) -> None:
        while True:
            spec = self._loads.get()
            if spec is None:
                return
            bad = set(int(p) for p in np.unique(spec.pages))    # if _load itself failed
            try:
                bad = self._load(spec)
            except Exception as exc:      # never kill the loader: later loads wait on it
                log.warning("TraCT load of request %s failed, vLLM recomputes it: %s",
                            spec.req_id, exc)
            finally:
                self._finish(spec.req_id, bad)
            # the handoff's acknowledgement once the request is reported (its copy
            # was proven by still_published): queued, off this thread, so the next
            # load never waits behind it
            if spec.ticket is not None:
                self._queue_ack(spec)

    def _finish(self, req_id: str, bad_pages: set) -> None:
        with self._done_lock:
            self._done.append((req_id, bad_pages))

    def _check_still_published(self, ticket: Ticket | None, req_id: str) -> None:
        """Before a handoff's copy: HandoffGone if its record was released since
        the scheduler opened it (whose slots the load names), so nothing is
        copied.  A look at the record's state, no lock: reading the record and
        its key list again cost 80-170 µs a load inside a busy instance; the
        same look after the copy is what proves the copy."""
        if ticket is not None and not self.pool.handoffs.still_published(ticket):
            raise HandoffGone(f"handoff record {ticket.record} of request {req_id} was "
                              "released before its load", "vLLM recomputes it")

    def _load(self, spec: LoadSpec) -> set:
        """Copies one request's blocks into vLLM's pages (all layers); the vLLM
        pages to recompute (from the first bad block on).  A handoff's copy
        stands if its record is still published after it (observed without a
        lock: no release of the slots can have preceded the copy); its
        acknowledgement follows (the caller's, after reporting the load)."""
        n = len(spec.slots)
        valid = n
        t0 = time.perf_counter()
        copy_s = reference_s = 0.0
        ticket = Ticket.from_dict(spec.ticket) if spec.ticket is not None else None
        try:
            self._check_still_published(ticket, spec.req_id)
            self.pool.acquire_payload(spec.slots, spec.tags)
            # off the load's time
            reference_s, in_step_s = (
                self._memcpy_in_step("load", spec.slots, spec.pages, spec.subs)
                if spec.reference else (0.0, None))
            t1 = time.perf_counter()
            crcs = self._paged.load(spec.slots, spec.pages, spec.subs)
            copy_s = time.perf_counter() - t1
            if self.settings.checksums:
                bad = np.flatnonzero((spec.checksums != 0) & (crcs != spec.checksums))
                if bad.size:
                    valid = int(bad[0])
                    log.warning("TraCT: block %d of request %s fails its checksum; vLLM "
                                "recomputes from there", valid, spec.req_id)
            if valid == n and spec.reference:
                # while the pins or the record still hold the slots (before the
                # check below), and off the load's time
                reference_s += self._reference("load", spec.slots, spec.pages, spec.subs,
                                               crcs, in_step_s=in_step_s)
            if ticket is not None and not self.pool.handoffs.still_published(ticket):
                # expired and reclaimed (or acknowledged by another) meanwhile: its
                # slots may have been reused under the copy, whose lines this host
                # may cache: the node's payload ledger stops vouching for them now
                log.warning("TraCT handoff %d of request %s was released during its load: "
                            "vLLM recomputes it", ticket.record, spec.req_id)
                valid = 0
                self.pool.forget_payload(spec.slots)
        except Exception as exc:      # a pool or a torch error: recomputed, never fatal
            log.warning("TraCT load of request %s failed, vLLM recomputes it: %s", spec.req_id,
                        exc)
            valid = 0
        bad_pages = {int(p) for p in np.unique(spec.pages[valid:])} if valid < n else set()
        total = time.perf_counter() - t0 - reference_s
        log.log(self._timings, kvlog.LOADED, valid, valid * self.pool.info.block_bytes,
                spec.req_id, total * 1e3, copy_s * 1e3, (total - copy_s) * 1e3)
        return bad_pages

    def _queue_ack(self, spec: LoadSpec) -> None:
        """Queues the acknowledgement of the handoff SPEC loaded from (its load
        stands or was refused already: this only gives the pins and slots back),
        tried on the releases thread until it succeeds."""
        try:
            queue_ack(self.releases, self.pool, Ticket.from_dict(spec.ticket), spec.slots)
        except Exception as exc:      # never into the loader or the step: the record expires
            log.warning("TraCT acknowledgement of request %s not queued: %s", spec.req_id, exc)

    def finished(self) -> set[str] | None:
        """The requests whose loads finished since the last call; their bad pages
        go to `load_errors` (asked right after, in the same step's output)."""
        # GPU loads are settled before any of the step's output is asked for:
        # with speculative decoding vLLM asks before wait_for_save
        self._settle_gpu_loads()
        with self._done_lock:
            done, self._done = self._done, []
        for _, bad in done:
            self._load_errors |= bad
        return {req_id for req_id, _ in done} or None

    def load_errors(self) -> set[int]:
        self._settle_gpu_loads()
        errors, self._load_errors = self._load_errors, set()
        return errors

    def worker_meta(self) -> TractWorkerMeta | None:
        """The requests whose synchronous loads this step copied (asked after
        load_errors, in the same step's output)."""
        self._settle_gpu_loads()
        if not self._sync_loaded:
            return None
        loaded, self._sync_loaded = self._sync_loaded, set()
        return TractWorkerMeta(loaded)

    def shutdown(self) -> None:
        """Gives back the claims of a save bound and never waited for, waits for
        the save thread's queued commits and any reserve in flight (each bounded
        by step_timeout_s a lock), then stops the loader:
        loads not started are dropped, the one running is waited for (it writes
        into vLLM's tensors, which must outlive it; it waits for no lock)."""
        self._drop_pending_save("shutdown")
        self._next_step.set()                # a deferred commit starts now
        self._saver.shutdown(wait=True)      # the commits queued done first
        if self._gpu is not None:      # the DMA in flight done, the mapping unregistered
            self._settle_gpu_loads()      # their acknowledgements queued
            self._gpu.close()
        if self._loader is None:
            return
        while True:
            try:
                self._loads.get_nowait()
            except queue.Empty:
                break
        self._loads.put(None)
        self._loader.join()
