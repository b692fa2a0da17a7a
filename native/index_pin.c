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

/*
 * Repairs the entered stripe after a process of this host died inside it.
 * First what it may have left dirty in this host's caches is written back:
 * every line its section could write (the stripe's buckets, its anchor,
 * every node's pin lines for the stripe's buckets -- a handoff's release
 * writes another node's), so that no other host reads them stale.  Pins
 * need nothing more: a pin is one store (tract_pin_add), a death leaves it
 * taken or not.  The LRU list may be broken (the anchor was the dead
 * process's until it left): tract_lru_repair makes it whole (internal).
 */
void tract_stripe_repair(struct stripe_ctx *c)
{
	tract_region *r = c->r;
	r->ops->flush(r, bucket_off(c, c->first), c->size * TRACT_LINE);
	r->ops->flush(r, c->lru_off, TRACT_LINE);
	for (uint32_t n = 0; n < r->hdr.max_nodes; n++)
		r->ops->flush(r, pin_off(r, n, c->first), c->size * 2);
	r->ops->fence(r);
	tract_lru_repair(c);     /* out of memory: the list stays as it is, for tract check */
}

/*
 * Unpins keys on behalf of node, stripe group by stripe group in ascending
 * stripe order.  With `journal`, each pin leaves this process's journal right
 * before it is given back.  With `mark`, the first `done` groups are skipped
 * and mark(arg, g + 1) records the progress before group g's pins are given
 * back: a crash between the two leaves pins behind but never gives one back
 * twice (a handoff's release) (internal).
 */
static int unpin_impl(tract_region *r, const uint8_t *keys, uint32_t n, uint32_t node,
		      int journal, uint32_t done, void (*mark)(tract_region *, void *, uint32_t),
		      void *arg, uint64_t timeout_ns)
{
	int rc = index_usable(r);
	if (rc)
		return rc;
	if (node >= r->hdr.max_nodes)
		return TRACT_E_INVAL;
	struct keyref *refs = tract_group_keys(r, keys, n);
	if (!refs && n)
		return TRACT_E_NOMEM;
	struct line_set *set = calloc(1, sizeof(*set));   /* NULL: no deferral */
	struct stripe_walk walk;
	tract_walk_init(&walk, r, set, timeout_ns);
	rc = TRACT_OK;
	struct stripe_groups g;
	tract_groups_init(&g, refs, n, NULL, NULL);
	while (tract_groups_next(&g)) {
		if (g.ordinal < done)
			continue;
		struct stripe_ctx c;
		int rc2 = tract_walk_enter(&walk, g.stripe, g.next, &c);
		if (rc2 < 0) {
			rc = rc2;
			break;
		}
		if (mark)
			mark(r, arg, g.ordinal + 1);
		tract_prefetch_group(&c, keys, refs, g.first, g.end, node);
		for (uint32_t k = g.first; k < g.end; k++) {
			const uint8_t *key = keys + (uint64_t)refs[k].idx * 16;
			uint64_t b, fb;
			struct tract_bucket bk;
			tract_probe(&c, key, &b, &fb, &bk);
			if (journal)
				tract_journal_pins(r, key, 1, -1);
			if (b == UINT64_MAX || tract_pin_add(&c, b, node, -1) < 0)
				rc = TRACT_E_CORRUPT;   /* not pinned by that node */
		}
		tract_stripe_leave(&c);
	}
	tract_walk_end(&walk);
	free(refs);
	free(set);
	return rc;
}

/* Unpins keys this node pinned with tract_index_lookup. */
int tract_index_unpin(tract_region *r, const uint8_t *keys, uint32_t n, uint64_t timeout_ns)
{
	return unpin_impl(r, keys, n, r ? r->node_id : 0, 1, 0, NULL, NULL, timeout_ns);
}

/* unpins keys for node resuming after `done` stripe groups, recording each
 * group's progress with mark before it is given back (internal) */
int tract_index_unpin_groups(tract_region *r, const uint8_t *keys, uint32_t n, uint32_t node,
			     uint32_t done, void (*mark)(tract_region *, void *, uint32_t),
			     void *arg, uint64_t timeout_ns)
{
	return unpin_impl(r, keys, n, node, 0, done, mark, arg, timeout_ns);
}
