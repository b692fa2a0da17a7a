/*
 * cpu.c -- CPU feature detection and the per-process copy configuration.
 *
 * Features are detected once (pthread_once).  Environment overrides exist
 * for testing: TRACT_NO_MOVNT=1 disables non-temporal copies,
 * TRACT_MOVNT_THRESHOLD=<bytes> moves the threshold, TRACT_NO_AVX512=1 and
 * TRACT_NO_AVX2=1 hide those extensions from the copy routine, TRACT_NO_PCLMUL=1
 * the carry-less multiply from the CRC (crc.c), TRACT_NO_VPCLMUL=1 only its
 * 256- and 512-bit forms, TRACT_NO_SSE42=1 its crc32.
 */
#include <pthread.h>
#include <stdlib.h>

#include "internal.h"

#if defined(__x86_64__)
#include <cpuid.h>
#endif

#define DEFAULT_MOVNT_THRESHOLD 4096

static pthread_once_t once = PTHREAD_ONCE_INIT;
static uint32_t features;
static uint64_t movnt_threshold = DEFAULT_MOVNT_THRESHOLD;

#if defined(__x86_64__)
/* reads XCR0 to learn which register states the OS saves (internal) */
static uint64_t xgetbv0(void)
{
	uint32_t eax, edx;
	__asm__ volatile("xgetbv" : "=a"(eax), "=d"(edx) : "c"(0));
	return ((uint64_t)edx << 32) | eax;
}
#endif

/* the mutation site removed in this process (tests/mutation.py); 0 = none */
int tract_mutant;
/* the point where this process kills itself (tests); 0 = none */
int tract_die_point;
long tract_die_skip;
extern int tract_strict_payload;

/* env flag set to a non-empty value other than "0" (internal) */
static int env_flag(const char *name)
{
	const char *v = getenv(name);
	return v && *v && !(v[0] == '0' && v[1] == 0);
}

/* detects features once and applies environment overrides (internal) */
static void detect(void)
{
	uint32_t f = 0;
#if defined(__x86_64__)
	unsigned a, b, c, d;
	f |= TRACT_CPU_X86_64;
	if (__get_cpuid(1, &a, &b, &c, &d)) {
		if (d & (1u << 19))
			f |= TRACT_CPU_CLFLUSH;
		if (c & (1u << 31))
			f |= TRACT_CPU_HYPERVISOR;
		if (c & (1u << 20))
			f |= TRACT_CPU_SSE42;
		if (c & (1u << 1))
			f |= TRACT_CPU_PCLMUL;
		int osxsave = (c >> 27) & 1;
		uint64_t xcr0 = osxsave ? xgetbv0() : 0;
		if (__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
			if (b & (1u << 23))
				f |= TRACT_CPU_CLFLUSHOPT;
			if (b & (1u << 24))
				f |= TRACT_CPU_CLWB;
			if ((b & (1u << 5)) && (xcr0 & 0x6) == 0x6)
				f |= TRACT_CPU_AVX2;
			if ((b & (1u << 16)) && (xcr0 & 0xe6) == 0xe6)
				f |= TRACT_CPU_AVX512F;
			/* 512-bit carry-less multiply: VPCLMULQDQ with AVX-512F and
			 * AVX-512BW (the byte-granular loads of the CRC's tail) */
			if ((c & (1u << 10)) && (b & (1u << 30)) && (f & TRACT_CPU_AVX512F))
				f |= TRACT_CPU_VPCLMUL512;
			/* 256-bit: VPCLMULQDQ with AVX2, twice the 128-bit form's
			 * throughput where there is no AVX-512 (AMD Zen 3) */
			if ((c & (1u << 10)) && (f & TRACT_CPU_AVX2) && (f & TRACT_CPU_PCLMUL))
				f |= TRACT_CPU_VPCLMUL256;
		}
	}
#endif
	if (env_flag("TRACT_NO_AVX512"))
		f &= ~(uint32_t)(TRACT_CPU_AVX512F | TRACT_CPU_VPCLMUL512);
	if (env_flag("TRACT_NO_PCLMUL"))
		f &= ~(uint32_t)(TRACT_CPU_PCLMUL | TRACT_CPU_VPCLMUL512 | TRACT_CPU_VPCLMUL256);
	if (env_flag("TRACT_NO_VPCLMUL"))
		f &= ~(uint32_t)(TRACT_CPU_VPCLMUL512 | TRACT_CPU_VPCLMUL256);
	if (env_flag("TRACT_NO_SSE42"))
		f &= ~(uint32_t)TRACT_CPU_SSE42;
	if (env_flag("TRACT_NO_AVX2"))
		f &= ~(uint32_t)(TRACT_CPU_AVX2 | TRACT_CPU_AVX512F | TRACT_CPU_VPCLMUL512 |
				 TRACT_CPU_VPCLMUL256);
	features = f;

	const char *mu = getenv("TRACT_MUTANT");
	if (mu && *mu)
		tract_mutant = atoi(mu);
	/* TRACT_DIE_AT=point[:passes]: SIGKILL at a named point (tests) */
	const char *die = getenv("TRACT_DIE_AT");
	if (die && *die) {
		char *end;
		tract_die_point = (int)strtol(die, &end, 10);
		tract_die_skip = *end == ':' ? strtol(end + 1, NULL, 10) : 0;
	}

	const char *t = getenv("TRACT_MOVNT_THRESHOLD");
	if (t && *t)
		movnt_threshold = strtoull(t, NULL, 10);
	if (env_flag("TRACT_NO_MOVNT"))
		movnt_threshold = UINT64_MAX;
	tract_strict_payload = env_flag("TRACT_STRICT_PAYLOAD");
	/* TRACT_WALK_AHEAD=n (1..WALK_AHEAD): how many stripe requests a walk
	 * keeps pending; 1 is the one-ahead walk of format 7, what the
	 * benchmarks measure requesting ahead against (docs/BENCHMARKS.md) */
	const char *ahead = getenv("TRACT_WALK_AHEAD");
	if (ahead && *ahead) {
		long n = strtol(ahead, NULL, 10);
		tract_walk_ahead = n < 1 ? 1 : n > TRACT_WALK_AHEAD_MAX ? TRACT_WALK_AHEAD_MAX : (uint32_t)n;
	}
}

/* requests a stripe walk keeps pending (TRACT_WALK_AHEAD) */
uint32_t tract_walk_ahead = TRACT_WALK_AHEAD_MAX;

/* Sets how many stripe requests a walk keeps ahead (1..32); 0 only reads it. */
uint32_t tract_set_walk_ahead(uint32_t n)
{
	pthread_once(&once, detect);     /* the environment's value first, then this */
	if (n)
		__atomic_store_n(&tract_walk_ahead, n > TRACT_WALK_AHEAD_MAX ? TRACT_WALK_AHEAD_MAX : n,
				 __ATOMIC_RELAXED);
	return __atomic_load_n(&tract_walk_ahead, __ATOMIC_RELAXED);
}

/* TRACT_STRICT_PAYLOAD=1: every payload line is written back with the flush
 * mode's own instruction before READY, also after streaming stores (copy.c) */
int tract_strict_payload;

/* Returns the TRACT_CPU_* bits of this CPU (detected once). */
uint32_t tract_cpu_features(void)
{
	pthread_once(&once, detect);
	return features;
}

/* whether TRACT_STRICT_PAYLOAD is set (detected once) (internal) */
int tract_payload_strict(void)
{
	pthread_once(&once, detect);
	return tract_strict_payload;
}

/* Returns the byte count above which block copies use non-temporal stores. */
uint64_t tract_movnt_threshold(void)
{
	pthread_once(&once, detect);
	return movnt_threshold;
}

/* Sets the non-temporal threshold (tests and benchmarks); 0 restores the default. */
void tract_set_movnt_threshold(uint64_t bytes)
{
	pthread_once(&once, detect);
	movnt_threshold = bytes ? bytes : DEFAULT_MOVNT_THRESHOLD;
}

/* 1 if the running CPU supports a flush mode (tract.h) */
int tract_flush_mode_supported(int flush_mode)
{
	uint32_t f = tract_cpu_features();
	switch (flush_mode) {
	case TRACT_FLUSH_NONE:
		return 1;
	case TRACT_FLUSH_CLFLUSH:
		return (f & TRACT_CPU_CLFLUSH) != 0;
	case TRACT_FLUSH_CLFLUSHOPT:
		return (f & TRACT_CPU_CLFLUSHOPT) != 0;
	case TRACT_FLUSH_CLWB:
		/* clwb publishes; invalidation still needs clflush */
		return (f & TRACT_CPU_CLWB) && (f & TRACT_CPU_CLFLUSH);
	default:
		return 0;
	}
}
