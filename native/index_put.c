/*
 * index_put.c -- puts into the prefix index (docs/PROTOCOLS.md §9): claim
 * PENDING buckets for the absent keys, allocate their slots (evicting when
 * the pool is full), copy the payloads in, publish READY.  The zero-copy
 * put is the same in two calls (put_begin, put_commit) around the caller's
 * own writes.  The payload is on the device, fenced, before READY is
 * published; the allocator's lock is taken with no stripe lock held.
 */
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "index_internal.h"

/* status codes of tract_index_put, per key */
enum {   /* enum tract_put_status (tract.h), by short names */
	PUT_STORED = TRACT_PUT_STORED,
	PUT_WAS_READY = TRACT_PUT_WAS_READY,
	PUT_WAS_PENDING = TRACT_PUT_WAS_PENDING,
	PUT_NO_ROOM = TRACT_PUT_NO_ROOM,
	PUT_CLAIMED = TRACT_PUT_CLAIMED,
	PUT_BURIED = TRACT_PUT_BURIED
};

/* claims PENDING buckets for absent keys; status per key (internal) */
/* evicted slots past which a claim frees them mid-walk, after the stripe
 * that reached it (their journal entries wait beside the claims' until then:
 * at most this many plus one stripe's keys) (internal) */
#define EVICT_BATCH 256

static int claim_all(tract_region *r, const uint8_t *keys, uint32_t n, const struct keyref *refs,
		     uint8_t *status, int pin_ready, uint64_t timeout_ns)
{
	struct line_set *set = calloc(1, sizeof(*set));   /* NULL: no deferral */
	uint32_t *freed = malloc(((size_t)n + 1) * sizeof(uint32_t));
	struct tract_slot_owner *owners = malloc(((size_t)n + 1) * sizeof(*owners));
	if (!freed || !owners) {
		free(set);
		free(freed);
		free(owners);
		return TRACT_E_NOMEM;
	}
	int err = TRACT_OK;
	struct stripe_groups g;
	tract_groups_init(&g, refs, n, NULL, NULL);
	/* a walk requested ahead: a put waits for about one grant, not one per
	 * stripe.  The slots it evicts are freed once it holds no stripe and has
	 * none requested (the allocator's lock is lower): at its end, or once
	 * EVICT_BATCH wait (a walk's requests withdrawn, then made again) */
	struct stripe_walk walk;
	tract_walk_init(&walk, r, set, timeout_ns);
	uint32_t nfreed = 0;
	while (tract_groups_next(&g)) {
		struct stripe_ctx c;
		int rc = tract_walk_enter(&walk, &g, &c);
		if (rc < 0) {
			tract_walk_end(&walk);
			if (nfreed)
				tract_free_evicted(r, freed, owners, nfreed, timeout_ns);
			free(set);
			free(freed);
			free(owners);
			return rc;
		}
		for (uint32_t k = g.first; k < g.end; k++) {
			uint32_t idx = refs[k].idx;
			const uint8_t *key = keys + (uint64_t)idx * 16;
			uint64_t b, fb;
			struct tract_bucket bk;
			tract_probe(&c, key, &b, &fb, &bk);
			/* every bucket of the stripe holds a block: evict this stripe's
			 * least recent unpinned one to make room for the key (its slot
			 * freed after the stripe lock) */
			if (b == UINT64_MAX && fb == UINT64_MAX &&
			    tract_evict_lru(&c, 1, freed + nfreed, owners + nfreed)) {
				nfreed++;
				tract_probe(&c, key, &b, &fb, &bk);
			}
			if (b != UINT64_MAX) {
				status[idx] = bk.state == TRACT_BUCKET_READY ? PUT_WAS_READY : PUT_WAS_PENDING;
				/* a pinning put pins what is already there too: the caller's
				 * handoff needs every block, its own and the others' */
				if (pin_ready && bk.state == TRACT_BUCKET_READY) {
					if (tract_pin_move(&c, b, key, +1) != TRACT_OK)
						status[idx] = PUT_WAS_PENDING;   /* pin count saturated */
				}
				continue;
			}
			if (fb == UINT64_MAX) {
				status[idx] = PUT_NO_ROOM;
				continue;
			}
			struct tract_bucket was;
			load_bucket(&c, fb, &was);
			memset(&bk, 0, sizeof(bk));
			memcpy(bk.key, key, 16);
			bk.state = TRACT_BUCKET_PENDING;
			/* a new epoch: the payload tag of this claim is new (payload.c) */
			bk.epoch = was.epoch;
			if (TRACT_KEEP(SITE_INDEX_CLAIM_EPOCH) && !++bk.epoch)
				bk.epoch = 1;
			bk.owner_node = (uint16_t)r->node_id;
			bk.owner_pid = (uint32_t)getpid();
			bk.last_access_ns = tract_now_ns();
			store_bucket(&c, fb, &bk);
			status[idx] = PUT_CLAIMED;
			tract_journal_claims(r, key, 1, &status[idx], PUT_CLAIMED, NULL, 0);
		}
		tract_stripe_leave(&c);
		/* the allocator lock, with no stripe lock held or requested (the
		 * walk's requests withdrawn first); a failure (the lock timed out)
		 * leaves the evicted blocks' slots journaled, for the node's agent
		 * to free once this process is gone, and is reported: the put is
		 * abandoned with it */
		if (nfreed >= EVICT_BATCH) {
			tract_walk_end(&walk);
			if ((rc = tract_free_evicted(r, freed, owners, nfreed, timeout_ns)) < 0 &&
			    !err)
				err = rc;
			nfreed = 0;
		}
	}
	tract_walk_end(&walk);
	if (nfreed) {
		int rc = tract_free_evicted(r, freed, owners, nfreed, timeout_ns);
		if (rc < 0 && !err)
			err = rc;
	}
	free(set);
	free(freed);
	free(owners);
	return err;
}

/* whether key idx is claimed (arg: the put's status array) (internal) */
static int claimed(const void *status, uint32_t idx)
{
	return ((const uint8_t *)status)[idx] == PUT_CLAIMED;
}

/* publishes (READY) or abandons claimed keys, inserting into LRU tail first (internal) */
static int finish_all(tract_region *r, const uint8_t *keys, uint32_t n, const struct keyref *refs,
		      uint8_t *status, const uint32_t *slots, const uint32_t *tokens,
		      const uint32_t *checksums, int publish, uint64_t timeout_ns)
{
	int rc = TRACT_OK;
	struct line_set *set = calloc(1, sizeof(*set));   /* NULL: no deferral */
	/* the stripes with a claim of this put, in a walk requested ahead */
	struct stripe_groups g;
	tract_groups_init(&g, refs, n, claimed, status);
	struct stripe_walk walk;          /* requested ahead, as claim_all's */
	tract_walk_init(&walk, r, set, timeout_ns);
	while (tract_groups_next(&g)) {
		struct stripe_ctx c;
		int rc2 = tract_walk_enter(&walk, &g, &c);
		if (rc2 < 0) {
			if (rc != TRACT_E_CORRUPT)
				rc = rc2;
			/* a publish stops at the first stripe not granted (it runs in an
			 * engine's step: one lock timeout, not one per stripe; the claims
			 * of this stripe and those after stay CLAIMED, for the caller's
			 * abandon); an abandon goes on to free what it can */
			if (publish)
				break;
			continue;
		}
		for (uint32_t k = g.first; k < g.end; k++) {
			uint32_t idx = refs[k].idx;
			if (status[idx] != PUT_CLAIMED)
				continue;
			uint64_t b, fb;
			struct tract_bucket bk;
			tract_probe(&c, keys + (uint64_t)idx * 16, &b, &fb, &bk);
			if (b == UINT64_MAX || bk.state != TRACT_BUCKET_PENDING) {
				rc = TRACT_E_CORRUPT;       /* our claim vanished */
				continue;
			}
			if (!publish) {
				tract_bury(&c, b);
				tract_journal_claims(r, keys + (uint64_t)idx * 16, 1, &status[idx],
						     PUT_CLAIMED, NULL, 1);
				/* buried: its slot is the caller's to free; a claim in a
				 * stripe not entered stays CLAIMED for a retry */
				status[idx] = PUT_BURIED;
				continue;
			}
			bk.state = TRACT_BUCKET_READY;
			bk.slot = slots[idx] + 1;
			bk.tokens = tokens ? tokens[idx] : r->hdr.block_tokens;
			if (checksums) {
				bk.checksum = checksums[idx];
				bk.flags |= TRACT_BUCKET_F_CHECKSUM;
			}
			bk.last_access_ns = tract_now_ns();
			tract_lru_push_head(&c, b, &bk);
			store_bucket(&c, b, &bk);
			tract_event_append(&c, TRACT_EVENT_STORED, &bk);
			/* publish pinned (2): READY and pinned by this node in one
			 * section, so the block cannot be evicted before the caller's
			 * handoff pins it; READY first, so a death in between leaves
			 * no count on a bucket that is not READY */
			int pinned_now = publish == 2 &&
					 tract_pin_move(&c, b, keys + (uint64_t)idx * 16, +1) == TRACT_OK;
			if (publish == 2 && !pinned_now)
				rc = TRACT_E_CORRUPT;
			c.lru.inserts++;
			/* the pin taken and journaled as one move, the claim forgotten
			 * once READY: a death in between leaves a READY bucket whose
			 * claim recovery keeps */
			tract_journal_claims(r, keys + (uint64_t)idx * 16, 1, &status[idx], PUT_CLAIMED,
					     NULL, 1);
			status[idx] = PUT_STORED;
		}
		tract_stripe_leave(&c);
	}
	tract_walk_end(&walk);
	free(set);
	return rc;
}

/* unpins the keys a pinning put found READY (status 1) (internal) */
static void unpin_ready(tract_region *r, const uint8_t *keys, uint32_t n, const uint8_t *status,
			uint64_t timeout_ns)
{
	uint8_t *ready = malloc((size_t)n * 16 + 16);
	uint32_t k = 0;
	for (uint32_t i = 0; ready && i < n; i++)
		if (status[i] == PUT_WAS_READY)
			memcpy(ready + (uint64_t)16 * k++, keys + (uint64_t)16 * i, 16);
	if (ready && k)
		tract_index_unpin(r, ready, k, timeout_ns);
	free(ready);
}

/* Claims PENDING buckets for absent keys and allocates their slots (evicting
 * when full); status[i] = 4 (claimed, slots[i] valid) or a skip reason. */
int tract_index_put_begin(tract_region *r, const uint8_t *keys, uint32_t n, uint8_t *status,
			  uint32_t *slots, int flags, uint64_t timeout_ns)
{
	int pin_ready = flags & TRACT_PUT_PIN;
	int rc = index_usable(r);
	if (rc)
		return rc;
	if ((!keys && n) || !status || (!slots && n))
		return TRACT_E_INVAL;
	struct keyref *refs = tract_group_keys(r, keys, n);
	uint32_t *mine = calloc((size_t)n + 1, sizeof(uint32_t));
	if (!refs || !mine) {
		free(refs);
		free(mine);
		return TRACT_E_NOMEM;
	}
	memset(status, 0, n);
	memset(slots, 0, (size_t)n * sizeof(uint32_t));
	if ((rc = claim_all(r, keys, n, refs, status, pin_ready, timeout_ns)) < 0)
		goto abandon;
	uint32_t want = 0;
	for (uint32_t i = 0; i < n; i++)
		if (status[i] == PUT_CLAIMED)
			mine[want++] = i;
	if (want) {
		uint32_t cursor = (uint32_t)getpid();
		for (int attempt = 0;; attempt++) {
			rc = tract_alloc_journaled(r, want, slots, timeout_ns);
			if (rc != TRACT_E_FULL)
				break;   /* (TRACT_E_TOO_LARGE: evicting would not help) */
			uint32_t evicted = 0;
			int rc2 = tract_evict_spread(r, want, &cursor, &evicted, timeout_ns);
			if (rc2 < 0) {
				rc = rc2;
				break;
			}
			if (!evicted && attempt >= 1)
				break;   /* nothing evictable: the pool is full of pinned blocks */
		}
		if (rc < 0)
			goto abandon;
		tract_maybe_die(TRACT_DIE_PUT_ALLOCATED);
		/* slots[0..want) belong to mine[0..want): spread them by key index
		 * (mine[k] >= k, so walking down never overwrites an unread one) */
		for (uint32_t k = want; k-- > 0;) {
			uint32_t s = slots[k];
			slots[k] = 0;
			slots[mine[k]] = s;
		}
		/* the claims take the slots over from the bare journal: named by
		 * their claims first, then forgotten as bare (a death between
		 * leaves both, which recovery gives back once: recover.c) */
		tract_journal_claims(r, keys, n, status, PUT_CLAIMED, slots, 0);
		tract_maybe_die(TRACT_DIE_PUT_CLAIMED);
		for (uint32_t k = 0; k < want; k++)
			mine[k] = slots[mine[k]];
		tract_journal_slots(r, mine, want, 1);
	}
	free(refs);
	free(mine);
	return TRACT_OK;
abandon:
	/* no slot was handed to a claim yet: a buried claim has none to free */
	finish_all(r, keys, n, refs, status, slots, NULL, NULL, 0, timeout_ns);
	for (uint32_t i = 0; i < n; i++)
		if (status[i] == PUT_CLAIMED || status[i] == PUT_BURIED)
			status[i] = PUT_NO_ROOM;
	if (pin_ready)            /* give back the pins claim_all took on READY keys */
		unpin_ready(r, keys, n, status, timeout_ns);
	free(refs);
	free(mine);
	return rc;
}

/* Publishes (publish=1: READY; 2: READY and pinned by this node) or abandons
 * (0: claims dropped, slots freed) the keys tract_index_put_begin claimed;
 * status turns 4 -> 0 (stored). */
int tract_index_put_commit(tract_region *r, const uint8_t *keys, uint32_t n, uint8_t *status,
			   const uint32_t *slots, const uint32_t *tokens, const uint32_t *checksums,
			   const struct tract_block_record *desc, const uint32_t *token_ids,
			   int publish, uint64_t timeout_ns)
{
	int rc = index_usable(r);
	if (rc)
		return rc;
	if ((!keys && n) || !status || (!slots && n))
		return TRACT_E_INVAL;
	for (uint32_t i = 0; i < n; i++)
		if (status[i] == PUT_CLAIMED && slots[i] >= r->hdr.slot_count)
			return TRACT_E_RANGE;
	struct keyref *refs = tract_group_keys(r, keys, n);
	if (!refs)
		return TRACT_E_NOMEM;
	uint32_t *freed = NULL;
	int mode = publish & ~TRACT_COMMIT_STREAMED;
	if (!mode) {
		/* an abandon frees the slots of the claims buried (by this call or an
		 * earlier one whose free timed out: PUT_BURIED), and only those: a
		 * claim in a stripe whose lock timed out keeps its slot and stays
		 * PUT_CLAIMED, a buried one whose free timed out stays PUT_BURIED, so
		 * the caller's retry with the same status array finishes either; a
		 * process that dies in between leaves them to `tract check --repair` */
		freed = malloc(((size_t)n + 1) * sizeof(uint32_t));
		if (!freed) {
			free(refs);
			return TRACT_E_NOMEM;
		}
		const struct tract_section *data = tract_sec(r, TRACT_SEC_DATA);
		for (uint32_t i = 0; i < n; i++)
			/* a zero-copy writer's abandoned stores may be dirty here: written
			 * back now, they cannot land later on the slot's next block */
			if (status[i] == PUT_CLAIMED && !(publish & TRACT_COMMIT_STREAMED))
				tract_write_back_payload(r, data->offset + (uint64_t)slots[i] *
							    r->hdr.slot_stride, r->hdr.block_bytes);
		rc = finish_all(r, keys, n, refs, status, slots, tokens, checksums, 0, timeout_ns);
		uint32_t k = 0;
		for (uint32_t i = 0; i < n; i++)
			if (status[i] == PUT_BURIED)
				freed[k++] = slots[i];
		int rc2 = k ? tract_free(r, freed, k, timeout_ns) : TRACT_OK;
		if (rc2 == TRACT_OK)
			for (uint32_t i = 0; i < n; i++)
				if (status[i] == PUT_BURIED)
					status[i] = PUT_NO_ROOM;
		rc = rc2 ?: rc;
	} else {
		/* a zero-copy writer's plain stores are dirty in this host's cache:
		 * write them back to the device (the mode's flush: dirty data) before
		 * any READY can point at them.  Streamed payloads are there already:
		 * the streaming stores and their sfence (tract_copy_in) preceded this
		 * commit, and the READY publication below fences again */
		if (!(publish & TRACT_COMMIT_STREAMED) || tract_payload_strict()) {
			const struct tract_section *data = tract_sec(r, TRACT_SEC_DATA);
			for (uint32_t i = 0; i < n; i++)
				if (status[i] == PUT_CLAIMED)
					tract_write_back_payload(r, data->offset + (uint64_t)slots[i] *
								    r->hdr.slot_stride, r->hdr.block_bytes);
		}
		/* what the KV events will say of them, at their slots before any
		 * turns READY (the READY sections fence after these lines too) */
		tract_records_write(r, keys, n, status, PUT_CLAIMED, slots, desc, token_ids);
		rc = finish_all(r, keys, n, refs, status, slots, tokens, checksums,
				mode == 2 ? 2 : 1, timeout_ns);
	}
	free(freed);
	free(refs);
	return rc;
}

/*
 * Puts blocks: claims PENDING for absent keys, allocates slots (evicting LRU
 * unpinned entries when the pool is full), copies each block i from
 * src + i * src_stride with non-temporal stores, optionally checksums it,
 * then publishes READY (pinned by this node with TRACT_PUT_PIN).  status[i]:
 * 0 stored, 1 already READY, 2 already PENDING (another writer), 3 no room.
 */
int tract_index_put(tract_region *r, const uint8_t *keys, uint32_t n, const void *src,
		    uint64_t src_stride, uint64_t block_len, const uint32_t *tokens, int flags,
		    const struct tract_block_record *desc, const uint32_t *token_ids,
		    uint8_t *status, uint64_t timeout_ns)
{
	int checksum = flags & TRACT_PUT_CHECKSUM;
	int rc = index_usable(r);
	if (rc)
		return rc;
	if ((!keys && n) || !status || (n && !src) || block_len > r->hdr.block_bytes)
		return TRACT_E_INVAL;
	uint32_t *slots = calloc((size_t)n + 1, sizeof(uint32_t));
	uint32_t *sums = checksum ? calloc((size_t)n + 1, sizeof(uint32_t)) : NULL;
	if (!slots || (checksum && !sums)) {
		free(slots);
		free(sums);
		return TRACT_E_NOMEM;
	}
	rc = tract_index_put_begin(r, keys, n, status, slots, flags & TRACT_PUT_PIN, timeout_ns);
	int begun = rc == TRACT_OK;
	for (uint32_t i = 0; rc == TRACT_OK && i < n; i++) {
		if (status[i] != PUT_CLAIMED)
			continue;
		const uint8_t *blk = (const uint8_t *)src + (uint64_t)i * src_stride;
		uint64_t off = tract_sec(r, TRACT_SEC_DATA)->offset +
			       (uint64_t)slots[i] * r->hdr.slot_stride;
		rc = tract_copy_in(r, off, blk, block_len);
		if (sums)
			sums[i] = tract_crc32c(blk, block_len);
	}
	if (rc == TRACT_OK) {
		rc = tract_index_put_commit(r, keys, n, status, slots, tokens, sums, desc, token_ids,
					    ((flags & TRACT_PUT_PIN) ? 2 : 1) | TRACT_COMMIT_STREAMED,
					    timeout_ns);
	} else if (begun) {
		tract_index_put_commit(r, keys, n, status, slots, NULL, NULL, NULL, NULL, 0,
				       timeout_ns);
		if (flags & TRACT_PUT_PIN)
			unpin_ready(r, keys, n, status, timeout_ns);
	}
	free(slots);
	free(sums);
	return rc;
}
