/*
 * manager.c -- the lock manager: a native thread that arbitrates the global
 * tier of every lock (docs/PROTOCOLS.md §4).
 *
 * Each scan observes the whole lock table at once (one invalidate pass, one
 * fence), then for every lock: a grant whose node went IDLE or moved on to
 * a newer request is released; a lock with no grant is granted to the next
 * WAITING node after the last one granted (round-robin: no node starves).
 * The manager only writes line 0 of each lock and never holds a lock.
 *
 * It polls continuously while any request is pending and backs off when
 * idle (yield, then sleeps growing up to idle_sleep_max_ns), so on a small
 * machine it does not steal a core from the workers.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct grant {
	uint32_t node;      /* node + 1, 0 = none */
	uint32_t last;      /* node + 1 granted last */
	uint64_t req;
	uint64_t seq;
};

struct tract_manager {
	pthread_t thread;
	tract_region *r;
	volatile int stop;
	uint64_t idle_sleep_max_ns;
	struct grant *grants;
	uint8_t *table;     /* private copy of the lock table */
	uint64_t scans, grants_issued, releases, sleeps;
};

/* publishes a lock's manager line from the private state (internal) */
static void publish_grant(struct tract_manager *m, uint32_t id)
{
	tract_region *r = m->r;
	struct tract_lock_manager_line line;
	memset(&line, 0, sizeof(line));
	line.granted_node = m->grants[id].node;
	line.last_node = m->grants[id].last;
	line.grant_seq = m->grants[id].seq;
	line.granted_req = m->grants[id].req;
	line.grant_ns = tract_now_ns();
	tract_write_line_at(r, tract_lock_line(r, id, 0), &line, SITE_MGR_PUBLISH_GRANT);
}

/* one pass over every lock; returns 1 if any request or grant is live (internal) */
static int scan(struct tract_manager *m)
{
	tract_region *r = m->r;
	const struct tract_section *sec = tract_sec(r, TRACT_SEC_LOCKS);
	uint32_t nodes = r->hdr.max_nodes;
	if (TRACT_KEEP(SITE_MGR_OBSERVE_SLOTS))
		r->ops->invalidate(r, sec->offset, sec->length);
	r->ops->fence(r);
	r->ops->load(r, sec->offset, m->table, sec->length);
	int busy = 0, wrote = 0;
	for (uint32_t id = 0; id < r->hdr.lock_count; id++) {
		const uint8_t *entry = m->table + (uint64_t)id * sec->entry_size;
		const struct tract_lock_node_slot *slot = (const void *)(entry + TRACT_LINE);
		struct grant *g = &m->grants[id];
		if (g->node) {
			const struct tract_lock_node_slot *s = &slot[g->node - 1];
			if (s->state == TRACT_LOCK_IDLE || s->request_seq != g->req) {
				g->node = 0;
				m->releases++;
				wrote = 1;
				publish_grant(m, id);
			} else {
				busy = 1;
				continue;
			}
		}
		for (uint32_t k = 0; k < nodes; k++) {
			uint32_t n = (g->last + k) % nodes;   /* node after the last granted */
			if (slot[n].state == TRACT_LOCK_WAITING) {
				g->node = n + 1;
				g->last = n + 1;
				g->req = slot[n].request_seq;
				g->seq++;
				m->grants_issued++;
				publish_grant(m, id);
				wrote = busy = 1;
				break;
			}
		}
	}
	if (wrote)
		r->ops->fence(r);
	m->scans++;
	return busy;
}

/* the manager thread (internal) */
static void *run(void *arg)
{
	struct tract_manager *m = arg;
	uint32_t round = 0;
	while (!m->stop) {
		if (scan(m)) {
			round = 0;
		} else {
			if (round >= 128)
				m->sleeps++;
			tract_backoff(&round, m->idle_sleep_max_ns);
		}
	}
	return NULL;
}

/* Starts the manager thread; idle_sleep_max_ns caps its back-off when nothing is pending. */
int tract_manager_start(tract_region *r, uint64_t idle_sleep_max_ns, tract_manager **out)
{
	if (!r || !out || (r->flags & TRACT_ATTACH_READONLY))
		return TRACT_E_INVAL;
	struct tract_manager *m = calloc(1, sizeof(*m));
	if (!m)
		return TRACT_E_NOMEM;
	m->r = r;
	m->idle_sleep_max_ns = idle_sleep_max_ns ? idle_sleep_max_ns : 1000000ULL;
	m->grants = calloc(r->hdr.lock_count, sizeof(*m->grants));
	m->table = malloc(tract_sec(r, TRACT_SEC_LOCKS)->length);
	if (!m->grants || !m->table) {
		free(m->grants);
		free(m->table);
		free(m);
		return TRACT_E_NOMEM;
	}
	/* resume from what a previous manager published: live grants stay */
	for (uint32_t id = 0; id < r->hdr.lock_count; id++) {
		struct tract_lock_manager_line line;
		tract_observe_line(r, tract_lock_line(r, id, 0), &line);
		if (line.granted_node <= r->hdr.max_nodes)
			m->grants[id].node = line.granted_node;
		if (line.last_node <= r->hdr.max_nodes)
			m->grants[id].last = line.last_node;
		m->grants[id].req = line.granted_req;
		m->grants[id].seq = line.grant_seq;
	}
	if (pthread_create(&m->thread, NULL, run, m)) {
		free(m->grants);
		free(m->table);
		free(m);
		return TRACT_E_SYS;
	}
	*out = m;
	return TRACT_OK;
}

/* Stops and frees the manager thread. */
void tract_manager_stop(tract_manager *m)
{
	if (!m)
		return;
	m->stop = 1;
	pthread_join(m->thread, NULL);
	free(m->grants);
	free(m->table);
	free(m);
}

/* Manager counters: scans, grants, releases seen, idle sleeps (4 values). */
int tract_manager_stats(const tract_manager *m, uint64_t *out4)
{
	if (!m || !out4)
		return TRACT_E_INVAL;
	out4[0] = m->scans;
	out4[1] = m->grants_issued;
	out4[2] = m->releases;
	out4[3] = m->sleeps;
	return TRACT_OK;
}
