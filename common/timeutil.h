// timeutil.h: clocks. Monotonic seconds for durations, wall-clock seconds for records.
#ifndef MTRL_TIMEUTIL_H
#define MTRL_TIMEUTIL_H

#include <pthread.h>
#include <time.h>

double mtrl_time_mono(void); // seconds since an arbitrary start, never goes back
double mtrl_time_wall(void); // seconds since the Unix epoch
// "2026-11-30T06:30:45Z" into buf (at least 21 bytes).
void mtrl_time_iso(double wall, char *buf, int cap);
// "2026-11-30 06:30:45 UTC" into buf (at least 24 bytes), for people; "-" for a time not set (<= 0).
void mtrl_time_utc(double wall, char *buf, int cap);

// Timed waits that ignore wall-clock jumps: a condition variable on CLOCK_MONOTONIC, and the
// absolute CLOCK_MONOTONIC time timeout_ms from now for pthread_cond_timedwait on it.
void mtrl_time_cond_init_mono(pthread_cond_t *cv);
struct timespec mtrl_time_mono_deadline(int timeout_ms);

#endif
