/*
 * tract.h -- public interface of the TraCT C core.
 *
 * The C core is the single source of truth for the on-media format
 * (docs/FORMAT.md describes the same bytes for independent readers).
 * Everything in the region is addressed by offset from the region base.
 *
 * The block between CDEF-BEGIN and CDEF-END is fed verbatim to cffi's
 * cdef() by native/build_ffi.py, so it must stay free of preprocessor
 * directives and expressions cffi cannot parse.  tests/test_native_api.py
 * checks that the header and the compiled module agree.
 */
#ifndef TRACT_H
#define TRACT_H

#include <stddef.h>
#include <stdint.h>

/* on-media structures (format.h) the API names (cffi reads them there first) */
struct tract_block_record;
struct tract_event;

/* CDEF-BEGIN */

/* ---- error codes: every fallible function returns one (0 = ok) ---- */
enum {
	TRACT_OK = 0,
	TRACT_E_INVAL = -1,          /* an argument is out of its valid range */
	TRACT_E_RANGE = -2,          /* an offset or length is outside the region */
	TRACT_E_NOT_FORMATTED = -3,  /* no TraCT magic at offset 0 */
	TRACT_E_VERSION = -4,        /* TraCT magic, unknown format version */
	TRACT_E_CHECKSUM = -5,       /* header checksum does not match */
	TRACT_E_SIZE = -6,           /* header region size != mapped size */
	TRACT_E_LAYOUT = -7,         /* layout table is inconsistent */
	TRACT_E_TOO_SMALL = -8,      /* size cannot hold metadata + one slot */
	TRACT_E_ALIGN = -9,          /* size or offset not a multiple of the alignment */
	TRACT_E_FLUSH_UNSUPPORTED = -10, /* the CPU lacks the flush instruction */
	TRACT_E_NOMEM = -11,         /* process-local allocation failed */
	TRACT_E_SYS = -12,           /* a system call failed; see errno */
	TRACT_E_TIMEOUT = -13,       /* a bounded wait ran out */
	TRACT_E_NO_LOCAL = -14,      /* no node-local segment bound to the handle */
	TRACT_E_NOT_HELD = -15,      /* releasing a lock this process does not hold */
	TRACT_E_FULL = -16,          /* no free slot / directory entry left */
	TRACT_E_NOT_FOUND = -17,     /* no such named object */
	TRACT_E_CORRUPT = -18,       /* region metadata fails a consistency check */
	TRACT_E_TABLE_FULL = -19,    /* the transfer table has no free record */
	TRACT_E_SUPERSEDED = -20,    /* another node holds a later lock-manager claim */
	TRACT_E_TOO_LARGE = -21,     /* more slots asked for than the whole pool has */
	TRACT_E_ALIVE = -22,         /* the node heartbeat or restarted: not (or no longer) dead */
	TRACT_E_PENDING = -23,       /* a handoff record is reserved: its owner publishes it soon */
	TRACT_RECOVERED = 1          /* acquired, after recovering from a dead holder */
};

/* ---- format constants ---- */
enum {
	TRACT_FORMAT_VERSION = 9,
	TRACT_HEADER_SIZE = 4096,
	TRACT_LINE = 64,
	TRACT_MAX_SECTIONS = 16,
	TRACT_MAX_NODES = 64,
	TRACT_NODE_ENTRY_SIZE = 256,
	TRACT_OBJDIR_ENTRIES = 64,
	TRACT_TRANSFER_ENTRY_SIZE = 128,
	TRACT_FIXED_LOCKS = 3        /* allocator, object directory, transfer table */
};

/* the limits a handoff's key list lives within: a slot (block) holds at most
 * 2^TRACT_MAX_BLOCK_SHIFT bytes (tract_format_params), and a key list is one
 * slot of TRACT_KEY_ENTRY_SIZE-byte entries (key, slot, checksum, tokens,
 * release state) */
enum {
	TRACT_MAX_BLOCK_SHIFT = 32,
	TRACT_KEY_ENTRY_SIZE = 32
};

/* the allocator section: its header line, then the slot list of a release
 * intent (u32 slots, 16 a line): one page, which the section's alignment
 * reserved anyway */
enum {
	TRACT_ALLOC_LINES = 64,
	TRACT_ALLOC_INTENT_CAP = (TRACT_ALLOC_LINES - 1) * 16
};

/* the ids of the fixed locks; index stripe s has lock TRACT_FIXED_LOCKS + s */
enum {
	TRACT_LOCK_ALLOCATOR = 0,    /* the allocator: bitmap, owner map, header (alloc.c) */
	TRACT_LOCK_OBJDIR = 1,       /* the object directory (objdir.c) */
	TRACT_LOCK_TRANSFER = 2      /* the transfer table of the handoffs (handoff.c) */
};

/* section kinds of the layout table */
enum {
	TRACT_SEC_LOCKS = 1,       /* per lock: manager line + one line per node */
	TRACT_SEC_NODES = 2,       /* per node: 256-byte entry */
	TRACT_SEC_OBJDIR = 3,      /* named roots, one line each */
	TRACT_SEC_ALLOC = 4,       /* allocator header line, then its release intent's slot list */
	TRACT_SEC_BITMAP = 5,      /* one bit per slot, 1 = taken from the pool */
	TRACT_SEC_OWNERS = 6,      /* one byte per slot: claiming node + 1, 0 = none */
	TRACT_SEC_BUCKETS = 7,     /* prefix index buckets, one line each */
	TRACT_SEC_PINS = 8,        /* per node: u16 pin count per bucket */
	TRACT_SEC_LRU = 9,         /* per stripe: LRU anchor line */
	TRACT_SEC_TRANSFER = 10,   /* handoff records, 128 bytes each */
	TRACT_SEC_EVENTS = 11,     /* per stripe: its event log (head line, then entry lines) */
	TRACT_SEC_RECORDS = 12,    /* per slot: its block's record (key, hashes, token ids) */
	TRACT_SEC_DATA = 13        /* block slots */
};

/* the sections of a region; the layout table lists them in kind order, which
 * is also their order in the region (the data area last) */
enum { TRACT_SECTION_COUNT = 13 };

/* flush modes (header field and per-process override) */
enum {
	TRACT_FLUSH_NONE = 0,
	TRACT_FLUSH_CLFLUSH = 1,
	TRACT_FLUSH_CLFLUSHOPT = 2,
	TRACT_FLUSH_CLWB = 3
};

/* KV element types */
enum {
	TRACT_DTYPE_F16 = 1,
	TRACT_DTYPE_BF16 = 2,
	TRACT_DTYPE_F32 = 3,
	TRACT_DTYPE_FP8 = 4
};

/* block-hash schemes recorded in the header */
enum {
	TRACT_HASH_TRACT = 1,
	TRACT_HASH_VLLM_SHA256_CBOR = 2
};

/* CPU feature bits reported by tract_cpu_features() */
enum {
	TRACT_CPU_CLFLUSH = 1,
	TRACT_CPU_CLFLUSHOPT = 2,
	TRACT_CPU_CLWB = 4,
	TRACT_CPU_AVX2 = 8,
	TRACT_CPU_AVX512F = 16,
	TRACT_CPU_HYPERVISOR = 32,
	TRACT_CPU_X86_64 = 64,
	TRACT_CPU_SSE42 = 128,
	TRACT_CPU_PCLMUL = 256,       /* carry-less multiply (the CRC's folding) */
	TRACT_CPU_VPCLMUL512 = 512,   /* its 512-bit form, with AVX-512F/BW */
	TRACT_CPU_VPCLMUL256 = 1024   /* its 256-bit form, with AVX2 (the fold where AVX-512's is not) */
};

/* attach flags */
enum {
	TRACT_ATTACH_SIMULATE = 1,   /* run accessors against the non-coherence simulator */
	TRACT_ATTACH_READONLY = 2    /* the mapping is read-only: stores are refused */
};

/* header flags (header.flags, chosen at format time) */
enum {
	TRACT_HDR_ZERO_ON_FREE = 1,  /* freed slots are zeroed before reuse (tenant isolation) */
	TRACT_HDR_KNOWN_FLAGS = 1
};

/* one layout-table entry (32 bytes on media) */
struct tract_section {
	uint32_t kind;
	uint32_t entry_size;
	uint64_t offset;
	uint64_t length;
	uint64_t count;
};

/* format parameters chosen at init time */
/* what tract_layout_compute takes for index_stripes or transfer_entries 0 */
enum {
	TRACT_DEFAULT_INDEX_STRIPES = 16,
	TRACT_DEFAULT_TRANSFER_ENTRIES = 1024
};

struct tract_format_params {
	uint64_t region_size;
	uint64_t alignment;
	uint32_t max_nodes;
	uint32_t flush_mode;
	uint32_t block_tokens;
	uint32_t num_layers;
	uint32_t num_kv_heads;
	uint32_t head_dim;
	uint32_t dtype;
	uint32_t dtype_bytes;
	uint32_t hash_scheme;
	uint32_t index_stripes;
	uint32_t transfer_entries;
	uint32_t flags;              /* TRACT_HDR_* */
	uint8_t uuid[16];
	uint8_t hash_seed[16];
	uint8_t model_fingerprint[32];
	char model_name[32];
	uint64_t created_ns;
};

/* the header at offset 0 (4096 bytes, little-endian) */
struct tract_header {
	uint8_t magic[8];
	uint32_t format_version;
	uint32_t header_size;
	uint8_t uuid[16];
	uint64_t region_size;
	uint64_t alignment;
	uint32_t flush_mode;
	uint32_t max_nodes;
	uint64_t created_ns;
	uint32_t block_tokens;
	uint32_t num_layers;
	uint32_t num_kv_heads;
	uint32_t head_dim;
	uint32_t dtype;
	uint32_t dtype_bytes;
	uint64_t bytes_per_token;
	uint64_t block_bytes;
	uint64_t slot_stride;
	uint64_t slot_count;
	uint64_t reserved1;
	uint8_t model_fingerprint[32];
	char model_name[32];
	uint32_t hash_scheme;
	uint32_t reserved2;
	uint8_t hash_seed[16];
	uint32_t index_stripes;
	uint32_t lock_count;
	uint32_t section_count;
	uint32_t flags;
	uint8_t reserved3[24];
	struct tract_section sections[16];
	uint8_t reserved4[3320];
	uint32_t header_crc32;
	uint32_t reserved5;
};

typedef struct tract_region tract_region;

/* ---- CPU and process configuration ---- */

/* Returns the TRACT_CPU_* bits of this CPU (detected once). */
uint32_t tract_cpu_features(void);

/* 1 if this CPU can run the region accessors in flush_mode (TRACT_FLUSH_*):
 * the one rule, which attach applies and Python asks (core/native.py) */
int tract_flush_mode_supported(int flush_mode);

/* Sets the non-temporal threshold (tests); 0 restores the default. */
void tract_set_movnt_threshold(uint64_t bytes);

/* How many stripe lock requests an index walk of this process keeps ahead
 * (1..32, clamped; TRACT_WALK_AHEAD sets it at start, default 32): 1 is the
 * one-ahead walk of format 7, the benchmarks' reference.  Returns it. */
uint32_t tract_set_walk_ahead(uint32_t n);

/* ---- layout and format ---- */

/* Bytes per element of a TRACT_DTYPE_*, 0 if unknown (the one table; Python reads it). */
uint32_t tract_dtype_size(uint32_t dtype);

/* Computes the layout of a region without touching memory. */
int tract_layout_compute(const struct tract_format_params *p,
			 struct tract_section *out, uint32_t *out_count,
			 uint64_t *out_slot_count, uint32_t *out_lock_count);

/* Formats the mapped region at base: writes metadata sections, then the header. */
int tract_format(void *base, const struct tract_format_params *p);

/* Checks the header at base against the mapped size; fills *out on success. */
int tract_verify_header(const void *base, uint64_t mapped_size, struct tract_header *out);

/* CRC-32 (IEEE 802.3, as zlib) of a buffer. */
uint32_t tract_crc32(const void *buf, size_t len);

/* ---- attach / detach ---- */

/* Attaches to a formatted region mapped at base; flush_mode < 0 uses the header's. */
int tract_attach(void *base, uint64_t mapped_size, int flush_mode, uint32_t flags,
		 uint32_t node_id, tract_region **out);

/* Releases a handle from tract_attach (the mapping itself is not unmapped). */
void tract_detach(tract_region *r);

/* Returns the flush mode the handle runs with. */
int tract_region_flush_mode(const tract_region *r);

/* Returns the name of the accessor table in use ("clflush", "sim+clflush", ...). */
const char *tract_region_ops_name(const tract_region *r);

/* Configures the simulator: random eviction probability in 1/2^32 units, rng seed. */
int tract_sim_configure(tract_region *r, uint32_t evict_prob_u32, uint64_t seed);

/* Returns simulator counters: hits, misses, writebacks, evictions (4 values). */
int tract_sim_stats(const tract_region *r, uint64_t *out4);

/* Pre-faults [0, len) of a mapping so first requests do not pay page faults. */
int tract_prefault(void *base, uint64_t len, int writable);

/* ---- the access discipline (metadata) ---- */

/* Plain store of a u64 (stays in this host's cache until flushed). */
int tract_store_u64(tract_region *r, uint64_t off, uint64_t v);

/* Plain load of a u64 (may return a stale cached line). */
int tract_load_u64(tract_region *r, uint64_t off, uint64_t *out);

/* Publish: store, flush the line, fence. */
int tract_publish_u64(tract_region *r, uint64_t off, uint64_t v);

/* Observe: invalidate the line, fence, load. */
int tract_observe_u64(tract_region *r, uint64_t off, uint64_t *out);

/* Publish len bytes: store them, flush every touched line, fence once. */
int tract_publish(tract_region *r, uint64_t off, const void *src, uint64_t len);

/* Observe len bytes: invalidate every touched line, fence once, load. */
int tract_observe(tract_region *r, uint64_t off, void *dst, uint64_t len);

/* Writes back (and, except for clwb, evicts) every line of a range. */
int tract_flush_range(tract_region *r, uint64_t off, uint64_t len);

/* Evicts every line of a range so the next load reads the device. */
int tract_invalidate_range(tract_region *r, uint64_t off, uint64_t len);

/* Orders all earlier flushes and stores before later loads and stores. */
void tract_fence(tract_region *r);

/* ---- payload (KV bytes) ---- */

/* Copies len bytes from private memory into the region (NT stores above threshold). */
int tract_copy_in(tract_region *r, uint64_t dst_off, const void *src, uint64_t len);

/* Copies len bytes from the region into private memory; evicts the range first
 * if asked (and the node's payload ledger forgets the slots it touches); without
 * invalidate, the caller made the range safe with tract_payload_acquire. */
int tract_copy_out(tract_region *r, void *dst, uint64_t src_off, uint64_t len, int invalidate);

/* Makes n slots safe to load from for payloads tags[i] (from a lookup; 0 or
 * NULL: unknown): evicts only the slots whose lines this node's caches may
 * hold of another payload (the payload ledger), one fence; *evicted (may be
 * NULL) gets how many were evicted.  The caller holds pins on the payloads. */
int tract_payload_acquire(tract_region *r, const uint32_t *slots, const uint64_t *tags,
			  uint32_t n, uint32_t *evicted);

/* Evicts, off the request path, slots whose payload this node may cache and
 * that has died (or that are free), so the first read of their next payload
 * evicts nothing: visits up to max_slots from *cursor (advanced), evicts at
 * most max_bytes; *swept (may be NULL) gets how many were evicted.  The node
 * agent calls it every heartbeat. */
int tract_payload_sweep(tract_region *r, uint32_t *cursor, uint32_t max_slots, uint64_t max_bytes,
			uint32_t *swept);

/* The node's ledger stops vouching for n slots (0: unknown): for a reader
 * that may have loaded them after its pin or handoff was gone (an expired
 * handoff acknowledged too late), whose lines could be stale for the slots'
 * next payloads. */
int tract_payload_forget(tract_region *r, const uint32_t *slots, uint32_t n);

/* The payload tag the node's ledger holds for a slot (0: none or unknown;
 * TRACT_LEDGER_EVICTED: no line of the slot is cached on this node; a sweep
 * at work shows 0xFFFFFFFF, which vouches for nothing). */
#define TRACT_LEDGER_EVICTED 0xFFFFFFFFFFFFFFFFull

uint64_t tract_payload_ledger(const tract_region *r, uint32_t slot);

/* CRC-32C (as block checksums) of the whole payload of each of n slots, in place. */
int tract_checksum_slots(tract_region *r, const uint32_t *slots, uint32_t n, uint32_t *out);

/* Advances the CRC-32C register (no inversion: start from 0xFFFFFFFF, invert
 * after the last part) of each of n slots, in place in regs, over bytes
 * [off, off+len) of its payload; with write_back, then writes those bytes back
 * to the device as a commit of a DMA'd payload would, fenced (a commit of the
 * slots may then say TRACT_COMMIT_STREAMED).  A slot's parts go in order; other
 * slots' parts may run on other threads at the same time. */
int tract_checksum_slots_part(tract_region *r, const uint32_t *slots, uint32_t n, uint64_t off,
			      uint64_t len, uint32_t *regs, int write_back);

/* ---- node-local segment (per node, in local DRAM, e.g. /dev/shm) ---- */

/* Bytes a node-local segment needs for this region. */
uint64_t tract_local_size(const tract_region *r);

/* Where a segment's region lives, as the process that created the segment
 * saw it: what tells, once no process uses the segment, whether its region
 * is gone (the segment is then garbage: tract_local_describe). */
#define TRACT_LOCAL_PATH_MAX 4096
enum {
	TRACT_LOCAL_REGION_UNKNOWN = 0,   /* never judged gone */
	TRACT_LOCAL_REGION_FILE = 1,      /* gone once its path holds no region of its uuid */
	TRACT_LOCAL_REGION_DEVICE = 2,    /* a device (device-DAX): never gone */
};
struct tract_local_origin {
	uint32_t kind;                    /* TRACT_LOCAL_REGION_* */
	uint32_t reserved;
	uint64_t pid_ns;                  /* inode of the creator's pid namespace (0: unknown) */
	uint64_t mnt_ns;                  /* and of its mount namespace, which the path is in */
	char path[TRACT_LOCAL_PATH_MAX];  /* the region's absolute path, NUL-terminated */
};

/* Initializes a fresh, zeroed local segment for this region and the handle's
 * node; ORIGIN (NULL: unknown) names its region (a path without its NUL
 * within TRACT_LOCAL_PATH_MAX: TRACT_E_INVAL). */
int tract_local_init(void *mem, uint64_t size, const tract_region *r,
		     const struct tract_local_origin *origin);

/* What a local segment says of itself, read without binding it (by whoever
 * decides whether a segment is garbage): its layout version, node, region
 * and origin, and the pids its journal names (up to cap of them in pids;
 * pid_count: all).  TRACT_E_NOT_FORMATTED: not a whole segment (no magic,
 * too short); TRACT_E_VERSION: another layout version (version, node and
 * region_uuid are filled, the rest is not). */
struct tract_local_desc {
	uint32_t version;
	uint32_t node;
	uint8_t region_uuid[16];
	uint32_t pid_count;
	uint32_t reserved;
	struct tract_local_origin origin;
};
int tract_local_describe(const void *mem, uint64_t size, struct tract_local_desc *out,
			 uint32_t *pids, uint32_t cap);

/* Binds an initialized local segment to the handle (checks magic, region, node). */
int tract_bind_local(tract_region *r, void *mem, uint64_t size);

/* Tries to take the node's agent mutex: 0 taken, TRACT_E_TIMEOUT if another agent holds it. */
int tract_agent_lock(tract_region *r);

/* Releases the node's agent mutex. */
int tract_agent_unlock(tract_region *r);

/*
 * Death points, for tests: TRACT_DIE_AT=<point>[:<passes>] in the environment
 * (read once, at CPU detection) makes the process SIGKILL itself the
 * (passes + 1)-th time it reaches that point, so a test can kill a process
 * exactly inside a critical section and check what recovery makes of it.
 */
enum tract_die_point {
	TRACT_DIE_NONE = 0,
	TRACT_DIE_CLAIM_STAGED = 1,    /* claim: intent recorded, nothing in the region yet */
	TRACT_DIE_CLAIM_HEADER = 2,    /* claim: allocator header counted the slots */
	TRACT_DIE_CLAIM_BITMAP = 3,    /* claim: owners and bitmap written, free list not yet */
	TRACT_DIE_CLAIM_PUSHED = 4,    /* claim: on the free list, intent not yet cleared */
	TRACT_DIE_RELEASE_POPPED = 5,  /* release: off the free list, region untouched */
	TRACT_DIE_RELEASE_HEADER = 6,  /* release: header uncounted them, owners and bits not */
	TRACT_DIE_RELEASE_OWNERS = 7,  /* release: owners cleared, bitmap not yet */
	TRACT_DIE_ALLOC_JOURNALED = 8, /* a handed-on allocation: its slots journaled, not popped */
	TRACT_DIE_PUT_ALLOCATED = 9,   /* put: slots allocated, no claim names them yet */
	TRACT_DIE_PUT_CLAIMED = 10,    /* put: the claims name their slots, bare slots not forgotten */
	TRACT_DIE_HANDOFF_NO_RECORD = 11, /* handoff: no free record; its pins not given back yet */
	TRACT_DIE_JOURNAL_MOVED = 12,  /* journal erase: a key copied back, its old place not yet reused */
	TRACT_DIE_LRU_MOVED = 13,      /* lookup: a block moved to its LRU head, the anchor not written */
	TRACT_DIE_RELEASE_INTENT = 14, /* handoff release: a group's intent on the device, its pins not given back */
	TRACT_DIE_RELEASE_PINS = 15,   /* handoff release: a group's pins given back in this host's caches, not flushed */
	TRACT_DIE_RELEASE_MARKED = 16, /* handoff release: a group marked in the record, its stripe not yet left */
	TRACT_DIE_EVICTED = 17,        /* eviction: slots buried and journaled, their free not begun */
	TRACT_DIE_EVENT_APPENDED = 18, /* a stripe section: a KV event appended, its log's head not written */
	TRACT_DIE_PIN_MOVED = 19,      /* a pin move: one of the count and the journal moved, not the other */
	TRACT_DIE_PIN_NAMED = 20,      /* a pin move: named in the journal, neither moved yet */
	TRACT_DIE_PIN_BOTH = 21,       /* a pin move: both moved, still named */
	TRACT_DIE_COUNT = 22
};

/* ---- recovery of what this node's dead processes left (recover.c) ---- */

/* what one pass of tract_recover gave back */
struct tract_recovery {
	uint32_t locks;            /* locks of dead processes taken over or withdrawn */
	uint32_t handoffs;         /* half-done handoff releases finished */
	uint64_t processes;        /* dead processes whose journals were given back */
	uint64_t pins;             /* pins released */
	uint64_t claims;           /* PENDING claims dropped */
	uint64_t slots;            /* slots freed */
	uint64_t partial;          /* journals that had overflowed (the rest: tract check --repair) */
	uint32_t orphans_buried;   /* PENDING buckets of writers no journal remembers */
	uint32_t orphans_skipped;  /* stripes busy: those orphans wait for the next pass */
	int32_t journal_rc;        /* each step's result (TRACT_E_TIMEOUT: a lock was busy, */
	int32_t orphan_rc;         /*   the next pass resumes it) */
	int32_t handoff_rc;
	int32_t reserved;
};

enum {
	TRACT_RECOVER_ORPHANS = 1  /* also bury orphaned claims (a scan of the node's stripes) */
};

/* One pass of the node's recovery, in its documented order: dead processes'
 * locks (each repaired by its owner), their journals, orphaned claims (with
 * TRACT_RECOVER_ORPHANS), half-done handoff releases.  The agent calls it
 * every heartbeat. */
int tract_recover(tract_region *r, uint32_t flags, struct tract_recovery *out, uint64_t timeout_ns);

/* Step 2 alone: gives back what the node's dead processes journaled (pins,
 * PENDING claims, bare slots), counted in out's processes, pins, claims,
 * slots and partial; its other fields are left as they are. */
int tract_recover_dead(tract_region *r, struct tract_recovery *out, uint64_t timeout_ns);

/* ---- a dead host (verdict.c, recover.c; docs/PROTOCOLS.md §7) ---- */

struct tract_node_verdict;     /* line 1 of a node's entry (format.h) */

/* Observes node's verdict (line 1 of its node-table entry) into out (may be
 * NULL): 1 if the node is dead now (its entry's epoch is the one declared
 * dead), 0 if not, or an error. */
int tract_node_verdict(tract_region *r, uint32_t node, struct tract_node_verdict *out);

/* Declares another node's agent epoch dead, if its entry still shows that
 * epoch and that heartbeat (TRACT_E_ALIVE if not): from then on the lock
 * manager grants it nothing and takes back what it holds.  Only the current
 * lock manager's agent declares (TRACT_E_SUPERSEDED). */
int tract_node_declare_dead(tract_region *r, uint32_t node, uint64_t epoch, uint64_t heartbeat_ns);

/* what one pass of tract_recover_host gave back */
struct tract_host_recovery {
	uint32_t handoffs;         /* its half-done handoff releases finished */
	uint32_t claims;           /* its PENDING claims buried */
	uint32_t records;          /* its handoff records still live (its pins wait for them) */
	uint32_t skipped;          /* stripes busy: the next pass resumes */
	uint64_t pins;             /* pins of its dead readers given back (summed counts) */
	uint64_t slots;            /* its unreferenced slots returned to the pool */
	uint64_t owned;            /* its slots still referenced (READY blocks, records) */
	uint32_t done;             /* 1: nothing left but later slot sweeps */
	uint32_t reserved;
};

enum {
	TRACT_RECOVER_HOST_SLOTS = 1  /* also sweep its slots (a pass over the index and the owner map) */
};

/* One pass of a dead host's recovery by the current lock manager's agent:
 * its half-done handoff releases, its PENDING claims, and (once none of its
 * handoff records remains) its pins.  TRACT_E_ALIVE once the node was
 * restarted, TRACT_E_SUPERSEDED when this node is not the manager's. */
int tract_recover_host(tract_region *r, uint32_t node, uint32_t flags,
		       struct tract_host_recovery *out, uint64_t timeout_ns);

/* What every agent starting on this node publishes through: line0 (the
 * node's line 0 with its new epoch; 64 bytes), published while no process
 * of the node can allocate.  If a verdict declared the previous epoch
 * (prev_epoch) dead -- whenever it landed -- what that death's recovery gave
 * back is forgotten here, under lock 0: free-list entries that are no longer
 * this node's in the region (*dropped gets how many), the pins the node's
 * dead processes journaled (*pins), their bare slots no longer theirs.
 * Returns 1 if a verdict named the previous epoch, 0 if not. */
int tract_node_rejoin(tract_region *r, uint64_t prev_epoch, const void *line0, uint64_t *pins,
		      uint64_t *dropped, uint64_t timeout_ns);

/* Buries this node's PENDING buckets whose writer is dead and in no journal
 * (a restarted host, an overflowed journal): their keys become writable; their
 * slots come back with `tract check --repair`.  Busy stripes are skipped. */
int tract_bury_orphan_claims(tract_region *r, uint64_t timeout_ns, uint32_t *buried,
			     uint32_t *skipped);

/* The pids of this node's journal entries in use (processes attached to the
 * node, live or dead and not yet recovered): up to cap into out, *n = all. */
int tract_journal_pids(const tract_region *r, uint32_t *out, uint32_t cap, uint32_t *n);

/* ---- the two-tier lock ---- */

/* what a timed-out acquire saw, for the error message */
struct tract_lock_wait {
	uint32_t granted_node;   /* node + 1 holding the grant, 0 none */
	uint32_t holder_pid;     /* pid in that node's slot */
	uint64_t held_ns;        /* how long the grant has been held */
	uint32_t stage;          /* 1 local mutex, 2 global grant */
	uint32_t reserved;
};

/* Acquires global lock lock_id (local mutex, then a grant from the lock manager). */
int tract_lock_acquire(tract_region *r, uint32_t lock_id, uint64_t timeout_ns,
		       struct tract_lock_wait *wait);

/* Releases global lock lock_id: publish IDLE, then unlock the local mutex. */
int tract_lock_release(tract_region *r, uint32_t lock_id);

/* Step 1 of recovery alone: takes over (and repairs) or withdraws the locks
 * of this node's dead processes; *count gets how many. */
int tract_lock_recover(tract_region *r, uint32_t *count);

/* Lets go of every lock this handle holds as a dead holder would (the node's
 * next taker or its agent repairs); returns how many it could not (held by
 * another thread). */
int tract_lock_abandon(tract_region *r);

/* Per-lock acquisition count and total wait of this node (local statistics). */
int tract_lock_stats(const tract_region *r, uint32_t lock_id, uint64_t *acquired,
		     uint64_t *wait_ns);

/* ---- the lock manager (a native thread; one current manager per region) ---- */

typedef struct tract_manager tract_manager;

/* a fencing token: a lock-manager claim as one comparable number, the claim's
 * manager epoch above TRACT_TOKEN_NODE_BITS bits of its node id */
enum {
	TRACT_TOKEN_NODE_BITS = 32
};

/* The current manager's fencing token: the largest claim in the node table,
 * (manager_epoch << TRACT_TOKEN_NODE_BITS) | node, 0 if no node ever claimed; *node gets its
 * node, or -1.  Observes every node entry (tract_cli.core.nodes.current_token;
 * the agent applies the same rule to a table it read, nodes.current_manager). */
int tract_manager_current(tract_region *r, uint64_t *token, int32_t *node);

/* Starts the manager thread; idle_sleep_max_ns caps its back-off when nothing
 * is pending.  This node's claim must be the current token, published before
 * (TRACT_E_SUPERSEDED if another node's is larger); with no claim anywhere the
 * manager runs unfenced, token 0.  It adopts the holder of every lock from
 * the LOCKED slots before it grants anything (docs/PROTOCOLS.md §4). */
int tract_manager_start(tract_region *r, uint64_t idle_sleep_max_ns, tract_manager **out);

/* 1 if the manager stopped managing because a later claim appeared (*by gets
 * that token), 0 while it is current. */
int tract_manager_superseded(const tract_manager *m, uint64_t *by);

/* Stops and frees the manager thread. */
void tract_manager_stop(tract_manager *m);

/* Manager counters: scans, grants, releases seen, idle sleeps, line repairs (5 values). */
int tract_manager_stats(const tract_manager *m, uint64_t *out5);

/* ---- allocator ---- */

/* Allocates n slots into out (all or nothing); TRACT_E_FULL if the pool has fewer free. */
int tract_alloc(tract_region *r, uint32_t n, uint32_t *out, uint64_t timeout_ns);

/* Frees n slots: own slots go to the node's free list, others back to the region. */
int tract_free(tract_region *r, const uint32_t *slots, uint32_t n, uint64_t timeout_ns);

/* Returns every slot of this node's free list to the region. */
int tract_alloc_drain(tract_region *r, uint64_t timeout_ns);

/* Copies this node's free list (up to cap entries) into out; *count gets its length. */
int tract_alloc_local_free(const tract_region *r, uint32_t *out, uint64_t cap, uint64_t *count);

/* ---- object store (named roots) ---- */

/* Publishes name -> (offset, size) under the object-directory lock. */
int tract_obj_put(tract_region *r, const char *name, uint64_t offset, uint64_t size,
		  uint64_t timeout_ns);

/* Looks a name up without the lock; bounds-checks what it read. */
int tract_obj_get(tract_region *r, const char *name, uint64_t *offset, uint64_t *size);

/* Removes a name under the object-directory lock. */
int tract_obj_delete(tract_region *r, const char *name, uint64_t timeout_ns);

/* ---- block hashes ---- */

/* MurmurHash3_x64_128 of len bytes with a 32-bit seed; out gets 16 bytes. */
void tract_murmur3_128(const void *key, uint64_t len, uint32_t seed, uint8_t *out);

/* SHA-256 of len bytes; out gets 32 bytes. */
void tract_sha256(const void *data, uint64_t len, uint8_t *out);

/* vLLM's NONE_HASH: SHA-256 of the canonical CBOR text string SEED (len bytes
 * of UTF-8, at most 1 MiB); out gets 32 bytes. */
int tract_vllm_root(const char *seed, uint64_t len, uint8_t *out);

/* the bounds of tract_hash_chain's inputs (TRACT_E_INVAL past them) */
enum { TRACT_HASH_MAX_BLOCK_TOKENS = 4096, TRACT_HASH_MAX_EXTRA = 4096 };

/* Block hashes of the full blocks of a prompt; out gets n_blocks * hash_bytes
 * (16 for TRACT_HASH_TRACT, 32 for TRACT_HASH_VLLM_SHA256_CBOR).  EXTRA is
 * appended to each block for the tract scheme; for the vLLM scheme it is a
 * cache salt (UTF-8) that enters the first block's extra keys as [salt]. */
int tract_hash_chain(uint32_t scheme, const int32_t *tokens, uint64_t n_tokens,
		     uint32_t block_tokens, const uint8_t *root, const uint8_t *extra,
		     uint64_t extra_len, uint8_t *out, uint64_t out_cap_blocks);

/* ---- the prefix index ---- */

/* Finds, pins and touches the longest run of leading READY keys (16 bytes each);
 * per hit: slot, token count, checksum (0 none) and payload tag (may be NULL). */
int tract_index_lookup(tract_region *r, const uint8_t *keys, uint32_t n, uint32_t *slots,
		       uint32_t *tokens, uint32_t *checksums, uint64_t *tags, uint32_t *hits,
		       uint64_t timeout_ns);

/* How many leading keys look READY, read without a lock: a hint (what a
 * lookup looks at first; 0 means the lookup would find none, and take no lock). */
int tract_index_peek(tract_region *r, const uint8_t *keys, uint32_t n, uint32_t *ready);

/* Unpins keys this node pinned with tract_index_lookup. */
int tract_index_unpin(tract_region *r, const uint8_t *keys, uint32_t n, uint64_t timeout_ns);

/* tract_index_unpin that sets done[i] = 1 for each key it unpinned (or found not
 * pinned by this node): one that timed out partway leaves the keys of the
 * stripes it did not enter at 0, for a retry of exactly those. */
int tract_index_unpin_marked(tract_region *r, const uint8_t *keys, uint32_t n, uint8_t *done,
			     uint64_t timeout_ns);

/* Puts blocks (claim, allocate with eviction, NT copy, publish); status per key.
 * DESC (one per key, or NULL) and TOKEN_IDS (block_tokens per key, or NULL)
 * describe the blocks for their records (tract_index_put_commit). */
int tract_index_put(tract_region *r, const uint8_t *keys, uint32_t n, const void *src,
		    uint64_t src_stride, uint64_t block_len, const uint32_t *tokens, int flags,
		    const struct tract_block_record *desc, const uint32_t *token_ids,
		    uint8_t *status, uint64_t timeout_ns);

/* flags of tract_index_put and tract_index_put_begin */
enum {
	TRACT_PUT_CHECKSUM = 1,      /* record each block's CRC-32C */
	TRACT_PUT_PIN = 2,           /* pin, for this node, the stored blocks and those already READY */
};

/* or'ed into tract_index_put_commit's publish: the payloads went in with
 * tract_copy_in (streaming stores, already on the device), so the commit does
 * not write them back line by line; without it the commit writes back every
 * payload line (a zero-copy writer's plain stores) before any READY */
enum { TRACT_COMMIT_STREAMED = 4 };

/* a put's status per key */
enum tract_put_status {
	TRACT_PUT_STORED = 0,        /* stored by this call */
	TRACT_PUT_WAS_READY = 1,     /* READY already (pinned with TRACT_PUT_PIN) */
	TRACT_PUT_WAS_PENDING = 2,   /* another writer holds it PENDING */
	TRACT_PUT_NO_ROOM = 3,       /* no slot or bucket for it */
	TRACT_PUT_CLAIMED = 4,       /* put_begin: claimed PENDING for this writer, slot allocated */
	TRACT_PUT_BURIED = 5         /* an abandon buried the claim; the slot's free timed out:
				      * the same abandon again frees it */
};

/* Claims PENDING buckets for absent keys and allocates their slots (status
 * TRACT_PUT_CLAIMED); with TRACT_PUT_PIN, keys already READY
 * (TRACT_PUT_WAS_READY) are pinned by this node. */
int tract_index_put_begin(tract_region *r, const uint8_t *keys, uint32_t n, uint8_t *status,
			  uint32_t *slots, int flags, uint64_t timeout_ns);

/* Publishes (1; 2: pinned by this node; | TRACT_COMMIT_STREAMED) or abandons (0)
 * what tract_index_put_begin claimed.  A publish writes each block's record
 * (its slot's, for KV events) before it turns READY: from DESC[i] (tag, hash,
 * parent, n_tokens, flags; key and node are the call's) and TOKEN_IDS[i *
 * block_tokens ...] where DESC[i] has TRACT_RECORD_GIVEN (its salt too), else the
 * key alone. */
int tract_index_put_commit(tract_region *r, const uint8_t *keys, uint32_t n, uint8_t *status,
			   const uint32_t *slots, const uint32_t *tokens, const uint32_t *checksums,
			   const struct tract_block_record *desc, const uint32_t *token_ids,
			   int publish, uint64_t timeout_ns);

/* Copies blocks out of slots (payload tags from the lookup, or NULL: evicts every
 * slot first), verifying recorded checksums; *bad gets a failing index. */
int tract_index_read(tract_region *r, const uint32_t *slots, const uint64_t *tags, uint32_t n,
		     void *dst, uint64_t dst_stride, uint64_t block_len, const uint32_t *checksums,
		     uint32_t *bad);

/* The slot, token count and checksum (0: none) of n keys this process holds
 * pinned, read without a lock (a pinned READY bucket cannot change them;
 * every line observed); TRACT_E_NOT_FOUND if one is not READY. */
int tract_index_observe_pinned(tract_region *r, const uint8_t *keys, uint32_t n, uint32_t *slots,
			       uint32_t *tokens, uint32_t *checksums);

/* Payload tags of n blocks pinned for the caller without its own lookup (a
 * handoff's), read without stripe locks; 0 where a key is not READY at slots[i]. */
int tract_index_tags(tract_region *r, const uint8_t *keys, const uint32_t *slots, uint32_t n,
		     uint64_t *tags);

/* Evicts up to want unpinned entries (LRU first); *evicted gets the count. */
int tract_index_evict(tract_region *r, uint32_t want, uint32_t *evicted, uint64_t timeout_ns);

/* ---- KV events: the stripes' event logs, the slots' block records ---- */

/* a stripe's state after tract_events_read */
enum {
	TRACT_EVENTS_OK = 0,         /* read up to its head (or up to cap) */
	TRACT_EVENTS_LOST = 1,       /* events past its cursor were overwritten: resynchronise
				      * the stripe from tract_events_snapshot */
	TRACT_EVENTS_BEHIND = 2      /* its head is past an event not visible here yet: read
				      * again later */
};

/* Reads new events of every stripe without a lock: stripe s from cursors[s]
 * (the seq it reads next) up to its head, cap events in all; out[k] and
 * stripe_of[k] (ascending) get them, cursors advance past them; state[s] says
 * how stripe s ended (TRACT_EVENTS_*), heads[s] its head as read. */
int tract_events_read(tract_region *r, uint64_t *cursors, struct tract_event *out,
		      uint32_t *stripe_of, uint32_t cap, uint32_t *n_out, uint8_t *state,
		      uint64_t *heads);

/* The READY blocks of the stripes with want[s] != 0 and their logs' heads,
 * each stripe read under its lock (so a reader that continues from heads[s]
 * misses nothing and sees nothing twice): keys (16 bytes each), slots and
 * stripe_of appended, at most cap (TRACT_E_FULL when more). */
int tract_events_snapshot(tract_region *r, const uint8_t *want, uint64_t *heads, uint8_t *keys,
			  uint32_t *slots, uint32_t *stripe_of, uint32_t cap, uint32_t *n_out,
			  uint64_t timeout_ns);

/* The records of n blocks (key, slot): rec[i] and token_ids[i * block_tokens
 * ...]; ok[i] = 1 when the slot's record is the key's, read whole (0: the
 * block was evicted and its slot is being reused). */
int tract_records_read(tract_region *r, const uint8_t *keys, const uint32_t *slots, uint32_t n,
		       struct tract_block_record *rec, uint32_t *token_ids, uint8_t *ok);

/* ---- prefill -> decode handoff ---- */

/* Pins n READY blocks for a decode side, stores the key list and tail, writes a record. */
int tract_handoff_publish(tract_region *r, const uint8_t *request_id, const uint8_t *keys,
			  uint32_t n, uint64_t token_count, const void *tail, uint64_t tail_len,
			  uint32_t tail_tokens, uint64_t ttl_ns, uint32_t *rec, uint64_t timeout_ns);

/* tract_handoff_publish in record want (UINT32_MAX: the first FREE one),
 * chosen without the lock (tract_handoff_peek_free): TRACT_E_TABLE_FULL if
 * it is taken by now (nothing pinned or written). */
int tract_handoff_publish_in(tract_region *r, uint32_t want, const uint8_t *request_id,
			     const uint8_t *keys, uint32_t n, uint64_t token_count, const void *tail,
			     uint64_t tail_len, uint32_t tail_tokens, uint64_t ttl_ns, uint32_t *rec,
			     uint64_t timeout_ns);

/* Publishes a handoff of blocks this process holds one pin on each
 * (journaled: a pinning put's), in record want, chosen without the lock
 * (tract_handoff_peek_free); the pins become the record's.  No tail.
 * reserved: want is this process's reservation for request_id
 * (tract_handoff_reserve), which must still hold, unexpired; else want must
 * be FREE.  TRACT_E_NOT_FOUND: a key is not READY; TRACT_E_TABLE_FULL:
 * record want is taken by now (with reserved: the reservation is gone); on
 * any failure the pins stay the caller's. */
int tract_handoff_publish_pinned(tract_region *r, uint32_t want, const uint8_t *request_id,
				 const uint8_t *keys, uint32_t n, uint64_t token_count,
				 uint64_t ttl_ns, int reserved, uint64_t timeout_ns);

/* Reserves FREE record rec for request_id until ttl_ns from now, under the
 * transfer lock, for a handoff of block_count blocks and token_count tokens
 * (a decode side holds them against its ticket): a decode side that opens it meanwhile is told
 * TRACT_E_PENDING (its owner publishes it, tract_handoff_publish_pinned with
 * reserved, or gives it back).  TRACT_E_TABLE_FULL if rec is taken. */
int tract_handoff_reserve(tract_region *r, uint32_t rec, const uint8_t *request_id,
			  uint32_t block_count, uint64_t token_count, uint64_t ttl_ns,
			  uint64_t timeout_ns);

/* Gives back record rec's reservation for request_id (its owner's, that
 * publishes nothing; or a decode side's that stopped waiting for it):
 * TRACT_OK, or TRACT_E_NOT_FOUND if it is not reserved for request_id. */
int tract_handoff_unreserve(tract_region *r, uint32_t rec, const uint8_t *request_id,
			    uint64_t timeout_ns);

/* A record that looks FREE, observed without a lock from start on
 * (wrapping), none of the n in skip: TRACT_OK and *rec, or
 * TRACT_E_TABLE_FULL. */
int tract_handoff_peek_free(tract_region *r, uint32_t start, const uint32_t *skip, uint32_t n,
			    uint32_t *rec);

/* Finds the records of n request ids (16 bytes each) in one pass without a
 * lock: recs[i], the first record PUBLISHED or RESERVED for ids[i], or
 * UINT32_MAX.  A hint: tract_handoff_open checks the record it names. */
int tract_handoff_find(tract_region *r, const uint8_t *ids, uint32_t n, uint32_t *recs);

/* Reads a published record: block keys, slots, checksums, token counts, tail
 * slot + 1.  TRACT_E_PENDING while rec is reserved for request_id, unexpired
 * (*block_count and *token_count: what it was reserved for). */
int tract_handoff_open(tract_region *r, uint32_t rec, const uint8_t *request_id,
		       uint8_t *keys, uint32_t *slots, uint32_t *checksums, uint32_t *tokens,
		       uint32_t cap, uint32_t *block_count, uint64_t *token_count,
		       uint32_t *tail_slot, uint32_t *tail_tokens);

/* Whether record rec is still published for request_id, observed without a
 * lock: TRACT_OK, or TRACT_E_NOT_FOUND.  Called after copying a handoff's
 * blocks (its fence orders the copy's loads first), OK proves the copy read
 * them before any release of their slots (a release follows PUBLISHED's end). */
int tract_handoff_check(tract_region *r, uint32_t rec, const uint8_t *request_id);

/* Acknowledges a handoff: pins and slots released, record freed. */
int tract_handoff_ack(tract_region *r, uint32_t rec, const uint8_t *request_id, uint64_t timeout_ns);

/* Finishes this process's own acknowledgement of record rec that timed out
 * partway (its retry; never proof that a load outlived the record). */
int tract_handoff_ack_resume(tract_region *r, uint32_t rec, const uint8_t *request_id,
			     uint64_t timeout_ns);

/* Reclaims records expired at now_ns, reservations among them; *count gets how many. */
int tract_handoff_reclaim(tract_region *r, uint64_t now_ns, uint32_t *count, uint64_t timeout_ns);

/* Finishes the releases (acknowledge or reclaim) that a dead process of this
 * node left half done, from where it stopped; *count gets how many. */
int tract_handoff_recover(tract_region *r, uint32_t *count, uint64_t timeout_ns);

/* CRC-32C (Castagnoli) of len bytes, as used for block checksums. */
uint32_t tract_crc32c(const void *buf, uint64_t len);

/* the block checksum's path over a long buffer (tract_crc_path) */
enum {
	TRACT_CRC_BITWISE = 0,       /* no SSE4.2: bit by bit */
	TRACT_CRC_INSTRUCTION = 1,   /* the SSE4.2 crc32 instruction, one chain */
	TRACT_CRC_FOLD128 = 2,       /* PCLMULQDQ folding */
	TRACT_CRC_FOLD256 = 3,       /* AVX2 VPCLMULQDQ folding */
	TRACT_CRC_FOLD512 = 4        /* AVX-512 VPCLMULQDQ folding */
};

/* The path (TRACT_CRC_*) the block checksum takes over a long buffer on this
 * CPU, as crc.c chooses it (the TRACT_NO_* overrides included). */
int tract_crc_path(void);

/* ---- an engine's paged KV cache to and from slots (kvpages.c) ---- */

/* Where an engine keeps the KV of a region block: one tensor per layer
 * (bases), pages page_stride bytes apart; sub-block j of a page (one of subs
 * region blocks a page holds) is runs run_first[j] .. run_first[j+1]-1, each
 * (run_off: bytes from its page's start, run_len: bytes, run_pos: bytes
 * from the chunk's start), in the order the block's layer chunk (layer_bytes)
 * holds them; elem_token (subs x the chunk's elements; NULL: partial blocks
 * refused) names each element's token. */
struct tract_kv_pages {
	uint32_t layers;
	uint32_t subs;
	uint64_t layer_bytes;
	uint64_t page_stride;
	uint64_t tensor_bytes;
	const uint64_t *bases;
	const uint32_t *run_first;
	const uint64_t *run_off;
	const uint64_t *run_len;
	const uint64_t *run_pos;
	const uint16_t *elem_token;
	uint32_t elem_bytes;
	uint32_t block_tokens;
	/* the page sizes of the region's mapping and of the engine's tensors:
	 * save and load read one byte of each page of both sides a few MiB
	 * ahead of the copy, so it meets few TLB misses (0: that side is not
	 * touched) */
	uint64_t region_page;
	uint64_t engine_page;
};

/* Copies n blocks from the engine's pages (pages[i], sub-block subs[i]) into
 * their claimed slots with streaming stores, on the device at return, and
 * gives each block's CRC-32C (crcs[i]); tokens[i] (NULL: all full) below the
 * block's tokens zeroes the rest.  One call, no lock, the GIL released; the
 * blocks in any order (visited by ascending slot).
 * crcs NULL: memcpy of the same runs only (no checksum, no write-back), the
 * reference a benchmark measures the copy against. */
int tract_kv_save(tract_region *r, const struct tract_kv_pages *kv, uint32_t n, const uint32_t *slots,
		  const uint64_t *pages, const uint32_t *subs, const uint32_t *tokens,
		  uint32_t *crcs);

/* Copies n blocks from their slots (acquired: tract_payload_acquire) into the
 * engine's pages and gives the CRC-32C of each as read.  crcs NULL: memcpy
 * of the same runs only, the reference a benchmark measures it against. */
int tract_kv_load(tract_region *r, const struct tract_kv_pages *kv, uint32_t n, const uint32_t *slots,
		  const uint64_t *pages, const uint32_t *subs, uint32_t *crcs);

/* Evicts every line of n blocks' runs, both sides (the slots and the engine's
 * pages), from this host's caches, and fences: the cold state a benchmark
 * times a copy and its reference from (never part of the data path).
 * TRACT_E_FLUSH_UNSUPPORTED where the CPU has no flush instruction. */
int tract_kv_evict(tract_region *r, const struct tract_kv_pages *kv, uint32_t n,
		   const uint32_t *slots, const uint64_t *pages, const uint32_t *subs);

/* ---- the index as `tract check` audits and repairs it (audit.c) ---- */

/* what a bucket's own key rule says of it */
enum tract_audit {
	TRACT_AUDIT_OK = 0,            /* live, and reachable from its key's home */
	TRACT_AUDIT_NOT_LIVE = 1,      /* EMPTY or TOMBSTONE: nothing to reach */
	TRACT_AUDIT_OTHER_STRIPE = 2,  /* live, but its key belongs to another stripe */
	TRACT_AUDIT_CHAIN_BROKEN = 3   /* live, but an EMPTY bucket lies between home and it */
};

/* Audits every bucket of the index (n = its bucket count): reach[i] gets
 * TRACT_AUDIT_* for bucket i, home[i] its key's home bucket (live buckets of
 * the right stripe), broken[i] the EMPTY bucket that breaks its probe chain.
 * Reads only, without locks. */
int tract_index_audit(tract_region *r, uint8_t *reach, uint64_t *home, uint64_t *broken,
		      uint64_t n);

/* The home bucket of each of n 16-byte keys: the bucket of its stripe its
 * probe starts from (the key rule), for readers of a snapshot (`tract
 * inspect`'s probe lengths). */
int tract_index_key_homes(const tract_region *r, const uint8_t *keys, uint64_t n,
			  uint64_t *homes);

/* Rebuilds the index offline (`tract check --repair`) from the READY buckets
 * keep[0..n_keep): each READY, of its key's stripe, naming a slot of the data
 * area, no bucket, key or slot twice (else TRACT_E_INVAL, and nothing is
 * written).  Every bucket becomes EMPTY
 * and every pin count zero; the kept ones are placed again from their key's
 * home by the index's probe, keeping their fields but pins, and linked into
 * their stripe's LRU list oldest (last_access_ns, then bucket index) first,
 * the newest at the head; each stripe's anchor counts them and keeps its
 * counters; every bucket takes one epoch above all the old ones (wrapping
 * past 0xffffffff to 1).  Written stripe by stripe, each published before
 * the next is touched.  Takes no lock: only while no other process maps the
 * region. */
int tract_index_rebuild(tract_region *r, const uint64_t *keep, uint64_t n_keep);

/* Rebuilds the allocator state offline (`tract check --repair`, after
 * tract_index_rebuild) from the slots keep[0..n_keep) the kept entries hold:
 * each below the slot count, none twice (else TRACT_E_INVAL, and nothing is
 * written).  The bitmap gets exactly their bits; the owner map keeps each
 * one's owner byte where it names a node (1..max_nodes), else gives it to
 * node 0 (byte 1),
 * and clears every other slot's; the allocator header's used_slots becomes
 * n_keep (its other fields kept); the transfer table and the lock table are
 * emptied (all zero: no record, no grant, no holder).  Each section is
 * published (stored, flushed, fenced) whole.  Takes no lock: only while no
 * other process maps the region. */
int tract_alloc_rebuild(tract_region *r, const uint32_t *keep, uint64_t n_keep);

/* CDEF-END */

#endif
