/*
 * crc.c -- CRC-32C (Castagnoli), the block checksum, and the copy that
 * computes it as it moves KV (kvpages.c).
 *
 * Three paths, chosen by cpu.c's detection (the one path every feature
 * takes, TRACT_NO_* included):
 *   - carry-less multiply folding (PCLMULQDQ; 512 bits at a time with
 *     AVX-512 VPCLMULQDQ, 256 with AVX2 VPCLMULQDQ): four accumulators
 *     folded forward over the data.  Where the bytes come from the caches
 *     the multiplies bind, not the memory: on AMD Zen 3 the 128-bit form
 *     folds ~6-7 GB/s a core and the 256-bit form ~14 (the 512-bit one
 *     more where AVX-512 has it), so each CPU takes the widest it has;
 *   - the SSE4.2 crc32 instruction, 8 bytes at a time: one dependency chain
 *     (~8-9 GB/s on AMD Zen 3; three interleaved chains checksum faster but
 *     copy slower than the 256-bit fold, docs/BENCHMARKS.md);
 *   - bit by bit (no SSE4.2: slow but right).
 *
 * Folding, in the reflected bit order the CRC uses (bit 0 of the first byte
 * is the highest power): a 128-bit accumulator X stands for every byte so far
 * modulo P.  Moving it d bits on is X*x^d = lo*x^(64+d) + hi*x^d; each
 * 64-bit half is multiplied (carry-less) by the residue of x^(64+d-1) or
 * x^(d-1) (one power lower: the product of two reflected numbers comes out
 * shifted by one bit), which lands aligned with the next 128 data bits, and
 * they are XORed in.  At the end the accumulators fold into one, and the
 * crc32 instruction over its 16 bytes gives the register (X is congruent to
 * the data).  The residues are computed here once, not tabled.
 */
#include <pthread.h>
#include <string.h>

#include "internal.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

#define CASTAGNOLI 0x11EDC6F41ull       /* P, with its x^32 term */

/* CRC-32C register (no pre/post inversion) over n bytes, bit by bit (internal) */
static uint32_t crc_soft(uint32_t c, const uint8_t *p, uint64_t n)
{
	for (uint64_t i = 0; i < n; i++) {
		c ^= p[i];
		for (int k = 0; k < 8; k++)
			c = (c >> 1) ^ (0x82F63B78u & (0u - (c & 1u)));
	}
	return c;
}

#if defined(__x86_64__)
/* x^n mod P, bit-reflected into 64 bits (coefficient c at bit 63 - c) (internal) */
static uint64_t xpow_reflected(unsigned n)
{
	uint64_t r = 1;
	for (unsigned i = 0; i < n; i++) {
		r <<= 1;
		if (r >> 32)
			r ^= CASTAGNOLI;
	}
	uint64_t out = 0;
	for (int c = 0; c < 32; c++)
		if ((r >> c) & 1)
			out |= 1ull << (63 - c);
	return out;
}

/* fold constants per distance in bits: {x^(64+d-1), x^(d-1)} mod P, reflected */
static uint64_t k128[2], k256[2], k384[2], k512[2], k768[2], k1024[2], k1536[2], k2048[2];
static pthread_once_t constants_once = PTHREAD_ONCE_INIT;

static void make_constants(void)
{
	struct { uint64_t *k; unsigned d; } all[] = {{k128, 128}, {k256, 256}, {k384, 384},
						     {k512, 512}, {k768, 768}, {k1024, 1024},
						     {k1536, 1536}, {k2048, 2048}};
	for (unsigned i = 0; i < sizeof all / sizeof all[0]; i++) {
		all[i].k[0] = xpow_reflected(64 + all[i].d - 1);
		all[i].k[1] = xpow_reflected(all[i].d - 1);
	}
}

/* the register over n bytes with the crc32 instruction, copying them to dst
 * when dst is not NULL (plain stores) (internal) */
__attribute__((target("sse4.2"))) static uint32_t crc_hw(uint32_t c32, uint8_t *dst,
							 const uint8_t *p, uint64_t n)
{
	uint64_t c = c32;
	uint64_t i = 0;
	for (; i + 8 <= n; i += 8) {
		uint64_t v;
		memcpy(&v, p + i, 8);
		c = __builtin_ia32_crc32di(c, v);
		if (dst)
			memcpy(dst + i, &v, 8);
	}
	c32 = (uint32_t)c;
	for (; i < n; i++) {
		c32 = __builtin_ia32_crc32qi(c32, p[i]);
		if (dst)
			dst[i] = p[i];
	}
	return c32;
}

__attribute__((target("pclmul,sse4.2"))) static inline __m128i fold128(__m128i x, const uint64_t *k)
{
	__m128i kk = _mm_loadu_si128((const __m128i *)(const void *)k);
	return _mm_xor_si128(_mm_clmulepi64_si128(x, kk, 0x00), _mm_clmulepi64_si128(x, kk, 0x11));
}

/* the register of the 16 bytes x stands for (internal) */
__attribute__((target("pclmul,sse4.2"))) static inline uint32_t finish128(__m128i x)
{
	uint64_t c = __builtin_ia32_crc32di(0, (uint64_t)_mm_cvtsi128_si64(x));
	return (uint32_t)__builtin_ia32_crc32di(c, (uint64_t)_mm_extract_epi64(x, 1));
}

/* stores 16 bytes: streaming when nt (dst 16-aligned), else plain (internal) */
__attribute__((target("sse4.2"))) static inline void put128(uint8_t *dst, __m128i v, int nt)
{
	if (nt)
		_mm_stream_si128((__m128i *)(void *)dst, v);
	else
		_mm_storeu_si128((__m128i *)(void *)dst, v);
}

/* folds 64 bytes at a time (n >= 128), 128-bit registers; the bytes past the
 * last whole 64 through crc_hw (internal) */
__attribute__((target("pclmul,sse4.2"))) static uint32_t fold_sse(uint32_t c, uint8_t *dst,
								  const uint8_t *s, uint64_t n,
								  int nt)
{
	__m128i x[4];
	for (int j = 0; j < 4; j++) {
		x[j] = _mm_loadu_si128((const __m128i *)(const void *)(s + 16 * j));
		if (dst)
			put128(dst + 16 * j, x[j], nt);
	}
	x[0] = _mm_xor_si128(x[0], _mm_cvtsi32_si128((int)c));
	uint64_t i = 64;
	for (; i + 64 <= n; i += 64)
		for (int j = 0; j < 4; j++) {
			__m128i d = _mm_loadu_si128((const __m128i *)(const void *)(s + i + 16 * j));
			if (dst)
				put128(dst + i + 16 * j, d, nt);
			x[j] = _mm_xor_si128(fold128(x[j], k512), d);
		}
	__m128i y = _mm_xor_si128(_mm_xor_si128(fold128(x[0], k384), fold128(x[1], k256)),
				  _mm_xor_si128(fold128(x[2], k128), x[3]));
	return crc_hw(finish128(y), dst ? dst + i : NULL, s + i, n - i);
}

/* as fold_sse, 128 bytes at a time in 256-bit registers (n >= 128; dst
 * 32-aligned when nt); the rest through fold_sse or crc_hw (internal) */
__attribute__((target("avx2,vpclmulqdq,pclmul,sse4.2"))) static uint32_t
fold_avx2(uint32_t c, uint8_t *dst, const uint8_t *s, uint64_t n, int nt)
{
#define K256OF(k) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(k)))
	const __m256i ky1024 = K256OF(k1024), ky768 = K256OF(k768), ky512 = K256OF(k512),
		      ky256 = K256OF(k256);
#undef K256OF
	__m256i x[4];
	for (int j = 0; j < 4; j++) {
		x[j] = _mm256_loadu_si256((const __m256i *)(const void *)(s + 32 * j));
		if (dst) {
			if (nt)
				_mm256_stream_si256((__m256i *)(void *)(dst + 32 * j), x[j]);
			else
				_mm256_storeu_si256((__m256i *)(void *)(dst + 32 * j), x[j]);
		}
	}
	x[0] = _mm256_xor_si256(x[0], _mm256_zextsi128_si256(_mm_cvtsi32_si128((int)c)));
	uint64_t i = 128;
	for (; i + 128 <= n; i += 128)
		for (int j = 0; j < 4; j++) {
			__m256i d = _mm256_loadu_si256((const __m256i *)(const void *)(s + i + 32 * j));
			if (dst) {
				if (nt)
					_mm256_stream_si256((__m256i *)(void *)(dst + i + 32 * j), d);
				else
					_mm256_storeu_si256((__m256i *)(void *)(dst + i + 32 * j), d);
			}
			x[j] = _mm256_xor_si256(_mm256_xor_si256(_mm256_clmulepi64_epi128(x[j], ky1024, 0x00),
								 _mm256_clmulepi64_epi128(x[j], ky1024, 0x11)),
						d);
		}
	/* four accumulators 768, 512, 256 and 0 bits from the end: into one */
	__m256i y = x[3];
	const __m256i *ks[3] = {&ky768, &ky512, &ky256};
	for (int j = 0; j < 3; j++)
		y = _mm256_xor_si256(y, _mm256_xor_si256(_mm256_clmulepi64_epi128(x[j], *ks[j], 0x00),
							 _mm256_clmulepi64_epi128(x[j], *ks[j], 0x11)));
	/* its two 128-bit lanes, 128 and 0 bits from the end */
	__m128i z = _mm_xor_si128(fold128(_mm256_castsi256_si128(y), k128),
				  _mm256_extracti128_si256(y, 1));
	uint32_t reg = finish128(z);
	dst = dst ? dst + i : NULL;
	s += i, n -= i;
	return n >= 128 ? fold_sse(reg, dst, s, n, nt) : crc_hw(reg, dst, s, n);
}

/* as fold_sse, 256 bytes at a time in 512-bit registers (n >= 256); the rest
 * through fold_sse or crc_hw (internal) */
__attribute__((target("avx512f,avx512bw,vpclmulqdq,pclmul,sse4.2"))) static uint32_t
fold_avx512(uint32_t c, uint8_t *dst, const uint8_t *s, uint64_t n, int nt)
{
#define K512OF(k) _mm512_broadcast_i32x4(_mm_loadu_si128((const __m128i *)(const void *)(k)))
	const __m512i kz2048 = K512OF(k2048), kz1536 = K512OF(k1536), kz1024 = K512OF(k1024),
		      kz512 = K512OF(k512);
#undef K512OF
	__m512i x[4];
	for (int j = 0; j < 4; j++) {
		x[j] = _mm512_loadu_si512((const void *)(s + 64 * j));
		if (dst) {
			if (nt)
				_mm512_stream_si512((void *)(dst + 64 * j), x[j]);
			else
				_mm512_storeu_si512((void *)(dst + 64 * j), x[j]);
		}
	}
	x[0] = _mm512_xor_si512(x[0], _mm512_zextsi128_si512(_mm_cvtsi32_si128((int)c)));
	uint64_t i = 256;
	for (; i + 256 <= n; i += 256)
		for (int j = 0; j < 4; j++) {
			__m512i d = _mm512_loadu_si512((const void *)(s + i + 64 * j));
			if (dst) {
				if (nt)
					_mm512_stream_si512((void *)(dst + i + 64 * j), d);
				else
					_mm512_storeu_si512((void *)(dst + i + 64 * j), d);
			}
			/* x*K (both halves) XOR d, in one ternary logic op */
			x[j] = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x[j], kz2048, 0x00),
							 _mm512_clmulepi64_epi128(x[j], kz2048, 0x11),
							 d, 0x96);
		}
	/* four accumulators 1536, 1024, 512 and 0 bits from the end: into one */
	__m512i y = x[3];
	const __m512i *ks[3] = {&kz1536, &kz1024, &kz512};
	for (int j = 0; j < 3; j++)
		y = _mm512_ternarylogic_epi64(_mm512_clmulepi64_epi128(x[j], *ks[j], 0x00),
					      _mm512_clmulepi64_epi128(x[j], *ks[j], 0x11), y, 0x96);
	/* its four 128-bit lanes, 384, 256, 128 and 0 bits from the end */
	__m128i z = _mm_xor_si128(
		_mm_xor_si128(fold128(_mm512_extracti32x4_epi32(y, 0), k384),
			      fold128(_mm512_extracti32x4_epi32(y, 1), k256)),
		_mm_xor_si128(fold128(_mm512_extracti32x4_epi32(y, 2), k128),
			      _mm512_extracti32x4_epi32(y, 3)));
	uint32_t reg = finish128(z);
	dst = dst ? dst + i : NULL;
	s += i, n -= i;
	return n >= 128 ? fold_sse(reg, dst, s, n, nt) : crc_hw(reg, dst, s, n);
}
#endif

/* the path a long buffer takes on this CPU (cpu.c's features, TRACT_NO_*
 * included): crc_update's one choice, and what tract_crc_path reports */
static int long_path(void)
{
#if defined(__x86_64__)
	uint32_t f = tract_cpu_features();
	if (!(f & TRACT_CPU_SSE42))
		return TRACT_CRC_BITWISE;
	if (!(f & TRACT_CPU_PCLMUL))
		return TRACT_CRC_INSTRUCTION;
	if (f & TRACT_CPU_VPCLMUL512)
		return TRACT_CRC_FOLD512;
	if (f & TRACT_CPU_VPCLMUL256)
		return TRACT_CRC_FOLD256;
	return TRACT_CRC_FOLD128;
#else
	return TRACT_CRC_BITWISE;
#endif
}

/* the register over n bytes, copied to dst when not NULL (internal) */
static uint32_t crc_update(uint32_t c, uint8_t *dst, const uint8_t *src, uint64_t n, int nt)
{
#if defined(__x86_64__)
	int path = long_path();
	if (path != TRACT_CRC_BITWISE) {
		if (path != TRACT_CRC_INSTRUCTION && n >= 128) {
			pthread_once(&constants_once, make_constants);
			if (path == TRACT_CRC_FOLD512 && n >= 256)
				return fold_avx512(c, dst, src, n, nt);
			if (path == TRACT_CRC_FOLD256 && n >= 256)
				return fold_avx2(c, dst, src, n, nt);
			return fold_sse(c, dst, src, n, nt);
		}
		return crc_hw(c, dst, src, n);
	}
#endif
	(void)nt;
	if (dst)
		memcpy(dst, src, n);
	return crc_soft(c, src, n);
}

/* The path (TRACT_CRC_*) the block checksum takes over a long buffer here. */
int tract_crc_path(void)
{
	return long_path();
}

/* CRC-32C (Castagnoli) of len bytes, as used for block checksums. */
uint32_t tract_crc32c(const void *buf, uint64_t len)
{
	return ~crc_update(0xFFFFFFFFu, NULL, buf, len, 0);
}

/* Copies n bytes src -> dst advancing the CRC-32C register reg (no inversion)
 * over them.  flush_mode < 0: plain stores (dst private memory); else the
 * destination is the region: streaming stores, and the bytes that cannot
 * stream (an unaligned head, the last bytes) are written back in that flush
 * mode; the caller fences (internal) */
uint32_t tract_crc32c_copy(uint32_t reg, void *dst, const void *src, uint64_t n, int flush_mode)
{
	uint8_t *d = dst;
	const uint8_t *s = src;
	uint64_t head = (64 - ((uintptr_t)d & 63)) & 63;
	if (head > n)
		head = n;
	/* only the folding paths stream (crc_hw and the bitwise path store
	 * plainly), and TRACT_NO_MOVNT or the threshold may refuse streaming */
	uint32_t f = tract_cpu_features();
	int streams = flush_mode >= 0 && (f & TRACT_CPU_SSE42) && (f & TRACT_CPU_PCLMUL) &&
		      n - head >= 128 && n >= tract_movnt_threshold();
	if (!streams) {
		reg = crc_update(reg, d, s, n, 0);
		if (flush_mode >= 0)      /* all of it went through the cache */
			tract_flush_lines(flush_mode, d, n);
		return reg;
	}
	/* streaming stores need a 64-aligned destination: the head goes plain */
	reg = crc_update(reg, d, s, head, 0);
	reg = crc_update(reg, d + head, s + head, n - head, 1);
	tract_flush_lines(flush_mode, d, head);
	/* what went plain at the end: under 128 bytes (fold_sse's and crc_hw's tails) */
	tract_flush_lines(flush_mode, d + n - 128, 128);
	return reg;
}
