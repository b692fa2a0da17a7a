"""Chained block hashes: published vectors, the vLLM-compatible scheme,
stability across processes, separation by salt, seed and model."""
from __future__ import annotations

import hashlib
import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from tract_cli.core.errors import UsageError
from tract_cli.core.geometry import load_model
from tract_cli.core.hashing import as_token_array, block_hashes, tract_root, vllm_root
from tract_cli.core.native import ffi, lib

VLLM_VECTOR = "dc918a88b139e5afe60b88eda27508d4aee16c10fdc354791efea06206ac0749"


def murmur(data: bytes, seed: int) -> bytes:
    out = ffi.new("uint8_t[16]")
    lib.tract_murmur3_128(data, len(data), seed, out)
    return bytes(out)


def test_murmur3_matches_smhasher_verification_value():
    """SMHasher's VerificationTest: hash keys 0..i with seed 256-i, hash the hashes."""
    hashes = b"".join(murmur(bytes(range(i)), 256 - i) for i in range(256))
    assert int.from_bytes(murmur(hashes, 0)[:4], "little") == 0x6384BA69


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300), st.integers(0, 2**32 - 1))
def test_murmur3_matches_the_reference_implementation(data, seed):
    mmh3 = pytest.importorskip("mmh3")
    assert murmur(data, seed) == mmh3.hash_bytes(data, seed)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=300))
def test_sha256_matches_hashlib(data):
    out = ffi.new("uint8_t[32]")
    lib.tract_sha256(data, len(data), out)
    assert bytes(out) == hashlib.sha256(data).digest()


def test_vllm_scheme_matches_the_published_vector(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    h = block_hashes(np.arange(16, dtype=np.int32), "vllm")
    assert h.shape == (1, 32) and h[0].tobytes().hex() == VLLM_VECTOR


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 2**31 - 1), max_size=100), st.sampled_from([1, 3, 16]))
def test_vllm_chain_equals_sha256_of_cbor2(tokens, bt):
    cbor2 = pytest.importorskip("cbor2")
    parent = hashlib.sha256(cbor2.dumps("vllm-none-hash", canonical=True)).digest()
    expected = []
    for i in range(len(tokens) // bt):
        parent = hashlib.sha256(cbor2.dumps((parent, tuple(tokens[i * bt:(i + 1) * bt]), None),
                                            canonical=True)).digest()
        expected.append(parent.hex())
    got = block_hashes(tokens, "vllm", bt, vllm_seed="vllm-none-hash")
    assert [r.tobytes().hex() for r in got] == expected


def sha256_cbor(obj) -> bytes:
    """vLLM's sha256_cbor, as vLLM computes it (cbor2): the reference."""
    cbor2 = pytest.importorskip("cbor2")
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


@settings(max_examples=100, deadline=None)
@given(st.text(max_size=40) | st.text(min_size=250, max_size=300))
def test_vllm_root_is_sha256_of_the_cbor2_seed(seed):
    """The C encoder's text-string heads (1, 2 and 3 bytes) agree with cbor2."""
    assert vllm_root(seed) == sha256_cbor(seed)
    assert vllm_root("x" * 70000) == sha256_cbor("x" * 70000)


@settings(max_examples=60, deadline=None)
@given(st.text(min_size=1, max_size=300), st.sampled_from([1, 16]))
def test_vllm_salted_first_block_equals_cbor2(salt, bt):
    toks = list(range(3 * bt))
    root = vllm_root("s")
    first = sha256_cbor((root, tuple(toks[:bt]), (salt,)))
    h = block_hashes(toks, "vllm", bt, vllm_seed="s", salt=salt)
    assert h[0].tobytes() == first
    assert h[1].tobytes() == sha256_cbor((first, tuple(toks[bt:2 * bt]), None))


def test_vllm_salt_enters_the_first_block_only():
    cbor2 = pytest.importorskip("cbor2")
    toks = list(range(40))
    root = vllm_root("s")
    first = hashlib.sha256(cbor2.dumps((root, tuple(toks[:16]), ("tenant",)),
                                       canonical=True)).digest()
    h = block_hashes(toks, "vllm", vllm_seed="s", salt="tenant")
    assert h[0].tobytes() == first
    assert h[1].tobytes() == sha256_cbor((first, tuple(toks[16:32]), None))


def test_vllm_root_follows_pythonhashseed(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "42")
    assert vllm_root() == sha256_cbor("42")


def test_equal_prefixes_give_equal_keys_and_tails_are_not_hashed():
    a = np.arange(100, dtype=np.int32)
    b = np.concatenate([a[:64], np.full(36, 7, dtype=np.int32)])
    ha, hb = block_hashes(a), block_hashes(b)
    assert ha.shape == (6, 16)                          # 100 tokens: 6 full blocks
    assert np.array_equal(ha[:4], hb[:4]) and not np.array_equal(ha[4], hb[4])
    # a chain: a different first block changes every later key
    c = a.copy()
    c[0] = 99
    assert not (block_hashes(c) == ha).all(axis=1).any()


def test_every_input_form_gives_the_same_keys():
    toks = list(range(1000, 1050))
    ref = block_hashes(np.array(toks, dtype=np.int32))
    assert np.array_equal(block_hashes(toks), ref)
    assert np.array_equal(block_hashes(np.array(toks, dtype=np.int64)), ref)
    assert np.array_equal(block_hashes(np.array(toks, dtype="<i4").tobytes()), ref)
    torch = pytest.importorskip("torch")
    assert np.array_equal(block_hashes(torch.tensor(toks)), ref)


def test_int32_arrays_are_not_copied():
    a = np.arange(32, dtype=np.int32)
    assert as_token_array(a) is a


def test_keys_are_stable_across_processes():
    code = ("import numpy as np; from tract_cli.core.hashing import block_hashes;"
            "print(block_hashes(np.arange(64, dtype=np.int32))[-1].tobytes().hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           timeout=60, env={"PYTHONHASHSEED": str(seed), "PATH": ""}).stdout
            for seed in (1, 2)}
    assert outs == {block_hashes(np.arange(64, dtype=np.int32))[-1].tobytes().hex() + "\n"}


def test_salts_seeds_and_models_separate_keys():
    toks = np.arange(32, dtype=np.int32)
    fp8, fpt = load_model("llama-3-8b").fingerprint(), load_model("tiny").fingerprint()
    roots = [tract_root(bytes(16), fp8), tract_root(bytes(16), fp8, "tenant-a"),
             tract_root(bytes(16), fp8, "tenant-b"), tract_root(b"\1" * 16, fp8),
             tract_root(bytes(16), fpt)]
    keys = {block_hashes(toks, root=r)[0].tobytes() for r in roots}
    assert len(keys) == len(roots)


def test_bad_tokens_are_refused():
    with pytest.raises(UsageError):
        block_hashes([1, -2, 3] * 8)
    with pytest.raises(UsageError):
        block_hashes([0.5] * 16)
    with pytest.raises(UsageError):
        block_hashes(b"\0" * 7)


def tract_cli(*args):
    return subprocess.run([sys.executable, "-m", "tract_cli.cli", *args], capture_output=True,
                          text=True, timeout=60)


def test_hash_command(tmp_path):
    res = tract_cli("hash", "--scheme", "vllm", *map(str, range(16)))
    assert res.returncode == 0 and res.stdout.strip() == VLLM_VECTOR
    f = tmp_path / "toks.json"
    f.write_text(json.dumps(list(range(40))))
    res = tract_cli("hash", "--tokens-file", str(f), "--json")
    data = json.loads(res.stdout)
    assert data["tokens"] == 40 and len(data["hashes"]) == 2 and len(data["hashes"][0]) == 32
    res = tract_cli("hash", "1", "x")
    assert res.returncode == 2 and res.stderr.startswith("tract: error:")
    res = tract_cli("hash")
    assert res.returncode == 2 and "no token ids" in res.stderr


def test_hash_command_uses_a_pools_seed(region_path):
    from tract_cli.core.pool import Pool
    from tract_cli.core.hashing import pool_root
    with Pool.create(region_path, 16 << 20, "tiny") as p:
        expected = block_hashes(np.arange(16, dtype=np.int32), root=pool_root(p.info))
    res = tract_cli("hash", "--pool", region_path, *map(str, range(16)))
    assert res.returncode == 0 and res.stdout.strip() == expected[0].tobytes().hex()


@pytest.mark.parametrize("scheme", ["tract", "vllm"])
def test_tenants_salts_give_other_keys_on_either_scheme(region_path, scheme):
    """A region's request keys (what serve-prefill and the vLLM connector
    compute) differ by tenant salt on both schemes: on the vLLM scheme the
    root is vLLM's and carries no salt, so the salt must enter the first
    block (a prompt under salt "b" once hit every block salt "a" cached)."""
    from tract_cli.core.hashing import pool_root, request_keys
    from tract_cli.core.pool import Pool
    Pool.create(region_path, 16 << 20, "tiny", nodes=2, hash_scheme=scheme).close()
    with Pool.attach(region_path, readonly=True, prefault=False, local=False) as p:
        toks = np.arange(64, dtype=np.int32)
        a, b = (request_keys(p.info, toks, 16, s) for s in ("a", "b"))
        none = request_keys(p.info, toks, 16)
        assert len(a) == len(b) == len(none) == 4
        assert not {bytes(k) for k in a} & {bytes(k) for k in b}
        assert not {bytes(k) for k in a} & {bytes(k) for k in none}
        # the root a caller caches per tenant gives the same keys
        assert np.array_equal(request_keys(p.info, toks, 16, "a", root=pool_root(p.info, "a")), a)
