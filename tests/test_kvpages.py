"""The engine data path (core/kvpages.py, native/kvpages.c): blocks move
between an engine's per-layer page tensors and region slots in the page's own
order, checksummed as they copy, in every layout an engine connector meets."""
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from tract_cli.core.errors import UsageError
from tract_cli.core.kvpages import PageLayout, PagedKV
from tract_cli.core.pool import Pool

PAGES = 24


def _layouts(g: int, heads: int, dim: int) -> dict:
    """Page layouts (offsets [2, B, heads, dim] within a page, page stride) as
    engines make them: canonical token-major, FlashAttention's K|V planes, a
    CPU kernel's packing (K in dimension pairs, V in token pairs, as vLLM's AMX
    layout), and a random permutation, each with two region blocks per page."""
    B = 2 * g
    page = 2 * B * heads * dim
    kv, t, h, d = np.meshgrid(np.arange(2), np.arange(B), np.arange(heads), np.arange(dim),
                              indexing="ij")
    canonical = ((kv * B + t) * heads + h) * dim + d
    plane = B * heads * dim
    flash = kv * PAGES * plane + (t * heads + h) * dim + d       # [2, pages, B, heads, dim]
    # per head: K as [dim/2][B][2], V as [B/2][dim][2]
    k_amx = h * (B * dim) + (d // 2) * (B * 2) + t * 2 + d % 2
    v_amx = heads * B * dim + h * (B * dim) + (t // 2) * (dim * 2) + d * 2 + t % 2
    amx = np.where(kv == 0, k_amx, v_amx)
    rnd = np.random.default_rng(7).permutation(page).reshape(2, B, heads, dim)
    return {"canonical": (canonical, page), "flash": (flash, plane), "amx": (amx, page),
            "random": (rnd, page),
            # many short runs at unaligned region positions (the bounce buffer's case)
            "odd": (_interleaved(page, g, heads, dim, (40, 40, 24, 24)), page),
            # a few long runs at unaligned positions, copied run by run (a streaming
            # copy's plain head, with a low streaming threshold)
            "long": (_interleaved(page, g, heads, dim, (260, 260, 252, 252)), page)}


def _interleaved(page: int, g: int, heads: int, dim: int, sizes: tuple) -> np.ndarray:
    """A page of two region blocks whose elements alternate in chunks of SIZES
    (owners 0, 1, 0, 1, ...), each block's elements in a random order within its
    chunks: [2, 2g, heads, dim] offsets."""
    chunks, owner, at = [], [], 0
    while at < page:
        size = min(sizes[len(chunks) % len(sizes)], page - at)
        owner.append(len(chunks) % 2)
        chunks.append((at, size))
        at += size
    per_sub = [np.concatenate([np.arange(a, a + n) for (a, n), o in zip(chunks, owner) if o == j])
               for j in (0, 1)]
    half = page // 2
    assert all(len(p) == half for p in per_sub)
    out = np.empty((2, 2, g, heads, dim), np.int64)          # [sub, K|V, token, h, d]
    for j in (0, 1):
        out[j] = per_sub[j][np.random.default_rng(j).permutation(half)].reshape(2, g, heads, dim)
    return out.transpose(1, 0, 2, 3, 4).reshape(2, 2 * g, heads, dim)


def _one_block_a_page(g: int, heads: int, dim: int):
    """A CPU-like packed page of exactly one region block (B = g): one run per
    layer and page, whatever the packing inside it."""
    kv, t, h, d = np.meshgrid(np.arange(2), np.arange(g), np.arange(heads), np.arange(dim),
                              indexing="ij")
    page = 2 * g * heads * dim
    k = h * (g * dim) + (d // 2) * (g * 2) + t * 2 + d % 2
    v = heads * g * dim + h * (g * dim) + (t // 2) * (dim * 2) + d * 2 + t % 2
    return np.where(kv == 0, k, v), page


@pytest.fixture
def pool(managed_region):
    p = Pool.attach(managed_region, node=1)
    yield p
    p.close()


def _tensors(pool, layout_name: str, seed: int = 0):
    g = pool.geometry
    offsets, stride = (_one_block_a_page(g.block_tokens, g.num_kv_heads, g.head_dim)
                       if layout_name == "page" else
                       _layouts(g.block_tokens, g.num_kv_heads, g.head_dim)[layout_name])
    layout = PageLayout(offsets.astype(np.int64), stride, g.block_tokens, 4)
    elems = 2 * PAGES * stride if layout_name == "flash" else PAGES * stride
    gen = torch.Generator().manual_seed(seed)
    tensors = [torch.randn(elems, generator=gen) for _ in range(g.num_layers)]
    return layout, tensors


def _claim(pool, n: int, seed: int = 1):
    keys = np.random.default_rng(seed).integers(0, 256, (n, 16), dtype=np.uint8)
    status, slots = pool.index.reserve(keys, timeout=10)
    return keys, status, slots


@pytest.mark.parametrize("name", ["canonical", "flash", "amx", "random", "odd", "long", "page"])
def test_blocks_round_trip_in_the_page_order_with_their_checksums(pool, name):
    layout, tensors = _tensors(pool, name)
    assert (layout.digest is None) == (name in ("canonical", "flash"))
    if name == "page":
        assert layout.blocks_per_page == 1 and layout.run_count == 1
    kv = PagedKV(pool, layout, tensors)
    n = 10
    keys, status, slots = _claim(pool, n)
    pages = np.array([3, 3, 7, 0, 23, 23, 11, 5, 9, 2])
    subs = np.array([0, 1, 1, 0, 0, 1, 0, 1, 0, 1]) % layout.blocks_per_page
    crcs = kv.save(slots, pages, subs)
    assert np.array_equal(crcs, pool.checksum_slots(slots))
    area = pool.slots_tensor().reshape(pool.info.slot_count, pool.geometry.num_layers, -1)
    index = torch.from_numpy(layout.gather_index(pages, subs))
    for layer, t in enumerate(tensors):
        assert torch.equal(area[torch.from_numpy(slots.astype(np.int64)), layer], t[index])
    back = [torch.zeros_like(t) for t in tensors]
    got = PagedKV(pool, layout, back).load(slots, pages, subs)
    assert np.array_equal(got, crcs)
    for t, b in zip(tensors, back):
        assert torch.equal(b[index], t[index])
        # nothing outside the loaded blocks was written
        mask = torch.ones_like(b, dtype=torch.bool)
        mask[index.reshape(-1)] = False
        assert not b[mask].any()
    pool.index.commit(keys, status, slots, publish=False)


def test_a_partial_block_keeps_only_its_tokens_and_its_checksum_covers_the_zeros(pool):
    layout, tensors = _tensors(pool, "amx")
    kv = PagedKV(pool, layout, tensors)
    keys, status, slots = _claim(pool, 2, seed=2)
    crcs = kv.save(slots, np.array([4, 4]), np.array([0, 1]), tokens=np.array([16, 5]))
    assert np.array_equal(crcs, pool.checksum_slots(slots))
    g = pool.geometry
    block = pool.slot_tensor(int(slots[1]))          # (layer, K|V, token, head, dim) view
    flat = block.reshape(g.num_layers, -1)
    tokens = torch.from_numpy(layout.elem_token[1].astype(np.int64))
    assert not flat[:, tokens >= 5].any()
    assert flat[:, tokens < 5].abs().sum() > 0
    pool.index.commit(keys, status, slots, publish=False)


def test_a_wrong_byte_in_a_slot_shows_in_the_load_checksum(pool):
    layout, tensors = _tensors(pool, "canonical")
    kv = PagedKV(pool, layout, tensors)
    keys, status, slots = _claim(pool, 3, seed=3)
    crcs = kv.save(slots, np.array([1, 2, 3]), np.array([0, 0, 0]))
    pool.slot_tensor(int(slots[1])).reshape(-1)[100] += 1.0
    got = kv.load(slots, np.array([1, 2, 3]), np.array([0, 0, 0]))
    assert got[0] == crcs[0] and got[2] == crcs[2]
    assert got[1] != crcs[1]
    pool.index.commit(keys, status, slots, publish=False)


def test_the_reference_copy_moves_the_same_bytes_without_a_checksum(pool):
    layout, tensors = _tensors(pool, "amx")
    kv = PagedKV(pool, layout, tensors)
    keys, status, slots = _claim(pool, 4, seed=4)
    pages, subs = np.array([1, 2, 3, 4]), np.array([0, 1, 0, 1])
    with pytest.raises(Exception):      # a memcpy would copy a partial block's stale tokens
        kv.save(slots, pages, subs, tokens=np.array([16, 16, 16, 3]), checksum=False)
    assert kv.save(slots, pages, subs, checksum=False) is None
    first = pool.checksum_slots(slots)
    assert np.array_equal(kv.save(slots, pages, subs), first)
    # the cold state the benchmarks time from: every line evicted, no byte changed
    before = [t.clone() for t in tensors]
    kv.evict(slots, pages, subs)
    assert np.array_equal(pool.checksum_slots(slots), first)
    assert all(torch.equal(a, b) for a, b in zip(before, tensors))
    assert np.array_equal(kv.load(slots, pages, subs), first)
    with pytest.raises(UsageError, match="outside the pool or the engine"):
        kv.evict(np.array([pool.info.slot_count]), np.array([0]), np.array([0]))
    pool.index.commit(keys, status, slots, publish=False)


def test_bad_blocks_and_layouts_are_refused(pool):
    layout, tensors = _tensors(pool, "canonical")
    kv = PagedKV(pool, layout, tensors)
    keys, status, slots = _claim(pool, 1, seed=5)
    with pytest.raises(UsageError, match="outside the pool or the engine"):
        kv.save(slots, np.array([PAGES]), np.array([0]))
    with pytest.raises(UsageError, match="outside the pool or the engine"):
        kv.save(slots, np.array([0]), np.array([2]))
    with pytest.raises(UsageError, match="outside the pool or the engine"):
        kv.load(np.array([pool.info.slot_count]), np.array([0]), np.array([0]))
    with pytest.raises(UsageError, match="differ in length"):
        kv.save(slots, np.array([0, 1]), np.array([0]))
    with pytest.raises(UsageError, match="layer tensors"):
        PagedKV(pool, layout, tensors[:1])
    with pytest.raises(UsageError, match="not alike"):
        PagedKV(pool, layout, [tensors[0], tensors[1][:-4]])
    pool.index.commit(keys, status, slots, publish=False)


def test_the_simulator_path_round_trips(managed_region):
    with Pool.attach(managed_region, node=2, simulate=True) as pool:
        layout, tensors = _tensors(pool, "amx", seed=9)
        kv = PagedKV(pool, layout, tensors)
        keys, status, slots = _claim(pool, 3, seed=6)
        pages, subs = np.array([5, 6, 6]), np.array([1, 0, 1])
        crcs = kv.save(slots, pages, subs, tokens=np.array([16, 16, 7]))   # one partial
        assert np.array_equal(crcs, pool.checksum_slots(slots))
        flat = pool.slot_tensor(int(slots[2])).reshape(pool.geometry.num_layers, -1)
        assert not flat[:, torch.from_numpy(layout.elem_token[1].astype(np.int64)) >= 7].any()
        back = [torch.zeros_like(t) for t in tensors]
        assert np.array_equal(PagedKV(pool, layout, back).load(slots, pages, subs), crcs)
        index = torch.from_numpy(layout.gather_index(pages[:2], subs[:2]))
        assert all(torch.equal(b[index], t[index]) for b, t in zip(back, tensors))
        pool.index.commit(keys, status, slots, publish=False)


CRC_PATHS = """
import numpy as np
from tract_cli.core.native import lib, ffi
def ref(data):
    c = 0xFFFFFFFF
    for b in data:
        c ^= b
        for _ in range(8):
            c = (c >> 1) ^ (0x82F63B78 & -(c & 1))
    return c ^ 0xFFFFFFFF
rng = np.random.default_rng(0)
buf = rng.integers(0, 256, 9000, dtype=np.uint8).tobytes()
bad = 0
for n in list(range(0, 300)) + [511, 512, 513, 1000, 4096, 8191]:
    for off in (0, 1, 7):
        bad += lib.tract_crc32c(buf[off:off + n], n) != ref(buf[off:off + n])
print(bad)
"""


def _cpu_flags() -> set:
    """/proc/cpuinfo's flags (what the kernel lets this CPU use), empty elsewhere."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return set()
    return set(line.partition(":")[2].split())


def _widest_fold(flags: set, env: dict) -> str:
    """The checksum path native/crc.c must take on a CPU with FLAGS under ENV."""
    if "sse4_2" not in flags or "TRACT_NO_SSE42" in env:
        return "bit by bit"
    if "pclmulqdq" not in flags or "TRACT_NO_PCLMUL" in env:
        return "the crc32 instruction"
    wide = "vpclmulqdq" in flags and "TRACT_NO_VPCLMUL" not in env
    if wide and {"avx512f", "avx512bw"} <= flags and "TRACT_NO_AVX512" not in env:
        return "512-bit VPCLMULQDQ folding"
    if wide and "avx2" in flags:
        return "256-bit VPCLMULQDQ folding"
    return "128-bit PCLMULQDQ folding"


@pytest.mark.parametrize("env", [{}, {"TRACT_NO_AVX512": "1"}, {"TRACT_NO_VPCLMUL": "1"},
                                 {"TRACT_NO_PCLMUL": "1"}, {"TRACT_NO_SSE42": "1"}])
def test_the_checksum_takes_the_widest_path_the_cpu_has(env):
    """Which path the checksum runs on, against the kernel's own flags: a
    detection that never chose the wider fold would pass every CRC test."""
    flags = _cpu_flags()
    if "sse4_2" not in flags:
        pytest.skip("not an x86 CPU with SSE4.2 (/proc/cpuinfo)")
    out = subprocess.run([sys.executable, "-c", "from tract_cli.core.cpu import checksum_path; "
                          "print(checksum_path())"], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == _widest_fold(flags, env)


@pytest.mark.parametrize("env", [{}, {"TRACT_NO_AVX512": "1"}, {"TRACT_NO_VPCLMUL": "1"},
                                 {"TRACT_NO_PCLMUL": "1"}, {"TRACT_NO_SSE42": "1"}])
def test_every_crc_path_gives_crc32c(env):
    """The folding paths (512-, 256- and 128-bit carry-less multiply, each where
    the CPU has it: without AVX-512 the first two are the 256-bit one), the crc32
    instruction and the bitwise path agree with the definition at every length
    and alignment around their thresholds."""
    out = subprocess.run([sys.executable, "-c", CRC_PATHS], capture_output=True, text=True,
                         env={**os.environ, **env}, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["0"]


ROUND_TRIP = """
import sys
import numpy as np, torch
sys.path.insert(0, sys.argv[2])
from test_kvpages import _layouts
from tract_cli.core.kvpages import PageLayout, PagedKV
from tract_cli.core.pool import Pool
pool = Pool.create(sys.argv[1], 8 << 20, "tiny", nodes=2, flush_mode="clflush")
g = pool.geometry
bad = 0
for name in ("canonical", "amx", "random", "odd", "long"):
    offsets, stride = _layouts(g.block_tokens, g.num_kv_heads, g.head_dim)[name]
    layout = PageLayout(offsets.astype(np.int64), stride, g.block_tokens, 4)
    tensors = [torch.randn(24 * stride) for _ in range(g.num_layers)]
    slots = np.arange(6, dtype=np.uint32)
    pages, subs = np.array([1, 1, 2, 9, 9, 4]), np.array([0, 1, 1, 0, 1, 0])
    crcs = PagedKV(pool, layout, tensors).save(slots, pages, subs,
                                               tokens=np.array([16, 16, 16, 16, 16, 9]))
    bad += not np.array_equal(crcs, pool.checksum_slots(slots))
    back = [torch.zeros_like(t) for t in tensors]
    bad += not np.array_equal(PagedKV(pool, layout, back).load(slots[:5], pages[:5], subs[:5]),
                              crcs[:5])
    index = torch.from_numpy(layout.gather_index(pages[:5], subs[:5]))
    bad += not all(torch.equal(b[index], t[index]) for b, t in zip(back, tensors))
pool.close()
print(bad)
"""


@pytest.mark.parametrize("env", [{}, {"TRACT_MOVNT_THRESHOLD": "256"}, {"TRACT_NO_AVX512": "1"},
                                 {"TRACT_NO_VPCLMUL": "1"}, {"TRACT_NO_PCLMUL": "1"},
                                 {"TRACT_NO_SSE42": "1"}, {"TRACT_NO_MOVNT": "1"}])
def test_every_copy_path_round_trips(env, tmp_path):
    """The data path on each CPU path (512-, 256- and 128-bit folding, streaming runs
    from an unaligned head, the crc32 instruction, bit by bit, no streaming
    stores), clflush mode: bytes and checksums equal after a save and a load,
    every layout.  (Whether the bytes reached the device is not observable in
    one process: the write-back is by construction, PROTOCOLS.md §1.1.)"""
    path = f"/dev/shm/tract-test-kvp-{os.getpid()}-{'-'.join(env) or 'default'}.pool"
    try:
        out = subprocess.run([sys.executable, "-c", ROUND_TRIP, path, os.path.dirname(__file__)],
                             capture_output=True, text=True, env={**os.environ, **env},
                             timeout=300)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["0"]
    finally:
        from tract_cli.core.region import remove_region
        if os.path.exists(path):
            remove_region(path)


def test_microbench_kvpages_times_the_checksummed_copy_beside_memcpy():
    """`tract microbench kvpages`: a request's save and load, warm and cold, each
    beside a memcpy of the same runs, on the checksum path this CPU takes; the
    checksums of every round equal the first save's (else it stops)."""
    import json

    from tract_cli.core.cpu import checksum_path
    res = subprocess.run([sys.executable, "-m", "tract_cli.cli", "microbench", "kvpages",
                          "--model", "tiny-llama", "--input-len", "600", "--rounds", "1",
                          "--flush-mode", "none", "--flush-mode", "clflush", "--json"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    figures = json.loads(res.stdout)
    assert [f["flush_mode"] for f in figures] == ["none", "clflush"]
    for f in figures:
        assert f["blocks"] == 4 and f["crc_path"] == checksum_path()
        assert f["bytes"] == 4 * 128 * 2 * 2 * 2 * 32 * 4   # tokens, layers, K|V, heads, dim, f32
        assert sorted(f["us"]) == sorted(f"{op}_{state}_{kind}" for op in ("save", "load")
                                         for state in ("warm", "cold")
                                         for kind in ("memcpy", "tract"))
        assert all(v > 0 for v in f["us"].values())


@pytest.mark.parametrize("dtype", ["fp8", "bf16", "f32"])
def test_a_partial_block_is_the_pages_bytes_up_to_its_tokens_for_every_element_size(dtype,
                                                                                      tmp_path):
    """A partial save's zeroing (native/kvpages.c zero_tail, one branch per element
    size): the slot holds the page's bytes of the block's first tokens and zeros
    after, checked byte for byte against numpy, for 1-, 2- and 4-byte elements."""
    import dataclasses
    from tract_cli.core.geometry import load_model
    base = load_model("tiny")
    profile = dataclasses.replace(base, name=f"tiny-{dtype}",
                                  geometry=dataclasses.replace(base.geometry, dtype=dtype))
    path = f"/dev/shm/tract-test-kvp-partial-{os.getpid()}-{dtype}.pool"
    try:
        with Pool.create(path, 8 << 20, profile, nodes=1) as pool:
            g = pool.geometry
            eb = g.dtype_bytes
            offsets, stride = _layouts(g.block_tokens, g.num_kv_heads, g.head_dim)["amx"]
            layout = PageLayout(offsets.astype(np.int64), stride, g.block_tokens, eb)
            gen = np.random.default_rng(4)
            raw = [torch.from_numpy(gen.integers(1, 255, PAGES * stride * eb, dtype=np.uint8))
                   for _ in range(g.num_layers)]
            tensors = [r.view({1: torch.uint8, 2: torch.bfloat16, 4: torch.float32}[eb])
                       for r in raw]
            kv = PagedKV(pool, layout, tensors)
            slots = np.array([5, 0, 2], np.uint32)     # one process: no claim needed
            pages, subs, tokens = np.array([6, 6, 2]), np.array([0, 1, 1]), np.array([3, 16, 1])
            crcs = kv.save(slots, pages, subs, tokens=tokens)
            assert np.array_equal(crcs, pool.checksum_slots(slots))
            for b in range(3):
                got = np.array(pool.slot_bytes(int(slots[b]))).reshape(g.num_layers, -1)
                idx = layout.gather_index(pages[b:b + 1], subs[b:b + 1])[0]
                keep = layout.elem_token[subs[b]] < tokens[b]
                for layer in range(g.num_layers):
                    elems = raw[layer].numpy().reshape(-1, eb)[idx]
                    want = np.where(keep[:, None], elems, 0).reshape(-1)
                    assert np.array_equal(got[layer], want), (dtype, b, layer)
            del kv
    finally:
        from tract_cli.core.region import remove_region
        if os.path.exists(path):
            remove_region(path)


def test_the_page_touch_is_off_or_a_power_of_two_and_copies_alike_either_way(pool,
                                                                               monkeypatch):
    """Save and load read one byte of every page ahead of the copy (native/kvpages.c
    touch_ahead); the same bytes and checksums with it off (TRACT_NO_PAGE_TOUCH=1,
    the benchmark's A/B), and a page size that is no power of two is refused."""
    import mmap
    from tract_cli.core.kvpages import touch_page_sizes
    layout, tensors = _tensors(pool, "page", seed=12)
    kv = PagedKV(pool, layout, tensors)
    assert (kv._kv.region_page, kv._kv.engine_page) == (mmap.PAGESIZE, mmap.PAGESIZE)
    keys, status, slots = _claim(pool, 4, seed=12)
    pages, subs = np.array([5, 1, 9, 2]), np.zeros(4, int)
    crcs = kv.save(slots, pages, subs)
    monkeypatch.setenv("TRACT_NO_PAGE_TOUCH", "1")
    assert touch_page_sizes(pool.target) == (0, 0)
    plain = PagedKV(pool, layout, [t.clone() for t in tensors])
    assert (plain._kv.region_page, plain._kv.engine_page) == (0, 0)
    assert np.array_equal(plain.save(slots, pages, subs), crcs)
    back = [torch.zeros_like(t) for t in tensors]
    assert np.array_equal(PagedKV(pool, layout, back).load(slots, pages, subs), crcs)
    kv._kv.engine_page = 3 * 4096
    with pytest.raises(Exception, match="invalid|argument"):
        kv.save(slots, pages, subs)
    kv._kv.engine_page, kv._kv.region_page = 4096, 2048
    with pytest.raises(Exception, match="invalid|argument"):
        kv.load(slots, pages, subs)
    pool.index.commit(keys, status, slots, publish=False)


def test_huge_page_share_reads_the_mappings_holding_the_tensors(tmp_path):
    """The share of a tensor's bytes in huge pages (the connector's warning when
    vLLM's KV cache has none), from a smaps text: the mapping's AnonHugePages
    spread over it, only the part of it the tensor covers."""
    from tract_cli.core.kvpages import huge_page_share
    t = torch.zeros(4 << 20, dtype=torch.uint8)
    start = t.data_ptr()
    smaps = tmp_path / "smaps"
    # one mapping of 8 MiB around the tensor, 4 MiB of it in huge pages: half
    smaps.write_text(f"{start - (2 << 20):x}-{start + (6 << 20):x} rw-p 00000000 00:00 0\n"
                     "Size:               8192 kB\nAnonHugePages:      4096 kB\n"
                     f"{start + (6 << 20):x}-{start + (8 << 20):x} rw-p 00000000 00:00 0\n"
                     "AnonHugePages:      2048 kB\n")
    assert huge_page_share([t], str(smaps)) == pytest.approx(0.5)
    smaps.write_text(smaps.read_text().replace("4096 kB", "0 kB"))
    assert huge_page_share([t], str(smaps)) == 0.0
    assert huge_page_share([t], str(tmp_path / "none")) is None


def test_blocks_in_any_slot_order_come_back_in_the_callers_order(pool):
    """The C core visits blocks by ascending slot (the prefetcher follows a region
    read forward) and gives each result at the caller's index: slots given
    descending and shuffled copy and checksum as given ascending."""
    layout, tensors = _tensors(pool, "page", seed=13)
    kv = PagedKV(pool, layout, tensors)
    keys, status, slots = _claim(pool, 6, seed=13)
    pages = np.array([8, 2, 14, 5, 0, 19])
    subs = np.zeros(6, int)
    area = pool.slots_tensor().reshape(pool.info.slot_count, pool.geometry.num_layers, -1)
    for order in (np.arange(6), np.arange(6)[::-1], np.array([3, 0, 5, 1, 4, 2])):
        area[torch.from_numpy(slots.astype(np.int64))] = 0
        crcs = kv.save(slots[order], pages[order], subs[order])
        assert np.array_equal(crcs, pool.checksum_slots(slots[order])), order
        # each slot holds its own page, whatever the order
        for b in range(6):
            index = torch.from_numpy(layout.gather_index(pages[b:b + 1], subs[b:b + 1]))
            for layer, t in enumerate(tensors):
                assert torch.equal(area[int(slots[b]), layer], t[index][0]), (order, b)
        back = [torch.zeros_like(t) for t in tensors]
        assert np.array_equal(PagedKV(pool, layout, back).load(slots[order], pages[order],
                                                               subs[order]), crcs)
        index = torch.from_numpy(layout.gather_index(pages, subs))
        assert all(torch.equal(b[index], t[index]) for b, t in zip(back, tensors))
    del area
    pool.index.commit(keys, status, slots, publish=False)


TOUCH_BOUNDS = r"""
import sys
sys.path.insert(0, sys.argv[2])
import numpy as np, torch
from test_kvpages import _one_block_a_page
from tract_cli.core.kvpages import PageLayout, PagedKV
from tract_cli.core.pool import Pool
with Pool.create(sys.argv[1], 8 << 20, "tiny", nodes=1) as pool:
    g = pool.geometry
    offsets, stride = _one_block_a_page(g.block_tokens, g.num_kv_heads, g.head_dim)
    layout = PageLayout(offsets.astype(np.int64), stride, g.block_tokens, 4)
    tensors = [torch.randn(8 * stride) for _ in range(g.num_layers)]
    kv = PagedKV(pool, layout, tensors)
    slots, pages, subs = np.array([3, 1], np.uint32), np.array([6, 2]), np.zeros(2, int)
    want = kv.save(slots, pages, subs)
    # pages of 1 GiB: a touch that began at a page's start would read far before
    # the tensors and the slots, into memory that is not mapped
    kv._kv.region_page = kv._kv.engine_page = 1 << 30
    got = kv.save(slots, pages, subs), kv.load(slots, pages, subs)
    del kv
print(int(all(np.array_equal(x, want) for x in got)))
"""


def test_the_page_touch_reads_nothing_before_a_block(tmp_path):
    """The touch (touch_block) reads one byte in every page a block spans and none before it:
    on a device the mapping's pages are 2 MiB or 1 GiB, whose start lies in
    another slot (whose lines the payload ledger says are not cached here), or
    before an engine's tensor.  With 1 GiB pages over small tensors a touch
    from a page's start reads unmapped memory and the process dies."""
    path = f"/dev/shm/tract-test-kvp-touch-{os.getpid()}.pool"
    try:
        out = subprocess.run([sys.executable, "-c", TOUCH_BOUNDS, path, os.path.dirname(__file__)],
                             capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-2000:]
        assert out.stdout.split() == ["1"]
    finally:
        from tract_cli.core.region import remove_region
        if os.path.exists(path):
            remove_region(path)
