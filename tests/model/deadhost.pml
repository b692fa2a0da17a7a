/*
 * deadhost.pml -- a dead host's slots (docs/PROTOCOLS.md §5 and §7, "A dead
 * host"): while a node is declared dead only its recovery's sweep returns its
 * slots to the pool; another node's free of one of its slots leaves it to the
 * sweep.  Checked: a slot is never returned to the pool twice, and never
 * while a block or a new owner still holds it -- whatever the order of an
 * eviction, its free, the verdicts, the sweeps, the host coming back (a new
 * agent epoch) and claims by it or by another node.
 *
 * One slot, first taken by host N and named by a READY bucket (N wrote the
 * block).  Processes:
 *   Evictor  another node M: inside the stripe section, while the bucket
 *            still names the slot, it observes the slot's owner byte and that
 *            owner's agent epoch (tract_slot_owner_of), then buries the bucket;
 *            later, under lock 0, it frees the slot only if the owner byte is
 *            unchanged and no verdict declared the owner dead at or after
 *            that epoch (alloc.c keep_live_owners);
 *   Manager  the lock manager's agent: declares N's current epoch dead (at
 *            any moment: a verdict is a matter of time, which the model does
 *            not bound), and sweeps while N is dead: reads whether a bucket
 *            names the slot (lock-free), then under lock 0 returns it if N is
 *            still dead, owns it, and nothing named it (alloc.c
 *            tract_alloc_sweep_dead);
 *   HostN    N comes back (a new agent epoch) after a verdict, and may then
 *            claim the slot if it is free;
 *   NodeK    another node claims the slot if it is free.
 *
 * Every shared access of the real protocol is an observe or a publish with a
 * fence, and every decision on the slot's bits is made under lock 0, so the
 * model interleaves single reads and writes of shared variables (sequential
 * consistency); it abstracts caches away, unlike lock.pml, whose subject is
 * the flushes themselves.
 *
 * Planted bugs that must fail: BUG_NO_DEFER (the free ignores verdicts);
 * BUG_EPOCH_AT_FREE (the owner's epoch read at the free, not while the
 * bucket named the slot); BUG_SWEEP_UNCHECKED (the sweep does not check,
 * under lock 0, that the host is still dead).
 */

#define NO_NODE 0
#define N 1
#define K 2

byte taken = 1;      /* the bitmap bit */
byte owner = N;      /* the owner byte */
bool named = 1;      /* a READY bucket names the slot */
byte epN = 1;        /* N's agent epoch (line 0 of its node entry) */
byte deadN = 0;      /* N's verdict: the epoch declared dead, 0 none */
bool lock0 = 0;      /* the allocator lock */
byte heldN = 0;      /* the epoch of N that took the slot again (come back), 0 none */
bool heldK = 0;      /* K took the slot */
byte verdicts = 0;

inline acquire() { atomic { lock0 == 0 -> lock0 = 1 } }
inline release() { lock0 = 0 }

/* the slot goes back to the pool */
inline to_pool() {
	taken = 0;
	owner = NO_NODE;
	heldN = 0
}

active proctype Evictor()
{
	byte o, e;
	o = owner;           /* observed while the bucket names the slot */
	e = epN;
	named = 0;           /* the bucket buried; the section left */
	acquire();
#ifdef BUG_EPOCH_AT_FREE
	e = epN;
#endif
	if
#ifdef BUG_NO_DEFER
	:: owner == o ->
#else
	:: owner == o && !(deadN != 0 && deadN >= e) ->
#endif
		/* its free: of the slot its bucket named, never twice, never
		 * a slot somebody took since */
		assert(taken == 1 && heldN == 0 && !heldK);
		to_pool()
	:: else -> skip      /* left to the dead host's sweep */
	fi;
	release()
}

active proctype Manager()
{
	bool r;
	do
	:: deadN != epN && verdicts < 2 -> deadN = epN; verdicts++
	:: deadN == epN ->
		r = named;           /* the references, read without a lock */
		acquire();
		if
#ifdef BUG_SWEEP_UNCHECKED
		:: owner == N && taken && !r ->
#else
		:: deadN == epN && owner == N && taken && !r ->
#endif
			/* the sweep: a slot of the dead host nothing names (what
			 * a dead epoch of N held is void: its DRAM is gone) */
			assert(!named && !heldK && (heldN == 0 || heldN <= deadN));
			to_pool()
		:: else -> skip
		fi;
		release()
	:: break
	od
}

active proctype HostN()
{
	do
	:: deadN == epN && epN < 3 ->
		/* a new agent: publishes its epoch (holding alloc_mu), then under
		 * lock 0 drops its free list if it was swept -- the slot was never
		 * on it here (a block named it) */
		epN++
	:: deadN != epN && heldN == 0 ->
		acquire();
		if
		:: taken == 0 -> taken = 1; owner = N; heldN = epN
		:: else -> skip
		fi;
		release()
	:: break
	od
}

active proctype NodeK()
{
	acquire();
	if
	:: taken == 0 -> taken = 1; owner = K; heldK = 1
	:: else -> skip
	fi;
	release()
}
