/*
 * hash.c -- chained block hashes over a whole prompt in one call.
 *
 * Scheme "tract": h_i = MurmurHash3_x64_128(h_{i-1} || tokens_i || extra),
 * seed 0, tokens as little-endian u32; h_{-1} is the root the caller derives
 * from the region's hash seed, the model fingerprint and a tenant salt.
 * MurmurHash3 is implemented here from Austin Appleby's published
 * description and checked against SMHasher's verification value.
 *
 * Scheme "vllm": h_i = SHA-256(CBOR([h_{i-1}, [tokens_i...], extra_keys])),
 * the canonical CBOR of vLLM's sha256_cbor; extra_keys is null, or [salt] (a
 * text string) in the first block when a cache salt is given, as vLLM does;
 * the root is NONE_HASH = SHA-256(CBOR(seed)) (tract_vllm_root).  This file
 * is the one CBOR encoder of the project (core/hashing.py calls these two
 * functions and encodes nothing itself).  SHA-256 is implemented here from
 * FIPS 180-4.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* ---- MurmurHash3_x64_128 ---- */

static inline uint64_t rotl64(uint64_t x, int r)
{
	return (x << r) | (x >> (64 - r));
}

/* finalization mix (internal) */
static inline uint64_t fmix64(uint64_t k)
{
	k ^= k >> 33;
	k *= 0xff51afd7ed558ccdULL;
	k ^= k >> 33;
	k *= 0xc4ceb9fe1a85ec53ULL;
	k ^= k >> 33;
	return k;
}

/* little-endian u64 load (internal) */
static inline uint64_t load64(const uint8_t *p)
{
	uint64_t v;
	memcpy(&v, p, 8);
	return v;   /* x86-64 and aarch64 Linux are little-endian */
}

#define MM3_C1 0x87c37b91114253d5ULL
#define MM3_C2 0x4cf5ad432745937fULL

/* the body of MurmurHash3_x64_128 over whole 16-byte blocks (internal) */
static inline void mm3_body(uint64_t *h1p, uint64_t *h2p, const uint8_t *data, uint64_t nblocks)
{
	uint64_t h1 = *h1p, h2 = *h2p;
	const uint64_t c1 = MM3_C1, c2 = MM3_C2;
	for (uint64_t i = 0; i < nblocks; i++) {
		uint64_t k1 = load64(data + i * 16), k2 = load64(data + i * 16 + 8);
		k1 *= c1; k1 = rotl64(k1, 31); k1 *= c2; h1 ^= k1;
		h1 = rotl64(h1, 27); h1 += h2; h1 = h1 * 5 + 0x52dce729;
		k2 *= c2; k2 = rotl64(k2, 33); k2 *= c1; h2 ^= k2;
		h2 = rotl64(h2, 31); h2 += h1; h2 = h2 * 5 + 0x38495ab5;
	}
	*h1p = h1;
	*h2p = h2;
}

/* the finalization of MurmurHash3_x64_128 (internal) */
static inline void mm3_final(uint64_t h1, uint64_t h2, uint64_t len, uint8_t *out)
{
	h1 ^= len; h2 ^= len;
	h1 += h2; h2 += h1;
	h1 = fmix64(h1); h2 = fmix64(h2);
	h1 += h2; h2 += h1;
	memcpy(out, &h1, 8);
	memcpy(out + 8, &h2, 8);
}

/* MurmurHash3_x64_128 of len bytes with a 32-bit seed; out gets 16 bytes. */
void tract_murmur3_128(const void *key, uint64_t len, uint32_t seed, uint8_t *out)
{
	const uint8_t *data = key;
	const uint64_t nblocks = len / 16;
	uint64_t h1 = seed, h2 = seed;
	const uint64_t c1 = MM3_C1, c2 = MM3_C2;

	mm3_body(&h1, &h2, data, nblocks);
	const uint8_t *tail = data + nblocks * 16;
	uint64_t k1 = 0, k2 = 0;
	switch (len & 15) {
	case 15: k2 ^= (uint64_t)tail[14] << 48; /* fall through */
	case 14: k2 ^= (uint64_t)tail[13] << 40; /* fall through */
	case 13: k2 ^= (uint64_t)tail[12] << 32; /* fall through */
	case 12: k2 ^= (uint64_t)tail[11] << 24; /* fall through */
	case 11: k2 ^= (uint64_t)tail[10] << 16; /* fall through */
	case 10: k2 ^= (uint64_t)tail[9] << 8;   /* fall through */
	case 9:
		k2 ^= (uint64_t)tail[8];
		k2 *= c2; k2 = rotl64(k2, 33); k2 *= c1; h2 ^= k2;
		/* fall through */
	case 8: k1 ^= (uint64_t)tail[7] << 56;   /* fall through */
	case 7: k1 ^= (uint64_t)tail[6] << 48;   /* fall through */
	case 6: k1 ^= (uint64_t)tail[5] << 40;   /* fall through */
	case 5: k1 ^= (uint64_t)tail[4] << 32;   /* fall through */
	case 4: k1 ^= (uint64_t)tail[3] << 24;   /* fall through */
	case 3: k1 ^= (uint64_t)tail[2] << 16;   /* fall through */
	case 2: k1 ^= (uint64_t)tail[1] << 8;    /* fall through */
	case 1:
		k1 ^= (uint64_t)tail[0];
		k1 *= c1; k1 = rotl64(k1, 31); k1 *= c2; h1 ^= k1;
	}
	mm3_final(h1, h2, len, out);
}

/* ---- SHA-256 (FIPS 180-4) ---- */

static const uint32_t K256[64] = {
	0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
	0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
	0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
	0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
	0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
	0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
	0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
	0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
};

static inline uint32_t rotr32(uint32_t x, int r)
{
	return (x >> r) | (x << (32 - r));
}

/* one 64-byte block of the compression function (internal) */
static void sha256_block(uint32_t st[8], const uint8_t *p)
{
	uint32_t w[64];
	for (int i = 0; i < 16; i++)
		w[i] = (uint32_t)p[4 * i] << 24 | (uint32_t)p[4 * i + 1] << 16 |
		       (uint32_t)p[4 * i + 2] << 8 | p[4 * i + 3];
	for (int i = 16; i < 64; i++) {
		uint32_t s0 = rotr32(w[i - 15], 7) ^ rotr32(w[i - 15], 18) ^ (w[i - 15] >> 3);
		uint32_t s1 = rotr32(w[i - 2], 17) ^ rotr32(w[i - 2], 19) ^ (w[i - 2] >> 10);
		w[i] = w[i - 16] + s0 + w[i - 7] + s1;
	}
	uint32_t a = st[0], b = st[1], c = st[2], d = st[3], e = st[4], f = st[5], g = st[6],
		 h = st[7];
	for (int i = 0; i < 64; i++) {
		uint32_t t1 = h + (rotr32(e, 6) ^ rotr32(e, 11) ^ rotr32(e, 25)) + ((e & f) ^ (~e & g)) +
			      K256[i] + w[i];
		uint32_t t2 = (rotr32(a, 2) ^ rotr32(a, 13) ^ rotr32(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
		h = g; g = f; f = e; e = d + t1; d = c; c = b; b = a; a = t1 + t2;
	}
	st[0] += a; st[1] += b; st[2] += c; st[3] += d;
	st[4] += e; st[5] += f; st[6] += g; st[7] += h;
}

/* SHA-256 of len bytes; out gets 32 bytes. */
void tract_sha256(const void *data, uint64_t len, uint8_t *out)
{
	uint32_t st[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a,
			  0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
	const uint8_t *p = data;
	uint64_t n = len;
	for (; n >= 64; n -= 64, p += 64)
		sha256_block(st, p);
	uint8_t last[128];
	memset(last, 0, sizeof(last));
	memcpy(last, p, n);
	last[n] = 0x80;
	uint64_t total = n + 1 + 8 <= 64 ? 64 : 128;
	uint64_t bits = len * 8;
	for (int i = 0; i < 8; i++)
		last[total - 1 - i] = (uint8_t)(bits >> (8 * i));
	sha256_block(st, last);
	if (total == 128)
		sha256_block(st, last + 64);
	for (int i = 0; i < 8; i++) {
		out[4 * i] = (uint8_t)(st[i] >> 24);
		out[4 * i + 1] = (uint8_t)(st[i] >> 16);
		out[4 * i + 2] = (uint8_t)(st[i] >> 8);
		out[4 * i + 3] = (uint8_t)st[i];
	}
}

/* ---- chains ---- */

/* CBOR head of a major type and argument, canonical (shortest) form (internal) */
static uint64_t cbor_head(uint8_t *p, uint8_t major, uint64_t v)
{
	major <<= 5;
	if (v < 24) {
		p[0] = major | (uint8_t)v;
		return 1;
	}
	if (v < 256) {
		p[0] = major | 24;
		p[1] = (uint8_t)v;
		return 2;
	}
	if (v < 65536) {
		p[0] = major | 25;
		p[1] = (uint8_t)(v >> 8);
		p[2] = (uint8_t)v;
		return 3;
	}
	if (v <= 0xffffffffULL) {
		p[0] = major | 26;
		for (int i = 0; i < 4; i++)
			p[1 + i] = (uint8_t)(v >> (24 - 8 * i));
		return 5;
	}
	p[0] = major | 27;
	for (int i = 0; i < 8; i++)
		p[1 + i] = (uint8_t)(v >> (56 - 8 * i));
	return 9;
}

/* vLLM's NONE_HASH: SHA-256 of the canonical CBOR text string SEED (len bytes
 * of UTF-8); out gets 32 bytes. */
int tract_vllm_root(const char *seed, uint64_t len, uint8_t *out)
{
	if ((!seed && len) || !out || len > (1u << 20))
		return TRACT_E_INVAL;
	uint8_t *buf = malloc(9 + len);
	if (!buf)
		return TRACT_E_NOMEM;
	uint64_t n = cbor_head(buf, 3, len);
	if (len)
		memcpy(buf + n, seed, len);
	tract_sha256(buf, n + len, out);
	free(buf);
	return TRACT_OK;
}

/* Block hashes of the full blocks of a prompt; out gets n_blocks * hash_bytes.
 * For the vLLM scheme EXTRA is a cache salt (UTF-8), entering the first
 * block's extra keys as [salt]. */
int tract_hash_chain(uint32_t scheme, const int32_t *tokens, uint64_t n_tokens,
		     uint32_t block_tokens, const uint8_t *root, const uint8_t *extra,
		     uint64_t extra_len, uint8_t *out, uint64_t out_cap_blocks)
{
	if (!root || (!tokens && n_tokens) || block_tokens < 1 ||
	    block_tokens > TRACT_HASH_MAX_BLOCK_TOKENS || (!extra && extra_len) ||
	    extra_len > TRACT_HASH_MAX_EXTRA)
		return TRACT_E_INVAL;
	uint64_t blocks = n_tokens / block_tokens;
	if (blocks > out_cap_blocks || (!out && blocks))
		return TRACT_E_RANGE;
	uint32_t sign = 0;   /* OR of all ids: one vectorizable pass */
	for (uint64_t i = 0; i < blocks * block_tokens; i++)
		sign |= (uint32_t)tokens[i];
	if (sign >> 31)
		return TRACT_E_INVAL;
	uint8_t buf[32 + 16 + TRACT_HASH_MAX_BLOCK_TOKENS * 9 + TRACT_HASH_MAX_EXTRA + 16];
	if (scheme == TRACT_HASH_TRACT && block_tokens % 4 == 0 && extra_len == 0) {
		/* fast path: parent and tokens are whole 16-byte blocks, hashed in
		 * place (same bytes as the general path below) */
		const uint8_t *prev = root;
		uint64_t len = 16 + (uint64_t)block_tokens * 4;
		for (uint64_t b = 0; b < blocks; b++) {
			uint64_t h1 = 0, h2 = 0;
			mm3_body(&h1, &h2, prev, 1);
			mm3_body(&h1, &h2, (const uint8_t *)(tokens + b * block_tokens), block_tokens / 4);
			mm3_final(h1, h2, len, out + b * 16);
			prev = out + b * 16;
		}
		return TRACT_OK;
	}
	if (scheme == TRACT_HASH_TRACT) {
		const uint8_t *prev = root;
		for (uint64_t b = 0; b < blocks; b++) {
			uint64_t n = 0;
			memcpy(buf, prev, 16);
			n += 16;
			memcpy(buf + n, tokens + b * block_tokens, (uint64_t)block_tokens * 4);
			n += (uint64_t)block_tokens * 4;
			if (extra_len)
				memcpy(buf + n, extra, extra_len);
			n += extra_len;
			tract_murmur3_128(buf, n, 0, out + b * 16);
			prev = out + b * 16;
		}
		return TRACT_OK;
	}
	if (scheme == TRACT_HASH_VLLM_SHA256_CBOR) {
		const uint8_t *prev = root;
		for (uint64_t b = 0; b < blocks; b++) {
			uint64_t n = 0;
			buf[n++] = 0x83;                      /* array(3) */
			n += cbor_head(buf + n, 2, 32);       /* bytes(32): parent */
			memcpy(buf + n, prev, 32);
			n += 32;
			n += cbor_head(buf + n, 4, block_tokens);
			for (uint32_t t = 0; t < block_tokens; t++)
				n += cbor_head(buf + n, 0, (uint64_t)tokens[b * block_tokens + t]);
			if (b == 0 && extra) {                /* [salt]: the cache salt */
				buf[n++] = 0x81;              /* array(1) */
				n += cbor_head(buf + n, 3, extra_len);
				memcpy(buf + n, extra, extra_len);
				n += extra_len;
			} else {
				buf[n++] = 0xf6;              /* null: no extra keys */
			}
			tract_sha256(buf, n, out + b * 32);
			prev = out + b * 32;
		}
		return TRACT_OK;
	}
	return TRACT_E_INVAL;
}
