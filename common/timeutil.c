// timeutil.c: clocks (see timeutil.h).
#include "common/timeutil.h"

#include <stdio.h>
#include <time.h>

double mtrl_time_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void mtrl_time_cond_init_mono(pthread_cond_t *cv) {
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    pthread_cond_init(cv, &ca);
    pthread_condattr_destroy(&ca);
}

struct timespec mtrl_time_mono_deadline(int timeout_ms) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    t.tv_sec += timeout_ms / 1000;
    t.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
    if (t.tv_nsec >= 1000000000L) {
        t.tv_sec++;
        t.tv_nsec -= 1000000000L;
    }
    return t;
}

double mtrl_time_wall(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

void mtrl_time_iso(double wall, char *buf, int cap) {
    time_t t = (time_t)wall;
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(buf, (size_t)cap, "%Y-%m-%dT%H:%M:%SZ", &tm);
}

void mtrl_time_utc(double wall, char *buf, int cap) {
    if (wall <= 0) {
        snprintf(buf, (size_t)cap, "-");
        return;
    }
    time_t t = (time_t)wall;
    struct tm tm;
    gmtime_r(&t, &tm);
    strftime(buf, (size_t)cap, "%Y-%m-%d %H:%M:%S UTC", &tm);
}
