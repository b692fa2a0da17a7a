/*
 * format.h -- on-media structures of the sections (internal).
 *
 * Every structure here is a whole number of 64-byte lines and every line
 * has exactly one writer at a time (the rule of docs/FORMAT.md §1).  The
 * all-zero state of every section is its initial state, so formatting a
 * section is zeroing it.  Links between entries are index + 1 (0 = none).
 * The structs and enums are in CDEF blocks (native/build_ffi.py): Python
 * sees their compiled layout, and tract_cli/core/media.py checks its
 * mirrors of them against it at import.
 */
#ifndef TRACT_FORMAT_H
#define TRACT_FORMAT_H

#include <assert.h>
#include <stdint.h>

#include "tract.h"

#define TRACT_MAGIC "TRACTPOL"

/* lock table: per lock, line 0 is written only by the lock manager,
 * line 1 + n only by node n. */
/* CDEF-BEGIN (for Python too: tract_cli/core/media.py) */
struct tract_lock_manager_line {
	uint32_t granted_node; /* node + 1 holding the grant, 0 = none */
	uint32_t last_node;    /* node + 1 granted last (round-robin cursor) */
	uint64_t grant_seq;    /* grants issued for this lock */
	uint64_t grant_ns;     /* CLOCK_REALTIME of the current grant */
	uint64_t granted_req;  /* the granted node's request_seq this grant answers */
	uint64_t token;        /* fencing token of the manager that wrote the line */
	uint32_t inherited;    /* node + 1 of a dead host this grant takes the lock
				* over from: its grantee repairs what the lock
				* protects before its own section (0 = none) */
	uint32_t reserved0;
	uint8_t reserved[16];
};
/* CDEF-END */

/* CDEF-BEGIN (for Python too: tract_cli/core/media.py) */
struct tract_lock_node_slot {
	uint32_t state;        /* TRACT_LOCK_IDLE / WAITING / LOCKED */
	uint32_t pid;          /* holder or requester pid on that node */
	uint64_t epoch;        /* node agent epoch when written */
	uint64_t request_seq;  /* incremented by the node for every request */
	uint64_t since_ns;     /* CLOCK_REALTIME when state was entered */
	uint64_t grant_token;  /* LOCKED: the token of the grant it entered with */
	uint32_t after_lock;   /* WAITING, a request made ahead in a walk: lock id + 1
				* of the same walk's request just below it, which the
				* manager grants first (0 = none) */
	uint32_t reserved0;
	uint64_t after_req;    /* ... that request's request_seq */
	uint8_t reserved[8];
};
/* CDEF-END */

/* CDEF-BEGIN (the lock slot states, for Python too: native/build_ffi.py) */
enum {
	TRACT_LOCK_IDLE = 0,
	TRACT_LOCK_WAITING = 1,
	TRACT_LOCK_LOCKED = 2
};
/* CDEF-END */

/* a node's verdict, line 1 of its node-table entry: written only by the
 * current lock manager's agent, which declares a silent host dead and
 * recovers what it held (docs/PROTOCOLS.md §7). */
/* CDEF-BEGIN (for Python too: tract_cli/core/media.py) */
struct tract_node_verdict {
	uint64_t dead_epoch;   /* the node's agent epoch declared dead, 0 = never;
				* the node is dead while its entry's epoch is this */
	uint64_t declared_ns;  /* CLOCK_REALTIME of the declaration */
	uint64_t token;        /* fencing token of the manager that declared it */
	uint64_t heartbeat_ns; /* the node's last heartbeat, which stood still */
	uint32_t recovered;    /* TRACT_VERDICT_* steps of its recovery done */
	uint32_t reserved0;
	uint8_t reserved[24];
};
/* CDEF-END */

/* CDEF-BEGIN (the recovery steps a verdict records, for Python too) */
enum {
	TRACT_VERDICT_CLAIMS = 1,       /* its PENDING claims buried */
	TRACT_VERDICT_PINS = 2,         /* its pin counts zeroed (once no handoff record of it remains) */
	TRACT_VERDICT_SLOTS = 4         /* its unreferenced slots returned to the pool once (later
					 * passes return what others evict meanwhile) */
};
/* CDEF-END */

/* node table entry: line 0 written only by the node's agent, line 1 only by
 * the current lock manager's agent. */
/* CDEF-BEGIN (for Python too: tract_cli/core/media.py) */
struct tract_node_entry {
	uint32_t state;        /* TRACT_NODE_* (0 = never attached) */
	uint32_t agent_pid;
	uint64_t epoch;        /* incremented every time an agent starts */
	uint64_t heartbeat_ns; /* CLOCK_REALTIME of the last heartbeat */
	uint32_t flags;        /* TRACT_NODE_F_*: bit 0 runs the lock manager, bit 1
				* stands by to take it over, bit 2 started by a
				* worker (stops once its node is idle; advisory) */
	uint32_t manager_epoch; /* the node's manager claim, 0 = never claimed */
	uint64_t manager_heartbeat_ns;
	char hostname[24];
	struct tract_node_verdict verdict;   /* line 1 */
	uint8_t reserved[128]; /* two lines, reserved */
};
/* CDEF-END */

/* CDEF-BEGIN (the node entry's states and flags, for Python too: the agent
 * (tract_cli/core/agent.py) writes the entry, native/build_ffi.py) */
enum {
	TRACT_NODE_NEVER = 0,           /* never attached */
	TRACT_NODE_ALIVE = 1,
	TRACT_NODE_LEFT = 2
};
enum {
	TRACT_NODE_F_MANAGER = 1,       /* this agent runs the lock manager */
	TRACT_NODE_F_STANDBY = 2,       /* stands by to take the manager over */
	TRACT_NODE_F_AUTOSTOP = 4       /* started by a worker: stops once its node is idle */
};
/* CDEF-END */

/* object directory entry: written under the object-directory lock. */
/* CDEF-BEGIN (for Python too: tract_cli/core/media.py) */
struct tract_objdir_entry {
	char name[40];         /* NUL-padded; empty name = free entry */
	uint64_t offset;       /* region offset of the object */
	uint64_t size;         /* bytes */
	uint32_t seq;          /* bumped on every update */
	uint32_t flags;
};
/* CDEF-END */

/* allocator header: written under the allocator lock. */
/* CDEF-BEGIN (for Python too: tract_cli/core/media.py) */
struct tract_alloc_header {
	uint64_t used_slots;   /* slots with bitmap bit 1 (0 at format: all free) */
	uint64_t next_hint;    /* slot where the next claim scan starts */
	uint64_t claims;       /* batches claimed since format */
	uint64_t releases;     /* batches returned since format */
	/* a release of other nodes' slots in progress (docs/PROTOCOLS.md §5.2),
	 * its slots listed in the section's next lines: what a dead host's next
	 * holder of lock 0 finishes */
	uint16_t intent_n;     /* slots listed, 0 none */
	uint16_t intent_node;  /* node + 1 that releases them */
	uint8_t reserved[28];
};
/* CDEF-END */

/* prefix index bucket: written under its stripe's lock. */
/* CDEF-BEGIN (for Python too: tract_cli/core/media.py) */
struct tract_bucket {
	uint8_t key[16];
	uint32_t state;        /* TRACT_BUCKET_* */
	uint32_t slot;         /* slot id + 1, 0 = none */
	uint32_t tokens;
	uint32_t reserved;     /* 0 (format 3 kept the pins' total here) */
	uint32_t lru_prev;     /* bucket index + 1 within the stripe, 0 = none */
	uint32_t lru_next;
	uint16_t owner_node;
	uint16_t flags;
	uint32_t owner_pid;
	uint32_t epoch;
	uint32_t checksum;     /* CRC-32C of the payload, valid if TRACT_BUCKET_F_CHECKSUM */
	uint64_t last_access_ns;
};
/* CDEF-END */

/* CDEF-BEGIN (the bucket states and flags, for Python too: native/build_ffi.py) */
enum {
	TRACT_BUCKET_EMPTY = 0,
	TRACT_BUCKET_PENDING = 1,
	TRACT_BUCKET_READY = 2,
	TRACT_BUCKET_TOMBSTONE = 3
};
enum {
	TRACT_BUCKET_F_CHECKSUM = 1     /* flags: `checksum` holds the payload's CRC-32C */
};
/* CDEF-END */

/* LRU anchor, one per index stripe: written under the stripe's lock. */
/* CDEF-BEGIN (for Python too: tract_cli/core/media.py) */
struct tract_lru_anchor {
	uint32_t head;         /* most recently used, bucket index + 1 */
	uint32_t tail;         /* least recently used */
	uint64_t count;
	uint64_t hits;
	uint64_t inserts;
	uint64_t evictions;
	uint64_t lookups;
	/* a handoff release in this stripe's section: the key list whose
	 * entries of this stripe hold the owner's pin counts as they were when
	 * the section began (docs/PROTOCOLS.md §10); 0 none */
	uint64_t release_keys;     /* region offset of the key list */
	uint32_t release_blocks;   /* its entries */
	uint32_t release_owner;    /* node + 1 whose pins it gives back */
};
/* CDEF-END */

/* one entry of a handoff's key list (docs/FORMAT.md §4.8): written by the
 * publisher before its record exists, then only `released`, by the holder
 * of the entry's key's stripe lock during the release */
/* CDEF-BEGIN (for Python too: tests read the release states) */
struct tract_key_entry {
	uint8_t key[16];
	uint32_t slot;
	uint32_t checksum;
	uint32_t tokens;
	uint32_t released;     /* TRACT_KEY_* below */
};
enum {
	TRACT_KEY_HELD = 0,               /* pinned for the record */
	TRACT_KEY_GIVEN_BACK = 1,         /* its pin given back (set by a repair) */
	TRACT_KEY_INTENT = 0x80000000u    /* | the owner's pin count before the release's section */
};
/* CDEF-END */

/* handoff record: written under the transfer-table lock. */
/* CDEF-BEGIN (for Python too: tract_cli/core/media.py) */
struct tract_transfer_record {
	uint32_t state;        /* TRACT_TRANSFER_* */
	uint32_t owner_node;   /* node + 1 of the prefill side */
	uint32_t owner_pid;
	uint32_t block_count;
	uint8_t request_id[16];
	uint64_t token_count;
	uint64_t keys_offset;  /* region offset of the key list */
	uint32_t tail_slot;    /* slot id + 1 of the partial tail block, 0 = none */
	uint32_t tail_tokens;
	uint64_t created_ns;
	uint64_t expiry_ns;
	/* while ACKED or RECLAIMING: who gives the resources back, and how far
	 * it got (so a successor resumes instead of releasing twice) */
	uint32_t releaser_node;    /* node + 1, 0 = none */
	uint32_t releaser_pid;
	uint32_t released_groups;  /* stripe groups of the key list whose pins are given back */
	uint32_t slots_freed;      /* 1 once the key-list and tail slots are (being) freed */
	uint8_t reserved[40];
};
/* CDEF-END */

/* CDEF-BEGIN (the transfer record states, for Python too: native/build_ffi.py) */
enum {
	TRACT_TRANSFER_FREE = 0,
	TRACT_TRANSFER_PUBLISHED = 1,   /* its blocks pinned for the decode side */
	TRACT_TRANSFER_ACKED = 2,       /* acknowledged: its releaser gives them back */
	TRACT_TRANSFER_RECLAIMING = 3,  /* expired: its releaser gives them back */
	TRACT_TRANSFER_RESERVED = 4     /* taken by its owner for a request whose blocks it is
					 * still committing: published or given back by it (no
					 * key list, no pins; expiry_ns bounds it) */
};
/* CDEF-END */

/* the event log of an index stripe (docs/PROTOCOLS.md §13): line 0 is the
 * head, then `capacity` entry lines (the section's entry size / 64 - 1, a
 * power of two), event seq at line 1 + seq % capacity.  Written only under
 * the stripe's lock; read without a lock by any host. */
/* CDEF-BEGIN (for Python too: tract_cli/core/media.py) */
struct tract_event_head {
	uint64_t next_seq;     /* events appended to this stripe's log since format */
	uint8_t reserved[56];
};
struct tract_event {
	uint64_t seq;          /* the event's sequence number + 1; 0 never written;
				* TRACT_EVENT_WRITING while its line is rewritten */
	uint32_t kind;         /* TRACT_EVENT_* */
	uint32_t slot;         /* slot id + 1 of the block (its record's) */
	uint8_t key[16];
	uint16_t node;         /* the node that published (STORED) or evicted (REMOVED) it */
	uint16_t flags;
	uint32_t tokens;       /* the block's token count */
	uint64_t time_ns;      /* CLOCK_REALTIME of the change */
	uint32_t epoch;        /* the bucket's epoch (STORED: the payload's tag) */
	uint8_t reserved[12];
};
/* CDEF-END */

/* CDEF-BEGIN (the event kinds, for Python too: native/build_ffi.py) */
enum {
	TRACT_EVENT_STORED = 1,         /* the key turned READY */
	TRACT_EVENT_REMOVED = 2         /* the key's READY bucket was evicted */
};
/* CDEF-END */
#define TRACT_EVENT_WRITING UINT64_MAX

/* a slot's block record (docs/FORMAT.md §4.10): what a KV event says of the
 * block in it, written by the block's writer before it turns READY; token ids
 * (u32, block_tokens of them, zero-padded to a line) follow these three lines.
 * A reader trusts it only while `key` reads the event's key before and after
 * (the writer zeroes `key` before it rewrites the rest). */
/* CDEF-BEGIN (for Python too: tract_cli/core/media.py) */
struct tract_block_record {
	uint8_t key[16];       /* the block's key; zero while rewritten */
	uint8_t tag[16];       /* the writer's model tag (0: none given) */
	uint8_t hash[32];      /* the block's hash as its scheme made it, untagged
				* (the tract scheme's 16 bytes, zero-padded) */
	uint8_t parent[32];    /* its parent's hash, valid with TRACT_RECORD_PARENT */
	uint32_t n_tokens;     /* token ids that follow (0: none given) */
	uint16_t node;         /* the writer's node */
	uint16_t flags;        /* TRACT_RECORD_* */
	uint64_t written_ns;
	uint8_t reserved[16];
	/* line 2: the request's cache salt (UTF-8), on a prompt's first block of
	 * a salted request (vLLM's extra keys of that block), else empty */
	uint32_t salt_len;
	uint8_t salt[60];
};
/* CDEF-END */

/* CDEF-BEGIN (the record flags, for Python too) */
enum {
	TRACT_RECORD_PARENT = 1,        /* `parent` holds the parent block's hash */
	TRACT_RECORD_PARTIAL = 2,       /* a partial block (a handoff's tail): not a prefix block */
	TRACT_RECORD_GIVEN = 4          /* written from a caller's description (else key only) */
};
/* CDEF-END */

/* bytes of a slot's record: three lines and its token ids, whole lines */
static inline uint64_t tract_record_size(uint32_t block_tokens)
{
	return 192 + (((uint64_t)block_tokens * 4 + 63) & ~(uint64_t)63);
}

/* the most entries a stripe's event log holds (its bucket count, up to this:
 * the log's entry size stays far below 2^32, and 65536 events a stripe is a
 * turnover of a million slots at 16 stripes) */
#define TRACT_EVENT_LOG_MAX 65536u

static_assert(sizeof(struct tract_header) == TRACT_HEADER_SIZE, "header size");
static_assert(sizeof(struct tract_section) == 32, "section entry size");
static_assert(sizeof(struct tract_lock_manager_line) == 64, "lock manager line");
static_assert(sizeof(struct tract_lock_node_slot) == 64, "lock node slot");
static_assert(sizeof(struct tract_node_entry) == TRACT_NODE_ENTRY_SIZE, "node entry");
static_assert(sizeof(struct tract_node_verdict) == 64, "node verdict");
static_assert(offsetof(struct tract_node_entry, verdict) == 64, "verdict is line 1");
static_assert(sizeof(struct tract_objdir_entry) == 64, "objdir entry");
static_assert(sizeof(struct tract_alloc_header) == 64, "alloc header");
static_assert(sizeof(struct tract_bucket) == 64, "bucket");
static_assert(sizeof(struct tract_lru_anchor) == 64, "lru anchor");
static_assert(sizeof(struct tract_transfer_record) == TRACT_TRANSFER_ENTRY_SIZE, "transfer record");
static_assert(sizeof(struct tract_key_entry) == TRACT_KEY_ENTRY_SIZE, "key list entry");
static_assert(sizeof(struct tract_event_head) == 64, "event head");
static_assert(sizeof(struct tract_event) == 64, "event");
static_assert(sizeof(struct tract_block_record) == 192, "block record");

#endif
