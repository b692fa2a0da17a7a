/*
 * lock.c -- the two-tier lock, requester side (docs/PROTOCOLS.md §4).
 *
 * acquire: local robust mutex -> publish WAITING (with a fresh request_seq)
 *          in this node's slot line -> poll the manager's line until it
 *          grants this node this request -> publish LOCKED with the grant's
 *          token -> observe the manager claims: enter only if the token is
 *          the current one, else withdraw to WAITING and go on polling.
 * release: publish IDLE -> unlock the local mutex.
 * A grant that takes the lock back from a dead host says so (line 0's
 * `inherited`): acquire then returns TRACT_RECOVERED, as when a process of
 * this node died holding it, and the caller repairs before its section.
 *
 * Only the holder of the node's local mutex writes the node's slot line and
 * only the manager writes line 0, so every line has one writer and no atomic
 * instruction touches the region.
 */
#include <string.h>
#include <unistd.h>

#include "internal.h"

#define MAX_SLEEP_NS 100000ULL

/* writes this node's slot for lock id: state, pid, request seq, and for a
 * WAITING request made ahead in a walk (q's after_lock) the request it
 * follows (internal) */
static void publish_request(tract_region *r, uint32_t id, uint32_t state, uint64_t req,
			    uint64_t grant_token, const struct tract_lock_req *q, int site)
{
	struct tract_lock_node_slot s;
	memset(&s, 0, sizeof(s));
	s.state = state;
	s.pid = (uint32_t)getpid();
	s.request_seq = req;
	s.since_ns = tract_now_ns();
	s.grant_token = grant_token;
	if (q && state == TRACT_LOCK_WAITING && q->after_lock) {
		s.after_lock = q->after_lock;
		s.after_req = q->after_req;
	}
	tract_publish_line_at(r, tract_lock_line(r, id, 1 + r->node_id), &s, site);
}

/* writes this node's slot for lock id: state, pid, request seq (internal) */
static void publish_slot(tract_region *r, uint32_t id, uint32_t state, uint64_t req,
			 uint64_t grant_token, int site)
{
	publish_request(r, id, state, req, grant_token, NULL, site);
}

/* fills the wait report from what the region says now (internal) */
static void describe_wait(tract_region *r, uint32_t id, uint32_t stage, struct tract_lock_wait *w)
{
	struct tract_lock_manager_line m;
	struct tract_lock_node_slot s;
	if (!w)
		return;
	memset(w, 0, sizeof(*w));
	w->stage = stage;
	tract_observe_line(r, tract_lock_line(r, id, 0), &m);
	w->granted_node = m.granted_node <= r->hdr.max_nodes ? m.granted_node : 0;
	if (w->granted_node) {
		tract_observe_line(r, tract_lock_line(r, id, w->granted_node), &s);
		w->holder_pid = s.pid;
		uint64_t now = tract_now_ns();
		w->held_ns = now > m.grant_ns ? now - m.grant_ns : 0;
	}
}

/* what the manager line says of this node's slot (mine, just observed):
 * GRANT_HELD, the current manager's line grants this node that request (a
 * manager that took over since re-grants a LOCKED slot under its own token);
 * GRANT_UNDECIDED, the line is not the current manager's yet (a takeover in
 * progress, which will adopt a LOCKED slot); GRANT_NOT_HELD (internal) */
enum { GRANT_NOT_HELD, GRANT_HELD, GRANT_UNDECIDED };

static int grant_state(tract_region *r, uint32_t id, const struct tract_lock_node_slot *mine)
{
	struct tract_lock_manager_line m;
	tract_observe_line(r, tract_lock_line(r, id, 0), &m);
	if (tract_current_token(r, NULL, SITE_NONE) != m.token)
		return GRANT_UNDECIDED;
	return m.granted_node == r->node_id + 1 && m.granted_req == mine->request_seq ?
	       GRANT_HELD : GRANT_NOT_HELD;
}

/* whether the slot's holder let the local mutex go inside its critical
 * section (tract_lock_abandon): a dead holder, whatever its pid (internal) */
static int abandoned_by(const struct tract_local_mutex *lm, const struct tract_lock_node_slot *mine)
{
	/* read without the mutex too (tract_lock_take_dead's first look) */
	uint32_t pid = __atomic_load_n(&lm->abandoned, __ATOMIC_RELAXED);
	return pid && pid == mine->pid;
}

/* whether this node's slot names a dead process holding the lock: LOCKED by
 * a pid of this host that is gone (owner_died: the local mutex said so) or
 * that abandoned it, with a grant held or undecided (internal) */
static int held_by_dead(tract_region *r, uint32_t id, const struct tract_lock_node_slot *mine,
			int owner_died)
{
	return mine->state == TRACT_LOCK_LOCKED &&
	       (abandoned_by(tract_local_lock(r, id), mine) || (mine->pid != (uint32_t)getpid() &&
			      (owner_died || tract_pid_dead(mine->pid)))) &&
	       grant_state(r, id, mine) != GRANT_NOT_HELD;
}

/*
 * Requests global lock lock_id without waiting for the grant: takes the
 * local mutex, then publishes WAITING with a fresh request sequence; the
 * grant is awaited by tract_lock_await (or the request withdrawn by
 * tract_lock_cancel) by the same thread.  A caller may request the next of
 * several locks while it still holds an earlier one, so that the manager
 * grants it while the caller works (the index's walk over its stripes,
 * index_stripe.c): deadlock is impossible as long as every caller holding a
 * lock requests only locks of higher id (docs/PROTOCOLS.md §4) (internal).
 */
static int request(tract_region *r, uint32_t lock_id, uint64_t timeout_ns,
		   struct tract_lock_req *q, struct tract_lock_wait *wait, int ahead);

int tract_lock_request(tract_region *r, uint32_t lock_id, uint64_t timeout_ns,
		       struct tract_lock_req *q, struct tract_lock_wait *wait)
{
	if (q)
		q->after_lock = 0;
	return request(r, lock_id, timeout_ns, q, wait, 0);
}

/*
 * A request made ahead in a walk (index_stripe.c): the walk requests every
 * stripe it will enter at once, each naming the walk's request just below
 * it, and the manager grants a named request only once the one it follows is
 * granted or gone -- so a walk holds its grants in ascending order only, and
 * waits for a lock only while it holds lower ones, which keeps the walk
 * deadlock-free (docs/PROTOCOLS.md §4).  Only the local tier's mutex is
 * tried: another process of the node holding or requesting it is never
 * waited for here (internal).
 */
int tract_lock_request_after(tract_region *r, uint32_t lock_id, struct tract_lock_req *q,
			     uint32_t after_id, const struct tract_lock_req *after)
{
	if (!q || !after || after_id >= lock_id)
		return TRACT_E_INVAL;
	q->after_lock = after_id + 1;
	q->after_req = after->req;
	return request(r, lock_id, 0, q, NULL, 1);
}

/* tract_lock_request; AHEAD: a walk's request made ahead, which does not take
 * a dead holder's grant over (that would hold a lock above the ones the walk
 * still awaits): put back as found, it is requested in turn (internal) */
static int request(tract_region *r, uint32_t lock_id, uint64_t timeout_ns,
		   struct tract_lock_req *q, struct tract_lock_wait *wait, int ahead)
{
	if (!r || lock_id >= r->hdr.lock_count || (r->flags & TRACT_ATTACH_READONLY) || !q)
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	q->start = tract_mono_ns();
	struct tract_local_mutex *lm = tract_local_lock(r, lock_id);

	int rc = tract_robust_lock(&lm->mu, timeout_ns);
	if (rc < 0) {
		describe_wait(r, lock_id, 1, wait);
		return rc;
	}
	q->recovered = rc == TRACT_RECOVERED;
	q->inherited = 0;
	q->dead_host = 0;

	/* request: a fresh sequence number, so a stale grant is never mistaken
	 * for this one; the previous holder on this node wrote the line last */
	uint64_t slot_off = tract_lock_line(r, lock_id, 1 + r->node_id);
	struct tract_lock_node_slot mine;
	tract_observe_line_at(r, slot_off, &mine, SITE_LOCK_OBSERVE_SEQ);
	/* the mutex of a holder that abandoned it comes free, not owner-dead */
	q->recovered |= abandoned_by(lm, &mine);
	if (held_by_dead(r, lock_id, &mine, q->recovered)) {
		if (ahead) {
			/* left for the walk to request in turn: the mutex marked as the
			 * dead holder's again (its owner-died state was taken here), so
			 * whoever takes it next finds the dead holder, as this did */
			__atomic_store_n(&lm->abandoned, mine.pid, __ATOMIC_RELAXED);
			pthread_mutex_unlock(&lm->mu);
			return TRACT_E_TIMEOUT;
		}
		/* a process of this node died holding the lock (whether or not this
		 * lock of the mutex saw it die: the agent may have made the mutex
		 * consistent and left the slot for later): keep its request, so the
		 * grant passes to this process without the lock ever being free --
		 * no other node enters before this one has repaired what it left */
		q->req = mine.request_seq;
		q->inherited = 1;
		/* repaired by its caller whether or not this lock of the mutex saw
		 * the owner die (TRACT_RECOVERED): a takeover that skipped the
		 * repair left a half-done section, and an untold pin move, behind */
		q->recovered = 1;
		__atomic_store_n(&lm->abandoned, 0, __ATOMIC_RELAXED);   /* ours now, to repair */
		return TRACT_OK;
	}
	__atomic_store_n(&lm->abandoned, 0, __ATOMIC_RELAXED);
	q->req = mine.request_seq + 1;
	publish_request(r, lock_id, TRACT_LOCK_WAITING, q->req, 0, q, SITE_LOCK_PUBLISH_WAITING);
	return TRACT_OK;
}

/* Withdraws a request tract_lock_request made (not granted, or granted and
 * not entered): publishes IDLE, unlocks the local mutex; a grant racing with
 * this is released by the manager when it sees IDLE, so nothing leaks (internal). */
void tract_lock_cancel(tract_region *r, uint32_t lock_id, const struct tract_lock_req *q)
{
	struct tract_lock_node_slot mine;
	if (q->inherited) {
		/* a dead holder's request this process kept but never entered: the
		 * slot stays the dead holder's (LOCKED), for whoever takes the lock
		 * next to keep it and repair, instead of freeing the lock unrepaired */
		tract_observe_line(r, tract_lock_line(r, lock_id, 1 + r->node_id), &mine);
		if (mine.pid != (uint32_t)getpid()) {
			/* marked the dead holder's again (this request took the
			 * mutex's owner-died state), so the next to take it finds
			 * the dead holder even before its pid looks gone */
			struct tract_local_mutex *lm = tract_local_lock(r, lock_id);
			__atomic_store_n(&lm->abandoned, mine.pid, __ATOMIC_RELAXED);
			pthread_mutex_unlock(&lm->mu);
			return;
		}
	}
	publish_slot(r, lock_id, TRACT_LOCK_IDLE, q->req, 0, SITE_NONE);
	pthread_mutex_unlock(&tract_local_lock(r, lock_id)->mu);
}

/* Waits, within timeout_ns of the request, for the current manager's grant of
 * the request q, and enters; on a timeout the request is withdrawn (internal). */
int tract_lock_await(tract_region *r, uint32_t lock_id, struct tract_lock_req *q,
		     uint64_t timeout_ns, struct tract_lock_wait *wait)
{
	struct tract_local_mutex *lm = tract_local_lock(r, lock_id);
	uint64_t mgr_off = tract_lock_line(r, lock_id, 0);
	uint64_t floor = 0;   /* grants of smaller tokens were superseded */
	uint32_t round = 0;
	for (;;) {
		struct tract_lock_manager_line m;
		tract_observe_line_at(r, mgr_off, &m, SITE_LOCK_OBSERVE_GRANT);
		if (m.granted_node == r->node_id + 1 && m.granted_req == q->req && m.token >= floor) {
			/* LOCKED first, then the claims (publish ends with a full
			 * fence): a manager taking over either sees this slot and
			 * adopts it, or its claim is seen here */
			publish_slot(r, lock_id, TRACT_LOCK_LOCKED, q->req, m.token,
				     SITE_LOCK_PUBLISH_LOCKED);
			uint64_t current = tract_current_token(r, NULL, SITE_LOCK_OBSERVE_CLAIMS);
			if (current == m.token) {
				/* taken back from a dead host that held it: this
				 * holder repairs what it left (its caller, as for a
				 * dead process of this node) */
				q->dead_host = m.inherited;
				break;
			}
			/* a grant of a superseded manager: withdraw, keep the request */
			publish_request(r, lock_id, TRACT_LOCK_WAITING, q->req, 0, q, SITE_NONE);
			floor = current > m.token ? current : m.token + 1;
		}
		if (tract_mono_ns() - q->start > timeout_ns) {
			tract_backoff_end();
			describe_wait(r, lock_id, 2, wait);
			tract_lock_cancel(r, lock_id, q);
			return TRACT_E_TIMEOUT;
		}
		tract_backoff(&round, MAX_SLEEP_NS);
	}
	tract_backoff_end();
	lm->acquired++;
	lm->wait_ns += tract_mono_ns() - q->start;
	pthread_mutex_lock(&r->held_mu);
	r->held[lock_id] = 1;
	r->held_seq[lock_id] = q->req;
	pthread_mutex_unlock(&r->held_mu);
	return q->recovered || q->dead_host ? TRACT_RECOVERED : TRACT_OK;
}

/* Acquires global lock lock_id (local mutex, then a grant from the lock manager). */
int tract_lock_acquire(tract_region *r, uint32_t lock_id, uint64_t timeout_ns,
		       struct tract_lock_wait *wait)
{
	struct tract_lock_req q;
	int rc = tract_lock_request(r, lock_id, timeout_ns, &q, wait);
	if (rc < 0)
		return rc;
	return tract_lock_await(r, lock_id, &q, timeout_ns, wait);
}

/* Releases global lock lock_id: publish IDLE, then unlock the local mutex. */
int tract_lock_release(tract_region *r, uint32_t lock_id)
{
	if (!r || lock_id >= r->hdr.lock_count)
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	pthread_mutex_lock(&r->held_mu);
	int held = r->held[lock_id];
	r->held[lock_id] = 0;
	pthread_mutex_unlock(&r->held_mu);
	if (!held)
		return TRACT_E_NOT_HELD;
	struct tract_lock_node_slot mine;
	uint64_t slot_off = tract_lock_line(r, lock_id, 1 + r->node_id);
	tract_observe_line_at(r, slot_off, &mine, SITE_LOCK_OBSERVE_RELEASE);
	publish_slot(r, lock_id, TRACT_LOCK_IDLE, mine.request_seq, 0, SITE_LOCK_PUBLISH_IDLE);
	pthread_mutex_unlock(&tract_local_lock(r, lock_id)->mu);
	return TRACT_OK;
}

/*
 * Lets go of every global lock this handle holds as a dead holder would:
 * the slot stays LOCKED (no other node enters), the local mutex is marked
 * abandoned by this pid and unlocked, so the node's next process to take it,
 * or its agent, takes it over and repairs what the critical section may have
 * left half done -- as for a process killed inside.  For a handle closed
 * inside a critical section (an exception between acquire and release):
 * unmapping the node-local segment with the mutex still held would leave it
 * on the thread's robust list.  Returns how many it could not let go (held by
 * another thread of this process: pthreads lets only the owner unlock).
 */
int tract_lock_abandon(tract_region *r)
{
	if (!r || !r->local)
		return 0;
	int left = 0;
	pthread_mutex_lock(&r->held_mu);
	for (uint32_t i = 0; i < r->hdr.lock_count; i++) {
		if (!r->held[i])
			continue;
		struct tract_local_mutex *lm = tract_local_lock(r, i);
		uint32_t before = __atomic_load_n(&lm->abandoned, __ATOMIC_RELAXED);
		__atomic_store_n(&lm->abandoned, (uint32_t)getpid(), __ATOMIC_RELAXED);
		if (pthread_mutex_unlock(&lm->mu) == 0) {
			r->held[i] = 0;
		} else {
			__atomic_store_n(&lm->abandoned, before, __ATOMIC_RELAXED);
			left++;
		}
	}
	pthread_mutex_unlock(&r->held_mu);
	return left;
}

/* Per-lock acquisition count and total wait of this node (local statistics). */
int tract_lock_stats(const tract_region *r, uint32_t lock_id, uint64_t *acquired,
		     uint64_t *wait_ns)
{
	if (!r || lock_id >= r->hdr.lock_count)
		return TRACT_E_INVAL;
	if (!r->local)
		return TRACT_E_NO_LOCAL;
	struct tract_local_mutex *lm = tract_local_lock(r, lock_id);
	if (acquired)
		*acquired = lm->acquired;
	if (wait_ns)
		*wait_ns = lm->wait_ns;
	return TRACT_OK;
}

/*
 * Takes lock id from a dead process of this node, if its slot names one
 * (recover.c runs this for every lock, every heartbeat):
 *   TRACT_RECOVERED  the dead process held the current grant: the caller now
 *                    holds the lock (the grant kept, never free in between),
 *                    repairs what the dead holder left, and calls
 *                    tract_lock_release;
 *   TRACT_OK, *withdrawn = 1  it only requested (or held a grant that is no
 *                    longer current): its request is withdrawn (IDLE);
 *   TRACT_OK, *withdrawn = 0  nothing to do: idle, alive, or the local mutex
 *                    is held by a live process (which inherits it itself).
 * The lock knows nothing of what it protects: the repair is the caller's
 * (internal).
 */
int tract_lock_take_dead(tract_region *r, uint32_t id, int *withdrawn)
{
	*withdrawn = 0;
	struct tract_lock_node_slot mine;
	uint64_t slot_off = tract_lock_line(r, id, 1 + r->node_id);
	tract_observe_line(r, slot_off, &mine);
	struct tract_local_mutex *lm = tract_local_lock(r, id);
	if (mine.state == TRACT_LOCK_IDLE ||
	    (!tract_pid_dead(mine.pid) && !abandoned_by(lm, &mine)))
		return TRACT_OK;              /* idle, alive, or not ours to judge */
	if (mine.state == TRACT_LOCK_LOCKED && grant_state(r, id, &mine) == GRANT_UNDECIDED)
		return TRACT_OK;              /* a takeover in progress: next heartbeat */
	if (tract_robust_lock(&lm->mu, 0) < 0)
		return TRACT_OK;              /* a live process holds it now */
	/* re-check under the mutex: a live successor may have taken over */
	tract_observe_line(r, slot_off, &mine);
	int grant = mine.state == TRACT_LOCK_LOCKED ? grant_state(r, id, &mine) : GRANT_NOT_HELD;
	int dead = tract_pid_dead(mine.pid) || abandoned_by(lm, &mine);
	if (mine.state == TRACT_LOCK_IDLE || !dead || grant == GRANT_UNDECIDED) {
		/* (undecided: the slot stays LOCKED for whoever takes the lock next,
		 * which keeps its request, held_by_dead) */
		pthread_mutex_unlock(&lm->mu);
		return TRACT_OK;
	}
	__atomic_store_n(&lm->abandoned, 0, __ATOMIC_RELAXED);   /* its holding is decided here */
	if (grant == GRANT_HELD) {
		/* adopt the grant under this process's pid: if it dies repairing,
		 * the next recovery finds it dead and starts over */
		struct tract_lock_manager_line m;
		tract_observe_line(r, tract_lock_line(r, id, 0), &m);
		publish_slot(r, id, TRACT_LOCK_LOCKED, mine.request_seq, m.token, SITE_NONE);
		pthread_mutex_lock(&r->held_mu);
		r->held[id] = 1;
		r->held_seq[id] = mine.request_seq;
		pthread_mutex_unlock(&r->held_mu);
		return TRACT_RECOVERED;
	}
	publish_slot(r, id, TRACT_LOCK_IDLE, mine.request_seq, 0, SITE_NONE);
	pthread_mutex_unlock(&lm->mu);
	*withdrawn = 1;
	return TRACT_OK;
}
