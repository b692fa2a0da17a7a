"""Layout invariants for any valid geometry and size (hypothesis)."""
from __future__ import annotations

from hypothesis import given, settings, strategies as st

from tract_cli.core.geometry import Geometry, ModelProfile
from tract_cli.core.locks import lock_count
from tract_cli.core.region import FormatOptions, compute_layout

MiB = 1 << 20


@st.composite
def configs(draw):
    g = Geometry(num_layers=draw(st.integers(1, 128)), num_kv_heads=draw(st.integers(1, 16)),
                 head_dim=draw(st.sampled_from([16, 64, 80, 96, 128, 256])),
                 dtype=draw(st.sampled_from(["f16", "bf16", "f32", "fp8"])),
                 block_tokens=draw(st.sampled_from([1, 8, 16, 32, 64])))
    opts = FormatOptions(model=ModelProfile("m", g), max_nodes=draw(st.integers(1, 64)),
                         index_stripes=draw(st.sampled_from([1, 8, 64, 256])),
                         transfer_entries=draw(st.integers(1, 4096)))
    alignment = draw(st.sampled_from([2 * MiB, 4096]))
    min_blocks = draw(st.integers(1, 3000))
    size = ((g.block_bytes * min_blocks + 16 * MiB) // alignment + 1) * alignment
    return opts, size, alignment


@settings(max_examples=300, deadline=None)
@given(configs())
def test_sections_are_aligned_disjoint_and_in_bounds(cfg):
    opts, size, alignment = cfg
    sections, slots = compute_layout(size, alignment, opts)
    assert [s.name for s in sections][-1] == "data"
    end = 4096
    for s in sections:
        assert s.offset % 64 == 0, s
        assert s.offset >= end, f"{s.name} overlaps the previous section"
        assert s.length > 0
        end = s.offset + s.length
    assert end <= size
    data = sections[-1]
    assert data.offset % min(alignment, 2 * MiB) == 0
    assert data.count == slots >= 1
    assert data.entry_size % 64 == 0 and data.entry_size >= opts.model.geometry.block_bytes
    by = {s.name: s for s in sections}
    assert by["bitmap"].length * 8 >= slots
    assert by["owners"].length >= slots
    assert by["buckets"].count >= 2 * slots
    assert by["buckets"].count % opts.index_stripes == 0
    assert by["buckets"].count // opts.index_stripes >= 32     # a pin line never spans stripes
    assert by["locks"].count == lock_count(opts.index_stripes)
    assert by["locks"].entry_size == 64 * (opts.max_nodes + 1)
    assert by["pins"].entry_size >= 2 * by["buckets"].count


@settings(max_examples=100, deadline=None)
@given(configs(), st.integers(1, 64))
def test_a_larger_region_never_gets_fewer_slots(cfg, extra_units):
    opts, size, alignment = cfg
    _, slots = compute_layout(size, alignment, opts)
    _, more = compute_layout(size + extra_units * alignment, alignment, opts)
    assert more >= slots
