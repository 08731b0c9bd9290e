// testhelp.h: the tiny assertion helper every mtrl test uses.
//
// Each check prints file:line and the values it compared when it fails, counts the failure
// and carries on, so one run shows every broken invariant. test_report() prints the closing
// line "N passed, N failed" and returns the process exit status (non-zero on any failure).
// A GPU test that finds no device calls test_skip(), which exits 77 (ctest SKIP_RETURN_CODE).
//
//     int main(void) {
//         TEST_CHECK(x == 3);
//         TEST_NEAR(got, want, 1e-6);             // |got - want| <= tol
//         TEST_CLOSE(got, want, 1e-9, 1e-12);     // |got - want| <= atol + rtol*|want|
//         TEST_ARRAY_CLOSE(a, b, n, rtol, atol);  // every element, reports the worst
//         return test_report();
//     }
#ifndef MTRL_TESTHELP_H
#define MTRL_TESTHELP_H

#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int test_passed_;
static int test_failed_;

static inline void test_fail_(const char *file, int line, const char *what) {
    fprintf(stderr, "%s:%d: FAIL: %s\n", file, line, what);
    test_failed_++;
}

#define TEST_CHECK(cond)                                                   \
    do {                                                                   \
        if (cond) test_passed_++;                                          \
        else test_fail_(__FILE__, __LINE__, #cond);                        \
    } while (0)

// TEST_CHECKF(cond, fmt, ...): like TEST_CHECK with a message that explains the values.
#define TEST_CHECKF(cond, ...)                                             \
    do {                                                                   \
        if (cond) test_passed_++;                                          \
        else {                                                             \
            fprintf(stderr, "%s:%d: FAIL: %s: ", __FILE__, __LINE__, #cond); \
            fprintf(stderr, __VA_ARGS__);                                  \
            fputc('\n', stderr);                                           \
            test_failed_++;                                                \
        }                                                                  \
    } while (0)

#define TEST_EQ_INT(got, want)                                             \
    do {                                                                   \
        long long g_ = (long long)(got), w_ = (long long)(want);           \
        if (g_ == w_) test_passed_++;                                      \
        else {                                                             \
            fprintf(stderr, "%s:%d: FAIL: %s == %s: got %lld, want %lld\n", \
                    __FILE__, __LINE__, #got, #want, g_, w_);              \
            test_failed_++;                                                \
        }                                                                  \
    } while (0)

#define TEST_EQ_STR(got, want)                                             \
    do {                                                                   \
        const char *g_ = (got), *w_ = (want);                              \
        if (g_ && w_ && strcmp(g_, w_) == 0) test_passed_++;               \
        else {                                                             \
            fprintf(stderr, "%s:%d: FAIL: %s == %s: got \"%s\", want \"%s\"\n", \
                    __FILE__, __LINE__, #got, #want, g_ ? g_ : "(null)",   \
                    w_ ? w_ : "(null)");                                   \
            test_failed_++;                                                \
        }                                                                  \
    } while (0)

// TEST_CONTAINS(haystack, needle): the string contains the substring.
#define TEST_CONTAINS(hay, needle)                                         \
    do {                                                                   \
        const char *h_ = (hay), *n_ = (needle);                            \
        if (h_ && n_ && strstr(h_, n_)) test_passed_++;                    \
        else {                                                             \
            fprintf(stderr, "%s:%d: FAIL: \"%s\" should contain \"%s\"\n", \
                    __FILE__, __LINE__, h_ ? h_ : "(null)", n_ ? n_ : "(null)"); \
            test_failed_++;                                                \
        }                                                                  \
    } while (0)

#define TEST_NEAR(got, want, tol)                                          \
    TEST_CLOSE(got, want, 0.0, tol)

#define TEST_CLOSE(got, want, rtol, atol)                                  \
    do {                                                                   \
        double g_ = (double)(got), w_ = (double)(want);                    \
        double lim_ = (double)(atol) + (double)(rtol) * fabs(w_);          \
        if (fabs(g_ - w_) <= lim_) test_passed_++;                         \
        else {                                                             \
            fprintf(stderr, "%s:%d: FAIL: %s ~ %s: got %.17g, want %.17g " \
                    "(diff %.3g > tol %.3g)\n", __FILE__, __LINE__, #got,  \
                    #want, g_, w_, fabs(g_ - w_), lim_);                   \
            test_failed_++;                                                \
        }                                                                  \
    } while (0)

// Compares two arrays of any real type element by element; reports the worst element.
#define TEST_ARRAY_CLOSE(got, want, n, rtol, atol)                         \
    do {                                                                   \
        size_t n_ = (size_t)(n), worst_ = 0, bad_ = 0;                     \
        double excess_ = -1.0;                                             \
        for (size_t i_ = 0; i_ < n_; i_++) {                               \
            double g_ = (double)(got)[i_], w_ = (double)(want)[i_];        \
            double lim_ = (double)(atol) + (double)(rtol) * fabs(w_);      \
            double e_ = fabs(g_ - w_) - lim_;                              \
            if (!(e_ <= 0.0)) bad_++;                                      \
            if (!(e_ <= excess_)) { excess_ = e_; worst_ = i_; }           \
        }                                                                  \
        if (bad_ == 0) test_passed_++;                                     \
        else {                                                             \
            fprintf(stderr, "%s:%d: FAIL: %s ~ %s: %zu of %zu elements off; " \
                    "worst [%zu] got %.17g want %.17g\n", __FILE__, __LINE__, \
                    #got, #want, bad_, n_, worst_, (double)(got)[worst_],  \
                    (double)(want)[worst_]);                               \
            test_failed_++;                                                \
        }                                                                  \
    } while (0)

// Relative error of two arrays: ||a - b|| / max(||b||, tiny). Used for stated tolerances.
static inline double test_rel_err_d(const double *a, const double *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) { num += (a[i] - b[i]) * (a[i] - b[i]); den += b[i] * b[i]; }
    return sqrt(num) / (sqrt(den) > 1e-300 ? sqrt(den) : 1e-300);
}
static inline double test_rel_err_f(const float *a, const float *b, size_t n) {
    double num = 0, den = 0;
    for (size_t i = 0; i < n; i++) {
        double d = (double)a[i] - (double)b[i];
        num += d * d; den += (double)b[i] * (double)b[i];
    }
    return sqrt(num) / (sqrt(den) > 1e-300 ? sqrt(den) : 1e-300);
}

static inline void test_skip(const char *why) {
    printf("SKIP: %s\n", why);
    exit(77);
}

static inline int test_report(void) {
    printf("%d passed, %d failed\n", test_passed_, test_failed_);
    return test_failed_ ? 1 : 0;
}

#endif
