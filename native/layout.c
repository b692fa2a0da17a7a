/*
 * layout.c -- sizing and placement of the region's sections, and CRC-32.
 *
 * The layout is a pure function of the format parameters, so a reader can
 * recompute it from the header and reject a layout table that disagrees.
 */
#include <string.h>

#include "internal.h"

#define PAGE 4096ULL
#define DATA_ALIGN_MAX (2ULL << 20)
#define MAX_SLOTS 0xFFFFFFFEULL

/* rounds v up to a multiple of a (a power of two) (internal) */
static uint64_t round_up(uint64_t v, uint64_t a)
{
	return (v + a - 1) & ~(a - 1);
}

/* true if v is a power of two (internal) */
static int is_pow2(uint64_t v)
{
	return v && !(v & (v - 1));
}

/* smallest power of two >= v (internal) */
static uint64_t next_pow2(uint64_t v)
{
	uint64_t p = 1;
	while (p < v)
		p <<= 1;
	return p;
}

/* bytes per element of a dtype, 0 if unknown (tract.h) */
uint32_t tract_dtype_size(uint32_t dtype)
{
	switch (dtype) {
	case TRACT_DTYPE_F16:
	case TRACT_DTYPE_BF16:
		return 2;
	case TRACT_DTYPE_F32:
		return 4;
	case TRACT_DTYPE_FP8:
		return 1;
	default:
		return 0;
	}
}

/* validates parameters and derives block bytes, stripes, transfer entries (internal) */
static int check_params(const struct tract_format_params *p, uint64_t *block_bytes,
			uint32_t *stripes, uint32_t *transfers)
{
	if (!is_pow2(p->alignment) || p->alignment < PAGE)
		return TRACT_E_INVAL;
	if (p->region_size == 0 || p->region_size % p->alignment)
		return TRACT_E_ALIGN;
	if (p->max_nodes < 1 || p->max_nodes > TRACT_MAX_NODES)
		return TRACT_E_INVAL;
	if (p->flush_mode > TRACT_FLUSH_CLWB)
		return TRACT_E_INVAL;
	if (p->hash_scheme != TRACT_HASH_TRACT && p->hash_scheme != TRACT_HASH_VLLM_SHA256_CBOR)
		return TRACT_E_INVAL;
	uint32_t es = tract_dtype_size(p->dtype);
	if (!es || p->dtype_bytes != es)
		return TRACT_E_INVAL;
	if (p->block_tokens < 1 || p->block_tokens > 4096 || p->num_layers < 1 ||
	    p->num_layers > 4096 || p->num_kv_heads < 1 || p->num_kv_heads > 4096 ||
	    p->head_dim < 1 || p->head_dim > 8192)
		return TRACT_E_INVAL;
	/* each factor is bounded above, so this product fits in 64 bits */
	uint64_t bb = (uint64_t)p->block_tokens * p->num_layers * 2 * p->num_kv_heads *
		      p->head_dim * es;
	if (bb > (1ULL << TRACT_MAX_BLOCK_SHIFT))
		return TRACT_E_INVAL;
	uint32_t st = p->index_stripes ? p->index_stripes : TRACT_DEFAULT_INDEX_STRIPES;
	if (!is_pow2(st) || st > 4096)
		return TRACT_E_INVAL;
	uint32_t te = p->transfer_entries ? p->transfer_entries : TRACT_DEFAULT_TRANSFER_ENTRIES;
	if (te > (1u << 20))
		return TRACT_E_INVAL;
	*block_bytes = bb;
	*stripes = st;
	*transfers = te;
	return TRACT_OK;
}

/* places every section for n slots; returns the end of the data area (internal) */
static uint64_t place(const struct tract_format_params *p, uint64_t stride, uint32_t stripes,
		      uint32_t transfers, uint64_t n, struct tract_section *s)
{
	uint64_t nodes = p->max_nodes;
	/* a stripe spans at least 32 buckets, so one line of a node's pin
	 * array (32 u16 counts) never covers two stripes: its writer is always
	 * the holder of one stripe lock */
	uint64_t buckets = next_pow2(2 * n);
	if (buckets < (uint64_t)stripes * 32)
		buckets = (uint64_t)stripes * 32;
	uint64_t event_log = buckets / stripes;      /* a power of two, >= 32 */
	if (event_log > TRACT_EVENT_LOG_MAX)
		event_log = TRACT_EVENT_LOG_MAX;
	struct { uint32_t kind; uint64_t entry; uint64_t count; uint64_t length; } spec[] = {
		{TRACT_SEC_LOCKS, (nodes + 1) * TRACT_LINE, TRACT_FIXED_LOCKS + stripes, 0},
		{TRACT_SEC_NODES, TRACT_NODE_ENTRY_SIZE, nodes, 0},
		{TRACT_SEC_OBJDIR, TRACT_LINE, TRACT_OBJDIR_ENTRIES, 0},
		{TRACT_SEC_ALLOC, TRACT_LINE, TRACT_ALLOC_LINES, 0},
		{TRACT_SEC_BITMAP, 0, n, round_up((n + 7) / 8, TRACT_LINE)},
		{TRACT_SEC_OWNERS, 1, n, round_up(n, TRACT_LINE)},
		{TRACT_SEC_BUCKETS, TRACT_LINE, buckets, 0},
		{TRACT_SEC_PINS, round_up(buckets * 2, TRACT_LINE), nodes, 0},
		{TRACT_SEC_LRU, TRACT_LINE, stripes, 0},
		{TRACT_SEC_TRANSFER, TRACT_TRANSFER_ENTRY_SIZE, transfers, 0},
		/* a stripe's log holds as many events as the stripe has buckets
		 * (at least twice the slots; at most TRACT_EVENT_LOG_MAX): a reader
		 * falls behind only when more than a whole turnover of its stripe
		 * happened between two of its reads (docs/PROTOCOLS.md §13) */
		{TRACT_SEC_EVENTS, (event_log + 1) * TRACT_LINE, stripes, 0},
		{TRACT_SEC_RECORDS, tract_record_size(p->block_tokens), n, 0},
	};
	uint64_t off = TRACT_HEADER_SIZE;
	uint32_t i = 0;
	for (; i < sizeof(spec) / sizeof(spec[0]); i++) {
		uint64_t len = spec[i].length ? spec[i].length : spec[i].entry * spec[i].count;
		s[i].kind = spec[i].kind;
		s[i].entry_size = (uint32_t)spec[i].entry;
		s[i].offset = off;
		s[i].length = len;
		s[i].count = spec[i].count;
		off = round_up(off + len, PAGE);
	}
	uint64_t data_align = p->alignment < DATA_ALIGN_MAX ? p->alignment : DATA_ALIGN_MAX;
	off = round_up(off, data_align);
	s[i].kind = TRACT_SEC_DATA;
	s[i].entry_size = (uint32_t)stride;
	s[i].offset = off;
	s[i].length = n * stride;
	s[i].count = n;
	return off + n * stride;
}

/* Computes the layout of a region without touching memory. */
int tract_layout_compute(const struct tract_format_params *p, struct tract_section *out,
			 uint32_t *out_count, uint64_t *out_slot_count, uint32_t *out_lock_count)
{
	uint64_t bb;
	uint32_t stripes, transfers;
	if (!p || !out)
		return TRACT_E_INVAL;
	int rc = check_params(p, &bb, &stripes, &transfers);
	if (rc)
		return rc;
	uint64_t stride = round_up(bb, TRACT_LINE);
	struct tract_section tmp[TRACT_MAX_SECTIONS];

	/* largest slot count whose metadata and data fit: binary search,
	 * since the end of the data area grows with the slot count */
	uint64_t lo = 0, hi = p->region_size / stride;
	if (hi > MAX_SLOTS)
		hi = MAX_SLOTS;
	while (lo < hi) {
		uint64_t mid = lo + (hi - lo + 1) / 2;
		if (place(p, stride, stripes, transfers, mid, tmp) <= p->region_size)
			lo = mid;
		else
			hi = mid - 1;
	}
	if (lo == 0)
		return TRACT_E_TOO_SMALL;
	place(p, stride, stripes, transfers, lo, out);
	if (out_count)
		*out_count = TRACT_SECTION_COUNT;
	if (out_slot_count)
		*out_slot_count = lo;
	if (out_lock_count)
		*out_lock_count = TRACT_FIXED_LOCKS + stripes;
	return TRACT_OK;
}

/* reflected CRC-32 of a buffer with a given polynomial, bit by bit (internal) */
uint32_t tract_crc_bitwise(uint32_t poly, const void *buf, uint64_t len)
{
	const uint8_t *p = buf;
	uint32_t c = 0xFFFFFFFFu;
	while (len--) {
		c ^= *p++;
		for (int k = 0; k < 8; k++)
			c = (c >> 1) ^ (poly & (0u - (c & 1)));
	}
	return c ^ 0xFFFFFFFFu;
}

/* CRC-32 (IEEE 802.3, as zlib) of a buffer. */
uint32_t tract_crc32(const void *buf, size_t len)
{
	return tract_crc_bitwise(0xEDB88320u, buf, len);
}
