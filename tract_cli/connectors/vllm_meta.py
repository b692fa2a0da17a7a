"""What the two halves of the vLLM connector tell each other: the scheduler's
plan for a step (loads and saves, `TractConnectorMetadata`, sent with each
step), the synchronous loads the worker did in it (`TractWorkerMeta`, back
with the step's output) and the worker's page layout (`TractHandshake`, sent once at start-up
through vLLM's handshake, before any request: the scheduler's keys carry it).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tract_cli.core.events import Described
from tract_cli.core.handoff import named_by_pair
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorHandshakeMetadata,
                                                               KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)


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
    sync: bool = False         # copied in the step, before its forward (load_mode sync)
    reference: bool = False    # time a memcpy beside its copy (kvlog.REFERENCE_PARAM)
    # its last block holds positions past what vLLM was told it loads (the
    # prompt's last token, a partial tail), which the same step computes and
    # writes: on a GPU the step's writes must come after the load's DMA
    past_end: bool = False


@dataclass
class HandoffSpec:
    """Publish the request's P/D handoff after the step that completes its
    prompt: every block of it (KEYS, the ones this step saves and those already
    in the pool) pinned by the save's own claim and commit, in RECORD, which the
    scheduler chose and has already promised in the request's ticket; the
    record is reserved with the claim, in the step, and published after the
    commit, off it (a decode that opens it first is told to wait)."""

    record: int
    request_id: str            # vLLM's request id
    keys: np.ndarray           # (n, 16) uint8: all the prompt's blocks, the tail last
    token_count: int           # the prompt's tokens
    ttl_s: float
    # the 16 bytes the record is named by (core.handoff.request_key of vLLM's
    # request id, or pair_key of the pair a paired decode finds it by)
    name: bytes

    @property
    def paired(self) -> bool:
        """Whether a paired decode finds the record by its name (it has no ticket)."""
        return named_by_pair(self.name, self.request_id)


@dataclass
class SaveSpec:
    """Write the request's region blocks KEYS (from vLLM pages) into the pool,
    and publish its handoff (HANDOFF) once they and the others are in."""

    req_id: str
    keys: np.ndarray           # (n, 16) uint8
    tokens: np.ndarray         # uint32 tokens of each block (g, or fewer for a partial tail)
    pages: np.ndarray
    subs: np.ndarray
    handoff: HandoffSpec | None = None
    # HANDOFF is published in the step (handoff_publish in_step), so the step
    # waits for the commit that makes its blocks READY and for that publish.
    # Otherwise a HANDOFF's record is reserved in the step and published after
    # the commit, off the step, as every other step's commit runs
    handoff_follows: bool = False
    # what the blocks' records say (core.events.describe: KV events); None: the
    # keys alone
    described: Described | None = None
    reference: bool = False    # time a memcpy beside its copy (kvlog.REFERENCE_PARAM)


@dataclass
class TractConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


@dataclass
class TractWorkerMeta(KVConnectorWorkerMetadata):
    """The worker's word to the scheduler after a step: the requests whose
    synchronous loads (LoadSpec.sync) it copied in that step (their pages that
    failed go with the step's invalid_block_ids, as an asynchronous load's),
    so the scheduler gives their pins back.  Asynchronous loads are reported
    through get_finished instead: vLLM expects those only for requests waiting
    for remote KV."""

    loaded: set = field(default_factory=set)

    def aggregate(self, other: "KVConnectorWorkerMetadata") -> "KVConnectorWorkerMetadata":
        if isinstance(other, TractWorkerMeta):
            return TractWorkerMeta(self.loaded | other.loaded)
        return self


@dataclass
class TractHandshake(KVConnectorHandshakeMetadata):
    """The worker's KV page layout digest (hex; "" for the region's canonical
    order): the scheduler mixes it into every key it computes."""

    layout: str
