/*
 * payload.c -- making KV payload that other hosts wrote safe to load
 * (docs/ARCHITECTURE.md §6; the argument is docs/PROTOCOLS.md §1.1).
 *
 * A reader must never load a stale line of a reused slot: a line this host
 * cached while the slot held an earlier block.  Evicting the whole slot
 * before every read is correct but sits on the KV path (with clflushopt
 * about half a memcpy of the bytes; with serialized clflush 25 memcpys).
 *
 * The payload ledger (node-local DRAM, one u64 per slot, shared by the
 * node's processes as they share its caches) holds, per slot, the tag of
 * the payload whose lines this node's caches may hold.  A tag names one
 * write of a slot: the index bucket that published it and that bucket's
 * epoch, which every claim of the bucket bumps (index_put.c), so a tag never
 * names two payloads.  0 is "unknown" and vouches for nothing.
 *
 * Invariant: ledger[s] == T != 0 and s holds payload T  =>  every line of s
 * in this node's caches was loaded while s held T (is not stale).
 * Kept because the ledger turns T only after an eviction of s, fenced,
 * made while the reader holds a pin on T (s held T already and keeps it
 * while pinned); any line loaded since (by a reader, a prefetcher or a
 * speculative load) was loaded from T.  When s holds another payload U, U
 * has another tag, so its first reader here evicts again.
 *
 * Eviction of these clean lines is weakly ordered clflushopt (clflush where
 * the CPU lacks it) and one fence per batch: the paper's requirement of
 * serialized clflush is about dirty data reaching the device before a
 * release is seen, which a reader's clean lines never need (§1.1).
 */
#include <stdlib.h>

#include "internal.h"

/* ledger values no tag can take (a tag's low half is a bucket + 1 < 2^32 - 1):
 * EVICTED vouches for every payload -- this node's caches hold no line of the
 * slot (a sweep evicted it after its payload died, and no reader or writer
 * of this node touched it since); EVICTING marks a sweep at work and, like 0,
 * vouches for nothing */
#define LEDGER_EVICTED TRACT_LEDGER_EVICTED
#define LEDGER_EVICTING 0xFFFFFFFFull

/* what a reader of an EVICTED slot still evicts at each end of it */
#define EDGE_BYTES 2048ull

static int ledger_sentinel(uint64_t v)
{
	return (uint32_t)v == UINT32_MAX;
}

/* region offset of slot s's payload (internal) */
static uint64_t slot_offset(const tract_region *r, uint32_t s)
{
	return tract_sec(r, TRACT_SEC_DATA)->offset + (uint64_t)s * r->hdr.slot_stride;
}

/* the ledger this handle reads and writes: the node's, shared by its
 * processes as they share the host's caches (the simulator's cache is the
 * node's too, sim.c); a simulated handle without a local segment has a
 * cache of its own, so it gets a ledger of its own too (internal) */
static uint64_t *payload_ledger(tract_region *r)
{
	if (r->local)
		return tract_ledger(r);
	return r->sim ? tract_sim_ledger(r) : NULL;
}

/*
 * Makes n slots safe to load from (zero-copy views, copies, GPU DMA, which
 * snoops this host's caches) for the payloads tags[i] (0 or tags NULL:
 * unknown): evicts this node's cached lines of every slot the ledger does
 * not vouch for, fences once, then records the tags.  The caller holds a
 * pin (or a handoff) on every tagged payload.  *evicted (may be NULL) gets
 * the count of slots evicted.
 */
int tract_payload_acquire(tract_region *r, const uint32_t *slots, const uint64_t *tags,
			  uint32_t n, uint32_t *evicted)
{
	if (!r || (!slots && n))
		return TRACT_E_INVAL;
	for (uint32_t i = 0; i < n; i++) {
		if (slots[i] >= r->hdr.slot_count)
			return TRACT_E_RANGE;
		if (tags && ledger_sentinel(tags[i]))
			return TRACT_E_INVAL;   /* not a tag a lookup returns */
	}
	uint64_t *ledger = payload_ledger(r);
	uint32_t count = 0, edges = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint64_t tag = tags ? tags[i] : 0;
		uint64_t held = ledger ? __atomic_load_n(&ledger[slots[i]], __ATOMIC_SEQ_CST) : 0;
		/* this node can hold only lines of this very payload */
		if (tag && held == tag)
			continue;
		/* or none, but near the slot's ends: a loop or prefetcher running
		 * past a neighbour's end (the next-page prefetcher, speculation)
		 * can load its first or last page unannounced (PROTOCOLS.md §1.1) */
		if (held == LEDGER_EVICTED && !tract_payload_strict()) {
			/* (a slot of two pages or less: all of it; *evicted counts
			 * only the slots the ledger did not vouch for) */
			uint64_t off = slot_offset(r, slots[i]), bb = r->hdr.block_bytes;
			uint64_t edge = bb < 2 * EDGE_BYTES ? (bb + 1) / 2 : EDGE_BYTES;
			if (TRACT_KEEP(SITE_PAYLOAD_EVICT)) {
				tract_evict_clean(r, off, edge);
				tract_evict_clean(r, off + bb - edge, edge);
			}
			edges++;
			continue;
		}
		if (TRACT_KEEP(SITE_PAYLOAD_EVICT))
			tract_evict_clean(r, slot_offset(r, slots[i]), r->hdr.block_bytes);
		count++;
	}
	if (count || edges)
		r->ops->fence(r);     /* the evictions complete before any later load */
	/* only now may another process of the node skip its own eviction; a
	 * slot the ledger called EVICTED stops being so before its first load */
	for (uint32_t i = 0; ledger && i < n; i++) {
		uint64_t tag = tags ? tags[i] : 0;
		if (__atomic_load_n(&ledger[slots[i]], __ATOMIC_RELAXED) != tag)
			__atomic_store_n(&ledger[slots[i]], tag, __ATOMIC_SEQ_CST);
	}
	if (evicted)
		*evicted = count;
	return TRACT_OK;
}

/* Returns the payload tag the ledger holds for a slot (0: none or unknown). */
uint64_t tract_payload_ledger(const tract_region *r, uint32_t slot)
{
	uint64_t *ledger = r ? payload_ledger((tract_region *)r) : NULL;
	if (!ledger || slot >= r->hdr.slot_count)
		return 0;
	return __atomic_load_n(&ledger[slot], __ATOMIC_ACQUIRE);
}

/* Forgets what the ledger vouches for of n slots this node is about to write
 * or load outside tract_payload_acquire: a writer's lines may stay in this
 * node's caches (clwb, the partial lines of a streamed copy, a zero-copy
 * writer's stores), so no slot it writes may stay EVICTED, and a sweep that
 * raced the write must fail (sweep below).  Also for a reader that loaded
 * past its handoff's expiry (tract.h). */
int tract_payload_forget(tract_region *r, const uint32_t *slots, uint32_t n)
{
	if (!r || (!slots && n))
		return TRACT_E_INVAL;
	uint64_t *ledger = payload_ledger(r);
	for (uint32_t i = 0; ledger && i < n && TRACT_KEEP(SITE_PAYLOAD_FORGET); i++)
		if (slots[i] < r->hdr.slot_count)
			__atomic_store_n(&ledger[slots[i]], 0, __ATOMIC_SEQ_CST);
	return TRACT_OK;
}

/* as tract_payload_forget, for the slots a region range [off, off + len)
 * overlaps; 0 if this handle has no ledger to tell (internal) */
int tract_payload_forget_range(tract_region *r, uint64_t off, uint64_t len)
{
	const struct tract_section *data = tract_sec(r, TRACT_SEC_DATA);
	uint64_t *ledger = payload_ledger(r);
	if (!ledger)
		return 0;
	if (!len || !r->hdr.slot_stride || off + len <= data->offset)
		return 1;
	uint64_t lo = off > data->offset ? (off - data->offset) / r->hdr.slot_stride : 0;
	uint64_t hi = (off + len - 1 - data->offset) / r->hdr.slot_stride;
	for (uint64_t s = lo; s <= hi && s < r->hdr.slot_count && TRACT_KEEP(SITE_PAYLOAD_FORGET); s++)
		__atomic_store_n(&ledger[s], 0, __ATOMIC_SEQ_CST);
	return 1;
}

/* true if no payload can be live in slot s: not claimed from the pool, or in
 * this node's free list; `line` caches the last bitmap line observed (internal) */
static int slot_free(tract_region *r, uint32_t s, uint64_t *line_off, uint8_t line[TRACT_LINE],
		     int observe)
{
	const uint8_t *local = r->local ? (const uint8_t *)r->local + r->local->free_bits_off : NULL;
	if (local && (__atomic_load_n(&local[s / 8], __ATOMIC_ACQUIRE) & (1u << (s % 8))))
		return 1;
	uint64_t off = tract_sec(r, TRACT_SEC_BITMAP)->offset + (uint64_t)(s / 512) * TRACT_LINE;
	if (*line_off != off + 1) {
		if (observe)
			tract_observe_line(r, off, line);
		else
			r->ops->load(r, off, line, TRACT_LINE);   /* a hint: maybe stale */
		*line_off = off + 1;
	}
	uint32_t b = s % 512;
	return !(line[b / 8] & (1u << (b % 8)));
}

/*
 * Evicts, off the request path, the slots whose payload this node read and
 * that has since died (or that no payload holds), so the first read of the
 * slot's next payload here evicts nothing: the node agent calls this every
 * heartbeat (docs/PROTOCOLS.md §1.1).  Visits up to max_slots slots from
 * *cursor (advanced, wrapping), evicts at most max_bytes of them; *swept
 * (may be NULL) gets how many became EVICTED.
 *
 * Per slot: mark it EVICTING (a CAS from the value read; a batch of marks
 * first), *then* decide it is
 * dead, evict, fence, and CAS EVICTING -> EVICTED.  Any reader or writer of
 * the node that comes in between stores to the entry, so the last CAS fails.
 * Deciding after the mark is what makes a stale decision harmless: a payload
 * that was dead then never lives again (tags are unique), and a slot found
 * free after the mark was not yet handed to a writer of this node (the
 * allocator forgets a slot's entry after taking it from the free list).
 */
int tract_payload_sweep(tract_region *r, uint32_t *cursor, uint32_t max_slots, uint64_t max_bytes,
			uint32_t *swept)
{
	if (!r || !cursor)
		return TRACT_E_INVAL;
	if (swept)
		*swept = 0;
	uint64_t *ledger = payload_ledger(r);
	uint64_t count = r->hdr.slot_count;
	if (!ledger || !count || !r->hdr.block_bytes || tract_payload_strict())
		return TRACT_OK;
	/* flush mode none evicts nothing: this handle cannot vouch for a slot to
	 * the node's readers that do evict (the mode is per process) */
	if (!r->sim && r->flush_mode == TRACT_FLUSH_NONE)
		return TRACT_OK;
	/* hardware prefetchers stay inside a 4 KiB page: a slot that shares a
	 * page with its neighbour could get lines from the neighbour's reads */
	if ((slot_offset(r, 0) | r->hdr.slot_stride) & 4095)
		return TRACT_OK;
	uint64_t room = max_bytes / r->hdr.block_bytes;
	uint64_t cap = room < max_slots ? room : max_slots;
	uint32_t *marked = malloc(cap * sizeof(uint32_t) + 4);
	uint64_t *was = malloc(cap * sizeof(uint64_t) + 8);
	if (!marked || !was) {
		free(marked);
		free(was);
		return TRACT_E_NOMEM;
	}
	uint32_t s = *cursor < count ? *cursor : 0, n = 0;
	uint64_t line_off = 0, hint_off = 0;
	uint8_t line[TRACT_LINE], hint[TRACT_LINE];
	/* 1. mark the candidates */
	for (uint32_t k = 0; k < max_slots && k < count && n < cap; k++, s = (s + 1) % count) {
		uint64_t v = __atomic_load_n(&ledger[s], __ATOMIC_SEQ_CST);
		if (ledger_sentinel(v))
			continue;
		/* a first look, unmarked: a live payload (being read, most likely)
		 * is left alone, not marked EVICTING under its reader's feet (a
		 * reader that found EVICTING would evict the whole slot).  Only a
		 * hint: the decision that counts comes after the mark.  A plain
		 * load first; a "live" it sees is confirmed from the device (one
		 * observe of the bucket line per live candidate, off the request
		 * path): this node's readers keep the bucket lines they observed in
		 * its caches, clean and stale once the block is evicted elsewhere
		 * (since format 4 nothing a lookup writes evicts them), and a stale
		 * "live" would spare a dead payload pass after pass.  (A stale
		 * bitmap line can still spare a slot freed elsewhere until it
		 * leaves this host's caches: a cost, not an error) */
		if (!slot_free(r, s, &hint_off, hint, 0) &&
		    (!v || (TRACT_KEEP(SITE_PAYLOAD_SWEEP_LIVE) && tract_index_tag_live(r, v, s, 0) &&
			    tract_index_tag_live(r, v, s, 1))))
			continue;
		if (!__atomic_compare_exchange_n(&ledger[s], &v, LEDGER_EVICTING, 0,
						 __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST))
			continue;                       /* somebody is using it */
		marked[n] = s;
		was[n++] = v;
	}
	/* 2. the decision that counts, after every mark, observed (each bitmap
	 * line once); what is not dead gets back what it vouched for */
	uint32_t dead = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t m = marked[i];
		uint64_t v = was[i];
		if (slot_free(r, m, &line_off, line, 1) ||
		    (v && (!TRACT_KEEP(SITE_PAYLOAD_SWEEP_LIVE) || !tract_index_tag_live(r, v, m, 1)))) {
			marked[dead++] = m;
			continue;
		}
		uint64_t mark = LEDGER_EVICTING;
		__atomic_compare_exchange_n(&ledger[m], &mark, v, 0, __ATOMIC_SEQ_CST,
					    __ATOMIC_SEQ_CST);
	}
	free(was);
	n = dead;
	*cursor = s;
	for (uint32_t i = 0; i < n; i++)
		if (TRACT_KEEP(SITE_PAYLOAD_SWEEP_EVICT))
			tract_evict_clean(r, slot_offset(r, marked[i]), r->hdr.block_bytes);
	if (n)
		r->ops->fence(r);
	uint32_t done = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint64_t mark = LEDGER_EVICTING;
		done += __atomic_compare_exchange_n(&ledger[marked[i]], &mark, LEDGER_EVICTED, 0,
						    __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
	}
	free(marked);
	if (swept)
		*swept = done;
	return TRACT_OK;
}
