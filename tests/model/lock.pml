/*
 * lock.pml -- the two-tier lock of native/lock.c and native/manager.c,
 * checked under a non-coherent memory model (docs/PROTOCOLS.md §4).
 *
 * Hosts: nodes 0..NODES-1 and the lock manager's host.  Every host has a
 * private write-back cache of the shared lines: a store stays in the cache
 * (invisible to other hosts) until flushed; a load returns the cached copy,
 * stale or not, until the line is invalidated.  A line holds two fields
 * and is written back whole.  (No spontaneous eviction: it only makes a
 * value visible earlier, and an unflushed store that is never evicted is the
 * adversarial case for a missing flush.)  Lines: the slot of node k (written by the holder of node k's
 * local mutex) and the manager's grant line (written by the manager only).
 *
 * Checked: mutual exclusion (assert), and no starvation (LTL, weak fairness).
 * Build with -DBUG_NO_GRANT_FLUSH to plant a bug: the manager does not flush
 * its grant; the check must then fail.
 */
#ifndef NODES
#define NODES 3
#endif
#define PROCS 2
#define HOSTS (NODES + 1)
#define LINES (NODES + 1)
#define MGR NODES
#define IDLE 0
#define WAITING 1
#define LOCKED 2
#define REQMOD 2

byte mem_a[LINES];
byte mem_b[LINES];
byte c_a[HOSTS * LINES];
byte c_b[HOSTS * LINES];
bit valid[HOSTS * LINES];
bit dirty[HOSTS * LINES];

byte lm[NODES];             /* local robust mutex per node: holder id + 1 */
byte in_cs;
bool waiting[NODES * PROCS];
bool cs[NODES * PROCS];

inline store(h, l, va, vb) {
	atomic {
		c_a[h * LINES + l] = va; c_b[h * LINES + l] = vb;
		valid[h * LINES + l] = 1; dirty[h * LINES + l] = 1
	}
}

/* clflush: write back if dirty, then evict */
inline flush(h, l) {
	atomic {
		if
		:: dirty[h * LINES + l] ->
			mem_a[l] = c_a[h * LINES + l]; mem_b[l] = c_b[h * LINES + l];
			dirty[h * LINES + l] = 0
		:: else -> skip
		fi;
		valid[h * LINES + l] = 0;
		c_a[h * LINES + l] = 0; c_b[h * LINES + l] = 0
	}
}

inline load(h, l, va, vb) {
	atomic {
		if
		:: valid[h * LINES + l] -> va = c_a[h * LINES + l]; vb = c_b[h * LINES + l]
		:: else ->
			va = mem_a[l]; vb = mem_b[l];
			c_a[h * LINES + l] = va; c_b[h * LINES + l] = vb;
			valid[h * LINES + l] = 1; dirty[h * LINES + l] = 0
		fi
	}
}

/*
 * observe = invalidate, then load; publish = store, then flush.  Each is one
 * atomic step: no process reads a line between its own store and flush of
 * it, and a load right after an invalidate reads memory, so every
 * interleaving inside the pair is equivalent to one where the pair happens
 * at its second step.  The line an observe loads is not kept: every later
 * load of it is again an observe, which would drop it first.
 */
inline observe(h, l, va, vb) { atomic { flush(h, l); va = mem_a[l]; vb = mem_b[l] } }
inline publish(h, l, va, vb) { atomic { store(h, l, va, vb); flush(h, l) } }

proctype requester(byte n; byte id) {
	byte st, rq, ga, gb, req;
	do
	:: atomic { lm[n] == 0 -> lm[n] = id + 1 };
		observe(n, n, st, rq);
		req = (rq + 1) % REQMOD;
		st = 0; rq = 0;
		publish(n, n, WAITING, req);
		waiting[id] = 1;
		do
		:: observe(n, MGR, ga, gb);
			if
			:: ga == n + 1 && gb == req -> ga = 0; gb = 0; break
			:: else -> ga = 0; gb = 0
			fi
		od;
		publish(n, n, LOCKED, req);
		atomic { waiting[id] = 0; in_cs++; cs[id] = 1 };
		assert(in_cs == 1);
		atomic { cs[id] = 0; in_cs-- };
		publish(n, n, IDLE, req);
		req = 0;
		lm[n] = 0
	od
}

active proctype manager() {
	byte g, last, greq, k, n, st, rq;
	do
	:: if
		:: g != 0 ->
			observe(MGR, g - 1, st, rq);
			if
			:: st == IDLE || rq != greq -> g = 0; publish(MGR, MGR, 0, greq)
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
				observe(MGR, n, st, rq);
				if
				:: st == WAITING ->
					g = n + 1; last = n + 1; greq = rq;
#ifdef BUG_NO_GRANT_FLUSH
					store(MGR, MGR, g, greq);
#else
					publish(MGR, MGR, g, greq);
#endif
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
	byte n, p;
	atomic {
		for (n : 0 .. NODES - 1) {
			for (p : 0 .. PROCS - 1) {
				run requester(n, n * PROCS + p)
			}
		}
	}
}

ltl no_starvation { [] (waiting[0] -> <> cs[0]) }
