/*
 * tsan_threads.c -- the C core's threaded paths under ThreadSanitizer
 * (tests/test_tsan.py builds it with -fsanitize=thread and runs it).
 *
 * One process, one region handle shared by its threads, as a worker with a
 * thread pool uses it: the lock manager's thread, a watcher polling the
 * manager's state (superseded, stats: the agent's heartbeat), and worker
 * threads doing lock round trips, allocations, puts, lookups, reads,
 * unpins, handoffs (publish, open, ack), evictions and payload sweeps at
 * once.  The C core promises that such a handle is
 * thread-safe; TSan checks the process-local memory it shares between
 * threads (the manager's flags, the local tier, the payload ledger).
 * Region memory is a device that other hosts write with plain loads and
 * stores: its protocol is checked by the non-coherence simulator and the
 * spin model, not here (tests/tsan.supp says which frames).
 *
 * Exit 0 when every operation succeeded; TSan exits 66 on a report.
 */
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tract.h"

#define REGION (64ull << 20)
#define THREADS 4
#define ROUNDS 150
#define KEYS 8

static tract_region *region;
static tract_manager *manager;
static volatile int failed;      /* written once on failure; read after join */
static int stop_watch;
static uint32_t handoffs_done;    /* handoffs published, opened and acked */

static void fail(const char *what, int rc, int t)
{
	fprintf(stderr, "tsan_threads: thread %d: %s returned %d\n", t, what, rc);
	__atomic_store_n(&failed, 1, __ATOMIC_SEQ_CST);
}

static void *watcher(void *arg)
{
	(void)arg;
	uint64_t by = 0, stats[6];
	while (!__atomic_load_n(&stop_watch, __ATOMIC_ACQUIRE)) {
		if (tract_manager_superseded(manager, &by))
			fail("tract_manager_superseded (no other claim exists)", 1, -1);
		tract_manager_stats(manager, stats);
		uint32_t n = 0;
		tract_lock_recover(region, &n);      /* the agent's heartbeat does this */
	}
	return NULL;
}

static void *worker(void *arg)
{
	int t = (int)(intptr_t)arg;
	uint64_t timeout = 20ull * 1000 * 1000 * 1000;
	uint8_t keys[KEYS * 16];
	uint32_t slots[KEYS], hits = 0;
	uint64_t tags[KEYS];
	uint8_t status[KEYS];
	size_t block = 16 * 2 * 2 * 2 * 64 * 2;   /* tokens x layers x K|V x heads x dim x bytes */
	uint8_t *kv = calloc(KEYS, block);
	if (!kv) {
		fail("calloc", -1, t);
		return NULL;
	}
	for (int round = 0; round < ROUNDS && !__atomic_load_n(&failed, __ATOMIC_SEQ_CST); round++) {
		int rc;
		/* a lock of this thread's and one every thread wants */
		uint32_t lock = 3 + (uint32_t)(t % 4);
		if ((rc = tract_lock_acquire(region, lock, timeout, NULL)) < 0)
			return fail("tract_lock_acquire", rc, t), free(kv), NULL;
		if ((rc = tract_lock_release(region, lock)) < 0)
			return fail("tract_lock_release", rc, t), free(kv), NULL;
		uint32_t got[2];
		if ((rc = tract_alloc(region, 2, got, timeout)) < 0 && rc != TRACT_E_FULL)
			return fail("tract_alloc", rc, t), free(kv), NULL;
		if (rc == TRACT_OK && (rc = tract_free(region, got, 2, timeout)) < 0)
			return fail("tract_free", rc, t), free(kv), NULL;
		/* keys shared between pairs of threads: puts race, lookups pin */
		for (int k = 0; k < KEYS; k++) {
			memset(keys + k * 16, 0, 16);
			keys[k * 16] = (uint8_t)(t / 2);
			keys[k * 16 + 1] = (uint8_t)(round % 20);
			keys[k * 16 + 2] = (uint8_t)k;
			keys[k * 16 + 3] = 0x5a;
		}
		rc = tract_index_put(region, keys, KEYS, kv, block, block, NULL, 0, NULL, NULL, status,
				     timeout);
		if (rc < 0 && rc != TRACT_E_FULL)
			return fail("tract_index_put", rc, t), free(kv), NULL;
		if ((rc = tract_index_lookup(region, keys, KEYS, slots, NULL, NULL, tags, &hits,
					     timeout)) < 0)
			return fail("tract_index_lookup", rc, t), free(kv), NULL;
		if (hits && (rc = tract_payload_acquire(region, slots, tags, hits, NULL)) < 0)
			return fail("tract_payload_acquire", rc, t), free(kv), NULL;
		if (hits && (rc = tract_index_read(region, slots, tags, hits, kv, block, block,
						   NULL, NULL)) < 0)
			return fail("tract_index_read", rc, t), free(kv), NULL;
		if (hits && (rc = tract_index_unpin(region, keys, hits, timeout)) < 0)
			return fail("tract_index_unpin", rc, t), free(kv), NULL;
		/* a handoff of what is cached (publish pins, open reads, ack releases) */
		if (hits == KEYS) {
			uint8_t rid[16] = {(uint8_t)t, (uint8_t)round, 0x7e};
			uint8_t got_keys[KEYS * 16];
			uint32_t rec = 0, bc = 0, ts = 0, tt = 0, sums[KEYS], toks[KEYS];
			uint64_t tc = 0;
			rc = tract_handoff_publish(region, rid, keys, KEYS, KEYS * 16, kv, 100, 5,
						   timeout, &rec, timeout);
			if (rc == TRACT_OK) {
				if ((rc = tract_handoff_open(region, rec, rid, got_keys, slots, sums, toks,
							     KEYS, &bc, &tc, &ts, &tt)) < 0)
					return fail("tract_handoff_open", rc, t), free(kv), NULL;
				if ((rc = tract_handoff_ack(region, rec, rid, timeout)) < 0)
					return fail("tract_handoff_ack", rc, t), free(kv), NULL;
				__atomic_fetch_add(&handoffs_done, 1, __ATOMIC_RELAXED);
			} else if (rc != TRACT_E_NOT_FOUND && rc != TRACT_E_FULL &&
				   rc != TRACT_E_TABLE_FULL) {
				return fail("tract_handoff_publish", rc, t), free(kv), NULL;
			}
		}
		if (round % 10 == t) {
			uint32_t evicted = 0, cursor = (uint32_t)t * 97, swept = 0;
			if ((rc = tract_index_evict(region, 16, &evicted, timeout)) < 0)
				return fail("tract_index_evict", rc, t), free(kv), NULL;
			if ((rc = tract_payload_sweep(region, &cursor, 64, 1 << 20, &swept)) < 0)
				return fail("tract_payload_sweep", rc, t), free(kv), NULL;
		}
	}
	free(kv);
	return NULL;
}

int main(void)
{
	uint8_t *base = aligned_alloc(2 << 20, REGION);
	if (!base)
		return 2;
	memset(base, 0, REGION);
	struct tract_format_params p;
	memset(&p, 0, sizeof(p));
	p.region_size = REGION;
	p.alignment = 2 << 20;
	p.max_nodes = 2;
	p.flush_mode = TRACT_FLUSH_NONE;
	p.block_tokens = 16;
	p.num_layers = 2;
	p.num_kv_heads = 2;
	p.head_dim = 64;
	p.dtype = TRACT_DTYPE_F16;
	p.dtype_bytes = 2;
	p.hash_scheme = TRACT_HASH_TRACT;
	p.index_stripes = 16;
	p.transfer_entries = 64;
	memcpy(p.model_name, "tsan", 5);
	int rc = tract_format(base, &p);
	if (rc)
		return fprintf(stderr, "tract_format: %d\n", rc), 2;
	if ((rc = tract_attach(base, REGION, -1, 0, 0, &region)))
		return fprintf(stderr, "tract_attach: %d\n", rc), 2;
	uint64_t lsize = tract_local_size(region);
	void *local = aligned_alloc(4096, (lsize + 4095) & ~4095ull);
	if (!local)
		return 2;
	memset(local, 0, lsize);
	if ((rc = tract_local_init(local, lsize, region, NULL)) || (rc = tract_bind_local(region, local, lsize)))
		return fprintf(stderr, "local segment: %d\n", rc), 2;
	if ((rc = tract_manager_start(region, 1000 * 1000, &manager)))
		return fprintf(stderr, "tract_manager_start: %d\n", rc), 2;
	pthread_t w, th[THREADS];
	pthread_create(&w, NULL, watcher, NULL);
	for (intptr_t i = 0; i < THREADS; i++)
		pthread_create(&th[i], NULL, worker, (void *)i);
	for (int i = 0; i < THREADS; i++)
		pthread_join(th[i], NULL);
	__atomic_store_n(&stop_watch, 1, __ATOMIC_RELEASE);
	pthread_join(w, NULL);
	tract_manager_stop(manager);
	tract_detach(region);
	free(local);
	free(base);
	if (__atomic_load_n(&failed, __ATOMIC_SEQ_CST))
		return 1;
	printf("tsan_threads: %d threads x %d rounds (%u handoffs), every operation succeeded\n",
	       THREADS, ROUNDS, handoffs_done);
	return 0;
}
