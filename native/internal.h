/*
 * internal.h -- definitions shared by the C core's translation units.
 */
#ifndef TRACT_INTERNAL_H
#define TRACT_INTERNAL_H

#include <pthread.h>
#include <stdint.h>

#include "format.h"
#include "tract.h"

struct tract_sim;

/*
 * The accessor table: chosen once at attach (flush mode, simulator), so no
 * caller ever branches on CPU features or on the simulator.
 */
struct tract_ops {
	const char *name;
	/* load n bytes at region offset off (may hit a stale cached line) */
	void (*load)(tract_region *r, uint64_t off, void *dst, uint64_t n);
	/* store n bytes (stays in this host's cache until flushed) */
	void (*store)(tract_region *r, uint64_t off, const void *src, uint64_t n);
	/* write back every line of [off, off+n); evicts except for clwb */
	void (*flush)(tract_region *r, uint64_t off, uint64_t n);
	/* evict every line of [off, off+n) so the next load reads the device */
	void (*invalidate)(tract_region *r, uint64_t off, uint64_t n);
	/* order flushes and stores before later accesses */
	void (*fence)(tract_region *r);
};

struct tract_region {
	uint8_t *base;
	uint64_t size;
	uint32_t flags;
	uint32_t node_id;
	int flush_mode;
	const struct tract_ops *ops;
	struct tract_sim *sim;      /* non-NULL only in simulator mode */
	struct tract_header hdr;    /* private copy of the verified header */
};

/* true if [off, off+n) lies inside the region (internal) */
static inline int tract_in_bounds(const tract_region *r, uint64_t off, uint64_t n)
{
	return off <= r->size && n <= r->size - off;
}

/* plain accessor table for a flush mode, or NULL if unknown (internal) */
const struct tract_ops *tract_plain_ops(int flush_mode);

/* simulator accessor table (internal) */
extern const struct tract_ops tract_sim_ops;

/* creates simulator state for a region (internal) */
int tract_sim_create(tract_region *r);

/* frees simulator state (internal) */
void tract_sim_destroy(tract_region *r);

/* the flush-line primitive of a mode, used by the simulator and copies (internal) */
void tract_flush_lines(int flush_mode, const uint8_t *p, uint64_t n);

/* true if the running CPU supports a flush mode (internal) */
int tract_flush_mode_supported(int flush_mode);

#endif
