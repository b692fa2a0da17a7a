/*
 * alloc.c -- the slot allocator (docs/ARCHITECTURE.md §8, docs/PROTOCOLS.md §5).
 *
 * Ground truth is the region: bitmap bit i = slot i taken from the pool,
 * owners[i] = claiming node + 1.  A node claims slots in batches under the
 * allocator lock (lock 0) and serves allocate/free from its free list in
 * the node-local segment, so the common path takes no global lock and
 * writes no shared metadata.  Free reads the owner map (no lock, no write)
 * to tell its own slots from others': a slot claimed by another node goes
 * back to the region, batched, so claims stay exact and a dead node's slots
 * can be recovered precisely.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define BATCH 64
#define HIGH_WATER (8 * BATCH)
#define LOCK_ALLOC 0

/* the node's free list and its membership bits (internal) */
static uint32_t *free_list(const tract_region *r)
{
	return (uint32_t *)((uint8_t *)r->local + r->local->free_list_off);
}

static uint8_t *free_bits(const tract_region *r)
{
	return (uint8_t *)r->local + r->local->free_bits_off;
}

/* sets owners[slot] for a sorted list of slots, a line at a time (internal) */
static void set_owners(tract_region *r, const uint32_t *slots, uint32_t n, uint8_t value)
{
	uint64_t base = tract_sec(r, TRACT_SEC_OWNERS)->offset;
	uint8_t line[TRACT_LINE];
	for (uint32_t i = 0; i < n;) {
		uint64_t lo = (uint64_t)slots[i] & ~63ULL;
		tract_observe_line(r, base + lo, line);
		for (; i < n && ((uint64_t)slots[i] & ~63ULL) == lo; i++)
			line[slots[i] - lo] = value;
		tract_write_line(r, base + lo, line);
	}
}

/* reads, updates and writes back the allocator header (internal) */
static void update_header(tract_region *r, int64_t used_delta, uint64_t hint, int claim)
{
	uint64_t off = tract_sec(r, TRACT_SEC_ALLOC)->offset;
	struct tract_alloc_header h;
	tract_observe_line(r, off, (uint8_t *)&h);
	h.used_slots = (uint64_t)((int64_t)h.used_slots + used_delta);
	if (claim) {
		h.next_hint = hint;
		h.claims++;
	} else {
		h.releases++;
	}
	tract_write_line(r, off, (const uint8_t *)&h);
}

/* claims up to want free slots under the allocator lock onto the node's
 * free list (inside the critical section: a slot is never between the two
 * when a process dies) (internal; alloc_mu held) */
static void push_local(tract_region *r, const uint32_t *slots, uint32_t n);

static int claim(tract_region *r, uint32_t want, uint32_t *out, uint32_t *got,
		 uint64_t timeout_ns)
{
	int rc = tract_lock_acquire(r, LOCK_ALLOC, timeout_ns, NULL);
	if (rc < 0)
		return rc;
	uint64_t slots = r->hdr.slot_count;
	uint64_t bm = tract_sec(r, TRACT_SEC_BITMAP)->offset;
	struct tract_alloc_header h;
	tract_observe_line(r, tract_sec(r, TRACT_SEC_ALLOC)->offset, (uint8_t *)&h);
	uint64_t lines = (slots + 511) / 512;
	uint64_t start = (h.next_hint < slots ? h.next_hint : 0) / 512;
	uint32_t n = 0;
	uint8_t line[TRACT_LINE];
	for (uint64_t k = 0; k < lines && n < want; k++) {
		uint64_t li = (start + k) % lines;
		tract_observe_line(r, bm + li * TRACT_LINE, line);
		int dirty = 0;
		for (uint32_t b = 0; b < 512 && n < want; b++) {
			uint64_t s = li * 512 + b;
			if (s >= slots)
				break;
			if (!(line[b / 8] & (1u << (b % 8)))) {
				line[b / 8] |= (uint8_t)(1u << (b % 8));
				out[n++] = (uint32_t)s;
				dirty = 1;
			}
		}
		if (dirty)
			tract_write_line(r, bm + li * TRACT_LINE, line);
	}
	if (n) {
		uint32_t last = out[n - 1];
		/* out is ascending except across the wrap: sort for set_owners */
		for (uint32_t i = 1; i < n; i++)
			for (uint32_t j = i; j > 0 && out[j - 1] > out[j]; j--) {
				uint32_t t = out[j];
				out[j] = out[j - 1];
				out[j - 1] = t;
			}
		set_owners(r, out, n, (uint8_t)(r->node_id + 1));
		update_header(r, n, (uint64_t)last + 1, 1);
		r->ops->fence(r);
		push_local(r, out, n);          /* ours now, even if short */
	}
	tract_lock_release(r, LOCK_ALLOC);
	*got = n;
	return TRACT_OK;
}

/* u32 comparison for qsort (internal) */
static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x < y ? -1 : x > y;
}

/* returns slots (sorted in place) to the pool; the caller holds the
 * allocator lock (internal) */
static int release_locked(tract_region *r, uint32_t *slots, uint32_t n)
{
	if (!n)
		return TRACT_OK;
	qsort(slots, n, sizeof(*slots), cmp_u32);
	uint64_t bm = tract_sec(r, TRACT_SEC_BITMAP)->offset;
	uint8_t line[TRACT_LINE];
	uint32_t cleared = 0;
	for (uint32_t i = 0; i < n;) {
		uint64_t lo = (uint64_t)slots[i] & ~511ULL;
		tract_observe_line(r, bm + lo / 8, line);
		for (; i < n && ((uint64_t)slots[i] & ~511ULL) == lo; i++) {
			uint32_t b = (uint32_t)(slots[i] - lo);
			if (line[b / 8] & (1u << (b % 8)))
				cleared++;
			line[b / 8] &= (uint8_t)~(1u << (b % 8));
		}
		tract_write_line(r, bm + lo / 8, line);
	}
	set_owners(r, slots, n, 0);
	update_header(r, -(int64_t)cleared, 0, 0);
	r->ops->fence(r);
	return cleared == n ? TRACT_OK : TRACT_E_CORRUPT;
}

/* clears the payloads of slots and writes them back to the device (internal) */
static void zero_slots(tract_region *r, const uint32_t *slots, uint32_t n)
{
	const struct tract_section *data = tract_sec(r, TRACT_SEC_DATA);
	tract_payload_forget(r, slots, n);
	for (uint32_t i = 0; i < n; i++) {
		if (slots[i] >= r->hdr.slot_count)
			continue;
		uint8_t *p = r->base + data->offset + (uint64_t)slots[i] * r->hdr.slot_stride;
		memset(p, 0, r->hdr.block_bytes);
		tract_flush_lines(r->flush_mode, p, r->hdr.block_bytes);
	}
	__sync_synchronize();
}

/* pops n slots from the node's free list into out (internal) */
static void pop_local(tract_region *r, uint32_t n, uint32_t *out)
{
	uint32_t *fl = free_list(r);
	uint8_t *fb = free_bits(r);
	/* the bits are read without alloc_mu by the payload sweep (payload.c) */
	for (uint32_t i = 0; i < n; i++) {
		uint32_t s = fl[--r->local->free_count];
		__atomic_fetch_and(&fb[s / 8], (uint8_t)~(1u << (s % 8)), __ATOMIC_RELEASE);
		out[i] = s;
	}
}

/* pushes slots onto the node's free list (internal) */
static void push_local(tract_region *r, const uint32_t *slots, uint32_t n)
{
	uint32_t *fl = free_list(r);
	uint8_t *fb = free_bits(r);
	for (uint32_t i = 0; i < n; i++) {
		fl[r->local->free_count++] = slots[i];
		__atomic_fetch_or(&fb[slots[i] / 8], (uint8_t)(1u << (slots[i] % 8)), __ATOMIC_RELEASE);
	}
}

/* Allocates n slots into out (all or nothing); TRACT_E_FULL if the pool has fewer free. */
int tract_alloc(tract_region *r, uint32_t n, uint32_t *out, uint64_t timeout_ns)
{
	if (!r || (!out && n))
		return TRACT_E_INVAL;
	if (n > r->hdr.slot_count)
		return TRACT_E_TOO_LARGE;   /* never satisfiable, whatever is evicted */
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	int rc = tract_robust_lock(&r->local->alloc_mu, timeout_ns);
	if (rc < 0)
		return rc;
	if (r->local->free_count < n) {
		uint32_t need = n - (uint32_t)r->local->free_count;
		uint32_t want = need > BATCH ? need : BATCH;
		uint32_t *tmp = malloc((size_t)want * sizeof(uint32_t));
		uint32_t got = 0;
		rc = tmp ? claim(r, want, tmp, &got, timeout_ns) : TRACT_E_NOMEM;
		free(tmp);
		if (rc == TRACT_OK && got < need)
			rc = TRACT_E_FULL;
		if (rc < 0) {
			pthread_mutex_unlock(&r->local->alloc_mu);
			return rc;
		}
	}
	pop_local(r, n, out);
	pthread_mutex_unlock(&r->local->alloc_mu);
	/* its writer's lines may stay in this node's caches: no longer EVICTED */
	tract_payload_forget(r, out, n);
	return TRACT_OK;
}

/*
 * Frees n slots: own slots go to the node's free list, others back to the
 * region.  Every lock it needs is taken before anything changes, so a slot is
 * never in flight (off the free list, not yet in the region) while the
 * process waits: a death leaves it in one place or the other.  note(arg),
 * when given, runs once all locks are held, right before the slots change
 * hands: a handoff marks its record there, so that a crash can leak the
 * slots (between the mark and the free) but never free them twice (internal).
 */
int tract_free_noted(tract_region *r, const uint32_t *slots, uint32_t n,
		     void (*note)(tract_region *, void *), void *arg, uint64_t timeout_ns)
{
	if (!r || (!slots && n))
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	for (uint32_t i = 0; i < n; i++)
		if (slots[i] >= r->hdr.slot_count)
			return TRACT_E_RANGE;
	uint32_t *foreign = malloc(((size_t)n + 1) * sizeof(uint32_t));
	uint32_t *own = malloc(((size_t)n + HIGH_WATER + 1) * sizeof(uint32_t));
	if (!foreign || !own) {
		free(foreign);
		free(own);
		return TRACT_E_NOMEM;
	}
	/* a region formatted with zero-on-free never hands out another tenant's
	 * KV: the slots are cleared (and written back) while they are still the
	 * caller's, before any lock */
	if (r->hdr.flags & TRACT_HDR_ZERO_ON_FREE)
		zero_slots(r, slots, n);
	int rc = tract_robust_lock(&r->local->alloc_mu, timeout_ns);
	if (rc < 0)
		goto out;
	/* classify by the owner map (read only: no lock, no shared write),
	 * observing each line of the map once for all the slots it covers */
	uint64_t owners = tract_sec(r, TRACT_SEC_OWNERS)->offset;
	uint8_t *fb = free_bits(r);
	uint32_t nf = 0, no = 0;
	memcpy(foreign, slots, (size_t)n * sizeof(uint32_t));
	qsort(foreign, n, sizeof(uint32_t), cmp_u32);
	uint8_t line[TRACT_LINE];
	uint64_t line_lo = UINT64_MAX;
	uint32_t prev = 0;
	rc = TRACT_OK;
	for (uint32_t i = 0; i < n && rc == TRACT_OK; i++) {
		uint32_t s = foreign[i];
		int dup = i && s == prev;
		prev = s;
		if (dup) {
			rc = TRACT_E_CORRUPT;          /* the same slot twice in one call */
			break;
		}
		if (((uint64_t)s & ~63ULL) != line_lo) {
			line_lo = (uint64_t)s & ~63ULL;
			tract_observe_line(r, owners + line_lo, line);
		}
		uint8_t owner = line[s - line_lo];
		if (owner == 0)
			rc = TRACT_E_CORRUPT;          /* not taken from the pool: double free */
		else if (owner == r->node_id + 1 && (fb[s / 8] & (1u << (s % 8))))
			rc = TRACT_E_CORRUPT;          /* already on our free list */
		else if (owner == r->node_id + 1)
			own[no++] = s;
		else
			foreign[nf++] = s;             /* nf <= i: compacts in place */
	}
	if (rc == TRACT_OK) {
		/* the free list stays bounded: the excess goes back to the region too */
		uint64_t after = r->local->free_count + no;
		uint32_t excess = after > HIGH_WATER ? (uint32_t)(after - HIGH_WATER / 2) : 0;
		int global = nf || excess;
		if (global && (rc = tract_lock_acquire(r, LOCK_ALLOC, timeout_ns, NULL)) < 0) {
			pthread_mutex_unlock(&r->local->alloc_mu);
			goto out;
		}
		if (note)
			note(r, arg);
		push_local(r, own, no);
		rc = release_locked(r, foreign, nf);
		if (excess) {
			pop_local(r, excess, own);
			int rc2 = release_locked(r, own, excess);
			if (rc == TRACT_OK)
				rc = rc2;
		}
		if (global)
			tract_lock_release(r, LOCK_ALLOC);
	}
	pthread_mutex_unlock(&r->local->alloc_mu);
out:
	free(foreign);
	free(own);
	return rc;
}

/* Frees n slots: own slots go to the node's free list, others back to the region. */
int tract_free(tract_region *r, const uint32_t *slots, uint32_t n, uint64_t timeout_ns)
{
	return tract_free_noted(r, slots, n, NULL, NULL, timeout_ns);
}

/* Returns every slot of this node's free list to the region. */
int tract_alloc_drain(tract_region *r, uint64_t timeout_ns)
{
	if (!r)
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	int rc = tract_robust_lock(&r->local->alloc_mu, timeout_ns);
	if (rc < 0)
		return rc;
	uint32_t k = (uint32_t)r->local->free_count;
	uint32_t *buf = malloc(((size_t)k + 1) * sizeof(uint32_t));
	if (!buf) {
		pthread_mutex_unlock(&r->local->alloc_mu);
		return TRACT_E_NOMEM;
	}
	rc = tract_lock_acquire(r, LOCK_ALLOC, timeout_ns, NULL);
	if (rc >= 0) {           /* TRACT_RECOVERED too: acquired, from a dead holder */
		pop_local(r, k, buf);        /* under both locks: never in flight */
		rc = release_locked(r, buf, k);
		tract_lock_release(r, LOCK_ALLOC);
	}
	free(buf);
	pthread_mutex_unlock(&r->local->alloc_mu);
	return rc;
}

/* Copies this node's free list (up to cap entries) into out; *count gets its length. */
int tract_alloc_local_free(const tract_region *r, uint32_t *out, uint64_t cap, uint64_t *count)
{
	if (!r || !count)
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	int rc = tract_robust_lock(&r->local->alloc_mu, 1000000000ULL);
	if (rc < 0)
		return rc;
	uint64_t n = r->local->free_count;
	*count = n;
	if (out)
		memcpy(out, free_list(r), (n < cap ? n : cap) * sizeof(uint32_t));
	pthread_mutex_unlock(&r->local->alloc_mu);
	return TRACT_OK;
}
