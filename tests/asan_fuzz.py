"""Fuzzing the C core with corrupted regions, meant to run under
AddressSanitizer (tests/test_asan_fuzz.py builds the core with
-fsanitize=address and runs this with libasan preloaded).

A region is formatted and populated once (blocks with checksums, handoffs
with tails, named objects); each case restores it, corrupts one part of it
as a buggy host could — header fields (with the checksum recomputed, so the
layout check must catch the lie), the layout table, index buckets, pin
counts, LRU anchors, transfer records, handoff key lists, the object
directory, the allocator's bitmap and owner map — then attaches (with the
lock manager running in this process) and drives every path that reads
what another host wrote: lookup and read, handoff open and copy, object
get, evict, put, reclaim, dead-process recovery, `tract check`. Each must
end in a result or a TractError: a crash, an ASan report or any other
exception fails the run.

    python tests/asan_fuzz.py --cases 300 --seed 1      (prints a JSON summary)
"""
from __future__ import annotations

import argparse
import glob
import json
import mmap
import os
import struct
import sys
import time
import traceback
import uuid
import zlib

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from format_reader import CRC_OFFSET  # noqa: E402
from tract_cli.core.agent import Agent  # noqa: E402
from tract_cli.core.errors import TractError  # noqa: E402
from tract_cli.core.events import RegionView, describe  # noqa: E402
from tract_cli.core.hashing import block_hashes, pool_root  # noqa: E402
from tract_cli.core.pool import Pool  # noqa: E402
from tract_cli.core.recovery import recover_dead_processes  # noqa: E402
from tract_cli.inspect import check  # noqa: E402

T = 0.2          # lock timeouts: a corrupted lock table must not stall the run


def chain(pool: Pool, seed: int, blocks: int) -> np.ndarray:
    bt = pool.info.geometry.block_tokens
    tokens = np.random.default_rng(seed).integers(0, 50000, blocks * bt).astype(np.int32)
    return block_hashes(tokens, root=pool_root(pool.info))


def populate(path: str) -> list:
    """Blocks, handoffs and objects in a fresh region; returns the tickets."""
    agent = Agent(path, 0, manager=True).start()
    tickets = []
    try:
        with Pool.attach(path, node=1) as p:
            bb = p.info.block_bytes
            bt = p.info.geometry.block_tokens
            for s in range(6):
                keys = chain(p, s, 6 + s)
                toks = np.random.default_rng(s).integers(0, 50000, len(keys) * bt)
                p.index.put(keys, np.full((len(keys), bb), s + 1, np.uint8), checksum=True,
                            described=describe(keys, toks, bt, b"fuzz-model-tag-1"))
                if s < 3:
                    t = p.handoffs.publish(f"r{s}", keys, len(keys) * 16 + 3,
                                           tail=np.full(bb, 7, np.uint8), tail_tokens=3, ttl=3600)
                    tickets.append(t)
            slot = int(p.allocator.alloc(1)[0])
            p.objects.put("fuzz-root", p.slot_offset(slot), bb)
    finally:
        agent.stop()
    return tickets


def regions_of(path: str) -> dict:
    with Pool.attach(path, readonly=True, prefault=False, local=False) as p:
        out = {s.name: (s.offset, s.length, s.entry_size or 1) for s in p.info.sections}
        out["data"] = (p.info.section("data").offset, p.info.section("data").length,
                       p.info.slot_stride)
    return out


def with_crc(page: bytearray) -> None:
    struct.pack_into("<I", page, CRC_OFFSET, zlib.crc32(bytes(page[:CRC_OFFSET])))


def corrupt(buf: bytearray, areas: dict, rng) -> str:
    """Corrupts one area of the region image in place; returns its name."""
    area = rng.choice(["header", "layout", "buckets", "pins", "lru", "transfer", "keylist",
                       "objdir", "bitmap", "owners", "locks", "nodes", "alloc", "events",
                       "records"])
    if area in ("header", "layout"):
        page = bytearray(buf[:4096])
        lo, hi = (0x08, 0x100) if area == "header" else (0x100, 0x300)
        for _ in range(rng.integers(1, 5)):
            off = int(rng.integers(lo, hi))
            page[off:off + 4] = rng.integers(0, 256, 4, dtype=np.uint8).tobytes()
        if rng.random() < 0.7:              # a consistent lie: the checksum recomputed
            with_crc(page)
        buf[:4096] = page
        return area
    if area == "keylist":                   # the contents of handoff key-list slots
        off, length, stride = areas["data"]
        for _ in range(rng.integers(1, 8)):
            at = off + int(rng.integers(0, length // 64)) * 64 + int(rng.integers(0, 64)) // 4 * 4
            buf[at:at + 4] = rng.integers(0, 2**32, dtype=np.uint64).astype("<u4").tobytes()
        return area
    off, length, stride = areas[area]
    for _ in range(rng.integers(1, 12)):
        at = off + int(rng.integers(0, max(length - 8, 1)))
        value = rng.choice([0, 1, 0xFFFFFFFF, 0x7FFFFFFF, int(rng.integers(0, 2**32))])
        width = int(rng.choice([1, 2, 4, 8]))
        buf[at:at + width] = int(value).to_bytes(8, "little")[:width]
    return area


def drive(path: str, tickets: list, rng) -> dict:
    """Every read path over the (corrupted) region; counts of outcomes."""
    seen = {"attached": 0, "refused": 0, "tract_errors": 0, "ops": 0}
    try:
        agent = Agent(path, 0, manager=True, heartbeat_s=0.05).start()
    except TractError:
        seen["refused"] += 1
        return seen
    seen["attached"] += 1
    try:
        with Pool.attach(path, node=1) as p:
            bb = p.info.block_bytes
            ops = [
                lambda: p.index.read(h := p.index.lookup(chain(p, int(rng.integers(0, 6)), 8),
                                                         timeout=T),
                                     np.empty((h.hits, bb), np.uint8)),
                lambda: [p.handoffs.copy_blocks(rec := p.handoffs.open(t),
                                                np.empty((len(rec.slots), bb), np.uint8))
                         for t in tickets],
                lambda: [p.handoffs.copy_tail(p.handoffs.open(t), np.empty(bb, np.uint8))
                         for t in tickets],
                lambda: p.objects.get("fuzz-root"),
                lambda: p.index.evict(int(rng.integers(1, 20)), timeout=T),
                lambda: p.index.put(chain(p, 100 + int(rng.integers(0, 9)), 4),
                                    np.zeros((4, bb), np.uint8), timeout=T),
                lambda: p.handoffs.reclaim(now_ns=time.time_ns() + 10**13, timeout=T),
                lambda: p.handoffs.recover(timeout=T),
                lambda: recover_dead_processes(p, timeout=T),
                lambda: p.allocator.free(p.allocator.alloc(3, timeout=T), timeout=T),
                lambda: check.verify(p, data=True),
                # KV events: the logs and records read (snapshot, then the logs)
                lambda: RegionView(p, None).poll(),
            ]
            for i in rng.permutation(len(ops)):
                seen["ops"] += 1
                try:
                    ops[i]()
                except TractError:
                    seen["tract_errors"] += 1
    except TractError:
        seen["refused"] += 1
    finally:
        agent.stop()
    return seen


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=300)
    ap.add_argument("--seed", type=int, default=1)
    a = ap.parse_args()
    rng = np.random.default_rng(a.seed)
    # the nodes' local segments in a folder of this run's own (a corrupted
    # header makes segments under UUIDs nobody else would clean up)
    import tempfile
    seg_dir = tempfile.mkdtemp(prefix="tract-fuzz-local-", dir="/dev/shm")
    os.environ["TRACT_LOCAL_DIR"] = seg_dir
    path = f"/dev/shm/tract-asan-fuzz-{uuid.uuid4().hex[:8]}.pool"
    Pool.create(path, 4 << 20, "tiny", nodes=2, index_stripes=4).close()
    summary = {"cases": 0, "attached": 0, "refused": 0, "tract_errors": 0, "ops": 0,
               "by_area": {}, "failures": []}
    try:
        tickets = populate(path)
        areas = regions_of(path)
        with open(path, "rb") as f:
            pristine = f.read()
        fd = os.open(path, os.O_RDWR)
        mm = mmap.mmap(fd, len(pristine))
        os.close(fd)
        for case in range(a.cases):
            summary["cases"] += 1
            img = bytearray(pristine)
            area = corrupt(img, areas, rng)
            mm[:] = img
            summary["by_area"][area] = summary["by_area"].get(area, 0) + 1
            try:
                seen = drive(path, tickets, rng)
            except Exception:                       # anything but a TractError: a bug
                summary["failures"].append({"case": case, "area": area,
                                            "error": traceback.format_exc()[-1500:]})
                continue
            for k, v in seen.items():
                summary[k] += v
            # the nodes' DRAM state belongs to the image just replaced (and a
            # corrupted UUID makes segments of its own)
            for seg in glob.glob(os.path.join(seg_dir, "tract-*.local")):
                os.unlink(seg)
        mm.close()
    finally:
        import shutil
        from tract_cli.core.region import remove_region
        remove_region(path)
        shutil.rmtree(seg_dir, ignore_errors=True)
    import tract_cli._native
    summary["core"] = tract_cli._native.__file__
    print(json.dumps(summary, indent=2))
    return 1 if summary["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
