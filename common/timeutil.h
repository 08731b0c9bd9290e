// timeutil.h: clocks. Monotonic seconds for durations, wall-clock seconds for records.
#ifndef MTRL_TIMEUTIL_H
#define MTRL_TIMEUTIL_H

double mtrl_time_mono(void); // seconds since an arbitrary start, never goes back
double mtrl_time_wall(void); // seconds since the Unix epoch
// "2026-11-30T06:30:45Z" into buf (at least 21 bytes).
void mtrl_time_iso(double wall, char *buf, int cap);
// "2026-11-30 06:30:45 UTC" into buf (at least 24 bytes), for people; "-" for a time not set (<= 0).
void mtrl_time_utc(double wall, char *buf, int cap);

#endif
