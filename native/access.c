/*
 * access.c -- the access discipline for shared metadata (docs/PROTOCOLS.md §1).
 *
 * publish = store -> flush the line -> fence
 * observe = invalidate the line -> fence -> load
 *
 * The plain accessor tables below act on the real mapping; the simulator
 * (sim.c) provides one more table with the same signatures.  Every public
 * function bounds-checks its offset against the mapped size.
 */
#include <string.h>

#include "internal.h"

#define LINE_MASK ((uint64_t)TRACT_LINE - 1)

/* ---- line primitives ---- */

#if defined(__x86_64__)
/* clflush one line (internal) */
static inline void line_clflush(const void *p)
{
	__asm__ volatile("clflush %0" : "+m"(*(volatile char *)p));
}

/* clflushopt one line (internal) */
static inline void line_clflushopt(const void *p)
{
	__asm__ volatile("clflushopt %0" : "+m"(*(volatile char *)p));
}

/* clwb one line (internal) */
static inline void line_clwb(const void *p)
{
	__asm__ volatile("clwb %0" : "+m"(*(volatile char *)p));
}

/* full fence (internal) */
static inline void full_fence(void)
{
	__asm__ volatile("mfence" ::: "memory");
}
#else
static inline void line_clflush(const void *p) { (void)p; __sync_synchronize(); }
static inline void line_clflushopt(const void *p) { (void)p; __sync_synchronize(); }
static inline void line_clwb(const void *p) { (void)p; __sync_synchronize(); }
static inline void full_fence(void) { __sync_synchronize(); }
#endif

/* the flush-line primitive of a mode over [p, p+n) (internal) */
void tract_flush_lines(int flush_mode, const uint8_t *p, uint64_t n)
{
	if (n == 0)
		return;
	uintptr_t start = (uintptr_t)p & ~(uintptr_t)LINE_MASK;
	uintptr_t end = (uintptr_t)p + n;
	switch (flush_mode) {
	case TRACT_FLUSH_CLFLUSH:
		for (uintptr_t a = start; a < end; a += TRACT_LINE)
			line_clflush((const void *)a);
		break;
	case TRACT_FLUSH_CLFLUSHOPT:
		for (uintptr_t a = start; a < end; a += TRACT_LINE)
			line_clflushopt((const void *)a);
		break;
	case TRACT_FLUSH_CLWB:
		for (uintptr_t a = start; a < end; a += TRACT_LINE)
			line_clwb((const void *)a);
		break;
	default:
		break;
	}
}

/* ---- plain accessor tables ---- */

/* load from the mapping; an aligned u64 is one load (internal) */
static void plain_load(tract_region *r, uint64_t off, void *dst, uint64_t n)
{
	const uint8_t *p = r->base + off;
	if (n == 8 && (off & 7) == 0)
		*(uint64_t *)dst = *(const volatile uint64_t *)p;
	else
		memcpy(dst, p, n);
	__asm__ volatile("" ::: "memory");
}

/* store to the mapping; an aligned u64 is one store (internal) */
static void plain_store(tract_region *r, uint64_t off, const void *src, uint64_t n)
{
	uint8_t *p = r->base + off;
	__asm__ volatile("" ::: "memory");
	if (n == 8 && (off & 7) == 0)
		*(volatile uint64_t *)p = *(const uint64_t *)src;
	else
		memcpy(p, src, n);
}

/* flush with the handle's mode (internal) */
static void plain_flush(tract_region *r, uint64_t off, uint64_t n)
{
	tract_flush_lines(r->flush_mode, r->base + off, n);
}

/*
 * invalidate: clwb cannot evict, so clwb mode invalidates with clflush.  A
 * range of several lines is evicted with clflushopt where the CPU has it:
 * unlike clflush it is not serialized, and the fence that follows every
 * invalidate in the discipline orders the batch.  (The paper's caveat about
 * clflushopt concerns write-backs reaching the device; the lines a host
 * invalidates to observe are lines it did not write.)  A single line keeps
 * clflush: a lock-free observer may hit a line another process of this host
 * holds dirty between its store and its flush, and must not be the one to
 * write it back weakly (tract_evict_clean is for lines that cannot be dirty).
 * (internal)
 */
static void plain_invalidate(tract_region *r, uint64_t off, uint64_t n)
{
	int mode = r->flush_mode == TRACT_FLUSH_CLWB ? TRACT_FLUSH_CLFLUSH : r->flush_mode;
	if (mode == TRACT_FLUSH_CLFLUSH && n > TRACT_LINE &&
	    (tract_cpu_features() & TRACT_CPU_CLFLUSHOPT))
		mode = TRACT_FLUSH_CLFLUSHOPT;
	tract_flush_lines(mode, r->base + off, n);
}

/* evicts lines that cannot be dirty here with clflushopt (internal.h) (internal) */
void tract_evict_clean(tract_region *r, uint64_t off, uint64_t n)
{
	if (r->sim || r->flush_mode == TRACT_FLUSH_NONE) {
		r->ops->invalidate(r, off, n);
		return;
	}
	int mode = (tract_cpu_features() & TRACT_CPU_CLFLUSHOPT) ? TRACT_FLUSH_CLFLUSHOPT
								 : TRACT_FLUSH_CLFLUSH;
	tract_flush_lines(mode, r->base + off, n);
}

/* fence (internal) */
static void plain_fence(tract_region *r)
{
	(void)r;
	full_fence();
}

static const struct tract_ops ops_none = {
	"none", plain_load, plain_store, plain_flush, plain_invalidate, plain_fence,
};
static const struct tract_ops ops_clflush = {
	"clflush", plain_load, plain_store, plain_flush, plain_invalidate, plain_fence,
};
static const struct tract_ops ops_clflushopt = {
	"clflushopt", plain_load, plain_store, plain_flush, plain_invalidate, plain_fence,
};
static const struct tract_ops ops_clwb = {
	"clwb", plain_load, plain_store, plain_flush, plain_invalidate, plain_fence,
};

/* plain accessor table for a flush mode, or NULL if unknown (internal) */
const struct tract_ops *tract_plain_ops(int flush_mode)
{
	switch (flush_mode) {
	case TRACT_FLUSH_NONE:
		return &ops_none;
	case TRACT_FLUSH_CLFLUSH:
		return &ops_clflush;
	case TRACT_FLUSH_CLFLUSHOPT:
		return &ops_clflushopt;
	case TRACT_FLUSH_CLWB:
		return &ops_clwb;
	default:
		return NULL;
	}
}

/* ---- public accessors ---- */

/* checks handle, bounds and (for u64) alignment (internal) */
static int check(tract_region *r, uint64_t off, uint64_t n, int u64)
{
	if (!r)
		return TRACT_E_INVAL;
	if (!tract_in_bounds(r, off, n))
		return TRACT_E_RANGE;
	if (u64 && (off & 7))
		return TRACT_E_ALIGN;
	/* a load or store of payload slots outside tract_payload_acquire (an
	 * object kept in a slot, a handoff's key list): the node's ledger stops
	 * vouching for them before their lines can enter the caches (payload.c) */
	tract_payload_forget_range(r, off, n);
	return TRACT_OK;
}

/* refuses stores through a read-only handle (internal) */
static int check_writable(const tract_region *r)
{
	return (r->flags & TRACT_ATTACH_READONLY) ? TRACT_E_INVAL : TRACT_OK;
}

/* Plain store of a u64 (stays in this host's cache until flushed). */
int tract_store_u64(tract_region *r, uint64_t off, uint64_t v)
{
	int rc = check(r, off, 8, 1);
	if (rc || (rc = check_writable(r)))
		return rc;
	r->ops->store(r, off, &v, 8);
	return TRACT_OK;
}

/* Plain load of a u64 (may return a stale cached line). */
int tract_load_u64(tract_region *r, uint64_t off, uint64_t *out)
{
	int rc = check(r, off, 8, 1);
	if (rc)
		return rc;
	r->ops->load(r, off, out, 8);
	return TRACT_OK;
}

/* Publish: store, flush the line, fence. */
int tract_publish_u64(tract_region *r, uint64_t off, uint64_t v)
{
	int rc = check(r, off, 8, 1);
	if (rc || (rc = check_writable(r)))
		return rc;
	r->ops->store(r, off, &v, 8);
	r->ops->flush(r, off, 8);
	r->ops->fence(r);
	return TRACT_OK;
}

/* Observe: invalidate the line, fence, load. */
int tract_observe_u64(tract_region *r, uint64_t off, uint64_t *out)
{
	int rc = check(r, off, 8, 1);
	if (rc)
		return rc;
	r->ops->invalidate(r, off, 8);
	r->ops->fence(r);
	r->ops->load(r, off, out, 8);
	return TRACT_OK;
}

/* Publish len bytes: store them, flush every touched line, fence once. */
int tract_publish(tract_region *r, uint64_t off, const void *src, uint64_t len)
{
	int rc = check(r, off, len, 0);
	if (rc || (rc = check_writable(r)))
		return rc;
	r->ops->store(r, off, src, len);
	r->ops->flush(r, off, len);
	r->ops->fence(r);
	return TRACT_OK;
}

/* Observe len bytes: invalidate every touched line, fence once, load. */
int tract_observe(tract_region *r, uint64_t off, void *dst, uint64_t len)
{
	int rc = check(r, off, len, 0);
	if (rc)
		return rc;
	r->ops->invalidate(r, off, len);
	r->ops->fence(r);
	r->ops->load(r, off, dst, len);
	return TRACT_OK;
}

/* Writes back (and, except for clwb, evicts) every line of a range. */
int tract_flush_range(tract_region *r, uint64_t off, uint64_t len)
{
	int rc = check(r, off, len, 0);
	if (rc)
		return rc;
	r->ops->flush(r, off, len);
	return TRACT_OK;
}

/* Evicts every line of a range so the next load reads the device. */
int tract_invalidate_range(tract_region *r, uint64_t off, uint64_t len)
{
	int rc = check(r, off, len, 0);
	if (rc)
		return rc;
	r->ops->invalidate(r, off, len);
	return TRACT_OK;
}

/* Orders all earlier flushes and stores before later loads and stores. */
void tract_fence(tract_region *r)
{
	if (r)
		r->ops->fence(r);
	else
		full_fence();
}
