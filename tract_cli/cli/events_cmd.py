"""`tract events POOL`: the region's KV events, printed or served over ZMQ in
vLLM's wire format (docs/VLLM.md, "KV events for routers")."""
from __future__ import annotations

import json
import signal
import sys

import typer

from tract_cli.cli import render
from tract_cli.core.agent_launch import AgentWatch, start_node_agent
from tract_cli.core.errors import TractError, UsageError
from tract_cli.core.events import RETRY_S, Change, Feed, RegionView, event_fields
from tract_cli.core.pool import Pool
from tract_cli.core.stopflag import StopFlag

HASH_FORMATS = ("int", "bytes")


def _tag(value: str | None) -> bytes | None:
    if value is None:
        return None
    try:
        tag = bytes.fromhex(value)
    except ValueError:
        tag = b""
    if len(tag) != 16:
        raise UsageError(f"--tag {value!r} is not 32 hex digits",
                         "pass the key tag a TraCT connector logs at start "
                         "(\"publishing the region's blocks of key tag ...\")")
    return tag


def _line(change: Change, kind: str, fields: dict, tag: bool) -> dict:
    out = {"type": kind, **fields}
    if "parent_block_hash" in out and isinstance(out["parent_block_hash"], bytes):
        out["parent_block_hash"] = out["parent_block_hash"].hex()
    out["block_hashes"] = [h.hex() if isinstance(h, bytes) else h for h in out["block_hashes"]]
    out["nodes"] = sorted({b.node for b in change.blocks})
    if tag:
        out["tags"] = sorted({b.tag.hex() for b in change.blocks})
    return out


def events(
    pool: str = typer.Argument(..., help="Region file or /dev/daxX.Y."),
    node: int = typer.Option(0, "--node", help="The node this command attaches as: blocks it "
                             "wrote are LOCAL, the others REMOTE."),
    tag: str = typer.Option(None, "--tag", help="Only blocks of this key tag (32 hex digits: "
                            "one model and page layout; the connector logs it at start)."),
    zmq_endpoint: str = typer.Option(None, "--zmq", help="Serve the stream on a ZMQ PUB socket "
                                     "as vLLM does (e.g. tcp://*:5557) instead of printing it."),
    topic: str = typer.Option("", "--topic", help="The ZMQ topic frame (with --zmq)."),
    once: bool = typer.Option(False, "--once", help="The blocks the region holds now, as "
                              "stored events, then exit."),
    json_out: bool = typer.Option(False, "--json", help="One JSON object a line."),
    interval: float = typer.Option(0.05, "--interval", help="Seconds between reads of the "
                                   "event logs."),
    medium: str = typer.Option("CPU", "--medium", help="The events' medium."),
    ownership: str = typer.Option(None, "--ownership", help="The events' ownership "
                                  "(default tract:<region uuid>; \"\" for none)."),
    locality: bool = typer.Option(True, "--locality/--no-locality", help="LOCAL/REMOTE by "
                                  "the block's writer node."),
    hash_format: str = typer.Option("int", "--hash-format", help="Block hashes as vLLM's "
                                    "default int (last 8 bytes) or as bytes."),
    start_agent: bool = typer.Option(True, "--start-agent/--no-start-agent",
                                     help="Start the node's agent if none runs."),
) -> None:
    """The region's blocks as KV events: stored when they turn READY, removed when
    evicted, whoever wrote them, for routers and operators."""
    if not interval > 0 or interval > 60:
        raise UsageError("--interval must be in (0, 60] seconds", "e.g. --interval 0.05")
    if hash_format not in HASH_FORMATS:
        raise UsageError(f"--hash-format {hash_format!r} is unknown", "use int or bytes")
    if once and zmq_endpoint:
        raise UsageError("--once prints; --zmq serves", "drop one of them")
    if not medium or len(medium) > 256:
        raise UsageError("--medium must be 1 to 256 characters", "e.g. --medium CPU")
    for name, value in (("--ownership", ownership), ("--topic", topic)):
        if value is not None and len(value) > 256:
            raise UsageError(f"{name} must be at most 256 characters", f"shorten {name}")
    want = _tag(tag)
    if zmq_endpoint and want is None:
        # one model's blocks: another model's hashes of the same tokens are the same
        # (vLLM's), so a router told both would credit the wrong instances
        raise UsageError("--zmq serves one model's blocks: --tag is missing",
                         "pass --tag (`tract events POOL --once --json` lists the tags)")
    if start_agent:
        start_node_agent(pool, node)
        watch = AgentWatch(pool, node)
    else:
        watch = None
    publisher = None
    stop = StopFlag()
    old = {s: signal.signal(s, stop.request) for s in (signal.SIGINT, signal.SIGTERM)}
    try:
        with Pool.attach(pool, node=node) as p:
            own = f"tract:{p.info.uuid}" if ownership is None else (ownership or None)
            bt = p.geometry.block_tokens
            view = RegionView(p, want)
            feed = Feed(view, node)
            if zmq_endpoint:
                from tract_cli.serve.kv_events import ZmqPublisher
                publisher = ZmqPublisher(zmq_endpoint, topic)
                print(f"tract events: serving {pool}'s KV events on {publisher.endpoint}"
                      f"{' topic ' + repr(topic) if topic else ''}; Ctrl-C to stop",
                      file=sys.stderr, flush=True)
            while True:
                batch = []
                if publisher is not None and publisher.joined():
                    feed.retell()          # a new subscriber gets the whole state
                for change in feed.take(wait_parents=not once):
                    kind, fields = event_fields(change, block_size=bt, medium=medium,
                                                ownership=own, locality=locality,
                                                int_hashes=hash_format == "int")
                    if publisher is not None:
                        batch.append((kind, fields))
                    elif json_out:
                        print(json.dumps(_line(change, kind, fields, want is None)), flush=True)
                    else:
                        render.stdout.print(_human(change, fields, want is None))
                if publisher is not None:
                    publisher.publish(batch)
                if once or stop.wait(interval):
                    break
                try:
                    feed.note(view.poll())
                except TractError as exc:
                    # (a snapshot's lock wait timed out, ...): the stream goes on
                    # from a fresh snapshot, the difference told
                    print(f"tract events: reading the event logs failed ({exc.problem}); "
                          "taking the region from a snapshot again", file=sys.stderr, flush=True)
                    if stop.wait(RETRY_S):
                        break
                    try:
                        view = RegionView(p, want)
                    except TractError:
                        continue      # tried again at the next round
                    feed.reattach(view)
    finally:
        for s, h in old.items():
            signal.signal(s, h)
        if publisher is not None:
            publisher.close()
        if watch is not None:
            watch.stop()


def _human(change: Change, fields: dict, tag: bool) -> str:
    n = len(change.blocks)
    first = fields["block_hashes"][0]
    first = first.hex()[:16] if isinstance(first, bytes) else f"{first:016x}"
    where = "LOCAL" if change.local else "REMOTE"
    nodes = ",".join(str(x) for x in sorted({b.node for b in change.blocks}))
    line = (f"{change.kind:7} {n:4} block{'s' if n != 1 else ' '} from {first}  node {nodes} "
            f"{where}")
    if change.kind == "stored":
        line += f"  {len(fields['token_ids'])} tokens"
    if tag:
        line += "  tag " + ",".join(sorted({b.tag.hex()[:16] for b in change.blocks}))
    return line
