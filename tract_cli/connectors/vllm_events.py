"""The region's blocks in vLLM's own KV event stream (docs/VLLM.md, "KV events
for routers").

When vLLM publishes KV events (`--kv-events-config`), the scheduler half of
the connector tails the region's event logs on a thread of its own
(`core.events.Tail`) and vLLM's scheduler takes the changes from it every
step (`take_events`), so each instance tells the router, next to its own
pages, every region block it can load: blocks of its model and page layout
(the key tag), whoever wrote them, stored when they turn READY and removed
when the pool evicts them.  What is published:

- `block_hashes`: each block's hash as the region's scheme made it, untagged:
  on the vLLM scheme (`tract init --hash-scheme vllm`) and with the region's
  block size equal to vLLM's, vLLM's own hashes; converted as vLLM converts
  its own (`VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`);
- `parent_block_hash`, `token_ids`, `block_size` (the region's block tokens);
- `medium` (`kv_events_medium`, "CPU" by default: the region is memory the
  CPUs address, and every router of today knows the name), `ownership`
  (`kv_events_ownership`: "tract:<region uuid>" by default, "" for none),
  `locality` (LOCAL for blocks this node wrote, REMOTE for the others;
  `kv_events_locality: false` leaves it out).
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from vllm import envs
from vllm.distributed.kv_events import BlockRemoved, BlockStored

from tract_cli.core.events import Tail, event_fields

if TYPE_CHECKING:
    from tract_cli.connectors.settings import ConnectorSettings
    from tract_cli.core.pool import Pool

log = logging.getLogger("vllm.tract")


def wanted(vllm_config, settings: "ConnectorSettings") -> bool:
    """Whether this instance publishes the region's blocks: vLLM publishes KV
    events and the connector's `kv_events` is not false."""
    cfg = getattr(vllm_config, "kv_events_config", None)
    return bool(settings.kv_events and cfg is not None and cfg.enable_kv_cache_events)


class RegionEvents:
    """The region's block changes as vLLM KV events, for one instance."""

    def __init__(self, pool: "Pool", settings: "ConnectorSettings", key_tag: bytes,
                 page_tokens: int, hash_algo: str):
        self.settings = settings
        self.block_size = pool.geometry.block_tokens
        self.medium = settings.kv_events_medium
        own = settings.kv_events_ownership
        self.ownership = (f"tract:{pool.info.uuid}" if own is None else own) or None
        self._tail = Tail(pool, key_tag, settings.node, settings.kv_events_interval_s)
        self._error_logged = False
        if self.block_size != page_tokens:
            log.warning("TraCT KV events: the region's blocks are %d tokens, vLLM's %d: a "
                        "router that hashes vLLM's block size (Dynamo's) does not match them "
                        "(docs/VLLM.md, \"KV events for routers\")", self.block_size, page_tokens)
        if pool.info.hash_scheme != "vllm" or hash_algo != "sha256_cbor":
            log.warning("TraCT KV events: the region's block hashes are not vLLM's own (region "
                        "scheme %s, vLLM --prefix-caching-hash-algo %s; vLLM's need `tract init "
                        "--hash-scheme vllm` and sha256_cbor): a router must match the events' "
                        "token_ids (docs/VLLM.md, \"KV events for routers\")",
                        pool.info.hash_scheme, hash_algo)
        log.info("TraCT KV events: publishing the region's blocks of key tag %s (medium %s, "
                 "ownership %s)", key_tag.hex(), self.medium, self.ownership)

    def take(self) -> list:
        """vLLM events for the changes since the last take (never waits)."""
        error = self._tail.error
        if error is not None and not self._error_logged:
            self._error_logged = True
            log.warning("TraCT KV events: reading the region's event logs failed (tried again "
                        "from a snapshot every second until it works): %s", error)
        elif error is None and self._error_logged:
            self._error_logged = False
            log.info("TraCT KV events: reading the region's event logs again")
        try:
            out = []
            for change in self._tail.take():
                kind, fields = event_fields(change, block_size=self.block_size,
                                            medium=self.medium, ownership=self.ownership,
                                            locality=self.settings.kv_events_locality,
                                            int_hashes=envs.VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
                out.append((BlockStored if kind == "BlockStored" else BlockRemoved)(**fields))
            return out
        except Exception as exc:     # the engine's step never fails for an event
            log.warning("TraCT KV events: changes not told (told again from the region): %s",
                        exc)
            self._tail.retell()
            return []

    def retell(self) -> None:
        self._tail.retell()

    def close(self) -> None:
        self._tail.close()
