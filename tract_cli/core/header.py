"""The region header as a Python value: what `tract info` prints and what
attach checks a caller's expectations against (docs/FORMAT.md §3)."""
from __future__ import annotations

import uuid as uuidlib
from dataclasses import asdict, dataclass

from tract_cli.core.geometry import DTYPE_NAMES, Geometry
from tract_cli.core.native import FLUSH_MODE_NAMES, ffi, lib

SECTION_NAMES = {
    lib.TRACT_SEC_LOCKS: "locks", lib.TRACT_SEC_NODES: "nodes", lib.TRACT_SEC_OBJDIR: "objdir",
    lib.TRACT_SEC_ALLOC: "alloc", lib.TRACT_SEC_BITMAP: "bitmap", lib.TRACT_SEC_OWNERS: "owners",
    lib.TRACT_SEC_BUCKETS: "buckets", lib.TRACT_SEC_PINS: "pins", lib.TRACT_SEC_LRU: "lru",
    lib.TRACT_SEC_TRANSFER: "transfer", lib.TRACT_SEC_DATA: "data",
    lib.TRACT_SEC_EVENTS: "events", lib.TRACT_SEC_RECORDS: "records",
}
HASH_SCHEMES = {"tract": lib.TRACT_HASH_TRACT, "vllm": lib.TRACT_HASH_VLLM_SHA256_CBOR}
HASH_SCHEME_NAMES = {v: k for k, v in HASH_SCHEMES.items()}


@dataclass(frozen=True)
class Section:
    """One entry of the layout table: where a section lives and how it is divided."""

    name: str
    kind: int
    offset: int
    length: int
    count: int
    entry_size: int


@dataclass(frozen=True)
class RegionInfo:
    """Every field of a verified header, decoded."""

    format_version: int
    uuid: str
    region_size: int
    alignment: int
    flush_mode: str
    max_nodes: int
    created_ns: int
    model_name: str
    model_fingerprint: str
    geometry: Geometry
    bytes_per_token: int
    block_bytes: int
    slot_stride: int
    slot_count: int
    hash_scheme: str
    hash_seed: str
    index_stripes: int
    lock_count: int
    sections: tuple[Section, ...]
    zero_on_free: bool = False      # header flag: freed slots are cleared before reuse

    def section(self, name: str) -> Section:
        """The section called NAME (locks, nodes, ..., data)."""
        for s in self.sections:
            if s.name == name:
                return s
        raise KeyError(name)

    @property
    def metadata_bytes(self) -> int:
        """Bytes before the data area (header and every metadata section)."""
        return self.section("data").offset

    def to_dict(self) -> dict:
        d = asdict(self)
        d["geometry"] = asdict(self.geometry)
        d["sections"] = [asdict(s) for s in self.sections]
        return d


def decode_header(h) -> RegionInfo:
    """Builds a RegionInfo from a verified `struct tract_header` (cdata)."""
    sections = tuple(
        Section(SECTION_NAMES.get(s.kind, f"kind{s.kind}"), s.kind, s.offset, s.length, s.count,
                s.entry_size)
        for s in (h.sections[i] for i in range(h.section_count)))
    geometry = Geometry(num_layers=h.num_layers, num_kv_heads=h.num_kv_heads, head_dim=h.head_dim,
                        dtype=DTYPE_NAMES[h.dtype], block_tokens=h.block_tokens)
    return RegionInfo(
        format_version=h.format_version,
        uuid=str(uuidlib.UUID(bytes=bytes(ffi.buffer(h.uuid, 16)))),
        region_size=h.region_size, alignment=h.alignment,
        flush_mode=FLUSH_MODE_NAMES[h.flush_mode], max_nodes=h.max_nodes,
        created_ns=h.created_ns,
        model_name=ffi.string(h.model_name).decode(errors="replace"),
        model_fingerprint=bytes(ffi.buffer(h.model_fingerprint, 32)).hex(),
        geometry=geometry, bytes_per_token=h.bytes_per_token, block_bytes=h.block_bytes,
        slot_stride=h.slot_stride, slot_count=h.slot_count,
        hash_scheme=HASH_SCHEME_NAMES[h.hash_scheme],
        hash_seed=bytes(ffi.buffer(h.hash_seed, 16)).hex(),
        zero_on_free=bool(h.flags & lib.TRACT_HDR_ZERO_ON_FREE),
        index_stripes=h.index_stripes, lock_count=h.lock_count, sections=sections)
