/*
 * local.c -- the node-local segment: robust process-shared mutexes (the
 * local tier of the two-tier lock), the agent mutex, and the node's slot
 * free list.  (Clocks, back-off and the robust lock itself: util.c.)
 */
#include <errno.h>
#include <sched.h>
#include <string.h>
#include <time.h>

#include "internal.h"

/* rounds v up to 64 (internal) */
static uint64_t up64(uint64_t v)
{
	return (v + 63) & ~63ULL;
}

/* Bytes a node-local segment needs for this region. */
uint64_t tract_local_size(const tract_region *r)
{
	if (!r)
		return 0;
	uint64_t n = r->hdr.slot_count;
	return up64(sizeof(struct tract_local_hdr)) +
	       up64((uint64_t)r->hdr.lock_count * sizeof(struct tract_local_mutex)) +
	       up64(n * 4) + up64((n + 7) / 8) + tract_journal_size() + up64(n * 8) +
	       up64(tract_sim_cache_size());
}

/* Initializes a fresh, zeroed local segment for this region and the handle's
 * node, recording ORIGIN (NULL: unknown). */
int tract_local_init(void *mem, uint64_t size, const tract_region *r,
		     const struct tract_local_origin *origin)
{
	if (!mem || !r || size < tract_local_size(r))
		return TRACT_E_INVAL;
	if (origin && (origin->kind > TRACT_LOCAL_REGION_DEVICE ||
		       !memchr(origin->path, 0, sizeof(origin->path))))
		return TRACT_E_INVAL;
	struct tract_local_hdr *h = mem;
	memset(h, 0, sizeof(*h));
	h->version = TRACT_LOCAL_VERSION;
	h->node = r->node_id;
	memcpy(h->region_uuid, r->hdr.uuid, 16);
	if (origin)
		h->origin = *origin;
	h->lock_count = r->hdr.lock_count;
	h->slot_count = r->hdr.slot_count;
	h->locks_off = up64(sizeof(*h));
	h->free_list_off = h->locks_off + up64((uint64_t)h->lock_count * sizeof(struct tract_local_mutex));
	h->free_bits_off = h->free_list_off + up64(h->slot_count * 4);
	h->journal_off = h->free_bits_off + up64((h->slot_count + 7) / 8);
	h->ledger_off = h->journal_off + tract_journal_size();
	h->sim_off = h->ledger_off + up64(h->slot_count * 8);
	int rc = tract_robust_init(&h->agent_mu);
	if (!rc)
		rc = tract_sim_cache_init((uint8_t *)mem + h->sim_off);
	if (!rc)
		rc = tract_robust_init(&h->alloc_mu);
	struct tract_local_mutex *m = (void *)((uint8_t *)mem + h->locks_off);
	for (uint32_t i = 0; !rc && i < h->lock_count; i++)
		rc = tract_robust_init(&m[i].mu);
	if (rc)
		return rc;
	__atomic_store_n(&h->magic, TRACT_LOCAL_MAGIC, __ATOMIC_RELEASE);
	return TRACT_OK;
}

/* Binds an initialized local segment to the handle (checks magic, region, node). */
int tract_bind_local(tract_region *r, void *mem, uint64_t size)
{
	if (!r || !mem)
		return TRACT_E_INVAL;
	struct tract_local_hdr *h = mem;
	if (size < sizeof(*h) || __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != TRACT_LOCAL_MAGIC ||
	    h->version != TRACT_LOCAL_VERSION)
		return TRACT_E_NOT_FORMATTED;
	if (memcmp(h->region_uuid, r->hdr.uuid, 16) || h->node != r->node_id ||
	    h->lock_count != r->hdr.lock_count || h->slot_count != r->hdr.slot_count ||
	    size < tract_local_size(r))
		return TRACT_E_LAYOUT;
	r->local = h;
	tract_journal_open(r);
	if (r->sim)
		tract_sim_bind(r, (uint8_t *)mem + h->sim_off);
	else if (!(r->flags & TRACT_ATTACH_READONLY))
		tract_sim_flush_node(r, (uint8_t *)mem + h->sim_off);
	return TRACT_OK;
}

/* What a local segment says of itself, read without binding it. */
int tract_local_describe(const void *mem, uint64_t size, struct tract_local_desc *out,
			 uint32_t *pids, uint32_t cap)
{
	if (!mem || !out || (cap && !pids))
		return TRACT_E_INVAL;
	memset(out, 0, sizeof(*out));
	const struct tract_local_hdr *h = mem;
	/* magic, version, node and uuid sit where every version had them */
	if (size < 32 || __atomic_load_n(&h->magic, __ATOMIC_ACQUIRE) != TRACT_LOCAL_MAGIC)
		return TRACT_E_NOT_FORMATTED;
	out->version = h->version;
	out->node = h->node;
	memcpy(out->region_uuid, h->region_uuid, 16);
	if (h->version != TRACT_LOCAL_VERSION)
		return TRACT_E_VERSION;
	if (size < sizeof(*h) || h->journal_off < sizeof(*h) ||
	    h->journal_off > size || size - h->journal_off < tract_journal_size() ||
	    !memchr(h->origin.path, 0, sizeof(h->origin.path)))
		return TRACT_E_NOT_FORMATTED;
	out->origin = h->origin;
	out->pid_count = tract_journal_pids_of(h, pids, cap);
	return TRACT_OK;
}

/* Tries to take the node's agent mutex: 0 taken, TRACT_E_TIMEOUT if another agent holds it. */
int tract_agent_lock(tract_region *r)
{
	if (!r || !r->local)
		return TRACT_E_NO_LOCAL;
	int rc = tract_robust_lock(&r->local->agent_mu, 0);
	return rc == TRACT_RECOVERED ? TRACT_OK : rc;
}

/* Releases the node's agent mutex. */
int tract_agent_unlock(tract_region *r)
{
	if (!r || !r->local)
		return TRACT_E_NO_LOCAL;
	return pthread_mutex_unlock(&r->local->agent_mu) ? TRACT_E_NOT_HELD : TRACT_OK;
}
