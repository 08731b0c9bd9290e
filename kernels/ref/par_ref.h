// par_ref.h: when a loop of the CPU reference runs on an OpenMP team (one policy for every kernel).
//
// A loop forks only for at least REF_PAR_MIN_FLOPS of work (floating-point operations, an exp
// or a division counted as REF_FLOPS_EXP), never from inside an active parallel region (the
// caller parallelises the outer loop, the callee then runs its inner loop serially), and below
// that it runs inline without calling the OpenMP runtime at all. Measured on the 2-vCPU build
// machine (issue 21):
//   * a fork/join is ~0.6 µs on idle cores, but a team of one (`parallel if (0)`, or a nested
//     team) is a libgomp call and a futex syscall too: ~0.6 µs each, 40% of a tiny decode step
//     at 8 sequences (220 of them per step);
//   * with other processes on the cores the team waits for its descheduled thread: ~1 ms per
//     fork for a loop of 50 µs, which is what made batched decode collapse (7 ms per step at 32
//     sequences for 7 forks, 0.3 ms at 8 without them).
// So the threshold is where a loop's serial time (~0.2-0.5 ms at the reference's 10-20 GFLOP/s)
// is worth risking one such wait; the learner's GEMMs and attention are far above it, a decode
// step of the tiny preset runs serially. Kernels that the decode step calls per op or per row
// run inline below it (REF_PAR_FOR, or an explicit branch around a region with per-thread
// scratch); the whole-sequence kernels of training and prefill (attention, KDA chunks) use
// `parallel if (ref_par(...))`, one runtime call per call.
#ifndef MTRL_PAR_REF_H
#define MTRL_PAR_REF_H

#ifdef _OPENMP
#include <omp.h>
#endif

#define REF_PAR_MIN_FLOPS 4.0e6
#define REF_FLOPS_EXP 20.0

// Should a loop of `flops` operations run on a team? 0 inside any parallel region (a team of one
// included: only the top level forks) or with one thread.
static inline int ref_par(double flops) {
#ifdef _OPENMP
    return flops >= REF_PAR_MIN_FLOPS && omp_get_level() == 0 && omp_get_max_threads() > 1;
#else
    (void)flops;
    return 0;
#endif
}

// REF_PAR_FOR(par, for (...) statement): the for statement on a team (static schedule, so the
// split depends only on the trip count and the thread count) when par, else inline. Bodies
// whose result must not depend on the thread count may only write their own iteration's output.
#define REF_PAR_FOR(par, ...)                                                                      \
    do {                                                                                           \
        if (par) {                                                                                 \
            _Pragma("omp parallel for schedule(static)") __VA_ARGS__                               \
        } else {                                                                                   \
            __VA_ARGS__                                                                            \
        }                                                                                          \
    } while (0)

// This thread's share [*lo, *hi) of n iterations in a team (all of them outside one): the same
// split as schedule(static), for regions that set up per-thread scratch first.
static inline void ref_thread_range(long n, long *lo, long *hi) {
#ifdef _OPENMP
    long nt = omp_get_num_threads(), t = omp_get_thread_num();
#else
    long nt = 1, t = 0;
#endif
    long q = n / nt, r = n % nt;
    *lo = t * q + (t < r ? t : r);
    *hi = *lo + q + (t < r);
}

// REF_PAR_RANGES(par, n, lo, hi, call): on a team when par, call once per thread with long lo, hi
// its share of n iterations (ref_thread_range), else once inline with [0, n): for loops whose
// callee sets up per-thread scratch.
#define REF_PAR_RANGES(par, n, lo, hi, ...)                                                        \
    do {                                                                                           \
        if (par) {                                                                                 \
            _Pragma("omp parallel") {                                                              \
                long lo, hi;                                                                       \
                ref_thread_range((n), &lo, &hi);                                                   \
                __VA_ARGS__;                                                                       \
            }                                                                                      \
        } else {                                                                                   \
            long lo = 0, hi = (n);                                                                 \
            __VA_ARGS__;                                                                           \
        }                                                                                          \
    } while (0)

#endif
