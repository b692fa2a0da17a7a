/*
 * audit.c -- the index offline, as `tract check` sees it and `tract check
 * --repair` rebuilds it (docs/PROTOCOLS.md §11), by the same code that writes
 * the index, so that one program knows the format.
 *
 * The audit decides which live bucket its key's own rule (stripe, home,
 * probing; internal.h) can reach.  It reads only (observes), takes no lock:
 * it reports what a quiescent region holds.
 *
 * The rebuild writes the index (buckets, pins, LRU anchors) anew from the
 * READY buckets the caller keeps: each is placed from its key's home by the
 * probe of the stripe sections (tract_probe), linked into its stripe's LRU
 * list oldest first (tract_lru_push_head: the newest ends at the head), and
 * every bucket takes one epoch above all the old ones.  It takes no stripe
 * lock: the caller guarantees nobody else maps the region (check.py), and
 * writes through the section's line set, flushed and fenced per stripe, so
 * a later attach on another host observes it.
 *
 * The allocator rebuild (tract_alloc_rebuild) then writes what the repair
 * keeps of the rest: the bitmap and owner map of the kept slots, the
 * allocator header's count of them, and the transfer and lock tables empty
 * (no process that held anything there runs any more).  Here, not in
 * alloc.c: it is the same offline write, under the same guarantee (nobody
 * else maps the region, so no lock), not an allocator operation.
 */
#include <stdlib.h>
#include <string.h>

#include "index_internal.h"

/* Audits every bucket of the index: reach[i] gets TRACT_AUDIT_* for bucket
 * i, home[i] its key's home bucket and broken[i] the EMPTY bucket that breaks
 * its probe chain (0 where they do not apply); n must be the index's bucket
 * count. */
int tract_index_audit(tract_region *r, uint8_t *reach, uint64_t *home, uint64_t *broken,
		      uint64_t n)
{
	if (!r || !reach || !home || !broken)
		return TRACT_E_INVAL;
	uint64_t total = tract_index_buckets(r), size = tract_index_stripe_size(r);
	if (n != total || !size)
		return TRACT_E_INVAL;
	uint64_t off = tract_sec(r, TRACT_SEC_BUCKETS)->offset;
	uint8_t *state = malloc(size + 1);
	struct tract_bucket *stripe = malloc((size + 1) * sizeof(*stripe));
	if (!state || !stripe) {
		free(state);
		free(stripe);
		return TRACT_E_NOMEM;
	}
	for (uint32_t s = 0; s < r->hdr.index_stripes; s++) {
		uint64_t first = (uint64_t)s * size;
		/* the stripe's buckets in one observe (one fence, not one a bucket) */
		int rc = tract_observe(r, off + first * sizeof(struct tract_bucket), stripe,
				       size * sizeof(struct tract_bucket));
		if (rc < 0) {
			free(state);
			free(stripe);
			return rc;
		}
		for (uint64_t j = 0; j < size; j++)
			state[j] = (uint8_t)(stripe[j].state <= TRACT_BUCKET_TOMBSTONE ? stripe[j].state : 0xFF);
		for (uint64_t j = 0; j < size; j++) {
			uint64_t i = first + j;
			home[i] = broken[i] = 0;
			if (state[j] != TRACT_BUCKET_READY && state[j] != TRACT_BUCKET_PENDING) {
				reach[i] = TRACT_AUDIT_NOT_LIVE;
				continue;
			}
			if (tract_key_stripe(r, stripe[j].key) != s) {
				reach[i] = TRACT_AUDIT_OTHER_STRIPE;
				continue;
			}
			/* every bucket from its home up to it must be non-EMPTY */
			uint64_t k = tract_key_home(r, stripe[j].key);
			reach[i] = TRACT_AUDIT_OK;
			home[i] = first + k;
			for (; k != j; k = (k + 1) & (size - 1))
				if (state[k] == TRACT_BUCKET_EMPTY) {
					reach[i] = TRACT_AUDIT_CHAIN_BROKEN;
					broken[i] = first + k;
					break;
				}
		}
	}
	free(state);
	free(stripe);
	return TRACT_OK;
}

/* a kept bucket, in the order its stripe's LRU list takes them (internal) */
struct kept {
	uint64_t stripe;
	uint64_t last_access_ns;
	uint64_t bucket;
	const uint8_t *key;
};

/* by stripe, then oldest first, then bucket index (internal) */
static int kept_by_age(const void *a, const void *b)
{
	const struct kept *x = a, *y = b;
	if (x->stripe != y->stripe)
		return x->stripe < y->stripe ? -1 : 1;
	if (x->last_access_ns != y->last_access_ns)
		return x->last_access_ns < y->last_access_ns ? -1 : 1;
	return x->bucket < y->bucket ? -1 : x->bucket > y->bucket;
}

/* by key (internal) */
static int kept_by_key(const void *a, const void *b)
{
	return memcmp(((const struct kept *)a)->key, ((const struct kept *)b)->key, 16);
}

/* publishes len zero bytes at off, with one fence (internal) */
static int publish_zero(tract_region *r, uint64_t off, uint64_t len)
{
	if (!len)
		return TRACT_OK;
	void *z = calloc(1, len);
	if (!z)
		return TRACT_E_NOMEM;
	int rc = tract_publish(r, off, z, len);
	free(z);
	return rc;
}

/* Rebuilds the index offline from the READY buckets keep[0..n_keep) (see
 * tract.h). */
int tract_index_rebuild(tract_region *r, const uint64_t *keep, uint64_t n_keep)
{
	if (!r || (r->flags & TRACT_ATTACH_READONLY) || (n_keep && !keep))
		return TRACT_E_INVAL;
	uint64_t total = tract_index_buckets(r), size = tract_index_stripe_size(r);
	if (!size || n_keep > total)
		return TRACT_E_INVAL;
	const struct tract_section *bs = tract_sec(r, TRACT_SEC_BUCKETS);
	const struct tract_section *ps = tract_sec(r, TRACT_SEC_PINS);
	const struct tract_section *ls = tract_sec(r, TRACT_SEC_LRU);
	uint64_t anchors = (uint64_t)r->hdr.index_stripes * TRACT_LINE;
	if (bs->length < total * TRACT_LINE || ls->length < anchors)
		return TRACT_E_CORRUPT;
	int rc = TRACT_E_NOMEM;
	uint32_t slots = r->hdr.slot_count;
	struct tract_bucket *old = malloc(total * sizeof(*old));
	struct tract_bucket *fresh = calloc(1, bs->length);
	struct kept *kept = malloc((n_keep + 1) * sizeof(*kept));
	uint8_t *taken = calloc(1, total);
	uint8_t *slot_taken = calloc(1, (size_t)slots + 1);
	struct line_set *set = calloc(1, sizeof(*set));
	if (!old || !fresh || !kept || !taken || !slot_taken || !set)
		goto out;
	rc = tract_observe(r, bs->offset, old, total * sizeof(*old));
	if (rc < 0)
		goto out;
	/* what is kept: READY buckets, each once, of their key's stripe, no key
	 * twice, each naming a slot of the data area (1-based) no other names */
	rc = TRACT_E_INVAL;
	for (uint64_t i = 0; i < n_keep; i++) {
		uint64_t b = keep[i];
		if (b >= total || taken[b] || old[b].state != TRACT_BUCKET_READY ||
		    tract_key_stripe(r, old[b].key) != b / size)
			goto out;
		uint32_t slot = old[b].slot;
		if (slot < 1 || slot > slots || slot_taken[slot])
			goto out;
		taken[b] = 1;
		slot_taken[slot] = 1;
		kept[i] = (struct kept){ b / size, old[b].last_access_ns, b, old[b].key };
	}
	qsort(kept, n_keep, sizeof(*kept), kept_by_key);
	for (uint64_t i = 1; i < n_keep; i++)
		if (!memcmp(kept[i - 1].key, kept[i].key, 16))
			goto out;
	/* one epoch above every old one: a payload tag (bucket, epoch) some
	 * node's ledger holds never names a payload again (PROTOCOLS.md §1.1;
	 * past 0xffffffff it wraps to 1) */
	uint32_t epoch = 0;
	for (uint64_t i = 0; i < total; i++)
		if (old[i].epoch > epoch)
			epoch = old[i].epoch;
	epoch = epoch + 1 ? epoch + 1 : 1;
	for (uint64_t i = 0; i < total; i++)
		fresh[i].epoch = epoch;
	/* every pin count zero, the anchors of no stripe and the section's
	 * padding zero */
	if ((rc = publish_zero(r, ps->offset, ps->length)) < 0 ||
	    (rc = publish_zero(r, ls->offset + anchors, ls->length - anchors)) < 0 ||
	    (rc = tract_publish(r, bs->offset + total * TRACT_LINE, fresh + total,
				bs->length - total * TRACT_LINE)) < 0)
		goto out;
	/* then stripe by stripe: its buckets EMPTY under the new epoch, its kept
	 * buckets placed oldest first, all published before the next stripe is
	 * touched, so a repair killed midway has emptied no stripe beyond the
	 * one it was writing (run again, it finds the rest as they were) */
	qsort(kept, n_keep, sizeof(*kept), kept_by_age);
	uint64_t i = 0;
	for (uint32_t s = 0; s < r->hdr.index_stripes; s++) {
		/* the stripe's READY set changes without events: its log is moved
		 * on first, so its readers resynchronise even from a repair killed
		 * partway */
		struct stripe_ctx c;
		tract_stripe_init(r, s, &c, set);
		tract_events_skip(&c);
		tract_stripe_flush(&c);
		if ((rc = tract_publish(r, bs->offset + (uint64_t)s * size * TRACT_LINE,
					fresh + (uint64_t)s * size, size * TRACT_LINE)) < 0)
			goto out;
		tract_stripe_init(r, s, &c, set);
		struct tract_lru_anchor a = { 0 };   /* the list empty; the counters kept */
		a.hits = c.lru.hits;
		a.inserts = c.lru.inserts;
		a.evictions = c.lru.evictions;
		a.lookups = c.lru.lookups;
		c.lru = a;
		c.lru_dirty = 1;
		for (; i < n_keep && kept[i].stripe == s; i++) {
			struct tract_bucket k = old[kept[i].bucket];
			uint64_t found, free_b;
			tract_probe(&c, k.key, &found, &free_b, NULL);
			if (found != UINT64_MAX || free_b == UINT64_MAX) {
				tract_stripe_flush(&c);
				rc = TRACT_E_CORRUPT;      /* cannot happen: checked above */
				goto out;
			}
			k.reserved = 0;
			k.epoch = epoch;
			tract_lru_push_head(&c, free_b, &k);
			store_bucket(&c, free_b, &k);
		}
		tract_stripe_flush(&c);
	}
	rc = TRACT_OK;
out:
	free(old);
	free(fresh);
	free(kept);
	free(taken);
	free(slot_taken);
	free(set);
	return rc;
}

/* Rebuilds the allocator state offline from the slots keep[0..n_keep) and
 * empties the transfer and lock tables (see tract.h). */
int tract_alloc_rebuild(tract_region *r, const uint32_t *keep, uint64_t n_keep)
{
	if (!r || (r->flags & TRACT_ATTACH_READONLY) || (n_keep && !keep))
		return TRACT_E_INVAL;
	uint64_t slots = r->hdr.slot_count;
	if (n_keep > slots)
		return TRACT_E_INVAL;
	const struct tract_section *as = tract_sec(r, TRACT_SEC_ALLOC);
	const struct tract_section *bs = tract_sec(r, TRACT_SEC_BITMAP);
	const struct tract_section *os = tract_sec(r, TRACT_SEC_OWNERS);
	const struct tract_section *ts = tract_sec(r, TRACT_SEC_TRANSFER);
	const struct tract_section *ls = tract_sec(r, TRACT_SEC_LOCKS);
	if (as->length < sizeof(struct tract_alloc_header) || bs->length < (slots + 7) / 8 ||
	    os->length < slots)
		return TRACT_E_CORRUPT;
	int rc = TRACT_E_NOMEM;
	/* whole sections, zero past the last slot: their padding is rewritten
	 * zero too, as a fresh format has it */
	uint8_t *bits = calloc(1, bs->length);
	uint8_t *owners = calloc(1, os->length);
	uint8_t *old = malloc(os->length);
	if (!bits || !owners || !old)
		goto out;
	/* every slot in range and kept once, checked whole before any write */
	rc = TRACT_E_INVAL;
	for (uint64_t i = 0; i < n_keep; i++) {
		uint32_t s = keep[i];
		uint8_t bit = (uint8_t)(1u << (s % 8));
		if (s >= slots || (bits[s / 8] & bit))
			goto out;
		bits[s / 8] |= bit;
	}
	struct tract_alloc_header h;
	if ((rc = tract_observe(r, os->offset, old, os->length)) < 0 ||
	    (rc = tract_observe(r, as->offset, &h, sizeof(h))) < 0)
		goto out;
	/* a kept slot stays its claimer's; one with no owner byte or one naming
	 * no node (a torn or corrupt allocator state) is given to node 0, so bitmap and owner map
	 * agree: whichever node frees it later, alloc.c returns it to the
	 * region or to node 0's list by that byte */
	for (uint64_t i = 0; i < n_keep; i++) {
		uint8_t o = old[keep[i]];
		owners[keep[i]] = o && o <= r->hdr.max_nodes ? o : 1;
	}
	/* the claim, next_hint and release counters kept: only the count was
	 * derived from what is taken */
	h.used_slots = n_keep;
	/* a release a dead host left half done is moot: every slot is kept or
	 * free by the references just counted */
	h.intent_n = 0;
	h.intent_node = 0;
	/* the header first, its intent dropped: a rebuild cut short must not
	 * leave a dead host's intent to be finished over the owners it
	 * rewrote; then owners before bits, as a claim writes them (alloc.c):
	 * a set bit never meets an owner byte that is not yet written; each
	 * published (flushed, fenced) before the next, so another host's later
	 * attach observes them */
	if ((rc = tract_publish(r, as->offset, &h, sizeof(h))) < 0 ||
	    (rc = tract_publish(r, os->offset, owners, os->length)) < 0 ||
	    (rc = tract_publish(r, bs->offset, bits, bs->length)) < 0 ||
	    (rc = publish_zero(r, as->offset + sizeof(h), as->length - sizeof(h))) < 0 ||
	    (rc = publish_zero(r, ts->offset, ts->length)) < 0 ||
	    (rc = publish_zero(r, ls->offset, ls->length)) < 0)
		goto out;
	rc = TRACT_OK;
out:
	free(bits);
	free(owners);
	free(old);
	return rc;
}
