/*
 * index_stripe.c -- a stripe section of the prefix index (docs/PROTOCOLS.md §9).
 *
 * Under a stripe's lock its holder is the only writer of the stripe's
 * buckets, its LRU anchor and the pin lines of its buckets, so a section
 * observes each line once (later reads are plain loads), invalidates the
 * lines it will probe with one fence up front, and flushes the lines it
 * wrote all together before the lock is released: one fence each way.
 * Stripes are entered in ascending order, one at a time; a walk requests
 * the locks of the stripes it will enter ahead (index_internal.h).
 */
#include <stdlib.h>
#include <string.h>

#include "index_internal.h"

/* position of a line in the set, or where it would go; -1 when full (internal) */
static int set_slot(struct line_set *s, uint64_t off)
{
	uint64_t h = (off / TRACT_LINE) * 0x9E3779B97F4A7C15ULL;
	for (uint32_t i = 0; i < 64; i++) {
		uint32_t p = (uint32_t)((h >> 40) + i) & (SET_CAP - 1);
		if (s->off[p] == off + 1 || s->off[p] == 0)
			return (int)p;
	}
	return -1;
}

/* reads a line: observed the first time, plain loads after (internal) */
void tract_line_get(struct stripe_ctx *c, uint64_t off, void *dst)
{
	int p = c->set ? set_slot(c->set, off) : -1;
	if (p >= 0 && c->set->off[p] == off + 1) {
		c->r->ops->load(c->r, off, dst, TRACT_LINE);
		return;
	}
	/* the line cannot be dirty here: its writers hold this stripe's lock, and
	 * the previous holder flushed it (clflushopt, internal.h) -- unless that
	 * holder was a process of this node that died inside (clflush then) */
	if (TRACT_KEEP(SITE_INDEX_OBSERVE_LINE)) {
		if (c->recovered)
			c->r->ops->invalidate(c->r, off, TRACT_LINE);
		else
			tract_evict_clean(c->r, off, TRACT_LINE);
	}
	c->r->ops->fence(c->r);
	c->r->ops->load(c->r, off, dst, TRACT_LINE);
	if (p >= 0 && c->set->n_used < SET_CAP) {
		c->set->off[p] = off + 1;
		c->set->dirty[p] = 0;
		c->set->used[c->set->n_used++] = (uint16_t)p;
	}
}

/* writes a whole line; flushed when the section ends (internal) */
void tract_line_put(struct stripe_ctx *c, uint64_t off, const void *src)
{
	int p = c->set ? set_slot(c->set, off) : -1;
	if (p < 0 || (c->set->off[p] != off + 1 && c->set->n_used >= SET_CAP)) {
		tract_write_line_at(c->r, off, src, SITE_INDEX_FLUSH_SECTION);   /* no deferral */
		return;
	}
	c->r->ops->store(c->r, off, src, TRACT_LINE);
	if (c->set->off[p] != off + 1) {
		c->set->off[p] = off + 1;
		c->set->used[c->set->n_used++] = (uint16_t)p;
	}
	c->set->dirty[p] = 1;
}

/* invalidates many lines with one fence and records them as observed (internal) */
void tract_lines_prefetch(struct stripe_ctx *c, const uint64_t *offs, uint32_t k)
{
	if (!c->set)
		return;
	uint32_t fresh = 0;
	for (uint32_t i = 0; i < k; i++) {
		int p = set_slot(c->set, offs[i]);
		if (p < 0 || c->set->off[p] == offs[i] + 1 || c->set->n_used >= SET_CAP)
			continue;
		if (TRACT_KEEP(SITE_INDEX_PREFETCH)) {           /* as tract_line_get */
			if (c->recovered)
				c->r->ops->invalidate(c->r, offs[i], TRACT_LINE);
			else
				tract_evict_clean(c->r, offs[i], TRACT_LINE);
		}
		c->set->off[p] = offs[i] + 1;
		c->set->dirty[p] = 0;
		c->set->used[c->set->n_used++] = (uint16_t)p;
		fresh++;
	}
	if (fresh) {
		c->r->ops->fence(c->r);
		/* start every miss now, in parallel: the probes that follow load
		 * these lines one by one, each a trip to the device otherwise.
		 * A prefetch after the fence is an early load of the observe: the
		 * lines are written only under the stripe lock this caller holds */
		for (uint32_t i = 0; !c->r->sim && i < k; i++)
			__builtin_prefetch(c->r->base + offs[i]);
	}
}

/* flushes the section's written lines and empties the set (internal) */
static void set_flush(struct stripe_ctx *c)
{
	if (!c->set)
		return;
	for (uint32_t i = 0; i < c->set->n_used; i++) {
		uint16_t p = c->set->used[i];
		if (c->set->dirty[p] && TRACT_KEEP(SITE_INDEX_FLUSH_SECTION))
			c->r->ops->flush(c->r, c->set->off[p] - 1, TRACT_LINE);
		c->set->off[p] = 0;
		c->set->dirty[p] = 0;
	}
	c->set->n_used = 0;
}

/* fills the context of a stripe whose lock the caller holds (internal) */
void tract_stripe_init(tract_region *r, uint32_t stripe, struct stripe_ctx *c,
		       struct line_set *set)
{
	c->r = r;
	c->set = set;
	c->stripe = stripe;
	c->size = tract_index_stripe_size(r);
	c->first = (uint64_t)stripe * c->size;
	c->bucket_off = tract_sec(r, TRACT_SEC_BUCKETS)->offset;
	c->lru_off = tract_sec(r, TRACT_SEC_LRU)->offset + (uint64_t)stripe * TRACT_LINE;
	tract_observe_line_at(r, c->lru_off, &c->lru, SITE_INDEX_OBSERVE_ANCHOR);
	c->lru_dirty = 0;
	c->recovered = 0;
	c->ev_loaded = 0;
	c->ev_dirty = 0;
}

/* locks a stripe and loads its LRU anchor.  Its caller holds no stripe and
 * has none requested: it may wait for the node-local mutex, which a walk of
 * this node may hold while it awaits a lower stripe (docs/PROTOCOLS.md §4)
 * (internal) */
int tract_stripe_enter(tract_region *r, uint32_t stripe, uint64_t timeout_ns,
		       struct stripe_ctx *c, struct line_set *set)
{
	int rc = tract_lock_acquire(r, TRACT_FIXED_LOCKS + stripe, timeout_ns, NULL);
	if (rc < 0)
		return rc;
	tract_stripe_init(r, stripe, c, set);
	if (rc == TRACT_RECOVERED) {
		c->recovered = 1;
		tract_stripe_repair(c);   /* this node's last holder died inside */
	}
	return TRACT_OK;
}

/* writes the anchor back, flushes what the section wrote, fences (internal) */
void tract_stripe_flush(struct stripe_ctx *c)
{
	if (c->lru_dirty)
		tract_write_line_at(c->r, c->lru_off, &c->lru, SITE_INDEX_PUBLISH_ANCHOR);
	c->lru_dirty = 0;
	tract_events_flush_head(c);
	set_flush(c);
	c->r->ops->fence(c->r);
}

/* writes the anchor back, flushes what the section wrote, fences, unlocks (internal) */
void tract_stripe_leave(struct stripe_ctx *c)
{
	tract_stripe_flush(c);
	tract_lock_release(c->r, TRACT_FIXED_LOCKS + c->stripe);
}

/* a walk with nothing requested yet (internal) */
void tract_walk_init(struct stripe_walk *w, tract_region *r, struct line_set *set,
		     uint64_t timeout_ns)
{
	w->r = r;
	w->set = set;
	w->timeout_ns = timeout_ns;
	w->at = w->n = 0;
}

/* enters stripe s, awaiting its request q, repairing what a dead holder
 * left; AHEAD: a request made ahead, which waited its turn, waits a full
 * timeout from now (one made for this entry counts from when it was made, as
 * an acquire does) (internal) */
static int walk_await(struct stripe_walk *w, uint32_t s, struct tract_lock_req *q,
		      struct stripe_ctx *c, int ahead)
{
	if (ahead)
		q->start = tract_mono_ns();
	int rc = tract_lock_await(w->r, TRACT_FIXED_LOCKS + s, q, w->timeout_ns, NULL);
	if (rc < 0)
		return rc;
	tract_stripe_init(w->r, s, c, w->set);
	if (rc == TRACT_RECOVERED) {
		c->recovered = 1;
		tract_stripe_repair(c);   /* this node's last holder died inside */
	}
	return TRACT_OK;
}

/* withdraws the pending requests, highest first; one that recovered the local
 * mutex of a process that died (the last made, if any) is entered instead,
 * once the others are withdrawn, to repair what the dead process left (its
 * LOCKED slot is gone: nobody else would) (internal) */
void tract_walk_end(struct stripe_walk *w)
{
	int repair = -1;
	for (uint32_t i = w->n; i-- > w->at;) {
		if (w->q[i].recovered && repair < 0) {
			repair = (int)i;
			continue;
		}
		tract_lock_cancel(w->r, TRACT_FIXED_LOCKS + w->stripe[i], &w->q[i]);
	}
	w->at = w->n = 0;
	if (repair >= 0) {
		struct stripe_ctx c;
		uint32_t s = w->stripe[repair];
		/* (recovered: the wait says so, and walk_await repairs) */
		if (walk_await(w, s, &w->q[repair], &c, 1) == TRACT_OK)
			tract_stripe_leave(&c);
	}
}

/* requests ahead the stripes of g's groups after its current one, each after
 * the last pending request (the walk holds or awaits it), until WALK_AHEAD are
 * pending or one is not made (see stripe_walk) (internal) */
static void request_ahead(struct stripe_walk *w, const struct stripe_groups *g)
{
	struct stripe_groups rest = *g;
	/* at most tract_walk_ahead requests past the stripes entered (q[0..at)) */
	uint32_t cap = w->at + __atomic_load_n(&tract_walk_ahead, __ATOMIC_RELAXED);
	if (cap > WALK_AHEAD)
		cap = WALK_AHEAD;
	while (w->n < cap && !w->q[w->n - 1].recovered && tract_groups_next(&rest)) {
		uint32_t s = rest.stripe, below = w->stripe[w->n - 1];
		if (s <= below)
			break;
		if (tract_lock_request_after(w->r, TRACT_FIXED_LOCKS + s, &w->q[w->n],
					     TRACT_FIXED_LOCKS + below, &w->q[w->n - 1]) != TRACT_OK)
			break;
		w->stripe[w->n++] = s;
	}
}

/* enters the stripe of g's current group (its request pending or made now),
 * requesting those of g's groups after it ahead (internal) */
int tract_walk_enter(struct stripe_walk *w, const struct stripe_groups *g, struct stripe_ctx *c)
{
	tract_region *r = w->r;
	uint32_t s = g->stripe;
	/* pending below s: stripes the caller skipped after all (every lower one
	 * is left, so withdrawing them leaves the rest in order) */
	while (w->at < w->n && w->stripe[w->at] < s) {
		if (w->q[w->at].recovered) {         /* the last pending: entered to repair */
			tract_walk_end(w);
			break;
		}
		tract_lock_cancel(r, TRACT_FIXED_LOCKS + w->stripe[w->at], &w->q[w->at]);
		w->at++;
	}
	if (w->at < w->n && w->stripe[w->at] != s)
		tract_walk_end(w);          /* not in the order requested: start afresh */
	int ahead = 1;
	if (w->at == w->n) {
		/* nothing pending: s requested now (holding no stripe, so its local
		 * mutex may be waited for), the rest ahead of it */
		ahead = 0;
		w->at = w->n = 0;
		int rc = tract_lock_request(r, TRACT_FIXED_LOCKS + s, w->timeout_ns, &w->q[0], NULL);
		if (rc < 0)
			return rc;
		w->stripe[0] = s;
		w->n = 1;
		request_ahead(w, g);
	}
	uint32_t i = w->at++;
	int rc = walk_await(w, s, &w->q[i], c, ahead);
	if (rc < 0)
		return rc;                  /* its request withdrawn by the wait */
	if (w->at == w->n) {
		/* none pending (the requests ahead stopped short): the rest after s,
		 * which the walk holds, requested now, s first in the arrays */
		w->q[0] = w->q[i];
		w->q[0].recovered = 0;      /* repaired on entry */
		w->stripe[0] = s;
		w->at = w->n = 1;
		request_ahead(w, g);
	}
	return TRACT_OK;
}

/* orders key refs by stripe, then by descending index (tail first) (internal) */
static int cmp_keyref(const void *a, const void *b)
{
	const struct keyref *x = a, *y = b;
	if (x->stripe != y->stripe)
		return x->stripe < y->stripe ? -1 : 1;
	return x->idx > y->idx ? -1 : x->idx < y->idx;
}

/* the request's keys as refs sorted by stripe, tail first within a stripe;
 * NULL when out of memory (internal) */
struct keyref *tract_group_keys(const tract_region *r, const uint8_t *keys, uint32_t n)
{
	struct keyref *refs = malloc(((size_t)n + 1) * sizeof(*refs));
	if (!refs)
		return NULL;
	for (uint32_t i = 0; i < n; i++) {
		refs[i].stripe = tract_key_stripe(r, keys + (uint64_t)i * 16);
		refs[i].idx = i;
	}
	qsort(refs, n, sizeof(*refs), cmp_keyref);
	return refs;
}

/* starts the groups of refs[0..n); select (NULL: every group) is given arg
 * and a key's index (internal) */
void tract_groups_init(struct stripe_groups *g, const struct keyref *refs, uint32_t n,
		       int (*select)(const void *arg, uint32_t idx), const void *arg)
{
	g->refs = refs;
	g->n = n;
	g->select = select;
	g->arg = arg;
	g->stripe = UINT32_MAX;
	g->first = g->end = 0;
	g->ordinal = g->passed = 0;
}

/* the end of the group that starts at refs[at] (internal) */
static uint32_t group_end(const struct stripe_groups *g, uint32_t at)
{
	uint32_t j = at;
	while (j < g->n && g->refs[j].stripe == g->refs[at].stripe)
		j++;
	return j;
}

/* whether the caller wants the group refs[at..end) (internal) */
static int group_wanted(const struct stripe_groups *g, uint32_t at, uint32_t end)
{
	if (!g->select)
		return 1;
	for (uint32_t k = at; k < end; k++)
		if (g->select(g->arg, g->refs[k].idx))
			return 1;
	return 0;
}

/* moves to the next group visited: 1, or 0 when there is none (internal) */
int tract_groups_next(struct stripe_groups *g)
{
	while (g->end < g->n) {
		uint32_t at = g->end;
		g->end = group_end(g, at);
		g->passed++;
		if (!group_wanted(g, at, g->end))
			continue;
		g->first = at;
		g->stripe = g->refs[at].stripe;
		g->ordinal = g->passed - 1;
		return 1;
	}
	return 0;
}

/* observes the home buckets of refs[i..j) (one stripe's keys) and node's pin
 * lines for them with a single fence (internal) */
void tract_prefetch_group(struct stripe_ctx *c, const uint8_t *keys, const struct keyref *refs,
			  uint32_t i, uint32_t j, uint32_t node)
{
	uint64_t pre[2 * 64];
	uint32_t np = 0;
	for (uint32_t k = i; k < j && np + 2 <= 2 * 64; k++) {
		const uint8_t *key = keys + (uint64_t)refs[k].idx * 16;
		uint64_t home = c->first + tract_key_home(c->r, key);
		pre[np++] = bucket_off(c, home);
		pre[np++] = pin_off(c->r, node, home) & ~(uint64_t)(TRACT_LINE - 1);
	}
	tract_lines_prefetch(c, pre, np);
}
