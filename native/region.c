/*
 * region.c -- format, verify, attach and pre-fault a region.
 *
 * Formatting writes only metadata: it zeroes the metadata sections (the
 * all-zero state is every section's initial state), then writes the header
 * with its magic last, so a region whose formatting was interrupted never
 * looks formatted.  Verification never trusts the header: it checks magic,
 * version, checksum and size, then recomputes the layout from the header's
 * parameters and rejects any layout table that differs.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "internal.h"

#ifndef MADV_POPULATE_READ
#define MADV_POPULATE_READ 22
#endif
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23
#endif

/* fills a header from parameters and layout (magic and crc left zero) (internal) */
static void build_header(struct tract_header *h, const struct tract_format_params *p,
			 const struct tract_section *s, uint32_t nsec, uint64_t slots,
			 uint32_t locks)
{
	memset(h, 0, sizeof(*h));
	h->format_version = TRACT_FORMAT_VERSION;
	h->header_size = TRACT_HEADER_SIZE;
	memcpy(h->uuid, p->uuid, 16);
	h->region_size = p->region_size;
	h->alignment = p->alignment;
	h->flush_mode = p->flush_mode;
	h->max_nodes = p->max_nodes;
	h->created_ns = p->created_ns;
	h->flags = p->flags;
	h->block_tokens = p->block_tokens;
	h->num_layers = p->num_layers;
	h->num_kv_heads = p->num_kv_heads;
	h->head_dim = p->head_dim;
	h->dtype = p->dtype;
	h->dtype_bytes = p->dtype_bytes;
	h->bytes_per_token = (uint64_t)p->num_layers * 2 * p->num_kv_heads * p->head_dim *
			     p->dtype_bytes;
	h->block_bytes = h->bytes_per_token * p->block_tokens;
	h->slot_stride = s[nsec - 1].entry_size;
	h->slot_count = slots;
	memcpy(h->model_fingerprint, p->model_fingerprint, 32);
	memcpy(h->model_name, p->model_name, 32);
	h->model_name[31] = 0;
	h->hash_scheme = p->hash_scheme;
	memcpy(h->hash_seed, p->hash_seed, 16);
	h->lock_count = locks;
	h->index_stripes = locks - TRACT_FIXED_LOCKS;
	h->section_count = nsec;
	memcpy(h->sections, s, nsec * sizeof(*s));
}

/* CRC of a header with its crc field taken as zero (internal) */
static uint32_t header_crc(const struct tract_header *h)
{
	return tract_crc32(h, offsetof(struct tract_header, header_crc32));
}

/* Formats the mapped region at base: writes metadata sections, then the header. */
int tract_format(void *base, const struct tract_format_params *p)
{
	struct tract_section s[TRACT_MAX_SECTIONS];
	uint32_t nsec, locks;
	uint64_t slots;
	if (!base || !p)
		return TRACT_E_INVAL;
	int rc = tract_layout_compute(p, s, &nsec, &slots, &locks);
	if (rc)
		return rc;
	if (!tract_flush_mode_supported(p->flush_mode))
		return TRACT_E_FLUSH_UNSUPPORTED;
	/* the formatting host flushes with clflush whatever mode the region
	 * will run with, so its writes reach the device even on clwb hosts */
	int fm = p->flush_mode == TRACT_FLUSH_NONE ? TRACT_FLUSH_NONE : TRACT_FLUSH_CLFLUSH;
	uint8_t *b = base;

	/* 1. kill the magic first: an interrupted format is never "formatted" */
	memset(b, 0, 8);
	tract_flush_lines(fm, b, 8);
	__sync_synchronize();

	/* 2. every metadata section to its all-zero initial state */
	uint64_t meta_end = s[nsec - 1].offset;
	memset(b + TRACT_HEADER_SIZE, 0, meta_end - TRACT_HEADER_SIZE);
	tract_flush_lines(fm, b + TRACT_HEADER_SIZE, meta_end - TRACT_HEADER_SIZE);
	__sync_synchronize();

	/* 3. the header body, then the magic */
	struct tract_header h;
	build_header(&h, p, s, nsec, slots, locks);
	memcpy(h.magic, TRACT_MAGIC, 8);
	h.header_crc32 = header_crc(&h);
	memcpy(b + 8, (uint8_t *)&h + 8, sizeof(h) - 8);
	tract_flush_lines(fm, b, sizeof(h));
	__sync_synchronize();
	memcpy(b, h.magic, 8);
	tract_flush_lines(fm, b, 8);
	__sync_synchronize();
	return TRACT_OK;
}

/* Checks the header at base against the mapped size; fills *out on success. */
int tract_verify_header(const void *base, uint64_t mapped_size, struct tract_header *out)
{
	struct tract_header h;
	if (!base)
		return TRACT_E_INVAL;
	if (mapped_size < TRACT_HEADER_SIZE)
		return TRACT_E_NOT_FORMATTED;
	/* observe: another host wrote the header, drop any cached copy */
	if (tract_cpu_features() & TRACT_CPU_CLFLUSH)
		tract_flush_lines(TRACT_FLUSH_CLFLUSH, base, TRACT_HEADER_SIZE);
	__sync_synchronize();
	memcpy(&h, base, sizeof(h));
	if (memcmp(h.magic, TRACT_MAGIC, 8))
		return TRACT_E_NOT_FORMATTED;
	if (h.format_version != TRACT_FORMAT_VERSION)
		return TRACT_E_VERSION;
	if (h.header_crc32 != header_crc(&h))
		return TRACT_E_CHECKSUM;
	if (h.header_size != TRACT_HEADER_SIZE)
		return TRACT_E_LAYOUT;
	if (h.region_size > mapped_size)
		return TRACT_E_SIZE;
	if (h.flags & ~(uint32_t)TRACT_HDR_KNOWN_FLAGS)
		return TRACT_E_LAYOUT;          /* a flag this build does not know how to honour */

	/* recompute the layout from the header's own parameters */
	struct tract_format_params p;
	memset(&p, 0, sizeof(p));
	p.region_size = h.region_size;
	p.alignment = h.alignment;
	p.max_nodes = h.max_nodes;
	p.flush_mode = h.flush_mode;
	p.block_tokens = h.block_tokens;
	p.num_layers = h.num_layers;
	p.num_kv_heads = h.num_kv_heads;
	p.head_dim = h.head_dim;
	p.dtype = h.dtype;
	p.dtype_bytes = h.dtype_bytes;
	p.hash_scheme = h.hash_scheme;
	p.index_stripes = h.index_stripes;
	p.transfer_entries = h.section_count == TRACT_SECTION_COUNT ? (uint32_t)h.sections[9].count : 0;
	struct tract_section s[TRACT_MAX_SECTIONS];
	uint32_t nsec, locks;
	uint64_t slots;
	if (h.section_count != TRACT_SECTION_COUNT || h.index_stripes == 0 || h.sections[9].count == 0 ||
	    h.sections[9].count > (1u << 20))
		return TRACT_E_LAYOUT;
	if (tract_layout_compute(&p, s, &nsec, &slots, &locks))
		return TRACT_E_LAYOUT;
	if (nsec != h.section_count || slots != h.slot_count || locks != h.lock_count ||
	    memcmp(s, h.sections, nsec * sizeof(*s)))
		return TRACT_E_LAYOUT;
	uint64_t bpt = (uint64_t)h.num_layers * 2 * h.num_kv_heads * h.head_dim * h.dtype_bytes;
	if (h.bytes_per_token != bpt || h.block_bytes != bpt * h.block_tokens ||
	    h.slot_stride != s[nsec - 1].entry_size)
		return TRACT_E_LAYOUT;
	if (out)
		memcpy(out, &h, sizeof(h));
	return TRACT_OK;
}

/* Attaches to a formatted region mapped at base; flush_mode < 0 uses the header's. */
int tract_attach(void *base, uint64_t mapped_size, int flush_mode, uint32_t flags,
		 uint32_t node_id, tract_region **out)
{
	if (!out)
		return TRACT_E_INVAL;
	*out = NULL;
	tract_region *r = calloc(1, sizeof(*r));
	if (!r)
		return TRACT_E_NOMEM;
	int rc = tract_verify_header(base, mapped_size, &r->hdr);
	if (rc)
		goto fail;
	rc = TRACT_E_INVAL;
	if (node_id >= r->hdr.max_nodes)
		goto fail;
	int mode = flush_mode < 0 ? (int)r->hdr.flush_mode : flush_mode;
	if (!tract_plain_ops(mode))
		goto fail;
	rc = TRACT_E_FLUSH_UNSUPPORTED;
	if (!tract_flush_mode_supported(mode))
		goto fail;
	rc = TRACT_E_NOMEM;
	r->held = calloc(r->hdr.lock_count, 1);
	r->held_seq = calloc(r->hdr.lock_count, sizeof(*r->held_seq));
	if (!r->held || !r->held_seq)
		goto fail;
	pthread_mutex_init(&r->held_mu, NULL);
	r->base = base;
	r->size = r->hdr.region_size;
	r->flags = flags;
	r->node_id = node_id;
	r->flush_mode = mode;
	r->ops = tract_plain_ops(mode);
	if (flags & TRACT_ATTACH_SIMULATE) {
		/* the simulator models a non-coherent host, where "none" is never
		 * correct: it runs with clflush semantics instead */
		if (mode == TRACT_FLUSH_NONE)
			r->flush_mode = TRACT_FLUSH_CLFLUSH;
		rc = tract_sim_create(r);
		if (rc)
			goto fail;
		r->ops = &tract_sim_ops;
	}
	*out = r;
	return TRACT_OK;
fail:
	free(r->held);
	free(r->held_seq);
	free(r);
	return rc;
}

/* Releases a handle from tract_attach (the mapping itself is not unmapped). */
void tract_detach(tract_region *r)
{
	if (!r)
		return;
	if (r->local)
		tract_journal_close(r);
	tract_sim_destroy(r);
	pthread_mutex_destroy(&r->held_mu);
	free(r->held);
	free(r->held_seq);
	free(r);
}

/* Returns the flush mode the handle runs with. */
int tract_region_flush_mode(const tract_region *r)
{
	return r ? r->flush_mode : TRACT_E_INVAL;
}

/* Returns the name of the accessor table in use ("clflush", "sim", ...). */
const char *tract_region_ops_name(const tract_region *r)
{
	return r ? r->ops->name : "";
}

/* Pre-faults [0, len) of a mapping so first requests do not pay page faults. */
int tract_prefault(void *base, uint64_t len, int writable)
{
	if (!base)
		return TRACT_E_INVAL;
	if (madvise(base, len, writable ? MADV_POPULATE_WRITE : MADV_POPULATE_READ) == 0)
		return TRACT_OK;
	if (errno != EINVAL && errno != ENOSYS)
		return TRACT_E_SYS;
	/* kernels before 5.14: touch one byte per page with a load, which maps
	 * the page without writing anything to shared memory */
	long page = sysconf(_SC_PAGESIZE);
	volatile const uint8_t *p = base;
	uint8_t sink = 0;
	for (uint64_t off = 0; off < len; off += (uint64_t)page)
		sink ^= p[off];
	(void)sink;
	return TRACT_OK;
}
