"""A KV event subscriber as a router runs one (run with vLLM's python): a ZMQ SUB
socket on ENDPOINT, decoding every batch with vLLM's own `KVEventBatch`, and
with REPLAY (a publisher's replay endpoint, or "-") the batches published
before it connected, asked for from sequence 0 as vLLM's protocol has it.
Writes one JSON object a line to OUT (hashes as vLLM decoded them: ints, or
bytes as hex), `{"connected": true}` first once its socket is connected, and
exits when its stdin closes or after LIMIT_S seconds.

    python kv_event_subscriber.py ENDPOINT REPLAY|- OUT LIMIT_S
"""
from __future__ import annotations

import json
import select
import sys
import time

import msgspec
import zmq
from vllm.distributed.kv_events import KVEventBatch

END_SEQ = (-1).to_bytes(8, "big", signed=True)


def _plain(value):
    if isinstance(value, bytes):
        return value.hex()
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def main() -> None:
    endpoint, replay, out_path, limit = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    ctx = zmq.Context()
    sub = ctx.socket(zmq.SUB)
    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    seen: set[int] = set()
    deadline = time.monotonic() + limit
    with open(out_path, "w") as out:
        def emit(seq_bytes: bytes, payload: bytes) -> None:
            seq = int.from_bytes(seq_bytes, "big")
            if seq in seen:
                return
            seen.add(seq)
            batch = decoder.decode(payload)
            for ev in batch.events:
                row = {"seq": seq, "type": type(ev).__name__}
                row.update({k: _plain(v) for k, v in msgspec.structs.asdict(ev).items()})
                out.write(json.dumps(row) + "\n")
            out.flush()

        # connected (the subscription goes out with the handshake) before anything
        # is asked for again or waited for
        if not monitor.poll(int(limit * 1000)):
            raise SystemExit(f"no connection to {endpoint} within {limit} s")
        monitor.recv_multipart()
        out.write(json.dumps({"connected": True}) + "\n")
        out.flush()
        if replay != "-":
            dealer = ctx.socket(zmq.DEALER)
            dealer.connect(replay)
            dealer.send_multipart((b"", (0).to_bytes(8, "big")))
            while time.monotonic() < deadline and dealer.poll(int(limit * 1000)):
                frames = dealer.recv_multipart()
                _, _topic, seq_bytes, payload = frames
                if seq_bytes == END_SEQ:
                    break
                emit(seq_bytes, payload)
            dealer.close(linger=0)
        while time.monotonic() < deadline:
            if select.select([sys.stdin], [], [], 0)[0] and not sys.stdin.read(1):
                break           # the test closed our stdin: done
            if sub.poll(100):
                _topic, seq_bytes, payload = sub.recv_multipart()
                emit(seq_bytes, payload)
    sub.disable_monitor()
    monitor.close(linger=0)
    sub.close(linger=0)
    ctx.term()          # (returns at once: every socket is closed, none lingers)


if __name__ == "__main__":
    main()
