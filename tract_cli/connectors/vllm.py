"""TraCT as a vLLM KV connector: P/D handoffs and a rack-wide prefix cache.

Loaded by vLLM out of tree:

    --kv-transfer-config '{"kv_connector": "TractConnector",
        "kv_connector_module_path": "tract_cli.connectors.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"pool": "/dev/shm/tract.pool", "node": 1}}'

(`recompute`: a block that fails its checksum is computed, not the request
failed, which is vLLM's default, `fail`; said at start where it is not set.)

vLLM makes one connector per role: the *scheduler* side (in the engine core)
decides what to load and save (`vllm_scheduler.SchedulerSide`), the *worker*
side (next to the KV cache) moves bytes (`vllm_worker.WorkerSide`); this class
is the face vLLM loads, and hands each call to its half.  Both attach the
region as the configured node (one `Pool` per process).  docs/VLLM.md is the
user's guide; the lifecycle in short:

- **Layout** (worker, `register_kv_caches`): the attention backend's page
  layout is measured and handed to the scheduler through vLLM's handshake;
  region blocks hold each page's bytes in the page's own order, and the
  layout enters every key, so instances of one layout share blocks and
  another layout never misreads them (core/kvpages.py).
- **Lookup** (scheduler, `get_num_new_matched_tokens`): a prompt's chained
  block keys are computed in one C call; a request carrying a TraCT handoff
  (`kv_transfer_params.tract_ticket`, from a prefill instance) opens the
  handoff record (metadata only, no lock); any other is one lookup+pin of its
  keys on the scheduler half's lookup thread ("not yet" to vLLM while it
  runs).  Pins are held only by the scheduler process that took them.
- **Load** (worker, `start_load_kv`): the slots are copied into vLLM's
  pages by one C call that checksums as it copies, the GIL released: with
  `load_mode` sync (the default) in the step, before the forward that
  computes the rest of the prompt; with async on the worker's loader thread,
  while the engine steps on.  A bad block is reported through
  `get_block_ids_with_load_errors` and vLLM recomputes from there.  A
  handoff is acknowledged once its bytes are in vLLM's pages; prefix pins are
  given back by the scheduler when the worker reports the load finished.
- **Save** (worker, `wait_for_save`): during the forward, one reserve call
  on the save thread claims the step's new full blocks (keys already in the pool are skipped);
  after it, one C call copies every layer of them from vLLM's pages into the
  claimed slots, checksumming as it copies, and one commit publishes them
  READY, on the worker's save thread, off the step (a P/D prefill's last
  step too: its handoff's record is reserved in the step, published after
  the commit).  A full pool skips the save (vLLM computes as ever; nothing
  is an error to the user).
- **Handoff** (a `do_remote_decode` request): the step that completes its
  prompt saves its blocks, and its partial tail block (stored under a key of
  its own), and reserves the handoff record the scheduler chose, which the
  save thread publishes with the save's pins after the commit;
  `request_finished` returns its ticket with no pool call.  The returned
  `kv_transfer_params` follow NixlConnector's protocol (`do_remote_prefill`)
  and add `tract_ticket`, so vLLM's proxy, Dynamo and llm-d pass them on
  unchanged.  vLLM's own blocks are freed at once: the pool has the bytes.
"""
from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorHandshakeMetadata,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorWorkerMetadata)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from tract_cli.connectors.retry import RELEASE_DEFER_S, Releases
from tract_cli.connectors.settings import ConnectorSettings
from tract_cli.connectors.vllm_meta import (LoadSpec, SaveSpec, TractConnectorMetadata,
                                            TractHandshake)
from tract_cli.connectors.vllm_scheduler import PARAMS_KEY, SchedulerSide
from tract_cli.connectors.vllm_setup import (ConnectorError, check_engine_geometry,
                                             check_kv_cache_groups, served_identity, shared_pool)
from tract_cli.connectors.vllm_worker import WorkerSide
from tract_cli.core.errors import TractError

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

__all__ = ["LoadSpec", "PARAMS_KEY", "SaveSpec", "TractConnector", "TractConnectorMetadata",
           "TractHandshake"]

# a child of vLLM's logger: our lines appear in its log, in its format
log = logging.getLogger("vllm.tract")

# TRACT_CONNECTOR_TIMINGS=1: one INFO line per load, per save and per handoff
# publish with its time
# (what `tract bench --engine vllm` reads); otherwise those lines are DEBUG
TIMINGS = logging.INFO if os.environ.get("TRACT_CONNECTOR_TIMINGS") == "1" else logging.DEBUG


class TractConnector(KVConnectorBase_V1):
    """vLLM KV connector over a TraCT region (see the module docstring)."""

    _cache_hit_source = CacheHitSource.HOST

    @classmethod
    def requires_piecewise_for_cudagraph(cls, extra_config: dict[str, Any]) -> bool:
        """Yes: on a GPU the connector moves KV layer by layer (save_kv_layer,
        wait_for_layer_load), which a FULL CUDA graph's replay skips; and vLLM
        0.32's model runner calls start_load_kv outside the replay's forward
        context, so the connector cannot see that a step replays FULL and wait
        for every layer instead.  vLLM then captures PIECEWISE graphs."""
        return True

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
        if role == KVConnectorRole.SCHEDULER and \
                getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("TraCT connector: kv_load_failure_policy is %r, so a pool block that "
                        "fails its checksum, or a handoff released during its load, fails "
                        "its request instead of being computed; set \"kv_load_failure_policy\""
                        ": \"recompute\" in --kv-transfer-config", ktc.kv_load_failure_policy)
        self.releases = Releases(self.settings.lookup_timeout_s, defer=RELEASE_DEFER_S)
        self.scheduler_side: SchedulerSide | None = None
        self.worker_side: WorkerSide | None = None
        if role == KVConnectorRole.SCHEDULER:
            self.scheduler_side = SchedulerSide(self.pool, self.settings, vllm_config,
                                                self.identity, self.releases, ktc.engine_id,
                                                lambda: self._kv_cache_manager)
        else:
            self.worker_side = WorkerSide(self.pool, self.settings, vllm_config, self.releases,
                                          TIMINGS)
        log.info("TraCT connector (%s, %s): region %s node %d, %s, %d-token blocks, vLLM block "
                 "%d, accessors %s, model identity %s (%d weight files, %d tensors, %.0f ms)",
                 role.name.lower(), ktc.kv_role, self.settings.pool, self.settings.node,
                 self.pool.info.model_name, self.pool.geometry.block_tokens,
                 vllm_config.cache_config.block_size, self.pool.accessors,
                 self.identity.short(), self.identity.weight_files, self.identity.tensors,
                 self.identity.seconds * 1e3)

    @property
    def key_tag(self) -> bytes | None:
        """The 16 bytes in every key of this instance (model and page layout), once
        the scheduler half knows the worker's layout."""
        return self.scheduler_side.key_tag if self.scheduler_side else None

    # ---- scheduler side ----

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]
                                    ) -> None:
        layouts = {m.layout for m in metadata.values() if isinstance(m, TractHandshake)}
        if self.scheduler_side is not None and layouts:
            try:
                self.scheduler_side.set_layout(layouts)
            except TractError as exc:
                raise ConnectorError(f"TraCT connector: {exc.problem}", exc.fix) from None

    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.scheduler_side.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int):
        self.scheduler_side.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        return self.scheduler_side.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput"):
        self.scheduler_side.update_connector_output(connector_output)

    def request_finished(self, request: "Request",
                         block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        return self.scheduler_side.request_finished(request, block_ids)

    def reset_cache(self) -> bool | None:
        # the region is the rack's, never reset by one instance; after vLLM's
        # reset (and its AllBlocksCleared) the region's blocks are told again
        if self.scheduler_side is not None:
            self.scheduler_side.retell_events()
        return None

    def take_events(self):
        # the region's blocks this instance can load, told next to vLLM's own
        # pages in its KV event stream (connectors/vllm_events.py)
        return self.scheduler_side.take_events() if self.scheduler_side is not None else ()

    # ---- worker side ----

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]):
        self.worker_side.register_kv_caches(kv_caches)

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        return self.worker_side.handshake() if self.worker_side else None

    def bind_connector_metadata(self, connector_metadata: KVConnectorMetadata) -> None:
        super().bind_connector_metadata(connector_metadata)
        if self.worker_side is not None:
            saves = (connector_metadata.saves
                     if isinstance(connector_metadata, TractConnectorMetadata) else [])
            self.worker_side.bind(saves)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._connector_metadata
        if isinstance(meta, TractConnectorMetadata):
            # a FULL CUDA graph's replay runs no attention wrapper, so no
            # wait_for_layer_load: the step's stream then waits for every layer
            # (vLLM captures only PIECEWISE graphs beside this connector:
            # requires_piecewise_for_cudagraph; kept for a runner that still
            # says FULL here)
            mode = getattr(forward_context, "cudagraph_runtime_mode", None)
            self.worker_side.start_loads(meta.loads,
                                         whole=getattr(mode, "name", "") == "FULL")

    def wait_for_layer_load(self, layer_name: str) -> None:
        # on the CPU a synchronous load was copied in start_load_kv, before the
        # forward, an asynchronous one before the request was scheduled; on a GPU
        # the layer's DMA, queued in start_load_kv, is waited for by its stream
        if self.worker_side is not None:
            self.worker_side.wait_layer(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata,
                      **kwargs: Any) -> None:
        self.worker_side.save_layer(layer_name, kv_layer)

    def wait_for_save(self):
        self.worker_side.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        return None, self.worker_side.finished()

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self.worker_side.load_errors()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        return self.worker_side.worker_meta() if self.worker_side is not None else None

    def shutdown(self):
        if self.scheduler_side is not None:
            self.scheduler_side.shutdown()
        if self.worker_side is not None:
            self.worker_side.shutdown()
        self.releases.close(timeout=max(5.0, 2 * self.settings.lookup_timeout_s))  # logs the rest
