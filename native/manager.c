/*
 * manager.c -- the lock manager: a native thread that arbitrates the global
 * tier of every lock, and the fencing of managers (docs/PROTOCOLS.md §4).
 *
 * Each scan observes the whole lock table at once (one invalidate pass, one
 * fence), then for every lock: a grant whose node went IDLE or moved on to
 * a newer request is released; a lock with no grant is granted to the next
 * WAITING node after the last one granted (round-robin: no node starves).
 * The manager only writes line 0 of each lock and never holds a lock.
 *
 * Fencing: a manager runs under a token, its node's claim in the node table
 * ((manager_epoch << TRACT_TOKEN_NODE_BITS) | node, tract.h); the largest claim is the current manager.
 * Every grant carries the token, and a requester enters only with a grant of
 * the current token (lock.c).  A manager that finds a larger claim stops,
 * and one that starts adopts each lock's holder from the LOCKED slots
 * before it grants anything, so a takeover -- even from a manager that is
 * still running, paused or unaware -- never admits two holders
 * (tests/model/takeover.pml).
 *
 * It scans again at once after a scan that granted or released; while a
 * request or grant is live it spins briefly, then sleeps up to 20 us between
 * scans; when idle it sleeps growing up to idle_sleep_max_ns.  So on a small
 * machine it does not steal a core from the workers, and is woken promptly.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

struct grant {
	uint32_t node;      /* node + 1, 0 = none */
	uint32_t last;      /* node + 1 granted last */
	uint64_t req;
	uint64_t seq;
	uint32_t inherit;   /* node + 1 of a dead host whose section the next
			     * holder must repair first (published in line 0) */
	int entered;        /* the holder of this grant was seen LOCKED */
};

struct tract_manager {
	pthread_t thread;
	tract_region *r;
	int stop;           /* set by the stopping thread, read by the manager: atomics */
	int superseded;     /* set by the manager (release: `by` first), read by the agent */
	uint64_t token;     /* this manager's claim; 0 = unfenced (no claims) */
	uint64_t by;        /* the claim that superseded it (written before superseded) */
	uint64_t idle_sleep_max_ns;
	struct grant *grants;
	uint8_t *table;     /* private copy of the lock table */
	uint8_t *dead;      /* per node: declared dead (verdict.c), as of this scan */
	uint64_t scans, grants_issued, releases, sleeps, repairs, revoked;
};

/* the largest manager claim in the node table; *node gets its node.  Every
 * claim line is invalidated first and fenced once, then loaded: one fence for
 * the whole table, not one per node -- a requester pays this per acquisition
 * (internal) */
uint64_t tract_current_token(tract_region *r, int32_t *node, int site)
{
	const struct tract_section *sec = tract_sec(r, TRACT_SEC_NODES);
	uint32_t n = sec->count < r->hdr.max_nodes ? (uint32_t)sec->count : r->hdr.max_nodes;
	for (uint32_t k = 0; k < n && TRACT_KEEP(site); k++)
		r->ops->invalidate(r, sec->offset + (uint64_t)k * sec->entry_size, TRACT_LINE);
	r->ops->fence(r);
	uint64_t best = 0;
	int32_t who = -1;
	for (uint32_t k = 0; k < n; k++) {
		struct tract_node_entry e;
		r->ops->load(r, sec->offset + (uint64_t)k * sec->entry_size, &e, TRACT_LINE);
		uint64_t token = ((uint64_t)e.manager_epoch << TRACT_TOKEN_NODE_BITS) | k;
		if (e.manager_epoch && token > best) {
			best = token;
			who = (int32_t)k;
		}
	}
	if (node)
		*node = who;
	return best;
}

/* The current manager's fencing token and its node (-1, token 0 if none). */
int tract_manager_current(tract_region *r, uint64_t *token, int32_t *node)
{
	if (!r || !token)
		return TRACT_E_INVAL;
	*token = tract_current_token(r, node, SITE_NONE);
	return TRACT_OK;
}

/* writes a lock's manager line from the private state; the caller fences (internal) */
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
	line.token = m->token;
	line.inherited = m->grants[id].inherit;
	tract_write_line_at(r, tract_lock_line(r, id, 0), &line, SITE_MGR_PUBLISH_GRANT);
}

/* whether line 0 still says what this manager last published (internal) */
static int line_is_mine(const struct tract_manager *m, const struct tract_lock_manager_line *l,
			uint32_t id)
{
	const struct grant *g = &m->grants[id];
	return l->token == m->token && l->granted_node == g->node && l->last_node == g->last &&
	       l->granted_req == g->req && l->grant_seq == g->seq && l->inherited == g->inherit;
}

/* whether node n's WAITING request S on lock id may be granted now.  A request
 * a walk made ahead names the walk's request just below it (after_lock,
 * after_req), and waits until that one is granted (by this scan too: locks are
 * scanned in ascending order) or gone -- released or withdrawn (its slot IDLE
 * at that sequence) or followed by a newer request of the node (a larger
 * sequence: a node's sequences only grow).  A lower sequence is a request not
 * seen yet: the scan's copy of the table is not taken at one instant, and
 * the walker publishes the request below before the one above it.  So a walk
 * is granted its locks in ascending order, holds only locks below the one it
 * waits for, and no cycle of waits can form (docs/PROTOCOLS.md §4) (internal) */
static int walk_ready(const struct tract_manager *m, uint32_t id, uint32_t n,
		      const struct tract_lock_node_slot *s)
{
	if (!s->after_lock || !TRACT_KEEP(SITE_MGR_WALK_ORDER))
		return 1;
	uint32_t below = s->after_lock - 1;
	if (below >= id)         /* not a lower lock: no walk names one */
		return 1;
	if (m->grants[below].node == n + 1 && m->grants[below].req == s->after_req)
		return 1;
	const struct tract_section *sec = tract_sec(m->r, TRACT_SEC_LOCKS);
	const struct tract_lock_node_slot *b = (const void *)(m->table + (uint64_t)below *
							      sec->entry_size + TRACT_LINE);
	return b[n].request_seq > s->after_req ||
	       (b[n].request_seq == s->after_req && b[n].state == TRACT_LOCK_IDLE);
}

/* one pass over every lock; returns SCAN_WROTE if it granted or released,
 * SCAN_BUSY if a request or grant is live, else SCAN_IDLE (internal) */
enum { SCAN_IDLE, SCAN_BUSY, SCAN_WROTE };

static int scan(struct tract_manager *m)
{
	tract_region *r = m->r;
	/* the claims and the verdicts, one pass over the node table */
	uint64_t current = tract_observe_nodes(r, m->dead, SITE_MGR_OBSERVE_CLAIMS);
	if (m->token) {
		/* fenced: a larger claim means another manager took over */
		if (current > m->token) {
			__atomic_store_n(&m->by, current, __ATOMIC_RELAXED);
			__atomic_store_n(&m->superseded, 1, __ATOMIC_RELEASE);
			return SCAN_IDLE;
		}
	}
	const struct tract_section *sec = tract_sec(r, TRACT_SEC_LOCKS);
	uint32_t nodes = r->hdr.max_nodes;
	if (TRACT_KEEP(SITE_MGR_OBSERVE_SLOTS))
		r->ops->invalidate(r, sec->offset, sec->length);
	r->ops->fence(r);
	r->ops->load(r, sec->offset, m->table, sec->length);
	int busy = 0, wrote = 0;
	for (uint32_t id = 0; id < r->hdr.lock_count; id++) {
		const uint8_t *entry = m->table + (uint64_t)id * sec->entry_size;
		const struct tract_lock_manager_line *line = (const void *)entry;
		const struct tract_lock_node_slot *slot = (const void *)(entry + TRACT_LINE);
		struct grant *g = &m->grants[id];
		if (m->token && !line_is_mine(m, line, id)) {
			/* a superseded manager wrote it after this one took over */
			__atomic_fetch_add(&m->repairs, 1, __ATOMIC_RELAXED);
			wrote = 1;
			publish_grant(m, id);
		}
		if (g->node) {
			const struct tract_lock_node_slot *s = &slot[g->node - 1];
			if (m->dead[g->node - 1]) {
				/* taken back from a dead host: if it entered, the
				 * next holder repairs what it left (so does the
				 * next one, if this grant carried a repair it
				 * never made) */
				if (s->state == TRACT_LOCK_LOCKED && s->request_seq == g->req)
					g->inherit = g->node;
				g->node = 0;
				__atomic_fetch_add(&m->revoked, 1, __ATOMIC_RELAXED);
				wrote = 1;
				publish_grant(m, id);
			} else if (s->state == TRACT_LOCK_IDLE || s->request_seq != g->req) {
				/* a repair is done once its holder was seen inside;
				 * one released unseen passes on (a repair twice is
				 * harmless, none is not) */
				if (g->entered)
					g->inherit = 0;
				g->node = 0;
				__atomic_fetch_add(&m->releases, 1, __ATOMIC_RELAXED);
				wrote = 1;
				publish_grant(m, id);
			} else {
				if (s->state == TRACT_LOCK_LOCKED)
					g->entered = 1;
				busy = 1;
				continue;
			}
		}
		for (uint32_t k = 0; k < nodes; k++) {
			uint32_t n = (g->last + k) % nodes;   /* node after the last granted */
			if (slot[n].state != TRACT_LOCK_WAITING || m->dead[n])
				continue;
			busy = 1;        /* a live request, granted now or later */
			if (walk_ready(m, id, n, &slot[n])) {
				g->node = n + 1;
				g->last = n + 1;
				g->req = slot[n].request_seq;
				g->entered = 0;
				g->seq++;
				__atomic_fetch_add(&m->grants_issued, 1, __ATOMIC_RELAXED);
				publish_grant(m, id);
				wrote = busy = 1;
				break;
			}
		}
	}
	if (wrote)
		r->ops->fence(r);
	__atomic_fetch_add(&m->scans, 1, __ATOMIC_RELAXED);   /* read by stats */
	return wrote ? SCAN_WROTE : busy ? SCAN_BUSY : SCAN_IDLE;
}

/* while a grant or request is live and a scan changed nothing, the manager
 * waits at most this long before the next scan: it spins first (a grant
 * within microseconds where a core is free), then sleeps, so that on cores
 * shared with busy workers it is a short sleeper the scheduler wakes promptly,
 * not a spinner that waits a whole slice for each scan (internal) */
#define BUSY_SLEEP_MAX_NS 20000ULL

/* the manager thread (internal) */
static void *run(void *arg)
{
	struct tract_manager *m = arg;
	uint32_t idle_round = 0, busy_round = 0;
	while (!__atomic_load_n(&m->stop, __ATOMIC_ACQUIRE) &&
	       !__atomic_load_n(&m->superseded, __ATOMIC_RELAXED)) {
		int got = scan(m);
		if (got == SCAN_WROTE) {
			idle_round = busy_round = 0;
		} else if (got == SCAN_BUSY) {
			idle_round = 0;
			tract_backoff(&busy_round, BUSY_SLEEP_MAX_NS);
		} else {
			busy_round = 0;
			if (idle_round >= 64)
				__atomic_fetch_add(&m->sleeps, 1, __ATOMIC_RELAXED);
			tract_backoff(&idle_round, m->idle_sleep_max_ns);
		}
	}
	tract_backoff_end();
	return NULL;
}

/* Takes over the lock table.  Fenced: each lock's holder is the LOCKED slot
 * with the largest grant token (a requester that entered under an older
 * manager and was not seen here sees this manager's claim and withdraws);
 * then every line 0 is republished under this token.  Unfenced (no claims,
 * one manager by the operator's word): resume from line 0 as published. */
static void take_over(struct tract_manager *m)
{
	tract_region *r = m->r;
	const struct tract_section *sec = tract_sec(r, TRACT_SEC_LOCKS);
	tract_observe_nodes(r, m->dead, SITE_NONE);
	if (TRACT_KEEP(SITE_MGR_OBSERVE_ADOPT))
		r->ops->invalidate(r, sec->offset, sec->length);
	r->ops->fence(r);
	r->ops->load(r, sec->offset, m->table, sec->length);
	uint32_t nodes = r->hdr.max_nodes;
	for (uint32_t id = 0; id < r->hdr.lock_count; id++) {
		const uint8_t *entry = m->table + (uint64_t)id * sec->entry_size;
		const struct tract_lock_manager_line *line = (const void *)entry;
		const struct tract_lock_node_slot *slot = (const void *)(entry + TRACT_LINE);
		struct grant *g = &m->grants[id];
		g->last = line->last_node <= nodes ? line->last_node : 0;
		g->seq = line->grant_seq;
		/* a repair the previous manager's grant carried stays owed (a dead
		 * holder adopted below is taken back, with its repair, at the
		 * first scan) */
		g->inherit = line->inherited <= nodes ? line->inherited : 0;
		g->entered = 0;
		if (!m->token) {
			g->node = line->granted_node <= nodes ? line->granted_node : 0;
			g->req = line->granted_req;
			continue;
		}
		int found = 0;
		uint64_t best = 0;
		for (uint32_t k = 0; k < nodes; k++) {
			/* of equal tokens a live node's: a dead host's slot keeps
			 * saying LOCKED after its grant was taken back and given,
			 * under the same token, to the holder */
			int better = !found || slot[k].grant_token > best ||
				     (slot[k].grant_token == best && m->dead[g->node - 1] && !m->dead[k]);
			if (slot[k].state == TRACT_LOCK_LOCKED && better) {
				found = 1;
				best = slot[k].grant_token;
				g->node = k + 1;
				g->req = slot[k].request_seq;
			}
		}
		publish_grant(m, id);
	}
	r->ops->fence(r);
}

/* Starts the manager thread; idle_sleep_max_ns caps its back-off when nothing is pending. */
int tract_manager_start(tract_region *r, uint64_t idle_sleep_max_ns, tract_manager **out)
{
	if (!r || !out || (r->flags & TRACT_ATTACH_READONLY))
		return TRACT_E_INVAL;
	int32_t who;
	uint64_t current = tract_current_token(r, &who, SITE_NONE);
	if (current && who != (int32_t)r->node_id)
		return TRACT_E_SUPERSEDED;
	struct tract_manager *m = calloc(1, sizeof(*m));
	if (!m)
		return TRACT_E_NOMEM;
	m->r = r;
	m->token = current;
	m->idle_sleep_max_ns = idle_sleep_max_ns ? idle_sleep_max_ns : 1000000ULL;
	m->grants = calloc(r->hdr.lock_count, sizeof(*m->grants));
	m->table = malloc(tract_sec(r, TRACT_SEC_LOCKS)->length);
	m->dead = calloc(r->hdr.max_nodes, 1);
	if (!m->grants || !m->table || !m->dead) {
		free(m->grants);
		free(m->table);
		free(m->dead);
		free(m);
		return TRACT_E_NOMEM;
	}
	take_over(m);
	if (pthread_create(&m->thread, NULL, run, m)) {
		free(m->grants);
		free(m->table);
		free(m->dead);
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
	__atomic_store_n(&m->stop, 1, __ATOMIC_RELEASE);
	pthread_join(m->thread, NULL);
	free(m->grants);
	free(m->table);
	free(m->dead);
	free(m);
}

/* 1 if a later claim superseded the manager (*by gets it), 0 while current. */
int tract_manager_superseded(const tract_manager *m, uint64_t *by)
{
	if (!m)
		return TRACT_E_INVAL;
	int sup = __atomic_load_n(&m->superseded, __ATOMIC_ACQUIRE);   /* then `by` is set */
	if (by)
		*by = sup ? __atomic_load_n(&m->by, __ATOMIC_RELAXED) : 0;
	return sup ? 1 : 0;
}

/* Manager counters: scans, grants, releases seen, idle sleeps, line repairs,
 * grants taken back from dead hosts (6 values). */
int tract_manager_stats(const tract_manager *m, uint64_t *out6)
{
	if (!m || !out6)
		return TRACT_E_INVAL;
	out6[0] = __atomic_load_n(&m->scans, __ATOMIC_RELAXED);
	out6[1] = __atomic_load_n(&m->grants_issued, __ATOMIC_RELAXED);
	out6[2] = __atomic_load_n(&m->releases, __ATOMIC_RELAXED);
	out6[3] = __atomic_load_n(&m->sleeps, __ATOMIC_RELAXED);
	out6[4] = __atomic_load_n(&m->repairs, __ATOMIC_RELAXED);
	out6[5] = __atomic_load_n(&m->revoked, __ATOMIC_RELAXED);
	return TRACT_OK;
}
