/*
 * handoff.c -- prefill -> decode handoff records (docs/ARCHITECTURE.md §10,
 * docs/PROTOCOLS.md §10).
 *
 * The control message carries only (record index, request id).  The record
 * (transfer table, written under lock 2) names a key list stored in a slot:
 * per block its key, slot, checksum and token count, so the decode side
 * reaches every block without probing the index.  The blocks stay pinned by
 * the prefill node until the decode side acknowledges, or the record
 * expires and a node agent reclaims it: pins unpinned on the prefill node's
 * behalf, the list and tail slots freed, the record freed.
 *
 * A record may be RESERVED first (format 9): taken for a request whose
 * blocks its owner is still committing, so the ticket can go out before the
 * publish; a decode side that opens it meanwhile is told TRACT_E_PENDING.
 * It holds nothing (no key list, no pins): its owner publishes it or gives
 * it back, and past its expiry, or its owner dead, it is freed.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "internal.h"

/* the transfer record states (format.h), by short names */
enum {
	REC_FREE = TRACT_TRANSFER_FREE,
	REC_PUBLISHED = TRACT_TRANSFER_PUBLISHED,
	REC_ACKED = TRACT_TRANSFER_ACKED,
	REC_RECLAIMING = TRACT_TRANSFER_RECLAIMING,
	REC_RESERVED = TRACT_TRANSFER_RESERVED
};

static uint64_t record_off(const tract_region *r, uint32_t rec)
{
	const struct tract_section *s = tract_sec(r, TRACT_SEC_TRANSFER);
	return s->offset + (uint64_t)rec * TRACT_TRANSFER_ENTRY_SIZE;
}

static uint64_t slot_off(const tract_region *r, uint32_t slot)
{
	return tract_sec(r, TRACT_SEC_DATA)->offset + (uint64_t)slot * r->hdr.slot_stride;
}

/* observes n consecutive records from rec: one invalidate of all their
 * lines, one fence, then the loads -- the discipline of observe, with one
 * fence per batch instead of one per record (internal) */
static void observe_records(tract_region *r, uint32_t rec, uint32_t n,
			    struct tract_transfer_record *out)
{
	uint64_t off = record_off(r, rec), len = (uint64_t)n * sizeof(*out);
	if (TRACT_KEEP(SITE_HANDOFF_OBSERVE_RECORD))
		r->ops->invalidate(r, off, len);
	r->ops->fence(r);
	r->ops->load(r, off, out, len);
}

static void observe_record(tract_region *r, uint32_t rec, struct tract_transfer_record *out)
{
	observe_records(r, rec, 1, out);
}

/*
 * Records a table scan observes per invalidate + fence: 8 KiB, 128 lines.
 * A scan's view of a record may be stale by the time it acts on it (the
 * scans run without the transfer lock); every action re-observes the
 * record under the lock first, so a batch only has to be fresh enough to
 * be worth acting on.  Bounded so the private buffer stays on the stack.
 */
#define SCAN_BATCH 64

/* calls visit(r, rec, record, arg) for every record of the table, in order,
 * observed without a lock SCAN_BATCH at a time (internal) */
static void visit_records(tract_region *r,
			  void (*visit)(tract_region *r, uint32_t rec,
					const struct tract_transfer_record *t, void *arg),
			  void *arg)
{
	uint32_t count = tract_sec(r, TRACT_SEC_TRANSFER)->count;
	struct tract_transfer_record seen[SCAN_BATCH];
	for (uint32_t base = 0; base < count; base += SCAN_BATCH) {
		uint32_t k = count - base < SCAN_BATCH ? count - base : SCAN_BATCH;
		observe_records(r, base, k, seen);
		for (uint32_t j = 0; j < k; j++)
			visit(r, base + j, &seen[j], arg);
	}
}

static void publish_record(tract_region *r, uint32_t rec, const struct tract_transfer_record *in)
{
	uint64_t off = record_off(r, rec);
	r->ops->store(r, off, in, sizeof(*in));
	if (TRACT_KEEP(SITE_HANDOFF_PUBLISH_RECORD))
		r->ops->flush(r, off, sizeof(*in));
	r->ops->fence(r);
}

/* checks what a record written by another host says before it is used (internal) */
static int record_sane(const tract_region *r, const struct tract_transfer_record *t)
{
	uint64_t data = tract_sec(r, TRACT_SEC_DATA)->offset;
	if (t->owner_node < 1 || t->owner_node > r->hdr.max_nodes)
		return 0;
	if (t->keys_offset < data || (t->keys_offset - data) % r->hdr.slot_stride ||
	    (t->keys_offset - data) / r->hdr.slot_stride >= r->hdr.slot_count)
		return 0;
	if ((uint64_t)t->block_count * sizeof(struct tract_key_entry) > r->hdr.block_bytes)
		return 0;
	if (t->tail_slot > r->hdr.slot_count)
		return 0;
	return 1;
}

/* whether record t is reserved for request_id by this process (internal) */
static int reserved_by_me(const tract_region *r, const struct tract_transfer_record *t,
			  const uint8_t *request_id)
{
	return t->state == REC_RESERVED && !memcmp(t->request_id, request_id, 16) &&
	       t->owner_node == r->node_id + 1 && t->owner_pid == (uint32_t)getpid();
}

/* whether a reservation's owner is known dead, to this node's agent: a
 * process of this node whose pid is gone (the node's processes share a pid
 * namespace, as its journal recovery assumes; another node's dead processes
 * are its agent's to find, a dead host's the manager's) */
static int owner_known_dead(const tract_region *r, const struct tract_transfer_record *t)
{
	return t->owner_node == r->node_id + 1 && t->owner_pid != (uint32_t)getpid() &&
	       tract_pid_dead(t->owner_pid);
}

/*
 * finds a FREE record for a publish (internal; the transfer lock held, so
 * no record turns FREE -> anything else meanwhile).  Next fit: the scan
 * starts at the record after the one this handle published last; records
 * are observed in batches of 1, 2, 4 ... SCAN_BATCH (one invalidate + one
 * fence per batch), so the common case -- acknowledgements roughly in
 * publish order -- reads one record, and a nearly full table costs about
 * count / SCAN_BATCH fences rather than one per record.
 */
static int find_free_record(tract_region *r, uint32_t *found)
{
	uint32_t count = tract_sec(r, TRACT_SEC_TRANSFER)->count;
	uint32_t at = r->handoff_next < count ? r->handoff_next : 0, batch = 1;
	struct tract_transfer_record t[SCAN_BATCH];
	for (uint32_t seen = 0; seen < count;) {
		uint32_t k = batch;
		if (k > count - seen)
			k = count - seen;
		if (k > count - at)
			k = count - at;                 /* a batch never wraps */
		observe_records(r, at, k, t);
		for (uint32_t j = 0; j < k; j++) {
			if (t[j].state == REC_FREE) {
				*found = at + j;
				return TRACT_OK;
			}
		}
		seen += k;
		at = at + k == count ? 0 : at + k;
		if (batch < SCAN_BATCH)
			batch *= 2;
	}
	return TRACT_E_TABLE_FULL;
}

/* 16-byte key order for qsort (internal) */
static int cmp_key(const void *a, const void *b)
{
	return memcmp(a, b, 16);
}

/* whether keys[0..n) names a key twice (a chained hash never does; a
 * caller's mistake would make the release's counts off by one): 1, 0, or
 * TRACT_E_NOMEM (internal) */
static int has_duplicate_key(const uint8_t *keys, uint32_t n)
{
	if (n < 2)
		return 0;
	uint8_t *sorted = malloc((size_t)n * 16);
	if (!sorted)
		return TRACT_E_NOMEM;
	memcpy(sorted, keys, (size_t)n * 16);
	qsort(sorted, n, 16, cmp_key);
	int dup = 0;
	for (uint32_t i = 1; i < n && !dup; i++)
		dup = !memcmp(sorted + (uint64_t)(i - 1) * 16, sorted + (uint64_t)i * 16, 16);
	free(sorted);
	return dup;
}

/* slots a publish gives back, to forget from its journal (internal) */
struct forget_ctx {
	const uint32_t *slots;
	uint32_t n;
};

/* forgets the slots (tract_free_noted's note: the free holds its locks) (internal) */
static void forget_slots(tract_region *r, void *arg)
{
	struct forget_ctx *f = arg;
	tract_journal_slots(r, f->slots, f->n, 1);
}

/*
 * Steps 2 and 3 of a publish, for blocks this process holds one pin on each
 * (journaled): the key list (keys with their slots, checksums, token
 * counts) and the tail in slots of their own, then the record, under the
 * transfer lock, in record want (UINT32_MAX: the first FREE one found);
 * the pins become the record's.  On failure the pins stay the caller's and
 * the slots it allocated are freed (internal).
 */
static int write_handoff(tract_region *r, const uint8_t *request_id, const uint8_t *keys,
			 uint32_t n, const uint32_t *slots, const uint32_t *tokens,
			 const uint32_t *sums, uint64_t token_count, const void *tail,
			 uint64_t tail_len, uint32_t tail_tokens, uint64_t ttl_ns, uint32_t want,
			 int reserved, uint32_t *rec, uint64_t timeout_ns)
{
	struct tract_key_entry *list = calloc((size_t)n + 1, sizeof(*list));
	uint32_t extra[2] = {0, 0}, nextra = tail_len ? 2 : 1;
	int rc;
	if (!list)
		return TRACT_E_NOMEM;
	if ((rc = tract_alloc_journaled(r, nextra, extra, timeout_ns)) == TRACT_E_FULL) {
		/* a pool full of cached blocks: make room as a put would (no lock is held) */
		uint32_t evicted = 0;
		if (tract_index_evict(r, nextra, &evicted, timeout_ns) == TRACT_OK && evicted)
			rc = tract_alloc_journaled(r, nextra, extra, timeout_ns);
	}
	if (rc < 0) {
		free(list);
		return rc;
	}
	/* (journaled as ours by the allocation, until the record holds them) */
	for (uint32_t i = 0; i < n; i++) {
		memcpy(list[i].key, keys + (uint64_t)i * 16, 16);
		list[i].slot = slots[i];
		list[i].checksum = sums[i];
		list[i].tokens = tokens[i];
	}
	if ((rc = tract_copy_in(r, slot_off(r, extra[0]), list, (uint64_t)n * sizeof(*list))) < 0)
		goto release;
	if (tail_len && (rc = tract_copy_in(r, slot_off(r, extra[1]), tail, tail_len)) < 0)
		goto release;
	/* the record, under the transfer lock; the pins become the record's
	 * (forgotten by this process's journal before the record can exist) */
	if ((rc = tract_lock_acquire(r, TRACT_LOCK_TRANSFER, timeout_ns, NULL)) < 0)
		goto release;
	uint32_t i = want;
	if (want == UINT32_MAX) {
		rc = find_free_record(r, &i);
	} else if (reserved) {
		/* this process's reservation of it for the request: still held? (a
		 * decode side that stopped waiting gave it back, or it expired and
		 * was reclaimed: nobody opens it any more) */
		struct tract_transfer_record was;
		observe_record(r, want, &was);
		rc = reserved_by_me(r, &was, request_id) && was.expiry_ns > tract_now_ns() ?
		     TRACT_OK : TRACT_E_TABLE_FULL;
	} else {
		/* the caller's choice, made without the lock: still FREE under it? */
		struct tract_transfer_record was;
		observe_record(r, want, &was);
		rc = was.state == REC_FREE ? TRACT_OK : TRACT_E_TABLE_FULL;
	}
	if (rc == TRACT_OK) {
		/* forgotten only now that the record will hold them: a full table
		 * leaves them journaled while the release below gives them back */
		tract_journal_pins(r, keys, n, -1);
		tract_journal_slots(r, extra, nextra, 1);
		struct tract_transfer_record t;
		memset(&t, 0, sizeof(t));
		t.state = REC_PUBLISHED;
		t.owner_node = r->node_id + 1;
		t.owner_pid = (uint32_t)getpid();
		t.block_count = n;
		memcpy(t.request_id, request_id, 16);
		t.token_count = token_count;
		t.keys_offset = slot_off(r, extra[0]);
		t.tail_slot = tail_len ? extra[1] + 1 : 0;
		t.tail_tokens = tail_tokens;
		t.created_ns = tract_now_ns();
		t.expiry_ns = t.created_ns + ttl_ns;
		publish_record(r, i, &t);
		if (want == UINT32_MAX)
			r->handoff_next = i + 1;      /* next fit: the following record is likely free */
		*rec = i;
	}
	tract_lock_release(r, TRACT_LOCK_TRANSFER);
	if (rc == TRACT_OK) {
		free(list);
		return TRACT_OK;
	}
	tract_maybe_die(TRACT_DIE_HANDOFF_NO_RECORD);
release:
	/* forgotten by the journal once the free holds its locks, right before
	 * they change hands (a death between leaks them, never frees them
	 * twice; a death while the free waits for a lock leaves them journaled,
	 * for the agent); any other failure may have listed some: a leak at
	 * worst */
	{
		struct forget_ctx f = {extra, nextra};
		tract_free_noted(r, extra, NULL, nextra, forget_slots, &f, NULL, timeout_ns);
	}
	free(list);
	return rc;
}

/* the checks every publish makes of its arguments first (internal) */
static int publish_args(const tract_region *r, const uint8_t *request_id, const uint8_t *keys,
			uint32_t n, const void *tail, uint64_t tail_len, const uint32_t *rec)
{
	if (!r || !request_id || !rec || (!keys && n) || (tail_len && !tail) ||
	    tail_len > r->hdr.block_bytes)
		return TRACT_E_INVAL;
	if ((uint64_t)n * sizeof(struct tract_key_entry) > r->hdr.block_bytes)
		return TRACT_E_RANGE;        /* the key list must fit one slot */
	int dup = has_duplicate_key(keys, n);
	if (dup)
		return dup < 0 ? dup : TRACT_E_INVAL;   /* a release counts one pin per entry */
	return TRACT_OK;
}

/* Publishes a handoff: pins the blocks (all must be READY), stores the key
 * list and the partial tail in slots, writes a record; *rec gets its index. */
int tract_handoff_publish(tract_region *r, const uint8_t *request_id, const uint8_t *keys,
			  uint32_t n, uint64_t token_count, const void *tail, uint64_t tail_len,
			  uint32_t tail_tokens, uint64_t ttl_ns, uint32_t *rec, uint64_t timeout_ns)
{
	return tract_handoff_publish_in(r, UINT32_MAX, request_id, keys, n, token_count, tail,
					tail_len, tail_tokens, ttl_ns, rec, timeout_ns);
}

/* tract_handoff_publish in record want (UINT32_MAX: the first FREE one),
 * chosen without the lock: TRACT_E_TABLE_FULL if it is taken by now */
int tract_handoff_publish_in(tract_region *r, uint32_t want, const uint8_t *request_id,
			     const uint8_t *keys, uint32_t n, uint64_t token_count, const void *tail,
			     uint64_t tail_len, uint32_t tail_tokens, uint64_t ttl_ns, uint32_t *rec,
			     uint64_t timeout_ns)
{
	int rc = publish_args(r, request_id, keys, n, tail, tail_len, rec);
	if (rc)
		return rc;
	if (want != UINT32_MAX && want >= tract_sec(r, TRACT_SEC_TRANSFER)->count)
		return TRACT_E_RANGE;
	uint32_t *slots = calloc((size_t)n + 1, sizeof(uint32_t));
	uint32_t *tokens = calloc((size_t)n + 1, sizeof(uint32_t));
	uint32_t *sums = calloc((size_t)n + 1, sizeof(uint32_t));
	uint32_t hits = 0;
	rc = (slots && tokens && sums) ? TRACT_OK : TRACT_E_NOMEM;
	if (rc)
		goto out;
	/* 1. pin every block for the decode side (as this node) */
	rc = tract_index_lookup(r, keys, n, slots, tokens, sums, NULL, &hits, timeout_ns);
	if (rc)
		goto out;
	if (hits < n) {
		tract_index_unpin(r, keys, hits, timeout_ns);
		rc = TRACT_E_NOT_FOUND;
		goto out;
	}
	/* 2, 3. the key list, the tail, the record */
	rc = write_handoff(r, request_id, keys, n, slots, tokens, sums, token_count, tail,
			   tail_len, tail_tokens, ttl_ns, want, 0, rec, timeout_ns);
	if (rc)
		tract_index_unpin(r, keys, n, timeout_ns);
out:
	free(slots);
	free(tokens);
	free(sums);
	return rc;
}

/*
 * Publishes a handoff of blocks this process holds pinned already, one pin
 * each, journaled (a pinning put's: TRACT_PUT_PIN), in record want, which
 * the caller chose without the lock (tract_handoff_peek_free): the pins
 * become the record's.  Each block's slot, token count and checksum are
 * read from its bucket without a lock: a pinned READY bucket cannot change
 * them, and every line is observed.  With reserved, record want is this
 * process's reservation for request_id (tract_handoff_reserve), taken over
 * if it still holds.  TRACT_E_NOT_FOUND if a key is not READY (nothing
 * written), TRACT_E_TABLE_FULL if record want is taken by now (with
 * reserved: the reservation is gone, expired or given back); on any
 * failure the pins stay the caller's, to give back.
 */
int tract_handoff_publish_pinned(tract_region *r, uint32_t want, const uint8_t *request_id,
				 const uint8_t *keys, uint32_t n, uint64_t token_count,
				 uint64_t ttl_ns, int reserved, uint64_t timeout_ns)
{
	uint32_t rec = 0;
	int rc = publish_args(r, request_id, keys, n, NULL, 0, &rec);
	if (rc)
		return rc;
	if (want >= tract_sec(r, TRACT_SEC_TRANSFER)->count)
		return TRACT_E_RANGE;
	uint32_t *slots = calloc((size_t)n + 1, sizeof(uint32_t));
	uint32_t *tokens = calloc((size_t)n + 1, sizeof(uint32_t));
	uint32_t *sums = calloc((size_t)n + 1, sizeof(uint32_t));
	rc = (slots && tokens && sums) ? TRACT_OK : TRACT_E_NOMEM;
	if (rc == TRACT_OK)
		rc = tract_index_observe_pinned(r, keys, n, slots, tokens, sums);
	if (rc == TRACT_OK)
		rc = write_handoff(r, request_id, keys, n, slots, tokens, sums, token_count, NULL,
				   0, 0, ttl_ns, want, reserved, &rec, timeout_ns);
	free(slots);
	free(tokens);
	free(sums);
	return rc;
}

/* A record that looked FREE from start on (wrapping), observed without a
 * lock, skipping the n records in skip: a choice for
 * tract_handoff_publish_pinned, which checks it under the lock.  TRACT_OK
 * and *rec, or TRACT_E_TABLE_FULL. */
int tract_handoff_peek_free(tract_region *r, uint32_t start, const uint32_t *skip, uint32_t n,
			    uint32_t *rec)
{
	if (!r || !rec || (!skip && n))
		return TRACT_E_INVAL;
	uint32_t count = tract_sec(r, TRACT_SEC_TRANSFER)->count;
	struct tract_transfer_record t[SCAN_BATCH];
	uint32_t at = start < count ? start : 0;
	for (uint32_t seen = 0; seen < count;) {
		uint32_t k = count - at < SCAN_BATCH ? count - at : SCAN_BATCH;
		if (k > count - seen)
			k = count - seen;
		observe_records(r, at, k, t);
		for (uint32_t j = 0; j < k; j++) {
			if (t[j].state != REC_FREE)
				continue;
			uint32_t i = 0;
			while (i < n && skip[i] != at + j)
				i++;
			if (i == n) {
				*rec = at + j;
				return TRACT_OK;
			}
		}
		seen += k;
		at = at + k == count ? 0 : at + k;
	}
	return TRACT_E_TABLE_FULL;
}

/* a record id with its caller's position, for tract_handoff_find (internal) */
struct wanted_id {
	uint8_t id[16];
	uint32_t at;
};

static int cmp_wanted(const void *a, const void *b)
{
	return memcmp(a, b, 16);
}

/* what tract_handoff_find looks for, and where it answers (internal) */
struct find_args {
	const struct wanted_id *want;     /* sorted by id */
	uint32_t n;
	uint32_t *recs;
};

static void find_one(tract_region *r, uint32_t rec, const struct tract_transfer_record *t,
		     void *arg)
{
	(void)r;
	const struct find_args *a = arg;
	if (t->state != REC_PUBLISHED && t->state != REC_RESERVED)
		return;
	const struct wanted_id *hit = bsearch(t->request_id, a->want, a->n, sizeof(*a->want),
					      cmp_wanted);
	if (!hit)
		return;
	/* the first of equal ids, which bsearch may not have landed on: every
	 * caller position asking for this id is answered */
	while (hit > a->want && !memcmp(hit[-1].id, t->request_id, 16))
		hit--;
	for (; hit < a->want + a->n && !memcmp(hit->id, t->request_id, 16); hit++)
		if (a->recs[hit->at] == UINT32_MAX)
			a->recs[hit->at] = rec;
}

/* Finds, in one pass over the table without a lock, the record of each of
 * the n request ids in ids (16 bytes each): recs[i] is the first record
 * PUBLISHED or RESERVED for ids[i], or UINT32_MAX if none is.  What it finds
 * may change before it is used: tract_handoff_open re-observes the record,
 * and its request id, state and expiry are checked there.  The ids are
 * sorted once, so a scan costs count * log n compares, not count * n. */
int tract_handoff_find(tract_region *r, const uint8_t *ids, uint32_t n, uint32_t *recs)
{
	if (!r || (n && (!ids || !recs)))
		return TRACT_E_INVAL;
	if (!n)
		return TRACT_OK;
	struct wanted_id *want = malloc((size_t)n * sizeof(*want));
	if (!want)
		return TRACT_E_NOMEM;
	for (uint32_t i = 0; i < n; i++) {
		memcpy(want[i].id, ids + (uint64_t)i * 16, 16);
		want[i].at = i;
		recs[i] = UINT32_MAX;
	}
	qsort(want, n, sizeof(*want), cmp_wanted);
	struct find_args a = {want, n, recs};
	visit_records(r, find_one, &a);
	free(want);
	return TRACT_OK;
}

/* observes record rec without a lock into *t: TRACT_OK if it is published
 * for request_id, TRACT_E_NOT_FOUND if not, TRACT_E_RANGE past the table (internal) */
static int observe_published(tract_region *r, uint32_t rec, const uint8_t *request_id,
			     struct tract_transfer_record *t)
{
	if (rec >= tract_sec(r, TRACT_SEC_TRANSFER)->count)
		return TRACT_E_RANGE;
	observe_record(r, rec, t);
	return t->state == REC_PUBLISHED && !memcmp(t->request_id, request_id, 16) ?
	       TRACT_OK : TRACT_E_NOT_FOUND;
}

/* Reads a published record and its key list: the keys (16 bytes each; keys may be
 * NULL), slots, checksums and token counts of its blocks (cap entries at most)
 * and the tail. */
int tract_handoff_open(tract_region *r, uint32_t rec, const uint8_t *request_id,
		       uint8_t *keys, uint32_t *slots, uint32_t *checksums, uint32_t *tokens,
		       uint32_t cap, uint32_t *block_count, uint64_t *token_count,
		       uint32_t *tail_slot, uint32_t *tail_tokens)
{
	if (!r || !request_id || !block_count || !token_count || !tail_slot || !tail_tokens)
		return TRACT_E_INVAL;
	struct tract_transfer_record t;
	int got = observe_published(r, rec, request_id, &t);
	if (got == TRACT_E_NOT_FOUND && t.state == REC_RESERVED &&
	    !memcmp(t.request_id, request_id, 16) && t.expiry_ns > tract_now_ns()) {
		/* its owner is committing its blocks: the counts it reserved for,
		 * for the caller to hold against its ticket (a dead owner's is
		 * freed by its node's agent, or expires; no pid is judged here,
		 * whatever namespace this process and the owner are in) */
		*block_count = t.block_count;
		*token_count = t.token_count;
		return TRACT_E_PENDING;
	}
	if (got)
		return got;
	if (!record_sane(r, &t))
		return TRACT_E_CORRUPT;
	if (t.block_count > cap)
		return TRACT_E_RANGE;
	struct tract_key_entry *list = calloc((size_t)t.block_count + 1, sizeof(*list));
	if (!list)
		return TRACT_E_NOMEM;
	int rc = tract_copy_out(r, list, t.keys_offset, (uint64_t)t.block_count * sizeof(*list), 1);
	for (uint32_t i = 0; rc == TRACT_OK && i < t.block_count; i++) {
		if (list[i].slot >= r->hdr.slot_count) {
			rc = TRACT_E_CORRUPT;
			break;
		}
		if (keys)
			memcpy(keys + (uint64_t)i * 16, list[i].key, 16);
		if (slots)
			slots[i] = list[i].slot;
		if (checksums)
			checksums[i] = list[i].checksum;
		if (tokens)
			tokens[i] = list[i].tokens;
	}
	free(list);
	if (rc)
		return rc;
	*block_count = t.block_count;
	*token_count = t.token_count;
	*tail_slot = t.tail_slot;        /* slot + 1, 0 = none */
	*tail_tokens = t.tail_tokens;
	return TRACT_OK;
}

/* Reserves record rec for request_id (FREE under the transfer lock) until
 * ttl_ns from now, for a handoff of block_count blocks and token_count
 * tokens: a publish whose blocks are still being committed lets its ticket
 * go out before it, and the decode side told PENDING waits for it. */
int tract_handoff_reserve(tract_region *r, uint32_t rec, const uint8_t *request_id,
			  uint32_t block_count, uint64_t token_count, uint64_t ttl_ns,
			  uint64_t timeout_ns)
{
	if (!r || !request_id)
		return TRACT_E_INVAL;
	if (rec >= tract_sec(r, TRACT_SEC_TRANSFER)->count)
		return TRACT_E_RANGE;
	int rc = tract_lock_acquire(r, TRACT_LOCK_TRANSFER, timeout_ns, NULL);
	if (rc < 0)
		return rc;
	struct tract_transfer_record t;
	observe_record(r, rec, &t);
	if (t.state != REC_FREE) {
		rc = TRACT_E_TABLE_FULL;
	} else {
		memset(&t, 0, sizeof(t));
		t.state = REC_RESERVED;
		t.owner_node = r->node_id + 1;
		t.owner_pid = (uint32_t)getpid();
		t.block_count = block_count;      /* what the publish will hold: */
		t.token_count = token_count;      /* a decode checks its ticket */
		memcpy(t.request_id, request_id, 16);
		t.created_ns = tract_now_ns();
		t.expiry_ns = t.created_ns + ttl_ns;
		publish_record(r, rec, &t);
		rc = TRACT_OK;
	}
	tract_lock_release(r, TRACT_LOCK_TRANSFER);
	return rc;
}

static int transition(tract_region *r, uint32_t rec, const uint8_t *request_id, uint32_t from,
		      uint32_t to, uint64_t expired_at, struct tract_transfer_record *out,
		      uint64_t timeout_ns);

/* Gives back a reservation of record rec for request_id: RESERVED -> FREE. */
int tract_handoff_unreserve(tract_region *r, uint32_t rec, const uint8_t *request_id,
			    uint64_t timeout_ns)
{
	if (!r || !request_id)
		return TRACT_E_INVAL;
	if (rec >= tract_sec(r, TRACT_SEC_TRANSFER)->count)
		return TRACT_E_RANGE;
	return transition(r, rec, request_id, REC_RESERVED, REC_FREE, 0, NULL, timeout_ns);
}

/* Whether record rec is still published for request_id (no lock).  Every
 * release of a record's slots (acknowledge, reclaim) first moves the record
 * off PUBLISHED, under the transfer lock, and publishes that before it
 * unpins or frees anything; so a copy of the blocks whose loads all precede
 * an observation of PUBLISHED (observe's fence orders them) read the slots
 * before any release, whatever happens after: proof the copy stands, without
 * a lock round trip on the load's path. */
int tract_handoff_check(tract_region *r, uint32_t rec, const uint8_t *request_id)
{
	if (!r || !request_id)
		return TRACT_E_INVAL;
	struct tract_transfer_record t;
	return observe_published(r, rec, request_id, &t);
}

/* the progress of a release, published in its record (internal) */
struct release_ctx {
	uint32_t rec;
	struct tract_transfer_record *t;
};

static void mark_groups(tract_region *r, void *arg, uint32_t groups)
{
	struct release_ctx *x = arg;
	x->t->released_groups = groups;
	publish_record(r, x->rec, x->t);
}

static void mark_slots_freed(tract_region *r, void *arg)
{
	struct release_ctx *x = arg;
	x->t->slots_freed = 1;
	publish_record(r, x->rec, x->t);
}

/* unpins a record's blocks for its owner and frees its slots, resuming from
 * the progress its record shows; the caller owns the record (ACKED or
 * RECLAIMING with itself as releaser), so nobody else writes it (internal) */
static int release_resources(tract_region *r, uint32_t rec, struct tract_transfer_record *t,
			     uint64_t timeout_ns)
{
	if (!record_sane(r, t))
		return TRACT_E_CORRUPT;
	struct tract_key_entry *list = calloc((size_t)t->block_count + 1, sizeof(*list));
	uint8_t *keys = calloc((size_t)t->block_count + 1, 16);
	int rc = (list && keys) ? TRACT_OK : TRACT_E_NOMEM;
	if (rc == TRACT_OK && !t->slots_freed)
		rc = tract_copy_out(r, list, t->keys_offset, (uint64_t)t->block_count * sizeof(*list), 1);
	if (rc == TRACT_OK && !t->slots_freed) {
		for (uint32_t i = 0; i < t->block_count; i++)
			memcpy(keys + (uint64_t)i * 16, list[i].key, 16);
		struct release_ctx x = {rec, t};
		struct tract_release rel = {t->keys_offset, t->block_count, t->owner_node - 1, keys};
		rc = tract_index_release_groups(r, &rel, t->released_groups, mark_groups, &x,
						timeout_ns);
		if (rc != TRACT_E_TIMEOUT && rc != TRACT_E_NOMEM) {
			uint32_t extra[2] = {(uint32_t)((t->keys_offset -
							  tract_sec(r, TRACT_SEC_DATA)->offset) /
							 r->hdr.slot_stride),
					     t->tail_slot ? t->tail_slot - 1 : 0};
			/* marked once the allocator's locks are held, right before
			 * the free: a crash in between leaks the two slots rather
			 * than freeing them twice */
			int rc2 = tract_free_noted(r, extra, NULL, t->tail_slot ? 2 : 1,
						   mark_slots_freed, &x, NULL, timeout_ns);
			if (rc == TRACT_OK)
				rc = rc2;
		}
	}
	free(list);
	free(keys);
	return rc;
}

/* moves a record from one state to another under the transfer lock, if it
 * is in state from (for request_id, if given; expired at expired_at, if
 * nonzero); into ACKED or RECLAIMING it records this process as the
 * releaser (internal) */
static int transition(tract_region *r, uint32_t rec, const uint8_t *request_id, uint32_t from,
		      uint32_t to, uint64_t expired_at, struct tract_transfer_record *out,
		      uint64_t timeout_ns)
{
	int rc = tract_lock_acquire(r, TRACT_LOCK_TRANSFER, timeout_ns, NULL);
	if (rc < 0)
		return rc;
	struct tract_transfer_record t;
	observe_record(r, rec, &t);
	if (t.state != from || (request_id && memcmp(t.request_id, request_id, 16)) ||
	    (expired_at && t.expiry_ns > expired_at)) {
		rc = TRACT_E_NOT_FOUND;
	} else {
		if (to == REC_FREE) {
			memset(&t, 0, sizeof(t));
		} else {
			if (from == REC_PUBLISHED) {        /* a fresh release */
				t.released_groups = 0;
				t.slots_freed = 0;
			}
			if (to == REC_ACKED || to == REC_RECLAIMING) {
				t.releaser_node = r->node_id + 1;
				t.releaser_pid = (uint32_t)getpid();
			}
			t.state = to;
		}
		if (out)
			*out = t;
		publish_record(r, rec, &t);
		rc = TRACT_OK;
	}
	tract_lock_release(r, TRACT_LOCK_TRANSFER);
	return rc;
}

static int resume_record(tract_region *r, uint32_t rec, const struct tract_transfer_record *t,
			 uint64_t timeout_ns);

/* one resumed acknowledgement at a time in a process: two threads must not
 * both finish one record's release */
static pthread_mutex_t resume_ack_mu = PTHREAD_MUTEX_INITIALIZER;

/* Finishes this process's acknowledgement of record rec that timed out partway
 * (ACKED, released by this pid, the same request): only the retry of that same
 * acknowledgement calls it.  TRACT_OK once done, TRACT_E_NOT_FOUND if there is
 * nothing of it to finish. */
int tract_handoff_ack_resume(tract_region *r, uint32_t rec, const uint8_t *request_id,
			     uint64_t timeout_ns)
{
	if (!r || !request_id)
		return TRACT_E_INVAL;
	if (rec >= tract_sec(r, TRACT_SEC_TRANSFER)->count)
		return TRACT_E_RANGE;
	pthread_mutex_lock(&resume_ack_mu);
	struct tract_transfer_record t;
	observe_record(r, rec, &t);
	int rc = TRACT_E_NOT_FOUND;
	if (t.state == REC_ACKED && !memcmp(t.request_id, request_id, 16) &&
	    t.releaser_node == r->node_id + 1 && t.releaser_pid == (uint32_t)getpid()) {
		rc = resume_record(r, rec, &t, timeout_ns);
		rc = rc < 0 ? rc : rc ? TRACT_OK : TRACT_E_NOT_FOUND;
	}
	pthread_mutex_unlock(&resume_ack_mu);
	return rc;
}

/* Acknowledges a handoff: its pins and slots are released, the record freed. */
int tract_handoff_ack(tract_region *r, uint32_t rec, const uint8_t *request_id, uint64_t timeout_ns)
{
	if (!r || !request_id)
		return TRACT_E_INVAL;
	if (rec >= tract_sec(r, TRACT_SEC_TRANSFER)->count)
		return TRACT_E_RANGE;
	struct tract_transfer_record t;
	int rc = transition(r, rec, request_id, REC_PUBLISHED, REC_ACKED, 0, &t, timeout_ns);
	if (rc)
		return rc;
	rc = release_resources(r, rec, &t, timeout_ns);
	if (rc == TRACT_E_TIMEOUT)
		return rc;      /* stays ACKED and ours: this node's agent finishes it if we die */
	int rc2 = transition(r, rec, NULL, REC_ACKED, REC_FREE, 0, NULL, timeout_ns);
	return rc ? rc : rc2;
}

static int reclaim(tract_region *r, uint64_t now_ns, uint32_t *count, uint64_t timeout_ns);

/* one reclaim at a time in a process: a reclaim resumes the records its
 * process left RECLAIMING, which two threads must not both resume */
static pthread_mutex_t reclaim_mu = PTHREAD_MUTEX_INITIALIZER;

/* Reclaims records past their expiry at now_ns that were never
 * acknowledged; *count gets how many.  (A release a dead process left half
 * done is finished by its own node's agent: tract_handoff_recover.) */
int tract_handoff_reclaim(tract_region *r, uint64_t now_ns, uint32_t *count, uint64_t timeout_ns)
{
	if (!r || !count)
		return TRACT_E_INVAL;
	pthread_mutex_lock(&reclaim_mu);
	int rc = reclaim(r, now_ns, count, timeout_ns);
	pthread_mutex_unlock(&reclaim_mu);
	return rc;
}

/* tract_handoff_reclaim, reclaim_mu held (internal) */
static int reclaim(tract_region *r, uint64_t now_ns, uint32_t *count, uint64_t timeout_ns)
{
	*count = 0;
	uint32_t n = tract_sec(r, TRACT_SEC_TRANSFER)->count;
	int rc = TRACT_OK;
	struct tract_transfer_record t[SCAN_BATCH];
	for (uint32_t base = 0; base < n; base += SCAN_BATCH) {
		uint32_t k = n - base < SCAN_BATCH ? n - base : SCAN_BATCH;
		observe_records(r, base, k, t);     /* cheap scan without the lock */
		for (uint32_t j = 0; j < k; j++) {
			uint32_t i = base + j;
			if (t[j].state == REC_RECLAIMING && t[j].releaser_node == r->node_id + 1 &&
			    t[j].releaser_pid == (uint32_t)getpid()) {
				/* one of ours that timed out on a busy lock: resume it */
				int got = resume_record(r, i, &t[j], timeout_ns);
				if (got == TRACT_E_TIMEOUT)
					return got;
				*count += got > 0;
				continue;
			}
			if (t[j].state == REC_RESERVED && t[j].expiry_ns <= now_ns) {
				/* an owner that neither published nor gave it back in
				 * time: nothing is held by it (no key list, no pins) */
				int moved = transition(r, i, t[j].request_id, REC_RESERVED, REC_FREE,
						       now_ns, NULL, timeout_ns);
				if (moved == TRACT_E_TIMEOUT)
					return moved;
				*count += moved == TRACT_OK;
				continue;
			}
			if (t[j].state != REC_PUBLISHED || t[j].expiry_ns > now_ns)
				continue;
			/* the scan's copy may be stale: only the same request, still
			 * expired, is taken (not a record acknowledged and reused since) */
			struct tract_transfer_record got;
			int moved = transition(r, i, t[j].request_id, REC_PUBLISHED, REC_RECLAIMING,
					       now_ns, &got, timeout_ns);
			if (moved == TRACT_E_TIMEOUT)
				return moved;   /* the lock is busy (a dead host's until its
						 * verdict): the next pass, not one wait per
						 * expired record -- the agent's other duties,
						 * the verdict among them, wait for this pass */
			if (moved != TRACT_OK)
				continue;               /* someone else moved it first */
			int rc2 = release_resources(r, i, &got, timeout_ns);
			if (rc2 == TRACT_E_TIMEOUT)
				return rc2;         /* stays RECLAIMING and ours; finished later */
			if (rc2 && rc2 != TRACT_E_CORRUPT)
				rc = rc2;
			transition(r, i, NULL, REC_RECLAIMING, REC_FREE, 0, NULL, timeout_ns);
			(*count)++;
		}
	}
	return rc;
}

/* finishes record rec if the scan saw it (t) half released by a dead
 * process of node (this node: a process whose pid is gone, or this one,
 * which took a release over and timed out on a busy lock; another node: a
 * dead host's, any process), or gives back its reservation if a dead
 * process of node held it: 1 if it did, 0 if not, or an error (internal) */
static int recover_record(tract_region *r, uint32_t node, uint32_t rec,
			  const struct tract_transfer_record *t, uint64_t timeout_ns)
{
	if (t->state == REC_RESERVED && t->owner_node == node + 1 &&
	    (node != r->node_id || owner_known_dead(r, t))) {
		/* a reservation whose owner died: it holds nothing, and its decode
		 * side stops waiting once it is FREE */
		int rc = transition(r, rec, t->request_id, REC_RESERVED, REC_FREE, 0, NULL,
				    timeout_ns);
		return rc == TRACT_OK ? 1 : rc == TRACT_E_NOT_FOUND ? 0 : rc;
	}
	if ((t->state != REC_ACKED && t->state != REC_RECLAIMING) ||
	    t->releaser_node != node + 1 ||
	    (node == r->node_id && t->releaser_pid != (uint32_t)getpid() &&
	     !tract_pid_dead(t->releaser_pid)))
		return 0;
	return resume_record(r, rec, t, timeout_ns);
}

/* finishes the release of record rec that the scan saw (t) half done by a
 * process of this node (dead, or this one), taking it over under the lock if
 * nobody did meanwhile: 1 if it did, 0 if not, or an error (internal) */
static int resume_record(tract_region *r, uint32_t rec, const struct tract_transfer_record *t,
			 uint64_t timeout_ns)
{
	/* take it over, under the lock, if nobody did meanwhile */
	int rc = tract_lock_acquire(r, TRACT_LOCK_TRANSFER, timeout_ns, NULL);
	if (rc < 0)
		return rc;
	struct tract_transfer_record now;
	observe_record(r, rec, &now);
	int mine = now.state == t->state && now.releaser_node == t->releaser_node &&
		   now.releaser_pid == t->releaser_pid &&
		   !memcmp(now.request_id, t->request_id, 16);
	if (mine) {
		/* this process releases it now, as a process of this node: if it
		 * dies too, this node's agent resumes it (a dead host's release
		 * taken over by the manager's agent stays the manager node's) */
		now.releaser_node = r->node_id + 1;
		now.releaser_pid = (uint32_t)getpid();
		publish_record(r, rec, &now);
	}
	tract_lock_release(r, TRACT_LOCK_TRANSFER);
	if (!mine)
		return 0;
	rc = release_resources(r, rec, &now, timeout_ns);
	if (rc == TRACT_E_TIMEOUT)
		return rc;
	transition(r, rec, NULL, now.state, REC_FREE, 0, NULL, timeout_ns);
	return 1;
}

/* finishes the releases dead processes of node left half done; *count gets
 * how many (internal) */
static int recover_releases(tract_region *r, uint32_t node, uint32_t *count, uint64_t timeout_ns)
{
	*count = 0;
	uint32_t n = tract_sec(r, TRACT_SEC_TRANSFER)->count;
	struct tract_transfer_record seen[SCAN_BATCH];
	for (uint32_t base = 0; base < n; base += SCAN_BATCH) {
		uint32_t k = n - base < SCAN_BATCH ? n - base : SCAN_BATCH;
		observe_records(r, base, k, seen);  /* cheap scan without the lock */
		for (uint32_t j = 0; j < k; j++) {
			int rc = recover_record(r, node, base + j, &seen[j], timeout_ns);
			if (rc < 0)
				return rc;
			*count += (uint32_t)rc;
		}
	}
	return TRACT_OK;
}

/* Finishes the releases (acknowledge or reclaim) that dead processes of this
 * node left half done, resuming from the progress their records show. */
int tract_handoff_recover(tract_region *r, uint32_t *count, uint64_t timeout_ns)
{
	if (!r || !count)
		return TRACT_E_INVAL;
	return recover_releases(r, r->node_id, count, timeout_ns);
}

/* finishes the releases a dead host (node, declared dead: every process of
 * it is gone) left half done (internal; recover.c) */
int tract_handoff_recover_node(tract_region *r, uint32_t node, uint32_t *count,
			       uint64_t timeout_ns)
{
	return recover_releases(r, node, count, timeout_ns);
}

/* counts the records node published that are not yet free (a lock-free
 * observe of the table): their blocks stay pinned in node's pin lines until
 * each is acknowledged or reclaimed (internal; recover.c) */
uint32_t tract_handoff_records_of(tract_region *r, uint32_t node)
{
	uint32_t n = tract_sec(r, TRACT_SEC_TRANSFER)->count, live = 0;
	struct tract_transfer_record seen[SCAN_BATCH];
	for (uint32_t base = 0; base < n; base += SCAN_BATCH) {
		uint32_t k = n - base < SCAN_BATCH ? n - base : SCAN_BATCH;
		observe_records(r, base, k, seen);
		for (uint32_t j = 0; j < k; j++)
			live += seen[j].state != REC_FREE && seen[j].state != REC_RESERVED &&
				seen[j].owner_node == node + 1;   /* a reservation holds no pins */
	}
	return live;
}

/* what tract_handoff_mark_slots marks, and for which node (internal) */
struct mark_args {
	uint32_t node;
	uint8_t *bits;
};

static void mark_one(tract_region *r, uint32_t rec, const struct tract_transfer_record *t,
		     void *arg)
{
	(void)rec;
	const struct mark_args *a = arg;
	if (t->state == REC_FREE || t->state == REC_RESERVED || t->owner_node != a->node + 1 ||
	    !record_sane(r, t))
		return;
	uint64_t keys = (t->keys_offset - tract_sec(r, TRACT_SEC_DATA)->offset) /
			r->hdr.slot_stride;
	a->bits[keys / 8] |= (uint8_t)(1u << (keys % 8));
	if (t->tail_slot)
		a->bits[(t->tail_slot - 1) / 8] |= (uint8_t)(1u << ((t->tail_slot - 1) % 8));
}

/* marks in bits (one per slot) the slots every live handoff record of node
 * names, its key list's and its tail's, observed without the lock: a dead
 * host's sweep reads which of its slots are still referenced (internal;
 * recover.c) */
void tract_handoff_mark_slots(tract_region *r, uint32_t node, uint8_t *bits)
{
	struct mark_args a = {node, bits};
	visit_records(r, mark_one, &a);
}
