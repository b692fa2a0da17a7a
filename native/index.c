/*
 * index.c -- the prefix index (docs/ARCHITECTURE.md §9, docs/PROTOCOLS.md §9):
 * lookup, read, payload tags and eviction; puts are index_put.c's.
 *
 * A fixed open-addressing table of cache-line buckets, split into stripes of
 * contiguous buckets; a key's stripe and home bucket come from its bits and
 * its probe sequence wraps inside its stripe, so every operation on a key
 * needs only that stripe's lock.  A request's keys are grouped by stripe
 * and the stripes are locked in ascending order; a walk requests the locks
 * of all its stripes ahead, which the manager grants in ascending order, so
 * a holder only ever waits for higher locks: no lock-order cycle is possible.
 *
 * Under a stripe's lock its holder is the only writer of the stripe's
 * buckets, its LRU anchor and the pin lines of its buckets (a stripe spans
 * at least 32 buckets, so a pin line never covers two stripes).  Every line
 * is observed before it is modified and written back whole; one fence
 * before the lock is released.
 *
 * The index's other files, one job each, share index_internal.h:
 * index_stripe.c (a stripe section, the walk over stripes), index_bucket.c
 * (probing, the LRU list, burial), index_pin.c (pins), index_put.c (puts),
 * index_recover.c (what recovery calls).
 */
#include <stdlib.h>
#include <string.h>

#include "index_internal.h"

/* the tag of the payload a READY bucket publishes: the bucket and its epoch,
 * which every claim bumps, so it names one write of the slot (payload.c);
 * 0 (unknown: always evicted) past 2^32 - 1 buckets (internal) */
static uint64_t payload_tag(uint64_t b, const struct tract_bucket *bk)
{
	return b + 1 < UINT32_MAX ? ((uint64_t)bk->epoch << 32) | (b + 1) : 0;
}

/* the pins a lookup gives back: those it took at or past key `keep` (internal) */
struct pinned_past {
	const uint8_t *pinned;      /* per key: 1 if the lookup pinned it */
	uint32_t keep;
};

/* whether the lookup gives back its pin on key idx (arg: struct pinned_past) (internal) */
static int gives_back(const void *arg, uint32_t idx)
{
	const struct pinned_past *p = arg;
	return idx >= p->keep && p->pinned[idx];
}

/* finds KEY's bucket by probing its stripe WITHOUT the stripe's lock, every
 * line observed (home_observed: its home line was invalidated and fenced
 * already, as a batch); 1 and the bucket (index *b, copy *out) if a live
 * bucket holds the key, 0 if the probe ends first.  What a lock holder has
 * in flight may make the answer stale either way: callers use it as a hint,
 * or only for buckets that cannot change (pinned) (internal) */
static int find_unlocked(tract_region *r, const uint8_t *key, int home_observed, uint64_t *b,
			 struct tract_bucket *out)
{
	uint64_t size = tract_index_stripe_size(r), base = tract_sec(r, TRACT_SEC_BUCKETS)->offset;
	uint64_t first = (uint64_t)tract_key_stripe(r, key) * size, home = tract_key_home(r, key);
	if (first + size > tract_index_buckets(r))
		return 0;
	for (uint64_t k = 0; k < size; k++) {
		*b = first + ((home + k) & (size - 1));
		if (k == 0 && home_observed)
			r->ops->load(r, base + *b * TRACT_LINE, out, sizeof(*out));
		else
			tract_observe_line(r, base + *b * TRACT_LINE, out);
		if (out->state == TRACT_BUCKET_EMPTY)
			return 0;
		if (out->state != TRACT_BUCKET_TOMBSTONE && !memcmp(out->key, key, 16))
			return 1;
	}
	return 0;
}

/* the home bucket lines of n keys invalidated as one batch and fenced once,
 * for find_unlocked(home_observed = 1) on each (internal) */
static void observe_homes(tract_region *r, const uint8_t *keys, uint32_t n)
{
	uint64_t size = tract_index_stripe_size(r), base = tract_sec(r, TRACT_SEC_BUCKETS)->offset;
	for (uint32_t i = 0; i < n; i++) {
		const uint8_t *key = keys + (uint64_t)i * 16;
		uint64_t home = (uint64_t)tract_key_stripe(r, key) * size + tract_key_home(r, key);
		r->ops->invalidate(r, base + home * TRACT_LINE, TRACT_LINE);
	}
	r->ops->fence(r);
}

/* whether KEY is READY in a slot of the pool, looked at without a lock (internal) */
static int peek_ready(tract_region *r, const uint8_t *key, int home_observed)
{
	uint64_t b;
	struct tract_bucket bk;
	return find_unlocked(r, key, home_observed, &b, &bk) && bk.state == TRACT_BUCKET_READY &&
	       bk.slot >= 1 && bk.slot <= r->hdr.slot_count;
}

/*
 * How many leading keys are READY, found by probing each key's stripe
 * WITHOUT its lock (every line observed): a hint, which a lock holder's
 * update in flight can make wrong either way.  A lookup takes it first and
 * locks only the stripes of the keys it names: a miss (0) takes no lock at
 * all, so the common case of a prompt the pool does not hold costs a few
 * line reads instead of a grant per stripe, and a hint that is too long is
 * corrected under the locks.  One that is too short loses hits (computed
 * again), never correctness (internal).
 */
static uint32_t peek_leading_ready(tract_region *r, const uint8_t *keys, uint32_t n)
{
	/* the first key alone (a miss costs one observe); past it, the home
	 * lines of the rest invalidated together and fenced once, as
	 * tract_index_tags does */
	if (!n || !peek_ready(r, keys, 0))
		return 0;
	observe_homes(r, keys + 16, n - 1);
	for (uint32_t i = 1; i < n; i++)
		if (!peek_ready(r, keys + (uint64_t)i * 16, 1))
			return i;
	return n;
}

/* How many leading keys look READY, read without a lock (a hint: what a
 * lookup takes first; 0 is the answer its locked pass would give a prompt
 * the pool does not hold, with no lock taken). */
int tract_index_peek(tract_region *r, const uint8_t *keys, uint32_t n, uint32_t *ready)
{
	int rc = index_usable(r);
	if (rc)
		return rc;
	if ((!keys && n) || !ready)
		return TRACT_E_INVAL;
	*ready = peek_leading_ready(r, keys, n);
	return TRACT_OK;
}

/* Finds, pins and touches the longest run of leading READY keys. */
int tract_index_lookup(tract_region *r, const uint8_t *keys, uint32_t n, uint32_t *slots,
		       uint32_t *tokens, uint32_t *checksums, uint64_t *tags, uint32_t *hits,
		       uint64_t timeout_ns)
{
	int rc = index_usable(r);
	if (rc)
		return rc;
	if ((!keys && n) || !hits)
		return TRACT_E_INVAL;
	/* only the keys a lockless look finds READY are looked up under locks */
	n = peek_leading_ready(r, keys, n);
	if (!n) {
		*hits = 0;
		return TRACT_OK;
	}
	struct keyref *refs = tract_group_keys(r, keys, n);
	uint8_t *pinned = calloc((size_t)n + 1, 1);
	uint64_t *hit = malloc(((size_t)n + 1) * sizeof(*hit));   /* a group's buckets, in touch order */
	if (!refs || !pinned || !hit) {
		free(refs);
		free(pinned);
		free(hit);
		return TRACT_E_NOMEM;
	}
	uint32_t limit = n;      /* keys at or past the first known miss are not pinned */
	struct line_set *set = calloc(1, sizeof(*set));   /* NULL: no deferral */
	struct stripe_walk walk;
	tract_walk_init(&walk, r, set, timeout_ns);
	rc = TRACT_OK;
	struct stripe_groups g;
	tract_groups_init(&g, refs, n, NULL, NULL);
	while (rc == TRACT_OK && tract_groups_next(&g)) {
		struct stripe_ctx c;
		if ((rc = tract_walk_enter(&walk, &g, &c)) < 0)
			break;
		/* refs[first..end) are this stripe's keys, tail first */
		tract_prefetch_group(&c, keys, refs, g.first, g.end, r->node_id);
		uint32_t nhit = 0;
		for (uint32_t k = g.first; k < g.end; k++) {
			uint32_t idx = refs[k].idx;
			if (idx >= limit)
				continue;
			uint64_t b, fb;
			struct tract_bucket bk;
			tract_probe(&c, keys + (uint64_t)idx * 16, &b, &fb, &bk);
			c.lru.lookups++;
			if (b == UINT64_MAX || bk.state != TRACT_BUCKET_READY || !slot_ok(&c, &bk)) {
				limit = idx;
				continue;
			}
			/* taken and journaled as one move: a death between is recovered */
			if ((rc = tract_pin_move(&c, b, keys + (uint64_t)idx * 16, +1)) < 0)
				break;
			hit[nhit++] = b;
			c.lru.hits++;
			c.lru_dirty = 1;
			pinned[idx] = 1;
			if (slots)
				slots[idx] = bk.slot - 1;
			if (tokens)
				tokens[idx] = bk.tokens;
			if (checksums)
				checksums[idx] = (bk.flags & TRACT_BUCKET_F_CHECKSUM) ? bk.checksum : 0;
			if (tags)
				tags[idx] = payload_tag(b, &bk);
		}
		tract_lru_touch_run(&c, hit, nhit);
		tract_stripe_leave(&c);
	}
	tract_walk_end(&walk);
	/* unpin what was pinned past the first miss (or everything on error) */
	uint32_t keep = rc == TRACT_OK ? limit : 0;
	/* the groups holding such a pin, entered in a walk requested ahead */
	struct pinned_past past = { pinned, keep };
	tract_groups_init(&g, refs, n, gives_back, &past);
	while (tract_groups_next(&g)) {
		struct stripe_ctx c;
		int rc2 = tract_walk_enter(&walk, &g, &c);
		if (rc2 < 0) {
			rc = rc2;   /* pins stay until the agent's recovery */
			break;
		}
		for (uint32_t k = g.first; k < g.end; k++) {
			uint32_t idx = refs[k].idx;
			if (idx < keep || !pinned[idx])
				continue;
			uint64_t b, fb;
			struct tract_bucket bk;
			tract_probe(&c, keys + (uint64_t)idx * 16, &b, &fb, &bk);
			if (b != UINT64_MAX)
				tract_pin_move(&c, b, keys + (uint64_t)idx * 16, -1);
			else
				tract_journal_pins(r, keys + (uint64_t)idx * 16, 1, -1);
		}
		tract_stripe_leave(&c);
	}
	tract_walk_end(&walk);
	*hits = keep;
	free(refs);
	free(pinned);
	free(hit);
	free(set);
	return rc;
}

/* Copies n blocks out of slots into dst + i * dst_stride, evicting first what
 * the payload ledger does not vouch for (tags from the lookup; NULL: every
 * slot); with checksums (non-NULL, 0 = none recorded) verifies each,
 * returning the first bad index in *bad (TRACT_E_CORRUPT). */
int tract_index_read(tract_region *r, const uint32_t *slots, const uint64_t *tags, uint32_t n,
		     void *dst, uint64_t dst_stride, uint64_t block_len, const uint32_t *checksums,
		     uint32_t *bad)
{
	if (!r || (!slots && n) || (n && !dst) || block_len > r->hdr.block_bytes)
		return TRACT_E_INVAL;
	int rc = tract_payload_acquire(r, slots, tags, n, NULL);
	if (rc)
		return rc;
	for (uint32_t i = 0; i < n; i++) {
		uint8_t *d = (uint8_t *)dst + (uint64_t)i * dst_stride;
		uint64_t off = tract_sec(r, TRACT_SEC_DATA)->offset + (uint64_t)slots[i] * r->hdr.slot_stride;
		if ((rc = tract_copy_out(r, d, off, block_len, 0)))
			return rc;
		if (checksums && checksums[i] && tract_crc32c(d, block_len) != checksums[i]) {
			if (bad)
				*bad = i;
			return TRACT_E_CORRUPT;
		}
	}
	return TRACT_OK;
}

/*
 * Payload tags of n blocks the caller holds pinned without a lookup of its
 * own (a handoff's blocks, pinned by the prefill node for this reader),
 * found by probing each key's stripe WITHOUT its lock: a pinned READY
 * bucket cannot change its key, slot or epoch, and every line is observed
 * (invalidated, fenced, loaded), so those fields are the device's.  Other
 * buckets on the probe path may be mid-update by a lock holder; a stale one
 * can only end the probe early or send it on, never match: the key's old
 * bucket was buried and flushed before the key could be claimed again.  A
 * key not found READY at slots[i] gets tag 0 (evicted as unknown).
 */
int tract_index_tags(tract_region *r, const uint8_t *keys, const uint32_t *slots, uint32_t n,
		     uint64_t *tags)
{
	if (!r || ((!keys || !slots || !tags) && n))
		return TRACT_E_INVAL;
	observe_homes(r, keys, n);      /* one batch of evictions, one fence */
	for (uint32_t i = 0; i < n; i++) {
		uint64_t b;
		struct tract_bucket bk;
		tags[i] = 0;
		if (find_unlocked(r, keys + (uint64_t)i * 16, 1, &b, &bk) &&
		    bk.state == TRACT_BUCKET_READY && bk.slot == slots[i] + 1)
			tags[i] = payload_tag(b, &bk);
	}
	return TRACT_OK;
}

/*
 * The slot, token count and checksum of keys the caller holds pinned, read
 * without a lock: a pinned READY bucket keeps its key, state, slot, tokens
 * and checksum until the pin goes (eviction skips it, a put finds it READY),
 * and every line is observed, so they are the device's; a stale bucket on
 * the probe path can only end the probe early (NOT_FOUND: the caller's
 * publish fails and it gives its pins back) or send it on, never match.
 */
int tract_index_observe_pinned(tract_region *r, const uint8_t *keys, uint32_t n, uint32_t *slots,
			       uint32_t *tokens, uint32_t *checksums)
{
	if (!r || ((!keys || !slots || !tokens || !checksums) && n))
		return TRACT_E_INVAL;
	observe_homes(r, keys, n);      /* one batch of evictions, one fence */
	for (uint32_t i = 0; i < n; i++) {
		uint64_t b;
		struct tract_bucket bk;
		if (!find_unlocked(r, keys + (uint64_t)i * 16, 1, &b, &bk) ||
		    bk.state != TRACT_BUCKET_READY || bk.slot < 1 || bk.slot > r->hdr.slot_count)
			return TRACT_E_NOT_FOUND;
		slots[i] = bk.slot - 1;
		tokens[i] = bk.tokens;
		checksums[i] = (bk.flags & TRACT_BUCKET_F_CHECKSUM) ? bk.checksum : 0;
	}
	return TRACT_OK;
}

/* true if slot still holds the READY payload of that tag: one lock-free
 * observe of the tag's bucket (observe = 0: a plain load, a hint that may be
 * stale either way).  Under a pin the bucket's state, slot and
 * epoch do not change, and a dead payload's tag never comes back, so a
 * bucket that is mid-update elsewhere can only make a live payload look
 * live (internal) */
int tract_index_tag_live(tract_region *r, uint64_t tag, uint32_t slot, int observe)
{
	uint64_t b = (uint32_t)tag;
	if (!b || b > tract_index_buckets(r))
		return 0;                 /* names no bucket: no payload of ours */
	b -= 1;
	struct tract_bucket bk;
	uint64_t off = tract_sec(r, TRACT_SEC_BUCKETS)->offset + b * TRACT_LINE;
	if (observe)
		tract_observe_line(r, off, &bk);
	else
		r->ops->load(r, off, &bk, sizeof(bk));   /* a hint: maybe stale */
	return bk.state == TRACT_BUCKET_READY && bk.slot == (uint64_t)slot + 1 &&
	       payload_tag(b, &bk) == tag;
}

/* slots an eviction takes out of the index before it frees them: each is
 * journaled until its free (journal.c), and a process's journal holds
 * TRACT_JOURNAL_CAP keys, its pins and claims too */
#define EVICT_CHUNK 1024u

/* evicts up to want unpinned READY entries, LRU first, spread over the
 * stripes: each round takes at most ceil(want / stripes) from each stripe,
 * starting at *cursor, until want are taken or a round finds nothing.
 * (Taking all of them from one stripe drained sparse stripes while others
 * filled every bucket of theirs.)  Their slots are freed EVICT_CHUNK at a
 * time: each chunk is spread so (want its size), the next starting one
 * stripe on (internal) */
int tract_evict_spread(tract_region *r, uint32_t want, uint32_t *cursor, uint32_t *evicted,
		       uint64_t timeout_ns)
{
	uint32_t chunk = want < EVICT_CHUNK ? want : EVICT_CHUNK;
	uint32_t *slots = malloc(((size_t)chunk + 1) * sizeof(uint32_t));
	struct tract_slot_owner *owners = malloc(((size_t)chunk + 1) * sizeof(*owners));
	struct line_set *set = calloc(1, sizeof(*set));   /* NULL: no deferral */
	if (!slots || !owners) {
		free(slots);
		free(owners);
		free(set);
		return TRACT_E_NOMEM;
	}
	uint32_t total = 0, stripes = r->hdr.index_stripes;
	int rc = TRACT_OK;
	while (total < want && rc == TRACT_OK) {
		uint32_t part = want - total < chunk ? want - total : chunk, got = 0;
		uint32_t per = (part + stripes - 1) / stripes;
		for (uint32_t before = UINT32_MAX; got < part && got != before && rc == TRACT_OK;) {
			before = got;
			for (uint32_t t = 0; t < stripes && got < part; t++) {
				uint32_t s = (*cursor + t) % stripes;
				struct stripe_ctx c;
				if ((rc = tract_stripe_enter(r, s, timeout_ns, &c, set)) < 0)
					break;
				got += tract_evict_lru(&c, part - got < per ? part - got : per,
						       slots + got, owners + got);
				tract_stripe_leave(&c);
			}
		}
		if (got)
			rc = tract_free_evicted(r, slots, owners, got, timeout_ns) ?: rc;
		total += got;
		*cursor = (*cursor + 1) % stripes;
		if (got < part)
			break;          /* nothing more to evict */
	}
	free(slots);
	free(owners);
	free(set);
	*evicted = total;
	return rc;
}

/* Evicts up to want unpinned entries (LRU first); *evicted gets the count. */
int tract_index_evict(tract_region *r, uint32_t want, uint32_t *evicted, uint64_t timeout_ns)
{
	int rc = index_usable(r);
	if (rc)
		return rc;
	uint32_t cursor = 0;
	return tract_evict_spread(r, want, &cursor, evicted, timeout_ns);
}

/* The home bucket of each of n keys (tract.h). */
int tract_index_key_homes(const tract_region *r, const uint8_t *keys, uint64_t n,
			  uint64_t *homes)
{
	if (!r || ((!keys || !homes) && n) || !r->hdr.index_stripes)
		return TRACT_E_INVAL;
	uint64_t size = tract_index_stripe_size(r);
	for (uint64_t i = 0; i < n; i++) {
		const uint8_t *key = keys + i * 16;
		homes[i] = (uint64_t)tract_key_stripe(r, key) * size + tract_key_home(r, key);
	}
	return TRACT_OK;
}
