/*
 * journal.c -- what each attached process holds in the index, so that its
 * node's agent can give it back when the process dies (docs/PROTOCOLS.md §7).
 *
 * A process that dies with lookup pins leaves blocks that can never be
 * evicted; one that dies between reserving a key (PENDING) and publishing it
 * leaves a key nobody can ever write, and a slot nobody can free.  The index
 * counts pins per node, not per process, and a PENDING bucket does not name
 * its slot, so the region alone cannot tell what a dead process held.  Each
 * handle therefore keeps a journal in the node-local segment (DRAM of the
 * node, coherent for the node's processes): per key, the pins it holds and
 * the claim (and slot) it reserved; and the slots it holds outside the
 * index: bare slots on their way to a claim or a handoff record, and slots
 * it evicted on their way to their free.
 *
 * The journal may say less than the process holds, never more: pins are
 * journaled after they are taken and forgotten before they are given back,
 * and a handoff's pins are forgotten before its record is published.  So
 * recovery may leave something behind (a leak, for `tract check --repair`),
 * but never releases what another process holds.  The journal only records:
 * recover.c reads the dead processes' entries and gives their holdings back.  Recovery frees a claim's
 * slot only when it finds the bucket still PENDING and owned by the dead
 * pid: a bucket that turned READY keeps its slot, and a missing bucket's
 * slot is left alone (it may have been freed and reused since).
 */
#include <string.h>
#include <unistd.h>

#include "internal.h"

/* the journal entries of the local segment (internal) */
static struct tract_journal_proc *procs(const tract_region *r)
{
	return (struct tract_journal_proc *)((uint8_t *)r->local + r->local->journal_off);
}

/* Bytes of the journal section of a local segment. */
uint64_t tract_journal_size(void)
{
	return (uint64_t)TRACT_JOURNAL_PROCS * sizeof(struct tract_journal_proc);
}

/* Takes a free journal entry for this handle (none free: the handle runs
 * without one, and its holdings are recovered only offline) (internal) */
void tract_journal_open(tract_region *r)
{
	pthread_mutex_init(&r->journal_mu, NULL);
	r->journal = NULL;
	if (!r->local || !r->local->journal_off)
		return;
	uint32_t me = (uint32_t)getpid();
	struct tract_journal_proc *p = procs(r);
	for (uint32_t i = 0; i < TRACT_JOURNAL_PROCS; i++) {
		uint32_t zero = 0;
		if (__atomic_compare_exchange_n(&p[i].pid, &zero, me, 0, __ATOMIC_ACQ_REL,
						__ATOMIC_ACQUIRE)) {
			/* a fresh entry: empty (recovery and close leave it zeroed) */
			p[i].attached_ns = tract_now_ns();
			r->journal = &p[i];
			return;
		}
	}
}

/* Gives the entry back if it holds nothing; otherwise it stays for the agent,
 * which recovers it once this process is gone (internal) */
void tract_journal_close(tract_region *r)
{
	if (r->journal) {
		pthread_mutex_lock(&r->journal_mu);
		if (r->journal->used == 0 && r->journal->overflow == 0)
			__atomic_store_n(&r->journal->pid, 0, __ATOMIC_RELEASE);
		r->journal = NULL;
		pthread_mutex_unlock(&r->journal_mu);
	}
	pthread_mutex_destroy(&r->journal_mu);
}

/* the home position of a key (internal) */
static uint32_t home(const uint8_t *key)
{
	uint64_t lo;
	memcpy(&lo, key, 8);
	return (uint32_t)(lo ^ (lo >> 29)) & (TRACT_JOURNAL_CAP - 1);
}

/* the position of key, or of the free place it would take; -1 when full (internal) */
static int64_t find(struct tract_journal_proc *p, const uint8_t *key, int *found)
{
	uint32_t h = home(key);
	for (uint32_t i = 0; i < TRACT_JOURNAL_CAP; i++) {
		uint32_t pos = (h + i) & (TRACT_JOURNAL_CAP - 1);
		struct tract_journal_key *k = &p->keys[pos];
		if (!k->used) {
			*found = 0;
			return pos;
		}
		if (!memcmp(k->key, key, 16)) {
			*found = 1;
			return pos;
		}
	}
	*found = 0;
	return -1;
}

/*
 * An erase in a live process's journal shifts the keys of the probe run
 * back (the table stays probe-correct without tombstones, which a journal
 * that never empties would fill).  Each move copies a key into the hole
 * and leaves the key at its old place until the next move reuses it: a
 * process killed there would leave the key twice, and recovery would give
 * its pins back twice -- someone else's.  So `shift` names the move in
 * progress before it starts, one u32 store: MOVE(to, from) while the key
 * at `from` is copied to `to`, CLEAR(at) while the last hole is emptied.
 * Recovery settles it (journal_settle) before it reads a dead process's
 * keys: the copy at `to` may be torn, the key at `from` is whole.
 */
#define SHIFT_MOVE 1u
#define SHIFT_CLEAR 2u
#define SHIFT_POS_BITS 15
#define SHIFT_POS_MASK ((1u << SHIFT_POS_BITS) - 1)
_Static_assert(TRACT_JOURNAL_CAP <= (1u << SHIFT_POS_BITS), "journal positions fit a shift");

/* records the move in progress before any byte of it is written (internal) */
static void shift_mark(struct tract_journal_proc *p, uint32_t kind, uint32_t to, uint32_t from)
{
	__atomic_store_n(&p->shift, kind << (2 * SHIFT_POS_BITS) | to << SHIFT_POS_BITS | from,
			 __ATOMIC_RELEASE);
	/* the compiler keeps the copy after the mark (one process: stores keep
	 * program order for whoever reads them after its death) */
	__atomic_signal_fence(__ATOMIC_SEQ_CST);
}

/* removes position pos, shifting back the keys of its probe run (internal) */
static void erase(struct tract_journal_proc *p, uint32_t pos)
{
	uint32_t hole = pos;
	for (uint32_t i = 1; i < TRACT_JOURNAL_CAP; i++) {
		uint32_t at = (pos + i) & (TRACT_JOURNAL_CAP - 1);
		struct tract_journal_key *k = &p->keys[at];
		if (!k->used)
			break;
		uint32_t h = home(k->key);
		/* k may move into the hole if its home is not in (hole, at] */
		uint32_t d_at = (at - h) & (TRACT_JOURNAL_CAP - 1);
		uint32_t d_hole = (hole - h) & (TRACT_JOURNAL_CAP - 1);
		if (d_hole <= d_at) {
			shift_mark(p, SHIFT_MOVE, hole, at);
			p->keys[hole] = *k;
			tract_maybe_die(TRACT_DIE_JOURNAL_MOVED);
			hole = at;
		}
	}
	shift_mark(p, SHIFT_CLEAR, hole, hole);
	memset(&p->keys[hole], 0, sizeof(p->keys[hole]));
	p->used--;
	shift_mark(p, 0, 0, 0);
}

/* a dead process's journal made ready for recovery: an erase killed in
 * the middle is settled (the one place that may hold a torn copy or a
 * second copy of a key is emptied), and the count of keys is taken again
 * (an insert or an erase killed between its key and its count leaves it
 * off by one) (internal) */
static void journal_settle(struct tract_journal_proc *p)
{
	uint32_t v = __atomic_load_n(&p->shift, __ATOMIC_ACQUIRE);
	uint32_t kind = v >> (2 * SHIFT_POS_BITS), to = (v >> SHIFT_POS_BITS) & SHIFT_POS_MASK;
	if ((kind == SHIFT_MOVE || kind == SHIFT_CLEAR) && to < TRACT_JOURNAL_CAP)
		memset(&p->keys[to], 0, sizeof(p->keys[to]));
	uint32_t used = 0;
	for (uint32_t i = 0; i < TRACT_JOURNAL_CAP; i++)
		used += p->keys[i].used != 0;
	p->used = used;
	__atomic_store_n(&p->shift, 0, __ATOMIC_RELEASE);
}

/* fills the free place pos with a new entry, no pins (internal, journal_mu held) */
static void occupy(struct tract_journal_proc *p, uint32_t pos, const uint8_t *key, uint32_t claim,
		   uint32_t kind)
{
	struct tract_journal_key *k = &p->keys[pos];
	memcpy(k->key, key, 16);
	k->pins = 0;
	k->claim = claim;
	k->kind = kind;
	k->used = 1;
	p->used++;
}

/* adds dpins to a key's pins and, with set_claim, sets its claim to claim
 * (0 clears it); without set_claim keeps it (internal, journal_mu held) */
static void update(struct tract_journal_proc *p, const uint8_t *key, int32_t dpins,
		   int set_claim, uint32_t claim)
{
	int found;
	int64_t pos = find(p, key, &found);
	if (!found) {
		if (dpins <= 0 && !(set_claim && claim))
			return;                    /* nothing journaled to take back */
		if (pos < 0) {
			p->overflow++;
			return;
		}
		occupy(p, (uint32_t)pos, key, 0, TRACT_JOURNAL_INDEX_KEY);
	}
	struct tract_journal_key *k = &p->keys[pos];
	if (dpins < 0 && (uint32_t)-dpins > k->pins)
		k->pins = 0;
	else
		k->pins = (uint32_t)((int64_t)k->pins + dpins);
	if (set_claim)
		k->claim = claim;
	if (!k->pins && !k->claim)
		erase(p, (uint32_t)pos);
}

/* Journals dpins (+1 taken, -1 given back) on each of n keys (internal). */
void tract_journal_pins(tract_region *r, const uint8_t *keys, uint32_t n, int32_t dpins)
{
	if (!r->journal || !n)
		return;
	pthread_mutex_lock(&r->journal_mu);
	for (uint32_t i = 0; i < n; i++)
		update(r->journal, keys + (uint64_t)i * 16, dpins, 0, 0);
	pthread_mutex_unlock(&r->journal_mu);
}

/* Journals (slots != NULL: with their slots) or forgets (forget) the claims
 * of the keys whose status is `claimed` (internal). */
void tract_journal_claims(tract_region *r, const uint8_t *keys, uint32_t n, const uint8_t *status,
			  uint8_t claimed, const uint32_t *slots, int forget)
{
	if (!r->journal || !n)
		return;
	pthread_mutex_lock(&r->journal_mu);
	for (uint32_t i = 0; i < n; i++) {
		if (status[i] != claimed)
			continue;
		uint32_t c = forget ? 0 : slots ? slots[i] + 1 : UINT32_MAX;
		update(r->journal, keys + (uint64_t)i * 16, 0, 1, c);
	}
	pthread_mutex_unlock(&r->journal_mu);
}

/* journals (forget = 0) or forgets a slot held outside the index under
 * key, as an entry of kind (internal, journal_mu held) */
static void journal_slot(struct tract_journal_proc *p, const uint8_t *key, uint32_t slot,
			 uint32_t kind, int forget)
{
	int found;
	int64_t pos = find(p, key, &found);
	if (forget) {
		if (found)
			erase(p, (uint32_t)pos);
		return;
	}
	if (found)
		return;
	if (pos < 0) {
		p->overflow++;
		return;
	}
	occupy(p, (uint32_t)pos, key, slot + 1, kind);
}

/* the journal key of a bare slot (internal) */
static void slot_key(uint32_t slot, uint8_t *key)
{
	memset(key, 0, 16);
	memcpy(key, &slot, 4);   /* in the low word: home() spreads the slots */
	memcpy(key + 4, "slot", 4);
	key[15] = 0xA5;          /* never equal to an index key's layout by accident */
}

/*
 * Pin moves.  Taking or giving back a pin is two stores: the node's count
 * on the bucket (the region, tract_pin_add) and this process's journal
 * entry for the key, ordered so that the journal never says more than the
 * process holds (taken: the count, then the journal; given back: the
 * journal, then the count).  A process killed between the two used to
 * leave one pin no journal named, for `tract check --repair`: the chaos
 * run's random kills found that window about once in thirty runs.  So a
 * move is named before either store (struct tract_journal_move: the key,
 * the bucket, the stripe lock and its holding's request sequence, the
 * count and the journaled pins before), under journal_mu, which the move
 * holds throughout (one move per process at a time), and inside the stripe
 * section that holds the bucket.  A process killed in the move died holding
 * that stripe's lock, so nobody changes the count before the lock is taken
 * over (by the node's next process to ask for it, or its agent: recover.c,
 * step 1); the stripe's repair then tells from the count whether the move
 * reached it (tract_journal_move_resolve), and the journal's recovery
 * (step 2) sets the key's journaled pins to what they were before, plus
 * the move if it reached the count (tract_journal_move_settle): exactly
 * what the process held.  The journal's recovery first enters the move's
 * stripe (its lock taken over from the dead holder, the stripe repaired,
 * the move told), unless the lock's recovery already did; a move that
 * cannot be told (a count that is neither) leaves the journal as it is,
 * saying less, never more.
 */
void tract_journal_move_begin(tract_region *r, const uint8_t *key, uint32_t lock_id,
			      uint64_t bucket, int dpins, uint16_t pins_before)
{
	if (!r->journal)
		return;
	pthread_mutex_lock(&r->journal_mu);
	struct tract_journal_proc *p = r->journal;
	struct tract_journal_move *m = &p->move;
	int found;
	int64_t pos = find(p, key, &found);
	m->bucket = bucket;
	memcpy(m->key, key, 16);
	m->lock_id = lock_id;
	m->journal_before = found ? p->keys[pos].pins : 0;
	m->pins_before = pins_before;
	m->dpins = (int8_t)dpins;
	m->seq = (uint32_t)r->held_seq[lock_id];   /* this thread's holding of the stripe */
	/* named whole before it is live (one process: its stores keep program
	 * order for the agent that reads them after its death, on this host) */
	__atomic_signal_fence(__ATOMIC_SEQ_CST);
	__atomic_store_n(&m->state, TRACT_MOVE_ACTIVE, __ATOMIC_RELEASE);
	__atomic_signal_fence(__ATOMIC_SEQ_CST);
}

/* the journal's half of the move begun (journal_mu held by it) */
void tract_journal_move_apply(tract_region *r, const uint8_t *key, int dpins)
{
	if (!r->journal)
		return;
	update(r->journal, key, dpins, 0, 0);
	__atomic_signal_fence(__ATOMIC_SEQ_CST);
}

/* ends the move begun: no longer named, journal_mu given back */
void tract_journal_move_end(tract_region *r)
{
	if (!r->journal)
		return;
	__atomic_store_n(&r->journal->move.state, TRACT_MOVE_NONE, __ATOMIC_RELEASE);
	pthread_mutex_unlock(&r->journal_mu);
}

/*
 * The repair of stripe lock lock_id, taken over from a holder of this node
 * that died inside its section: tells the move of that holding (the one
 * whose sequence is the holding's, which the takeover keeps) whether it
 * reached the count, count(ctx, bucket) reading the node's count now (-1: a
 * bucket that is not the stripe's).  Any other move still named on the
 * stripe is a holding's whose takeover told nothing (the count may have
 * moved since): it is left untold, its journal as it is.  No pid is asked
 * whether it is dead: the mutex's owner-died state hands the lock over
 * while the dying process may still be exiting, and no live process can be
 * inside a move on a lock this process holds.  Returns how many moves it
 * told (internal; the caller holds the lock).
 */
int tract_journal_move_resolve(tract_region *r, uint32_t lock_id,
			       int (*count)(void *ctx, uint64_t bucket), void *ctx)
{
	if (!r->local || !r->local->journal_off || lock_id >= r->hdr.lock_count)
		return 0;
	struct tract_journal_proc *p = procs(r);
	uint32_t holding = (uint32_t)r->held_seq[lock_id];
	int told = 0;
	for (uint32_t i = 0; i < TRACT_JOURNAL_PROCS; i++) {
		struct tract_journal_move *m = &p[i].move;
		if (__atomic_load_n(&m->state, __ATOMIC_ACQUIRE) != TRACT_MOVE_ACTIVE ||
		    m->lock_id != lock_id)
			continue;
		int v = m->seq == holding ? count(ctx, m->bucket) : -1;
		uint8_t state = TRACT_MOVE_NONE;          /* neither: left as it is */
		if (v >= 0 && v == (int)m->pins_before + m->dpins)
			state = TRACT_MOVE_APPLIED;
		else if (v >= 0 && v == (int)m->pins_before)
			state = TRACT_MOVE_UNDONE;
		__atomic_store_n(&m->state, state, __ATOMIC_RELEASE);
		told++;
	}
	return told;
}

/* whether a dead process's move is still untold (its stripe not repaired
 * since it died: its lock not taken over yet); *lock_id gets that stripe's
 * lock (internal) */
int tract_journal_move_untold(const struct tract_journal_proc *p, uint32_t *lock_id)
{
	if (__atomic_load_n(&p->move.state, __ATOMIC_ACQUIRE) != TRACT_MOVE_ACTIVE)
		return 0;
	*lock_id = p->move.lock_id;
	return 1;
}

/*
 * A dead process's move, once the repair of its stripe told it: the key's
 * journaled pins set to what they were before, plus the move if it reached
 * the count.  One still untold (its stripe entered without a repair, its
 * holding already given up) leaves the journal as it is, saying less than
 * the process held, never more (internal; after journal_settle).
 */
void tract_journal_move_settle(struct tract_journal_proc *p)
{
	struct tract_journal_move *m = &p->move;
	uint8_t state = __atomic_load_n(&m->state, __ATOMIC_ACQUIRE);
	if (state == TRACT_MOVE_APPLIED || state == TRACT_MOVE_UNDONE) {
		int64_t want = (int64_t)m->journal_before + (state == TRACT_MOVE_APPLIED ? m->dpins : 0);
		int found;
		int64_t pos = find(p, m->key, &found);
		int64_t have = found ? p->keys[pos].pins : 0;
		if (want < 0)
			want = 0;
		if (want != have)
			update(p, m->key, (int32_t)(want - have), 0, 0);
	}
	__atomic_store_n(&m->state, TRACT_MOVE_NONE, __ATOMIC_RELEASE);
}

/* Journals (forget = 0) or forgets bare slots this process holds outside the
 * index: slots tract_alloc_journaled handed out until their claim or their
 * handoff record holds them.  Forgotten before they are freed: the journal may
 * say less than the process holds, never more (internal). */
void tract_journal_slots(tract_region *r, const uint32_t *slots, uint32_t n, int forget)
{
	if (!r->journal || !n)
		return;
	pthread_mutex_lock(&r->journal_mu);
	for (uint32_t i = 0; i < n; i++) {
		uint8_t key[16];
		slot_key(slots[i], key);
		journal_slot(r->journal, key, slots[i], TRACT_JOURNAL_BARE, forget);
	}
	pthread_mutex_unlock(&r->journal_mu);
}

/* the journal key of a slot an eviction took out of the index: the slot, its
 * owner (node + 1, as the eviction saw it) and the owner's agent epoch then,
 * which the free needs (tract_free_evicted: a dead host's swept slot is never
 * freed twice); bytes 6-7 keep it from ever equalling a bare slot's key
 * (internal) */
static void evicted_key(uint32_t slot, const struct tract_slot_owner *owner, uint8_t *key)
{
	uint16_t node = (uint16_t)(owner->node + 1u);
	memcpy(key, &slot, 4);   /* in the low word: home() spreads the slots */
	memcpy(key + 4, &node, 2);
	key[6] = 0xE5;
	key[7] = 0xE5;
	memcpy(key + 8, &owner->epoch, 8);
}

/* Journals (forget = 0) or forgets slots this process evicted: from right
 * after their bucket stops naming them until their free holds its locks
 * (alloc.c's tract_free_evicted), so that the node's agent frees them when
 * the process dies in between (recover.c) (internal). */
void tract_journal_evicted(tract_region *r, const uint32_t *slots,
			   const struct tract_slot_owner *owners, uint32_t n, int forget)
{
	if (!r->journal || !n)
		return;
	pthread_mutex_lock(&r->journal_mu);
	for (uint32_t i = 0; i < n; i++) {
		uint8_t key[16];
		evicted_key(slots[i], &owners[i], key);
		journal_slot(r->journal, key, slots[i], TRACT_JOURNAL_EVICTED, forget);
	}
	pthread_mutex_unlock(&r->journal_mu);
}

/* who owned an evicted slot's journal entry's slot, as its eviction saw it
 * (internal) */
void tract_journal_evicted_owner(const struct tract_journal_key *k, struct tract_slot_owner *out)
{
	uint16_t node;
	memcpy(&node, k->key + 4, 2);
	out->node = node ? node - 1u : UINT32_MAX;
	out->reserved = 0;
	memcpy(&out->epoch, k->key + 8, 8);
}

/* The next journal entry of this node, from *cursor on, whose process is
 * dead (NULL: none left); *cursor moves past it.  Recovery (recover.c)
 * reads its keys with tract_journal_first, gives each back, erases it with
 * tract_journal_erase, and frees the entry with tract_journal_retire
 * (internal). */
struct tract_journal_proc *tract_journal_next_dead(tract_region *r, uint32_t *cursor)
{
	if (!r->local || !r->local->journal_off)
		return NULL;
	struct tract_journal_proc *p = procs(r);
	for (; *cursor < TRACT_JOURNAL_PROCS; (*cursor)++) {
		uint32_t pid = __atomic_load_n(&p[*cursor].pid, __ATOMIC_ACQUIRE);
		if (tract_pid_dead(pid)) {
			journal_settle(&p[*cursor]);
			return &p[(*cursor)++];
		}
	}
	return NULL;
}

/* the first key the entry still journals (NULL: none) (internal) */
struct tract_journal_key *tract_journal_first(struct tract_journal_proc *p, uint32_t *pos)
{
	for (uint32_t i = 0; i < TRACT_JOURNAL_CAP && p->used; i++)
		if (p->keys[i].used) {
			*pos = i;
			return &p->keys[i];
		}
	return NULL;
}

/* forgets the key at pos of a dead process's entry, in place: nobody
 * probes a dead process's keys (recovery reads them in order), so nothing
 * moves, and an agent killed here leaves no key twice (internal) */
void tract_journal_erase(struct tract_journal_proc *p, uint32_t pos)
{
	struct tract_journal_key *k = &p->keys[pos];
	k->pins = 0;
	k->claim = 0;
	__atomic_signal_fence(__ATOMIC_SEQ_CST);
	k->used = 0;
	p->used--;
}

/* frees a dead process's entry once everything it journaled is given back;
 * returns whether its journal had overflowed (internal) */
int tract_journal_retire(struct tract_journal_proc *p)
{
	int overflowed = p->overflow != 0;
	p->overflow = 0;
	p->used = 0;
	p->shift = 0;
	memset(&p->move, 0, sizeof(p->move));
	memset(p->keys, 0, sizeof(p->keys));
	__atomic_store_n(&p->pid, 0, __ATOMIC_RELEASE);
	return overflowed;
}

/* The pids of this node's journal entries in use: up to cap into out, *n = all. */
int tract_journal_pids(const tract_region *r, uint32_t *out, uint32_t cap, uint32_t *n)
{
	if (!r || !n || (cap && !out))
		return TRACT_E_INVAL;
	*n = 0;
	if (!r->local || !r->local->journal_off)
		return TRACT_E_NO_LOCAL;
	*n = tract_journal_pids_of(r->local, out, cap);
	return TRACT_OK;
}

/* the pids the journal of segment H names, up to cap of them in out; returns
 * how many it names (internal) */
uint32_t tract_journal_pids_of(const struct tract_local_hdr *h, uint32_t *out, uint32_t cap)
{
	const struct tract_journal_proc *p =
		(const struct tract_journal_proc *)((const uint8_t *)h + h->journal_off);
	uint32_t n = 0;
	for (uint32_t e = 0; e < TRACT_JOURNAL_PROCS; e++) {
		uint32_t pid = __atomic_load_n(&p[e].pid, __ATOMIC_ACQUIRE);
		if (!pid)
			continue;
		if (n < cap)
			out[n] = pid;
		n++;
	}
	return n;
}

/* whether a journal entry of this node names pid (internal) */
int tract_journal_names(tract_region *r, uint32_t pid)
{
	if (!r->local || !r->local->journal_off || !pid)
		return 0;
	struct tract_journal_proc *p = procs(r);
	for (uint32_t e = 0; e < TRACT_JOURNAL_PROCS; e++)
		if (__atomic_load_n(&p[e].pid, __ATOMIC_ACQUIRE) == pid)
			return 1;
	return 0;
}

/* Voids every bare slot journaled that still sits on this node's free list
 * (bit s of listed set): journaled under alloc_mu right before its pop by a
 * holder of alloc_mu that died before it popped it (alloc.c, repair_local,
 * alloc_mu held).  Whoever journaled it: no live process has a listed bare
 * slot while another holds alloc_mu, and the dead holder may not look dead
 * yet (its robust mutex is released before it becomes a zombie; its pid may
 * be reused).  Voided (claim 0, which recovery gives back as nothing), not
 * erased: the agent may be walking the entry (internal). */
void tract_journal_void_listed(tract_region *r, const uint8_t *listed)
{
	if (!r->local || !r->local->journal_off)
		return;
	struct tract_journal_proc *p = procs(r);
	for (uint32_t e = 0; e < TRACT_JOURNAL_PROCS; e++) {
		uint32_t pid = __atomic_load_n(&p[e].pid, __ATOMIC_ACQUIRE);
		if (!pid || !p[e].used)
			continue;
		for (uint32_t i = 0; i < TRACT_JOURNAL_CAP; i++) {
			struct tract_journal_key *k = &p[e].keys[i];
			if (!k->used || k->kind != TRACT_JOURNAL_BARE || !k->claim)
				continue;
			uint32_t s = k->claim - 1;
			if (s < r->hdr.slot_count && (listed[s / 8] & (1u << (s % 8))))
				k->claim = 0;
		}
	}
}

/* whether a claim the entry journals names slot (internal) */
int tract_journal_claims_slot(const struct tract_journal_proc *p, uint32_t slot)
{
	for (uint32_t i = 0; i < TRACT_JOURNAL_CAP; i++) {
		const struct tract_journal_key *k = &p->keys[i];
		if (k->used && k->kind == TRACT_JOURNAL_INDEX_KEY && k->claim == slot + 1)
			return 1;
	}
	return 0;
}

/* voids the entry's bare journal of slot, if it has one (internal) */
void tract_journal_void_bare(struct tract_journal_proc *p, uint32_t slot)
{
	for (uint32_t i = 0; i < TRACT_JOURNAL_CAP; i++) {
		struct tract_journal_key *k = &p->keys[i];
		if (k->used && k->kind == TRACT_JOURNAL_BARE && k->claim == slot + 1)
			k->claim = 0;
	}
}

/* Forgets, in this node's dead processes' journals, what the recovery of a
 * dead host gave back, for an agent that starts on a node whose previous
 * agent epoch was declared dead (alloc.c's tract_alloc_rejoin): their pins
 * always (the recovery zeroed the node's pin counts, so giving them back
 * again would take other processes' pins), and every bare slot that keep
 * (NULL: none) does not keep (the sweep returned it; another node may hold
 * it now).  Their claims stay: recovery frees a claim's slot only while its
 * bucket is still PENDING, which the recovery buried before it swept.  *pins
 * gets the pins forgotten, and their pin moves are forgotten with them
 * (internal). */
void tract_journal_void_dead(tract_region *r, int (*keep)(tract_region *, uint32_t, void *),
			     void *arg, uint64_t *pins)
{
	*pins = 0;
	if (!r->local || !r->local->journal_off)
		return;
	struct tract_journal_proc *p = procs(r);
	for (uint32_t i = 0; i < TRACT_JOURNAL_PROCS; i++) {
		uint32_t pid = __atomic_load_n(&p[i].pid, __ATOMIC_ACQUIRE);
		if (!pid || !tract_pid_dead(pid))
			continue;       /* free, or a live process (of the new epoch) */
		journal_settle(&p[i]);
		/* a pin move it died inside is forgotten with its pins: settled
		 * later, it would set back what this zeroes */
		memset(&p[i].move, 0, sizeof(p[i].move));
		for (uint32_t k = 0; k < TRACT_JOURNAL_CAP && p[i].used; k++) {
			struct tract_journal_key *key = &p[i].keys[k];
			if (!key->used)
				continue;
			*pins += key->pins;
			key->pins = 0;
			int bare_gone = key->kind == TRACT_JOURNAL_BARE &&
					(!keep || !key->claim || !keep(r, key->claim - 1, arg));
			if (bare_gone || (key->kind == TRACT_JOURNAL_INDEX_KEY && !key->claim))
				tract_journal_erase(&p[i], k);
		}
	}
}
