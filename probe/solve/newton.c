/* Newton-CG on the reduced dual (R-D) of probe/solve/dual.py, one tile at a time, in row blocks that stay in
 * the core's cache, each row certified here from its final iterate.
 *
 * The method of probe.solve.newton_cg (inexact Newton, float32 CG directions, Armijo backtracking on the
 * float64 objective, the same forcing, stopping and stall rules), with the precision of each product
 * chosen by how far the row still is from its goal:
 *
 *   phase 1 (far, ||g|| > SWITCH ||g_0||): the gradient's product A^T(u - p) in float32, and the step's
 *     A dy accumulated by the CG from the products A d it forms anyway (no product of its own);
 *   phase 2 (near): theta = log u + alpha s + A y formed afresh in float64 on entry, then each trial
 *     point's theta afresh (A (y + dy), whose difference from theta gives the shorter trial steps) and
 *     A^T(u - p) in float64.
 *
 * A row stops as soon as its certificate holds: in phase 2, where the state is that of a fresh float64
 * theta, 2 alpha ||g|| <= rtol ||lambda_hat|| + atol.  Its certificate and every output are formed from
 * that state: theta = log u + alpha s + A y by one product from the returned y, never accumulated, so
 * that the iterations decide only where a row ends, not what is certified about it.  Rows left above
 * their goal (out of iterations, no acceptable step) come back with their honest certificate and are
 * continued by the caller's torch loops.
 *
 * Written as loops over small blocks of rows so that each block's elementwise work runs while its rows
 * are in cache and fused into a few passes, with the products by BLAS (sgemm_/dgemm_, whose addresses the
 * caller passes: probe/solve/native.py takes torch's own).  Problems are independent rows, so a block is
 * solved to the end before the next one starts.
 *
 * Arrays are row-major and contiguous.  A tile: g groups sharing a factor A (n x r, float64 and its float32
 * copy), m problems per group: base = log u + alpha s (-inf off the support), u (one row per group where
 * u_stride is 0), logits s, mvec = A^T u (likewise, m_stride), evidence_sqnorm, active.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* glibc's vector exp (libmvec), for the softmax loops below */
#pragma omp declare simd notinbranch
extern double exp(double);

/* a row enters phase 2 once ||g|| <= SWITCH ||g_0||: there the float32 gradient still has about three
 * correct digits (its rounding is relative to ||A^T(u - p)||, which is about ||g_0||) */
#define SWITCH 1e-2
#define TINY 2.2250738585072014e-308

typedef void (*sgemm_t)(const char *, const char *, const int *, const int *, const int *, const float *,
                        const float *, const int *, const float *, const int *, const float *, float *, const int *);
typedef void (*dgemm_t)(const char *, const char *, const int *, const int *, const int *, const double *,
                        const double *, const int *, const double *, const int *, const double *, double *,
                        const int *);

/* The products, each adding its 2 rows n r flops to counted[0] (float32) or counted[1] (float64). */
/* out (rows x n) = X (rows x r) A^T, A (n x r): column-major, out^T = A X^T */
static void sprod_at(sgemm_t gemm, int rows, int n, int r, const float *X, const float *A, float *out, float beta,
                     double *counted) {
    const float one = 1.0f;
    gemm("T", "N", &n, &rows, &r, &one, A, &r, X, &r, &beta, out, &n);
    counted[0] += 2.0 * rows * n * r;
}
/* out (rows x r) = W (rows x n) A + beta out */
static void sprod_a(sgemm_t gemm, int rows, int n, int r, const float *W, const float *A, float *out, float beta,
                    double *counted) {
    const float one = 1.0f;
    gemm("N", "N", &r, &rows, &n, &one, A, &r, W, &n, &beta, out, &r);
    counted[0] += 2.0 * rows * n * r;
}
static void dprod_at(dgemm_t gemm, int rows, int n, int r, const double *X, const double *A, double *out,
                     double *counted) {
    const double one = 1.0, zero = 0.0;
    gemm("T", "N", &n, &rows, &r, &one, A, &r, X, &r, &zero, out, &n);
    counted[1] += 2.0 * rows * n * r;
}
static void dprod_a(dgemm_t gemm, int rows, int n, int r, const double *W, const double *A, double *out,
                    double *counted) {
    const double one = 1.0, zero = 0.0;
    gemm("N", "N", &r, &rows, &n, &one, A, &r, W, &n, &zero, out, &r);
    counted[1] += 2.0 * rows * n * r;
}

static double ddot(int k, const double *a, const double *b) {
    double s = 0.0;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < k; i++) s += a[i] * b[i];
    return s;
}
static float sdot(int k, const float *a, const float *b) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < k; i++) s += a[i] * b[i];
    return s;
}

/* p = softmax(theta), returns logsumexp(theta) */
static double softmax_row(int n, const double *theta, double *p) {
    double top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int i = 0; i < n; i++) top = theta[i] > top ? theta[i] : top;
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int i = 0; i < n; i++) {
        p[i] = exp(theta[i] - top);
        total += p[i];
    }
    const double inv = 1.0 / total;
    for (int i = 0; i < n; i++) p[i] *= inv;
    return top + log(total);
}
/* logsumexp(theta + t a) */
static double lse_along(int n, const double *theta, double t, const double *a, double *scratch) {
    double top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int i = 0; i < n; i++) {
        scratch[i] = theta[i] + t * a[i];
        top = scratch[i] > top ? scratch[i] : top;
    }
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int i = 0; i < n; i++) total += exp(scratch[i] - top);
    return top + log(total);
}
/* logsumexp(theta + t (trial - theta)), trial itself at t = 1 (excluded keys: -inf in both) */
static double lse_between(int n, const double *theta, double t, const double *trial, double *scratch) {
    double top = -INFINITY;
#pragma omp simd reduction(max : top)
    for (int i = 0; i < n; i++) {
        double v = t == 1.0 ? trial[i] : theta[i] + t * (trial[i] - theta[i]);
        scratch[i] = v == v ? v : -INFINITY; /* -inf - (-inf): NaN, an excluded key */
        top = scratch[i] > top ? scratch[i] : top;
    }
    double total = 0.0;
#pragma omp simd reduction(+ : total)
    for (int i = 0; i < n; i++) total += exp(scratch[i] - top);
    return top + log(total);
}

typedef struct {
    int n, r, B;
    /* the tile's data for the block's rows */
    const double *A, *base, *u, *logits, *mvec, *esq;
    const float *A32;
    int u_stride, m_stride;
    double alpha;
    sgemm_t sgemm;
    dgemm_t dgemm;
    double counted[2]; /* flops of the products, float32 and float64 */
    /* per row of the block, float64 */
    double *y, *theta, *p, *lse, *grad, *gsq, *obj, *ydm, *ysq, *lnorm, *gnorm0, *gnorm, *spsq;
    double *dir, *adir, *spread, *diff, *scratch, *gather;
    /* CG, float32 (slots) */
    float *p32, *x32, *r32, *d32, *Ad32, *Hd32, *Ax32, *rr, *target, *diff32, *spread32;
    double *forcing, *previous; /* per row: the CG's relative residual, ||g|| before the step */
    int *slot_row, *list, *order;
    unsigned char *live, *stop, *at_floor, *searching, *exact, *refresh;
} Block;

/* Lay the block's arrays out in ``memory`` (64-byte aligned); returns the bytes they take.  With
 * memory NULL only the size is computed. */
static size_t carve(Block *b, char *memory) {
    size_t n = b->n, r = b->r, B = b->B, offset = 0;
#define TAKE(field, count)                                               \
    do {                                                                 \
        if (memory) b->field = (void *)(memory + offset);                \
        offset += ((count) * sizeof(*b->field) + 63) & ~(size_t)63;      \
    } while (0)
    TAKE(y, B * r);
    TAKE(theta, B * n);
    TAKE(p, B * n);
    TAKE(grad, B * r);
    TAKE(lse, B);
    TAKE(gsq, B);
    TAKE(obj, B);
    TAKE(ydm, B);
    TAKE(ysq, B);
    TAKE(lnorm, B);
    TAKE(gnorm0, B);
    TAKE(gnorm, B);
    TAKE(spsq, B);
    TAKE(dir, B * r);
    TAKE(adir, B * n);
    TAKE(spread, B * r);
    TAKE(diff, B * n);
    TAKE(gather, B * r);
    TAKE(scratch, n);
    TAKE(p32, B * n);
    TAKE(Ad32, B * n);
    TAKE(Ax32, B * n);
    TAKE(diff32, B * n);
    TAKE(x32, B * r);
    TAKE(r32, B * r);
    TAKE(d32, B * r);
    TAKE(Hd32, B * r);
    TAKE(spread32, B * r);
    TAKE(rr, B);
    TAKE(target, B);
    TAKE(slot_row, B);
    TAKE(list, B);
    TAKE(order, B);
    TAKE(live, B);
    TAKE(stop, B);
    TAKE(forcing, B);
    TAKE(previous, B);
    TAKE(at_floor, B);
    TAKE(searching, B);
    TAKE(exact, B);
    TAKE(refresh, B);
#undef TAKE
    return offset;
}

/* The state after (y, theta, p, lse) for the rows listed in rows[0..k): A^T(u - p) by one product over
 * the listed rows (float64 where ``exact``, else float32), then the gradient, objective and
 * ||lambda_hat|| row by row (probe.solve.newton_cg's state terms). */
static void state_terms(Block *b, int k, const int *rows, int exact) {
    int n = b->n, r = b->r;
    double alpha = b->alpha;
    for (int s = 0; s < k; s++) {
        int j = rows[s];
        const double *uj = b->u + (size_t)j * b->u_stride, *pj = b->p + (size_t)j * n;
        double *dj = b->diff + (size_t)s * n;
        for (int i = 0; i < n; i++) dj[i] = uj[i] - pj[i];
        if (!exact) {
            float *d32 = b->diff32 + (size_t)s * n;
            for (int i = 0; i < n; i++) d32[i] = (float)dj[i];
        }
    }
    if (exact) {
        dprod_a(b->dgemm, k, n, r, b->diff, b->A, b->spread, b->counted);
    } else {
        sprod_a(b->sgemm, k, n, r, b->diff32, b->A32, b->spread32, 0.0f, b->counted);
        for (size_t i = 0; i < (size_t)k * r; i++) b->spread[i] = (double)b->spread32[i];
    }
    for (int s = 0; s < k; s++) {
        int j = rows[s];
        const double *sp = b->spread + (size_t)s * r, *yj = b->y + (size_t)j * r, *mj = b->mvec + (size_t)j * b->m_stride;
        double *gj = b->grad + (size_t)j * r;
        double gsq = 0.0, ydm = 0.0, ysq = 0.0, spsq = 0.0;
#pragma omp simd reduction(+ : gsq, ydm, ysq, spsq)
        for (int i = 0; i < r; i++) {
            gj[i] = sp[i] - yj[i] / alpha;
            gsq += gj[i] * gj[i];
            ydm += yj[i] * mj[i];
            ysq += yj[i] * yj[i];
            spsq += sp[i] * sp[i];
        }
        double lambda_sq = b->esq[j] + 2.0 * ddot(n, b->logits + (size_t)j * n, b->diff + (size_t)s * n) + spsq;
        b->gsq[j] = gsq;
        b->gnorm[j] = sqrt(gsq);
        b->spsq[j] = spsq;
        b->ydm[j] = ydm;
        b->ysq[j] = ysq;
        b->obj[j] = ydm - ysq / (2.0 * alpha) - b->lse[j];
        b->lnorm[j] = alpha * sqrt(lambda_sq > 0.0 ? lambda_sq : 0.0);
    }
}

/* theta = log u + alpha s + A y afresh in float64 for the rows listed, then p, lse and the exact state. */
static void refresh_rows(Block *b, int k, const int *rows) {
    if (k == 0) return;
    int n = b->n, r = b->r;
    for (int s = 0; s < k; s++) memcpy(b->gather + (size_t)s * r, b->y + (size_t)rows[s] * r, sizeof(double) * r);
    dprod_at(b->dgemm, k, n, r, b->gather, b->A, b->diff, b->counted); /* A y, as rows */
    for (int s = 0; s < k; s++) {
        int j = rows[s];
        double *th = b->theta + (size_t)j * n;
        const double *bj = b->base + (size_t)j * n, *ay = b->diff + (size_t)s * n;
        for (int i = 0; i < n; i++) th[i] = bj[i] + ay[i];
        b->lse[j] = softmax_row(n, th, b->p + (size_t)j * n);
        b->exact[j] = 1;
        b->refresh[j] = 0;
    }
    state_terms(b, k, rows, 1);
}

/* CG on H x = g in float32 for the k rows listed (probe.solve.newton_cg's CG, no preconditioner), each to
 * relative residual forcing[row]; the direction goes to b->dir (float64, in the list's order) and A x,
 * accumulated from the products A d of the steps, to b->Ax32. */
static void conjugate_gradient(Block *b, int k, const int *rows, const double *forcing, int cap) {
    int n = b->n, r = b->r;
    const float inv_alpha = (float)(1.0 / b->alpha);
    int running = 0;
    for (int s = 0; s < k; s++) {
        int j = rows[s];
        const double *pj = b->p + (size_t)j * n, *gj = b->grad + (size_t)j * r;
        float *p32 = b->p32 + (size_t)s * n, *r32 = b->r32 + (size_t)s * r, *d32 = b->d32 + (size_t)s * r;
        float *x32 = b->x32 + (size_t)s * r, *ax = b->Ax32 + (size_t)s * n;
        for (int i = 0; i < n; i++) {
            p32[i] = (float)pj[i];
            ax[i] = 0.0f;
        }
        for (int i = 0; i < r; i++) {
            r32[i] = (float)gj[i];
            d32[i] = r32[i];
            x32[i] = 0.0f;
        }
        float rr = sdot(r, r32, r32);
        float f = (float)forcing[j];
        b->rr[s] = rr;
        b->target[s] = f * f * rr;
        b->slot_row[s] = s; /* slot s holds row s of the list */
        b->stop[s] = !(rr > b->target[s]);
        if (!b->stop[s]) running++;
    }
    /* x and A x stay at the list's order; slots (p32, r32, d32) are packed to the front as rows finish */
    int width = k;
    for (int it = 0; it < cap && running > 0; it++) {
        if (2 * running <= width && width > 8) { /* pack the running slots to the front */
            int w = 0;
            for (int s = 0; s < width; s++) {
                if (b->stop[s]) continue;
                if (w != s) {
                    memcpy(b->p32 + (size_t)w * n, b->p32 + (size_t)s * n, sizeof(float) * n);
                    memcpy(b->r32 + (size_t)w * r, b->r32 + (size_t)s * r, sizeof(float) * r);
                    memcpy(b->d32 + (size_t)w * r, b->d32 + (size_t)s * r, sizeof(float) * r);
                    b->rr[w] = b->rr[s];
                    b->target[w] = b->target[s];
                    b->slot_row[w] = b->slot_row[s];
                    b->stop[w] = 0;
                }
                w++;
            }
            width = w;
        }
        sprod_at(b->sgemm, width, n, r, b->d32, b->A32, b->Ad32, 0.0f, b->counted); /* A d */
        for (int s = 0; s < width; s++) { /* Sigma_p A d in place, A d kept for A x */
            float *ad = b->Ad32 + (size_t)s * n;
            const float *p32 = b->p32 + (size_t)s * n;
            float mean = sdot(n, p32, ad);
            const float *d = b->d32 + (size_t)s * r;
            float *hd = b->Hd32 + (size_t)s * r;
            for (int i = 0; i < r; i++) hd[i] = d[i];
            float *keep = b->diff32 + (size_t)s * n;
            for (int i = 0; i < n; i++) {
                keep[i] = ad[i];
                ad[i] = (ad[i] - mean) * p32[i];
            }
        }
        sprod_a(b->sgemm, width, n, r, b->Ad32, b->A32, b->Hd32, inv_alpha, b->counted); /* d / alpha + A^T Sigma_p A d */
        for (int s = 0; s < width; s++) {
            if (b->stop[s]) continue;
            float *d = b->d32 + (size_t)s * r, *hd = b->Hd32 + (size_t)s * r, *res = b->r32 + (size_t)s * r;
            float *x = b->x32 + (size_t)b->slot_row[s] * r, *ax = b->Ax32 + (size_t)b->slot_row[s] * n;
            const float *ad = b->diff32 + (size_t)s * n;
            float curvature = sdot(r, d, hd);
            float step = b->rr[s] / (curvature > 0.0f ? curvature : 1.0f);
            float rr_new = 0.0f;
#pragma omp simd reduction(+ : rr_new)
            for (int i = 0; i < r; i++) {
                x[i] += step * d[i];
                res[i] -= step * hd[i];
                rr_new += res[i] * res[i];
            }
            for (int i = 0; i < n; i++) ax[i] += step * ad[i];
            if (!(rr_new > b->target[s])) {
                b->stop[s] = 1;
                running--;
                continue;
            }
            float beta = rr_new / (b->rr[s] > 0.0f ? b->rr[s] : 1.0f);
            for (int i = 0; i < r; i++) d[i] = res[i] + beta * d[i];
            b->rr[s] = rr_new;
        }
    }
    for (int s = 0; s < k; s++) {
        double *dir = b->dir + (size_t)s * r;
        const float *x = b->x32 + (size_t)s * r;
        for (int i = 0; i < r; i++) dir[i] = (double)x[i];
    }
}

/* Whether a row's float64 state is certified: error_bound = 2 alpha ||g|| <= rtol ||lambda_hat|| + atol
 * (false for NaN), as the caller's torch code decides it. */
static int certified(const Block *b, int j, double rtol, double atol) {
    return 2.0 * b->alpha * b->gnorm[j] <= rtol * b->lnorm[j] + atol;
}

/* The outputs of a tile (probe.solve.problems.DualSolution's fields, and the iterates y), each at the
 * first row of a block. */
typedef struct {
    double *y, *attention, *coefficients, *correction, *lambda_norm, *rel_deviation, *gap, *error_bound;
    int32_t *iterations;
    unsigned char *converged;
} Outputs;

/* The Newton iterations of a block's rows from y = 0 (module comment); returns how many rows stepped in
 * the last iteration (0: every row stopped). */
static void iterate(Block *b, int R, const unsigned char *active, double rtol, double atol, int max_iter,
                    double eps, double forcing_floor, int32_t *iterations) {
    int n = b->n, r = b->r;
    double alpha = b->alpha;
    int cap = 2 * r > 10 ? 2 * r : 10;
    int *list = b->list, *order = b->order;
    for (int done = 0; done < max_iter; done++) {
        int k = 0; /* rows entering phase 2, or whose theta is to be formed afresh again */
        for (int j = 0; j < R; j++)
            if (b->live[j] && !b->exact[j] && (b->refresh[j] || b->gnorm[j] <= SWITCH * b->gnorm0[j])) list[k++] = j;
        refresh_rows(b, k, list);
        k = 0; /* the rows that step */
        for (int j = 0; j < R; j++) {
            if (!b->live[j]) continue;
            if (b->exact[j] && certified(b, j, rtol, atol)) {
                b->live[j] = 0;
                continue;
            }
            double goal = (rtol * b->lnorm[j] + atol) / (2.0 * alpha);
            double ratio = b->gnorm[j] / b->gnorm0[j];
            double f = ratio * ratio, loose = 0.5 * goal / b->gnorm[j];
            f = f > loose ? f : loose;
            b->forcing[j] = f < forcing_floor ? forcing_floor : (f > 0.1 ? 0.1 : f);
            order[k++] = j;
        }
        if (k == 0) return;
        conjugate_gradient(b, k, order, b->forcing, cap);
        /* trial points: in phase 2 theta afresh at y + dy (its difference from theta is A dy), in phase 1
         * theta + A dy with A dy from the CG */
        int k2 = 0;
        for (int s = 0; s < k; s++) {
            int j = order[s];
            double *adir = b->adir + (size_t)s * n;
            if (b->exact[j]) {
                const double *yj = b->y + (size_t)j * r, *dir = b->dir + (size_t)s * r;
                double *at = b->gather + (size_t)k2 * r;
                for (int i = 0; i < r; i++) at[i] = yj[i] + dir[i];
                list[k2++] = s;
            } else {
                const float *ax = b->Ax32 + (size_t)s * n;
                for (int i = 0; i < n; i++) adir[i] = (double)ax[i];
            }
        }
        if (k2 > 0) {
            dprod_at(b->dgemm, k2, n, r, b->gather, b->A, b->diff, b->counted);
            for (int t = 0; t < k2; t++) {
                int s = list[t];
                const double *bj = b->base + (size_t)order[s] * n, *ay = b->diff + (size_t)t * n;
                double *trial = b->adir + (size_t)s * n;
                for (int i = 0; i < n; i++) trial[i] = bj[i] + ay[i];
            }
        }
        int exact_moved = 0, approx_moved = 0; /* rows that moved, by the precision of their next state */
        int *exact_rows = list, *approx_rows = b->slot_row;
        for (int s = 0; s < k; s++) {
            int j = order[s];
            int phase2 = b->exact[j];
            const double *dir = b->dir + (size_t)s * r, *adir = b->adir + (size_t)s * n;
            double *yj = b->y + (size_t)j * r, *th = b->theta + (size_t)j * n;
            const double *gj = b->grad + (size_t)j * r, *mj = b->mvec + (size_t)j * b->m_stride;
            double slope = 0.0, dm = 0.0, ydd = 0.0, dsq = 0.0;
#pragma omp simd reduction(+ : slope, dm, ydd, dsq)
            for (int i = 0; i < r; i++) {
                slope += gj[i] * dir[i];
                dm += dir[i] * mj[i];
                ydd += yj[i] * dir[i];
                dsq += dir[i] * dir[i];
            }
            double floor = 64.0 * eps * (fabs(b->obj[j]) + 1.0);
            int tiny = slope <= floor;
            double step = 1.0, taken = 0.0;
            b->searching[j] = 1;
            b->at_floor[j] = 0;
            for (int trial = 0; trial < 60; trial++) {
                double lse = phase2 ? lse_between(n, th, step, adir, b->scratch) : lse_along(n, th, step, adir, b->scratch);
                double value = b->ydm[j] + step * dm - (b->ysq[j] + step * (2.0 * ydd + step * dsq)) / (2.0 * alpha) - lse;
                int first = tiny && step == 1.0;
                int accepted = (value >= b->obj[j] + 1e-4 * step * slope || first) && isfinite(value);
                if (accepted) {
                    taken = step;
                    b->at_floor[j] = first;
                    b->searching[j] = 0;
                    break;
                }
                step *= 0.5;
            }
            iterations[j] += 1;
            b->previous[j] = b->gnorm[j];
            if (b->searching[j]) { /* no acceptable step: the row stays; phase 1 goes on in float64 */
                if (phase2) b->live[j] = 0;
                else b->refresh[j] = 1;
                continue;
            }
            for (int i = 0; i < r; i++) yj[i] += taken * dir[i];
            if (phase2 && taken == 1.0) {
                memcpy(th, adir, sizeof(double) * n); /* theta afresh */
            } else if (phase2) {                      /* between two fresh thetas: formed afresh next time */
                for (int i = 0; i < n; i++) {
                    double v = th[i] + taken * (adir[i] - th[i]);
                    th[i] = v == v ? v : -INFINITY;
                }
                b->exact[j] = 0;
                b->refresh[j] = 1;
            } else {
                for (int i = 0; i < n; i++) th[i] += taken * adir[i];
            }
            b->lse[j] = softmax_row(n, th, b->p + (size_t)j * n);
            if (b->exact[j]) exact_rows[exact_moved++] = j;
            else approx_rows[approx_moved++] = j;
        }
        state_terms(b, exact_moved, exact_rows, 1);
        state_terms(b, approx_moved, approx_rows, 0);
        /* near the optimum the objective cannot resolve a Newton step's gain, but the gradient can: such
         * steps are taken in full while they halve the gradient; in phase 2 a row stops when they no longer
         * do, in phase 1 it goes on in float64 */
        for (int s = 0; s < k; s++) {
            int j = order[s];
            if (b->searching[j] || !(b->at_floor[j] && b->gnorm[j] > 0.5 * b->previous[j])) continue;
            if (b->exact[j]) b->live[j] = 0;
            else b->refresh[j] = 1;
        }
    }
}

/* Solve a block of R rows and write their outputs (out: at the block's first row). */
static void solve_block(Block *b, int R, const unsigned char *active, double rtol, double atol, int max_iter,
                        double eps, double forcing_floor, const Outputs *out) {
    int n = b->n, r = b->r;
    double alpha = b->alpha;
    int k = 0;
    memset(b->y, 0, sizeof(double) * (size_t)R * r);
    for (int j = 0; j < R; j++) {
        out->iterations[j] = 0;
        b->live[j] = active[j];
        b->exact[j] = 0;
        b->refresh[j] = 0;
        memcpy(b->theta + (size_t)j * n, b->base + (size_t)j * n, sizeof(double) * n);
        b->lse[j] = softmax_row(n, b->theta + (size_t)j * n, b->p + (size_t)j * n);
        b->list[k++] = j;
    }
    state_terms(b, k, b->list, 0); /* y = 0: the float32 gradient */
    for (int j = 0; j < R; j++) b->gnorm0[j] = b->gnorm[j] > TINY ? b->gnorm[j] : TINY;
    iterate(b, R, active, rtol, atol, max_iter, eps, forcing_floor, out->iterations);
    k = 0; /* every row's certificate from a fresh theta */
    for (int j = 0; j < R; j++)
        if (active[j] && !b->exact[j]) b->list[k++] = j;
    refresh_rows(b, k, b->list);
    for (int j = 0; j < R; j++) {
        double *att = out->attention + (size_t)j * n, *coef = out->coefficients + (size_t)j * n;
        double *corr = out->correction + (size_t)j * r, *yo = out->y + (size_t)j * r;
        const double *yj = b->y + (size_t)j * r, *gj = b->grad + (size_t)j * r;
        if (!active[j]) { /* inactive: NaN, no iterations, not converged */
            for (int i = 0; i < n; i++) att[i] = coef[i] = NAN;
            for (int i = 0; i < r; i++) corr[i] = yo[i] = NAN;
            out->error_bound[j] = out->gap[j] = out->lambda_norm[j] = out->rel_deviation[j] = NAN;
            out->converged[j] = 0;
            continue;
        }
        const double *pj = b->p + (size_t)j * n, *uj = b->u + (size_t)j * b->u_stride;
        for (int i = 0; i < n; i++) {
            att[i] = pj[i];
            coef[i] = alpha * (uj[i] - pj[i]);
        }
        for (int i = 0; i < r; i++) {
            corr[i] = alpha * gj[i] + yj[i]; /* alpha A^T(u - p) = alpha g + y */
            yo[i] = yj[i];
        }
        double bound = 2.0 * alpha * b->gnorm[j], deviation = alpha * sqrt(b->spsq[j]);
        out->error_bound[j] = bound;
        out->gap[j] = 0.5 * alpha * b->gsq[j];
        out->lambda_norm[j] = b->lnorm[j];
        out->rel_deviation[j] = deviation == 0.0 ? 0.0 : deviation / b->lnorm[j];
        out->converged[j] = isfinite(bound) && certified(b, j, rtol, atol);
    }
}

/* Bytes of the working set of a block of B rows (what probe/solve/native.py sizes the blocks by). */
size_t probe_block_bytes(int n, int r, int B) {
    Block b = {.n = n, .r = r, .B = B};
    return carve(&b, NULL);
}

typedef int (*set_threads_t)(int);

/* Every group of a tile, in blocks of at most block_rows rows.  ``outputs``: y, attention, coefficients,
 * correction, lambda_norm, rel_deviation, duality_gap, error_bound (float64), iterations (int32),
 * converged (bytes), each of the tile's shape.  ``shared``: u and mvec hold one row per group.  ``counted``
 * (two doubles) gains the flops of the tile's products, float32 and float64.
 * set_threads: MKL's mkl_set_num_threads_local or NULL; the products run on one thread (the caller runs
 * tiles side by side), so that their rounding does not depend on the thread count.  Returns 0, or -1 if
 * memory ran out. */
int probe_newton_tile(int g, int m, int n, int r, int block_rows, const double *A, const float *A32,
                      const double *base, const double *u, int shared, const double *logits, const double *mvec,
                      const double *esq, const unsigned char *active, double alpha, double rtol, double atol,
                      int max_iter, double eps, double forcing_floor, void **outputs, double *counted, void *sgemm,
                      void *dgemm, void *set_threads) {
    int B = block_rows < m ? block_rows : m;
    if (B < 1) return 0;
    Block b = {.n = n, .r = r, .B = B, .alpha = alpha, .sgemm = (sgemm_t)sgemm, .dgemm = (dgemm_t)dgemm};
    char *memory = malloc(carve(&b, NULL));
    if (!memory) return -1;
    carve(&b, memory);
    int previous_threads = set_threads ? ((set_threads_t)set_threads)(1) : 0;
    for (int gi = 0; gi < g; gi++) {
        b.A = A + (size_t)gi * n * r;
        b.A32 = A32 + (size_t)gi * n * r;
        for (int j0 = 0; j0 < m; j0 += B) {
            int R = m - j0 < B ? m - j0 : B;
            size_t row = (size_t)gi * m + j0;
            b.base = base + row * n;
            b.logits = logits + row * n;
            b.esq = esq + row;
            b.u = shared ? u + (size_t)gi * n : u + row * n;
            b.u_stride = shared ? 0 : n;
            b.mvec = shared ? mvec + (size_t)gi * r : mvec + row * r;
            b.m_stride = shared ? 0 : r;
            Outputs out = {
                .y = (double *)outputs[0] + row * r, .attention = (double *)outputs[1] + row * n,
                .coefficients = (double *)outputs[2] + row * n, .correction = (double *)outputs[3] + row * r,
                .lambda_norm = (double *)outputs[4] + row, .rel_deviation = (double *)outputs[5] + row,
                .gap = (double *)outputs[6] + row, .error_bound = (double *)outputs[7] + row,
                .iterations = (int32_t *)outputs[8] + row, .converged = (unsigned char *)outputs[9] + row,
            };
            solve_block(&b, R, active + row, rtol, atol, max_iter, eps, forcing_floor, &out);
        }
    }
    if (set_threads) ((set_threads_t)set_threads)(previous_threads);
    counted[0] += b.counted[0];
    counted[1] += b.counted[1];
    free(memory);
    return 0;
}

/* A small product through each BLAS routine, against the same loops here: the largest relative error
 * (the caller trusts the routines only if it is at rounding level). */
double probe_check_blas(void *sgemm, void *dgemm) {
    enum { ROWS = 3, N = 5, R = 4 };
    double A[N * R], X[ROWS * R], W[ROWS * N], out_at[ROWS * N], out_a[ROWS * R];
    float A32[N * R], X32[ROWS * R], out32[ROWS * N];
    for (int i = 0; i < N * R; i++) A32[i] = (float)(A[i] = 0.25 * (i % 7) - 0.5);
    for (int i = 0; i < ROWS * R; i++) X32[i] = (float)(X[i] = 0.5 * (i % 5) - 1.0);
    for (int i = 0; i < ROWS * N; i++) W[i] = 0.125 * (i % 3) + 0.25;
    double counted[2] = {0.0, 0.0};
    dprod_at((dgemm_t)dgemm, ROWS, N, R, X, A, out_at, counted);
    dprod_a((dgemm_t)dgemm, ROWS, N, R, W, A, out_a, counted);
    sprod_at((sgemm_t)sgemm, ROWS, N, R, X32, A32, out32, 0.0f, counted);
    double worst = 0.0;
    for (int j = 0; j < ROWS; j++) {
        for (int i = 0; i < N; i++) {
            double want = ddot(R, X + j * R, A + i * R);
            double e1 = fabs(out_at[j * N + i] - want), e2 = fabs(out32[j * N + i] - want) * 1e-3;
            worst = e1 > worst ? e1 : worst;
            worst = e2 > worst ? e2 : worst;
        }
        for (int k = 0; k < R; k++) {
            double want = 0.0;
            for (int i = 0; i < N; i++) want += W[j * N + i] * A[i * R + k];
            double e = fabs(out_a[j * R + k] - want);
            worst = e > worst ? e : worst;
        }
    }
    return worst;
}
