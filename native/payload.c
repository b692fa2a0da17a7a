/*
 * payload.c -- making KV payload that other hosts wrote safe to load
 * (DESIGN.md §4; the argument is docs/PROTOCOLS.md §1.1).
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
 * epoch, which every claim of the bucket bumps (index.c), so a tag never
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
#include "internal.h"

/* region offset of slot s's payload (internal) */
static uint64_t slot_offset(const tract_region *r, uint32_t s)
{
	return tract_sec(r, TRACT_SEC_DATA)->offset + (uint64_t)s * r->hdr.slot_stride;
}

/* the ledger this handle reads and writes: the node's, shared by its
 * processes as they share the host's caches; under the simulator each process
 * has a cache of its own, so it gets a ledger of its own too (sim.c) (internal) */
static uint64_t *payload_ledger(tract_region *r)
{
	if (r->sim)
		return tract_sim_ledger(r);
	return r->local ? tract_ledger(r) : NULL;
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
	for (uint32_t i = 0; i < n; i++)
		if (slots[i] >= r->hdr.slot_count)
			return TRACT_E_RANGE;
	uint64_t *ledger = payload_ledger(r);
	uint32_t count = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint64_t tag = tags ? tags[i] : 0;
		if (tag && ledger && __atomic_load_n(&ledger[slots[i]], __ATOMIC_ACQUIRE) == tag)
			continue;      /* this node can hold only lines of this very payload */
		if (TRACT_KEEP(SITE_PAYLOAD_EVICT))
			tract_evict_clean(r, slot_offset(r, slots[i]), r->hdr.block_bytes);
		count++;
	}
	if (count)
		r->ops->fence(r);     /* the evictions complete before any later load */
	/* only now may another process of the node skip its own eviction */
	for (uint32_t i = 0; ledger && i < n; i++) {
		uint64_t tag = tags ? tags[i] : 0;
		if (__atomic_load_n(&ledger[slots[i]], __ATOMIC_RELAXED) != tag)
			__atomic_store_n(&ledger[slots[i]], tag, __ATOMIC_RELEASE);
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
