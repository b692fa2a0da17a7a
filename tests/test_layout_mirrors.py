"""Every Python mirror of a C struct (numpy dtypes, struct formats) agrees with
the layout the C compiler gives that struct: the size, and each field's offset
and width.  A field that moves in the C headers, or in a mirror, fails here.

Where the layout comes from:
- tract.h's CDEF block (struct tract_header, tract_section): the package's
  cffi module, compiled from it;
- native/format.h (the sections' on-media structs) and native/internal.h
  (the node-local segment header): cffi does not see them, so this test
  compiles a small cffi probe against those headers, once per session.  Its
  declarations name the fields the headers declare and end in `...;`, so the
  offsets and sizes are the compiler's, not cffi's own arithmetic.
The state values the mirrors decode (lock slot, bucket and transfer record
states) are checked against format.h's enums the same way.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
import struct
import sys

import numpy as np
import pytest

import format_reader
import index_check
import test_objects
import test_takeover
from tract_cli.core import index, locks, nodes
from tract_cli.core.native import ffi
from tract_cli.inspect import snapshot

NATIVE = pathlib.Path(__file__).resolve().parents[1] / "native"

# the node table's line 0, as nodes.read_nodes unpacks it
NODE_LINE_FIELDS = ("state", "agent_pid", "epoch", "heartbeat_ns", "flags", "manager_epoch",
                    "manager_heartbeat_ns", "hostname")

# (the mirror's name, the mirror, the C struct, the field names of a struct.Struct
# mirror in order (None: a numpy dtype, named), whether it spans the whole struct)
MIRRORS = [
    ("inspect.snapshot.BUCKET_DTYPE", snapshot.BUCKET_DTYPE, "tract_bucket", None, True),
    ("inspect.snapshot.ANCHOR_DTYPE", snapshot.ANCHOR_DTYPE, "tract_lru_anchor", None, True),
    ("inspect.snapshot.SLOT_DTYPE", snapshot.SLOT_DTYPE, "tract_lock_node_slot", None, True),
    ("inspect.snapshot.MGR_DTYPE", snapshot.MGR_DTYPE, "tract_lock_manager_line", None, True),
    ("inspect.snapshot.RECORD_DTYPE", snapshot.RECORD_DTYPE, "tract_transfer_record", None, True),
    ("inspect.snapshot.ALLOC_DTYPE", snapshot.ALLOC_DTYPE, "tract_alloc_header", None, True),
    ("core.nodes.NODE_LINE", nodes.NODE_LINE, "tract_node_entry", NODE_LINE_FIELDS, False),
    ("tests/format_reader.HEADER", format_reader.HEADER, "tract_header",
     format_reader.HEADER_FIELDS, False),
    ("tests/format_reader.SECTION", format_reader.SECTION, "tract_section",
     format_reader.SECTION_FIELDS, True),
    ("tests/index_check.BUCKET", index_check.BUCKET, "tract_bucket", index_check.BUCKET_FIELDS,
     True),
    ("tests/index_check.ANCHOR", index_check.ANCHOR, "tract_lru_anchor",
     index_check.ANCHOR_FIELDS, True),
    ("tests/test_takeover.MGR_LINE", test_takeover.MGR_LINE, "tract_lock_manager_line",
     test_takeover.MGR_FIELDS, False),
    ("tests/test_takeover.SLOT_LINE", test_takeover.SLOT_LINE, "tract_lock_node_slot",
     test_takeover.SLOT_FIELDS, False),
    ("tests/test_objects.OBJDIR_ENTRY", test_objects.OBJDIR_ENTRY, "tract_objdir_entry",
     test_objects.OBJDIR_FIELDS, True),
]

# the structs of the internal headers the probe declares (all of format.h's)
PROBED = {"format.h": None, "internal.h": ("tract_local_hdr", "tract_local_mutex")}
_FIELD = re.compile(r"^\s*((?:u?int(?:8|16|32|64)_t)|char)\s+(\w+)\s*(\[\s*\d+\s*\])?\s*;\s*$")


def _struct_bodies(text: str) -> dict[str, str]:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return {m.group(1): m.group(2)
            for m in re.finditer(r"^struct (tract_\w+) \{(.*?)^\}", text, flags=re.S | re.M)}


def _enum_names(text: str) -> list[str]:
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    return [name for body in re.findall(r"\benum\s*\{(.*?)\}", text, flags=re.S)
            for name in re.findall(r"\b(TRACT_\w+)\s*=", body)]


def _probe_cdef() -> str:
    """Partial declarations (`...;`) of the probed structs: their scalar and
    array fields, as the headers spell them (other members are left to the
    compiler: pthread mutexes, nested arrays); format.h's enum constants,
    their values the compiler's too."""
    enums = _enum_names((NATIVE / "format.h").read_text())
    out = [f"#define {name} ..." for name in enums]
    for header, wanted in PROBED.items():
        bodies = _struct_bodies((NATIVE / header).read_text())
        for name in wanted or bodies:
            fields = [m.group(0).strip() for m in map(_FIELD.match, bodies[name].splitlines()) if m]
            out.append(f"struct {name} {{ {' '.join(fields)} ...; }};")
    return "\n".join(out)


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    """The compiled probe (its ffi and lib): the compiler's layout of the
    structs cffi does not see, and the values of format.h's enums."""
    cffi = pytest.importorskip("cffi")
    if not (NATIVE / "format.h").exists():
        pytest.skip("needs the C sources (native/) of a checkout")
    builder = cffi.FFI()
    builder.cdef(_probe_cdef())
    builder.set_source("_tract_layout_probe", '#include "internal.h"\n',
                       include_dirs=[str(NATIVE)], extra_compile_args=["-std=gnu11"])
    tmp = tmp_path_factory.mktemp("layout_probe")
    try:
        so = builder.compile(tmpdir=str(tmp))
    except Exception as exc:           # no C compiler: the package was installed prebuilt
        pytest.skip(f"cannot compile the layout probe: {exc}")
    spec = importlib.util.spec_from_file_location("_tract_layout_probe", so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _c_ffi(name: str, probe):
    """The ffi that knows `struct NAME` with the compiler's layout."""
    try:
        ffi.typeof(f"struct {name}")
        return ffi
    except ffi.error:
        return probe.ffi


def _c_layout(name: str, probe) -> tuple[int, dict[str, tuple[int, int, str]]]:
    """(sizeof, {field: (offset, size, C type)}) of `struct NAME`."""
    f = _c_ffi(name, probe)
    t = f.typeof(f"struct {name}")
    return f.sizeof(t), {fname: (fld.offset, f.sizeof(fld.type), fld.type.cname)
                         for fname, fld in t.fields}


def _struct_items(st: struct.Struct) -> list[tuple[int, int, str]]:
    """(offset, size, code) of each value a struct.Struct format packs (pad bytes
    skipped); the format must be standard-size little-endian ('<')."""
    fmt = st.format if isinstance(st.format, str) else st.format.decode()
    assert fmt.startswith("<"), f"{fmt!r}: mirrors of on-media structs are '<' formats"
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
    assert offset == st.size, f"{fmt!r}: parsed {offset} bytes, struct says {st.size}"
    return items


def _mirror_fields(mirror, names) -> tuple[int, dict[str, tuple[int, int, str]]]:
    """(size, {field: (offset, size, kind)}) of a mirror; kind 'u'/'i' for
    integers, 'b' for raw bytes (numpy void, struct 's')."""
    if isinstance(mirror, np.dtype):
        return mirror.itemsize, {n: (off, dt.itemsize, "b" if dt.kind == "V" else dt.kind)
                                 for n, (dt, off) in mirror.fields.items()}
    items = _struct_items(mirror)
    assert len(items) == len(names), \
        f"{len(items)} values in {mirror.format!r} but {len(names)} field names"
    kinds = {"s": "b", "p": "b"}
    return mirror.size, {n: (off, size, kinds.get(code, "u" if code.isupper() else "i"))
                         for n, (off, size, code) in zip(names, items)}


def _is_pad(name: str) -> bool:
    return name.startswith(("pad", "reserved"))


@pytest.mark.parametrize("what,mirror,cname,names,whole", MIRRORS,
                         ids=[m[0] for m in MIRRORS])
def test_mirror_matches_the_c_layout(probe, what, mirror, cname, names, whole):
    csize, cfields = _c_layout(cname, probe)
    size, fields = _mirror_fields(mirror, names)
    if whole:
        assert size == csize, f"{what} is {size} bytes, struct {cname} {csize}"
    else:
        assert size <= csize, f"{what} ({size} bytes) is longer than struct {cname} ({csize})"
    for name, (off, width, kind) in fields.items():
        if name not in cfields:
            assert _is_pad(name), f"{what}.{name}: struct {cname} has no such field"
            continue
        coff, cwidth, ctype = cfields[name]
        assert (off, width) == (coff, cwidth), \
            (f"{what}.{name} is {width} bytes at offset {off}; in struct {cname} it is "
             f"{ctype}, {cwidth} bytes at offset {coff}")
        if kind in "ui":
            assert ctype.startswith("uint" if kind == "u" else "int"), \
                f"{what}.{name} is {'un' if kind == 'u' else ''}signed, struct {cname} has {ctype}"
    # a mirror that names the C struct's fields names them all (its padding excepted)
    end = size
    missed = [n for n, (off, _, _) in cfields.items()
              if off < end and n not in fields and not _is_pad(n)
              and not any(fo <= off < fo + fw for fo, fw, _ in fields.values())]
    assert not missed, f"{what} covers fields of struct {cname} it does not name: {missed}"


def test_the_independent_readers_header_offsets():
    assert format_reader.CRC_OFFSET == ffi.offsetof("struct tract_header", "header_crc32")
    assert format_reader.SECTIONS_OFFSET == ffi.offsetof("struct tract_header", "sections")
    assert format_reader.SECTION.size == ffi.sizeof("struct tract_section")


def test_the_node_local_header_offsets_that_tests_poke(probe):
    """test_lock corrupts a lock's local mutex through the segment header's
    locks_off (offset 56) and 64-byte mutex records."""
    assert probe.ffi.offsetof("struct tract_local_hdr", "locks_off") == 56
    assert probe.ffi.sizeof("struct tract_local_mutex") == 64


def test_state_names_match_format_h(probe):
    """The state values the mirrors decode are format.h's enums."""
    lib = probe.lib
    assert locks.SLOT_STATES == {lib.TRACT_LOCK_IDLE: "IDLE", lib.TRACT_LOCK_WAITING: "WAITING",
                                 lib.TRACT_LOCK_LOCKED: "LOCKED"}
    assert (test_takeover.IDLE, test_takeover.WAITING, test_takeover.LOCKED) == \
        (lib.TRACT_LOCK_IDLE, lib.TRACT_LOCK_WAITING, lib.TRACT_LOCK_LOCKED)
    buckets = (lib.TRACT_BUCKET_EMPTY, lib.TRACT_BUCKET_PENDING, lib.TRACT_BUCKET_READY,
               lib.TRACT_BUCKET_TOMBSTONE)
    assert index.BUCKET_STATES == dict(zip(buckets, ("EMPTY", "PENDING", "READY", "TOMBSTONE")))
    assert index.BUCKET_F_CHECKSUM == lib.TRACT_BUCKET_F_CHECKSUM
    assert (index_check.EMPTY, index_check.PENDING, index_check.READY, index_check.TOMB) == buckets
    assert snapshot.RECORD_STATES == {lib.TRACT_TRANSFER_PUBLISHED: "PUBLISHED",
                                      lib.TRACT_TRANSFER_ACKED: "ACKED",
                                      lib.TRACT_TRANSFER_RECLAIMING: "RECLAIMING"}
    assert lib.TRACT_TRANSFER_FREE == 0      # all-zero is every section's initial state
    assert nodes.NODE_STATES == {lib.TRACT_NODE_NEVER: "never", lib.TRACT_NODE_ALIVE: "alive",
                                 lib.TRACT_NODE_LEFT: "left"}
    assert lib.TRACT_NODE_NEVER == 0          # a zeroed node table: no node ever attached
    assert (nodes.FLAG_MANAGER, nodes.FLAG_STANDBY, nodes.FLAG_AUTOSTOP) == \
        (lib.TRACT_NODE_F_MANAGER, lib.TRACT_NODE_F_STANDBY, lib.TRACT_NODE_F_AUTOSTOP)


def test_the_probe_sees_every_struct_of_format_h(probe):
    names = _struct_bodies((NATIVE / "format.h").read_text())
    assert len(names) >= 8
    for name in names:
        assert probe.ffi.sizeof(f"struct {name}") % 64 == 0, f"struct {name} is not whole lines"


def test_a_moved_field_is_caught(probe):
    """The check itself: a dtype whose field sits 4 bytes off fails it."""
    fields = [(n, dt.str if dt.kind != "V" else f"V{dt.itemsize}")
              for n, (dt, _) in sorted(snapshot.BUCKET_DTYPE.fields.items(), key=lambda x: x[1][1])]
    i = [n for n, _ in fields].index("slot")
    moved = fields[:i] + [fields[i + 1], fields[i]] + fields[i + 2:]     # slot swapped with tokens
    with pytest.raises(AssertionError, match=r"moved\.(slot|tokens) is 4 bytes at offset"):
        test_mirror_matches_the_c_layout(probe, "moved", np.dtype(moved), "tract_bucket",
                                         None, True)


if __name__ == "__main__":      # print the probe's declarations
    sys.stdout.write(_probe_cdef() + "\n")
