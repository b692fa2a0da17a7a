/*
 * sim.c -- the non-coherence simulator (docs/PROTOCOLS.md §2).
 *
 * A set-associative write-back cache per emulated host (node) sits between
 * the accessors and the mapping.  Loads hit cached lines, stale or not,
 * until the line is invalidated; stores stay in the cache until the line is
 * flushed or evicted; a write-back writes the *whole* 64-byte line, as a
 * real cache does, so a line written from a stale copy clobbers other
 * hosts' bytes.  Random eviction (probability per access, seeded) makes
 * write-backs happen at unpredictable times; capacity conflicts evict too.
 *
 * On a coherent machine this turns a missing flush (the other host never
 * sees the value) or a missing invalidate (this host keeps reading the old
 * value) into a visible failure.
 *
 * The cache lives in the node-local segment, so every process of a node
 * shares it, as the processes of one host share its caches: a process
 * SIGKILLed inside a critical section leaves its stores in the cache, for
 * the repair of its node to write back (index_pin.c tract_stripe_repair), as
 * on a real host; a whole host's death (its segment removed with its
 * processes) loses them.  A handle without a local segment (a read-only or
 * local=False attach) has a private cache, as before it binds one.  The
 * cache's mutex is robust: a process killed holding it leaves at most the
 * one line it was copying torn, as a plain-mode memcpy would.
 */
#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define SIM_SETS 1024
#define SIM_WAYS 8

struct sim_line {
	uint64_t tag;          /* line offset + 1, 0 = invalid */
	uint32_t dirty;
	uint32_t pad;
	uint8_t data[TRACT_LINE];
};

/* one host's cache: in its node-local segment, or private to a handle */
struct tract_sim_cache {
	pthread_mutex_t mu;    /* robust, process-shared */
	struct sim_line lines[SIM_SETS][SIM_WAYS];
};

struct tract_sim {
	struct tract_sim_cache *c;     /* the node's (shared) or own */
	struct tract_sim_cache *own;   /* the private cache, until a segment is bound */
	uint64_t *ledger;      /* the private cache's payload ledger (payload.c), per slot */
	uint64_t rng;          /* this handle's eviction draws (under c->mu) */
	uint32_t evict_prob;   /* per access, in 1/2^32 units */
	uint64_t hits, misses, writebacks, evictions;   /* this handle's accesses' */
};

/* takes the cache's mutex; a holder killed inside leaves it consistent
 * enough (module comment) (internal) */
static void cache_lock(struct tract_sim_cache *c)
{
	int rc = pthread_mutex_lock(&c->mu);
	if (rc == EOWNERDEAD)
		pthread_mutex_consistent(&c->mu);
	else if (rc)
		abort();       /* not a mutex: the segment is corrupt, nothing is safe */
}

/* xorshift64* step (internal) */
static uint64_t rng_next(struct tract_sim *s)
{
	uint64_t x = s->rng;
	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	s->rng = x;
	return x * 0x2545F4914F6CDD1DULL;
}

/* set index of a line offset (internal) */
static uint32_t set_of(uint64_t line_off)
{
	uint64_t i = line_off / TRACT_LINE;
	return (uint32_t)((i ^ (i >> 10)) % SIM_SETS);
}

/* writes a dirty line back to the mapping, whole (internal) */
static void write_back(tract_region *r, struct sim_line *l)
{
	if (l->tag && l->dirty) {
		memcpy(r->base + (l->tag - 1), l->data, TRACT_LINE);
		l->dirty = 0;
		r->sim->writebacks++;
	}
}

/* evicts a line, writing it back if dirty (internal) */
static void evict(tract_region *r, struct sim_line *l)
{
	if (!l->tag)
		return;
	write_back(r, l);
	l->tag = 0;
	r->sim->evictions++;
}

/* finds a cached line or NULL (internal) */
static struct sim_line *find(struct tract_sim_cache *c, uint64_t line_off)
{
	struct sim_line *set = c->lines[set_of(line_off)];
	for (int w = 0; w < SIM_WAYS; w++)
		if (set[w].tag == line_off + 1)
			return &set[w];
	return NULL;
}

/* returns the cached line, filling it from the mapping on a miss (internal) */
static struct sim_line *get(tract_region *r, uint64_t line_off)
{
	struct tract_sim *s = r->sim;
	struct sim_line *l = find(s->c, line_off);
	if (l) {
		s->hits++;
		return l;
	}
	s->misses++;
	struct sim_line *set = s->c->lines[set_of(line_off)];
	l = NULL;
	for (int w = 0; w < SIM_WAYS && !l; w++)
		if (!set[w].tag)
			l = &set[w];
	if (!l) {
		l = &set[rng_next(s) % SIM_WAYS];
		evict(r, l);
	}
	memcpy(l->data, r->base + line_off, TRACT_LINE);
	__asm__ volatile("" ::: "memory");
	l->tag = line_off + 1;
	l->dirty = 0;
	return l;
}

/* with the configured probability, evicts one random resident line (internal) */
static void maybe_evict_random(tract_region *r)
{
	struct tract_sim *s = r->sim;
	if (!s->evict_prob || (uint32_t)rng_next(s) >= s->evict_prob)
		return;
	uint64_t x = rng_next(s);
	evict(r, &s->c->lines[x % SIM_SETS][(x >> 32) % SIM_WAYS]);
}

/* one random eviction draw per access, whatever its length (internal) */
static void evict_random_after(tract_region *r)
{
	cache_lock(r->sim->c);
	maybe_evict_random(r);
	pthread_mutex_unlock(&r->sim->c->mu);
}

/* load through the simulated cache (internal) */
static void sim_load(tract_region *r, uint64_t off, void *dst, uint64_t n)
{
	struct tract_sim *s = r->sim;
	uint8_t *d = dst;
	/* the node's cache is taken a line at a time, as a host's cache is
	 * never held for a whole range: a long copy must not stall the node's
	 * other processes (a process stalled inside a critical section widens
	 * the windows a kill can fall in) */
	while (n) {
		uint64_t lo = off & ~(uint64_t)(TRACT_LINE - 1);
		uint64_t in = off - lo;
		uint64_t k = TRACT_LINE - in < n ? TRACT_LINE - in : n;
		cache_lock(s->c);
		memcpy(d, get(r, lo)->data + in, k);
		pthread_mutex_unlock(&s->c->mu);
		d += k, off += k, n -= k;
	}
	evict_random_after(r);
}

/* store into the simulated cache; the line becomes dirty (internal) */
static void sim_store(tract_region *r, uint64_t off, const void *src, uint64_t n)
{
	struct tract_sim *s = r->sim;
	const uint8_t *p = src;
	while (n) {
		uint64_t lo = off & ~(uint64_t)(TRACT_LINE - 1);
		uint64_t in = off - lo;
		uint64_t k = TRACT_LINE - in < n ? TRACT_LINE - in : n;
		cache_lock(s->c);           /* a line at a time (sim_load) */
		struct sim_line *l = get(r, lo);
		/* dirty first: a process killed inside the copy leaves a torn
		 * dirty line, never new bytes in a line an eviction drops */
		l->dirty = 1;
		__asm__ volatile("" ::: "memory");
		memcpy(l->data + in, p, k);
		pthread_mutex_unlock(&s->c->mu);
		p += k, off += k, n -= k;
	}
	evict_random_after(r);
}

/* writes back (keep) or evicts every cached line of [off, off+n) (internal) */
static void for_lines(tract_region *r, uint64_t off, uint64_t n, int keep)
{
	struct tract_sim *s = r->sim;
	if (n == 0)
		return;
	uint64_t end = off + n;
	for (uint64_t lo = off & ~(uint64_t)(TRACT_LINE - 1); lo < end; lo += TRACT_LINE) {
		cache_lock(s->c);           /* a line at a time (sim_load) */
		struct sim_line *l = find(s->c, lo);
		if (l && keep)
			write_back(r, l);
		else if (l)
			evict(r, l);
		pthread_mutex_unlock(&s->c->mu);
	}
}

/* flush: write back; evict unless the mode is clwb, which keeps the line (internal) */
static void sim_flush(tract_region *r, uint64_t off, uint64_t n)
{
	for_lines(r, off, n, r->flush_mode == TRACT_FLUSH_CLWB);
}

/* invalidate: evict (writing back dirty data, as clflush does) (internal) */
static void sim_invalidate(tract_region *r, uint64_t off, uint64_t n)
{
	for_lines(r, off, n, 0);
}

/* fence (internal) */
static void sim_fence(tract_region *r)
{
	(void)r;
	__sync_synchronize();
}

const struct tract_ops tract_sim_ops = {
	"sim", sim_load, sim_store, sim_flush, sim_invalidate, sim_fence,
};

/* bytes of a node's cache in its local segment (internal; local.c) */
uint64_t tract_sim_cache_size(void)
{
	return sizeof(struct tract_sim_cache);
}

/* initializes a node's cache in a fresh, zeroed local segment (internal; local.c) */
int tract_sim_cache_init(void *mem)
{
	return tract_robust_init(&((struct tract_sim_cache *)mem)->mu);
}

/* creates simulator state for a region, with a private cache (internal) */
int tract_sim_create(tract_region *r)
{
	struct tract_sim *s = calloc(1, sizeof(*s));
	struct tract_sim_cache *own = calloc(1, sizeof(*own));
	int rc = s && own ? tract_robust_init(&own->mu) : TRACT_E_NOMEM;
	if (rc) {
		free(own);
		free(s);
		return rc;
	}
	s->c = s->own = own;
	s->rng = 0x9E3779B97F4A7C15ULL;
	r->sim = s;
	return TRACT_OK;
}

/* writes every dirty line of cache c back to base, as a drain would, and
 * with forget empties the cache too (internal) */
static void drain_cache(struct tract_sim_cache *c, uint8_t *base, int forget)
{
	cache_lock(c);
	for (int i = 0; i < SIM_SETS; i++)
		for (int w = 0; w < SIM_WAYS; w++) {
			struct sim_line *l = &c->lines[i][w];
			if (l->tag && l->dirty)
				memcpy(base + (l->tag - 1), l->data, TRACT_LINE);
			l->dirty = 0;
			if (forget)
				l->tag = 0;
		}
	pthread_mutex_unlock(&c->mu);
}

/* moves the handle onto its node's cache in the bound local segment: what
 * the private one holds is written back first.  A read-only handle keeps
 * its private cache: an eviction it made could write another process's
 * dirty line through its read-only mapping (internal; local.c) */
void tract_sim_bind(tract_region *r, void *cache)
{
	struct tract_sim *s = r->sim;
	if (!s || !s->own || (r->flags & TRACT_ATTACH_READONLY))
		return;
	drain_cache(s->own, r->base, 0);
	pthread_mutex_destroy(&s->own->mu);
	free(s->own);
	s->own = NULL;
	s->c = cache;
}

/* a handle without the simulator binds the node's segment: it reads and
 * writes memory directly, as if its host's caches were coherent with it, so
 * the node's simulated cache is written back and emptied first; the
 * processes of one emulated host are meant to run all simulated or all
 * plain, and a test that mixes them sees the host's cache as it was written
 * back here (internal; local.c) */
void tract_sim_flush_node(tract_region *r, void *cache)
{
	drain_cache(cache, r->base, 1);
}

/* the private cache's payload ledger, made at first use; NULL with a node's
 * cache, whose ledger is the node's (payload.c) (internal) */
uint64_t *tract_sim_ledger(tract_region *r)
{
	struct tract_sim *s = r->sim;
	if (!s->own)
		return NULL;
	uint64_t *l = __atomic_load_n(&s->ledger, __ATOMIC_ACQUIRE);
	if (l || !r->hdr.slot_count)
		return l;
	uint64_t *fresh = calloc(r->hdr.slot_count, sizeof(uint64_t));
	if (!fresh)
		return NULL;                    /* no ledger: every slot is evicted */
	uint64_t *none = NULL;
	if (!__atomic_compare_exchange_n(&s->ledger, &none, fresh, 0, __ATOMIC_ACQ_REL,
					 __ATOMIC_ACQUIRE)) {
		free(fresh);
		return none;
	}
	return fresh;
}

/* frees simulator state.  A private cache is written back, as a drain
 * would; the node's cache is left as it is: a process that exits writes
 * nothing back from its host's caches, and writing back the whole node's
 * would publish its live neighbours' unflushed stores, hiding a missing
 * flush (internal) */
void tract_sim_destroy(tract_region *r)
{
	struct tract_sim *s = r->sim;
	if (!s)
		return;
	if (s->own && !(r->flags & TRACT_ATTACH_READONLY))
		drain_cache(s->own, r->base, 0);
	if (s->own) {
		pthread_mutex_destroy(&s->own->mu);
		free(s->own);
	}
	free(s->ledger);
	free(s);
	r->sim = NULL;
}

/* Configures the simulator: random eviction probability in 1/2^32 units, rng seed. */
int tract_sim_configure(tract_region *r, uint32_t evict_prob_u32, uint64_t seed)
{
	if (!r || !r->sim)
		return TRACT_E_INVAL;
	cache_lock(r->sim->c);
	r->sim->evict_prob = evict_prob_u32;
	r->sim->rng = seed ? seed : 0x9E3779B97F4A7C15ULL;
	pthread_mutex_unlock(&r->sim->c->mu);
	return TRACT_OK;
}

/* Returns simulator counters of this handle's accesses (the cache they go
 * through is the node's once a local segment is bound): hits, misses,
 * writebacks, evictions (4 values). */
int tract_sim_stats(const tract_region *r, uint64_t *out4)
{
	if (!r || !r->sim || !out4)
		return TRACT_E_INVAL;
	out4[0] = r->sim->hits;
	out4[1] = r->sim->misses;
	out4[2] = r->sim->writebacks;
	out4[3] = r->sim->evictions;
	return TRACT_OK;
}
