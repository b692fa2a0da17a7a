"""vLLM's KV event wire format, for `tract events --zmq`: a router that is not a
vLLM instance (or an operator's tool) subscribes to the region's stream as it
subscribes to a vLLM instance's.

The structs mirror vllm.distributed.kv_events (vLLM 0.32): a `KVEventBatch`
(an array: ts, events, data_parallel_rank) of tagged `BlockStored` /
`BlockRemoved` maps, msgpack-encoded, sent on a ZMQ PUB socket as three
frames (topic, an 8-byte big-endian sequence number, the payload), as vLLM's
`ZmqEventPublisher` sends them.  tests/test_vllm.py decodes this stream with
vLLM's own classes.  (Mirrored, not imported: `tract` does not depend on
vLLM.)
"""
from __future__ import annotations

import time
from typing import Any

import msgspec
import zmq

from tract_cli.core.errors import UsageError


class _Event(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class BlockStored(_Event):
    block_hashes: list[Any]
    parent_block_hash: Any
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[Any] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class BlockRemoved(_Event):
    block_hashes: list[Any]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[BlockStored | BlockRemoved]
    data_parallel_rank: int | None = None


CLASSES = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved}


class ZmqPublisher:
    """A PUB socket (an XPUB: it also hears subscriptions) bound to ENDPOINT,
    sending batches as vLLM does.  A PUB socket drops what it sent before a
    subscriber joined, so `joined()` says when one did: the caller tells it
    the whole state again (what vLLM's replay endpoint is for, without a
    bounded buffer to fall out of)."""

    def __init__(self, endpoint: str, topic: str = ""):
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.XPUB)
        self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)     # every subscription, not the first only
        self._sock.set_hwm(100_000)
        try:
            self._sock.bind(endpoint)
        except zmq.ZMQError as exc:
            self.close()
            raise UsageError(f"cannot bind the ZMQ endpoint {endpoint}: {exc}",
                             "pass a free endpoint, e.g. --zmq tcp://*:5557") from None
        self.endpoint = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self._topic = topic.encode()
        self._seq = 0
        self._enc = msgspec.msgpack.Encoder()

    def joined(self) -> bool:
        """Whether a subscriber subscribed since the last call."""
        joined = False
        while self._sock.poll(0):
            msg = self._sock.recv()
            joined |= bool(msg) and msg[0] == 1
        return joined

    def publish(self, events: list[tuple[str, dict]]) -> None:
        if not events:
            return
        batch = KVEventBatch(ts=time.time(), events=[CLASSES[k](**f) for k, f in events])
        self._sock.send_multipart((self._topic, self._seq.to_bytes(8, "big"),
                                   self._enc.encode(batch)))
        self._seq += 1

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()
