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
 *
 * Recovery (docs/PROTOCOLS.md §5.1).  Every change of the region's allocator
 * state (a claim, a release) runs under lock 0 and alloc_mu, and records an
 * intent in the local segment before it writes anything: the operation and
 * its slots (in the free list, past its end).  Whoever next takes alloc_mu
 * after a holder that died inside settles the intent first, taking lock 0
 * from the dead holder (its grant kept, so nobody else enters in between;
 * the node's agent does the same every heartbeat): repair_intent.  A death
 * elsewhere under alloc_mu can only tear the free list against its bits,
 * which the next holder of alloc_mu rebuilds from the list.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

#define BATCH 64
#define HIGH_WATER (8 * BATCH)

/* the node's free list and its membership bits (internal) */
static uint32_t *free_list(const tract_region *r)
{
	return (uint32_t *)((uint8_t *)r->local + r->local->free_list_off);
}

static uint8_t *free_bits(const tract_region *r)
{
	return (uint8_t *)r->local + r->local->free_bits_off;
}

enum { INTENT_NONE, INTENT_CLAIM, INTENT_RELEASE };

/* u64 comparison for qsort (internal) */
static int cmp_u64(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

/* order[] gets the positions 0..n-1 of slots sorted by slot (internal) */
static int sort_by_slot(uint32_t *order, const uint32_t *slots, uint32_t n)
{
	uint64_t *pairs = malloc(((size_t)n + 1) * sizeof(uint64_t));
	if (!pairs)
		return TRACT_E_NOMEM;
	for (uint32_t i = 0; i < n; i++)
		pairs[i] = (uint64_t)slots[i] << 32 | i;
	qsort(pairs, n, sizeof(uint64_t), cmp_u64);
	for (uint32_t i = 0; i < n; i++)
		order[i] = (uint32_t)pairs[i];
	free(pairs);
	return TRACT_OK;
}

/* u32 comparison for qsort (internal) */
static int cmp_u32(const void *a, const void *b)
{
	uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
	return x < y ? -1 : x > y;
}

/* a sorted copy of n slots, or NULL (internal) */
static uint32_t *sorted_copy(const uint32_t *slots, uint32_t n)
{
	uint32_t *c = malloc(((size_t)n + 1) * sizeof(*c));
	if (c) {
		memcpy(c, slots, (size_t)n * sizeof(*c));
		qsort(c, n, sizeof(*c), cmp_u32);
	}
	return c;
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

/* sets (value 1) or clears the bitmap bits of a sorted list of slots, a line
 * at a time (write 0: only counts); returns how many were set (internal) */
static uint32_t set_bits(tract_region *r, const uint32_t *slots, uint32_t n, int value, int write)
{
	uint64_t bm = tract_sec(r, TRACT_SEC_BITMAP)->offset;
	uint8_t line[TRACT_LINE];
	uint32_t were = 0;
	for (uint32_t i = 0; i < n;) {
		uint64_t lo = (uint64_t)slots[i] & ~511ULL;
		tract_observe_line(r, bm + lo / 8, line);
		for (; i < n && ((uint64_t)slots[i] & ~511ULL) == lo; i++) {
			uint32_t b = (uint32_t)(slots[i] - lo);
			uint8_t bit = (uint8_t)(1u << (b % 8));
			were += (line[b / 8] & bit) != 0;
			line[b / 8] = value ? (uint8_t)(line[b / 8] | bit) : (uint8_t)(line[b / 8] & ~bit);
		}
		if (write)
			tract_write_line(r, bm + lo / 8, line);
	}
	return were;
}

/* the allocator header, observed (internal) */
static void read_header(tract_region *r, struct tract_alloc_header *h)
{
	tract_observe_line(r, tract_sec(r, TRACT_SEC_ALLOC)->offset, (uint8_t *)h);
}

/* writes the allocator header back and fences (internal) */
static void write_header(tract_region *r, const struct tract_alloc_header *h)
{
	tract_write_line(r, tract_sec(r, TRACT_SEC_ALLOC)->offset, (const uint8_t *)h);
	r->ops->fence(r);
}

/* drops the allocator header's intent, in the caller's copy (internal) */
static void header_intent_clear(struct tract_alloc_header *h)
{
	h->intent_n = 0;
	h->intent_node = 0;
}

/* region offset of line i (1..) of the allocator section: the intent's slot list (internal) */
static uint64_t intent_line(const tract_region *r, uint32_t i)
{
	return tract_sec(r, TRACT_SEC_ALLOC)->offset + (uint64_t)i * TRACT_LINE;
}

/* lists n sorted slots in the allocator section's intent lines, flushed and
 * fenced: on the device before the header names them (internal; lock 0 held) */
static void intent_list_write(tract_region *r, const uint32_t *slots, uint32_t n)
{
	for (uint32_t i = 0; i < n; i += TRACT_LINE / 4) {
		uint32_t line[TRACT_LINE / 4];
		uint32_t k = n - i < TRACT_LINE / 4 ? n - i : TRACT_LINE / 4;
		memset(line, 0xFF, sizeof(line));     /* padding names no slot */
		memcpy(line, slots + i, (size_t)k * sizeof(uint32_t));
		tract_write_line(r, intent_line(r, 1 + i / (TRACT_LINE / 4)), line);
	}
	r->ops->fence(r);
}

/* records the allocator's intent before it changes the region (internal; both locks held) */
static void intent_begin(tract_region *r, uint32_t op, uint64_t base, uint32_t n)
{
	struct tract_local_hdr *l = r->local;
	l->intent_base = base;
	l->intent_n = n;
	__atomic_store_n(&l->intent_op, op, __ATOMIC_RELEASE);   /* after its fields */
}

/* the change is whole: nothing is left to finish (internal) */
static void intent_end(tract_region *r)
{
	__atomic_store_n(&r->local->intent_op, INTENT_NONE, __ATOMIC_RELEASE);
}

/* pops n slots from the node's free list into out (NULL: they stay where
 * they were, past the list's end), in list order: a claimed batch is listed
 * ascending, so a request's blocks lie forward in the region, the direction
 * the hardware prefetcher follows when they are copied (internal) */
static void pop_local(tract_region *r, uint32_t n, uint32_t *out)
{
	uint32_t *fl = free_list(r);
	uint8_t *fb = free_bits(r);
	uint64_t end = r->local->free_count;
	/* the bits first (the payload sweep reads them without alloc_mu,
	 * payload.c), the count once after: a death in between leaves the list
	 * whole, and repair_local gives the bits back */
	for (uint32_t i = 0; i < n; i++) {
		uint32_t s = fl[end - n + i];
		__atomic_fetch_and(&fb[s / 8], (uint8_t)~(1u << (s % 8)), __ATOMIC_RELEASE);
		if (out)
			out[i] = s;
	}
	__atomic_store_n(&r->local->free_count, end - n, __ATOMIC_RELEASE);
}

/* pushes slots onto the node's free list (internal) */
static void push_local(tract_region *r, const uint32_t *slots, uint32_t n)
{
	uint32_t *fl = free_list(r);
	uint8_t *fb = free_bits(r);
	for (uint32_t i = 0; i < n; i++) {
		uint64_t at = r->local->free_count;
		fl[at] = slots[i];
		__atomic_store_n(&r->local->free_count, at + 1, __ATOMIC_RELEASE);  /* after the entry */
		__atomic_fetch_or(&fb[slots[i] / 8], (uint8_t)(1u << (slots[i] % 8)), __ATOMIC_RELEASE);
	}
}

/* puts the n slots staged at position base (the list's end) on the list:
 * their bits, then the count, so a death between leaves them unlisted and
 * the intent still open (internal) */
static void push_staged(tract_region *r, uint64_t base, uint32_t n)
{
	uint32_t *fl = free_list(r);
	uint8_t *fb = free_bits(r);
	for (uint32_t i = 0; i < n; i++) {
		uint32_t s = fl[base + i];
		__atomic_fetch_or(&fb[s / 8], (uint8_t)(1u << (s % 8)), __ATOMIC_RELEASE);
	}
	__atomic_store_n(&r->local->free_count, base + n, __ATOMIC_RELEASE);
}

/* makes the free list whole again after a process died holding alloc_mu
 * (internal; alloc_mu held).  A push writes the entry before the count, a
 * pop clears the bits before it moves the count: the list itself is exact
 * (a death inside a pop leaves its slots listed), and only its membership
 * bits are rebuilt from it.  An intent's staged slots are past the list's
 * end: their bits are lock 0's repair's to set. */
static void repair_local(tract_region *r)
{
	struct tract_local_hdr *l = r->local;
	uint32_t *fl = free_list(r);
	uint8_t *fb = free_bits(r);
	uint64_t slots = r->hdr.slot_count;
	uint64_t fc = l->free_count;
	if (fc > slots)
		fc = slots;                   /* cannot be: the list holds distinct slots */
	uint8_t *in = calloc((slots + 7) / 8 + 1, 1);
	if (!in)
		return;                       /* the bits stay as they are: at worst a leak */
	uint64_t kept = 0;
	for (uint64_t i = 0; i < fc; i++) {
		uint32_t s = fl[i];
		if (s < slots && !(in[s / 8] & (1u << (s % 8)))) {
			in[s / 8] |= (uint8_t)(1u << (s % 8));
			fl[kept++] = s;         /* drops what no list can hold: out of range, twice */
		}
	}
	__atomic_store_n(&l->free_count, kept, __ATOMIC_RELEASE);
	for (uint64_t i = 0; i < (slots + 7) / 8; i++)
		if (fb[i] != in[i])
			__atomic_store_n(&fb[i], in[i], __ATOMIC_RELEASE);
	/* a journaled allocation journals its slots before it pops them: the
	 * dead holder's that are still listed were never its */
	tract_journal_void_listed(r, in);
	free(in);
}

static int lock_alloc(tract_region *r, uint64_t timeout_ns);

/* takes alloc_mu, repairing the free list if its last holder died, and
 * settling an intent it left open before anything can move the list over the
 * intent's staged slots: lock 0, inherited from the dead holder with its grant,
 * repairs it.  TRACT_RECOVERED: taken, and an intent settled (internal) */
static int lock_alloc_mu(tract_region *r, uint64_t timeout_ns)
{
	int rc = tract_robust_lock(&r->local->alloc_mu, timeout_ns);
	if (rc < 0)
		return rc;
	if (rc == TRACT_RECOVERED)
		repair_local(r);
	if (__atomic_load_n(&r->local->intent_op, __ATOMIC_ACQUIRE) != INTENT_NONE) {
		rc = lock_alloc(r, timeout_ns);    /* settles the intent (see there) */
		if (rc < 0) {
			pthread_mutex_unlock(&r->local->alloc_mu);
			return rc;                 /* the list stays untouched until it can */
		}
		tract_lock_release(r, TRACT_LOCK_ALLOCATOR);
		return TRACT_RECOVERED;            /* (taken, and a dead holder's intent settled) */
	}
	return TRACT_OK;
}

/* the bitmap's population, observed a line at a time (internal; lock 0 held) */
static uint64_t count_taken(tract_region *r)
{
	uint64_t slots = r->hdr.slot_count, bm = tract_sec(r, TRACT_SEC_BITMAP)->offset, n = 0;
	uint8_t line[TRACT_LINE];
	for (uint64_t lo = 0; lo < slots; lo += 512) {
		tract_observe_line(r, bm + lo / 8, line);
		for (uint32_t b = 0; b < 512 && lo + b < slots; b++)
			n += (line[b / 8] >> (b % 8)) & 1;
	}
	return n;
}

/*
 * Settles the change a holder of lock 0 died inside, from its intent
 * (internal; alloc_mu and lock 0 held, inherited says whether with the dead
 * holder's grant).  Every step rewrites what the region and the list say, so
 * a repairer that dies repairing is repaired by the next one:
 *  - a claim keeps exactly the staged slots whose bit the dead holder set (a
 *    set bit with this node's owner byte: no other node claims a taken slot,
 *    and this node's other claims list what they take): listed now; a staged
 *    slot whose bit it never set gets its owner byte back to 0 if it was
 *    this node's, and stays free;
 *  - a release, with the grant (nobody entered since), is finished: its slots
 *    were the caller's to give back; without it (the grant passed on, so
 *    other nodes may have claimed what it had cleared) only this node's own
 *    slots still taken are listed again, one whose owner byte it had cleared
 *    is given back, and another node's stay as they are (at worst a leak, for
 *    `tract check --repair`, never a slot twice);
 *  - the header's used count is then recounted from the bitmap.
 */
static void repair_intent(tract_region *r, int inherited)
{
	struct tract_local_hdr *l = r->local;
	uint32_t op = __atomic_load_n(&l->intent_op, __ATOMIC_ACQUIRE);
	if (op == INTENT_NONE)
		return;
	uint64_t slots = r->hdr.slot_count;
	uint64_t base = l->intent_base;
	uint32_t n = l->intent_n;
	uint32_t *fl = free_list(r);
	uint8_t *fb = free_bits(r);
	uint32_t *sorted = NULL;
	uint8_t me = (uint8_t)(r->node_id + 1);
	if (base > slots || n > slots - base || (op != INTENT_CLAIM && op != INTENT_RELEASE))
		goto done;                    /* not an intent this code wrote */
	for (uint32_t i = 0; i < n; i++)
		if (fl[base + i] >= slots)
			goto done;
	if (op == INTENT_CLAIM && l->free_count == base + n)
		goto done;                    /* listed already: the claim was whole */
	/* the staged slots are past the list's end (a release's pop, done or not,
	 * is undone here: they are unlisted until decided) */
	for (uint32_t i = 0; i < n; i++) {
		uint32_t s = fl[base + i];
		__atomic_fetch_and(&fb[s / 8], (uint8_t)~(1u << (s % 8)), __ATOMIC_RELEASE);
	}
	__atomic_store_n(&l->free_count, base, __ATOMIC_RELEASE);
	if (!(sorted = sorted_copy(fl + base, n)))
		goto done;      /* out of memory: at worst a leak */
	uint32_t m = 0;                   /* distinct (a repairer that died rewriting) */
	for (uint32_t i = 0; i < n; i++)
		if (!i || sorted[i] != sorted[i - 1])
			sorted[m++] = sorted[i];
	if (op == INTENT_RELEASE && inherited) {
		set_owners(r, sorted, m, 0);
		set_bits(r, sorted, m, 0, 1);
		r->ops->fence(r);
	} else {
		uint64_t owners = tract_sec(r, TRACT_SEC_OWNERS)->offset;
		uint64_t bm = tract_sec(r, TRACT_SEC_BITMAP)->offset;
		uint32_t keep = 0, unown = 0;
		uint32_t *clear = malloc(((size_t)m + 1) * sizeof(*clear));
		for (uint32_t i = 0; i < m; i++) {
			uint32_t s = sorted[i];
			uint8_t o[TRACT_LINE], b[TRACT_LINE];
			tract_observe_line(r, owners + ((uint64_t)s & ~63ULL), o);
			tract_observe_line(r, bm + ((uint64_t)s & ~511ULL) / 8, b);
			int set = (b[(s % 512) / 8] >> (s % 8)) & 1;
			if (set && o[s % 64] == me)
				fl[base + keep++] = s;      /* ours, taken, on no list: list it */
			else if (!set && o[s % 64] == me && clear)
				clear[unown++] = s;         /* never taken: not ours either */
			else if (set && !o[s % 64] && op == INTENT_RELEASE && clear)
				clear[unown++] = s;         /* its release got past the owner byte:
							 * taken still, so nobody else's */
		}
		if (unown) {
			set_owners(r, clear, unown, 0);
			r->ops->fence(r);
			set_bits(r, clear, unown, 0, 1);   /* (clear ones stay clear) */
			r->ops->fence(r);
		}
		free(clear);
		push_staged(r, base, keep);
	}
	struct tract_alloc_header h;
	read_header(r, &h);
	h.used_slots = count_taken(r);
	/* the release this node's intent named, if the header names it, is
	 * settled above; one another node's dead host left is that host's
	 * repairer's (repair_after_dead_host), not this one's to drop */
	if (h.intent_node == r->node_id + 1)
		header_intent_clear(&h);
	write_header(r, &h);
done:
	free(sorted);
	intent_end(r);
}

/*
 * Settles a claim or release that a dead *host* left half done: its intent
 * died with its DRAM, so the region alone says what it did (internal; lock 0
 * held, taken back from that host with nobody entered since).  Claims write
 * owner bytes before bits and releases clear owner bytes before bits, so in
 * any state a whole operation leaves, a set bit has an owner and a clear bit
 * has none; the one operation in flight broke that only for its own slots:
 *  - a clear bit with an owner byte: a claim that got no further (never
 *    taken): the owner byte back to 0;
 *  - a set bit without one: a release that got past the owner byte: finished
 *    (the bit cleared; it was on its way back to the pool);
 * then the header's used count is recounted.  A pass over the whole bitmap
 * and owner map, once per dead host's lock 0.  Before it, a release of
 * other nodes' slots the header names as the dead host's (release_locked)
 * is finished: its owner bytes and bits may each have reached the device or
 * not, and the slots, named by nothing any more, would stay their live
 * owners' for good.  The slots a dead host had
 * claimed whole stay its own (on a free list that died with it): they come
 * back with `tract check --repair`, offline (docs/PROTOCOLS.md §5).
 */
static void repair_after_dead_host(tract_region *r)
{
	uint64_t slots = r->hdr.slot_count;
	uint64_t bm = tract_sec(r, TRACT_SEC_BITMAP)->offset;
	uint64_t owners = tract_sec(r, TRACT_SEC_OWNERS)->offset;
	uint8_t bits[TRACT_LINE], own[TRACT_LINE];
	struct tract_alloc_header h;
	read_header(r, &h);
	/* whoever released them: every live release clears its intent before
	 * lock 0 goes, so one found here was cut short by a dead holder -- this
	 * host, or one before it whose repairer died too (its grant's
	 * `inherited` then names the last) */
	if (h.intent_n && h.intent_n <= TRACT_ALLOC_INTENT_CAP) {   /* (attach checked the layout) */
		uint32_t named[TRACT_ALLOC_INTENT_CAP], k = 0;
		for (uint32_t i = 0; i < h.intent_n; i += TRACT_LINE / 4) {
			uint32_t line[TRACT_LINE / 4];
			tract_observe_line(r, intent_line(r, 1 + i / (TRACT_LINE / 4)), line);
			for (uint32_t j = 0; j < TRACT_LINE / 4 && i + j < h.intent_n; j++)
				if (line[j] < slots)        /* written by another host */
					named[k++] = line[j];
		}
		qsort(named, k, sizeof(uint32_t), cmp_u32);
		uint32_t m = 0;                      /* distinct */
		for (uint32_t i = 0; i < k; i++)
			if (!i || named[i] != named[i - 1])
				named[m++] = named[i];
		set_owners(r, named, m, 0);
		r->ops->fence(r);
		set_bits(r, named, m, 0, 1);
		r->ops->fence(r);
	}
	for (uint64_t lo = 0; lo < slots; lo += 512) {
		tract_observe_line(r, bm + lo / 8, bits);
		int bits_changed = 0;
		for (uint64_t o = lo; o < lo + 512 && o < slots; o += 64) {
			tract_observe_line(r, owners + o, own);
			int owners_changed = 0;
			for (uint64_t s = o; s < o + 64 && s < slots; s++) {
				uint32_t b = (uint32_t)(s - lo);
				int set = (bits[b / 8] >> (b % 8)) & 1;
				if (!set && own[s - o]) {
					own[s - o] = 0;
					owners_changed = 1;
				} else if (set && !own[s - o]) {
					bits[b / 8] &= (uint8_t)~(1u << (b % 8));
					bits_changed = 1;
				}
			}
			if (owners_changed)
				tract_write_line(r, owners + o, own);
		}
		if (bits_changed) {
			r->ops->fence(r);      /* owner bytes before bits, as a release */
			tract_write_line(r, bm + lo / 8, bits);
		}
	}
	r->ops->fence(r);
	read_header(r, &h);
	h.used_slots = count_taken(r);
	header_intent_clear(&h);
	write_header(r, &h);
}

/* takes lock 0 (alloc_mu held), settling first what a dead holder left
 * (internal): with its grant kept, nobody entered since; without it (the
 * grant passed on, e.g. across a manager takeover) repair_intent keeps to
 * what stays true whatever other nodes did meanwhile. */
static int lock_alloc(tract_region *r, uint64_t timeout_ns)
{
	struct tract_lock_req q;
	int rc = tract_lock_request(r, TRACT_LOCK_ALLOCATOR, timeout_ns, &q, NULL);
	if (rc < 0)
		return rc;
	rc = tract_lock_await(r, TRACT_LOCK_ALLOCATOR, &q, timeout_ns, NULL);
	if (rc < 0)
		return rc;
	repair_intent(r, q.inherited);
	if (q.dead_host)
		repair_after_dead_host(r);
	return TRACT_OK;
}

/* claims up to want free slots from the region onto the node's free list;
 * *got gets how many (internal; alloc_mu held) */
static int claim(tract_region *r, uint32_t want, uint32_t *got, uint64_t timeout_ns)
{
	int rc = lock_alloc(r, timeout_ns);
	if (rc < 0)
		return rc;
	uint64_t slots = r->hdr.slot_count;
	uint64_t bm = tract_sec(r, TRACT_SEC_BITMAP)->offset;
	struct tract_alloc_header h;
	read_header(r, &h);
	/* staged past the list's end: the list and these are distinct slots */
	uint64_t base = r->local->free_count;
	uint32_t *staged = free_list(r) + base;
	if (want > slots - base)
		want = (uint32_t)(slots - base);
	uint64_t lines = (slots + 511) / 512;
	uint64_t start = (h.next_hint < slots ? h.next_hint : 0) / 512;
	uint32_t n = 0;
	uint8_t line[TRACT_LINE];
	for (uint64_t k = 0; k < lines && n < want; k++) {
		uint64_t li = (start + k) % lines;
		tract_observe_line(r, bm + li * TRACT_LINE, line);
		for (uint32_t b = 0; b < 512 && n < want; b++) {
			uint64_t s = li * 512 + b;
			if (s >= slots)
				break;
			if (!(line[b / 8] & (1u << (b % 8))))
				staged[n++] = (uint32_t)s;
		}
	}
	uint32_t *sorted = n ? sorted_copy(staged, n) : NULL;
	if (n && !sorted)
		rc = TRACT_E_NOMEM;
	if (sorted) {
		intent_begin(r, INTENT_CLAIM, base, n);
		tract_maybe_die(TRACT_DIE_CLAIM_STAGED);
		h.used_slots += n;
		h.next_hint = (uint64_t)staged[n - 1] + 1;
		h.claims++;
		header_intent_clear(&h);   /* (none can be live here: a dead holder's is its repairer's) */
		write_header(r, &h);
		tract_maybe_die(TRACT_DIE_CLAIM_HEADER);
		/* owners before bits: a bit is never set with another's owner */
		set_owners(r, sorted, n, (uint8_t)(r->node_id + 1));
		r->ops->fence(r);
		set_bits(r, sorted, n, 1, 1);
		r->ops->fence(r);
		tract_maybe_die(TRACT_DIE_CLAIM_BITMAP);
		push_staged(r, base, n);        /* ours now, even if short */
		tract_maybe_die(TRACT_DIE_CLAIM_PUSHED);
		intent_end(r);
		free(sorted);
	}
	tract_lock_release(r, TRACT_LOCK_ALLOCATOR);
	*got = rc == TRACT_OK ? n : 0;
	return rc;
}

/*
 * Returns the n slots at position base of the free list (pop: its last n
 * entries, popped here; else staged past its end) to the region (internal;
 * alloc_mu and lock 0 held).  The node's intent (DRAM) lets its next holder
 * finish after a process death.  With `in_header` (other nodes' slots, n at
 * most TRACT_ALLOC_INTENT_CAP) the slots are also listed in the allocator
 * section and named in its header, on the device before any owner byte or
 * bit changes, for the case where this whole host dies inside: then the DRAM
 * intent dies too, and so may any of the stores below, and the slots would
 * stay their live owner's with nothing naming them; the dead host's next
 * holder of lock 0 finishes the release from the header
 * (repair_after_dead_host).  Its own slots need no such record: a dead
 * host's slots come back with its sweep.
 */
static int release_locked(tract_region *r, uint64_t base, uint32_t n, int pop, int in_header)
{
	if (!n)
		return TRACT_OK;
	if (pop ? base + n != r->local->free_count : base != r->local->free_count)
		return TRACT_E_CORRUPT;     /* not the list's end: a bug, never a wrap */
	if (in_header && n > TRACT_ALLOC_INTENT_CAP)
		return TRACT_E_INVAL;
	uint32_t *sorted = sorted_copy(free_list(r) + base, n);
	if (!sorted)
		return TRACT_E_NOMEM;
	struct tract_alloc_header h;
	read_header(r, &h);
	intent_begin(r, INTENT_RELEASE, base, n);
	if (pop)
		pop_local(r, n, NULL);
	tract_maybe_die(TRACT_DIE_RELEASE_POPPED);
	uint32_t were = set_bits(r, sorted, n, 0, 0);
	h.used_slots -= were;
	h.releases++;
	if (in_header && h.intent_n) {
		/* a stale intent (a repair that failed): unnamed before its list
		 * is overwritten, so no repair reads a list half this release's */
		header_intent_clear(&h);
		write_header(r, &h);
	}
	header_intent_clear(&h);
	if (in_header) {
		intent_list_write(r, sorted, n);
		h.intent_n = (uint16_t)n;
		h.intent_node = (uint16_t)(r->node_id + 1);
	}
	write_header(r, &h);
	tract_maybe_die(TRACT_DIE_RELEASE_HEADER);
	set_owners(r, sorted, n, 0);
	tract_maybe_die(TRACT_DIE_RELEASE_OWNERS);
	set_bits(r, sorted, n, 0, 1);
	r->ops->fence(r);
	if (in_header) {
		header_intent_clear(&h);
		write_header(r, &h);
	}
	intent_end(r);
	free(sorted);
	return were == n ? TRACT_OK : TRACT_E_CORRUPT;
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

/* allocates n slots from the node's free list, claiming a batch from the
 * region when it runs short; with journal, each slot is journaled as this
 * process's bare slot before the pop (internal) */
static int alloc_impl(tract_region *r, uint32_t n, uint32_t *out, int journal,
		      uint64_t timeout_ns)
{
	if (!r || (!out && n))
		return TRACT_E_INVAL;
	if (n > r->hdr.slot_count)
		return TRACT_E_TOO_LARGE;   /* never satisfiable, whatever is evicted */
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	int rc = lock_alloc_mu(r, timeout_ns);
	if (rc < 0)
		return rc;
	if (r->local->free_count < n) {
		uint32_t need = n - (uint32_t)r->local->free_count;
		uint32_t got = 0;
		rc = claim(r, need > BATCH ? need : BATCH, &got, timeout_ns);
		/* (the free list, not got: a repair inside claim may have listed more) */
		if (rc == TRACT_OK && r->local->free_count < n)
			rc = TRACT_E_FULL;
		if (rc < 0) {
			pthread_mutex_unlock(&r->local->alloc_mu);
			return rc;
		}
	}
	if (journal && n) {
		/* the slots the pop below takes: journaled first, so that no
		 * moment leaves them neither listed nor journaled; a death before
		 * the pop leaves them journaled and listed, which the next holder
		 * of alloc_mu voids (repair_local) */
		tract_journal_slots(r, free_list(r) + (r->local->free_count - n), n, 0);
		tract_maybe_die(TRACT_DIE_ALLOC_JOURNALED);
	}
	pop_local(r, n, out);
	pthread_mutex_unlock(&r->local->alloc_mu);
	/* its writer's lines may stay in this node's caches: no longer EVICTED */
	tract_payload_forget(r, out, n);
	return TRACT_OK;
}

/* Allocates n slots into out (all or nothing); TRACT_E_FULL if the pool has fewer free. */
int tract_alloc(tract_region *r, uint32_t n, uint32_t *out, uint64_t timeout_ns)
{
	return alloc_impl(r, n, out, 0, timeout_ns);
}

/* as tract_alloc, the slots journaled as bare slots of this process (internal.h) */
int tract_alloc_journaled(tract_region *r, uint32_t n, uint32_t *out, uint64_t timeout_ns)
{
	return alloc_impl(r, n, out, 1, timeout_ns);
}

/* takes and gives back alloc_mu, so that whatever a process that died
 * holding it left (its free list, an open intent, slots it journaled and had
 * not popped) is settled now (internal.h) */
int tract_alloc_settle(tract_region *r, uint64_t timeout_ns)
{
	if (!r || !r->local)
		return TRACT_E_NO_LOCAL;
	int rc = lock_alloc_mu(r, timeout_ns);
	if (rc < 0)
		return rc;
	pthread_mutex_unlock(&r->local->alloc_mu);
	return TRACT_OK;
}

/* whether a verdict (dead_epoch, 0: none) declared a node dead at or after
 * its agent epoch `epoch` (internal) */
static int declared_since(uint64_t dead_epoch, uint64_t epoch)
{
	return dead_epoch && dead_epoch >= epoch;
}

/* whether a verdict declared this node dead at or after its agent epoch
 * `epoch`: a slot of its own an eviction saw then was its sweep's to return,
 * and may have been taken again since (the node came back): the journaled
 * eviction of a process of the old epoch, freed by the new epoch's agent.
 * The verdict is read once per free (internal) */
struct own_verdict {
	int read;
	uint64_t dead_epoch;    /* UINT64_MAX: unreadable, every epoch counts as swept */
};

static int own_swept(tract_region *r, uint64_t epoch, struct own_verdict *cache)
{
	if (!cache->read) {
		struct tract_node_verdict v;
		cache->read = 1;
		cache->dead_epoch = tract_node_verdict(r, r->node_id, &v) < 0 ? UINT64_MAX
										: v.dead_epoch;
	}
	return declared_since(cache->dead_epoch, epoch);
}

/*
 * Keeps (compacted in place; returns how many) the foreign slots a free may
 * give back to the pool, under lock 0: each slot's owner byte still names
 * its owner, and no verdict declared that owner dead since epoch[i], its
 * agent epoch when the slot was last seen referenced (by the evicted bucket
 * or the handoff record being released: nothing else frees a referenced
 * slot).  A slot of a host declared dead since is its recovery's to return
 * (tract_alloc_sweep_dead, which knows which of its slots nothing references
 * any more); it may have been returned already, and even taken again by the
 * restarted owner, so freeing it here could free it twice.  A skipped slot
 * stays taken: the sweep returns it, or, when its owner restarted before a
 * sweep did, `tract check --repair` (internal; lock 0 held).
 */
static uint32_t keep_live_owners(tract_region *r, uint32_t *slots, const uint8_t *owner,
				 const uint64_t *epoch, uint32_t n)
{
	uint64_t owners = tract_sec(r, TRACT_SEC_OWNERS)->offset;
	uint8_t line[TRACT_LINE];
	uint64_t line_lo = UINT64_MAX;
	uint64_t dead_epoch[TRACT_MAX_NODES];
	uint8_t seen[TRACT_MAX_NODES] = { 0 };
	uint32_t kept = 0;
	for (uint32_t i = 0; i < n; i++) {
		uint32_t s = slots[i], node = owner[i] - 1u;
		if (node >= TRACT_MAX_NODES)
			continue;
		if (!seen[node]) {
			struct tract_node_verdict v;
			seen[node] = 1;
			dead_epoch[node] = tract_node_verdict(r, node, &v) < 0 ? UINT64_MAX : v.dead_epoch;
		}
		if (((uint64_t)s & ~63ULL) != line_lo) {
			line_lo = (uint64_t)s & ~63ULL;
			tract_observe_line(r, owners + line_lo, line);
		}
		if (line[s - line_lo] == owner[i] && !declared_since(dead_epoch[node], epoch[i]))
			slots[kept++] = s;
	}
	return kept;
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
static int free_slots(tract_region *r, const uint32_t *slots, const struct tract_slot_owner *known,
		      uint32_t n, void (*note)(tract_region *, void *), void *arg,
		      uint32_t *moved, uint64_t timeout_ns)
{
	if (moved)
		*moved = 0;
	if (!r || (!slots && n))
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	for (uint32_t i = 0; i < n; i++)
		if (slots[i] >= r->hdr.slot_count)
			return TRACT_E_RANGE;
	uint32_t *foreign = malloc(((size_t)n + 1) * sizeof(uint32_t));
	uint32_t *own = malloc(((size_t)n + 1) * sizeof(uint32_t));
	uint8_t *fowner = malloc((size_t)n + 1);
	uint64_t *fepoch = malloc(((size_t)n + 1) * sizeof(uint64_t));
	uint64_t node_epoch[TRACT_MAX_NODES];
	uint8_t epoch_seen[TRACT_MAX_NODES] = { 0 };
	uint32_t *order = NULL;       /* known: where each sorted slot came from */
	if (!foreign || !own || !fowner || !fepoch) {
		free(foreign);
		free(own);
		free(fowner);
		free(fepoch);
		return TRACT_E_NOMEM;
	}
	/* a region formatted with zero-on-free never hands out another tenant's
	 * KV: the slots are cleared (and written back) while they are still the
	 * caller's, before any lock */
	if (r->hdr.flags & TRACT_HDR_ZERO_ON_FREE)
		zero_slots(r, slots, n);
	int rc = lock_alloc_mu(r, timeout_ns);
	if (rc < 0)
		goto out;
	/* classify by the owner map (read only: no lock, no shared write),
	 * observing each line of the map once for all the slots it covers */
	uint64_t owners = tract_sec(r, TRACT_SEC_OWNERS)->offset;
	uint8_t *fb = free_bits(r);
	uint32_t nf = 0, no = 0;
	if (known && !(order = malloc(((size_t)n + 1) * sizeof(uint32_t)))) {
		rc = TRACT_E_NOMEM;
		pthread_mutex_unlock(&r->local->alloc_mu);
		goto out;
	}
	memcpy(foreign, slots, (size_t)n * sizeof(uint32_t));
	if (known) {
		if ((rc = sort_by_slot(order, slots, n)) < 0) {
			pthread_mutex_unlock(&r->local->alloc_mu);
			goto out;
		}
		for (uint32_t i = 0; i < n; i++)
			foreign[i] = slots[order[i]];
	} else {
		qsort(foreign, n, sizeof(uint32_t), cmp_u32);
	}
	uint8_t line[TRACT_LINE];
	uint64_t line_lo = UINT64_MAX;
	uint32_t prev = 0;
	struct own_verdict own_cache = {0, 0};
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
		const struct tract_slot_owner *k = known ? &known[order[i]] : NULL;
		if (k && owner != k->node + 1) {
			/* changed hands since its eviction: only a dead host's sweep
			 * does that (its owner was declared dead since); anything else
			 * is a slot freed twice */
			struct tract_node_verdict v;
			if (k->node >= r->hdr.max_nodes || tract_node_verdict(r, k->node, &v) < 0 ||
			    !declared_since(v.dead_epoch, k->epoch))
				rc = TRACT_E_CORRUPT;
			continue;
		}
		if (owner == 0)
			rc = TRACT_E_CORRUPT;          /* not taken from the pool: double free */
		else if (k && owner == r->node_id + 1 && own_swept(r, k->epoch, &own_cache))
			continue;                      /* ours before a verdict: the sweep's */
		else if (owner == r->node_id + 1 && (fb[s / 8] & (1u << (s % 8))))
			rc = TRACT_E_CORRUPT;          /* already on our free list */
		else if (owner == r->node_id + 1)
			own[no++] = s;
		else {
			/* its owner's epoch now, while the caller's reference keeps
			 * the slot from a dead host's sweep (or then, when known) */
			uint32_t node = owner - 1u;
			if (!k && node < TRACT_MAX_NODES && !epoch_seen[node]) {
				epoch_seen[node] = 1;
				node_epoch[node] = tract_node_epoch(r, node);
			}
			fowner[nf] = owner;
			fepoch[nf] = k ? k->epoch : node < TRACT_MAX_NODES ? node_epoch[node] : 0;
			foreign[nf++] = s;             /* nf <= i: compacts in place */
		}
	}
	if (rc == TRACT_OK) {
		/* the free list stays bounded: the excess goes back to the region too
		 * (decided before taking lock 0, counted again after: nothing moves
		 * the list meanwhile, alloc_mu is ours and no intent is open) */
		uint64_t after = r->local->free_count + no;
		int global = nf || after > HIGH_WATER;
		if (global && (rc = lock_alloc(r, timeout_ns)) < 0) {
			pthread_mutex_unlock(&r->local->alloc_mu);
			goto out;
		}
		/* another node's slots go back to the pool only while their owner
		 * lives as it did at the split: a dead host's are its recovery's to
		 * return (docs/PROTOCOLS.md §5) */
		if (nf)
			nf = keep_live_owners(r, foreign, fowner, fepoch, nf);
		if (note)
			note(r, arg);
		push_local(r, own, no);
		if (moved)
			*moved = no;         /* then the foreign ones released; the rest
					      * skipped (a dead host's, its sweep's) */
		after = r->local->free_count;
		uint32_t excess = global && after > HIGH_WATER ? (uint32_t)(after - HIGH_WATER / 2) : 0;
		if (nf) {
			/* staged past the list's end for the intent (distinct slots:
			 * others' slots are on no list of ours) */
			uint64_t base = r->local->free_count;
			for (uint32_t i = 0; i < nf && rc == TRACT_OK; i += TRACT_ALLOC_INTENT_CAP) {
				uint32_t k = nf - i < TRACT_ALLOC_INTENT_CAP ? nf - i
									     : TRACT_ALLOC_INTENT_CAP;
				memcpy(free_list(r) + base, foreign + i, (size_t)k * sizeof(uint32_t));
				rc = release_locked(r, base, k, 0, 1);
				if (moved && rc == TRACT_OK)
					*moved += k;
			}
		}
		if (excess) {
			int rc2 = release_locked(r, r->local->free_count - excess, excess, 1, 0);
			if (rc == TRACT_OK)
				rc = rc2;
		}
		if (global)
			tract_lock_release(r, TRACT_LOCK_ALLOCATOR);
	}
	pthread_mutex_unlock(&r->local->alloc_mu);
out:
	free(foreign);
	free(own);
	free(fowner);
	free(fepoch);
	free(order);
	return rc;
}

int tract_free_noted(tract_region *r, const uint32_t *slots, const struct tract_slot_owner *known,
		     uint32_t n, void (*note)(tract_region *, void *), void *arg, uint32_t *moved,
		     uint64_t timeout_ns)
{
	return free_slots(r, slots, known, n, note, arg, moved, timeout_ns);
}

/* an eviction's slots (tract_free_evicted's note) (internal) */
struct evicted {
	const uint32_t *slots;
	const struct tract_slot_owner *owners;
	uint32_t n;
};

/* forgets the evicted slots this process journaled (the free's note: its
 * locks are held, the slots change hands next) (internal) */
static void forget_evicted(tract_region *r, void *arg)
{
	const struct evicted *e = arg;
	tract_journal_evicted(r, e->slots, e->owners, e->n, 1);
}

/* frees n slots an eviction took out of the index, known[i] being who owned
 * slots[i] then, forgetting them in this process's journal once the free
 * holds its locks (internal.h) */
int tract_free_evicted(tract_region *r, const uint32_t *slots, const struct tract_slot_owner *known,
		       uint32_t n, uint64_t timeout_ns)
{
	struct evicted e = {slots, known, n};
	tract_maybe_die(TRACT_DIE_EVICTED);
	return free_slots(r, slots, known, n, forget_evicted, &e, NULL, timeout_ns);
}

/* Frees n slots: own slots go to the node's free list, others back to the region. */
int tract_free(tract_region *r, const uint32_t *slots, uint32_t n, uint64_t timeout_ns)
{
	return free_slots(r, slots, NULL, n, NULL, NULL, NULL, timeout_ns);
}

/* Returns every slot of this node's free list to the region. */
int tract_alloc_drain(tract_region *r, uint64_t timeout_ns)
{
	if (!r)
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	int rc = lock_alloc_mu(r, timeout_ns);
	if (rc < 0)
		return rc;
	rc = lock_alloc(r, timeout_ns);
	if (rc == TRACT_OK) {
		/* under both locks: never in flight */
		rc = release_locked(r, 0, (uint32_t)r->local->free_count, 1, 0);
		tract_lock_release(r, TRACT_LOCK_ALLOCATOR);
	}
	pthread_mutex_unlock(&r->local->alloc_mu);
	return rc;
}

/*
 * Recovery of lock 0 for the node's agent (recover.c's dispatch): if a dead
 * process of this node holds it, takes it (alloc_mu first, the order every
 * holder of lock 0 keeps) and finishes what the holder left.  A live process
 * holding alloc_mu is left alone: it inherits lock 0 itself if it needs it,
 * and otherwise the next heartbeat tries again.  *withdrawn / return value:
 * as tract_lock_take_dead (internal).
 */
int tract_alloc_recover_lock(tract_region *r, uint32_t id, int *withdrawn)
{
	*withdrawn = 0;
	int settled = lock_alloc_mu(r, 0);
	if (settled < 0)
		return TRACT_OK;
	if (settled == TRACT_RECOVERED) {
		/* taking alloc_mu settled a dead holder's intent, lock 0 and all */
		pthread_mutex_unlock(&r->local->alloc_mu);
		return TRACT_RECOVERED;
	}
	int rc = tract_lock_take_dead(r, id, withdrawn);
	if (rc == TRACT_RECOVERED) {
		repair_intent(r, 1);
		/* the grant it took over may carry a dead host's repair its dead
		 * holder never finished (the manager saw that holder inside) */
		struct tract_lock_manager_line m;
		tract_observe_line(r, tract_lock_line(r, id, 0), &m);
		if (m.inherited)
			repair_after_dead_host(r);
		tract_lock_release(r, id);
	}
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
	int rc = lock_alloc_mu((tract_region *)r, 1000000000ULL);
	if (rc < 0)
		return rc;
	uint64_t n = r->local->free_count;
	*count = n;
	if (out)
		memcpy(out, free_list(r), (n < cap ? n : cap) * sizeof(uint32_t));
	pthread_mutex_unlock(&r->local->alloc_mu);
	return TRACT_OK;
}

/*
 * Returns to the pool the slots of dead host node that nothing references
 * (referenced: a bit per slot, set for every slot a READY bucket, an object
 * directory entry or one of its handoff records names, read without a lock
 * under the verdict naming dead_epoch, before this call: while
 * the node is dead nothing makes a new reference to its slots, so a slot
 * unreferenced then stays so).  Under alloc_mu and lock 0, with the node
 * checked dead there (TRACT_E_ALIVE: an agent started there since): its free
 * list, which died with its DRAM, and the slots of its unfinished writes;
 * later passes return what other nodes evicted meanwhile (their frees leave
 * a dead host's slots to this, keep_live_owners).  Each batch is a release
 * with an intent, as a free of other nodes' slots; the first whole pass is
 * recorded in the verdict (TRACT_VERDICT_SLOTS), under lock 0, so that a
 * restarted agent of the node knows its old free list is void
 * (tract_alloc_rejoin).  *returned gets how many; *owned how many slots the
 * node still has taken (internal; recover.c).
 */
int tract_alloc_sweep_dead(tract_region *r, uint32_t node, uint64_t dead_epoch,
			   const uint8_t *referenced, uint64_t *returned, uint64_t *owned,
			   uint64_t timeout_ns)
{
	*returned = *owned = 0;
	int rc = lock_alloc_mu(r, timeout_ns);
	if (rc < 0)
		return rc;
	if ((rc = lock_alloc(r, timeout_ns)) < 0) {
		pthread_mutex_unlock(&r->local->alloc_mu);
		return rc;
	}
	/* still dead, under the very verdict the references were read under
	 * (not a later one: a node that came back since may have new blocks) */
	struct tract_node_verdict v;
	if ((rc = tract_node_verdict(r, node, &v)) != 1 || v.dead_epoch != dead_epoch) {
		rc = rc < 0 ? rc : TRACT_E_ALIVE;
		goto out;
	}
	uint64_t slots = r->hdr.slot_count, base = r->local->free_count;
	uint64_t room = slots - base;          /* staged past the list's end */
	uint64_t owners = tract_sec(r, TRACT_SEC_OWNERS)->offset;
	uint64_t bm = tract_sec(r, TRACT_SEC_BITMAP)->offset;
	uint32_t *staged = free_list(r) + base;
	uint8_t own[TRACT_LINE], bits[TRACT_LINE];
	uint32_t n = 0;
	rc = TRACT_OK;
	for (uint64_t lo = 0; lo < slots && rc == TRACT_OK; lo += 64) {
		tract_observe_line(r, owners + lo, own);
		if ((lo & 511) == 0)
			tract_observe_line(r, bm + lo / 8, bits);
		for (uint64_t s = lo; s < lo + 64 && s < slots; s++) {
			uint32_t b = (uint32_t)(s & 511);
			if (own[s - lo] != node + 1 || !((bits[b / 8] >> (b % 8)) & 1))
				continue;
			if ((referenced[s / 8] >> (s % 8)) & 1) {
				(*owned)++;
				continue;
			}
			staged[n++] = (uint32_t)s;
			if (n == room || n == 4096) {
				rc = release_locked(r, base, n, 0, 0);
				*returned += n;
				n = 0;
			}
		}
	}
	if (rc == TRACT_OK && n) {
		rc = release_locked(r, base, n, 0, 0);
		*returned += n;
	}
	if (rc == TRACT_OK)
		rc = tract_node_verdict_record(r, node, dead_epoch, TRACT_VERDICT_SLOTS);
out:
	tract_lock_release(r, TRACT_LOCK_ALLOCATOR);
	pthread_mutex_unlock(&r->local->alloc_mu);
	return rc;
}

/* whether slot is this node's in the region now: its owner byte this node,
 * its bit set (internal; lock 0 held) */
static int slot_is_mine(tract_region *r, uint32_t slot, void *arg)
{
	(void)arg;
	if (slot >= r->hdr.slot_count)
		return 0;
	uint8_t own[TRACT_LINE], bits[TRACT_LINE];
	tract_observe_line(r, tract_sec(r, TRACT_SEC_OWNERS)->offset + ((uint64_t)slot & ~63ULL), own);
	tract_observe_line(r, tract_sec(r, TRACT_SEC_BITMAP)->offset + ((uint64_t)slot & ~511ULL) / 8,
			   bits);
	uint32_t b = slot & 511;
	return own[slot & 63] == r->node_id + 1 && ((bits[b / 8] >> (b % 8)) & 1);
}

/*
 * An agent starts on this node (every start).  Holding alloc_mu (no process
 * of the node allocates meanwhile), it publishes the node's line 0 (line0:
 * the new epoch; from here the node is alive, and no sweep of its slots
 * starts).  If a verdict declared the previous epoch (prev_epoch) dead --
 * whenever it landed, even after the agent read the table -- the dead
 * host's recovery may have given back what that epoch held, so, under lock
 * 0: every free-list entry that is no longer this node's in the region
 * (owner byte, bit) is dropped -- the sweep returned it, and another node
 * may have taken it since -- and the dead processes' journals forget their
 * pins (zeroed by the recovery) and the bare slots no longer theirs.  When
 * lock 0 cannot be had, the whole free list and every bare slot are dropped
 * instead: a leak at worst, never a slot twice.  *dropped gets the entries
 * dropped, *pins the journaled pins forgotten; returns 1 if a verdict named
 * the previous epoch, 0 if not, or an error (internal; recover.c).
 */
int tract_alloc_rejoin(tract_region *r, uint64_t prev_epoch, const void *line0,
		       uint64_t *dropped, uint64_t *pins, uint64_t timeout_ns)
{
	*dropped = *pins = 0;
	/* alloc_mu without settling an intent a process of the dead epoch left
	 * open: that needs lock 0, which the manager grants a dead node never;
	 * lock_alloc settles it once the new epoch is published */
	int rc = tract_robust_lock(&r->local->alloc_mu, timeout_ns);
	if (rc < 0)
		return rc;
	if (rc == TRACT_RECOVERED)
		repair_local(r);
	const struct tract_section *nodes = tract_sec(r, TRACT_SEC_NODES);
	tract_publish_line(r, nodes->offset + (uint64_t)r->node_id * nodes->entry_size, line0);
	struct tract_node_verdict v;
	rc = tract_node_verdict(r, r->node_id, &v);
	if (rc < 0 || !v.dead_epoch || v.dead_epoch != prev_epoch) {
		pthread_mutex_unlock(&r->local->alloc_mu);
		return rc < 0 ? rc : 0;
	}
	struct tract_local_hdr *l = r->local;
	uint32_t *fl = free_list(r);
	uint8_t *fb = free_bits(r);
	if (lock_alloc(r, timeout_ns) < 0) {
		/* no lock 0: nothing can be checked, so nothing is kept */
		*dropped = l->free_count;
		intent_end(r);
		__atomic_store_n(&l->free_count, 0, __ATOMIC_RELEASE);
		memset(fb, 0, (r->hdr.slot_count + 7) / 8);
		tract_journal_void_dead(r, NULL, NULL, pins);
		pthread_mutex_unlock(&l->alloc_mu);
		return 1;
	}
	uint64_t kept = 0, n = l->free_count;
	for (uint64_t i = 0; i < n; i++) {
		uint32_t s = fl[i];
		if (slot_is_mine(r, s, NULL)) {
			fl[kept++] = s;
		} else {
			if (s < r->hdr.slot_count)
				__atomic_fetch_and(&fb[s / 8], (uint8_t)~(1u << (s % 8)), __ATOMIC_RELEASE);
			(*dropped)++;
		}
	}
	__atomic_store_n(&l->free_count, kept, __ATOMIC_RELEASE);
	tract_journal_void_dead(r, slot_is_mine, NULL, pins);
	tract_lock_release(r, TRACT_LOCK_ALLOCATOR);
	pthread_mutex_unlock(&l->alloc_mu);
	return 1;
}
