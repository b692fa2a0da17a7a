/*
 * index_pin.c -- pins of the prefix index (docs/PROTOCOLS.md §9): per node
 * a u16 count per bucket in the pins section, written under the stripe's
 * lock, and nothing on the bucket's own line, so a lookup of a block it
 * finds already recent writes only its node's pin line (format 4); the
 * repair of a stripe a holder died inside; unpinning, a lookup's and a
 * handoff's.
 */
#include <stdlib.h>
#include <string.h>

#include "index_internal.h"

/* node's pin count of bucket b; buf gets the line holding it (internal) */
uint16_t tract_pin_count(struct stripe_ctx *c, uint32_t node, uint64_t b,
			 uint8_t buf[TRACT_LINE])
{
	uint64_t off = pin_off(c->r, node, b);
	uint64_t line = off & ~(uint64_t)(TRACT_LINE - 1);
	uint16_t v;
	tract_line_get(c, line, buf);
	memcpy(&v, buf + (off - line), 2);
	return v;
}

/* adds delta to node's pin count of bucket b: one store of its line that
 * changes only that u16, so a process killed here leaves the count either
 * moved or not, never torn (internal) */
int tract_pin_add(struct stripe_ctx *c, uint64_t b, uint32_t node, int delta)
{
	uint64_t off = pin_off(c->r, node, b);
	uint64_t line = off & ~(uint64_t)(TRACT_LINE - 1);
	uint8_t buf[TRACT_LINE];
	uint16_t v = tract_pin_count(c, node, b, buf);
	if ((delta < 0 && v < (uint16_t)-delta) || (delta > 0 && UINT16_MAX - v < delta))
		return TRACT_E_CORRUPT;
	v = (uint16_t)(v + delta);
	memcpy(buf + (off - line), &v, 2);
	tract_line_put(c, line, buf);
	return TRACT_OK;
}

/*
 * Takes (dpins +1) or gives back (-1) one of this node's pins on bucket b,
 * whose key is key, and journals it, as one move named in the journal
 * first (journal.c, "Pin moves"), so that a process killed between the
 * count and the journal is recovered exactly.  Taken, the count moves
 * first; given back, the journal: named or not, the journal never says
 * more than the process holds.  Returns tract_pin_add's result (a count
 * that would pass its bounds is left as it is, and a pin not taken is not
 * journaled) (internal).
 */
int tract_pin_move(struct stripe_ctx *c, uint64_t b, const uint8_t *key, int dpins)
{
	tract_region *r = c->r;
	uint8_t buf[TRACT_LINE];
	tract_journal_move_begin(r, key, TRACT_FIXED_LOCKS + c->stripe, b, dpins,
				 tract_pin_count(c, r->node_id, b, buf));
	tract_maybe_die(TRACT_DIE_PIN_NAMED);
	int rc;
	if (dpins < 0) {
		tract_journal_move_apply(r, key, dpins);
		tract_maybe_die(TRACT_DIE_PIN_MOVED);
		rc = tract_pin_add(c, b, r->node_id, dpins);
	} else {
		rc = tract_pin_add(c, b, r->node_id, dpins);
		tract_maybe_die(TRACT_DIE_PIN_MOVED);
		if (rc == TRACT_OK)
			tract_journal_move_apply(r, key, dpins);
	}
	tract_maybe_die(TRACT_DIE_PIN_BOTH);
	tract_journal_move_end(r);
	return rc;
}

/* sets node's pin count of bucket b to v: one store of its line (internal) */
static void pin_set(struct stripe_ctx *c, uint64_t b, uint32_t node, uint16_t v)
{
	uint8_t buf[TRACT_LINE];
	tract_pin_add(c, b, node, (int)v - (int)tract_pin_count(c, node, b, buf));
}

/* whether any node pins bucket b: eviction's test, one pin line per node,
 * observed together under one fence (internal) */
int tract_pinned(struct stripe_ctx *c, uint64_t b)
{
	uint8_t buf[TRACT_LINE];
	uint64_t offs[TRACT_MAX_NODES] = { 0 };   /* gcc cannot see it filled to `nodes` */
	uint32_t nodes = c->r->hdr.max_nodes < TRACT_MAX_NODES ? c->r->hdr.max_nodes
							       : TRACT_MAX_NODES;
	for (uint32_t n = 0; n < nodes; n++)
		offs[n] = pin_off(c->r, n, b) & ~(uint64_t)(TRACT_LINE - 1);
	tract_lines_prefetch(c, offs, nodes);
	for (uint32_t n = 0; n < nodes; n++)
		if (tract_pin_count(c, n, b, buf))
			return 1;
	return 0;
}

/* region offset of entry i of the key list at keys (internal) */
static uint64_t entry_off(uint64_t keys, uint32_t i)
{
	return keys + (uint64_t)i * TRACT_KEY_ENTRY_SIZE;
}

/* whether the anchor's release intent names a key list that lies where a
 * key list can lie (the anchor was written by another host) (internal) */
static int intent_sane(const tract_region *r, const struct tract_lru_anchor *a)
{
	const struct tract_section *d = tract_sec(r, TRACT_SEC_DATA);
	uint64_t off = a->release_keys;
	return a->release_owner && a->release_owner <= r->hdr.max_nodes &&
	       (uint64_t)a->release_blocks * TRACT_KEY_ENTRY_SIZE <= r->hdr.block_bytes &&
	       off >= d->offset && (off - d->offset) % r->hdr.slot_stride == 0 &&
	       (off - d->offset) / r->hdr.slot_stride < r->hdr.slot_count;
}

/*
 * Finishes the handoff release whose section a holder died inside, from
 * the stripe's release intent (docs/PROTOCOLS.md §10): nobody entered the
 * stripe since, so the owner's pin counts of the intent's keys are still
 * what the dead section left, and each key-list entry of this stripe still
 * in TRACT_KEY_INTENT holds the count the section began with.  Each such
 * count is set to that minus one -- an absolute value, right whichever of
 * the dead section's stores reached the device -- and written back; then
 * the entries become TRACT_KEY_GIVEN_BACK (so a resumed release skips
 * them), then the intent is cleared.  A repairer that dies repairing is
 * repaired by the next holder the same way.  No allocation: the key list
 * is read a line at a time, twice (internal; the section's lines already
 * written back by tract_stripe_repair).
 */
static void finish_release(struct stripe_ctx *c)
{
	tract_region *r = c->r;
	struct tract_lru_anchor *a = &c->lru;
	if (!a->release_keys && !a->release_blocks && !a->release_owner)
		return;
	if (intent_sane(r, a)) {
		uint32_t node = a->release_owner - 1;
		uint32_t per_line = TRACT_LINE / TRACT_KEY_ENTRY_SIZE;
		for (int pass = 0; pass < 2; pass++) {
			for (uint32_t i = 0; i < a->release_blocks; i += per_line) {
				uint8_t line[TRACT_LINE];
				uint64_t off = entry_off(a->release_keys, i);
				int changed = 0;
				tract_observe_line(r, off, line);
				for (uint32_t j = 0; j < per_line && i + j < a->release_blocks; j++) {
					struct tract_key_entry *e =
						(struct tract_key_entry *)(line + j * TRACT_KEY_ENTRY_SIZE);
					uint16_t before = (uint16_t)(e->released & 0xFFFF);
					if (!(e->released & TRACT_KEY_INTENT) || !before ||
					    tract_key_stripe(r, e->key) != c->stripe)
						continue;
					if (pass == 1) {
						e->released = TRACT_KEY_GIVEN_BACK;
						changed = 1;
						continue;
					}
					uint64_t b, fb;
					struct tract_bucket bk;
					tract_probe(c, e->key, &b, &fb, &bk);
					uint8_t buf[TRACT_LINE];
					/* nobody entered since the section began, so the
					 * count is before or before - 1 (a publish names a
					 * key once): never raised, in case a list written
					 * by another host names a bucket twice */
					if (b != UINT64_MAX && tract_pin_count(c, node, b, buf) > before - 1)
						pin_set(c, b, node, (uint16_t)(before - 1));
				}
				if (changed)
					tract_write_line(r, off, line);
			}
			/* the counts on the device before any entry says they are
			 * given back; the entries before the intent goes */
			tract_stripe_flush(c);
		}
	}
	a->release_keys = 0;
	a->release_blocks = 0;
	a->release_owner = 0;
	c->lru_dirty = 1;
	tract_stripe_flush(c);
}

/* this node's count on bucket b of the stripe c holds, for a pin move's
 * resolution; -1 for a bucket that is not the stripe's (the journal names
 * it) (internal) */
static int move_count(void *ctx, uint64_t b)
{
	struct stripe_ctx *c = ctx;
	if (b < c->first || b - c->first >= c->size)
		return -1;
	uint8_t buf[TRACT_LINE];
	return tract_pin_count(c, c->r->node_id, b, buf);
}

/*
 * Repairs the entered stripe after a holder died inside it (a process of
 * this host, or a dead host whose grant this one inherited).  First what it
 * may have left dirty in this host's caches is written back: every line its
 * section could write (the stripe's buckets, its anchor, every node's pin
 * lines for the stripe's buckets -- a handoff's release writes another
 * node's), so that no other host reads them stale.  A pin is one store
 * (tract_pin_add), so a death leaves it taken or not, and a pin move the
 * holder died inside (between the count and its journal) is told which
 * from the count (tract_journal_move_resolve), for its journal's
 * recovery.  A handoff release's section is finished
 * from its intent (finish_release).  The LRU list may be broken (the anchor
 * was the dead process's until it left): tract_lru_repair makes it whole
 * (internal).
 */
void tract_stripe_repair(struct stripe_ctx *c)
{
	tract_region *r = c->r;
	r->ops->flush(r, bucket_off(c, c->first), c->size * TRACT_LINE);
	r->ops->flush(r, c->lru_off, TRACT_LINE);
	for (uint32_t n = 0; n < r->hdr.max_nodes; n++)
		r->ops->flush(r, pin_off(r, n, c->first), c->size * 2);
	/* its event log too: a dead holder's entries and head, written back
	 * now, cannot land after the next holder's (index_events.c) */
	tract_events_write_back(c);
	r->ops->fence(r);
	/* and moved on past a whole ring: the dead holder may have changed
	 * buckets whose events its head never covered (the next holder would
	 * write over them), so every reader takes the stripe from a snapshot */
	tract_events_skip(c);
	tract_lru_repair(c);     /* out of memory: the list stays as it is, for tract check */
	finish_release(c);
	/* a pin move the holder died inside: told from the count, which nobody
	 * has changed since (journal.c, "Pin moves") */
	tract_journal_move_resolve(r, TRACT_FIXED_LOCKS + c->stripe, move_count, c);
}

/*
 * Unpins keys this node pinned, stripe group by stripe group in ascending
 * stripe order, each pin leaving this process's journal right before it is
 * given back (internal).
 */
int tract_index_unpin(tract_region *r, const uint8_t *keys, uint32_t n, uint64_t timeout_ns)
{
	return tract_index_unpin_marked(r, keys, n, NULL, timeout_ns);
}

/* tract_index_unpin, marking each key given back in done (may be NULL) */
int tract_index_unpin_marked(tract_region *r, const uint8_t *keys, uint32_t n, uint8_t *done,
			     uint64_t timeout_ns)
{
	int rc = index_usable(r);
	if (rc)
		return rc;
	struct keyref *refs = tract_group_keys(r, keys, n);
	if (!refs && n)
		return TRACT_E_NOMEM;
	struct line_set *set = calloc(1, sizeof(*set));   /* NULL: no deferral */
	struct stripe_walk walk;
	tract_walk_init(&walk, r, set, timeout_ns);
	struct stripe_groups g;
	tract_groups_init(&g, refs, n, NULL, NULL);
	while (tract_groups_next(&g)) {
		struct stripe_ctx c;
		int rc2 = tract_walk_enter(&walk, &g, &c);
		if (rc2 < 0) {
			rc = rc2;
			break;
		}
		tract_prefetch_group(&c, keys, refs, g.first, g.end, r->node_id);
		for (uint32_t k = g.first; k < g.end; k++) {
			const uint8_t *key = keys + (uint64_t)refs[k].idx * 16;
			uint64_t b, fb;
			struct tract_bucket bk;
			tract_probe(&c, key, &b, &fb, &bk);
			if (b == UINT64_MAX) {
				tract_journal_pins(r, key, 1, -1);
				rc = TRACT_E_CORRUPT;   /* not pinned by this node */
			} else if (tract_pin_move(&c, b, key, -1) < 0) {
				rc = TRACT_E_CORRUPT;
			}
			if (done)
				done[refs[k].idx] = 1;  /* a retry must not give it back again */
		}
		tract_stripe_leave(&c);
	}
	tract_walk_end(&walk);
	free(refs);
	free(set);
	return rc;
}

/* writes entries e[0..m) of the group back to the key list, each flushed,
 * then fences (internal) */
static void put_entries(tract_region *r, const struct tract_release *rel,
			const struct keyref *refs, uint32_t first, uint32_t m,
			const struct tract_key_entry *e)
{
	for (uint32_t k = 0; k < m; k++) {
		uint64_t off = entry_off(rel->keys_offset, refs[first + k].idx);
		r->ops->store(r, off, &e[k], TRACT_KEY_ENTRY_SIZE);
		r->ops->flush(r, off, TRACT_KEY_ENTRY_SIZE);
	}
	r->ops->fence(r);
}

/*
 * One stripe group of a handoff's release, in its entered stripe c: keys
 * refs[first..end) of rel, whose entries e[] are observed here, under the
 * lock (a repair may have changed them since the release read the list).
 * Five steps, each on the device (flushed, fenced) before the next begins:
 *  1. each entry not yet given back gets TRACT_KEY_INTENT | the owner's
 *     count now (an entry a repair gave back is skipped; one whose key is
 *     gone or unpinned is given back at once: nothing of it to return);
 *  2. the stripe's anchor names the key list (the intent);
 *  3. each count becomes that minus one;
 *  4. the entries become TRACT_KEY_GIVEN_BACK;
 *  5. the intent is cleared.
 * The caller marks the group in the record after step 5, so a mark on the
 * device means no intent names the list any more: a resumed release that
 * skips the group leaves no repair behind that could still write the key
 * list (which it frees at the end) or race its own writes of lines the
 * group's entries share with the next group's.  A death in steps 3-4 leaves
 * the intent for the next holder's repair (finish_release); one before step
 * 2 leaves every count untouched, and a resumed release reads them afresh;
 * one after step 4 leaves nothing to redo (internal).
 */
static int release_group(struct stripe_ctx *c, const struct tract_release *rel,
			 const struct keyref *refs, uint32_t first, uint32_t end,
			 struct tract_key_entry *e, uint64_t *bucket)
{
	tract_region *r = c->r;
	uint32_t m = end - first, live = 0;
	int rc = TRACT_OK;
	for (uint32_t k = 0; k < m; k++)
		r->ops->invalidate(r, entry_off(rel->keys_offset, refs[first + k].idx),
				   TRACT_KEY_ENTRY_SIZE);
	r->ops->fence(r);
	for (uint32_t k = 0; k < m; k++)
		r->ops->load(r, entry_off(rel->keys_offset, refs[first + k].idx), &e[k],
			     TRACT_KEY_ENTRY_SIZE);
	tract_prefetch_group(c, rel->keys, refs, first, end, rel->owner);
	for (uint32_t k = 0; k < m; k++) {
		bucket[k] = UINT64_MAX;
		if (e[k].released == TRACT_KEY_GIVEN_BACK)
			continue;
		const uint8_t *key = rel->keys + (uint64_t)refs[first + k].idx * 16;
		uint64_t b, fb;
		struct tract_bucket bk;
		uint8_t buf[TRACT_LINE];
		tract_probe(c, key, &b, &fb, &bk);
		uint16_t v = b == UINT64_MAX ? 0 : tract_pin_count(c, rel->owner, b, buf);
		if (!v || memcmp(e[k].key, key, 16)) {
			rc = TRACT_E_CORRUPT;       /* not pinned by the owner */
			e[k].released = TRACT_KEY_GIVEN_BACK;
		} else {
			e[k].released = TRACT_KEY_INTENT | v;
			bucket[k] = b;
			live++;
		}
	}
	put_entries(r, rel, refs, first, m, e);                         /* 1 */
	if (!live)
		return rc;
	c->lru.release_keys = rel->keys_offset;                         /* 2 */
	c->lru.release_blocks = rel->n;
	c->lru.release_owner = rel->owner + 1;
	tract_publish_line_at(r, c->lru_off, &c->lru, SITE_INDEX_PUBLISH_ANCHOR);
	tract_maybe_die(TRACT_DIE_RELEASE_INTENT);
	for (uint32_t k = 0; k < m; k++)                                /* 3 */
		if (bucket[k] != UINT64_MAX)
			pin_set(c, bucket[k], rel->owner,
				(uint16_t)((e[k].released & 0xFFFF) - 1));
	tract_maybe_die(TRACT_DIE_RELEASE_PINS);
	tract_stripe_flush(c);
	for (uint32_t k = 0; k < m; k++)                                /* 4 */
		e[k].released = TRACT_KEY_GIVEN_BACK;
	put_entries(r, rel, refs, first, m, e);
	c->lru.release_keys = 0;                                        /* 5 */
	c->lru.release_blocks = 0;
	c->lru.release_owner = 0;
	tract_publish_line_at(r, c->lru_off, &c->lru, SITE_INDEX_PUBLISH_ANCHOR);
	c->lru_dirty = 0;
	return rc;
}

/*
 * Gives back a handoff's pins, stripe group by stripe group in ascending
 * stripe order, skipping the first `done` groups; mark(arg, g + 1) records
 * the progress once group g's pins are on the device and its intent is
 * cleared, so a resumed release never gives one back twice and never
 * leaves one behind, whatever a death lost (docs/PROTOCOLS.md §10)
 * (internal).
 */
int tract_index_release_groups(tract_region *r, const struct tract_release *rel, uint32_t done,
			       void (*mark)(tract_region *, void *, uint32_t), void *arg,
			       uint64_t timeout_ns)
{
	int rc = index_usable(r);
	if (rc)
		return rc;
	if (rel->owner >= r->hdr.max_nodes)
		return TRACT_E_INVAL;
	struct keyref *refs = tract_group_keys(r, rel->keys, rel->n);
	struct tract_key_entry *e = malloc(((size_t)rel->n + 1) * sizeof(*e));
	uint64_t *bucket = malloc(((size_t)rel->n + 1) * sizeof(*bucket));
	struct line_set *set = calloc(1, sizeof(*set));   /* NULL: no deferral */
	if ((!refs && rel->n) || !e || !bucket) {
		free(refs);
		free(e);
		free(bucket);
		free(set);
		return TRACT_E_NOMEM;
	}
	struct stripe_walk walk;
	tract_walk_init(&walk, r, set, timeout_ns);
	struct stripe_groups g;
	tract_groups_init(&g, refs, rel->n, NULL, NULL);
	while (tract_groups_next(&g)) {
		if (g.ordinal < done)
			continue;
		struct stripe_ctx c;
		int rc2 = tract_walk_enter(&walk, &g, &c);
		if (rc2 < 0) {
			rc = rc2;
			break;
		}
		if ((rc2 = release_group(&c, rel, refs, g.first, g.end, e, bucket)) < 0)
			rc = rc2;
		mark(r, arg, g.ordinal + 1);   /* (no intent left: release_group) */
		tract_maybe_die(TRACT_DIE_RELEASE_MARKED);
		tract_stripe_leave(&c);
	}
	tract_walk_end(&walk);
	free(refs);
	free(e);
	free(bucket);
	free(set);
	return rc;
}
