/*
 * objdir.c -- the object store: a few named roots (the paper's cxl_shm_put /
 * cxl_shm_get).  Updated under the object-directory lock (lock 1), one
 * whole line per entry; read without the lock by observing the directory.
 * What a reader finds is bounds-checked before it is returned: the region
 * may have been written by a buggy or malicious host.
 */
#include <string.h>

#include "internal.h"

/* a name fills the entry's field but for its NUL */
#define NAME_MAX_LEN (sizeof(((struct tract_objdir_entry *)0)->name) - 1)

/* validates a name: 1..NAME_MAX_LEN bytes (internal) */
static int name_ok(const char *name)
{
	size_t n = name ? strnlen(name, NAME_MAX_LEN + 1) : 0;
	return n >= 1 && n <= NAME_MAX_LEN;
}

/* observes the whole directory into dir (internal) */
static void observe_dir(tract_region *r, struct tract_objdir_entry *dir)
{
	const struct tract_section *s = tract_sec(r, TRACT_SEC_OBJDIR);
	r->ops->invalidate(r, s->offset, s->length);
	r->ops->fence(r);
	r->ops->load(r, s->offset, dir, s->length);
}

/* index of name in dir, or -1 (internal) */
static int find(const struct tract_objdir_entry *dir, const char *name)
{
	for (int i = 0; i < TRACT_OBJDIR_ENTRIES; i++)
		if (dir[i].name[0] && strncmp(dir[i].name, name, sizeof(dir[i].name)) == 0)
			return i;
	return -1;
}

/* takes the directory lock and observes the directory; *i = name's entry or -1 (internal) */
static int enter(tract_region *r, const char *name, uint64_t timeout_ns,
		 struct tract_objdir_entry *dir, int *i)
{
	int rc = tract_lock_acquire(r, TRACT_LOCK_OBJDIR, timeout_ns, NULL);
	if (rc < 0)
		return rc;
	observe_dir(r, dir);
	*i = find(dir, name);
	return TRACT_OK;
}

/* writes entry i of the directory (internal) */
static void publish_entry(tract_region *r, int i, const struct tract_objdir_entry *e)
{
	tract_publish_line(r, tract_sec(r, TRACT_SEC_OBJDIR)->offset + (uint64_t)i * TRACT_LINE, e);
}

/* Publishes name -> (offset, size) under the object-directory lock. */
int tract_obj_put(tract_region *r, const char *name, uint64_t offset, uint64_t size,
		  uint64_t timeout_ns)
{
	if (!r || !name_ok(name))
		return TRACT_E_INVAL;
	if (!tract_in_bounds(r, offset, size))
		return TRACT_E_RANGE;
	struct tract_objdir_entry dir[TRACT_OBJDIR_ENTRIES];
	int i, rc = enter(r, name, timeout_ns, dir, &i);
	if (rc < 0)
		return rc;
	for (int k = 0; i < 0 && k < TRACT_OBJDIR_ENTRIES; k++)
		if (!dir[k].name[0])
			i = k;
	if (i < 0) {
		rc = TRACT_E_FULL;
	} else {
		struct tract_objdir_entry e;
		memset(&e, 0, sizeof(e));
		strncpy(e.name, name, sizeof(e.name) - 1);
		e.offset = offset;
		e.size = size;
		e.seq = dir[i].seq + 1;
		publish_entry(r, i, &e);
		rc = TRACT_OK;
	}
	tract_lock_release(r, TRACT_LOCK_OBJDIR);
	return rc;
}

/* Looks a name up without the lock; bounds-checks what it read. */
int tract_obj_get(tract_region *r, const char *name, uint64_t *offset, uint64_t *size)
{
	if (!r || !name_ok(name) || !offset || !size)
		return TRACT_E_INVAL;
	struct tract_objdir_entry dir[TRACT_OBJDIR_ENTRIES];
	observe_dir(r, dir);
	int i = find(dir, name);
	if (i < 0)
		return TRACT_E_NOT_FOUND;
	if (!tract_in_bounds(r, dir[i].offset, dir[i].size))
		return TRACT_E_CORRUPT;
	*offset = dir[i].offset;
	*size = dir[i].size;
	return TRACT_OK;
}

/* Removes a name under the object-directory lock. */
int tract_obj_delete(tract_region *r, const char *name, uint64_t timeout_ns)
{
	if (!r || !name_ok(name))
		return TRACT_E_INVAL;
	struct tract_objdir_entry dir[TRACT_OBJDIR_ENTRIES];
	int i, rc = enter(r, name, timeout_ns, dir, &i);
	if (rc < 0)
		return rc;
	if (i < 0) {
		rc = TRACT_E_NOT_FOUND;
	} else {
		struct tract_objdir_entry e;
		memset(&e, 0, sizeof(e));
		e.seq = dir[i].seq + 1;
		publish_entry(r, i, &e);
		rc = TRACT_OK;
	}
	tract_lock_release(r, TRACT_LOCK_OBJDIR);
	return rc;
}

/* marks in bits (one per slot) every slot an entry's object overlaps: an
 * application may publish a slot it allocated as a named root, and a dead
 * host's sweep must not return it (internal; recover.c) */
void tract_obj_mark_slots(tract_region *r, uint8_t *bits)
{
	struct tract_objdir_entry dir[TRACT_OBJDIR_ENTRIES];
	observe_dir(r, dir);
	const struct tract_section *data = tract_sec(r, TRACT_SEC_DATA);
	uint64_t end = data->offset + r->hdr.slot_count * r->hdr.slot_stride;
	for (int i = 0; i < TRACT_OBJDIR_ENTRIES; i++) {
		uint64_t lo = dir[i].offset, size = dir[i].size;
		if (!dir[i].name[0] || !size || lo >= end || size > end - lo ||
		    lo + size <= data->offset)
			continue;
		uint64_t first = lo < data->offset ? 0 : (lo - data->offset) / r->hdr.slot_stride;
		uint64_t last = (lo + size - 1 - data->offset) / r->hdr.slot_stride;
		for (uint64_t s = first; s <= last && s < r->hdr.slot_count; s++)
			bits[s / 8] |= (uint8_t)(1u << (s % 8));
	}
}
