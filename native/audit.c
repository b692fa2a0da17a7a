/*
 * audit.c -- the index as `tract check` sees it (docs/PROTOCOLS.md §11):
 * which live bucket its key's own rule (stripe, home, probing; internal.h)
 * can reach, decided here, by the same code that writes the index, so that
 * one program knows the format.  Reads only (observes), takes no lock: it
 * reports what a quiescent region holds.
 */
#include <stdlib.h>
#include <string.h>

#include "internal.h"

/* Audits every bucket of the index: reach[i] gets TRACT_AUDIT_* for bucket
 * i, home[i] its key's home bucket and broken[i] the EMPTY bucket that breaks
 * its probe chain (0 where they do not apply); n must be the index's bucket
 * count. */
int tract_index_audit(tract_region *r, uint8_t *reach, uint64_t *home, uint64_t *broken,
		      uint64_t n)
{
	if (!r || !reach || !home || !broken)
		return TRACT_E_INVAL;
	uint64_t total = tract_index_buckets(r), size = tract_index_stripe_size(r);
	if (n != total || !size)
		return TRACT_E_INVAL;
	uint64_t off = tract_sec(r, TRACT_SEC_BUCKETS)->offset;
	uint8_t *state = malloc(size + 1);
	struct tract_bucket *stripe = malloc((size + 1) * sizeof(*stripe));
	if (!state || !stripe) {
		free(state);
		free(stripe);
		return TRACT_E_NOMEM;
	}
	for (uint32_t s = 0; s < r->hdr.index_stripes; s++) {
		uint64_t first = (uint64_t)s * size;
		/* the stripe's buckets in one observe (one fence, not one a bucket) */
		int rc = tract_observe(r, off + first * sizeof(struct tract_bucket), stripe,
				       size * sizeof(struct tract_bucket));
		if (rc < 0) {
			free(state);
			free(stripe);
			return rc;
		}
		for (uint64_t j = 0; j < size; j++)
			state[j] = (uint8_t)(stripe[j].state <= TRACT_BUCKET_TOMBSTONE ? stripe[j].state : 0xFF);
		for (uint64_t j = 0; j < size; j++) {
			uint64_t i = first + j;
			home[i] = broken[i] = 0;
			if (state[j] != TRACT_BUCKET_READY && state[j] != TRACT_BUCKET_PENDING) {
				reach[i] = TRACT_AUDIT_NOT_LIVE;
				continue;
			}
			if (tract_key_stripe(r, stripe[j].key) != s) {
				reach[i] = TRACT_AUDIT_OTHER_STRIPE;
				continue;
			}
			/* every bucket from its home up to it must be non-EMPTY */
			uint64_t k = tract_key_home(r, stripe[j].key);
			reach[i] = TRACT_AUDIT_OK;
			home[i] = first + k;
			for (; k != j; k = (k + 1) & (size - 1))
				if (state[k] == TRACT_BUCKET_EMPTY) {
					reach[i] = TRACT_AUDIT_CHAIN_BROKEN;
					broken[i] = first + k;
					break;
				}
		}
	}
	free(state);
	free(stripe);
	return TRACT_OK;
}
