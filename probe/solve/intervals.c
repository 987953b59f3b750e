/* The second-order systems H_u x = b of rows whose preference u is uniform over an interval of keys [l, h)
 * (causal masks, sliding windows), one Cholesky factorisation per interval: probe/solve/second_order.py's
 * _solve_intervals, whose docstring gives the equations.  With k = h - l keys of the (shifted) factor's rows
 * a_i,
 *
 *     H_u = I / alpha + S / k - abar abar^T,   S = sum_{l <= i < h} a_i a_i^T,   abar = (1/k) sum a_i.
 *
 * The intervals of a group come sorted (by start, then stop), so that S and sum a_i are kept for a window of
 * keys that moves along the group: each key entering or leaving the window is one rank-one update of r^2/2
 * multiply-adds, instead of a product over the interval's keys.  The window is formed afresh when that is
 * cheaper, and whenever as many keys have left it as it holds (the subtractions' rounding stays that of
 * one pass over the window).  Each interval's H_u is then factorised (LAPACK's dpotrf, whose address the
 * caller passes: probe/solve/native.py takes torch's own) and its rows solved (dpotrs), on one thread (as the
 * Newton kernel's products: their rounding then does not depend on the thread count).
 *
 * Nothing here is certified: the caller recomputes each row's residual b - H_u x from the factor itself and
 * leaves a row above its tolerance, or of an interval whose factorisation failed, to CG.
 *
 * Arrays are row-major and contiguous: a (g x n x r); the intervals' group, start and stop (count); the rows'
 * right-hand sides b, gathered interval by interval (rows x r; offset[c] .. offset[c + 1] are interval c's),
 * overwritten with x; info (count): dpotrf's info, 0 where the interval's rows were solved; counted gains the
 * flops of the window's updates and of LAPACK's factorisations and solves (r^3/3 and 2 r^2 a row).
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef void (*dpotrf_t)(const char *, const int *, double *, const int *, int *);
typedef void (*dpotrs_t)(const char *, const int *, const int *, const double *, const int *, double *, const int *,
                         int *);
typedef int (*threads_t)(int);

/* S += sign a a^T on the lower triangle (row-major), sum += sign a: r (r + 1) flops */
static void rank_one(int r, const double *a, double sign, double *S, double *sum) {
    for (int j = 0; j < r; j++) {
        const double aj = sign * a[j];
        double *row = S + (size_t)j * r;
#pragma omp simd
        for (int k = 0; k <= j; k++) row[k] += aj * a[k];
        sum[j] += aj;
    }
}

static void add_keys(int r, const double *a, int64_t from, int64_t to, double sign, double *S, double *sum) {
    for (int64_t i = from; i < to; i++) rank_one(r, a + (size_t)i * r, sign, S, sum);
}

int probe_interval_solve(int g, int n, int r, const double *a, int count, const int64_t *group,
                         const int64_t *start, const int64_t *stop, const int64_t *offset, double *b, double alpha,
                         int32_t *info, double *counted, void *potrf, void *potrs, void *set_threads) {
    dpotrf_t dpotrf = (dpotrf_t)potrf;
    dpotrs_t dpotrs = (dpotrs_t)potrs;
    double *S = malloc(sizeof(double) * (size_t)r * r);
    double *H = malloc(sizeof(double) * (size_t)r * r);
    double *sum = malloc(sizeof(double) * (size_t)r);
    if (!S || !H || !sum) {
        free(S);
        free(H);
        free(sum);
        return 1;
    }
    const double ridge = 1.0 / alpha;
    const int previous_threads = set_threads ? ((threads_t)set_threads)(1) : 0;
    int64_t current = -1, lo = 0, hi = 0, churn = 0, updates = 0;
    double flops = 0.0;
    for (int c = 0; c < count; c++) {
        const int64_t l = start[c], h = stop[c];
        if (group[c] < 0 || group[c] >= g || l < 0 || h > n || l >= h) {
            info[c] = -1;
            continue;
        }
        const double *ag = a + (size_t)group[c] * n * r;
        const int64_t moved = (h > hi ? h - hi : hi - h) + (l > lo ? l - lo : lo - l);
        const int64_t removed = (h < hi ? hi - h : 0) + (l > lo ? l - lo : 0);
        if (group[c] != current || l >= hi || h <= lo || moved >= h - l || churn + removed > h - l) {
            memset(S, 0, sizeof(double) * (size_t)r * r);
            memset(sum, 0, sizeof(double) * (size_t)r);
            add_keys(r, ag, l, h, 1.0, S, sum);
            updates += h - l;
            current = group[c];
            churn = 0;
        } else {
            if (h > hi) add_keys(r, ag, hi, h, 1.0, S, sum);
            if (h < hi) add_keys(r, ag, h, hi, -1.0, S, sum);
            if (l > lo) add_keys(r, ag, lo, l, -1.0, S, sum);
            if (l < lo) add_keys(r, ag, l, lo, 1.0, S, sum);
            churn += removed;
            updates += moved;
        }
        lo = l;
        hi = h;
        /* H_u's lower triangle (row-major), dpotrf's upper one (column-major) */
        const double inv = 1.0 / (double)(h - l);
        for (int j = 0; j < r; j++) {
            const double mj = sum[j] * inv;
            const double *srow = S + (size_t)j * r;
            double *hrow = H + (size_t)j * r;
#pragma omp simd
            for (int k = 0; k <= j; k++) hrow[k] = srow[k] * inv - mj * (sum[k] * inv);
            hrow[j] += ridge;
        }
        int status = 0;
        dpotrf("U", &r, H, &r, &status);
        flops += (double)r * r * r / 3.0 + 2.0 * r * r;
        info[c] = status;
        const int rows = (int)(offset[c + 1] - offset[c]);
        if (status == 0 && rows > 0) {
            dpotrs("U", &r, &rows, H, &r, b + (size_t)offset[c] * r, &r, &status);
            flops += 2.0 * r * r * rows;
            info[c] = status;
        }
    }
    if (set_threads) ((threads_t)set_threads)(previous_threads);
    counted[0] += flops + (double)updates * r * (r + 1);
    free(S);
    free(H);
    free(sum);
    return 0;
}
