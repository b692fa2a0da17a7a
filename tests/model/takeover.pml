/*
 * takeover.pml -- lock-manager takeover with fencing tokens
 * (docs/PROTOCOLS.md §4, "Manager takeover"; native/lock.c, native/manager.c).
 *
 * One lock, NODES requester nodes (one process each: the local tier is
 * checked by lock.pml) and MGRS manager hosts.  Manager m holds the fencing
 * token m + 1 and makes it current by publishing it in its claim line; the
 * current token is the largest claim.  Manager 0 runs from the start.  Every
 * later manager takes over at a moment of the checker's choosing (a standby
 * agent that found the manager's heartbeat stale), while the managers before
 * it go on running -- paused, slow, or unaware -- until they observe a larger
 * claim and stop, or crash at any moment.  That is the adversary: two
 * managers writing the grant line at once, one of them stale.
 *
 * The protocol checked:
 *  - a grant carries its manager's token; a requester that sees a grant of
 *    its request publishes LOCKED with that token, then observes the claims:
 *    it enters only if the grant's token is the current one, and otherwise
 *    withdraws to WAITING (same request) and waits for the current manager;
 *  - a manager, once its claim is published, adopts the holder: among the
 *    slots it observes LOCKED, the one with the largest token;
 *  - a manager observes the claims before every scan and stops when a larger
 *    one is current; every scan it repairs the grant line (a stale manager
 *    may have overwritten it).
 * The store -> load order in "publish LOCKED, then observe the claims" and
 * "publish the claim, then observe the slots" is what makes one of the two
 * parties see the other (the mfence after every publish, native/access.c).
 *
 * Publishes and observes are single steps on memory: as lock.pml shows, with
 * every write flushed and every read invalidated first, the private caches
 * hold nothing between steps.  The flushes are checked there; this model
 * checks the protocol above them.
 *
 * Checked: mutual exclusion (assert, exhaustive) and no starvation once the
 * takeovers are over (LTL, weak fairness).  Planted bugs, each of which must
 * fail: -DBUG_NO_RECHECK (the token is not checked: any grant is entered),
 * -DBUG_CHECK_BEFORE_LOCKED (the claims observed before LOCKED is
 * published, not after), -DBUG_NO_ADOPT (a new manager ignores the LOCKED
 * slots and grants afresh).
 */
#ifndef NODES
#define NODES 2
#endif
#ifndef MGRS
#define MGRS 2
#endif
#define IDLE 0
#define WAITING 1
#define LOCKED 2

/* memory: slot lines of the nodes, the grant line, the claim lines */
byte slot_st[NODES];
byte slot_rq[NODES];
byte slot_tok[NODES];
byte g_node;
byte g_rq;
byte g_tok;
byte claim[MGRS];

byte in_cs;
bool waiting[NODES];
bool cs[NODES];
bool done_takeover[MGRS];

/* the current token: the largest claim, observed one claim line at a time */
inline current_token(t, k) {
	t = 0; k = 0;
	do
	:: k < MGRS ->
		if
		:: claim[k] > t -> t = claim[k]
		:: else -> skip
		fi;
		k++
	:: else -> k = 0; break
	od
}

proctype requester(byte n) {
	byte req, gn, gr, gt, cur, k;
	do
	:: atomic { req = (slot_rq[n] + 1) % 2;
		slot_st[n] = WAITING; slot_rq[n] = req; slot_tok[n] = 0 };
		waiting[n] = 1;
wait:
		do
		:: atomic { gn = g_node; gr = g_rq; gt = g_tok };
			if
			:: gn == n + 1 && gr == req -> break
			:: else -> gn = 0; gr = 0; gt = 0
			fi
		od;
#ifdef BUG_CHECK_BEFORE_LOCKED
		current_token(cur, k);
#endif
		atomic { slot_st[n] = LOCKED; slot_tok[n] = gt };
#ifndef BUG_CHECK_BEFORE_LOCKED
#ifndef BUG_NO_RECHECK
		current_token(cur, k);
#else
		cur = gt;
#endif
#endif
		if
		:: cur != gt ->
			/* not the current manager's grant: withdraw, keep the request */
			atomic { slot_st[n] = WAITING; slot_tok[n] = 0 };
			gn = 0; gr = 0; gt = 0; cur = 0;
			goto wait
		:: else -> skip
		fi;
		atomic { waiting[n] = 0; in_cs++; cs[n] = 1 };
		assert(in_cs == 1);
		atomic { cs[n] = 0; in_cs-- };
		atomic { slot_st[n] = IDLE; slot_tok[n] = 0 };
		gn = 0; gr = 0; gt = 0; cur = 0
	od
}

proctype manager(byte m) {
	byte tok = m + 1, g, greq, last, k, n, st, rq, t, best;
	/* takeover: publish the claim, then adopt the holder from the slots */
	claim[m] = tok;
	done_takeover[m] = 1;
#ifndef BUG_NO_ADOPT
	k = 0; best = 0;
	do
	:: k < NODES ->
		atomic { st = slot_st[k]; rq = slot_rq[k]; t = slot_tok[k] };
		if
		:: st == LOCKED && t > best -> best = t; g = k + 1; greq = rq
		:: else -> skip
		fi;
		k++
	:: else -> break
	od;
	st = 0; rq = 0; t = 0; k = 0; best = 0;
#endif
	atomic { g_node = g; g_rq = greq; g_tok = tok };
	do
	:: m + 1 < MGRS -> break            /* an older manager may crash at any moment */
	:: true ->
		current_token(t, k);
		if
		:: t > tok -> break             /* superseded: stop */
		:: else -> t = 0
		fi;
		/* repair the grant line a stale manager may have overwritten */
		if
		:: g_node != g || g_rq != greq || g_tok != tok ->
			atomic { g_node = g; g_rq = greq; g_tok = tok }
		:: else -> skip
		fi;
		if
		:: g != 0 ->
			atomic { st = slot_st[g - 1]; rq = slot_rq[g - 1] };
			if
			:: st == IDLE || rq != greq ->
				g = 0; atomic { g_node = 0; g_rq = greq; g_tok = tok }
			:: else -> skip
			fi;
			st = 0; rq = 0
		:: else -> skip
		fi;
		if
		:: g == 0 ->
			k = 0;
			do
			:: k < NODES ->
				n = (last + k) % NODES;
				atomic { st = slot_st[n]; rq = slot_rq[n] };
				if
				:: st == WAITING ->
					g = n + 1; last = n + 1; greq = rq;
					atomic { g_node = g; g_rq = greq; g_tok = tok };
					st = 0; rq = 0; n = 0; k = 0;
					break
				:: else -> st = 0; rq = 0; n = 0; k++
				fi
			:: else -> k = 0; break
			od
		:: else -> skip
		fi
	od
}

init {
	byte n, m;
	atomic {
		for (n : 0 .. NODES - 1) {
			run requester(n)
		}
		for (m : 0 .. MGRS - 1) {
			run manager(m)
		}
	}
}

ltl no_starvation { [] (waiting[0] -> <> cs[0]) }
