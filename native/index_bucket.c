/*
 * index_bucket.c -- the buckets of an entered stripe (docs/PROTOCOLS.md §9):
 * probing for a key, the stripe's LRU list, burial, LRU eviction.
 *
 * A key probes linearly from its home bucket, wrapping inside its stripe
 * (the key rule: internal.h).  LRU per stripe: a doubly linked list through
 * the buckets (index + 1 links), head = most recent.  A request's keys are
 * touched tail first, so its head block ends up the most recent: under
 * pressure a chain loses its tail before its head.  Evicted buckets become
 * TOMBSTONE, or EMPTY when the next bucket of the probe sequence is EMPTY
 * (and preceding tombstones with them), which keeps probe chains short
 * under churn.  Links and anchors are read from the region, written by
 * other hosts, so each is checked to lie in the stripe before it is used.
 */
#include <stdlib.h>
#include <string.h>

#include "index_internal.h"

#define NONE 0u

/*
 * Probes for key: returns the bucket holding it (state PENDING or READY) in
 * *found, or UINT64_MAX; *free_b gets the first reusable bucket on the path
 * (TOMBSTONE or EMPTY), UINT64_MAX if the stripe is full (internal).
 */
void tract_probe(struct stripe_ctx *c, const uint8_t *key, uint64_t *found, uint64_t *free_b,
		 struct tract_bucket *out)
{
	uint64_t home = tract_key_home(c->r, key);
	*found = *free_b = UINT64_MAX;
	for (uint64_t i = 0; i < c->size; i++) {
		uint64_t b = c->first + ((home + i) & (c->size - 1));
		struct tract_bucket k;
		load_bucket(c, b, &k);
		if (k.state == TRACT_BUCKET_EMPTY) {
			if (*free_b == UINT64_MAX)
				*free_b = b;
			return;
		}
		if (k.state == TRACT_BUCKET_TOMBSTONE) {
			if (*free_b == UINT64_MAX)
				*free_b = b;
			continue;
		}
		if (!memcmp(k.key, key, 16)) {
			*found = b;
			if (out)
				*out = k;
			return;
		}
	}
}

/* unlinks bucket b (state READY, in the list) from the stripe's LRU (internal) */
void tract_lru_unlink(struct stripe_ctx *c, uint64_t b, struct tract_bucket *k)
{
	if (k->lru_prev && !in_stripe(c, k->lru_prev - 1))
		k->lru_prev = NONE;             /* a corrupt link: cut here */
	if (k->lru_next && !in_stripe(c, k->lru_next - 1))
		k->lru_next = NONE;
	if (k->lru_prev) {
		struct tract_bucket p;
		load_bucket(c, k->lru_prev - 1, &p);
		p.lru_next = k->lru_next;
		store_bucket(c, k->lru_prev - 1, &p);
	} else {
		c->lru.head = k->lru_next;
	}
	if (k->lru_next) {
		struct tract_bucket n;
		load_bucket(c, k->lru_next - 1, &n);
		n.lru_prev = k->lru_prev;
		store_bucket(c, k->lru_next - 1, &n);
	} else {
		c->lru.tail = k->lru_prev;
	}
	k->lru_prev = k->lru_next = NONE;
	c->lru.count--;
	c->lru_dirty = 1;
	(void)b;
}

/* links bucket b at the head (most recent); the caller stores *k (internal) */
void tract_lru_push_head(struct stripe_ctx *c, uint64_t b, struct tract_bucket *k)
{
	if (c->lru.head && !in_stripe(c, c->lru.head - 1))
		c->lru.head = c->lru.tail = NONE;   /* a corrupt anchor: restart the list */
	k->lru_prev = NONE;
	k->lru_next = c->lru.head;
	if (c->lru.head) {
		struct tract_bucket h;
		load_bucket(c, c->lru.head - 1, &h);
		h.lru_prev = (uint32_t)(b + 1);
		store_bucket(c, c->lru.head - 1, &h);
	} else {
		c->lru.tail = (uint32_t)(b + 1);
	}
	c->lru.head = (uint32_t)(b + 1);
	c->lru.count++;
	c->lru_dirty = 1;
}

/*
 * Whether the buckets hit[n-1], ..., hit[0] follow each other in the list in
 * that order, linked both ways: a run the moves would carry to the head
 * whole.  The links were read from the region (another host wrote them), so
 * each is checked; distinct buckets follow from a list without cycles, and
 * a corrupt one at worst splices a wrong run, never outside the stripe
 * (internal).
 */
static int lru_run(struct stripe_ctx *c, const uint64_t *hit, uint32_t n)
{
	for (uint32_t i = n - 1; i > 0; i--) {
		struct tract_bucket k;
		load_bucket(c, hit[i], &k);
		if (k.lru_next != hit[i - 1] + 1 || hit[i] == hit[i - 1])
			return 0;
		load_bucket(c, hit[i - 1], &k);
		if (k.lru_prev != hit[i] + 1)
			return 0;
	}
	return 1;
}

/*
 * Moves the READY buckets hit[0..n) to the head one after the other, so
 * that hit[n-1] ends up most recent, and stamps their access times in that
 * order.  Two cases write less, with the same order as a result:
 * - a prefix hit again in the same order (a hot prefix, looked up by
 *   request after request) finds the list already starting with
 *   hit[n-1], ..., hit[0]: nothing is written, no bucket line dirtied;
 * - hits that already follow each other in that order further down the list
 *   (a chain looked up whole before, other blocks touched since) are spliced
 *   to the head as one run: the run's two ends, its old neighbours and the
 *   old head are written, not every block of it (in clflush mode each
 *   written line is a serialized flush before the stripe lock is released).
 * A spliced run keeps its inner blocks' access times: the order a relink
 * after a death or the offline rebuild derives from them is approximate
 * there, while the list itself stays exact (internal).
 */
void tract_lru_touch_run(struct stripe_ctx *c, const uint64_t *hit, uint32_t n)
{
	if (!n)
		return;
	uint32_t cur = c->lru.head, i = n;
	while (i > 0 && cur == hit[i - 1] + 1) {
		struct tract_bucket k;
		load_bucket(c, hit[i - 1], &k);
		cur = k.lru_next;
		i--;
	}
	if (i == 0)
		return;
	uint64_t now = tract_now_ns();
	if (n > 2 && lru_run(c, hit, n)) {
		struct tract_bucket first, last;      /* the run's most and least recent */
		load_bucket(c, hit[n - 1], &first);
		load_bucket(c, hit[0], &last);
		uint32_t before = first.lru_prev, after = last.lru_next;
		if (before && in_stripe(c, before - 1)) {
			struct tract_bucket p;
			load_bucket(c, before - 1, &p);
			p.lru_next = after;
			store_bucket(c, before - 1, &p);
		}
		if (after && in_stripe(c, after - 1)) {
			struct tract_bucket x;
			load_bucket(c, after - 1, &x);
			x.lru_prev = before;
			store_bucket(c, after - 1, &x);
		} else {
			c->lru.tail = before;
		}
		/* the old head (not in the run: the run does not start the list);
		 * a corrupt anchor's is dropped, as tract_lru_push_head does */
		uint32_t head = c->lru.head;
		if (head && !in_stripe(c, head - 1))
			head = NONE;
		if (head) {
			struct tract_bucket h;
			load_bucket(c, head - 1, &h);
			h.lru_prev = (uint32_t)(hit[0] + 1);
			store_bucket(c, head - 1, &h);
		}
		load_bucket(c, hit[0], &last);    /* may be `after`'s neighbour: reload */
		last.lru_next = head;
		last.last_access_ns = now;
		store_bucket(c, hit[0], &last);
		load_bucket(c, hit[n - 1], &first);
		first.lru_prev = 0;
		first.last_access_ns = now + n;
		store_bucket(c, hit[n - 1], &first);
		c->lru.head = (uint32_t)(hit[n - 1] + 1);
		c->lru_dirty = 1;
		tract_maybe_die(TRACT_DIE_LRU_MOVED);
		return;
	}
	for (uint32_t j = 0; j < n; j++) {
		struct tract_bucket k;
		load_bucket(c, hit[j], &k);
		if (c->lru.head != hit[j] + 1) {
			tract_lru_unlink(c, hit[j], &k);
			tract_lru_push_head(c, hit[j], &k);
		}
		k.last_access_ns = now + j;     /* distinct, in the order of the list */
		store_bucket(c, hit[j], &k);
		tract_maybe_die(TRACT_DIE_LRU_MOVED);
	}
}

/* walks the list from head while each bucket is READY, in the stripe and
 * linked back to the one before: the walk's last bucket in *tail, the
 * buckets walked in *seen; whether it reached the end of the list (internal) */
static int lru_walk(struct stripe_ctx *c, uint32_t head, uint32_t *tail, uint64_t *seen)
{
	uint32_t prev = NONE, cur = head;
	*seen = 0;
	while (cur && *seen < c->size && in_stripe(c, cur - 1)) {
		struct tract_bucket k;
		load_bucket(c, cur - 1, &k);
		if (k.state != TRACT_BUCKET_READY || k.lru_prev != prev)
			break;
		prev = cur;
		cur = k.lru_next;
		(*seen)++;
	}
	*tail = prev;
	return cur == NONE;
}

/* the READY buckets of the entered stripe; *head gets the one bucket with
 * no predecessor, NONE when there are none or several (internal) */
static uint64_t lru_ready(struct stripe_ctx *c, uint32_t *head)
{
	uint64_t ready = 0, heads = 0;
	*head = NONE;
	for (uint64_t b = c->first; b < c->first + c->size; b++) {
		struct tract_bucket k;
		load_bucket(c, b, &k);
		if (k.state != TRACT_BUCKET_READY)
			continue;
		ready++;
		if (k.lru_prev == NONE && heads++ == 0)
			*head = (uint32_t)(b + 1);
	}
	if (heads != 1)
		*head = NONE;
	return ready;
}

/* whether the entered stripe's LRU list, as its anchor and links say, holds
 * exactly its READY buckets, each linked both ways (internal) */
static int lru_whole(struct stripe_ctx *c)
{
	uint32_t tail, head;
	uint64_t seen;
	return lru_walk(c, c->lru.head, &tail, &seen) && tail == c->lru.tail &&
	       seen == c->lru.count && seen == lru_ready(c, &head);
}

/* a READY bucket and when it last moved, for the relink (internal) */
struct aged {
	uint64_t ns;
	uint64_t b;
};

/* oldest first, then by bucket index (internal) */
static int by_age(const void *x, const void *y)
{
	const struct aged *a = x, *b = y;
	if (a->ns != b->ns)
		return a->ns < b->ns ? -1 : 1;
	return a->b < b->b ? -1 : a->b > b->b;
}

/*
 * Whether the links alone make a whole list of the stripe's READY buckets
 * (exactly one without a predecessor, each linked both ways, all reached);
 * if so the anchor is set from them (internal).
 */
static int lru_from_links(struct stripe_ctx *c)
{
	uint32_t head, tail;
	uint64_t seen, ready = lru_ready(c, &head);
	if ((ready && !head) || !lru_walk(c, head, &tail, &seen) || seen != ready)
		return 0;
	c->lru.head = head;
	c->lru.tail = tail;
	c->lru.count = seen;
	c->lru_dirty = 1;
	return 1;
}

/*
 * Makes the entered stripe's LRU list whole again after a holder died
 * inside it: the anchor lived in the dead process's memory until it left
 * the stripe, the links were stored as the moves went, so a death in the
 * middle of moves or of an eviction leaves them disagreeing.  A list that
 * is whole is left as it is.  Links that make a whole list by themselves
 * (the death fell between two whole moves: only the anchor is stale) give
 * the anchor, keeping the exact order.  Otherwise every READY bucket is
 * relinked, least recent (last_access_ns, then index) at the tail, the
 * order the offline rebuild gives (approximate where a run was spliced:
 * its inner blocks keep older times).  Returns 1 when it changed the
 * list, 0 when it was whole, TRACT_E_NOMEM (internal).
 */
int tract_lru_repair(struct stripe_ctx *c)
{
	if (lru_whole(c))
		return 0;
	if (lru_from_links(c))
		return 1;
	struct aged *all = malloc(c->size * sizeof(*all));
	if (!all)
		return TRACT_E_NOMEM;
	uint64_t n = 0;
	for (uint64_t b = c->first; b < c->first + c->size; b++) {
		struct tract_bucket k;
		load_bucket(c, b, &k);
		if (k.state == TRACT_BUCKET_READY)
			all[n++] = (struct aged){ k.last_access_ns, b };
	}
	qsort(all, n, sizeof(*all), by_age);
	c->lru.head = c->lru.tail = NONE;
	c->lru.count = 0;
	for (uint64_t i = 0; i < n; i++) {
		struct tract_bucket k;
		load_bucket(c, all[i].b, &k);
		tract_lru_push_head(c, all[i].b, &k);
		store_bucket(c, all[i].b, &k);
	}
	c->lru_dirty = 1;
	free(all);
	return 1;
}

/* turns an unlinked bucket into a tombstone or, where the probe chain ends
 * right after it, into EMPTY together with the tombstones before it (internal) */
void tract_bury(struct stripe_ctx *c, uint64_t b)
{
	uint64_t rel = b - c->first;
	struct tract_bucket next;
	load_bucket(c, c->first + ((rel + 1) & (c->size - 1)), &next);
	struct tract_bucket dead, was;
	load_bucket(c, b, &was);
	memset(&dead, 0, sizeof(dead));
	dead.epoch = was.epoch;     /* kept: a later claim's tag must differ (payload.c) */
	if (next.state != TRACT_BUCKET_EMPTY) {
		dead.state = TRACT_BUCKET_TOMBSTONE;
		store_bucket(c, b, &dead);
		return;
	}
	store_bucket(c, b, &dead);     /* EMPTY */
	for (uint64_t i = 1; i < c->size; i++) {
		uint64_t p = c->first + ((rel - i) & (c->size - 1));
		struct tract_bucket k;
		load_bucket(c, p, &k);
		if (k.state != TRACT_BUCKET_TOMBSTONE)
			break;
		uint32_t epoch = k.epoch;
		memset(&k, 0, sizeof(k));
		k.epoch = epoch;
		store_bucket(c, p, &k);
	}
}

/* evicts up to max of the entered stripe's READY entries with no pins, least
 * recent first: each is unlinked and buried, its slot put in slots[] and who
 * owned it in owners[] (observed before the bucket stops naming it), and
 * journaled as evicted, for the caller to free (tract_free_evicted, which
 * forgets them) once it has left the stripe; returns how many (internal) */
uint32_t tract_evict_lru(struct stripe_ctx *c, uint32_t max, uint32_t *slots,
			 struct tract_slot_owner *owners)
{
	uint32_t cur = c->lru.tail, got = 0;
	/* bounded by the stripe's size: a corrupt list may cycle */
	for (uint64_t steps = 0; cur && got < max && steps < c->size; steps++) {
		uint64_t b = cur - 1;
		if (!in_stripe(c, b))
			break;                  /* a corrupt link */
		struct tract_bucket bk;
		load_bucket(c, b, &bk);
		cur = bk.lru_prev;
		if (bk.state != TRACT_BUCKET_READY || !slot_ok(c, &bk) || tract_pinned(c, b))
			continue;     /* pinned blocks are never evicted */
		tract_slot_owner_of(c->r, bk.slot - 1, &owners[got]);
		tract_event_append(c, TRACT_EVENT_REMOVED, &bk);
		tract_lru_unlink(c, b, &bk);
		slots[got] = bk.slot - 1;
		c->lru.evictions++;
		tract_bury(c, b);
		/* from here only this process names the slot: journaled, so that
		 * its node's agent frees it if the process dies before its free
		 * (a death between the burial and this leaks it, one slot) */
		tract_journal_evicted(c->r, &slots[got], &owners[got], 1, 0);
		got++;
	}
	return got;
}
