"""An independent reader of the on-media format, written from docs/FORMAT.md
alone: struct + zlib, no C core.  Tests check that it agrees with the core."""
from __future__ import annotations

import struct
import zlib

HEADER = struct.Struct(
    "<8s I I 16s Q Q I I Q"      # magic .. created_ns            (0x00-0x3f)
    " I I I I I I Q Q Q Q Q"     # geometry line                   (0x40-0x7f)
    " 32s 32s"                   # fingerprint, model name         (0x80-0xbf)
    " I I 16s I I I I 24x"       # hash scheme .. flags            (0xc0-0xff)
)
HEADER_FIELDS = ("magic format_version header_size uuid region_size alignment flush_mode max_nodes "
                 "created_ns block_tokens num_layers num_kv_heads head_dim dtype dtype_bytes "
                 "bytes_per_token block_bytes slot_stride slot_count reserved1 model_fingerprint "
                 "model_name hash_scheme reserved2 hash_seed index_stripes lock_count "
                 "section_count flags").split()
SECTION = struct.Struct("<I I Q Q Q")
SECTION_FIELDS = ("kind", "entry_size", "offset", "length", "count")
SECTIONS_OFFSET = 0x100
SECTION_NAMES = {1: "locks", 2: "nodes", 3: "objdir", 4: "alloc", 5: "bitmap", 6: "owners",
                 7: "buckets", 8: "pins", 9: "lru", 10: "transfer", 11: "events",
                 12: "records", 13: "data"}
CRC_OFFSET = 0xFF8


class FormatError(ValueError):
    pass


def read_header(page: bytes) -> dict:
    """Parses and checks the 4096-byte header page as docs/FORMAT.md §3 describes."""
    if len(page) < 4096:
        raise FormatError("short header")
    fields = HEADER.unpack_from(page, 0)
    h = dict(zip(HEADER_FIELDS, fields))
    if h["magic"] != b"TRACTPOL":
        raise FormatError("bad magic")
    (crc,) = struct.unpack_from("<I", page, CRC_OFFSET)
    if zlib.crc32(page[:CRC_OFFSET]) != crc:
        raise FormatError("bad checksum")
    h["model_name"] = h["model_name"].rstrip(b"\0").decode()
    h["sections"] = {}
    for i in range(h["section_count"]):
        kind, entry, off, length, count = SECTION.unpack_from(page, SECTIONS_OFFSET + SECTION.size * i)
        h["sections"][SECTION_NAMES[kind]] = {"offset": off, "length": length, "count": count,
                                              "entry_size": entry}
    return h
