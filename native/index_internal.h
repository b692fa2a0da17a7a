/*
 * index_internal.h -- what the files of the prefix index share (internal).
 *
 * The index is one table in several files, each with one job:
 *   index_stripe.c   a stripe section: the stripe lock entered and left, the
 *                    lines the section observed and wrote, the walk over
 *                    stripes requested ahead, a request's keys grouped by stripe;
 *   index_bucket.c   the buckets of an entered stripe: probing, the LRU
 *                    list, burial, LRU eviction;
 *   index_pin.c      pin counts, the repair of a stripe a holder died
 *                    inside, unpinning;
 *   index_put.c      puts: claims, slots, publication (and the zero-copy put);
 *   index_recover.c  what recovery calls: a dead process's pins and claims
 *                    given back, orphaned claims buried;
 *   index_events.c   the stripes' event logs (appended in sections, read
 *                    without a lock) and the slots' block records (KV events);
 *   index.c          the other operations: lookup, read, payload tags, eviction;
 *   audit.c          offline: the audit `tract check` reports from, and the
 *                    rebuild `tract check --repair` writes with.
 * Nothing here is seen outside them: the rest of the core calls the index
 * through tract.h and internal.h.
 */
#ifndef TRACT_INDEX_INTERNAL_H
#define TRACT_INDEX_INTERNAL_H

#include "internal.h"

/*
 * The lines one stripe section has observed: under the stripe lock nobody
 * else writes them, so after the first observe they are read with plain
 * loads, and the lines written are flushed once, all together, before the
 * lock is released (one fence instead of one per line).
 */
#define SET_CAP 1024

struct line_set {
	uint64_t off[SET_CAP];     /* line offset + 1, 0 = free */
	uint8_t dirty[SET_CAP];
	uint16_t used[SET_CAP];    /* occupied positions, to reset cheaply */
	uint32_t n_used;
};

/* a stripe entered (its lock held): where its parts lie, its LRU anchor as
 * the section has it, and the lines the section observed (internal) */
struct stripe_ctx {
	tract_region *r;
	struct line_set *set;
	uint32_t stripe;
	uint64_t first;       /* first bucket index of the stripe */
	uint64_t size;        /* buckets in the stripe (power of two) */
	uint64_t bucket_off;  /* region offset of bucket 0 */
	uint64_t lru_off;     /* region offset of the stripe's LRU anchor */
	struct tract_lru_anchor lru;
	int lru_dirty;
	int recovered;        /* a process of this node died inside: lines may be dirty here */
	uint64_t ev_next;     /* the stripe log's head as this section has it (ev_loaded) */
	int ev_loaded;
	int ev_dirty;         /* events appended: the head is written back at the flush */
};

/* the index's geometry and key rule: tract_index_buckets, tract_key_stripe,
 * tract_key_home (internal.h), shared with audit.c */

/* region offset of bucket b (internal) */
static inline uint64_t bucket_off(const struct stripe_ctx *c, uint64_t b)
{
	return c->bucket_off + b * TRACT_LINE;
}

/* region offset of the u16 pin count of bucket b for node n (internal) */
static inline uint64_t pin_off(const tract_region *r, uint32_t node, uint64_t b)
{
	const struct tract_section *s = tract_sec(r, TRACT_SEC_PINS);
	return s->offset + (uint64_t)node * s->entry_size + b * 2;
}

/* checks a handle can use the index (internal) */
static inline int index_usable(const tract_region *r)
{
	if (!r || (r->flags & TRACT_ATTACH_READONLY))
		return TRACT_E_INVAL;
	return r->local ? TRACT_OK : TRACT_E_NO_LOCAL;
}

/* ---- a stripe section (index_stripe.c) ---- */

/* reads a line: observed the first time, plain loads after (internal) */
void tract_line_get(struct stripe_ctx *c, uint64_t off, void *dst);

/* writes a whole line; flushed when the section ends (internal) */
void tract_line_put(struct stripe_ctx *c, uint64_t off, const void *src);

/* observes lines offs[0..k) not observed yet with one fence, their loads
 * started at once (internal) */
void tract_lines_prefetch(struct stripe_ctx *c, const uint64_t *offs, uint32_t k);

/* fills the context of a stripe whose lock the caller holds (internal) */
void tract_stripe_init(tract_region *r, uint32_t stripe, struct stripe_ctx *c,
		       struct line_set *set);

/* locks a stripe and loads its LRU anchor (internal) */
int tract_stripe_enter(tract_region *r, uint32_t stripe, uint64_t timeout_ns,
		       struct stripe_ctx *c, struct line_set *set);

/* appends an event of bucket BK (its key, slot, tokens, epoch) to the entered
 * stripe's log (index_events.c) (internal) */
void tract_event_append(struct stripe_ctx *c, uint32_t kind, const struct tract_bucket *bk);

/* writes back every line of the entered stripe's log (the repair of a
 * stripe a holder died inside; the caller fences) (index_events.c) (internal) */
void tract_events_write_back(struct stripe_ctx *c);

/* writes back SLOT's record (a dead writer's claim dropped; the caller
 * fences) (index_events.c) (internal) */
void tract_record_write_back(tract_region *r, uint32_t slot);

/* moves the entered stripe's log head on past a whole ring: every reader
 * finds its cursor overrun and resynchronises from a snapshot (an offline
 * rebuild, which changes READY buckets without events) (index_events.c) (internal) */
void tract_events_skip(struct stripe_ctx *c);

/* writes the head of the entered stripe's log back if events were appended
 * (index_events.c: the section's flush) (internal) */
void tract_events_flush_head(struct stripe_ctx *c);

/* writes the records of the claimed keys' slots, before they turn READY
 * (index_events.c: a publishing commit) (internal) */
void tract_records_write(tract_region *r, const uint8_t *keys, uint32_t n, const uint8_t *status,
			 uint8_t claimed, const uint32_t *slots,
			 const struct tract_block_record *desc, const uint32_t *token_ids);

/* writes the anchor back, flushes what the section wrote, fences: the end of
 * a section, without the unlock (offline rebuild: audit.c) (internal) */
void tract_stripe_flush(struct stripe_ctx *c);

/* writes the anchor back, flushes what the section wrote, fences, unlocks (internal) */
void tract_stripe_leave(struct stripe_ctx *c);

/*
 * A walk over stripes in ascending order, requested ahead: on entering its
 * first stripe a walk requests every stripe it will enter (up to
 * WALK_AHEAD), each request naming the one below it, so the lock manager
 * grants them in order, most in the scan that grants the first, and a walk of
 * 16 stripes waits for about one grant instead of 16.  Deadlock-free: the
 * manager grants a walk's request only once the one below it is granted or
 * gone, so a walk holds only locks below the one it waits for
 * (docs/PROTOCOLS.md §4).  Only the local tier's mutexes are tried ahead; the
 * requests stop before one another process of the node holds (requested in
 * turn, once the walk holds nothing), before a dead holder's grant to take
 * over, and after one whose local mutex a dead process left (entered to
 * repair, even if the caller skips it) (internal).
 */
#define WALK_AHEAD TRACT_WALK_AHEAD_MAX     /* TRACT_WALK_AHEAD: fewer (internal.h) */

struct stripe_walk {
	tract_region *r;
	struct line_set *set;
	uint64_t timeout_ns;
	uint32_t at, n;                         /* pending: [at, n), ascending */
	uint32_t stripe[WALK_AHEAD];
	struct tract_lock_req q[WALK_AHEAD];
};

struct stripe_groups;

/* a walk with nothing requested yet (internal) */
void tract_walk_init(struct stripe_walk *w, tract_region *r, struct line_set *set,
		     uint64_t timeout_ns);

/* enters the stripe of g's current group (its request pending or made now),
 * requesting those of g's groups after it ahead (internal) */
int tract_walk_enter(struct stripe_walk *w, const struct stripe_groups *g, struct stripe_ctx *c);

/* withdraws the walk's pending requests, if any (internal) */
void tract_walk_end(struct stripe_walk *w);

/* a key of a request: its stripe and its index in the request (internal) */
struct keyref {
	uint32_t stripe;
	uint32_t idx;
};

/* the request's keys as refs sorted by stripe, tail first within a stripe;
 * NULL when out of memory (internal) */
struct keyref *tract_group_keys(const tract_region *r, const uint8_t *keys, uint32_t n);

/*
 * A request's keys one stripe group at a time, in ascending stripe order
 * (refs from tract_group_keys): a group is refs[first..end), the keys of
 * one stripe, tail first.  With `select`, only the groups where it holds
 * for some key are visited.  A copy of the groups goes on from the
 * current group without moving it (a walk's requests made ahead).
 *
 *	struct stripe_groups g;
 *	tract_groups_init(&g, refs, n, NULL, NULL);
 *	while (tract_groups_next(&g))
 *		... tract_walk_enter(&walk, &g, &c); visit refs[g.first..g.end) ...
 * (internal)
 */
struct stripe_groups {
	const struct keyref *refs;
	uint32_t n;
	int (*select)(const void *arg, uint32_t idx);   /* wants key idx's group; NULL: all */
	const void *arg;
	uint32_t stripe;        /* the current group's stripe */
	uint32_t first, end;    /* its keys: refs[first..end) */
	uint32_t ordinal;       /* the groups before it, visited or not */
	uint32_t passed;        /* groups scanned so far */
};

/* starts the groups of refs[0..n); select (NULL: every group) is given arg
 * and a key's index (internal) */
void tract_groups_init(struct stripe_groups *g, const struct keyref *refs, uint32_t n,
		       int (*select)(const void *arg, uint32_t idx), const void *arg);

/* moves to the next group visited: 1, or 0 when there is none (internal) */
int tract_groups_next(struct stripe_groups *g);

/* observes the home buckets of refs[i..j) (one stripe's keys) and node's pin
 * lines for them with a single fence (internal) */
void tract_prefetch_group(struct stripe_ctx *c, const uint8_t *keys, const struct keyref *refs,
			  uint32_t i, uint32_t j, uint32_t node);

/* ---- the buckets of an entered stripe (index_bucket.c; the accessors here) ---- */

/* whether bucket b belongs to the entered stripe: LRU links and anchors are
 * read from the region, written by other hosts, and checked before use (internal) */
static inline int in_stripe(const struct stripe_ctx *c, uint64_t b)
{
	return b >= c->first && b - c->first < c->size;
}

/* whether a bucket's slot field names a slot of the region (internal) */
static inline int slot_ok(const struct stripe_ctx *c, const struct tract_bucket *k)
{
	return k->slot && k->slot - 1 < c->r->hdr.slot_count;
}

/* loads bucket b; a b outside the stripe (a corrupt link) reads as EMPTY (internal) */
static inline void load_bucket(struct stripe_ctx *c, uint64_t b, struct tract_bucket *out)
{
	if (!in_stripe(c, b)) {
		memset(out, 0, sizeof(*out));
		return;
	}
	tract_line_get(c, bucket_off(c, b), out);
}

/* stores bucket b; never outside the stripe (internal) */
static inline void store_bucket(struct stripe_ctx *c, uint64_t b, const struct tract_bucket *in)
{
	if (in_stripe(c, b))
		tract_line_put(c, bucket_off(c, b), in);
}

/* probes for key: the bucket holding it (PENDING or READY) in *found, else
 * UINT64_MAX; the first reusable bucket on the path in *free_b (internal) */
void tract_probe(struct stripe_ctx *c, const uint8_t *key, uint64_t *found, uint64_t *free_b,
		 struct tract_bucket *out);

/* unlinks bucket b (state READY, in the list) from the stripe's LRU (internal) */
void tract_lru_unlink(struct stripe_ctx *c, uint64_t b, struct tract_bucket *k);

/* links bucket b at the head (most recent); the caller stores *k (internal) */
void tract_lru_push_head(struct stripe_ctx *c, uint64_t b, struct tract_bucket *k);

/* moves the READY buckets hit[0..n) to the head in that order (the last
 * one ends up most recent), stamping their access time; writes nothing
 * when the list already starts with them in the order this leaves (internal) */
void tract_lru_touch_run(struct stripe_ctx *c, const uint64_t *hit, uint32_t n);

/* relinks the entered stripe's LRU list from its READY buckets when a
 * holder that died inside left it broken: 1 relinked, 0 it was whole,
 * TRACT_E_NOMEM (internal) */
int tract_lru_repair(struct stripe_ctx *c);

/* turns an unlinked bucket into a tombstone, or EMPTY where its probe chain
 * ends (internal) */
void tract_bury(struct stripe_ctx *c, uint64_t b);

/* evicts up to max of the entered stripe's unpinned READY entries, least
 * recent first; their slots go to slots[], for the caller to free after
 * the stripe lock; returns how many (internal) */
uint32_t tract_evict_lru(struct stripe_ctx *c, uint32_t max, uint32_t *slots,
			 struct tract_slot_owner *owners);

/* ---- pins (index_pin.c) ---- */

/* node's pin count of bucket b; buf gets the line holding it (internal) */
uint16_t tract_pin_count(struct stripe_ctx *c, uint32_t node, uint64_t b,
			 uint8_t buf[TRACT_LINE]);

/* adds delta to node's pin count of bucket b: one store (internal) */
int tract_pin_add(struct stripe_ctx *c, uint64_t b, uint32_t node, int delta);
int tract_pin_move(struct stripe_ctx *c, uint64_t b, const uint8_t *key, int dpins);

/* whether any node pins bucket b (internal) */
int tract_pinned(struct stripe_ctx *c, uint64_t b);

/* repairs the entered stripe after a process of this host died inside it:
 * writes back every line it may have left dirty here (one fence), then
 * makes the LRU list whole (internal) */
void tract_stripe_repair(struct stripe_ctx *c);

/* ---- the operations (index.c) ---- */

/* evicts up to want unpinned READY entries, LRU first, spread over the
 * stripes from *cursor on; their slots are freed (internal) */
int tract_evict_spread(tract_region *r, uint32_t want, uint32_t *cursor, uint32_t *evicted,
		       uint64_t timeout_ns);

#endif
