/*
 * util.c -- what every part of the core uses and none owns: clocks, polite
 * back-off, the robust process-shared mutex lock, pthread error codes, and
 * whether a pid of this host is gone.  It calls nothing else of the core.
 */
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/prctl.h>
#include <time.h>
#include <unistd.h>

#include "internal.h"

/* CLOCK_REALTIME in ns (internal) */
uint64_t tract_now_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_REALTIME, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* CLOCK_MONOTONIC in ns (internal) */
uint64_t tract_mono_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ULL + (uint64_t)ts.tv_nsec;
}

/* the thread's timer slack before its current wait lowered it; -1: not lowered */
static __thread long saved_slack = -1;

/* waits politely: spins briefly, then sleeps, growing from 1 us up to
 * max_ns (internal).  No sched_yield step: on a core that another busy thread
 * shares (an engine's step loop, its OpenMP workers) a yield hands that thread
 * a whole scheduler slice (milliseconds under EEVDF) per round, while a short
 * sleeper is woken, and preempts it, within tens of microseconds -- a lock
 * grant inside a busy vLLM took 1-5 ms a stripe with the yields.  The sleeps
 * run with a timer slack of 1 us (Linux's default, 50 us, would stretch each
 * 1-20 us sleep to ~60 us); tract_backoff_end gives the thread its own back */
void tract_backoff(uint32_t *round, uint64_t max_sleep_ns)
{
	uint32_t n = (*round)++;
	if (n < 64) {
#if defined(__x86_64__)
		for (int i = 0; i < 32; i++)
			__asm__ volatile("pause");
#endif
		return;
	}
	if (saved_slack < 0) {
		long slack = prctl(PR_GET_TIMERSLACK, 0, 0, 0, 0);
		if (slack >= 0 && prctl(PR_SET_TIMERSLACK, 1000UL, 0, 0, 0) == 0)
			saved_slack = slack;
	}
	uint64_t ns = 1000ULL << (n - 64 < 10 ? n - 64 : 10);
	if (ns > max_sleep_ns)
		ns = max_sleep_ns;
	struct timespec ts = {(time_t)(ns / 1000000000ULL), (long)(ns % 1000000000ULL)};
	nanosleep(&ts, NULL);
}

/* the end of a wait that used tract_backoff: the thread's timer slack as it
 * was before (internal) */
void tract_backoff_end(void)
{
	if (saved_slack >= 0) {
		prctl(PR_SET_TIMERSLACK, (unsigned long)saved_slack, 0, 0, 0);
		saved_slack = -1;
	}
}

/* TRACT_E_SYS for a pthread return code: pthread calls return their error
 * instead of setting errno, and callers report strerror(errno) (internal) */
int tract_sys_error(int pthread_rc)
{
	errno = pthread_rc;
	return TRACT_E_SYS;
}

/* initializes a robust, process-shared mutex: a node-local segment's,
 * shared by the node's processes, any of which may die holding it (internal) */
int tract_robust_init(pthread_mutex_t *mu)
{
	pthread_mutexattr_t a;
	int rc = pthread_mutexattr_init(&a);
	if (rc)
		return tract_sys_error(rc);
	pthread_mutexattr_setpshared(&a, PTHREAD_PROCESS_SHARED);
	pthread_mutexattr_setrobust(&a, PTHREAD_MUTEX_ROBUST);
	rc = pthread_mutex_init(mu, &a);
	pthread_mutexattr_destroy(&a);
	return rc ? tract_sys_error(rc) : TRACT_OK;
}

/* locks a robust mutex, making it consistent if its owner died (internal) */
int tract_robust_lock(pthread_mutex_t *mu, uint64_t timeout_ns)
{
	int rc = pthread_mutex_trylock(mu);
	if (rc == EBUSY && timeout_ns) {
		struct timespec ts;
		clock_gettime(CLOCK_REALTIME, &ts);
		uint64_t end = (uint64_t)ts.tv_sec * 1000000000ULL + ts.tv_nsec + timeout_ns;
		ts.tv_sec = (time_t)(end / 1000000000ULL);
		ts.tv_nsec = (long)(end % 1000000000ULL);
		rc = pthread_mutex_timedlock(mu, &ts);
	}
	if (rc == 0)
		return TRACT_OK;
	if (rc == EOWNERDEAD) {
		pthread_mutex_consistent(mu);
		return TRACT_RECOVERED;
	}
	if (rc == EBUSY || rc == ETIMEDOUT)
		return TRACT_E_TIMEOUT;
	return tract_sys_error(rc);   /* e.g. EINVAL: the segment's mutex is not a mutex */
}

/* whether pid (of this host) is gone: no such process, or a zombie (it has
 * exited and holds nothing; its parent just has not reaped it yet) (internal) */
int tract_pid_dead(uint32_t pid)
{
	if (!pid)
		return 0;
	if (kill((pid_t)pid, 0) < 0)
		return errno == ESRCH;
	char path[32], buf[512];
	snprintf(path, sizeof(path), "/proc/%u/stat", pid);
	int fd = open(path, O_RDONLY | O_CLOEXEC);
	if (fd < 0)
		return errno == ENOENT;          /* reaped meanwhile */
	ssize_t n = read(fd, buf, sizeof(buf) - 1);
	close(fd);
	if (n <= 0)
		return 0;
	buf[n] = 0;
	const char *end = strrchr(buf, ')');   /* the name may hold spaces and ')' */
	return end && end[1] == ' ' && end[2] == 'Z';
}
