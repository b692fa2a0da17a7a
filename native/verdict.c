/*
 * verdict.c -- a silent host declared dead (docs/PROTOCOLS.md §7, "A dead
 * host").
 *
 * Line 1 of a node's entry is its verdict, written only by the current lock
 * manager's agent: when a node of another host has not heartbeat for the
 * agent's --host-dead-after, the agent declares that node's agent epoch dead.
 * A node is dead while its entry's epoch is the one its verdict names; an
 * agent that starts on the node later publishes the next epoch, which no
 * verdict names.  While a node is dead the lock manager grants it nothing and
 * takes back a lock it held (manager.c); recover.c gives back the rest.
 *
 * Nothing but time tells a dead host from a silent one, so the verdict is an
 * assumption the operator sizes (docs/PROTOCOLS.md §7): a host whose agent and
 * workers stood still longer than --host-dead-after and then resume are
 * fenced from the locks, but a worker that resumes inside a critical section
 * it held is not.
 */
#include <string.h>

#include "internal.h"

/* region offset of line `line` of node's entry (internal) */
static uint64_t entry_line(const tract_region *r, uint32_t node, uint32_t line)
{
	const struct tract_section *sec = tract_sec(r, TRACT_SEC_NODES);
	return sec->offset + (uint64_t)node * sec->entry_size + (uint64_t)line * TRACT_LINE;
}

/* the node-table entries the section holds, at most max_nodes (internal) */
static uint32_t table_nodes(const tract_region *r)
{
	const struct tract_section *sec = tract_sec(r, TRACT_SEC_NODES);
	return sec->count < r->hdr.max_nodes ? (uint32_t)sec->count : r->hdr.max_nodes;
}

/* whether an entry's line 0 and verdict say the node is dead (internal) */
static int is_dead(const struct tract_node_entry *e, const struct tract_node_verdict *v)
{
	return v->dead_epoch && v->dead_epoch == e->epoch;
}

/* Observes every node's line 0 and verdict under one fence: returns the
 * largest manager claim (tract_current_token's rule) and sets dead[n] for
 * every dead node n (dead has max_nodes entries) (internal; manager.c). */
uint64_t tract_observe_nodes(tract_region *r, uint8_t *dead, int site)
{
	uint32_t n = table_nodes(r);
	for (uint32_t k = 0; k < n && TRACT_KEEP(site); k++)
		r->ops->invalidate(r, entry_line(r, k, 0), 2 * TRACT_LINE);
	r->ops->fence(r);
	uint64_t best = 0;
	memset(dead, 0, r->hdr.max_nodes);
	for (uint32_t k = 0; k < n; k++) {
		struct tract_node_entry e;
		r->ops->load(r, entry_line(r, k, 0), &e, 2 * TRACT_LINE);
		uint64_t token = ((uint64_t)e.manager_epoch << TRACT_TOKEN_NODE_BITS) | k;
		if (e.manager_epoch && token > best)
			best = token;
		dead[k] = (uint8_t)is_dead(&e, &e.verdict);
	}
	return best;
}

/* Observes node's verdict (*out, if not NULL); 1 if the node is dead, 0 if
 * not, or an error. */
int tract_node_verdict(tract_region *r, uint32_t node, struct tract_node_verdict *out)
{
	if (!r || node >= table_nodes(r))
		return TRACT_E_INVAL;
	struct tract_node_entry e;
	r->ops->invalidate(r, entry_line(r, node, 0), 2 * TRACT_LINE);
	r->ops->fence(r);
	r->ops->load(r, entry_line(r, node, 0), &e, 2 * TRACT_LINE);
	if (out)
		*out = e.verdict;
	return is_dead(&e, &e.verdict);
}

/* TRACT_OK if this node's agent holds the largest manager claim, the
 * verdicts' only writer; TRACT_E_SUPERSEDED if not (internal) */
static int current_manager(tract_region *r)
{
	int32_t who;
	tract_current_token(r, &who, SITE_NONE);
	return who == (int32_t)r->node_id ? TRACT_OK : TRACT_E_SUPERSEDED;
}

/* Declares node's agent epoch dead, if the node still shows that epoch and
 * that heartbeat (TRACT_E_ALIVE: it heartbeat or restarted since).  Only the
 * current lock manager's agent declares (TRACT_E_SUPERSEDED otherwise); node
 * must be another node. */
int tract_node_declare_dead(tract_region *r, uint32_t node, uint64_t epoch, uint64_t heartbeat_ns)
{
	if (!r || (r->flags & TRACT_ATTACH_READONLY) || node >= table_nodes(r) ||
	    node == r->node_id || !epoch)
		return TRACT_E_INVAL;
	int rc = current_manager(r);
	if (rc < 0)
		return rc;
	struct tract_node_entry e;
	r->ops->invalidate(r, entry_line(r, node, 0), 2 * TRACT_LINE);
	r->ops->fence(r);
	r->ops->load(r, entry_line(r, node, 0), &e, 2 * TRACT_LINE);
	if (e.state != TRACT_NODE_ALIVE || e.epoch != epoch || e.heartbeat_ns != heartbeat_ns)
		return TRACT_E_ALIVE;
	if (is_dead(&e, &e.verdict))
		return TRACT_OK;                 /* declared already */
	struct tract_node_verdict v;
	memset(&v, 0, sizeof(v));
	v.dead_epoch = epoch;
	v.declared_ns = tract_now_ns();
	v.token = tract_current_token(r, NULL, SITE_NONE);
	v.heartbeat_ns = heartbeat_ns;
	tract_publish_line(r, entry_line(r, node, 1), &v);
	return TRACT_OK;
}

/* Records steps (TRACT_VERDICT_*) of a dead node's recovery as done, if the
 * verdict naming dead_epoch still stands (never into a later verdict)
 * (internal; recover.c and alloc.c, for the current manager's agent). */
int tract_node_verdict_record(tract_region *r, uint32_t node, uint64_t dead_epoch,
			      uint32_t steps)
{
	struct tract_node_verdict v;
	int dead = tract_node_verdict(r, node, &v);
	if (dead <= 0 || v.dead_epoch != dead_epoch)
		return dead < 0 ? dead : TRACT_E_ALIVE;
	if ((v.recovered & steps) == steps)
		return TRACT_OK;
	v.recovered |= steps;
	tract_publish_line(r, entry_line(r, node, 1), &v);
	return TRACT_OK;
}

/* Observes node's agent epoch, line 0 of its entry (internal). */
uint64_t tract_node_epoch(tract_region *r, uint32_t node)
{
	if (node >= table_nodes(r))
		return 0;
	struct tract_node_entry e;
	tract_observe_line(r, entry_line(r, node, 0), &e);
	return e.epoch;
}

/* Observes who claimed slot (its owner byte) and that node's agent epoch, for
 * an eviction to hand its free (alloc.c's tract_free_evicted): taken while
 * the bucket still references the slot, whose owner byte cannot change
 * meanwhile (internal). */
void tract_slot_owner_of(tract_region *r, uint32_t slot, struct tract_slot_owner *out)
{
	uint8_t line[TRACT_LINE];
	uint64_t off = tract_sec(r, TRACT_SEC_OWNERS)->offset + ((uint64_t)slot & ~63ULL);
	tract_observe_line(r, off, line);
	uint8_t owner = line[slot & 63];
	out->node = owner ? owner - 1u : UINT32_MAX;
	out->reserved = 0;
	out->epoch = owner ? tract_node_epoch(r, owner - 1u) : 0;
}
