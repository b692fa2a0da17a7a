/*
 * internal.h -- definitions shared by the C core's translation units.
 */
#ifndef TRACT_INTERNAL_H
#define TRACT_INTERNAL_H

#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>

#include "format.h"
#include "tract.h"

struct tract_sim;

/*
 * The accessor table: chosen once at attach (flush mode, simulator), so no
 * caller ever branches on CPU features or on the simulator.
 */
struct tract_ops {
	const char *name;
	/* load n bytes at region offset off (may hit a stale cached line) */
	void (*load)(tract_region *r, uint64_t off, void *dst, uint64_t n);
	/* store n bytes (stays in this host's cache until flushed) */
	void (*store)(tract_region *r, uint64_t off, const void *src, uint64_t n);
	/* write back every line of [off, off+n); evicts except for clwb */
	void (*flush)(tract_region *r, uint64_t off, uint64_t n);
	/* evict every line of [off, off+n) so the next load reads the device */
	void (*invalidate)(tract_region *r, uint64_t off, uint64_t n);
	/* order flushes and stores before later accesses */
	void (*fence)(tract_region *r);
};

/*
 * The node-local segment: one per node, in local DRAM (a file in /dev/shm
 * mapped by every process of the node).  Ordinary coherent memory, so
 * process-shared robust mutexes and plain atomics are fine here; nothing
 * in it is ever read by another host.
 */
#define TRACT_LOCAL_MAGIC 0x434f4c5443415254ULL /* "TRACTLOC" */
#define TRACT_LOCAL_VERSION 7   /* 7: the region's origin in the header */

/*
 * The per-process journal in the node-local segment (journal.c): what each
 * attached process holds in the shared index, so the node agent can give it
 * back when the process dies: its pins (per key) and its PENDING claims (key
 * and the slot allocated for it).  One entry per attached handle, claimed by
 * pid; an open-addressing table of keys per entry.
 */
#define TRACT_JOURNAL_PROCS 32
#define TRACT_JOURNAL_CAP 8192          /* keys per process (power of two) */

struct tract_journal_key {
	uint8_t key[16];
	uint32_t pins;          /* pins this process holds on the key */
	uint32_t claim;         /* 1 + slot of a PENDING claim (UINT32_MAX: no slot yet), 0 none;
				 * for a bare slot: 1 + the slot */
	uint32_t used;          /* 1: occupied */
	uint32_t kind;          /* TRACT_JOURNAL_* */
};

/* what a journal entry names (journal.c) */
enum {
	TRACT_JOURNAL_INDEX_KEY = 0,  /* a key of the index: its pins, its claim */
	TRACT_JOURNAL_BARE = 1,       /* a bare slot (tract_alloc_journaled's, until a claim
				       * or a handoff record holds it); key = slot id + "slot" */
	TRACT_JOURNAL_EVICTED = 2,    /* a slot an eviction took out of the index, not yet
				       * freed; key = slot id, its owner and the owner's epoch
				       * as the eviction saw them */
};

/* the states of a pin move (journal.c, "Pin moves") */
enum {
	TRACT_MOVE_NONE = 0,
	TRACT_MOVE_ACTIVE = 1,    /* named, the bucket's count and the journal being moved */
	TRACT_MOVE_APPLIED = 2,   /* its process died inside: the repair found the count moved */
	TRACT_MOVE_UNDONE = 3,    /* ... found the count as it was before */
};

/* A pin moving between a bucket's count and this process's journal, named
 * before either changes, inside the stripe section that holds the bucket
 * (journal.c, "Pin moves"): what recovery needs to make the journal say
 * exactly what a process killed in between held (40 bytes: the entry's
 * former padding). */
struct tract_journal_move {
	uint64_t bucket;         /* the bucket whose count moves */
	uint8_t key[16];         /* its key (the journal's) */
	uint32_t lock_id;        /* the stripe's lock, held throughout */
	uint32_t journal_before; /* this process's journaled pins on key before */
	uint16_t pins_before;    /* the node's count on the bucket before */
	int8_t dpins;            /* +1 taken, -1 given back */
	uint8_t state;           /* TRACT_MOVE_*; written last, cleared last */
	uint32_t seq;            /* the holding's request sequence (low 32 bits): the
				  * takeover of that holding keeps it (lock.c) */
};
_Static_assert(sizeof(struct tract_journal_move) == 40, "a move fills the entry's former padding");

struct tract_journal_proc {
	uint32_t pid;           /* 0: free; set by CAS, cleared by the owner or the agent */
	uint32_t used;          /* occupied keys */
	uint32_t overflow;      /* operations not journaled (table full): recovery incomplete */
	uint32_t shift;         /* an erase's move in progress (journal.c), 0 none */
	uint64_t attached_ns;
	struct tract_journal_move move;   /* a pin move in progress (journal.c) */
	struct tract_journal_key keys[TRACT_JOURNAL_CAP];
} __attribute__((aligned(64)));

struct tract_local_mutex {
	pthread_mutex_t mu;
	uint64_t acquired;      /* acquisitions of the global lock by this node */
	uint64_t wait_ns;       /* total time spent acquiring */
	uint32_t abandoned;     /* pid of a live process that let the mutex go
				 * inside its critical section (tract_lock_abandon):
				 * its holding is a dead one's, to take over and repair */
} __attribute__((aligned(64)));

struct tract_local_hdr {
	uint64_t magic;
	uint32_t version;
	uint32_t node;
	uint8_t region_uuid[16];
	uint32_t lock_count;
	uint32_t reserved;
	uint64_t slot_count;
	uint64_t free_count;    /* entries in the free list, under alloc_mu */
	uint64_t locks_off;     /* offsets inside the segment */
	uint64_t free_list_off; /* u32 slot ids */
	uint64_t free_bits_off; /* 1 bit per slot: in this node's free list */
	uint64_t journal_off;   /* TRACT_JOURNAL_PROCS struct tract_journal_proc */
	uint64_t ledger_off;    /* u64 per slot: the payload ledger (payload.c) */
	uint64_t sim_off;       /* the node's simulated cache (sim.c); untouched, so
				 * never backed by memory, outside the simulator */
	/* the allocator's intent (alloc.c): a change of the region's allocator
	 * state under lock 0, recorded before it starts and cleared when it has
	 * ended, so that whoever inherits lock 0 from a holder that died inside
	 * finishes it exactly; its slots sit in the free list at intent_base */
	uint32_t intent_op;     /* 0 none, 1 claim, 2 release */
	uint32_t intent_n;      /* its slots */
	uint64_t intent_base;   /* their position in the free list */
	pthread_mutex_t agent_mu __attribute__((aligned(64)));
	pthread_mutex_t alloc_mu __attribute__((aligned(64)));
	/* where the region lives (version 7): written once, before the segment
	 * is published under its name, and only read after (tract_local_describe) */
	struct tract_local_origin origin __attribute__((aligned(64)));
} __attribute__((aligned(64)));

struct tract_region {
	uint8_t *base;
	uint64_t size;
	uint32_t flags;
	uint32_t node_id;
	int flush_mode;
	const struct tract_ops *ops;
	struct tract_sim *sim;      /* non-NULL only in simulator mode */
	struct tract_header hdr;    /* private copy of the verified header */
	struct tract_local_hdr *local; /* bound node-local segment, or NULL */
	uint8_t *held;              /* per lock: 1 if this process holds it */
	uint64_t *held_seq;         /* per lock: the request sequence of that holding */
	struct tract_journal_proc *journal; /* this handle's entry in the local segment, or NULL */
	pthread_mutex_t journal_mu; /* guards the entry across this process's threads */
	pthread_mutex_t held_mu;    /* guards held[] across this process's threads */
	uint32_t handoff_next;      /* transfer record a publish tries first (handoff.c; transfer lock held) */
};

/* the section of a kind from the verified header (internal) */
static inline const struct tract_section *tract_sec(const tract_region *r, uint32_t kind)
{
	return &r->hdr.sections[kind - 1];
}

/* the local mutex record of a lock (internal) */
static inline struct tract_local_mutex *tract_local_lock(const tract_region *r, uint32_t id)
{
	return (struct tract_local_mutex *)((uint8_t *)r->local + r->local->locks_off) + id;
}

/* region offset of line `line` of lock `id`: 0 = manager, 1 + k = node k (internal) */
static inline uint64_t tract_lock_line(const tract_region *r, uint32_t id, uint32_t line)
{
	const struct tract_section *s = tract_sec(r, TRACT_SEC_LOCKS);
	return s->offset + (uint64_t)id * s->entry_size + (uint64_t)line * TRACT_LINE;
}

/* repairs the stripe of lock lock_id after a process of this host died
 * inside it; the caller holds the lock (index_recover.c; internal) */
void tract_index_repair_stripe(tract_region *r, uint32_t lock_id);

/* whether a journal entry of this node names pid (journal.c; internal) */
int tract_journal_names(tract_region *r, uint32_t pid);

/* a lock request published but not yet granted (lock.c; internal) */
struct tract_lock_req {
	uint64_t req;           /* the request sequence published as WAITING */
	uint32_t after_lock;    /* made ahead in a walk: lock id + 1 of the request it
				 * follows (published with it), 0 none */
	uint64_t after_req;     /* ... that request's sequence */
	uint64_t start;         /* CLOCK_MONOTONIC of the request */
	int recovered;          /* the local mutex's previous owner died */
	int inherited;          /* ... holding the current grant, which this request keeps */
	uint32_t dead_host;     /* set by await: node + 1 of a dead host the grant took
				 * the lock back from (the caller repairs), 0 = none */
};

/* lock request / await / cancel: tract_lock_acquire in two steps, so a holder
 * of a lock can request one of higher id before it leaves (internal) */
int tract_lock_request(tract_region *r, uint32_t lock_id, uint64_t timeout_ns,
		       struct tract_lock_req *q, struct tract_lock_wait *wait);
int tract_lock_await(tract_region *r, uint32_t lock_id, struct tract_lock_req *q,
		     uint64_t timeout_ns, struct tract_lock_wait *wait);
void tract_lock_cancel(tract_region *r, uint32_t lock_id, const struct tract_lock_req *q);

/* a request made ahead in a walk, after the walk's request AFTER of lock
 * after_id (lower than lock_id): the local tier only tried; the manager grants
 * it only once AFTER is granted or gone.  TRACT_E_TIMEOUT when not made (the
 * local mutex busy, or a dead holder's grant to take over: requested in turn)
 * (internal) */
int tract_lock_request_after(tract_region *r, uint32_t lock_id, struct tract_lock_req *q,
			     uint32_t after_id, const struct tract_lock_req *after);

/* the largest lock-manager claim in the node table (manager.c; internal) */
uint64_t tract_current_token(tract_region *r, int32_t *node, int site);

/* the largest claim, and which nodes are dead (dead: max_nodes entries), from
 * one observe of the node table (verdict.c; internal) */
uint64_t tract_observe_nodes(tract_region *r, uint8_t *dead, int site);

/* a dead host's part of the index, the transfer table (index_recover.c,
 * handoff.c; recover.c's tract_recover_host) (internal) */
int tract_index_bury_claims_of(tract_region *r, uint32_t node, uint64_t dead_epoch,
			       uint64_t timeout_ns, uint32_t *buried, uint32_t *skipped);
int tract_index_clear_pins(tract_region *r, uint32_t node, uint64_t dead_epoch,
			   uint64_t timeout_ns, uint64_t *pins, uint32_t *skipped);
int tract_handoff_recover_node(tract_region *r, uint32_t node, uint32_t *count,
			       uint64_t timeout_ns);
uint32_t tract_handoff_records_of(tract_region *r, uint32_t node);

/* who owned a slot when an eviction took it out of the index: the owner
 * node and its agent epoch then (alloc.c, index_bucket.c; internal) */
struct tract_slot_owner {
	uint32_t node;
	uint32_t reserved;
	uint64_t epoch;
};

/* observes the owner of slot (who claimed it) and that node's agent epoch (verdict.c; internal) */
void tract_slot_owner_of(tract_region *r, uint32_t slot, struct tract_slot_owner *out);

/* observes node's agent epoch, line 0 of its entry (verdict.c; internal) */
uint64_t tract_node_epoch(tract_region *r, uint32_t node);

/* frees slots an eviction took out of the index, known[i] their owner then:
 * a dead host's are left to its sweep; forgets them in the journal once its
 * locks are held (alloc.c; internal) */
int tract_free_evicted(tract_region *r, const uint32_t *slots, const struct tract_slot_owner *known,
		       uint32_t n, uint64_t timeout_ns);

/* a dead host's slots: returned by its recovery, and the node's free list
 * dropped when it comes back (alloc.c; internal) */
int tract_alloc_sweep_dead(tract_region *r, uint32_t node, uint64_t dead_epoch,
			   const uint8_t *referenced, uint64_t *returned, uint64_t *owned,
			   uint64_t timeout_ns);
int tract_alloc_rejoin(tract_region *r, uint64_t prev_epoch, const void *line0,
		       uint64_t *dropped, uint64_t *pins, uint64_t timeout_ns);

/* forgets, in the node's dead processes' journals, their pins and the bare
 * slots keep does not keep (journal.c; internal) */
void tract_journal_void_dead(tract_region *r, int (*keep)(tract_region *, uint32_t, void *),
			     void *arg, uint64_t *pins);

/* marks (a bit per slot) every slot a READY bucket names, every slot an
 * object-directory entry overlaps, and every slot a handoff record of node
 * names (index_recover.c, objdir.c, handoff.c; internal) */
void tract_index_mark_slots(tract_region *r, uint8_t *bits);
void tract_obj_mark_slots(tract_region *r, uint8_t *bits);
void tract_handoff_mark_slots(tract_region *r, uint32_t node, uint8_t *bits);

/* records steps of a dead node's recovery in its verdict (verdict.c; internal) */
int tract_node_verdict_record(tract_region *r, uint32_t node, uint64_t dead_epoch,
			      uint32_t steps);

/*
 * Mutation sites (tests/mutation.py): every flush and invalidate of the
 * lock, publish and pin paths has a name here.  TRACT_MUTANT=<site> (read
 * once, at CPU detection, like the other TRACT_* overrides) removes exactly
 * that one, so the tests under the non-coherence simulator can show they
 * catch its absence.  0 (the default) removes nothing.
 */
enum tract_site {
	SITE_NONE = 0,
	SITE_LOCK_OBSERVE_SEQ,          /* acquire: invalidate the own slot before its seq */
	SITE_LOCK_PUBLISH_WAITING,      /* acquire: flush the WAITING request */
	SITE_LOCK_OBSERVE_GRANT,        /* acquire: invalidate the manager line while waiting */
	SITE_LOCK_PUBLISH_LOCKED,       /* acquire: flush LOCKED */
	SITE_LOCK_OBSERVE_RELEASE,      /* release: invalidate the own slot */
	SITE_LOCK_PUBLISH_IDLE,         /* release: flush IDLE */
	SITE_MGR_OBSERVE_SLOTS,         /* manager: invalidate the node slots before a scan */
	SITE_MGR_PUBLISH_GRANT,         /* manager: flush a grant */
	SITE_INDEX_OBSERVE_LINE,        /* stripe section: invalidate a line on first read */
	SITE_INDEX_PREFETCH,            /* lookup, unpin, eviction: invalidate home buckets and pin lines */
	SITE_INDEX_OBSERVE_ANCHOR,      /* stripe enter: invalidate the LRU anchor */
	SITE_INDEX_FLUSH_SECTION,       /* stripe leave: flush the lines the section wrote */
	SITE_INDEX_PUBLISH_ANCHOR,      /* stripe leave: flush the LRU anchor */
	SITE_HANDOFF_PUBLISH_RECORD,    /* handoff record: flush */
	SITE_HANDOFF_OBSERVE_RECORD,    /* handoff record: invalidate */
	SITE_LOCK_OBSERVE_CLAIMS,       /* acquire: invalidate the manager claims after LOCKED */
	SITE_MGR_OBSERVE_CLAIMS,        /* manager: invalidate the claims before a scan */
	SITE_MGR_OBSERVE_ADOPT,         /* manager start: invalidate the lock table to adopt */
	SITE_PAYLOAD_EVICT,             /* payload read: evict a slot the ledger does not vouch for */
	SITE_INDEX_CLAIM_EPOCH,         /* claim: a new epoch for the bucket (a new payload tag) */
	SITE_PAYLOAD_SWEEP_EVICT,       /* payload sweep: evict a dead payload's slot */
	SITE_PAYLOAD_SWEEP_LIVE,        /* payload sweep: spare a slot whose payload lives */
	SITE_PAYLOAD_FORGET,            /* slot write: the ledger stops vouching for the slot */
	SITE_MGR_WALK_ORDER,            /* manager: a walk's request waits for the one below it */
	SITE_COUNT
};

/* the stripe requests a walk keeps pending at most (index_internal.h), and how
 * many this process keeps (TRACT_WALK_AHEAD, set once at CPU detection) (internal) */
#define TRACT_WALK_AHEAD_MAX 32
extern uint32_t tract_walk_ahead;

/* the site TRACT_MUTANT removes (0: none), set once at CPU detection (internal) */
extern int tract_mutant;
#define TRACT_KEEP(site) ((site) == SITE_NONE || tract_mutant != (site))

/* the death point of this process (tests; enum tract_die_point in tract.h) */
extern int tract_die_point;
extern long tract_die_skip;
static inline void tract_maybe_die(int point)
{
	if (__builtin_expect(tract_die_point == point, 0) &&
	    __atomic_fetch_sub(&tract_die_skip, 1, __ATOMIC_RELAXED) <= 0)
		raise(SIGKILL);
}

/* invalidates, fences and loads one line (site: see enum tract_site) (internal) */
static inline void tract_observe_line_at(tract_region *r, uint64_t off, void *dst, int site)
{
	if (TRACT_KEEP(site))
		r->ops->invalidate(r, off, TRACT_LINE);
	r->ops->fence(r);
	r->ops->load(r, off, dst, TRACT_LINE);
}

static inline void tract_observe_line(tract_region *r, uint64_t off, void *dst)
{
	tract_observe_line_at(r, off, dst, SITE_NONE);
}

/* stores one whole line and flushes it; the caller fences once (internal) */
static inline void tract_write_line_at(tract_region *r, uint64_t off, const void *src, int site)
{
	r->ops->store(r, off, src, TRACT_LINE);
	if (TRACT_KEEP(site))
		r->ops->flush(r, off, TRACT_LINE);
}

static inline void tract_write_line(tract_region *r, uint64_t off, const void *src)
{
	tract_write_line_at(r, off, src, SITE_NONE);
}

/* publishes one whole line: store, flush, fence (internal) */
static inline void tract_publish_line_at(tract_region *r, uint64_t off, const void *src, int site)
{
	tract_write_line_at(r, off, src, site);
	r->ops->fence(r);
}

static inline void tract_publish_line(tract_region *r, uint64_t off, const void *src)
{
	tract_publish_line_at(r, off, src, SITE_NONE);
}

/* a handoff's blocks to give back: its key list in the region (keys_offset,
 * n entries), a copy of the entries' keys, and the node that pins them */
struct tract_release {
	uint64_t keys_offset;
	uint32_t n;
	uint32_t owner;
	const uint8_t *keys;
};

/* gives back a handoff's pins stripe group by stripe group, resuming after
 * `done` groups and recording each group's progress with mark once its pins
 * are given back (internal; index_pin.c) */
int tract_index_release_groups(tract_region *r, const struct tract_release *rel, uint32_t done,
			       void (*mark)(tract_region *, void *, uint32_t), void *arg,
			       uint64_t timeout_ns);

/* gives back up to *journaled of this node's pins on key, forgetting them
 * (*journaled = 0, a dead process's journal entry) once the stripe lock is
 * held (internal) */
int tract_index_release_pins(tract_region *r, const uint8_t *key, uint32_t *journaled,
			     uint32_t *released, uint64_t timeout_ns);

/* drops a dead pid's PENDING claim on key, freeing slot (internal) */
int tract_index_drop_claim(tract_region *r, const uint8_t *key, uint32_t pid, uint32_t slot,
			   int *freed, uint64_t timeout_ns);

/* frees slots (known: who owned each when an eviction took it out of the
 * index, as tract_free_evicted; NULL: read at the free), calling note(arg)
 * once every lock is held, right before; *moved (NULL: not wanted) gets how
 * many changed hands, a dead host's left to its sweep not counted (internal) */
int tract_free_noted(tract_region *r, const uint32_t *slots, const struct tract_slot_owner *known,
		     uint32_t n, void (*note)(tract_region *, void *), void *arg, uint32_t *moved,
		     uint64_t timeout_ns);

/* takes lock id from a dead holder of this node: TRACT_RECOVERED (held now,
 * its grant kept: repair, then release), or withdraws its request (lock.c) (internal) */
int tract_lock_take_dead(tract_region *r, uint32_t id, int *withdrawn);

/* recovery of lock 0: alloc_mu, then the lock, then the allocator's repair (alloc.c) (internal) */
int tract_alloc_recover_lock(tract_region *r, uint32_t id, int *withdrawn);

/* tract_alloc for the core's callers that hand the slots on (a claim, a
 * handoff record): each slot is journaled as this process's bare slot before
 * it leaves the free list, so a death after the pop leaks nothing; and
 * settling what a process that died holding alloc_mu left (alloc.c) (internal) */
int tract_alloc_journaled(tract_region *r, uint32_t n, uint32_t *out, uint64_t timeout_ns);
int tract_alloc_settle(tract_region *r, uint64_t timeout_ns);


/* the journal's dead entries, for recovery (journal.c) (internal) */
struct tract_journal_proc *tract_journal_next_dead(tract_region *r, uint32_t *cursor);
struct tract_journal_key *tract_journal_first(struct tract_journal_proc *p, uint32_t *pos);
void tract_journal_erase(struct tract_journal_proc *p, uint32_t pos);
int tract_journal_retire(struct tract_journal_proc *p);
int tract_journal_claims_slot(const struct tract_journal_proc *p, uint32_t slot);
void tract_journal_void_bare(struct tract_journal_proc *p, uint32_t slot);
void tract_journal_void_listed(tract_region *r, const uint8_t *listed);

/* the index's geometry and its key rule, which every reader of the index
 * shares (index_*.c, audit.c): a key belongs to the stripe its high word's
 * bits 40.. name, and probes from its home (its low word, modulo the
 * stripe's size) onwards, wrapping inside the stripe (internal) */
static inline uint64_t tract_index_buckets(const tract_region *r)
{
	return tract_sec(r, TRACT_SEC_BUCKETS)->count;
}

static inline uint64_t tract_index_stripe_size(const tract_region *r)
{
	return tract_index_buckets(r) / r->hdr.index_stripes;
}

static inline uint32_t tract_key_stripe(const tract_region *r, const uint8_t *key)
{
	uint64_t hi;
	memcpy(&hi, key + 8, 8);
	return (uint32_t)((hi >> 40) & (r->hdr.index_stripes - 1));
}

static inline uint64_t tract_key_home(const tract_region *r, const uint8_t *key)
{
	uint64_t lo;
	memcpy(&lo, key, 8);
	return lo & (tract_index_stripe_size(r) - 1);
}

/* the per-process journal (journal.c) (internal) */
void tract_journal_open(tract_region *r);
void tract_journal_close(tract_region *r);
uint64_t tract_journal_size(void);
uint32_t tract_journal_pids_of(const struct tract_local_hdr *h, uint32_t *out, uint32_t cap);
void tract_journal_pins(tract_region *r, const uint8_t *keys, uint32_t n, int32_t dpins);
void tract_journal_move_begin(tract_region *r, const uint8_t *key, uint32_t lock_id,
			      uint64_t bucket, int dpins, uint16_t pins_before);
void tract_journal_move_apply(tract_region *r, const uint8_t *key, int dpins);
void tract_journal_move_end(tract_region *r);
int tract_journal_move_resolve(tract_region *r, uint32_t lock_id,
			       int (*count)(void *ctx, uint64_t bucket), void *ctx);
int tract_journal_move_untold(const struct tract_journal_proc *p, uint32_t *lock_id);
void tract_journal_move_settle(struct tract_journal_proc *p);
int tract_index_visit_stripe(tract_region *r, uint32_t lock_id, uint64_t timeout_ns);
void tract_journal_claims(tract_region *r, const uint8_t *keys, uint32_t n, const uint8_t *status,
			  uint8_t claimed, const uint32_t *slots, int forget);
void tract_journal_slots(tract_region *r, const uint32_t *slots, uint32_t n, int forget);
void tract_journal_evicted(tract_region *r, const uint32_t *slots,
			   const struct tract_slot_owner *owners, uint32_t n, int forget);
void tract_journal_evicted_owner(const struct tract_journal_key *k, struct tract_slot_owner *out);

/* the payload ledger's entries, one u64 per slot (payload.c) (internal) */
static inline uint64_t *tract_ledger(const tract_region *r)
{
	return (uint64_t *)((uint8_t *)r->local + r->local->ledger_off);
}

/* the ledger forgets the slots a range of this node's loads or stores
 * touches (payload.c); 0 if the handle has no ledger (internal) */
int tract_payload_forget_range(tract_region *r, uint64_t off, uint64_t len);

/* true if slot still holds the READY payload of that tag, by a lock-free
 * observe of its bucket (observe = 0: a plain load, a hint) (index.c) (internal) */
int tract_index_tag_live(tract_region *r, uint64_t tag, uint32_t slot, int observe);

/* reflected CRC-32 of a buffer with a given polynomial, bit by bit (internal) */
uint32_t tract_crc_bitwise(uint32_t poly, const void *buf, uint64_t len);

/* copies n bytes advancing the CRC-32C register over them; flush_mode < 0:
 * plain stores, else streaming ones into the region (crc.c) (internal) */
uint32_t tract_crc32c_copy(uint32_t reg, void *dst, const void *src, uint64_t n, int flush_mode);

/* util.c: used by every part, owned by none (internal) */
/* CLOCK_REALTIME in ns */
uint64_t tract_now_ns(void);
/* CLOCK_MONOTONIC in ns */
uint64_t tract_mono_ns(void);
/* waits politely: spins first, then yields, then sleeps up to max_ns */
void tract_backoff(uint32_t *round, uint64_t max_sleep_ns);
void tract_backoff_end(void);
/* TRACT_E_SYS with errno set to a pthread return code */
int tract_sys_error(int pthread_rc);
/* initializes a robust, process-shared mutex */
int tract_robust_init(pthread_mutex_t *mu);
/* locks a robust mutex within timeout_ns, recovering a dead owner
 * (TRACT_RECOVERED: taken, and its last owner died holding it) */
int tract_robust_lock(pthread_mutex_t *mu, uint64_t timeout_ns);
/* whether pid (of this host) is gone */
int tract_pid_dead(uint32_t pid);

/* true if [off, off+n) lies inside the region (internal) */
static inline int tract_in_bounds(const tract_region *r, uint64_t off, uint64_t n)
{
	return off <= r->size && n <= r->size - off;
}

/* plain accessor table for a flush mode, or NULL if unknown (internal) */
const struct tract_ops *tract_plain_ops(int flush_mode);

/* simulator accessor table (internal) */
extern const struct tract_ops tract_sim_ops;

/* creates simulator state for a region (internal) */
int tract_sim_create(tract_region *r);

/* the private simulated cache's payload ledger, or NULL (sim.c) (internal) */
uint64_t *tract_sim_ledger(tract_region *r);

/* bytes of, and initialization of, a node's simulated cache in its local
 * segment; moving a handle onto it (sim.c) (internal) */
uint64_t tract_sim_cache_size(void);
int tract_sim_cache_init(void *mem);
void tract_sim_bind(tract_region *r, void *cache);
void tract_sim_flush_node(tract_region *r, void *cache);

/* frees simulator state (internal) */
void tract_sim_destroy(tract_region *r);

/* the byte count above which block copies use non-temporal stores (cpu.c;
 * TRACT_MOVNT_THRESHOLD, tract_set_movnt_threshold) (internal) */
uint64_t tract_movnt_threshold(void);

/* set once at CPU detection from TRACT_STRICT_PAYLOAD (cpu.c) (internal) */
extern int tract_strict_payload;
int tract_payload_strict(void);

/* evicts lines that cannot be dirty in this host's caches (payload that was
 * written back before READY; metadata read under the lock its writers hold,
 * whose previous holder flushed it): clflushopt where the CPU has it, one
 * fence by the caller (access.c) (internal) */
void tract_evict_clean(tract_region *r, uint64_t off, uint64_t n);

/* writes a zero-copy writer's payload back to the device before READY (copy.c) (internal) */
void tract_write_back_payload(tract_region *r, uint64_t off, uint64_t len);

/* the flush-line primitive of a mode, used by the simulator and copies (internal) */
void tract_flush_lines(int flush_mode, const uint8_t *p, uint64_t n);

#endif
