/*
 * kvpages.c -- an engine's paged KV cache to and from region slots, in one
 * call per batch of blocks (docs/ARCHITECTURE.md §12, docs/VLLM.md "The data
 * path").
 *
 * An engine keeps each layer's KV in its own tensor of pages; a region block
 * holds every layer of g tokens, as `layers` chunks of layer_bytes each.  The
 * chunk of a layer is the bytes of that layer's page (sub-block `sub` of it,
 * when a page holds several region blocks) in the order the page holds them:
 * a list of runs (offset in page 0, length), the same for every layer and
 * every page.  With one region block per page and a CPU page layout the list
 * is one run (the page), with FlashAttention's two (K, V): save and load are
 * then one contiguous copy per (layer, page).
 *
 * The CRC-32C of each block is computed as it is copied, from the registers
 * the copy holds the bytes in (crc.c's tract_crc32c_copy: carry-less
 * multiply folding, at memory speed where the CPU has it).  A save writes
 * the region with streaming stores (on the device when the call returns: the
 * commit skips its write-back, TRACT_COMMIT_STREAMED); a load reads it with
 * plain loads after the caller's tract_payload_acquire, through the simulated
 * cache in simulator mode.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#if defined(__x86_64__)
#include <immintrin.h>
#endif

/* runs shorter than this on average go through a bounce buffer: each would
 * otherwise be a copy too short to stream or to fold its checksum */
#define BOUNCE_RUN_BYTES 1024

/* checks the page description once per call: TRACT_OK or TRACT_E_INVAL (internal) */
static int check_pages(const tract_region *r, const struct tract_kv_pages *kv)
{
	if (!kv->layers || !kv->subs || !kv->bases || !kv->run_first || !kv->run_off ||
	    !kv->run_len || !kv->run_pos || !kv->layer_bytes || !kv->page_stride || !kv->elem_bytes ||
	    !kv->block_tokens || kv->layer_bytes % kv->elem_bytes)
		return TRACT_E_INVAL;
	if ((uint64_t)kv->layers * kv->layer_bytes != r->hdr.block_bytes)
		return TRACT_E_INVAL;
	if (kv->run_first[0] != 0)
		return TRACT_E_INVAL;
	/* a page size is 0 (that side untouched) or a power of two of 4 KiB or more */
	if ((kv->region_page && (kv->region_page < 4096 ||
				 (kv->region_page & (kv->region_page - 1)))) ||
	    (kv->engine_page && (kv->engine_page < 4096 ||
				 (kv->engine_page & (kv->engine_page - 1)))))
		return TRACT_E_INVAL;
	for (uint32_t j = 0; j < kv->subs; j++) {
		if (kv->run_first[j + 1] < kv->run_first[j])
			return TRACT_E_INVAL;
		uint64_t sum = 0;
		for (uint32_t i = kv->run_first[j]; i < kv->run_first[j + 1]; i++) {
			if (kv->run_pos[i] != sum || !kv->run_len[i] || kv->run_len[i] > kv->tensor_bytes ||
			    kv->run_off[i] > kv->tensor_bytes - kv->run_len[i])
				return TRACT_E_INVAL;
			sum += kv->run_len[i];
		}
		if (sum != kv->layer_bytes)
			return TRACT_E_INVAL;
	}
	return TRACT_OK;
}

/* checks one block's slot, page and sub-block against the region and the
 * engine's tensors (internal) */
static int check_block(const tract_region *r, const struct tract_kv_pages *kv, uint32_t slot,
		       uint64_t page, uint32_t sub)
{
	if (slot >= r->hdr.slot_count || sub >= kv->subs)
		return TRACT_E_RANGE;
	if (page > kv->tensor_bytes / kv->page_stride)
		return TRACT_E_RANGE;
	uint64_t at = page * kv->page_stride;
	for (uint32_t i = kv->run_first[sub]; i < kv->run_first[sub + 1]; i++)
		if (at > kv->tensor_bytes - kv->run_off[i] - kv->run_len[i])
			return TRACT_E_RANGE;
	return TRACT_OK;
}

/* the region offset of a slot's payload (internal) */
static uint64_t slot_offset(const tract_region *r, uint32_t slot)
{
	return tract_sec(r, TRACT_SEC_DATA)->offset + (uint64_t)slot * r->hdr.slot_stride;
}

/* orders 64-bit keys ascending, for qsort (internal) */
static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return (x > y) - (x < y);
}

/* the order n blocks are visited in: by ascending slot, as the hardware
 * prefetcher follows a region read forward and an allocator hands slots out
 * in any order; ties in the caller's order.  NULL where they ascend already
 * (no allocation), or where it could not be allocated (*nomem set).  Here,
 * not in the caller: each numpy call the caller saves is tens of µs inside a
 * busy engine, whose caches hold none of the interpreter (internal) */
static uint32_t *slot_order(uint32_t n, const uint32_t *slots, int *nomem)
{
	*nomem = 0;
	uint32_t i = 1;
	while (i < n && slots[i - 1] <= slots[i])
		i++;
	if (i >= n)
		return NULL;
	uint64_t *keyed = malloc((size_t)n * sizeof *keyed);
	uint32_t *order = malloc((size_t)n * sizeof *order);
	if (!keyed || !order) {
		free(keyed);
		free(order);
		*nomem = 1;
		return NULL;
	}
	for (i = 0; i < n; i++)
		keyed[i] = (uint64_t)slots[i] << 32 | i;
	qsort(keyed, n, sizeof *keyed, cmp_u64);
	for (i = 0; i < n; i++)
		order[i] = (uint32_t)keyed[i];
	free(keyed);
	return order;
}

/* the block visited k-th (internal) */
#define VISIT(order, k) ((order) ? (order)[k] : (k))

/* whether sub-block sub's runs are many and short: a layer chunk of it then
 * goes through a bounce buffer (internal) */
static int bounced(const struct tract_kv_pages *kv, uint32_t sub)
{
	uint32_t runs = kv->run_first[sub + 1] - kv->run_first[sub];
	return runs > 1 && kv->layer_bytes / runs < BOUNCE_RUN_BYTES;
}

/* whether any sub-block of the layout goes through a bounce buffer (internal) */
static int any_bounced(const struct tract_kv_pages *kv)
{
	for (uint32_t j = 0; j < kv->subs; j++)
		if (bounced(kv, j))
			return 1;
	return 0;
}

/* one load in every page [p, p + len) spans, page a power of two, none before
 * p (a page's start may lie in another slot, whose lines this node's payload
 * ledger says are not cached here): its sum, which nobody uses, keeps the
 * loads (internal) */
static uint64_t touch_range(const uint8_t *p, uint64_t len, uint64_t page)
{
	uint64_t sum = 0;
	for (uintptr_t at = (uintptr_t)p, end = at + len; at < end;
	     at = (at & ~(uintptr_t)(page - 1)) + page)
		sum += *(const volatile uint8_t *)at;
	return sum;
}

/* how many bytes of blocks ahead of the copy the touch runs: their pages'
 * translations stay in the second-level TLB (1.5-2K entries, 6-8 MiB of
 * 4 KiB pages) until the copy reaches them */
#define TOUCH_AHEAD_BYTES (4u << 20)

/*
 * Reads one byte of every page both sides of block b span, a window of
 * blocks ahead of the copy (touch_window).  Why: a request's slots are pages
 * this process has not touched for long (a save's fresh slots, the slots
 * another host's prefill wrote), whose translations are in no TLB and whose
 * page-table lines an engine's forward has pushed out of the caches.  The
 * copy would meet each page's miss in turn, with its stores (a streaming
 * store waits for its translation) and its dependent checksum holding the
 * window small; these independent loads let the CPU walk many pages at
 * once.  Inside vLLM on a VM (nested paging: a cold walk is up to ~24 memory
 * accesses) a save of 2.9 MiB took 1.7-2.3 ms without it and 0.46-0.56 ms
 * with its slots touched first, against 0.37 ms for the same save from cold
 * caches with warm translations (docs/VLLM.md "The data path").  On a device
 * mapped in 2 MiB pages the slots' side is a load per 2 MiB (internal).
 */
static uint64_t touch_block(tract_region *r, const struct tract_kv_pages *kv, uint32_t slot,
			    uint64_t page, uint32_t sub)
{
	uint64_t sum = 0;
	if (kv->region_page)
		sum += touch_range(r->base + slot_offset(r, slot), r->hdr.block_bytes,
				   kv->region_page);
	if (!kv->engine_page)
		return sum;
	/* the span of the sub-block's runs in a page (check_block: in the tensor) */
	uint64_t lo = UINT64_MAX, hi = 0;
	for (uint32_t i = kv->run_first[sub]; i < kv->run_first[sub + 1]; i++) {
		lo = kv->run_off[i] < lo ? kv->run_off[i] : lo;
		hi = kv->run_off[i] + kv->run_len[i] > hi ? kv->run_off[i] + kv->run_len[i] : hi;
	}
	for (uint32_t l = 0; l < kv->layers; l++)
		sum += touch_range((const uint8_t *)(uintptr_t)kv->bases[l] +
				   page * kv->page_stride + lo, hi - lo, kv->engine_page);
	return sum;
}

/* the blocks the touch runs ahead of the copy: TOUCH_AHEAD_BYTES of them, at
 * least one; 0 where neither side is touched (internal) */
static uint32_t touch_window(const tract_region *r, const struct tract_kv_pages *kv)
{
	if (r->sim || (!kv->region_page && !kv->engine_page))
		return 0;
	uint64_t w = TOUCH_AHEAD_BYTES / r->hdr.block_bytes;
	return w ? (uint32_t)(w < UINT32_MAX ? w : UINT32_MAX) : 1;
}

/* before the copy of the block visited k-th: the block visited window
 * blocks later is touched (at k = 0, the whole first window) (internal) */
static void touch_ahead(tract_region *r, const struct tract_kv_pages *kv, uint32_t n,
			const uint32_t *slots, const uint64_t *pages, const uint32_t *subs,
			const uint32_t *order, uint32_t k, uint32_t window)
{
	if (!window)
		return;
	uint64_t sum = 0;
	uint32_t from = k ? k + window - 1 : 0, to = k + window;   /* [from, to) */
	for (uint32_t v = from; v < to && v < n; v++) {
		uint32_t b = VISIT(order, v);
		sum += touch_block(r, kv, slots[b], pages[b], subs[b]);
	}
	(void)sum;
}

/* one block, layer chunk by layer chunk, its CRC carried through (save: page
 * -> region, streaming stores; load: region -> page).  A chunk of few long
 * runs is copied run by run; one of many short runs (a packed page layout
 * with several region blocks a page) is gathered into BUF (layer_bytes, in
 * cache) and copied as one, or copied out as one and scattered (internal) */
static uint32_t move_block(tract_region *r, const struct tract_kv_pages *kv, uint8_t *slot_base,
			   uint64_t page, uint32_t sub, int save, uint8_t *buf)
{
	uint32_t reg = 0xFFFFFFFFu;
	uint32_t first = kv->run_first[sub], end = kv->run_first[sub + 1];
	int bounce = buf && bounced(kv, sub);
	for (uint32_t l = 0; l < kv->layers; l++) {
		uint8_t *eng = (uint8_t *)(uintptr_t)kv->bases[l] + page * kv->page_stride;
		uint8_t *chunk = slot_base + (uint64_t)l * kv->layer_bytes;
		if (bounce && save) {
			for (uint32_t i = first; i < end; i++)
				memcpy(buf + kv->run_pos[i], eng + kv->run_off[i], kv->run_len[i]);
			reg = tract_crc32c_copy(reg, chunk, buf, kv->layer_bytes, r->flush_mode);
			continue;
		}
		if (bounce) {
			reg = tract_crc32c_copy(reg, buf, chunk, kv->layer_bytes, -1);
			for (uint32_t i = first; i < end; i++)
				memcpy(eng + kv->run_off[i], buf + kv->run_pos[i], kv->run_len[i]);
			continue;
		}
		for (uint32_t i = first; i < end; i++) {
			uint8_t *e = eng + kv->run_off[i], *c = chunk + kv->run_pos[i];
			reg = save ? tract_crc32c_copy(reg, c, e, kv->run_len[i], r->flush_mode)
				   : tract_crc32c_copy(reg, e, c, kv->run_len[i], -1);
		}
	}
	return ~reg;
}

/* the simulator's path for one block: every region access through the
 * simulated cache (a save as tract_copy_in's streaming stores, a load may see
 * a stale line) and the CRC over what was stored or loaded (internal) */
static uint32_t move_block_sim(tract_region *r, const struct tract_kv_pages *kv,
			       uint64_t slot_off, uint64_t page, uint32_t sub, int save)
{
	uint32_t reg = 0xFFFFFFFFu;
	for (uint32_t l = 0; l < kv->layers; l++) {
		uint64_t pos = 0;
		for (uint32_t i = kv->run_first[sub]; i < kv->run_first[sub + 1]; i++) {
			uint8_t *eng = (uint8_t *)(uintptr_t)kv->bases[l] + page * kv->page_stride +
				       kv->run_off[i];
			uint64_t off = slot_off + (uint64_t)l * kv->layer_bytes + pos;
			if (save) {
				r->ops->invalidate(r, off, kv->run_len[i]);
				memcpy(r->base + off, eng, kv->run_len[i]);
			} else {
				r->ops->load(r, off, eng, kv->run_len[i]);
			}
			/* the CRC of what was stored, or of what the loads saw */
			reg = tract_crc32c_copy(reg, NULL, eng, kv->run_len[i], -1);
			pos += kv->run_len[i];
		}
	}
	return ~reg;
}

/* zeroes the elements of CHUNK (a layer's, in run order) whose token is USED
 * or later: one pass the compiler vectorizes for 1-, 2- and 4-byte elements
 * (the per-element memset it replaces cost more than the block's copy) */
static void zero_tail(uint8_t *chunk, const uint16_t *tok, uint64_t elems, uint32_t elem_bytes,
		      uint32_t used)
{
	if (elem_bytes == 2) {
		uint16_t *e = (uint16_t *)(void *)chunk;
		for (uint64_t i = 0; i < elems; i++)
			e[i] = tok[i] < used ? e[i] : 0;
	} else if (elem_bytes == 4) {
		uint32_t *e = (uint32_t *)(void *)chunk;
		for (uint64_t i = 0; i < elems; i++)
			e[i] = tok[i] < used ? e[i] : 0;
	} else if (elem_bytes == 1) {
		for (uint64_t i = 0; i < elems; i++)
			chunk[i] = tok[i] < used ? chunk[i] : 0;
	} else {
		for (uint64_t i = 0; i < elems; i++)
			if (tok[i] >= used)
				memset(chunk + i * elem_bytes, 0, elem_bytes);
	}
}

/* a partial block (its first `used` tokens), layer by layer: each layer's
 * chunk gathered into BUF (layer_bytes, in cache), every element of a later
 * token zeroed (an engine page may hold another request's KV there, which
 * must not reach the pool), then copied into the slot as it is checksummed,
 * with streaming stores (simulator: as tract_copy_in does) (internal) */
static uint32_t save_partial(tract_region *r, const struct tract_kv_pages *kv, uint8_t *buf,
			     uint64_t slot_off, uint64_t page, uint32_t sub, uint32_t used)
{
	uint64_t elems = kv->layer_bytes / kv->elem_bytes;
	const uint16_t *tok = kv->elem_token + (uint64_t)sub * elems;
	uint32_t reg = 0xFFFFFFFFu;
	for (uint32_t l = 0; l < kv->layers; l++) {
		uint64_t pos = 0, off = slot_off + (uint64_t)l * kv->layer_bytes;
		for (uint32_t i = kv->run_first[sub]; i < kv->run_first[sub + 1]; i++) {
			memcpy(buf + pos, (const uint8_t *)(uintptr_t)kv->bases[l] +
				       page * kv->page_stride + kv->run_off[i], kv->run_len[i]);
			pos += kv->run_len[i];
		}
		zero_tail(buf, tok, elems, kv->elem_bytes, used);
		if (r->sim) {
			reg = tract_crc32c_copy(reg, NULL, buf, kv->layer_bytes, -1);
			tract_copy_in(r, off, buf, kv->layer_bytes);
		} else {
			reg = tract_crc32c_copy(reg, r->base + off, buf, kv->layer_bytes,
						r->flush_mode);
		}
	}
	return ~reg;
}

/* memcpy of every run of n blocks, no checksum, no write-back: the
 * reference a benchmark sets the kernel against (the same buffers, the same
 * runs, the same order); not a save another host can read (internal) */
static void copy_reference(tract_region *r, const struct tract_kv_pages *kv, uint32_t n,
			   const uint32_t *slots, const uint64_t *pages, const uint32_t *subs,
			   int save, const uint32_t *order)
{
	for (uint32_t k = 0; k < n; k++) {
		uint32_t b = VISIT(order, k);
		uint8_t *slot_base = r->base + slot_offset(r, slots[b]);
		for (uint32_t l = 0; l < kv->layers; l++) {
			uint8_t *eng = (uint8_t *)(uintptr_t)kv->bases[l] + pages[b] * kv->page_stride;
			uint8_t *chunk = slot_base + (uint64_t)l * kv->layer_bytes;
			for (uint32_t i = kv->run_first[subs[b]]; i < kv->run_first[subs[b] + 1]; i++) {
				uint8_t *e = eng + kv->run_off[i], *c = chunk + kv->run_pos[i];
				if (save)
					memcpy(c, e, kv->run_len[i]);
				else
					memcpy(e, c, kv->run_len[i]);
			}
		}
	}
}

/* the arguments common to save and load: TRACT_OK or the error (internal) */
static int check_call(const tract_region *r, const struct tract_kv_pages *kv, uint32_t n,
		      const uint32_t *slots, const uint64_t *pages, const uint32_t *subs,
		      const uint32_t *crcs)
{
	(void)crcs;
	if (!r || !kv || ((!slots || !pages || !subs) && n))
		return TRACT_E_INVAL;
	int rc = check_pages(r, kv);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n; i++)
		if ((rc = check_block(r, kv, slots[i], pages[i], subs[i])))
			return rc;
	return TRACT_OK;
}

/* Copies n blocks from the engine's pages into their (claimed) slots, with
 * streaming stores, and gives each block's CRC-32C; a block of fewer than
 * block_tokens tokens (tokens[i]; NULL: all full) has the rest zeroed. */
int tract_kv_save(tract_region *r, const struct tract_kv_pages *kv,
		  uint32_t n, const uint32_t *slots,
		  const uint64_t *pages, const uint32_t *subs, const uint32_t *tokens,
		  uint32_t *crcs)
{
	int rc = check_call(r, kv, n, slots, pages, subs, crcs);
	if (rc)
		return rc;
	if (r->flags & TRACT_ATTACH_READONLY)
		return TRACT_E_INVAL;
	if (!crcs && tokens)       /* a memcpy of the pages, so of a partial block's stale tokens too */
		return TRACT_E_INVAL;
	for (uint32_t i = 0; tokens && i < n; i++)
		if (!tokens[i] || tokens[i] > kv->block_tokens ||
		    (tokens[i] < kv->block_tokens && !kv->elem_token))
			return TRACT_E_INVAL;
	int nomem;
	uint32_t *order = slot_order(n, slots, &nomem);
	if (nomem)
		return TRACT_E_NOMEM;
	if (!crcs) {
		copy_reference(r, kv, n, slots, pages, subs, 1, order);
		free(order);
		return TRACT_OK;
	}
	uint8_t *buf = NULL;
	/* one chunk's bounce buffer, if the layout needs it (NULL: run by run) */
	uint8_t *bounce = n && !r->sim && any_bounced(kv) ? malloc(kv->layer_bytes) : NULL;
	/* the ledger lets go of the slots before anything of them is read here */
	for (uint32_t i = 0; i < n; i++)
		tract_payload_forget_range(r, slot_offset(r, slots[i]), r->hdr.block_bytes);
	uint32_t window = touch_window(r, kv);
	for (uint32_t k = 0; k < n; k++) {
		uint32_t i = VISIT(order, k);
		uint64_t off = slot_offset(r, slots[i]);
		touch_ahead(r, kv, n, slots, pages, subs, order, k, window);
		if (tokens && tokens[i] < kv->block_tokens) {
			if (!buf && !(buf = malloc(kv->layer_bytes))) {
				rc = TRACT_E_NOMEM;      /* the blocks before it: fenced below */
				break;
			}
			crcs[i] = save_partial(r, kv, buf, off, pages[i], subs[i], tokens[i]);
		} else if (r->sim) {
			crcs[i] = move_block_sim(r, kv, off, pages[i], subs[i], 1);
		} else {
			crcs[i] = move_block(r, kv, r->base + off, pages[i], subs[i], 1, bounce);
		}
	}
	free(buf);
	free(bounce);
	free(order);
#if defined(__x86_64__)
	_mm_sfence();    /* the streaming stores drain before any later store (the commit's) */
#endif
	__sync_synchronize();
	return rc;
}

/* Copies n blocks from their slots into the engine's pages and gives the
 * CRC-32C of each as read (the caller compares them with the recorded ones);
 * the caller acquired the slots (tract_payload_acquire). */
int tract_kv_load(tract_region *r, const struct tract_kv_pages *kv,
		  uint32_t n, const uint32_t *slots,
		  const uint64_t *pages, const uint32_t *subs, uint32_t *crcs)
{
	int rc = check_call(r, kv, n, slots, pages, subs, crcs);
	if (rc)
		return rc;
	int nomem;
	uint32_t *order = slot_order(n, slots, &nomem);
	if (nomem)
		return TRACT_E_NOMEM;
	if (!crcs) {
		copy_reference(r, kv, n, slots, pages, subs, 0, order);
		free(order);
		return TRACT_OK;
	}
	uint8_t *bounce = n && !r->sim && any_bounced(kv) ? malloc(kv->layer_bytes) : NULL;
	uint32_t window = touch_window(r, kv);
	for (uint32_t k = 0; k < n; k++) {
		uint32_t i = VISIT(order, k);
		uint64_t off = slot_offset(r, slots[i]);
		touch_ahead(r, kv, n, slots, pages, subs, order, k, window);
		crcs[i] = r->sim ? move_block_sim(r, kv, off, pages[i], subs[i], 0)
				 : move_block(r, kv, r->base + off, pages[i], subs[i], 0, bounce);
	}
	free(bounce);
	free(order);
	return TRACT_OK;
}

/* Evicts every line of n blocks' runs (slots and pages) from this host's
 * caches: clflushopt where the CPU has it, else clflush; then a fence. */
int tract_kv_evict(tract_region *r, const struct tract_kv_pages *kv, uint32_t n,
		   const uint32_t *slots, const uint64_t *pages, const uint32_t *subs)
{
	int rc = check_call(r, kv, n, slots, pages, subs, NULL);
	if (rc)
		return rc;
	uint32_t f = tract_cpu_features();
	int mode = (f & TRACT_CPU_CLFLUSHOPT) ? TRACT_FLUSH_CLFLUSHOPT
		   : (f & TRACT_CPU_CLFLUSH) ? TRACT_FLUSH_CLFLUSH : -1;
	if (mode < 0)
		return TRACT_E_FLUSH_UNSUPPORTED;
	for (uint32_t b = 0; b < n; b++) {
		const uint8_t *slot_base = r->base + slot_offset(r, slots[b]);
		tract_flush_lines(mode, slot_base, r->hdr.block_bytes);
		for (uint32_t l = 0; l < kv->layers; l++) {
			const uint8_t *eng = (const uint8_t *)(uintptr_t)kv->bases[l] +
					     pages[b] * kv->page_stride;
			for (uint32_t i = kv->run_first[subs[b]]; i < kv->run_first[subs[b] + 1]; i++)
				tract_flush_lines(mode, eng + kv->run_off[i], kv->run_len[i]);
		}
	}
	__sync_synchronize();     /* the flushes done before any later load */
	return TRACT_OK;
}
