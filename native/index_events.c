/*
 * index_events.c -- the prefix index's KV events (docs/PROTOCOLS.md §13).
 *
 * Each stripe has an event log: a ring of one-line entries written only
 * under the stripe's lock, by whoever publishes a key READY (STORED) or
 * evicts it (REMOVED), in the same section: no extra lock round trip, and
 * one key's events are in the order its stripe lock gave them.  Readers on
 * any host read it without a lock, each from its own cursor, and check what
 * they read: an entry carries its sequence number, written last-and-first
 * (a seqlock within the line), so a reader that falls a whole ring behind,
 * or reads a line while it is rewritten, knows and resynchronises from a
 * snapshot (tract_events_snapshot) instead of trusting what it read.
 *
 * Each slot has a block record: what an event says of the block in it (its
 * model tag, its hash as vLLM computes it, its parent, its token ids),
 * written by the block's writer before the block turns READY.  A record is
 * read without a lock too, and trusted only while its key reads the same
 * before and after (its writer zeroes the key before it rewrites the rest).
 */
#include <stdlib.h>
#include <string.h>

#include "index_internal.h"

/* region offset of stripe s's log (its head line; entries follow) */
static inline uint64_t log_off(const tract_region *r, uint32_t s)
{
	const struct tract_section *sec = tract_sec(r, TRACT_SEC_EVENTS);
	return sec->offset + (uint64_t)s * sec->entry_size;
}

/* entries in a stripe's log (a power of two: layout.c) */
static inline uint64_t log_cap(const tract_region *r)
{
	return tract_sec(r, TRACT_SEC_EVENTS)->entry_size / TRACT_LINE - 1;
}

/* region offset of the entry that holds event SEQ of stripe s */
static inline uint64_t entry_off(const tract_region *r, uint32_t s, uint64_t seq)
{
	return log_off(r, s) + TRACT_LINE * (1 + (seq & (log_cap(r) - 1)));
}

/* region offset of slot's record */
static inline uint64_t record_off(const tract_region *r, uint32_t slot)
{
	const struct tract_section *sec = tract_sec(r, TRACT_SEC_RECORDS);
	return sec->offset + (uint64_t)slot * sec->entry_size;
}

/* appends an event of bucket BK to the entered stripe's log (internal) */
void tract_event_append(struct stripe_ctx *c, uint32_t kind, const struct tract_bucket *bk)
{
	tract_region *r = c->r;
	if (!c->ev_loaded) {
		struct tract_event_head h;
		tract_line_get(c, log_off(r, c->stripe), &h);
		c->ev_next = h.next_seq;
		c->ev_loaded = 1;
	}
	struct tract_event e;
	memset(&e, 0, sizeof(e));
	e.seq = c->ev_next + 1;
	e.kind = kind;
	e.slot = bk->slot;
	memcpy(e.key, bk->key, 16);
	e.node = (uint16_t)r->node_id;
	e.tokens = bk->tokens;
	e.time_ns = tract_now_ns();
	e.epoch = bk->epoch;
	uint64_t off = entry_off(r, c->stripe, c->ev_next);
	/* the seqlock within the line: WRITING first, then the body, then the
	 * whole line with its sequence number (stores are seen in program
	 * order; on a non-coherent device the line lands whole, at the flush or
	 * an eviction, and a reader that sees WRITING or another number rejects
	 * the line).  A reader re-reads the number after its copy: a rewrite
	 * that overlapped the copy changed it. */
	uint64_t writing = TRACT_EVENT_WRITING;
	r->ops->store(r, off, &writing, sizeof(writing));
	r->ops->store(r, off + 8, (const uint8_t *)&e + 8, TRACT_LINE - 8);
	tract_line_put(c, off, &e);
	tract_maybe_die(TRACT_DIE_EVENT_APPENDED);
	c->ev_next++;
	c->ev_dirty = 1;
}

/* writes back every line of the entered stripe's log (internal) */
void tract_events_write_back(struct stripe_ctx *c)
{
	c->r->ops->flush(c->r, log_off(c->r, c->stripe), (log_cap(c->r) + 1) * TRACT_LINE);
}

/* writes back SLOT's record (internal) */
void tract_record_write_back(tract_region *r, uint32_t slot)
{
	if (slot < r->hdr.slot_count)
		r->ops->flush(r, record_off(r, slot), tract_sec(r, TRACT_SEC_RECORDS)->entry_size);
}

/* moves the entered stripe's log head on past a whole ring (internal) */
void tract_events_skip(struct stripe_ctx *c)
{
	if (!c->ev_loaded) {
		struct tract_event_head h;
		tract_line_get(c, log_off(c->r, c->stripe), &h);
		c->ev_next = h.next_seq;
		c->ev_loaded = 1;
	}
	c->ev_next += log_cap(c->r) + 1;
	c->ev_dirty = 1;
}

/* writes the head of the entered stripe's log back if events were appended
 * (the section's flush, which writes the section's lines back in no set
 * order: a reader trusts an entry by its own number, never by the head) (internal) */
void tract_events_flush_head(struct stripe_ctx *c)
{
	if (!c->ev_dirty)
		return;
	struct tract_event_head h;
	memset(&h, 0, sizeof(h));
	h.next_seq = c->ev_next;
	tract_line_put(c, log_off(c->r, c->stripe), &h);
	c->ev_dirty = 0;
}

/* writes the records of the keys whose status is CLAIMED, at their slots,
 * before any of them turns READY: every record's key zeroed and written
 * back first (one fence), then the rest and the key (one fence) (internal) */
void tract_records_write(tract_region *r, const uint8_t *keys, uint32_t n, const uint8_t *status,
			 uint8_t claimed, const uint32_t *slots,
			 const struct tract_block_record *desc, const uint32_t *token_ids)
{
	uint32_t bt = r->hdr.block_tokens;
	uint64_t size = tract_sec(r, TRACT_SEC_RECORDS)->entry_size;
	uint8_t *ids = calloc(1, size - sizeof(struct tract_block_record) + 1);
	struct tract_block_record zero;
	memset(&zero, 0, sizeof(zero));
	int any = 0;
	for (uint32_t i = 0; i < n; i++)
		if (status[i] == claimed && slots[i] < r->hdr.slot_count) {
			tract_write_line(r, record_off(r, slots[i]), &zero);
			any = 1;
		}
	if (!any) {
		free(ids);
		return;
	}
	r->ops->fence(r);
	uint64_t now = tract_now_ns();
	for (uint32_t i = 0; i < n; i++) {
		if (status[i] != claimed || slots[i] >= r->hdr.slot_count)
			continue;
		uint64_t off = record_off(r, slots[i]);
		struct tract_block_record rec;
		/* a description counts where the caller marked it given (a put may
		 * describe some of its blocks only) */
		const struct tract_block_record *d =
			desc && (desc[i].flags & TRACT_RECORD_GIVEN) ? &desc[i] : NULL;
		if (d) {
			rec = *d;
			if (rec.n_tokens > bt)
				rec.n_tokens = bt;
			if (rec.salt_len > sizeof(rec.salt))
				rec.salt_len = 0;
			rec.flags &= TRACT_RECORD_PARENT | TRACT_RECORD_PARTIAL | TRACT_RECORD_GIVEN;
		} else {
			memset(&rec, 0, sizeof(rec));
			memcpy(rec.hash, keys + (uint64_t)i * 16, 16);
		}
		memcpy(rec.key, keys + (uint64_t)i * 16, 16);
		rec.node = (uint16_t)r->node_id;
		rec.written_ns = now;
		memset(rec.reserved, 0, sizeof(rec.reserved));
		/* token ids (none without a description: nothing to say of them) */
		if (ids) {
			uint64_t len = size - sizeof(rec);
			memset(ids, 0, len);
			if (d && token_ids)
				memcpy(ids, token_ids + (uint64_t)i * bt, (uint64_t)rec.n_tokens * 4);
			else
				rec.n_tokens = 0;
			r->ops->store(r, off + sizeof(rec), ids, len);
			r->ops->flush(r, off + sizeof(rec), len);
		} else {
			/* no room for the token ids: a record of the key alone */
			memset((uint8_t *)&rec + 16, 0, sizeof(rec) - 16);
			memcpy(rec.hash, keys + (uint64_t)i * 16, 16);
			rec.node = (uint16_t)r->node_id;
			rec.written_ns = now;
		}
		tract_write_line(r, off + 2 * TRACT_LINE, (const uint8_t *)&rec + 2 * TRACT_LINE);
		tract_write_line(r, off + TRACT_LINE, (const uint8_t *)&rec + TRACT_LINE);
		tract_write_line(r, off, &rec);
	}
	r->ops->fence(r);
	free(ids);
}

/* Reads new events of every stripe, without a lock. */
int tract_events_read(tract_region *r, uint64_t *cursors, struct tract_event *out,
		      uint32_t *stripe_of, uint32_t cap, uint32_t *n_out, uint8_t *state,
		      uint64_t *heads)
{
	if (!r || !cursors || !n_out || !state || !heads || (cap && (!out || !stripe_of)))
		return TRACT_E_INVAL;
	uint32_t stripes = r->hdr.index_stripes;
	uint64_t lc = log_cap(r);
	for (uint32_t s = 0; s < stripes; s++)
		r->ops->invalidate(r, log_off(r, s), TRACT_LINE);
	r->ops->fence(r);
	for (uint32_t s = 0; s < stripes; s++)
		r->ops->load(r, log_off(r, s), &heads[s], sizeof(heads[s]));
	uint32_t n = 0;
	for (uint32_t s = 0; s < stripes; s++) {
		uint64_t cur = cursors[s], head = heads[s];
		state[s] = TRACT_EVENTS_OK;
		if (head < cur || head - cur > lc) {
			state[s] = TRACT_EVENTS_LOST;   /* overwritten, or a rebuild moved it on */
			continue;
		}
		uint64_t want = head - cur;
		if (want > cap - n)
			want = cap - n;
		if (!want)
			continue;
		for (uint64_t k = 0; k < want; k++)
			r->ops->invalidate(r, entry_off(r, s, cur + k), TRACT_LINE);
		r->ops->fence(r);
		uint32_t got = 0;
		for (uint64_t k = 0; k < want; k++) {
			struct tract_event *e = &out[n + got];
			r->ops->load(r, entry_off(r, s, cur + k), e, TRACT_LINE);
			if (e->seq == cur + k + 1) {
				got++;
				continue;
			}
			/* being rewritten, or rewritten: a later event took the line; an
			 * earlier number: the head's line reached this host before the
			 * entry's (read again later) */
			state[s] = e->seq == TRACT_EVENT_WRITING || e->seq > cur + k + 1 ?
				   TRACT_EVENTS_LOST : TRACT_EVENTS_BEHIND;
			break;
		}
		if (got) {
			/* the seqlock's second read: a line rewritten while it was copied
			 * has another number now (lines are rewritten in sequence order,
			 * so any change means the log overran this reader) */
			for (uint32_t k = 0; k < got; k++)
				r->ops->invalidate(r, entry_off(r, s, cur + k), TRACT_LINE);
			r->ops->fence(r);
			for (uint32_t k = 0; k < got; k++) {
				uint64_t again;
				r->ops->load(r, entry_off(r, s, cur + k), &again, sizeof(again));
				if (again != cur + k + 1) {
					state[s] = TRACT_EVENTS_LOST;
					got = 0;
					break;
				}
			}
		}
		if (state[s] == TRACT_EVENTS_LOST)
			got = 0;
		for (uint32_t k = 0; k < got; k++)
			stripe_of[n + k] = s;
		n += got;
		cursors[s] = cur + got;
	}
	*n_out = n;
	return TRACT_OK;
}

/* The READY blocks of the wanted stripes and their logs' heads, under each
 * stripe's lock. */
int tract_events_snapshot(tract_region *r, const uint8_t *want, uint64_t *heads, uint8_t *keys,
			  uint32_t *slots, uint32_t *stripe_of, uint32_t cap, uint32_t *n_out,
			  uint64_t timeout_ns)
{
	int rc = index_usable(r);
	if (rc)
		return rc;
	if (!want || !heads || !n_out || (cap && (!keys || !slots || !stripe_of)))
		return TRACT_E_INVAL;
	uint32_t n = 0;
	*n_out = 0;
	for (uint32_t s = 0; s < r->hdr.index_stripes; s++) {
		if (!want[s])
			continue;
		struct stripe_ctx c;
		if ((rc = tract_stripe_enter(r, s, timeout_ns, &c, NULL)) < 0)
			return rc;
		struct tract_event_head h;
		tract_line_get(&c, log_off(r, s), &h);
		heads[s] = h.next_seq;
		/* the stripe's buckets observed with one fence: nobody writes them
		 * while this section holds the lock */
		r->ops->invalidate(r, bucket_off(&c, c.first), c.size * TRACT_LINE);
		r->ops->fence(r);
		for (uint64_t b = c.first; b < c.first + c.size; b++) {
			struct tract_bucket bk;
			r->ops->load(r, bucket_off(&c, b), &bk, sizeof(bk));
			if (bk.state != TRACT_BUCKET_READY || !bk.slot || bk.slot > r->hdr.slot_count)
				continue;
			if (n == cap) {
				tract_stripe_leave(&c);
				*n_out = n;
				return TRACT_E_FULL;
			}
			memcpy(keys + (uint64_t)n * 16, bk.key, 16);
			slots[n] = bk.slot - 1;
			stripe_of[n] = s;
			n++;
		}
		tract_stripe_leave(&c);
	}
	*n_out = n;
	return TRACT_OK;
}

/* The records of n blocks, each checked to be the key's and read whole. */
int tract_records_read(tract_region *r, const uint8_t *keys, const uint32_t *slots, uint32_t n,
		       struct tract_block_record *rec, uint32_t *token_ids, uint8_t *ok)
{
	if (!r || (n && (!keys || !slots || !rec || !token_ids || !ok)))
		return TRACT_E_INVAL;
	uint32_t bt = r->hdr.block_tokens;
	uint64_t size = tract_sec(r, TRACT_SEC_RECORDS)->entry_size;
	for (uint32_t i = 0; i < n; i++)
		if (slots[i] < r->hdr.slot_count)
			r->ops->invalidate(r, record_off(r, slots[i]), size);
	r->ops->fence(r);
	/* the key first, then the rest: loads are seen in program order */
	for (uint32_t i = 0; i < n; i++) {
		ok[i] = 0;
		memset(&rec[i], 0, sizeof(rec[i]));
		if (slots[i] >= r->hdr.slot_count)
			continue;
		uint64_t off = record_off(r, slots[i]);
		r->ops->load(r, off, &rec[i], TRACT_LINE);
		r->ops->load(r, off + TRACT_LINE, (uint8_t *)&rec[i] + TRACT_LINE,
			     sizeof(rec[i]) - TRACT_LINE);
		r->ops->load(r, off + sizeof(rec[i]), token_ids + (uint64_t)i * bt, (uint64_t)bt * 4);
		ok[i] = !memcmp(rec[i].key, keys + (uint64_t)i * 16, 16);
	}
	/* the key again: a writer that began to rewrite the record meanwhile
	 * zeroed it first */
	for (uint32_t i = 0; i < n; i++)
		if (ok[i])
			r->ops->invalidate(r, record_off(r, slots[i]), TRACT_LINE);
	r->ops->fence(r);
	for (uint32_t i = 0; i < n; i++) {
		if (!ok[i])
			continue;
		uint8_t again[16];
		r->ops->load(r, record_off(r, slots[i]), again, 16);
		if (memcmp(again, keys + (uint64_t)i * 16, 16) || rec[i].n_tokens > bt ||
		    rec[i].salt_len > sizeof(rec[i].salt))
			ok[i] = 0;
	}
	return TRACT_OK;
}
