// timeutil.c: clocks (see timeutil.h).
#include "common/timeutil.h"

#include <stdio.h>
#include <time.h>

double mtrl_time_mono(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
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
