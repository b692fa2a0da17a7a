"""Chained block hashes: the prefix index's keys (docs/PROTOCOLS.md §8).

h_i = H(h_{i-1}, tokens_i, extra) over full blocks of `block_tokens` tokens,
computed in C over a whole prompt in one call.  Equal prefixes give equal
keys on every host and process (never Python's hash()).

Schemes:
- "tract" (default): 128-bit MurmurHash3_x64_128 of parent || tokens (u32 LE)
  || extra.  The root mixes the region's random hash seed, the model
  fingerprint and an optional tenant salt, so two regions, two models or
  two tenants never share a key.
- "vllm": vLLM's prefix-cache block hash, sha256_cbor:
  sha256(cbor(canonical)((parent, tuple(tokens), extra_keys))), root
  NONE_HASH = sha256_cbor(seed), seed = PYTHONHASHSEED if set, else
  "vllm-none-hash".  A salt enters the first block's extra keys, as vLLM's
  cache_salt does.

The CBOR of the vLLM scheme is encoded in one place, native/hash.c: the hot
path (a whole prompt's chain) is there anyway, so the root (tract_vllm_root)
and the salted first block (tract_hash_chain's EXTRA for this scheme) are
there too, and nothing here encodes CBOR (tests/test_hashing.py checks the C
encoding against cbor2, vLLM's own encoder).
"""
from __future__ import annotations

import os

import numpy as np

from tract_cli.core.errors import UsageError
from tract_cli.core.geometry import DEFAULT_BLOCK_TOKENS
from tract_cli.core.header import HASH_SCHEMES
from tract_cli.core.native import ffi, lib, raise_for

# the key each scheme hashes a block to (bytes); its schemes are header.HASH_SCHEMES
HASH_BYTES = {"tract": 16, "vllm": 32}
VLLM_DEFAULT_SEED = "vllm-none-hash"
MAX_TOKEN = 2**31 - 1
# the chain's input bounds (native/hash.c): a block's tokens, and the extra
# bytes of a block (the tract scheme's; the vLLM scheme's cache salt)
MAX_BLOCK_TOKENS = lib.TRACT_HASH_MAX_BLOCK_TOKENS
MAX_EXTRA_BYTES = lib.TRACT_HASH_MAX_EXTRA


def as_token_array(tokens) -> np.ndarray:
    """Tokens as a contiguous int32 array (no copy when already one).

    Accepts a numpy integer array, a torch tensor, `bytes` (little-endian
    int32), or a list/tuple of ints (converted once).
    """
    if isinstance(tokens, (bytes, bytearray, memoryview)):
        if len(tokens) % 4:
            raise UsageError(f"{len(tokens)} bytes is not a whole number of int32 tokens",
                             "pass little-endian int32 token ids")
        return np.frombuffer(tokens, dtype="<i4")
    if type(tokens).__module__.startswith("torch"):
        tokens = tokens.detach().cpu().numpy()
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        arr = arr.reshape(-1)
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        raise UsageError(f"token ids must be integers, got {arr.dtype}", "pass integer ids")
    if arr.dtype != np.int32:
        if arr.size and (arr.min() < 0 or arr.max() > MAX_TOKEN):
            raise UsageError("token ids must be in 0..2^31-1", "check the tokenizer output")
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr)


def vllm_root(seed: str | None = None) -> bytes:
    """vLLM's NONE_HASH: sha256_cbor(seed), seed PYTHONHASHSEED or 'vllm-none-hash'."""
    if seed is None:
        seed = os.environ.get("PYTHONHASHSEED") or VLLM_DEFAULT_SEED
    raw = seed.encode()
    out = ffi.new("uint8_t[32]")
    raise_for(lib.tract_vllm_root(raw, len(raw), out), "vLLM root hash")
    return bytes(out)


def tract_root(hash_seed: bytes = bytes(16), model_fingerprint: bytes = bytes(32),
               salt: bytes | str | None = None, model_tag: bytes | None = None) -> bytes:
    """Root of a tract-scheme chain: region seed, model fingerprint, tenant salt,
    and the served model's 16-byte identity tag (the vLLM connector's; fixed
    width, before the salt, so no salt can imitate it)."""
    salt_bytes = salt.encode() if isinstance(salt, str) else (salt or b"")
    if model_tag is None:
        data = b"tract-root-v1" + bytes(hash_seed) + bytes(model_fingerprint) + salt_bytes
    else:
        if len(model_tag) != 16:
            raise UsageError(f"a model tag is 16 bytes, got {len(model_tag)}",
                             "pass ModelIdentity.tag")
        data = (b"tract-root-v2" + bytes(hash_seed) + bytes(model_fingerprint) + bytes(model_tag)
                + salt_bytes)
    out = ffi.new("uint8_t[16]")
    lib.tract_murmur3_128(data, len(data), 0, out)
    return bytes(out)


def _chain(scheme: str, tokens: np.ndarray, block_tokens: int, root: bytes,
           extra: bytes = b"") -> np.ndarray:
    n_blocks = tokens.size // block_tokens
    out = np.empty((n_blocks, HASH_BYTES[scheme]), dtype=np.uint8)
    rc = lib.tract_hash_chain(HASH_SCHEMES[scheme], ffi.cast("int32_t *", ffi.from_buffer(tokens)),
                              tokens.size, block_tokens, root, extra or ffi.NULL, len(extra),
                              ffi.from_buffer(out), n_blocks)
    if rc == lib.TRACT_E_INVAL:
        raise UsageError("invalid hash input (negative token id, block size or extra bytes)",
                         f"token ids must be >= 0, 1 <= block_tokens <= {MAX_BLOCK_TOKENS}, "
                         f"salt and extra bytes at most {MAX_EXTRA_BYTES} bytes")
    raise_for(rc, "block hashes")
    return out


def block_hashes(tokens, scheme: str = "tract", block_tokens: int = DEFAULT_BLOCK_TOKENS, *,
                 root: bytes | None = None, salt: bytes | str | None = None,
                 extra: bytes = b"", vllm_seed: str | None = None) -> np.ndarray:
    """Hashes of every full block of TOKENS: shape (n_blocks, 16 or 32), uint8.

    Tokens past the last full block (the partial tail) are not hashed.  For
    "tract", ROOT defaults to tract_root(salt=SALT) (zero seed and
    fingerprint: pass the region's root to match a pool's keys).
    """
    if scheme not in HASH_SCHEMES:
        raise UsageError(f"unknown hash scheme {scheme!r}", f"use {' or '.join(HASH_SCHEMES)}")
    if not 1 <= block_tokens <= MAX_BLOCK_TOKENS:
        raise UsageError(f"block size {block_tokens} out of range",
                         f"use 1 to {MAX_BLOCK_TOKENS} tokens")
    arr = as_token_array(tokens)
    if scheme == "tract":
        return _chain("tract", arr, block_tokens, root or tract_root(salt=salt), extra)
    if extra:
        raise UsageError("extra bytes are for the tract scheme", "use salt= with vllm")
    # vLLM puts the cache salt (when not empty) in the extra keys of the first
    # block only: the C chain does, given the salt as EXTRA
    salt_bytes = salt.encode() if isinstance(salt, str) else bytes(salt or b"")
    salt_bytes.decode()     # a text string in CBOR: it must be UTF-8
    return _chain("vllm", arr, block_tokens, root or vllm_root(vllm_seed), salt_bytes)


def tag_keys(keys: np.ndarray, tag) -> np.ndarray:
    """KEYS ((n, 16) uint8) with a 16-byte TAG mixed in (XOR: one vector op for a
    whole prompt).  How the vLLM connector puts the served model's identity into
    vLLM-scheme keys, whose chain must stay vLLM's own (routers recompute it):
    keys of two models then differ unless their SHA-256 keys differ by exactly
    the XOR of the two tags, a 2^-128 chance.  (The tract scheme takes the tag
    in its root instead: `pool_root(..., model_tag=)`.)"""
    tag = np.frombuffer(bytes(tag), np.uint8) if not isinstance(tag, np.ndarray) else tag
    if tag.shape != (16,):
        raise UsageError(f"a key tag is 16 bytes, got {tag.size}", "pass ModelIdentity.tag")
    return np.bitwise_xor(keys, tag)


def request_keys(info, tokens, block_tokens: int, salt: bytes | str | None = None,
                 root: bytes | None = None) -> np.ndarray:
    """The block hashes of a request's prompt on a region, for a tenant's SALT on
    either scheme: the tract scheme salts the root, the vLLM scheme the first
    block's extra keys (as vLLM does), so tenants never share a block.  ROOT is
    `pool_root(info, salt)` (pass it when cached)."""
    if root is None:
        root = pool_root(info, salt)
    return block_hashes(tokens, info.hash_scheme, block_tokens, root=root, salt=salt)


def pool_root(info, salt: bytes | str | None = None, model_tag: bytes | None = None) -> bytes:
    """The chain root of a region (its scheme, seed and model), with a tenant salt
    and a served model's tag.  The vLLM scheme's root is vLLM's own and carries
    neither: hash with `request_keys` (or `block_hashes(..., salt=)`), which puts
    the salt in the first block, and mix the tag in with `tag_keys`."""
    if info.hash_scheme == "vllm":
        return vllm_root()
    return tract_root(bytes.fromhex(info.hash_seed), bytes.fromhex(info.model_fingerprint), salt,
                      model_tag)
