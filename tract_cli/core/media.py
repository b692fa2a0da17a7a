"""The on-media structs as numpy dtypes and struct formats, for lock-free readers.

`tract inspect`, `tract check` and the node table's readers decode whole
sections in bulk; these are the layouts they decode with.  Each mirror is
checked at import, field by field, against the C compiler's layout of its
struct (native/format.h, whose structs are in CDEF blocks: `ffi.sizeof`,
`ffi.offsetof`), so a field that moves in the headers or here fails at once
instead of being misread.  Padding is named `pad...` and may cover reserved
fields the readers do not decode.
"""
from __future__ import annotations

import re
import struct
import sys

import numpy as np

from tract_cli.core.native import ffi

# one prefix-index bucket (struct tract_bucket)
BUCKET_DTYPE = np.dtype([("key", "V16"), ("state", "<u4"), ("slot", "<u4"), ("tokens", "<u4"),
                         ("reserved", "<u4"), ("lru_prev", "<u4"), ("lru_next", "<u4"),
                         ("owner_node", "<u2"), ("flags", "<u2"), ("owner_pid", "<u4"),
                         ("epoch", "<u4"), ("checksum", "<u4"), ("last_access_ns", "<u8")])
# one index stripe's LRU anchor (struct tract_lru_anchor)
ANCHOR_DTYPE = np.dtype([("head", "<u4"), ("tail", "<u4"), ("count", "<u8"), ("hits", "<u8"),
                         ("inserts", "<u8"), ("evictions", "<u8"), ("lookups", "<u8"),
                         ("release_keys", "<u8"), ("release_blocks", "<u4"),
                         ("release_owner", "<u4")])
# a node's slot of a lock (struct tract_lock_node_slot)
SLOT_DTYPE = np.dtype([("state", "<u4"), ("pid", "<u4"), ("epoch", "<u8"), ("request_seq", "<u8"),
                       ("since_ns", "<u8"), ("grant_token", "<u8"), ("after_lock", "<u4"),
                       ("reserved0", "<u4"), ("after_req", "<u8"), ("pad", "V8")])
# a lock's manager line (struct tract_lock_manager_line)
MGR_DTYPE = np.dtype([("granted_node", "<u4"), ("last_node", "<u4"), ("grant_seq", "<u8"),
                      ("grant_ns", "<u8"), ("granted_req", "<u8"), ("token", "<u8"),
                      ("inherited", "<u4"), ("pad", "V20")])
# a handoff record (struct tract_transfer_record); the releaser's progress is padding here
RECORD_DTYPE = np.dtype([("state", "<u4"), ("owner_node", "<u4"), ("owner_pid", "<u4"),
                         ("block_count", "<u4"), ("request_id", "V16"), ("token_count", "<u8"),
                         ("keys_offset", "<u8"), ("tail_slot", "<u4"), ("tail_tokens", "<u4"),
                         ("created_ns", "<u8"), ("expiry_ns", "<u8"), ("pad", "V56")])
# the allocator header (struct tract_alloc_header)
ALLOC_DTYPE = np.dtype([("used_slots", "<u8"), ("next_hint", "<u8"), ("claims", "<u8"),
                        ("releases", "<u8"), ("intent_n", "<u2"), ("intent_node", "<u2"),
                        ("pad", "V28")])
# an entry of a stripe's event log (struct tract_event, FORMAT.md §4.9)
EVENT_DTYPE = np.dtype([("seq", "<u8"), ("kind", "<u4"), ("slot", "<u4"), ("key", "V16"),
                        ("node", "<u2"), ("flags", "<u2"), ("tokens", "<u4"), ("time_ns", "<u8"),
                        ("epoch", "<u4"), ("pad", "V12")])
# the three lines of a slot's block record (struct tract_block_record, FORMAT.md §4.10)
BLOCK_RECORD_DTYPE = np.dtype([("key", "V16"), ("tag", "V16"), ("hash", "V32"), ("parent", "V32"),
                               ("n_tokens", "<u4"), ("node", "<u2"), ("flags", "<u2"),
                               ("written_ns", "<u8"), ("pad", "V16"), ("salt_len", "<u4"),
                               ("salt", "V60")])

# line 0 of a node entry (struct tract_node_entry, FORMAT.md §4.2), as
# nodes.read_nodes unpacks it and the agent packs it: its values, in order
NODE_LINE = struct.Struct("<IIQQIIQ24s")
NODE_LINE_FIELDS = ("state", "agent_pid", "epoch", "heartbeat_ns", "flags", "manager_epoch",
                    "manager_heartbeat_ns", "hostname")
# line 1 of a node entry, its verdict (struct tract_node_verdict, FORMAT.md §4.2)
VERDICT_LINE = struct.Struct("<QQQQI28x")
VERDICT_LINE_FIELDS = ("dead_epoch", "declared_ns", "token", "heartbeat_ns", "recovered")


def pins_view(raw: np.ndarray, info) -> np.ndarray:
    """The pins section, RAW (its bytes as uint8, as observed), as a (max_nodes,
    buckets) uint16 view: [n, i] is node n's pin count on bucket i.  Each
    node's array is padded to whole lines (the section's entry_size,
    native/layout.c), so rows are cut to the bucket count."""
    ps = info.section("pins")
    rows = raw[:ps.count * ps.entry_size].view("<u2").reshape(ps.count, ps.entry_size // 2)
    return rows[:, :info.section("buckets").count]


def c_fields(cname: str) -> dict[str, tuple[int, int, str]]:
    """{field: (offset, size, C type)} of `struct CNAME`, as the compiler lays it out."""
    t = ffi.typeof(f"struct {cname}")
    return {name: (ffi.offsetof(t, name), ffi.sizeof(f.type), f.type.cname) for name, f in t.fields}


# the node table keeps this many bytes of a host's name (the field, less its NUL)
HOSTNAME_MAX = c_fields("tract_node_entry")["hostname"][1] - 1


def struct_items(st: struct.Struct) -> list[tuple[int, int, str]]:
    """(offset, size, code) of each value a struct.Struct format packs (pad bytes
    skipped); the format must be standard-size little-endian ('<')."""
    fmt = st.format if isinstance(st.format, str) else st.format.decode()
    if not fmt.startswith("<"):
        raise ValueError(f"{fmt!r}: mirrors of on-media structs are '<' formats")
    items, offset = [], 0
    for count, code in re.findall(r"(\d*)([xcbB?hHiIlLqQefdsp])", fmt[1:]):
        n = int(count or 1)
        if code == "x":
            offset += n
        elif code in "sp":
            items.append((offset, n, code))
            offset += n
        else:
            size = struct.calcsize("<" + code)
            items += [(offset + i * size, size, code) for i in range(n)]
            offset += n * size
    if offset != st.size:
        raise ValueError(f"{fmt!r}: parsed {offset} bytes, struct says {st.size}")
    return items


def mirror_fields(mirror, names=None) -> tuple[int, dict[str, tuple[int, int, str]]]:
    """(size, {field: (offset, size, kind)}) of a mirror (a numpy dtype, or a
    struct.Struct with NAMES for its values); kind 'u'/'i' for integers, 'b'
    for raw bytes (numpy void, struct 's')."""
    if isinstance(mirror, np.dtype):
        return mirror.itemsize, {n: (off, dt.itemsize, _numpy_kind(dt))
                                 for n, (dt, off) in mirror.fields.items()}
    items = struct_items(mirror)
    if len(items) != len(names):
        raise ValueError(f"{len(items)} values in {mirror.format!r} but {len(names)} field names")
    kind = lambda code: ("b" if code in "sp" else "u" if code in "BHILQ"
                         else "i" if code in "bhilq" else "?")
    return mirror.size, {n: (off, size, kind(code)) for n, (off, size, code) in zip(names, items)}


def _numpy_kind(dt: np.dtype) -> str:
    """'u'/'i' for a little-endian (or one-byte) integer, 'b' for raw bytes
    (void without fields, or an array of single bytes), '?' for anything else
    (floats, bools, strings, big-endian, nested records): no mirror uses those."""
    if dt.subdtype is not None:
        base = dt.subdtype[0]
        return "b" if base.itemsize == 1 and base.kind in "uiV" and base.fields is None else "?"
    if dt.kind == "V":
        return "b" if dt.fields is None else "?"
    if dt.kind in "ui" and dt.byteorder in ("<", "|") + (("=",) if sys.byteorder == "little" else ()):
        return dt.kind
    return "?"


def _is_pad(name: str) -> bool:
    return name.startswith(("pad", "reserved"))


def layout_mismatches(what: str, mirror, cname: str, names=None, whole: bool = True,
                      cfields: dict | None = None, csize: int | None = None) -> list[str]:
    """How the mirror WHAT disagrees with `struct CNAME` (empty: it agrees): its
    size (equal if WHOLE, else at most the struct's), each field's offset,
    width and signedness, and every field of the struct it spans named.
    CFIELDS/CSIZE give the C layout where it is not this ffi's."""
    if cfields is None:
        cfields, csize = c_fields(cname), ffi.sizeof(f"struct {cname}")
    size, fields = mirror_fields(mirror, names)
    out = []
    if whole and size != csize:
        out.append(f"{what} is {size} bytes, struct {cname} {csize}")
    elif size > csize:
        out.append(f"{what} ({size} bytes) is longer than struct {cname} ({csize})")
    for name, (off, width, kind) in fields.items():
        if name not in cfields:
            if not _is_pad(name):
                out.append(f"{what}.{name}: struct {cname} has no such field")
            continue
        coff, cwidth, ctype = cfields[name]
        c_bytes = "[" in ctype and ctype.split("[")[0].strip() in ("char", "uint8_t", "int8_t")
        if kind == "?":
            out.append(f"{what}.{name} is neither a little-endian integer nor raw bytes "
                       f"(struct {cname} has {ctype})")
        elif (off, width) != (coff, cwidth):
            out.append(f"{what}.{name} is {width} bytes at offset {off}; in struct {cname} it "
                       f"is {ctype}, {cwidth} bytes at offset {coff}")
        elif kind in "ui" and ("[" in ctype
                               or not ctype.startswith("uint" if kind == "u" else "int")):
            out.append(f"{what}.{name} is {'an unsigned' if kind == 'u' else 'a signed'} "
                       f"integer, struct {cname} has {ctype}")
        elif kind == "b" and not c_bytes:
            out.append(f"{what}.{name} is raw bytes, struct {cname} has {ctype}")
    # a mirror that names the struct's fields names them all (its padding excepted)
    missed = [n for n, (off, _, _) in cfields.items()
              if off < size and n not in fields and not _is_pad(n)
              and not any(fo <= off < fo + fw for fo, fw, _ in fields.values())]
    if missed:
        out.append(f"{what} covers fields of struct {cname} it does not name: {missed}")
    return out


# (the mirror's name, the mirror, the C struct, the value names of a struct.Struct
# (None: a named numpy dtype), whether it spans the whole struct)
MIRRORS = (
    ("BUCKET_DTYPE", BUCKET_DTYPE, "tract_bucket", None, True),
    ("ANCHOR_DTYPE", ANCHOR_DTYPE, "tract_lru_anchor", None, True),
    ("SLOT_DTYPE", SLOT_DTYPE, "tract_lock_node_slot", None, True),
    ("MGR_DTYPE", MGR_DTYPE, "tract_lock_manager_line", None, True),
    ("RECORD_DTYPE", RECORD_DTYPE, "tract_transfer_record", None, True),
    ("ALLOC_DTYPE", ALLOC_DTYPE, "tract_alloc_header", None, True),
    ("EVENT_DTYPE", EVENT_DTYPE, "tract_event", None, True),
    ("BLOCK_RECORD_DTYPE", BLOCK_RECORD_DTYPE, "tract_block_record", None, True),
    ("NODE_LINE", NODE_LINE, "tract_node_entry", NODE_LINE_FIELDS, False),
    ("VERDICT_LINE", VERDICT_LINE, "tract_node_verdict", VERDICT_LINE_FIELDS, True),
)


def _check_mirrors() -> None:
    """Every mirror agrees with the C layout, or the import fails (ImportError,
    not an assert: `python -O` keeps the check)."""
    try:
        wrong = [m for what, mirror, cname, names, whole in MIRRORS
                 for m in layout_mismatches(what, mirror, cname, names, whole)]
    except ValueError as err:              # a struct format the check cannot read
        wrong = [str(err)]
    if wrong:
        raise ImportError("tract_cli.core.media disagrees with native/format.h: " + "; ".join(wrong))


_check_mirrors()
