/* Newton-CG on the reduced dual (R-D) of probe/solver.py, one tile at a time, in row blocks that stay
 * in the core's cache.
 *
 * The same method as probe.solver._newton with _newton_step and _conjugate_gradient (inexact Newton,
 * float32 CG directions, Armijo backtracking on the float64 objective, the same forcing, stopping and
 * stall rules), written as loops over small blocks of rows so that each block's elementwise work runs
 * while its rows are in cache and fused into a few passes, with the products by BLAS (sgemm_/dgemm_,
 * whose addresses the caller passes: probe/native.py takes torch's own).  Problems are independent
 * rows, so a block is solved to the end before the next one starts.
 *
 * It returns the iterates y and the Newton iteration counts only.  The caller recomputes the state at y
 * in torch (probe.solver._WorkingSet.state) and certifies from that, and goes on with the torch
 * Newton for any row this code left above its goal: a fault here can cost time, not a wrong number.
 *
 * Arrays are row-major and contiguous.  A tile: g groups sharing a factor A (n x r, float64 and its
 * float32 copy), m problems per group: base = log u + alpha s (-inf off the support), u, logits s,
 * mvec = A^T u, evidence_sqnorm, active.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

/* glibc's vector exp (libmvec), for the softmax loops below */
#pragma omp declare simd notinbranch
extern double exp(double);

typedef void (*sgemm_t)(const char *, const char *, const int *, const int *, const int *, const float *,
                        const float *, const int *, const float *, const int *, const float *, float *, const int *);
typedef void (*dgemm_t)(const char *, const char *, const int *, const int *, const int *, const double *,
                        const double *, const int *, const double *, const int *, const double *, double *,
                        const int *);

/* out (rows x n) = X (rows x r) A^T, A (n x r): column-major, out^T = A X^T */
static void sprod_at(sgemm_t gemm, int rows, int n, int r, const float *X, const float *A, float *out, float beta) {
    const float one = 1.0f;
    gemm("T", "N", &n, &rows, &r, &one, A, &r, X, &r, &beta, out, &n);
}
/* out (rows x r) = W (rows x n) A + beta out */
static void sprod_a(sgemm_t gemm, int rows, int n, int r, const float *W, const float *A, float *out, float beta) {
    const float one = 1.0f;
    gemm("N", "N", &r, &rows, &n, &one, A, &r, W, &n, &beta, out, &r);
}
static void dprod_at(dgemm_t gemm, int rows, int n, int r, const double *X, const double *A, double *out) {
    const double one = 1.0, zero = 0.0;
    gemm("T", "N", &n, &rows, &r, &one, A, &r, X, &r, &zero, out, &n);
}
static void dprod_a(dgemm_t gemm, int rows, int n, int r, const double *W, const double *A, double *out) {
    const double one = 1.0, zero = 0.0;
    gemm("N", "N", &r, &rows, &n, &one, A, &r, W, &n, &zero, out, &r);
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

typedef struct {
    int n, r, B;
    /* per row of the block, float64 */
    double *y, *theta, *p, *lse, *grad, *gsq, *obj, *ydm, *ysq, *lnorm, *gnorm0, *gnorm;
    double *dir, *adir, *spread, *diff, *scratch;
    /* CG, float32 (slots) */
    float *p32, *x32, *r32, *d32, *Ad32, *Hd32, *rr, *target;
    double *forcing, *previous; /* per row: the CG's relative residual, ||g|| before the step */
    int *slot_row, *live_rows, *order;
    unsigned char *live, *stop, *at_floor, *searching;
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
    TAKE(dir, B * r);
    TAKE(adir, B * n);
    TAKE(spread, B * r);
    TAKE(diff, B * n);
    TAKE(scratch, n);
    TAKE(p32, B * n);
    TAKE(Ad32, B * n);
    TAKE(x32, B * r);
    TAKE(r32, B * r);
    TAKE(d32, B * r);
    TAKE(Hd32, B * r);
    TAKE(rr, B);
    TAKE(target, B);
    TAKE(slot_row, B);
    TAKE(live_rows, B);
    TAKE(live, B);
    TAKE(stop, B);
    TAKE(forcing, B);
    TAKE(previous, B);
    TAKE(order, B);
    TAKE(at_floor, B);
    TAKE(searching, B);
#undef TAKE
    return offset;
}

/* The state after (y, theta, p, lse) for the rows listed in rows[0..k): A^T(u - p) by one product over
 * the listed rows, then the gradient, objective and ||lambda_hat|| row by row (probe.solver._state_terms). */
static void state_terms(Block *b, dgemm_t dgemm, const double *A, int k, const int *rows, const double *u,
                        const double *logits, const double *mvec, const double *esq, double alpha) {
    int n = b->n, r = b->r;
    for (int s = 0; s < k; s++) {
        int j = rows[s];
        const double *uj = u + (size_t)j * n, *pj = b->p + (size_t)j * n;
        double *dj = b->diff + (size_t)s * n;
        for (int i = 0; i < n; i++) dj[i] = uj[i] - pj[i];
    }
    dprod_a(dgemm, k, n, r, b->diff, A, b->spread);
    for (int s = 0; s < k; s++) {
        int j = rows[s];
        const double *sp = b->spread + (size_t)s * r, *yj = b->y + (size_t)j * r, *mj = mvec + (size_t)j * r;
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
        double lambda_sq = esq[j] + 2.0 * ddot(n, logits + (size_t)j * n, b->diff + (size_t)s * n) + spsq;
        b->gsq[j] = gsq;
        b->gnorm[j] = sqrt(gsq);
        b->ydm[j] = ydm;
        b->ysq[j] = ysq;
        b->obj[j] = ydm - ysq / (2.0 * alpha) - b->lse[j];
        b->lnorm[j] = alpha * sqrt(lambda_sq > 0.0 ? lambda_sq : 0.0);
    }
}

/* CG on H x = g in float32 for the k rows listed (probe.solver._conjugate_gradient_steps, no
 * preconditioner), each to relative residual forcing[row]; the direction goes to b->dir (float64). */
static void conjugate_gradient(Block *b, sgemm_t sgemm, const float *A32, int k, const int *rows, const double *forcing,
                               double alpha, int cap) {
    int n = b->n, r = b->r;
    const float inv_alpha = (float)(1.0 / alpha);
    int running = 0;
    for (int s = 0; s < k; s++) {
        int j = rows[s];
        const double *pj = b->p + (size_t)j * n, *gj = b->grad + (size_t)j * r;
        float *p32 = b->p32 + (size_t)s * n, *r32 = b->r32 + (size_t)s * r, *d32 = b->d32 + (size_t)s * r;
        float *x32 = b->x32 + (size_t)s * r;
        for (int i = 0; i < n; i++) p32[i] = (float)pj[i];
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
    /* x stays at the list's order; slots (p32, r32, d32) are packed to the front as rows finish */
    int width = k;
    float *xs = b->x32;
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
        sprod_at(sgemm, width, n, r, b->d32, A32, b->Ad32, 0.0f); /* A d */
        for (int s = 0; s < width; s++) {                          /* Sigma_p A d */
            float *ad = b->Ad32 + (size_t)s * n;
            const float *p32 = b->p32 + (size_t)s * n;
            float mean = sdot(n, p32, ad);
            for (int i = 0; i < n; i++) ad[i] = (ad[i] - mean) * p32[i];
            const float *d = b->d32 + (size_t)s * r;
            float *hd = b->Hd32 + (size_t)s * r;
            for (int i = 0; i < r; i++) hd[i] = d[i];
        }
        sprod_a(sgemm, width, n, r, b->Ad32, A32, b->Hd32, inv_alpha); /* d / alpha + A^T Sigma_p A d */
        for (int s = 0; s < width; s++) {
            if (b->stop[s]) continue;
            float *d = b->d32 + (size_t)s * r, *hd = b->Hd32 + (size_t)s * r, *res = b->r32 + (size_t)s * r;
            float *x = xs + (size_t)b->slot_row[s] * r;
            float curvature = sdot(r, d, hd);
            float step = b->rr[s] / (curvature > 0.0f ? curvature : 1.0f);
            float rr_new = 0.0f;
#pragma omp simd reduction(+ : rr_new)
            for (int i = 0; i < r; i++) {
                x[i] += step * d[i];
                res[i] -= step * hd[i];
                rr_new += res[i] * res[i];
            }
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
        const float *x = xs + (size_t)s * r;
        for (int i = 0; i < r; i++) dir[i] = (double)x[i];
    }
}

/* Solve the rows [j0, j1) of one group; writes y and iterations of those rows. */
static void solve_block(Block *b, sgemm_t sgemm, dgemm_t dgemm, const double *A, const float *A32, int rows_in_block,
                        const double *base, const double *u, const double *logits, const double *mvec,
                        const double *esq, const unsigned char *active, double alpha, double rtol, double atol,
                        int max_iter, double eps, double forcing_floor, double *y_out, int32_t *iterations) {
    int n = b->n, r = b->r, R = rows_in_block;
    int cap = 2 * r > 10 ? 2 * r : 10;
    int k = 0;
    memset(b->y, 0, sizeof(double) * (size_t)R * r);
    for (int j = 0; j < R; j++) {
        iterations[j] = 0;
        b->live[j] = active[j];
        memcpy(b->theta + (size_t)j * n, base + (size_t)j * n, sizeof(double) * n);
        b->lse[j] = softmax_row(n, b->theta + (size_t)j * n, b->p + (size_t)j * n);
        b->live_rows[k++] = j;
    }
    state_terms(b, dgemm, A, k, b->live_rows, u, logits, mvec, esq, alpha);
    for (int j = 0; j < R; j++) {
        double g0 = b->gnorm[j];
        b->gnorm0[j] = g0 > 2.2250738585072014e-308 ? g0 : 2.2250738585072014e-308;
    }
    double *forcing = b->forcing, *previous = b->previous;
    int *order = b->order;
    unsigned char *at_floor = b->at_floor, *searching = b->searching;
    for (int done = 0; done < max_iter; done++) {
        k = 0;
        for (int j = 0; j < R; j++) {
            if (!b->live[j]) continue;
            double goal = 0.25 * (rtol * b->lnorm[j] + atol) / (2.0 * alpha);
            if (!(b->gnorm[j] > goal)) {
                b->live[j] = 0;
                continue;
            }
            double ratio = b->gnorm[j] / b->gnorm0[j];
            double f = ratio * ratio, loose = 0.5 * goal / b->gnorm[j];
            f = f > loose ? f : loose;
            f = f < forcing_floor ? forcing_floor : (f > 0.1 ? 0.1 : f);
            forcing[j] = f;
            order[k++] = j;
        }
        if (k == 0) break;
        conjugate_gradient(b, sgemm, A32, k, order, forcing, alpha, cap);
        dprod_at(dgemm, k, n, r, b->dir, A, b->adir); /* A dy */
        int moved = 0;
        for (int s = 0; s < k; s++) {
            int j = order[s];
            const double *dir = b->dir + (size_t)s * r, *adir = b->adir + (size_t)s * n;
            double *yj = b->y + (size_t)j * r, *th = b->theta + (size_t)j * n;
            const double *gj = b->grad + (size_t)j * r, *mj = mvec + (size_t)j * r;
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
            searching[j] = 1;
            at_floor[j] = 0;
            for (int trial = 0; trial < 60; trial++) {
                double lse = lse_along(n, th, step, adir, b->scratch);
                double value = b->ydm[j] + step * dm - (b->ysq[j] + step * (2.0 * ydd + step * dsq)) / (2.0 * alpha) - lse;
                int first = tiny && step == 1.0;
                int accepted = (value >= b->obj[j] + 1e-4 * step * slope || first) && isfinite(value);
                if (accepted) {
                    taken = step;
                    at_floor[j] = first;
                    searching[j] = 0;
                    break;
                }
                step *= 0.5;
            }
            iterations[j] += 1;
            previous[j] = b->gnorm[j];
            if (searching[j]) continue; /* no acceptable step: the row stays and stops */
            for (int i = 0; i < r; i++) yj[i] += taken * dir[i];
            for (int i = 0; i < n; i++) th[i] += taken * adir[i];
            b->lse[j] = softmax_row(n, th, b->p + (size_t)j * n);
            b->live_rows[moved++] = j;
        }
        state_terms(b, dgemm, A, moved, b->live_rows, u, logits, mvec, esq, alpha);
        for (int s = 0; s < k; s++) {
            int j = order[s];
            int stalled = at_floor[j] && b->gnorm[j] > 0.5 * previous[j];
            if (searching[j] || stalled) b->live[j] = 0;
        }
    }
    memcpy(y_out, b->y, sizeof(double) * (size_t)R * r);
}

/* Every group of a tile, in blocks of at most block_rows rows.  Returns 0, or -1 if memory ran out. */
/* Bytes of the working set of a block of B rows (what probe/native.py sizes the blocks by). */
size_t probe_block_bytes(int n, int r, int B) {
    Block b = {.n = n, .r = r, .B = B};
    return carve(&b, NULL);
}

typedef int (*set_threads_t)(int);

/* Every group of a tile, in blocks of at most block_rows rows.  set_threads: MKL's
 * mkl_set_num_threads_local or NULL; the products run on one thread (the caller runs tiles side by
 * side), so that their rounding does not depend on the thread count.  Returns 0, or -1 if memory ran
 * out. */
int probe_newton_tile(int g, int m, int n, int r, int block_rows, const double *A, const float *A32,
                      const double *base, const double *u, const double *logits, const double *mvec,
                      const double *esq, const unsigned char *active, double alpha, double rtol, double atol,
                      int max_iter, double eps, double forcing_floor, double *y, int32_t *iterations, void *sgemm,
                      void *dgemm, void *set_threads) {
    int B = block_rows < m ? block_rows : m;
    if (B < 1) return 0;
    Block b = {.n = n, .r = r, .B = B};
    char *memory = malloc(carve(&b, NULL));
    if (!memory) return -1;
    carve(&b, memory);
    int previous_threads = set_threads ? ((set_threads_t)set_threads)(1) : 0;
    for (int gi = 0; gi < g; gi++) {
        const double *Ag = A + (size_t)gi * n * r;
        const float *A32g = A32 + (size_t)gi * n * r;
        for (int j0 = 0; j0 < m; j0 += B) {
            int R = m - j0 < B ? m - j0 : B;
            size_t row = (size_t)gi * m + j0;
            solve_block(&b, (sgemm_t)sgemm, (dgemm_t)dgemm, Ag, A32g, R, base + row * n, u + row * n,
                        logits + row * n, mvec + row * r, esq + row, active + row, alpha, rtol, atol, max_iter, eps,
                        forcing_floor, y + row * r, iterations + row);
        }
    }
    if (set_threads) ((set_threads_t)set_threads)(previous_threads);
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
    dprod_at((dgemm_t)dgemm, ROWS, N, R, X, A, out_at);
    dprod_a((dgemm_t)dgemm, ROWS, N, R, W, A, out_a);
    sprod_at((sgemm_t)sgemm, ROWS, N, R, X32, A32, out32, 0.0f);
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
