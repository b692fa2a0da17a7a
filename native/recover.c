/*
 * recover.c -- the node's recovery, the whole procedure in one place
 * (docs/PROTOCOLS.md §7).  The node's agent calls tract_recover once per
 * heartbeat; it gives back what this node's dead processes left, in an order
 * where each step relies on the ones before it:
 *
 *   1. locks     every lock a dead process of the node held or requested:
 *                a request is withdrawn; a held lock is taken over with its
 *                grant (nobody else enters in between) and handed to the
 *                repair of what it protects (the table below), then released;
 *   2. journals  the pins, PENDING claims and bare slots each dead process
 *                journaled (their stripe and allocator locks are free or
 *                repaired after step 1);
 *   3. orphans   (when asked) PENDING buckets of the node whose writer is dead
 *                and in no journal: a restarted host's, an overflowed journal's;
 *   4. handoffs  releases (acknowledge, reclaim) a dead process left half done,
 *                resumed from the progress their records show.
 *
 * A dead *host* (a node the current lock manager's agent declared dead,
 * verdict.c) left no agent to do this; the manager's agent runs
 * tract_recover_host for it every heartbeat until nothing is left.  Its locks
 * need no step here: the lock manager took each back and the next holder
 * repaired what it protects (the grant's `inherited`, lock.c).
 *
 * The parts below it know only their own state: lock.c takes a dead holder's
 * lock and knows nothing of what it protects; the journal is a passive table;
 * alloc.c, the index (index_recover.c) and handoff.c each repair their own
 * state.  A step that times out on a busy lock leaves its work for the next
 * heartbeat.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* takes lock id from a dead holder of this node and repairs what it protects
 * (tract_lock_take_dead's results) (internal) */
typedef int (*lock_recovery)(tract_region *r, uint32_t id, int *withdrawn);

/* the object directory and the transfer table: each critical section
 * publishes one line (an entry, a record), whole or not at all, so a dead
 * holder leaves nothing to repair; a record's release it left half done is
 * step 4's (internal) */
static int take_one_line_lock(tract_region *r, uint32_t id, int *withdrawn)
{
	int rc = tract_lock_take_dead(r, id, withdrawn);
	if (rc == TRACT_RECOVERED)
		tract_lock_release(r, id);
	return rc;
}

/* an index stripe: repaired (what the dead holder left dirty in this host's
 * caches written back, its LRU list made whole: tract_index_repair_stripe)
 * (internal) */
static int take_stripe_lock(tract_region *r, uint32_t id, int *withdrawn)
{
	int rc = tract_lock_take_dead(r, id, withdrawn);
	if (rc == TRACT_RECOVERED) {
		tract_index_repair_stripe(r, id);
		tract_lock_release(r, id);
	}
	return rc;
}

/* who repairs each fixed lock; every higher lock is an index stripe */
static const lock_recovery fixed_locks[TRACT_FIXED_LOCKS] = {
	[TRACT_LOCK_ALLOCATOR] = tract_alloc_recover_lock,  /* finishes the claim or release */
	[TRACT_LOCK_OBJDIR] = take_one_line_lock,
	[TRACT_LOCK_TRANSFER] = take_one_line_lock,
};

/* Takes back the locks of this node's dead processes (step 1); *count gets
 * how many were taken over or withdrawn. */
int tract_lock_recover(tract_region *r, uint32_t *count)
{
	if (!r || !count || (r->flags & TRACT_ATTACH_READONLY))
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	*count = 0;
	for (uint32_t id = 0; id < r->hdr.lock_count; id++) {
		lock_recovery recover = id < TRACT_FIXED_LOCKS ? fixed_locks[id] : take_stripe_lock;
		int withdrawn = 0;
		int rc = recover(r, id, &withdrawn);
		if (rc == TRACT_RECOVERED || withdrawn)
			(*count)++;
	}
	return TRACT_OK;
}

/* forgets a bare or evicted slot's journal entry (the free's note: its
 * locks are held) (internal) */
static void void_bare(tract_region *r, void *arg)
{
	(void)r;
	struct tract_journal_key *k = arg;
	k->claim = 0;
	__atomic_signal_fence(__ATOMIC_SEQ_CST);   /* forgotten before the slot moves */
}

/* gives back one journaled key of a dead process pid; TRACT_E_TIMEOUT leaves
 * what is not done yet in the key for the next heartbeat (internal) */
static int give_back(tract_region *r, struct tract_journal_proc *p, struct tract_journal_key *k,
		     uint32_t pid, struct tract_recovery *out, uint64_t timeout_ns)
{
	if (k->kind == TRACT_JOURNAL_BARE || k->kind == TRACT_JOURNAL_EVICTED) {
		/* a bare slot: popped by the dead process (the ones it journaled
		 * and never popped were voided when alloc_mu was settled), and no
		 * one else's: freed, unless a claim it journaled names the slot
		 * too (it died handing the slot over: the claim gives it back).
		 * An evicted one: taken out of the index and never freed: freed
		 * as its eviction would have, with the owner and epoch it saw (a
		 * dead host's swept slot, or this node's own from before a
		 * verdict, is left alone) */
		uint32_t slot = k->claim - 1;
		struct tract_slot_owner owner, *known = NULL;
		if (!k->claim || slot >= r->hdr.slot_count)
			return TRACT_OK;
		if (k->kind == TRACT_JOURNAL_EVICTED) {
			tract_journal_evicted_owner(k, &owner);
			if (owner.node >= r->hdr.max_nodes)
				return TRACT_OK;
			known = &owner;
		} else if (tract_journal_claims_slot(p, slot)) {
			return TRACT_OK;
		}
		/* voided once the free holds its locks, right before the slot
		 * changes hands: an agent killed in between leaks it, one killed
		 * while it waits for them leaves it to the next agent */
		uint32_t moved = 0;
		int rc = tract_free_noted(r, &slot, known, 1, void_bare, k, &moved, timeout_ns);
		if (rc == TRACT_E_TIMEOUT)
			return rc;          /* nothing changed: the next heartbeat frees it */
		k->claim = 0;               /* (a free that failed otherwise: not again) */
		out->slots += rc == TRACT_OK ? moved : 0;
		return TRACT_OK;
	}
	if (k->pins) {
		uint32_t released = 0;
		/* forgotten under the stripe lock, right before they are given
		 * back: an agent killed in between leaks them (one key's), the
		 * next agent never gives them twice; a timeout leaves them */
		int rc = tract_index_release_pins(r, k->key, &k->pins, &released, timeout_ns);
		if (rc == TRACT_E_TIMEOUT)
			return rc;          /* nothing changed: the next heartbeat gives them */
		out->pins += released;
	}
	if (k->claim) {
		uint32_t slot = k->claim == UINT32_MAX ? UINT32_MAX : k->claim - 1;
		int freed = 0;
		/* the claim gives its slot back (or the bucket keeps it): a bare
		 * journal of the same slot, left by a death while the claim took it
		 * over (index_put.c), gives back nothing after it */
		if (slot != UINT32_MAX)
			tract_journal_void_bare(p, slot);
		int rc = tract_index_drop_claim(r, k->key, pid, slot, &freed, timeout_ns);
		if (rc == TRACT_E_TIMEOUT)
			return rc;      /* the pins are done; the claim next time */
		out->claims += rc == TRACT_OK;
		out->slots += (uint64_t)freed;
	}
	return TRACT_OK;
}

/*
 * Gives back what the node's dead processes journaled (step 2): their pins
 * (per key), their PENDING claims (bucket buried, slot freed when the bucket
 * is still theirs) and their bare slots, counted in OUT's processes, pins,
 * claims, slots and partial (journals that had overflowed, recovered only in
 * part); its other fields are left as they are.  Needs no lock of its own:
 * only one agent runs per node, and a dead process writes nothing.
 */
int tract_recover_dead(tract_region *r, struct tract_recovery *out, uint64_t timeout_ns)
{
	if (!r || !out)
		return TRACT_E_INVAL;
	out->processes = out->pins = out->claims = out->slots = out->partial = 0;
	if (!r->local || !r->local->journal_off)
		return TRACT_E_NO_LOCAL;
	uint32_t cursor = 0;
	int waiting = 0;     /* a journal left for the next heartbeat: its move's stripe busy */
	struct tract_journal_proc *p;
	while ((p = tract_journal_next_dead(r, &cursor))) {
		uint32_t pid = p->pid, pos;
		struct tract_journal_key *k;
		/* it may have died holding alloc_mu, with slots journaled that it
		 * never popped: settling alloc_mu now, after its death, voids them
		 * before any of its bare slots is freed */
		int settle_rc = tract_alloc_settle(r, timeout_ns);
		if (settle_rc < 0)
			return settle_rc;
		/* a pin move it died inside: told by the repair of its stripe
		 * (step 1's, a successor's, or entering it now takes the lock over
		 * and repairs it), then set in its journal (journal.c, "Pin
		 * moves"); nothing of its journal is given back before, and a busy
		 * stripe leaves it whole for the next heartbeat, not the others */
		uint32_t move_lock;
		if (tract_journal_move_untold(p, &move_lock)) {
			int rc = tract_index_visit_stripe(r, move_lock, timeout_ns);
			if (rc < 0 && rc != TRACT_E_CORRUPT) {
				waiting = 1;    /* busy, or the node fenced: not told yet */
				continue;
			}
			/* (E_CORRUPT: a move naming no stripe, never told: settled
			 * as untold, the journal as it is) */
		}
		tract_journal_move_settle(p);
		while ((k = tract_journal_first(p, &pos))) {
			int rc = give_back(r, p, k, pid, out, timeout_ns);
			if (rc == TRACT_E_TIMEOUT)
				return rc;      /* the entry keeps the rest */
			tract_journal_erase(p, pos);
		}
		out->partial += (uint64_t)tract_journal_retire(p);
		out->processes++;
	}
	return waiting ? TRACT_E_TIMEOUT : TRACT_OK;
}

/* One pass of the node's recovery, steps 1 to 4 (see the top of this file). */
int tract_recover(tract_region *r, uint32_t flags, struct tract_recovery *out, uint64_t timeout_ns)
{
	if (!r || !out || (r->flags & TRACT_ATTACH_READONLY))
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	memset(out, 0, sizeof(*out));
	int rc = tract_lock_recover(r, &out->locks);
	if (rc < 0)
		return rc;
	out->journal_rc = tract_recover_dead(r, out, timeout_ns);
	if (flags & TRACT_RECOVER_ORPHANS)
		out->orphan_rc = tract_bury_orphan_claims(r, timeout_ns, &out->orphans_buried,
							  &out->orphans_skipped);
	out->handoff_rc = tract_handoff_recover(r, &out->handoffs, timeout_ns);
	return TRACT_OK;
}

/*
 * One pass of a dead host's recovery, by the current lock manager's agent
 * (TRACT_E_SUPERSEDED otherwise), while node stays dead (TRACT_E_ALIVE once
 * an agent started there again):
 *   1. handoff releases its processes left half done, finished;
 *   2. its PENDING claims buried (their keys writable again);
 *   3. once no handoff record it published remains (their pins are in its
 *      pin lines until each is acknowledged or reclaimed at expiry), its pin
 *      counts zeroed: what is left there is its dead readers';
 *   4. with TRACT_RECOVER_HOST_SLOTS, its slots that nothing references any
 *      more returned to the pool: its free list, which died with its DRAM,
 *      its unfinished writes' slots, and what other nodes evicted since the
 *      last pass (their frees leave a dead host's slots to this step).
 * Steps 2 to 4 are recorded in the verdict when whole (a busy stripe leaves
 * them for the next pass).  out->done: only later slot sweeps are left.
 */
int tract_recover_host(tract_region *r, uint32_t node, uint32_t flags,
		       struct tract_host_recovery *out, uint64_t timeout_ns)
{
	if (!r || !out || (r->flags & TRACT_ATTACH_READONLY) || node >= r->hdr.max_nodes ||
	    node == r->node_id)
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	memset(out, 0, sizeof(*out));
	int32_t who;
	tract_current_token(r, &who, SITE_NONE);
	if (who != (int32_t)r->node_id)
		return TRACT_E_SUPERSEDED;
	struct tract_node_verdict v;
	int dead = tract_node_verdict(r, node, &v);
	if (dead <= 0)
		return dead < 0 ? dead : TRACT_E_ALIVE;
	int rc = tract_handoff_recover_node(r, node, &out->handoffs, timeout_ns);
	if (rc < 0)
		return rc;
	uint32_t steps = v.recovered, skipped = 0;
	if (!(steps & TRACT_VERDICT_CLAIMS)) {
		rc = tract_index_bury_claims_of(r, node, v.dead_epoch, timeout_ns, &out->claims,
						&skipped);
		if (rc < 0)
			return rc;
		out->skipped += skipped;
		if (!skipped)
			steps |= TRACT_VERDICT_CLAIMS;
	}
	out->records = tract_handoff_records_of(r, node);
	if (!(steps & TRACT_VERDICT_PINS) && !out->records) {
		rc = tract_index_clear_pins(r, node, v.dead_epoch, timeout_ns, &out->pins, &skipped);
		if (rc < 0)
			return rc;
		out->skipped += skipped;
		if (!skipped)
			steps |= TRACT_VERDICT_PINS;
	}
	if (steps != v.recovered &&
	    (rc = tract_node_verdict_record(r, node, v.dead_epoch, steps)) < 0)
		return rc;
	if ((flags & TRACT_RECOVER_HOST_SLOTS) && (steps & TRACT_VERDICT_CLAIMS)) {
		/* the references first, without a lock (they only go away while
		 * the node is dead), then the sweep under lock 0 */
		uint8_t *referenced = calloc((r->hdr.slot_count + 7) / 8 + 1, 1);
		if (!referenced)
			return TRACT_E_NOMEM;
		tract_index_mark_slots(r, referenced);
		tract_obj_mark_slots(r, referenced);
		tract_handoff_mark_slots(r, node, referenced);
		rc = tract_alloc_sweep_dead(r, node, v.dead_epoch, referenced, &out->slots, &out->owned,
					    timeout_ns);
		free(referenced);
		if (rc < 0)
			return rc;
		steps |= TRACT_VERDICT_SLOTS;
	}
	out->done = (steps & (TRACT_VERDICT_CLAIMS | TRACT_VERDICT_PINS | TRACT_VERDICT_SLOTS)) ==
		    (TRACT_VERDICT_CLAIMS | TRACT_VERDICT_PINS | TRACT_VERDICT_SLOTS);
	return TRACT_OK;
}

/* An agent starting on this node: publishes its line 0 and, if a verdict
 * named the previous epoch, forgets what that death's recovery gave back
 * (tract.h). */
int tract_node_rejoin(tract_region *r, uint64_t prev_epoch, const void *line0, uint64_t *pins,
		      uint64_t *dropped, uint64_t timeout_ns)
{
	if (!r || !line0 || !pins || !dropped || (r->flags & TRACT_ATTACH_READONLY))
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	return tract_alloc_rejoin(r, prev_epoch, line0, dropped, pins, timeout_ns);
}
