"""Every Python mirror of a C struct (numpy dtypes, struct formats) agrees with
the layout the C compiler gives that struct: the size, and each field's offset
and width.  A field that moves in the C headers, or in a mirror, fails here.

Where the layout comes from:
- the CDEF blocks of tract.h (struct tract_header, tract_section) and
  format.h (the sections' on-media structs): the package's cffi module,
  compiled from them (cffi checks its layout against the compiler's);
- native/internal.h (the node-local segment header): cffi does not see it,
  so this test compiles a small cffi probe against the headers, once per
  session.  Its declarations name the fields the headers declare and end in
  `...;`, so the offsets and sizes are the compiler's, not cffi's own
  arithmetic; it declares format.h's structs too, a second opinion on the
  package's.
The core's own mirrors (tract_cli/core/media.py) run the same check at
import; this test runs it on the tests' mirrors too, and shows it catches a
moved field.  The state values the mirrors decode (lock slot, bucket and
transfer record states, the put statuses) are checked against the headers'
enums the same way.
"""
from __future__ import annotations

import importlib.util
import pathlib
import re
import sys

import numpy as np
import pytest

import format_reader
import index_check
import test_objects
import test_takeover
from tract_cli.core import handoff, index, locks, media, nodes
from tract_cli.core.native import ffi, lib
from tract_cli.inspect import snapshot

NATIVE = pathlib.Path(__file__).resolve().parents[1] / "native"

# (the mirror's name, the mirror, the C struct, the field names of a struct.Struct
# mirror in order (None: a numpy dtype, named), whether it spans the whole struct)
MIRRORS = [
    *((f"core.media.{what}", mirror, cname, names, whole)
      for what, mirror, cname, names, whole in media.MIRRORS),
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


@pytest.mark.parametrize("what,mirror,cname,names,whole", MIRRORS,
                         ids=[m[0] for m in MIRRORS])
def test_mirror_matches_the_c_layout(probe, what, mirror, cname, names, whole):
    """The check core/media.py runs at import (media.layout_mismatches), on every
    mirror, against the compiler's layout."""
    csize, cfields = _c_layout(cname, probe)
    wrong = media.layout_mismatches(what, mirror, cname, names, whole, cfields, csize)
    assert not wrong, "; ".join(wrong)


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
                                      lib.TRACT_TRANSFER_RECLAIMING: "RECLAIMING",
                                      lib.TRACT_TRANSFER_RESERVED: "RESERVED"}
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
        size = probe.ffi.sizeof(f"struct {name}")
        # whole lines, or (a key-list entry) a whole fraction of one: none straddles two
        assert size % 64 == 0 or 64 % size == 0, f"struct {name} straddles lines"


def test_a_moved_field_is_caught(probe):
    """The check itself: a dtype whose field sits 4 bytes off fails it."""
    fields = [(n, dt.str if dt.kind != "V" else f"V{dt.itemsize}")
              for n, (dt, _) in sorted(media.BUCKET_DTYPE.fields.items(), key=lambda x: x[1][1])]
    i = [n for n, _ in fields].index("slot")
    moved = fields[:i] + [fields[i + 1], fields[i]] + fields[i + 2:]     # slot swapped with tokens
    with pytest.raises(AssertionError, match=r"moved\.(slot|tokens) is 4 bytes at offset"):
        test_mirror_matches_the_c_layout(probe, "moved", np.dtype(moved), "tract_bucket",
                                         None, True)


def test_the_package_sees_every_struct_of_format_h_as_the_compiler_lays_it_out(probe):
    """format.h's structs are in its CDEF blocks (core/media.py's import check
    relies on it), and cffi's layout of each is the probe's (the compiler's)."""
    for name in _struct_bodies((NATIVE / "format.h").read_text()):
        t = ffi.typeof(f"struct {name}")     # ffi.error if a CDEF block lost it
        assert ffi.sizeof(t) == probe.ffi.sizeof(f"struct {name}"), name
        for field, _ in probe.ffi.typeof(f"struct {name}").fields:
            assert ffi.offsetof(t, field) == probe.ffi.offsetof(f"struct {name}", field), \
                f"struct {name}.{field}"


def test_the_core_mirrors_are_all_checked_here_and_at_import():
    assert {id(m[1]) for m in media.MIRRORS} <= {id(m[1]) for m in MIRRORS}
    assert snapshot.BUCKET_DTYPE is media.BUCKET_DTYPE and nodes.NODE_LINE is media.NODE_LINE
    assert not [m for what, mirror, cname, names, whole in media.MIRRORS
                for m in media.layout_mismatches(what, mirror, cname, names, whole)]


def test_the_node_tables_hostname_bound_is_the_c_fields():
    size = ffi.sizeof(ffi.new("struct tract_node_entry *").hostname)
    assert nodes.HOSTNAME_MAX == size - 1 == 23          # NUL-terminated
    assert media.NODE_LINE.size == ffi.offsetof("struct tract_node_entry", "hostname") + size


def test_put_status_names_enum_tract_put_status():
    """PUT_STATUS[v] names the status value v of native/tract.h's enum."""
    text = re.sub(r"/\*.*?\*/", "", (NATIVE / "tract.h").read_text(), flags=re.S)
    body = re.search(r"enum tract_put_status\s*\{(.*?)\}", text, flags=re.S).group(1)
    c_names = re.findall(r"\b(TRACT_PUT_\w+)\s*=", body)
    values = sorted(getattr(lib, n) for n in c_names)
    assert values == list(range(len(index.PUT_STATUS)))
    expected = {"TRACT_PUT_STORED": "stored", "TRACT_PUT_WAS_READY": "already_ready",
                "TRACT_PUT_WAS_PENDING": "already_pending", "TRACT_PUT_NO_ROOM": "no_room",
                "TRACT_PUT_CLAIMED": "claimed", "TRACT_PUT_BURIED": "buried"}
    assert set(c_names) == set(expected)
    for n in c_names:
        assert index.PUT_STATUS[getattr(lib, n)] == expected[n]


def test_the_ticket_bound_is_the_largest_key_list():
    """A key list is one slot of 32-byte entries; a slot holds at most 2^32 bytes."""
    assert handoff.MAX_TICKET_BLOCKS == (1 << 32) // 32
    assert lib.TRACT_KEY_ENTRY_SIZE == 32


if __name__ == "__main__":      # print the probe's declarations
    sys.stdout.write(_probe_cdef() + "\n")


@pytest.mark.parametrize("field,fmt", [("state", ">u4"), ("state", "<f4"), ("state", "?"),
                                       ("state", "<i4"), ("key", "S16"),
                                       ("key", [("a", "<u8"), ("b", "<i8")]),
                                       ("key", ("<f8", (2,))), ("slot", "V4")],
                         ids=["big-endian", "float", "bool", "signedness", "string", "record",
                              "float-array", "bytes-for-an-integer"])
def test_a_mirror_field_of_another_kind_is_caught(field, fmt):
    """The check reads kinds, not only widths: a field of the right size but
    of another type (or byte order) is a mismatch."""
    b = media.BUCKET_DTYPE
    variant = np.dtype({"names": list(b.names),
                        "formats": [np.dtype(fmt) if n == field else b.fields[n][0] for n in b.names],
                        "offsets": [b.fields[n][1] for n in b.names], "itemsize": b.itemsize})
    wrong = media.layout_mismatches("BUCKET", variant, "tract_bucket")
    assert any(f"BUCKET.{field}" in w for w in wrong), wrong
