/*
 * sim.c -- the non-coherence simulator (docs/PROTOCOLS.md §2).
 *
 * A private, set-associative write-back cache per process sits between the
 * accessors and the mapping.  Loads hit cached lines, stale or not, until
 * the line is invalidated; stores stay in the cache until the line is
 * flushed or evicted; a write-back writes the *whole* 64-byte line, as a
 * real cache does, so a line written from a stale copy clobbers other
 * hosts' bytes.  Random eviction (probability per access, seeded) makes
 * write-backs happen at unpredictable times; capacity conflicts evict too.
 *
 * On a coherent machine this turns a missing flush (the other process never
 * sees the value) or a missing invalidate (this process keeps reading the
 * old value) into a visible failure.  Threads of one process share the
 * cache, as threads of one host share its caches.
 */
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

struct tract_sim {
	pthread_mutex_t mu;
	uint64_t *ledger;      /* this process's payload ledger (payload.c), per slot */
	uint64_t rng;
	uint32_t evict_prob;   /* per access, in 1/2^32 units */
	uint64_t hits, misses, writebacks, evictions;
	struct sim_line lines[SIM_SETS][SIM_WAYS];
};

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
static struct sim_line *find(struct tract_sim *s, uint64_t line_off)
{
	struct sim_line *set = s->lines[set_of(line_off)];
	for (int w = 0; w < SIM_WAYS; w++)
		if (set[w].tag == line_off + 1)
			return &set[w];
	return NULL;
}

/* returns the cached line, filling it from the mapping on a miss (internal) */
static struct sim_line *get(tract_region *r, uint64_t line_off)
{
	struct tract_sim *s = r->sim;
	struct sim_line *l = find(s, line_off);
	if (l) {
		s->hits++;
		return l;
	}
	s->misses++;
	struct sim_line *set = s->lines[set_of(line_off)];
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
	evict(r, &s->lines[x % SIM_SETS][(x >> 32) % SIM_WAYS]);
}

/* load through the simulated cache (internal) */
static void sim_load(tract_region *r, uint64_t off, void *dst, uint64_t n)
{
	struct tract_sim *s = r->sim;
	uint8_t *d = dst;
	pthread_mutex_lock(&s->mu);
	while (n) {
		uint64_t lo = off & ~(uint64_t)(TRACT_LINE - 1);
		uint64_t in = off - lo;
		uint64_t k = TRACT_LINE - in < n ? TRACT_LINE - in : n;
		memcpy(d, get(r, lo)->data + in, k);
		d += k, off += k, n -= k;
	}
	maybe_evict_random(r);
	pthread_mutex_unlock(&s->mu);
}

/* store into the simulated cache; the line becomes dirty (internal) */
static void sim_store(tract_region *r, uint64_t off, const void *src, uint64_t n)
{
	struct tract_sim *s = r->sim;
	const uint8_t *p = src;
	pthread_mutex_lock(&s->mu);
	while (n) {
		uint64_t lo = off & ~(uint64_t)(TRACT_LINE - 1);
		uint64_t in = off - lo;
		uint64_t k = TRACT_LINE - in < n ? TRACT_LINE - in : n;
		struct sim_line *l = get(r, lo);
		memcpy(l->data + in, p, k);
		l->dirty = 1;
		p += k, off += k, n -= k;
	}
	maybe_evict_random(r);
	pthread_mutex_unlock(&s->mu);
}

/* writes back (keep) or evicts every cached line of [off, off+n) (internal) */
static void for_lines(tract_region *r, uint64_t off, uint64_t n, int keep)
{
	struct tract_sim *s = r->sim;
	if (n == 0)
		return;
	pthread_mutex_lock(&s->mu);
	uint64_t end = off + n;
	for (uint64_t lo = off & ~(uint64_t)(TRACT_LINE - 1); lo < end; lo += TRACT_LINE) {
		struct sim_line *l = find(s, lo);
		if (!l)
			continue;
		if (keep)
			write_back(r, l);
		else
			evict(r, l);
	}
	pthread_mutex_unlock(&s->mu);
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

/* creates simulator state for a region (internal) */
int tract_sim_create(tract_region *r)
{
	struct tract_sim *s = calloc(1, sizeof(*s));
	if (!s)
		return TRACT_E_NOMEM;
	pthread_mutex_init(&s->mu, NULL);
	s->rng = 0x9E3779B97F4A7C15ULL;
	r->sim = s;
	return TRACT_OK;
}

/* this process's payload ledger, made at first use: the simulated cache is
 * per process, so what it may hold is too (payload.c) (internal) */
uint64_t *tract_sim_ledger(tract_region *r)
{
	struct tract_sim *s = r->sim;
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

/* frees simulator state, writing back dirty lines as a cache drain would (internal) */
void tract_sim_destroy(tract_region *r)
{
	struct tract_sim *s = r->sim;
	if (!s)
		return;
	if (!(r->flags & TRACT_ATTACH_READONLY))
		for (int i = 0; i < SIM_SETS; i++)
			for (int w = 0; w < SIM_WAYS; w++)
				write_back(r, &s->lines[i][w]);
	pthread_mutex_destroy(&s->mu);
	free(s->ledger);
	free(s);
	r->sim = NULL;
}

/* Configures the simulator: random eviction probability in 1/2^32 units, rng seed. */
int tract_sim_configure(tract_region *r, uint32_t evict_prob_u32, uint64_t seed)
{
	if (!r || !r->sim)
		return TRACT_E_INVAL;
	pthread_mutex_lock(&r->sim->mu);
	r->sim->evict_prob = evict_prob_u32;
	r->sim->rng = seed ? seed : 0x9E3779B97F4A7C15ULL;
	pthread_mutex_unlock(&r->sim->mu);
	return TRACT_OK;
}

/* Returns simulator counters: hits, misses, writebacks, evictions (4 values). */
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
