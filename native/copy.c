/*
 * copy.c -- KV payload copies (docs/ARCHITECTURE.md §6, docs/PROTOCOLS.md §1.1).
 *
 * Payload is not published line by line: above the non-temporal threshold
 * it is written with streaming stores (which bypass this host's caches) and
 * one sfence; below it, with ordinary stores followed by a flush of the
 * touched lines.  The payload becomes visible to other hosts only through
 * the later publication of its metadata.
 *
 * The widest streaming store the CPU offers is chosen once, at first use.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if defined(__x86_64__)
#include <immintrin.h>

/* streams 256-byte chunks with AVX-512; dst 64-aligned, n multiple of 256 (internal) */
__attribute__((target("avx512f"))) static void stream_avx512(uint8_t *dst, const uint8_t *src,
							     uint64_t n)
{
	for (uint64_t i = 0; i < n; i += 256) {
		if (i + 1024 < n)   /* never a line past the source: the next slot's */
			__builtin_prefetch(src + i + 1024);
		__m512i a = _mm512_loadu_si512((const void *)(src + i));
		__m512i b = _mm512_loadu_si512((const void *)(src + i + 64));
		__m512i c = _mm512_loadu_si512((const void *)(src + i + 128));
		__m512i d = _mm512_loadu_si512((const void *)(src + i + 192));
		_mm512_stream_si512((void *)(dst + i), a);
		_mm512_stream_si512((void *)(dst + i + 64), b);
		_mm512_stream_si512((void *)(dst + i + 128), c);
		_mm512_stream_si512((void *)(dst + i + 192), d);
	}
}

/* streams 256-byte chunks with AVX2; dst 64-aligned, n multiple of 256 (internal) */
__attribute__((target("avx2"))) static void stream_avx2(uint8_t *dst, const uint8_t *src,
							uint64_t n)
{
	for (uint64_t i = 0; i < n; i += 256) {
		if (i + 1024 < n)   /* never a line past the source: the next slot's */
			__builtin_prefetch(src + i + 1024);
		for (int k = 0; k < 256; k += 128) {
			__m256i a = _mm256_loadu_si256((const __m256i *)(src + i + k));
			__m256i b = _mm256_loadu_si256((const __m256i *)(src + i + k + 32));
			__m256i c = _mm256_loadu_si256((const __m256i *)(src + i + k + 64));
			__m256i d = _mm256_loadu_si256((const __m256i *)(src + i + k + 96));
			_mm256_stream_si256((__m256i *)(dst + i + k), a);
			_mm256_stream_si256((__m256i *)(dst + i + k + 32), b);
			_mm256_stream_si256((__m256i *)(dst + i + k + 64), c);
			_mm256_stream_si256((__m256i *)(dst + i + k + 96), d);
		}
	}
}

/* streams 256-byte chunks with SSE2 (x86-64 baseline) (internal) */
static void stream_sse2(uint8_t *dst, const uint8_t *src, uint64_t n)
{
	for (uint64_t i = 0; i < n; i += 256) {
		if (i + 1024 < n)   /* never a line past the source: the next slot's */
			__builtin_prefetch(src + i + 1024);
		for (int k = 0; k < 256; k += 64) {
			__m128i a = _mm_loadu_si128((const __m128i *)(src + i + k));
			__m128i b = _mm_loadu_si128((const __m128i *)(src + i + k + 16));
			__m128i c = _mm_loadu_si128((const __m128i *)(src + i + k + 32));
			__m128i d = _mm_loadu_si128((const __m128i *)(src + i + k + 48));
			_mm_stream_si128((__m128i *)(dst + i + k), a);
			_mm_stream_si128((__m128i *)(dst + i + k + 16), b);
			_mm_stream_si128((__m128i *)(dst + i + k + 32), c);
			_mm_stream_si128((__m128i *)(dst + i + k + 48), d);
		}
	}
}

typedef void (*stream_fn)(uint8_t *, const uint8_t *, uint64_t);

/* picks the widest streaming routine once; threads that race here all pick
 * the same one, through an atomic (a plain static was a data race) (internal) */
static stream_fn stream_routine(void)
{
	static stream_fn fn;
	stream_fn got = __atomic_load_n(&fn, __ATOMIC_ACQUIRE);
	if (!got) {
		uint32_t f = tract_cpu_features();
		got = (f & TRACT_CPU_AVX512F) ? stream_avx512
		    : (f & TRACT_CPU_AVX2)    ? stream_avx2
					      : stream_sse2;
		__atomic_store_n(&fn, got, __ATOMIC_RELEASE);
	}
	return got;
}

/* copy with streaming stores for the 64-aligned bulk, memcpy for edges (internal) */
static void copy_nt(uint8_t *dst, const uint8_t *src, uint64_t n)
{
	uint64_t head = (64 - ((uintptr_t)dst & 63)) & 63;
	if (head > n)
		head = n;
	memcpy(dst, src, head);
	dst += head, src += head, n -= head;
	uint64_t bulk = n & ~(uint64_t)255;
	if (bulk)
		stream_routine()(dst, src, bulk);
	memcpy(dst + bulk, src + bulk, n - bulk);
	_mm_sfence();
}

/* rewrites whole 256-byte chunks in place with the streaming routine: each
 * chunk is loaded (from the cache, where it is dirty) before any of it is
 * streamed, which also drops its lines from the cache; p 64-aligned, n a
 * multiple of 256 (internal) */
static void restream(uint8_t *p, uint64_t n)
{
	if (n)
		stream_routine()(p, p, n);
}
#else
static void restream(uint8_t *p, uint64_t n)
{
	(void)p;
	(void)n;
}
static void copy_nt(uint8_t *dst, const uint8_t *src, uint64_t n)
{
	memcpy(dst, src, n);
	__sync_synchronize();
}
#endif

/*
 * Writes back to the device the payload a zero-copy writer (plain stores) or a
 * GPU's DMA (which DDIO may leave dirty in the last-level cache) put in
 * [off, off+len), before its READY is published (internal).  In clflush mode
 * the whole 256-byte chunks are streamed back in place by the copy routine
 * (read from the cache, written with non-temporal stores, one fence): the
 * payload path ARCHITECTURE.md §6 and PROTOCOLS.md §1.1 sanction for CPU writers, at
 * memory speed, where a serialized clflush of every line cost ~2 s per
 * 750 MiB; the unaligned head and the last partial chunk take clflush.  clflushopt and clwb modes use their instruction, fenced.
 */
void tract_write_back_payload(tract_region *r, uint64_t off, uint64_t len)
{
	tract_payload_forget_range(r, off, len);   /* clwb keeps the lines here */
	if (r->sim || r->flush_mode != TRACT_FLUSH_CLFLUSH || tract_payload_strict()) {
		r->ops->flush(r, off, len);
		r->ops->fence(r);
		return;
	}
	uint8_t *p = r->base + off;
	uint64_t head = (64 - ((uintptr_t)p & 63)) & 63;
	if (head > len)
		head = len;
	tract_flush_lines(TRACT_FLUSH_CLFLUSH, p, head);
	uint64_t bulk = (len - head) & ~(uint64_t)255;
	restream(p + head, bulk);
	tract_flush_lines(TRACT_FLUSH_CLFLUSH, p + head + bulk, len - head - bulk);
	__sync_synchronize();     /* mfence: the streaming stores drain before anything later */
}

/* copies with the core's copy routine: non-temporal stores above the
 * threshold, else memcpy (internal) */
static void memcpy_nt(void *dst, const void *src, uint64_t len)
{
	if (len >= tract_movnt_threshold())
		copy_nt(dst, src, len);
	else
		memcpy(dst, src, len);
}

/* Copies len bytes from private memory into the region (NT stores above threshold). */
int tract_copy_in(tract_region *r, uint64_t dst_off, const void *src, uint64_t len)
{
	if (!r || !src)
		return TRACT_E_INVAL;
	if (!tract_in_bounds(r, dst_off, len))
		return TRACT_E_RANGE;
	if (r->flags & TRACT_ATTACH_READONLY)
		return TRACT_E_INVAL;
	uint8_t *dst = r->base + dst_off;
	tract_payload_forget_range(r, dst_off, len);   /* its partial lines stay cached */
	if (r->sim) {
		/* streaming stores bypass the cache and drop any cached copy of
		 * the lines they write: the simulated cache lets go of the range
		 * (writing back what this process left dirty there), then the
		 * bytes go straight to the mapping */
		r->ops->invalidate(r, dst_off, len);
		memcpy(dst, src, len);
		__sync_synchronize();
		return TRACT_OK;
	}
	if (len >= tract_movnt_threshold()) {
		copy_nt(dst, src, len);
		/* what copy_nt did not stream went through the cache: the unaligned
		 * head, and everything past the last whole 256-byte chunk (up to
		 * 255 bytes): write it back (the same arithmetic as copy_nt) */
		uint64_t head = (64 - ((uintptr_t)dst & 63)) & 63;
		if (head > len)
			head = len;
		uint64_t bulk = (len - head) & ~(uint64_t)255;
		tract_flush_lines(r->flush_mode, dst, head);
		tract_flush_lines(r->flush_mode, dst + head + bulk, len - head - bulk);
	} else {
		memcpy(dst, src, len);
		tract_flush_lines(r->flush_mode, dst, len);
	}
	__sync_synchronize();
	return TRACT_OK;
}

/* loads len payload bytes at off into private memory: through the simulated
 * cache in simulator mode (a stale line stays visible), else with the core's
 * copy routine (internal) */
static void load_payload(tract_region *r, void *dst, uint64_t off, uint64_t len)
{
	if (r->sim)
		r->ops->load(r, off, dst, len);
	else
		memcpy_nt(dst, r->base + off, len);
}

/* Copies len bytes from the region into private memory; evicts the range first if
 * asked (a range no payload tag vouches for: key lists, tails, offline checks). */
int tract_copy_out(tract_region *r, void *dst, uint64_t src_off, uint64_t len, int invalidate)
{
	if (!r || !dst)
		return TRACT_E_INVAL;
	if (!tract_in_bounds(r, src_off, len))
		return TRACT_E_RANGE;
	/* an invalidating copy is a load outside tract_payload_acquire (a key
	 * list, a tail): the node's ledger stops vouching for what it loads;
	 * without invalidate the caller acquired the range (payload.c) */
	int announced = invalidate ? tract_payload_forget_range(r, src_off, len) : 1;
	if (invalidate) {
		/* a reused slot may still sit in this host's cache: evict it first
		 * (clean lines: weakly ordered eviction and one fence, payload.c) */
		tract_evict_clean(r, src_off, len);
		r->ops->fence(r);
	}
	load_payload(r, dst, src_off, len);
	if (invalidate && !announced) {
		/* no ledger to tell (an offline or read-only handle: `tract check`
		 * on a live node): leave none of these lines behind, so a slot the
		 * node's sweep calls EVICTED stays so */
		tract_evict_clean(r, src_off, len);
		r->ops->fence(r);
	}
	return TRACT_OK;
}

/* A GPU path's checksum as each layer's DMA lands: see tract.h.  The write-back
 * is tract_write_back_payload's (thread-safe: the ledger's stores are atomic,
 * the slots' ranges disjoint), right after the register read the bytes.  In
 * clflush mode the two are one pass: the checksum's copy routine streams the
 * bytes back in place as it reads them (each 64-byte piece loaded before its
 * own non-temporal store: what write-back's restream does, read once instead
 * of twice), its unaligned head and short tail written back with clflush by
 * the routine, and one fence at the end. */
int tract_checksum_slots_part(tract_region *r, const uint32_t *slots, uint32_t n, uint64_t off,
			      uint64_t len, uint32_t *regs, int write_back)
{
	if (!r || ((!slots || !regs) && n) || (write_back && (r->flags & TRACT_ATTACH_READONLY)))
		return TRACT_E_INVAL;
	if (off > r->hdr.block_bytes || len > r->hdr.block_bytes - off)
		return TRACT_E_RANGE;
	for (uint32_t i = 0; i < n; i++)
		if (slots[i] >= r->hdr.slot_count)
			return TRACT_E_RANGE;
	const struct tract_section *data = tract_sec(r, TRACT_SEC_DATA);
	uint8_t *buf = NULL;
	if (r->sim && n && len && !(buf = malloc(len)))
		return TRACT_E_NOMEM;
	int fused = write_back && !r->sim && r->flush_mode == TRACT_FLUSH_CLFLUSH &&
		    !tract_payload_strict();
	for (uint32_t i = 0; i < n; i++) {
		uint64_t at = data->offset + (uint64_t)slots[i] * r->hdr.slot_stride + off;
		if (fused) {
			tract_payload_forget_range(r, at, len);
			regs[i] = tract_crc32c_copy(regs[i], r->base + at, r->base + at, len,
						    TRACT_FLUSH_CLFLUSH);
			continue;
		}
		if (buf)    /* the simulator: what this process's loads would see */
			r->ops->load(r, at, buf, len);
		regs[i] = tract_crc32c_copy(regs[i], NULL, buf ? buf : r->base + at, len, -1);
		if (write_back)
			tract_write_back_payload(r, at, len);
	}
	if (fused)
		__sync_synchronize();   /* mfence: the streaming stores drain before anything later */
	free(buf);
	return TRACT_OK;
}

/* CRC-32C of each of n slots' whole payload, in place (zero-copy writers record
 * it at commit, zero-copy readers compare it before use); the caller invalidates
 * first where another host may have written the slots. */
int tract_checksum_slots(tract_region *r, const uint32_t *slots, uint32_t n, uint32_t *out)
{
	if (!r || ((!slots || !out) && n))
		return TRACT_E_INVAL;
	for (uint32_t i = 0; i < n; i++)
		out[i] = 0xFFFFFFFFu;
	int rc = tract_checksum_slots_part(r, slots, n, 0, r->hdr.block_bytes, out, 0);
	for (uint32_t i = 0; i < n; i++)
		out[i] = ~out[i];
	return rc;
}
