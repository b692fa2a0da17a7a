/*
 * index_recover.c -- the index's part of recovery (docs/PROTOCOLS.md §7):
 * what lock.c's recovery and recover.c call to give back what a dead
 * process of this node held in the index.  A stripe is repaired after a
 * holder died inside it; a dead process's pins are given
 * back and its PENDING claims dropped, from its journal; claims no journal
 * names any more are buried.
 */
#include "index_internal.h"

/* repairs the stripe of lock lock_id, which this node holds for a holder of
 * this host that died inside it (recover.c) (internal) */
void tract_index_repair_stripe(tract_region *r, uint32_t lock_id)
{
	if (lock_id < TRACT_FIXED_LOCKS || lock_id - TRACT_FIXED_LOCKS >= r->hdr.index_stripes)
		return;
	struct stripe_ctx c;
	tract_stripe_init(r, lock_id - TRACT_FIXED_LOCKS, &c, NULL);
	c.recovered = 1;      /* the dead holder was of this host: its lines may be dirty here */
	tract_stripe_repair(&c);
	tract_stripe_flush(&c);
}

/* enters and leaves the stripe of lock lock_id: a dead holder's lock is
 * taken over and the stripe repaired on the way (a pin move it died inside
 * told: journal.c) (internal) */
int tract_index_visit_stripe(tract_region *r, uint32_t lock_id, uint64_t timeout_ns)
{
	if (lock_id < TRACT_FIXED_LOCKS || lock_id - TRACT_FIXED_LOCKS >= r->hdr.index_stripes)
		return TRACT_E_CORRUPT;
	struct stripe_ctx c;
	int rc = tract_stripe_enter(r, lock_id - TRACT_FIXED_LOCKS, timeout_ns, &c, NULL);
	if (rc < 0)
		return rc;
	tract_stripe_leave(&c);
	return TRACT_OK;
}

/* enters the stripe of key and finds key's bucket: *b (UINT64_MAX: none) and
 * its contents *bk; the caller leaves the stripe when this returned >= 0 */
static int enter_and_probe(tract_region *r, const uint8_t *key, uint64_t timeout_ns,
			   struct stripe_ctx *c, uint64_t *b, struct tract_bucket *bk)
{
	int rc = tract_stripe_enter(r, tract_key_stripe(r, key), timeout_ns, c, NULL);
	if (rc < 0)
		return rc;
	uint64_t fb;
	tract_probe(c, key, b, &fb, bk);
	return rc;
}

/*
 * Gives back up to *journaled of this node's pins on key (a dead process's,
 * as its journal entry counts them).  The entry is forgotten (*journaled =
 * 0) only once the stripe lock is held, right before the count changes: an
 * agent killed in between leaks that key's pins (the journal may say less,
 * never more), but an agent killed while it waits for the lock -- which can
 * take seconds, a dead host's lock until its verdict -- leaves the entry for
 * the next agent (the chaos run with a host kill found pins leaked that way)
 * (internal).
 */
int tract_index_release_pins(tract_region *r, const uint8_t *key, uint32_t *journaled,
			     uint32_t *released, uint64_t timeout_ns)
{
	*released = 0;
	struct stripe_ctx c;
	uint64_t b;
	struct tract_bucket bk;
	int rc = enter_and_probe(r, key, timeout_ns, &c, &b, &bk);
	if (rc < 0)
		return rc;
	uint32_t count = *journaled;
	*journaled = 0;
	__atomic_signal_fence(__ATOMIC_SEQ_CST);   /* forgotten before the count moves */
	rc = TRACT_E_NOT_FOUND;
	if (b != UINT64_MAX) {
		uint8_t buf[TRACT_LINE];
		uint16_t v = tract_pin_count(&c, r->node_id, b, buf);
		uint32_t take = count < v ? count : v;
		if (take && tract_pin_add(&c, b, r->node_id, -(int)take) == TRACT_OK)
			*released = take;
		rc = TRACT_OK;
	}
	tract_stripe_leave(&c);
	return rc;
}

/* drops a dead process's PENDING claim on key: the bucket is buried and the
 * slot freed only when the bucket is still PENDING and pid's (internal) */
int tract_index_drop_claim(tract_region *r, const uint8_t *key, uint32_t pid, uint32_t slot,
			   int *freed, uint64_t timeout_ns)
{
	*freed = 0;
	struct stripe_ctx c;
	uint64_t b;
	struct tract_bucket bk;
	int rc = enter_and_probe(r, key, timeout_ns, &c, &b, &bk);
	if (rc < 0)
		return rc;
	int ours = b != UINT64_MAX && bk.state == TRACT_BUCKET_PENDING && bk.owner_pid == pid &&
		   bk.owner_node == r->node_id;
	if (ours)
		tract_bury(&c, b);
	tract_stripe_leave(&c);
	if (!ours)
		return TRACT_E_NOT_FOUND;
	if (slot < r->hdr.slot_count) {
		/* the dead writer's plain stores may still be dirty in this host's
		 * caches (the agent runs on its host): written back now, they cannot
		 * land later on the slot's next block */
		tract_write_back_payload(r, tract_sec(r, TRACT_SEC_DATA)->offset +
					    (uint64_t)slot * r->hdr.slot_stride, r->hdr.block_bytes);
		tract_record_write_back(r, slot);     /* and its record's (KV events) */
		r->ops->fence(r);
		if (tract_free(r, &slot, 1, timeout_ns) == TRACT_OK)
			*freed = 1;
	}
	return TRACT_OK;
}

/* whether a PENDING bucket's claim is to be buried (internal) */
typedef int (*claim_filter)(tract_region *r, const struct tract_bucket *bk, uint32_t node);

/* this node's claim whose writer is dead and in no journal (internal) */
static int orphaned(tract_region *r, const struct tract_bucket *bk, uint32_t node)
{
	return bk->owner_node == node && tract_pid_dead(bk->owner_pid) &&
	       !tract_journal_names(r, bk->owner_pid);
}

/* any claim of node, which is dead (the caller checked the verdict under
 * the stripe's lock) (internal) */
static int of_node(tract_region *r, const struct tract_bucket *bk, uint32_t node)
{
	(void)r;
	return bk->owner_node == node;
}

/* whether node is dead under the verdict naming dead_epoch (internal) */
static int still_dead(tract_region *r, uint32_t node, uint64_t dead_epoch)
{
	struct tract_node_verdict v;
	return tract_node_verdict(r, node, &v) == 1 && v.dead_epoch == dead_epoch;
}

enum { ENTERED = 1, SKIPPED = 2 };

/* enters stripe s for a recovery of node's holdings: ENTERED, or SKIPPED
 * (its lock stayed busy for timeout_ns; counted in *skipped); with
 * dead_epoch (0: none), re-checks under the stripe's lock that node is still
 * dead under that verdict: revived (an agent started there since), what it
 * holds is its new processes', so TRACT_E_ALIVE and nothing entered; another
 * error as is (internal) */
static int enter_while_dead(tract_region *r, uint32_t s, uint32_t node, uint64_t dead_epoch,
			    uint64_t timeout_ns, struct stripe_ctx *c, uint32_t *skipped)
{
	int rc = tract_stripe_enter(r, s, timeout_ns, c, NULL);
	if (rc == TRACT_E_TIMEOUT) {
		(*skipped)++;
		return SKIPPED;
	}
	if (rc < 0)
		return rc;
	if (dead_epoch && !still_dead(r, node, dead_epoch)) {
		tract_stripe_leave(c);
		return TRACT_E_ALIVE;
	}
	return ENTERED;
}

/* buries the PENDING buckets of every stripe that filter picks for node;
 * dead_epoch (0: none): re-check, under each stripe's lock, that node is
 * still dead under that verdict, and stop (TRACT_E_ALIVE) when it is not
 * (internal) */
static int bury_claims(tract_region *r, uint32_t node, claim_filter filter, uint64_t dead_epoch,
		       uint64_t timeout_ns, uint32_t *buried, uint32_t *skipped)
{
	*buried = *skipped = 0;
	for (uint32_t s = 0; s < r->hdr.index_stripes; s++) {
		struct stripe_ctx c;
		int rc = enter_while_dead(r, s, node, dead_epoch, timeout_ns, &c, skipped);
		if (rc < 0)
			return rc;
		if (rc == SKIPPED)
			continue;
		for (uint64_t b = c.first; b < c.first + c.size; b++) {
			struct tract_bucket bk;
			load_bucket(&c, b, &bk);
			if (bk.state != TRACT_BUCKET_PENDING || !filter(r, &bk, node))
				continue;
			tract_bury(&c, b);
			(*buried)++;
		}
		tract_stripe_leave(&c);
	}
	return TRACT_OK;
}

/*
 * Buries this node's PENDING buckets whose writer is dead and named in no
 * journal entry: the journal that would have dropped the claim is gone (the
 * host restarted and its node-local segment with it) or overflowed.  The
 * key becomes writable again.  The slot is not freed: a PENDING bucket does
 * not name it, so it comes back with `tract check --repair`.  A writer the
 * journal still names is left to tract_recover_dead, which frees its slot
 * too.  A stripe whose lock stays busy for timeout_ns is skipped.
 */
int tract_bury_orphan_claims(tract_region *r, uint64_t timeout_ns, uint32_t *buried,
			     uint32_t *skipped)
{
	if (!r || !buried || !skipped || (r->flags & TRACT_ATTACH_READONLY))
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	return bury_claims(r, r->node_id, orphaned, 0, timeout_ns, buried, skipped);
}

/* buries every PENDING claim of node, a dead host's (its slots, which no
 * bucket names, come back offline) (internal; recover.c) */
int tract_index_bury_claims_of(tract_region *r, uint32_t node, uint64_t dead_epoch,
			       uint64_t timeout_ns, uint32_t *buried, uint32_t *skipped)
{
	return bury_claims(r, node, of_node, dead_epoch, timeout_ns, buried, skipped);
}

/*
 * Zeroes node's pin counts, a dead host's whose handoff records are all gone
 * (the caller's check: a record's pins are the publishing node's, and its
 * release unpins them).  What remains pinned in the node's lines then is its
 * dead readers', whose journals died with the host.  Under each stripe's
 * lock, the verdict re-checked there (TRACT_E_ALIVE: revived, stop); *pins
 * gets the sum of the counts zeroed (internal; recover.c).
 */
int tract_index_clear_pins(tract_region *r, uint32_t node, uint64_t dead_epoch,
			   uint64_t timeout_ns, uint64_t *pins, uint32_t *skipped)
{
	*pins = 0;
	*skipped = 0;
	uint8_t zero[TRACT_LINE] = { 0 };
	for (uint32_t s = 0; s < r->hdr.index_stripes; s++) {
		struct stripe_ctx c;
		int rc = enter_while_dead(r, s, node, dead_epoch, timeout_ns, &c, skipped);
		if (rc < 0)
			return rc;
		if (rc == SKIPPED)
			continue;
		/* a stripe's buckets fill whole pin lines (layout.c) */
		for (uint64_t b = c.first; b < c.first + c.size; b += TRACT_LINE / 2) {
			uint64_t line = pin_off(r, node, b) & ~(uint64_t)(TRACT_LINE - 1);
			uint16_t counts[TRACT_LINE / 2];
			tract_line_get(&c, line, counts);
			uint64_t sum = 0;
			for (uint32_t i = 0; i < TRACT_LINE / 2; i++)
				sum += counts[i];
			if (sum) {
				tract_line_put(&c, line, zero);
				*pins += sum;
			}
		}
		tract_stripe_leave(&c);
	}
	return TRACT_OK;
}

/* marks in bits (one per slot) the slot of every READY bucket, observed a
 * batch of lines at a time without a lock: a dead host's sweep reads which of
 * its slots are still referenced (internal; recover.c) */
void tract_index_mark_slots(tract_region *r, uint8_t *bits)
{
	const struct tract_section *sec = tract_sec(r, TRACT_SEC_BUCKETS);
	struct tract_bucket batch[64];
	for (uint64_t b = 0; b < sec->count; b += 64) {
		uint64_t k = sec->count - b < 64 ? sec->count - b : 64;
		uint64_t off = sec->offset + b * TRACT_LINE;
		r->ops->invalidate(r, off, k * TRACT_LINE);
		r->ops->fence(r);
		r->ops->load(r, off, batch, k * TRACT_LINE);
		for (uint64_t i = 0; i < k; i++) {
			uint32_t slot = batch[i].slot;
			if (batch[i].state == TRACT_BUCKET_READY && slot && slot <= r->hdr.slot_count)
				bits[(slot - 1) / 8] |= (uint8_t)(1u << ((slot - 1) % 8));
		}
	}
}
