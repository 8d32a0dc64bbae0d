/* The host step of optimizer offload: Adam and AdamW over fp32 arrays in host memory.

   The arithmetic is torch's fused CPU Adam/AdamW kernel's, element for element (its vectorized body
   for the elements [0, vec_end), its scalar tail for [vec_end, n)), so the result is bitwise the one
   torch.optim.Adam(W)(fused=True) gives. Where the compiler that built torch fused a product and a
   sum into one rounding cannot be known from here, so those are variants (``ZQ_*`` flags below):
   lightning_zeroq/ops/host_adam.py builds this file once with every variant chosen at run time
   (``-DZQ_PROBE``), finds the one that matches torch bitwise on this machine, and builds it again
   with that variant fixed (``-DZQ_BODY=<flags>``), which the host step then uses. Where no variant
   matches, torch's kernel steps as before.

   What torch's kernel cannot do, this one does in the same pass over memory:
   - read the gradient as bf16 (``gh``): the working-dtype gradient a window got from a single
     reduction is exact in bf16, and crosses PCIe in half the bytes;
   - scale the gradient first (``gmul``: unscaling and clipping, one multiplier), as
     ``grad.mul_(gmul)`` before the step would, without a pass of its own over the gradient;
   - write the updated parameter rounded to bf16 (``wh``, round to nearest even as a cast on the GPU
     rounds), which crosses PCIe or rests in a stage-3 store instead of the fp32 master, with
     streaming stores (``zq_set_stream_half``), so no line of it is read first;
   - write the updated parameter, exp_avg and exp_avg_sq to other arrays (``op``, ``om``, ``ov``),
     leaving the inputs as they were, so a step taken before the step's global checks are known is
     undone by dropping its outputs, at no more memory traffic than a step in place.

   Muon's elementwise parts (``zq_muon_blends``, ``zq_muon_applies``) run on the same pool: the momentum
   blend (torch's ``lerp``, whose vector and scalar forms are one fused multiply-add each, as CUDA's)
   with the blended update written rounded to bf16 for the device, and the apply (decay, then one fused
   multiply-add, as torch's ``mul_`` and ``add_(alpha=)``) with the updated parameter also written in
   bf16. lightning_zeroq/ops/host_adam.py checks both against torch before using them.

   Threads: a small pool of its own (pthreads), one call at a time; the caller's thread works too.
   They take the call's elements in chunks of 256Ki (1 MiB of each fp32 array), one after another, so
   a thread that runs late does not hold the others up (``zq_set_chunk``).
   No Python, no torch: a plain shared object called through ctypes, which releases the GIL for the
   call. Build: cc -O3 -march=native -ffp-contract=off -fno-math-errno -shared -fPIC -pthread. */

#define _GNU_SOURCE
#include <math.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__AVX__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

#define ZQ_DECOUPLED 1      /* AdamW: p *= 1 - lr * wd before the update (else Adam with L2: g += wd * p) */
#define ZQ_L2_FMA 2         /* Adam with weight decay, vector body: g = fma(p, wd, g) (else g + p * wd) */
#define ZQ_V_FMA_A 4        /* vector body: v = fma(v, beta2, (c2 * g) * g) */
#define ZQ_V_FMA_B 8        /* vector body: v = fma(c2 * g, g, v * beta2) (neither: two roundings) */
#define ZQ_TAIL_FMA 16      /* scalar tail: m and the L2 term each as one fma */
#define ZQ_WEIGHT_DECAY 32  /* weight decay is not zero */
#define ZQ_TAIL_V_FMA_A 64  /* scalar tail: v = fma(v, beta2, (c2 * g) * g) */
#define ZQ_TAIL_V_FMA_B 128 /* scalar tail: v = fma(c2 * g, g, v * beta2) */
#define ZQ_VARIANT_BITS (ZQ_L2_FMA | ZQ_V_FMA_A | ZQ_V_FMA_B)

typedef struct {
    float *p, *m, *v;
    const float *g;      /* fp32 gradient, or NULL when gh is given */
    const uint16_t *gh;  /* bf16 gradient, or NULL */
    uint16_t *wh;        /* the updated parameter in bf16, or NULL */
    float *op, *om, *ov; /* where the updated values go instead of p, m, v, or all NULL (in place) */
    int64_t n, vec_end;
    float gmul;     /* gradient multiplier (1: none) */
    float gsign;    /* -1 with maximize */
    float decay;    /* float(1 - lr * wd) (decoupled) */
    float wd;       /* float(wd) (L2) */
    float w;        /* float(1 - beta1), the lerp weight */
    float beta2, c2, bc2s, eps;
    float neg_step; /* float(-(lr / bias_correction1)) */
    float step;     /* float(lr / bias_correction1) */
    int flags;      /* DECOUPLED, WEIGHT_DECAY and the tail's variant; the body's variant is ZQ_BODY (or
                       these flags with -DZQ_PROBE) */
} zq_adam;

static inline float from_bf16(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, 4);
    return f;
}

static inline uint16_t to_bf16(float f) { /* round to nearest even, as torch casts (a NaN: 0x7fc0) */
    uint32_t u;
    memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) return 0x7fc0u;
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One element: the updated (pi, mi, vi) from the old ones and the gradient gi (already scaled). */
static inline __attribute__((always_inline)) void adam_one(const zq_adam *a, int flags, float coeff, int small,
                                                           float *pi, float *mi, float *vi, float gi) {
    gi = gi * a->gsign;
    float p = *pi, m = *mi, v = *vi;
    if (flags & ZQ_WEIGHT_DECAY) {
        if (flags & ZQ_DECOUPLED)
            p = p * a->decay;
        else if (flags & ZQ_L2_FMA)
            gi = fmaf(p, a->wd, gi);
        else
            gi = gi + p * a->wd;
    }
    const float base = small ? m : gi;
    m = fmaf(coeff, gi - m, base);
    const float gg = (a->c2 * gi) * gi;
    if (flags & ZQ_V_FMA_A)
        v = fmaf(v, a->beta2, gg);
    else if (flags & ZQ_V_FMA_B)
        v = fmaf(a->c2 * gi, gi, v * a->beta2);
    else
        v = v * a->beta2 + gg;
    const float denom = sqrtf(v) / a->bc2s + a->eps;
    *pi = p + (a->neg_step * m) / denom;
    *mi = m;
    *vi = v;
}

/* dst[0, n) = src[0, n), the stores bypassing the caches where the target has streaming stores. */
static inline void stream_copy(float *restrict dst, const float *restrict src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i < n && ((uintptr_t)(dst + i) & 63); i++) dst[i] = src[i];
    for (; i + 16 <= n; i += 16) _mm512_stream_ps(dst + i, _mm512_loadu_ps(src + i));
#elif defined(__AVX__)
    for (; i < n && ((uintptr_t)(dst + i) & 31); i++) dst[i] = src[i];
    for (; i + 8 <= n; i += 8) _mm256_stream_ps(dst + i, _mm256_loadu_ps(src + i));
#endif
    for (; i < n; i++) dst[i] = src[i];
}

/* The same for bf16 arrays. */
static inline void stream_copy_half(uint16_t *restrict dst, const uint16_t *restrict src, int64_t n) {
    int64_t i = 0;
#if defined(__AVX512F__)
    for (; i < n && ((uintptr_t)(dst + i) & 63); i++) dst[i] = src[i];
    for (; i + 32 <= n; i += 32) _mm512_stream_si512((void *)(dst + i), _mm512_loadu_si512((const void *)(src + i)));
#elif defined(__AVX__)
    for (; i < n && ((uintptr_t)(dst + i) & 31); i++) dst[i] = src[i];
    for (; i + 16 <= n; i += 16)
        _mm256_stream_si256((__m256i *)(dst + i), _mm256_loadu_si256((const __m256i *)(src + i)));
#endif
    for (; i < n; i++) dst[i] = src[i];
}

#define ZQ_BLOCK 256 /* elements per block of a step out of place (three blocks stay in the L1 cache) */

/* Whether a step in place streams its bf16 copy out (1, the default) or stores it plainly (0, which
   reads each line of the copy first: 2 more bytes of memory traffic per element). */
static int stream_half = 1;

/* The arrays of one call never overlap (the caller's tensors are distinct): the loops say so, since
   the ``restrict`` pointers alone leave GCC more alias checks than it makes. */
#if defined(__clang__)
#define ZQ_NO_ALIAS _Pragma("clang loop vectorize(assume_safety)")
#elif defined(__GNUC__)
#define ZQ_NO_ALIAS _Pragma("GCC ivdep")
#else
#define ZQ_NO_ALIAS
#endif

/* A block's length from ``start``: ZQ_BLOCK, less where the bf16 copy (if any) starts inside a cache
   line, so that every later block streams whole lines of it; at most what is left of [start, hi). */
static inline int64_t block_len(const uint16_t *wh, int64_t start, int64_t hi) {
    int64_t len = ZQ_BLOCK;
    if (wh) len -= (int64_t)(((uintptr_t)(wh + start) & 63) / sizeof(uint16_t));
    return len < hi - start ? len : hi - start;
}

/* The vector body over [lo, hi), block by block: in place, or (``out``) into op, om, ov with p, m, v
   only read. Outputs to arrays the loop does not read (op, om, ov; the bf16 copy) go to blocks in the
   cache and are then streamed out, since plain stores would read each of their lines first. Two
   loops, so each one's pointers are ``restrict`` as they really are. */
static inline __attribute__((always_inline)) void update(const zq_adam *a, int64_t lo, int64_t hi, int flags,
                                                         int out, int half_in, int half_out) {
    const zq_adam h = *a; /* the loops read the hyperparameters from here: no store can change them */
    const float gmul = a->gmul, w = a->w;
    const int small = fabsf(w) < 0.5f;
    const float coeff = small ? w : w - 1.0f;
    uint16_t *const wh = half_out ? a->wh : NULL;
    uint16_t tw[ZQ_BLOCK] __attribute__((aligned(64)));
    float tp[ZQ_BLOCK] __attribute__((aligned(64))), tm[ZQ_BLOCK] __attribute__((aligned(64))),
        tv[ZQ_BLOCK] __attribute__((aligned(64)));
    for (int64_t start = lo, len; start < hi; start += len) {
        len = out || half_out ? block_len(wh, start, hi) : hi - start; /* nothing to stream: one block */
        const float *restrict gb = half_in ? NULL : a->g + start;
        const uint16_t *restrict ghb = half_in ? a->gh + start : NULL;
        if (out) {
            const float *restrict p = a->p + start, *restrict m = a->m + start, *restrict v = a->v + start;
            ZQ_NO_ALIAS
            for (int64_t i = 0; i < len; i++) {
                float pi = p[i], mi = m[i], vi = v[i];
                adam_one(&h, flags, coeff, small, &pi, &mi, &vi, (half_in ? from_bf16(ghb[i]) : gb[i]) * gmul);
                tp[i] = pi;
                tm[i] = mi;
                tv[i] = vi;
                if (half_out) tw[i] = to_bf16(pi);
            }
            stream_copy(a->op + start, tp, len);
            stream_copy(a->om + start, tm, len);
            stream_copy(a->ov + start, tv, len);
        } else {
            float *restrict p = a->p + start, *restrict m = a->m + start, *restrict v = a->v + start;
            ZQ_NO_ALIAS
            for (int64_t i = 0; i < len; i++) {
                float pi = p[i], mi = m[i], vi = v[i];
                adam_one(&h, flags, coeff, small, &pi, &mi, &vi, (half_in ? from_bf16(ghb[i]) : gb[i]) * gmul);
                p[i] = pi;
                m[i] = mi;
                v[i] = vi;
                if (half_out) tw[i] = to_bf16(pi);
            }
        }
        if (half_out && (out || stream_half))
            stream_copy_half(wh + start, tw, len);
        else if (half_out)
            memcpy(wh + start, tw, (size_t)len * sizeof(uint16_t)); /* plain stores (zq_set_stream_half(0)) */
    }
#if defined(__AVX__) || defined(__AVX512F__)
    if (out || half_out) _mm_sfence();
#endif
}

/* torch's scalar tail: the last n % (its vector width) elements of each tensor. */
static void tail(const zq_adam *a) {
    const int flags = a->flags, contract = flags & ZQ_TAIL_FMA;
    for (int64_t i = a->vec_end; i < a->n; i++) {
        float pi = a->p[i], mi = a->m[i], vi = a->v[i];
        float gi = (a->gh ? from_bf16(a->gh[i]) : a->g[i]) * a->gmul;
        gi = gi * a->gsign;
        if (flags & ZQ_WEIGHT_DECAY) {
            if (flags & ZQ_DECOUPLED)
                pi = pi * a->decay;
            else
                gi = contract ? fmaf(pi, a->wd, gi) : gi + pi * a->wd;
        }
        const float w = a->w;
        if (fabsf(w) < 0.5f)
            mi = contract ? fmaf(w, gi - mi, mi) : mi + w * (gi - mi);
        else
            mi = contract ? fmaf(-(gi - mi), 1.0f - w, gi) : gi - (gi - mi) * (1.0f - w);
        if (flags & ZQ_TAIL_V_FMA_A)
            vi = fmaf(vi, a->beta2, (a->c2 * gi) * gi);
        else if (flags & ZQ_TAIL_V_FMA_B)
            vi = fmaf(a->c2 * gi, gi, vi * a->beta2);
        else
            vi = vi * a->beta2 + (a->c2 * gi) * gi;
        const float denom = sqrtf(vi) / a->bc2s + a->eps;
        pi = pi - (a->step * mi) / denom;
        (a->op ? a->op : a->p)[i] = pi;
        (a->om ? a->om : a->m)[i] = mi;
        (a->ov ? a->ov : a->v)[i] = vi;
        if (a->wh) a->wh[i] = to_bf16(pi);
    }
}

#ifdef ZQ_PROBE
/* Every variant at run time: only for finding the one that matches torch (small arrays). */
static void run_range(const zq_adam *a, int64_t lo, int64_t hi) {
    update(a, lo, hi, a->flags, a->op != NULL, a->gh != NULL, a->wh != NULL);
}
#else
#ifndef ZQ_BODY
#error "build with -DZQ_PROBE, or with -DZQ_BODY=<the variant's flags> (lightning_zeroq/ops/host_adam.py does)"
#endif
/* One loop per mode and buffer choice, each vectorized without branches. */
#define ZQ_LOOP(MODE)                                                          \
    do {                                                                       \
        const int f = (MODE) | (ZQ_BODY & ZQ_VARIANT_BITS);                    \
        switch ((a->op != NULL) * 4 + (a->gh != NULL) * 2 + (a->wh != NULL)) { \
        case 0: update(a, lo, hi, f, 0, 0, 0); return;                         \
        case 1: update(a, lo, hi, f, 0, 0, 1); return;                         \
        case 2: update(a, lo, hi, f, 0, 1, 0); return;                         \
        case 3: update(a, lo, hi, f, 0, 1, 1); return;                         \
        case 4: update(a, lo, hi, f, 1, 0, 0); return;                         \
        case 5: update(a, lo, hi, f, 1, 0, 1); return;                         \
        case 6: update(a, lo, hi, f, 1, 1, 0); return;                         \
        default: update(a, lo, hi, f, 1, 1, 1); return;                        \
        }                                                                      \
    } while (0)

static void run_range(const zq_adam *a, int64_t lo, int64_t hi) {
    if (!(a->flags & ZQ_WEIGHT_DECAY))
        ZQ_LOOP(0);
    else if (a->flags & ZQ_DECOUPLED)
        ZQ_LOOP(ZQ_WEIGHT_DECAY | ZQ_DECOUPLED);
    else
        ZQ_LOOP(ZQ_WEIGHT_DECAY);
}
#endif

static void adam_range(const void *job, int64_t lo, int64_t hi) { run_range((const zq_adam *)job, lo, hi); }

/* ---- Muon's elementwise parts ---------------------------------------------------------------- */

typedef struct {
    float *buf;         /* the momentum buffer, updated in place */
    const float *g;     /* fp32 gradient, or NULL when gh is given */
    const uint16_t *gh; /* bf16 gradient, or NULL */
    float *out;         /* the blended update (fp32), or NULL when out_h is given */
    uint16_t *out_h;    /* the blended update rounded to bf16, or NULL */
    int64_t n;
    float gmul;     /* gradient multiplier (1: none), applied first as grad.mul_(gmul) */
    float w;        /* float(1 - momentum): buf.lerp_(g, w) */
    float momentum; /* float(momentum): the update g.lerp(buf, momentum) with nesterov, else buf */
    int nesterov;
} zq_muon_blend;

typedef struct {
    float *p;           /* the fp32 master, updated in place */
    const float *u;     /* the orthogonalized update (fp32), or NULL when uh is given */
    const uint16_t *uh; /* the same in bf16, or NULL */
    uint16_t *wh;       /* the updated parameter rounded to bf16, or NULL */
    int64_t n;
    float decay;  /* float(1 - lr * weight_decay): 1 without weight decay, which multiplies exactly */
    float neg_lr; /* float(-(the learning rate adjusted to the matrix's shape)) */
} zq_muon_apply;

/* torch's lerp(start, end, w) with a scalar weight: one rounding of a fused multiply-add, from start
   for a small weight and from end for a large one (its vector form; its scalar form contracts alike). */
static inline __attribute__((always_inline)) float lerp_fma(float start, float end, float c, int small) {
    return fmaf(c, end - start, small ? start : end);
}

static inline __attribute__((always_inline)) void blend_body(const zq_muon_blend *a, int64_t lo, int64_t hi,
                                                             int half_in, int nesterov, int half_out) {
    const float gmul = a->gmul, w = a->w, mom = a->momentum;
    const int small_w = fabsf(w) < 0.5f, small_m = fabsf(mom) < 0.5f;
    const float cw = small_w ? w : w - 1.0f, cm = small_m ? mom : mom - 1.0f;
    float *restrict buf = a->buf;
    const float *restrict g = a->g;
    const uint16_t *restrict gh = a->gh;
    float *restrict out = a->out;
    uint16_t *restrict out_h = a->out_h;
    ZQ_NO_ALIAS
    for (int64_t i = lo; i < hi; i++) {
        const float gi = (half_in ? from_bf16(gh[i]) : g[i]) * gmul;
        const float b = lerp_fma(buf[i], gi, cw, small_w);
        buf[i] = b;
        const float u = nesterov ? lerp_fma(gi, b, cm, small_m) : b;
        if (half_out)
            out_h[i] = to_bf16(u);
        else
            out[i] = u;
    }
}

/* One loop per combination of three flags, each vectorized without branches: ``BODY(a, lo, hi, x, y, z)``. */
#define ZQ_SWITCH3(BODY, a, lo, hi, x, y, z)                     \
    switch ((x) * 4 + (y) * 2 + (z)) {                           \
    case 0: BODY(a, lo, hi, 0, 0, 0); return;                    \
    case 1: BODY(a, lo, hi, 0, 0, 1); return;                    \
    case 2: BODY(a, lo, hi, 0, 1, 0); return;                    \
    case 3: BODY(a, lo, hi, 0, 1, 1); return;                    \
    case 4: BODY(a, lo, hi, 1, 0, 0); return;                    \
    case 5: BODY(a, lo, hi, 1, 0, 1); return;                    \
    case 6: BODY(a, lo, hi, 1, 1, 0); return;                    \
    default: BODY(a, lo, hi, 1, 1, 1); return;                   \
    }

static void muon_blend_range(const void *job, int64_t lo, int64_t hi) {
    const zq_muon_blend *a = (const zq_muon_blend *)job;
    ZQ_SWITCH3(blend_body, a, lo, hi, a->gh != NULL, a->nesterov != 0, a->out_h != NULL);
}

static inline __attribute__((always_inline)) void apply_body(const zq_muon_apply *a, int64_t lo, int64_t hi,
                                                             int half_in, int half_out) {
    const float decay = a->decay, neg_lr = a->neg_lr;
    float *restrict p = a->p;
    const float *restrict u = a->u;
    const uint16_t *restrict uh = a->uh;
    uint16_t *restrict wh = a->wh;
    ZQ_NO_ALIAS
    for (int64_t i = lo; i < hi; i++) {
        const float pi = fmaf(half_in ? from_bf16(uh[i]) : u[i], neg_lr, p[i] * decay);
        p[i] = pi;
        if (half_out) wh[i] = to_bf16(pi);
    }
}

static void muon_apply_range(const void *job, int64_t lo, int64_t hi) {
    const zq_muon_apply *a = (const zq_muon_apply *)job;
    if (a->uh != NULL) {
        if (a->wh != NULL) apply_body(a, lo, hi, 1, 1); else apply_body(a, lo, hi, 1, 0);
    } else {
        if (a->wh != NULL) apply_body(a, lo, hi, 0, 1); else apply_body(a, lo, hi, 0, 0);
    }
}

/* ---- the pool ------------------------------------------------------------------------------ */

/* One array set of a call: the elements [0, len) of ``job``, in ranges, by ``run``. */
typedef struct {
    void (*run)(const void *job, int64_t lo, int64_t hi);
    const void *job;
    int64_t len;
} zq_task;

#define ZQ_MAX_THREADS 256

static pthread_mutex_t pool_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_mutex_t call_lock = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t pool_wake = PTHREAD_COND_INITIALIZER;
static pthread_cond_t pool_done = PTHREAD_COND_INITIALIZER;
static int pool_workers = 0; /* threads started (the caller is one more) */
static uint64_t pool_generation = 0;
static int pool_remaining = 0;
static const zq_task *pool_jobs = NULL;
static int pool_count = 0;
static int pool_parts = 1;
static int64_t pool_call_chunk = 0;
static int pool_cpus[ZQ_MAX_THREADS];
static int pool_bound = 0; /* pool_cpus holds one cpu per part (0: no binding) */

static int64_t pool_chunk = 1 << 18; /* elements a thread takes at a time (0: one fixed part each) */
static int64_t pool_next = 0;        /* the next chunk of this call to take (atomic) */

/* Fixed parts (pool_chunk 0): each array set cut into ``parts`` cache-line (16 float) aligned pieces,
   one per thread. A thread that is descheduled holds the whole call up. */
static void part_range(const zq_task *a, int part, int parts, int64_t *lo, int64_t *hi) {
    const int64_t lines = (a->len + 15) / 16;
    const int64_t per = (lines + parts - 1) / parts;
    int64_t start = (int64_t)part * per * 16, end = start + per * 16;
    if (start > a->len) start = a->len;
    if (end > a->len) end = a->len;
    *lo = start;
    *hi = end;
}

static int64_t chunks_of(const zq_task *a, int64_t chunk) { return (a->len + chunk - 1) / chunk; }

/* Chunks (pool_chunk > 0): every thread takes the next chunk of ``pool_chunk`` elements of the call's
   bodies until none is left, so a thread that runs late (another process, the caller's own thread
   busy elsewhere, an interrupt) leaves its share to the others. The numbers are the same whatever
   the split: each element's update reads and writes that element only. */
static void run_chunks(const zq_task *jobs, int count, int64_t chunk) {
    int j = 0;
    int64_t before = 0; /* chunks of the jobs before job j */
    for (;;) {
        const int64_t c = __atomic_fetch_add(&pool_next, 1, __ATOMIC_RELAXED);
        while (j < count && c >= before + chunks_of(&jobs[j], chunk)) before += chunks_of(&jobs[j++], chunk);
        if (j >= count) return;
        const int64_t lo = (c - before) * chunk;
        const int64_t hi = lo + chunk < jobs[j].len ? lo + chunk : jobs[j].len;
        jobs[j].run(jobs[j].job, lo, hi);
    }
}

/* Thread ``part``'s share of every job. */
static void run_part(const zq_task *jobs, int count, int part, int parts, int64_t chunk) {
    if (chunk > 0) {
        run_chunks(jobs, count, chunk);
        return;
    }
    for (int j = 0; j < count; j++) {
        int64_t lo, hi;
        part_range(&jobs[j], part, parts, &lo, &hi);
        if (lo < hi) jobs[j].run(jobs[j].job, lo, hi);
    }
}

static void bind_self(int part) {
    if (part >= pool_bound) return;
    cpu_set_t set;
    CPU_ZERO(&set);
    CPU_SET(pool_cpus[part], &set);
    sched_setaffinity(0, sizeof(set), &set);
}

static void *worker(void *arg) {
    const int id = (int)(intptr_t)arg; /* its part (the caller takes part 0) */
    uint64_t seen = 0;
    int bound = 0;
    for (;;) {
        pthread_mutex_lock(&pool_lock);
        while (pool_generation == seen) pthread_cond_wait(&pool_wake, &pool_lock);
        seen = pool_generation;
        const zq_task *jobs = pool_jobs;
        const int count = pool_count, parts = pool_parts;
        const int64_t chunk = pool_call_chunk;
        pthread_mutex_unlock(&pool_lock);
        if (!bound) {
            bind_self(id);
            bound = 1;
        }
        if (id < parts) run_part(jobs, count, id, parts, chunk);
        pthread_mutex_lock(&pool_lock);
        if (--pool_remaining == 0) pthread_cond_signal(&pool_done);
        pthread_mutex_unlock(&pool_lock);
    }
    return NULL;
}

static int grow_pool(int workers) {
    while (pool_workers < workers) {
        pthread_t thread;
        if (pthread_create(&thread, NULL, worker, (void *)(intptr_t)(pool_workers + 1)) != 0) return -1;
        pthread_detach(thread);
        pool_workers++;
    }
    return 0;
}

/* Bind the threads that start from now on: part i to cpus[i] (the caller's thread is not bound).
   Call before the first step. Returns 0, or -1 for a bad count. */
int zq_bind(const int *cpus, int count) {
    if (count < 0 || count > ZQ_MAX_THREADS) return -1;
    pthread_mutex_lock(&call_lock);
    pthread_mutex_lock(&pool_lock);
    for (int i = 0; i < count; i++) pool_cpus[i] = cpus[i];
    pool_bound = count;
    pthread_mutex_unlock(&pool_lock);
    pthread_mutex_unlock(&call_lock);
    return 0;
}

/* How the threads share a call's elements: chunks of ``elements`` (a positive multiple of 16) taken
   one after another, or (0) one fixed part per thread. Returns 0, or -1 for a bad value. */
int zq_set_chunk(int64_t elements) {
    if (elements < 0 || elements % 16 != 0) return -1;
    pthread_mutex_lock(&call_lock);
    pool_chunk = elements;
    pthread_mutex_unlock(&call_lock);
    return 0;
}

/* Whether a step in place streams its bf16 copy past the caches (1, the default) or stores it (0).
   The numbers are the same either way. Returns 0, or -1 for a value other than 0 or 1. */
int zq_set_stream_half(int on) {
    if (on != 0 && on != 1) return -1;
    pthread_mutex_lock(&call_lock);
    stream_half = on;
    pthread_mutex_unlock(&call_lock);
    return 0;
}

/* ``count`` tasks with ``threads`` threads (the caller's included): one wake-up of the pool for all
   of them. Called with call_lock held. Returns 0, or -1 when a thread could not be started (nothing
   was written). */
static int run_tasks(const zq_task *tasks, int count, int threads) {
    int64_t total = 0;
    for (int j = 0; j < count; j++) total += tasks[j].len;
    if (threads < 1) threads = 1;
    if (threads > ZQ_MAX_THREADS) threads = ZQ_MAX_THREADS;
    /* Small work: the pool's wake-up would cost more than it saves. */
    if (total < (int64_t)threads * 16384) threads = (int)(total / 16384) + 1;
    if (threads > 1) {
        pthread_mutex_lock(&pool_lock);
        if (grow_pool(threads - 1) != 0) {
            pthread_mutex_unlock(&pool_lock);
            return -1;
        }
        pool_jobs = tasks;
        pool_count = count;
        pool_parts = threads;
        pool_call_chunk = pool_chunk;
        pool_next = 0;
        pool_remaining = pool_workers;
        pool_generation++;
        pthread_cond_broadcast(&pool_wake);
        pthread_mutex_unlock(&pool_lock);
    }
    run_part(tasks, count, 0, threads, threads > 1 ? pool_call_chunk : 0);
    if (threads > 1) {
        pthread_mutex_lock(&pool_lock);
        while (pool_remaining > 0) pthread_cond_wait(&pool_done, &pool_lock);
        pthread_mutex_unlock(&pool_lock);
    }
    return 0;
}

/* The tasks of ``count`` jobs of ``size`` bytes each, run by ``run`` over ``len(job)`` elements. */
static int run_jobs(const void *jobs, size_t size, int count, int threads,
                    void (*run)(const void *, int64_t, int64_t), int64_t (*len)(const void *)) {
    if (count <= 0) return 0;
    zq_task stack[64] = {{0}};
    zq_task *tasks = count <= 64 ? stack : (zq_task *)malloc(sizeof(zq_task) * (size_t)count);
    if (tasks == NULL) return -1;
    for (int j = 0; j < count; j++) {
        const void *job = (const char *)jobs + (size_t)j * size;
        tasks[j] = (zq_task){run, job, len(job)};
    }
    const int done = run_tasks(tasks, count, threads);
    if (tasks != stack) free(tasks);
    return done;
}

static int64_t adam_len(const void *job) { return ((const zq_adam *)job)->vec_end; }
static int64_t blend_len(const void *job) { return ((const zq_muon_blend *)job)->n; }
static int64_t apply_len(const void *job) { return ((const zq_muon_apply *)job)->n; }

/* One step over ``count`` array sets with ``threads`` threads (the caller's included): one wake-up of
   the pool for all of them. Returns 0, or -1 when a thread could not be started (nothing was written). */
int zq_adam_steps(const zq_adam *jobs, int count, int threads) {
    pthread_mutex_lock(&call_lock);
    const int done = run_jobs(jobs, sizeof(zq_adam), count, threads, adam_range, adam_len);
    if (done == 0)
        for (int j = 0; j < count; j++) tail(&jobs[j]);
    pthread_mutex_unlock(&call_lock);
    return done;
}

/* Muon's momentum blend over ``count`` array sets (every element in the fused form: no tail). Returns
   0, or -1 when a thread could not be started (nothing was written). */
int zq_muon_blends(const zq_muon_blend *jobs, int count, int threads) {
    pthread_mutex_lock(&call_lock);
    const int done = run_jobs(jobs, sizeof(zq_muon_blend), count, threads, muon_blend_range, blend_len);
    pthread_mutex_unlock(&call_lock);
    return done;
}

/* Muon's apply of the orthogonalized updates over ``count`` array sets. Returns as zq_muon_blends. */
int zq_muon_applies(const zq_muon_apply *jobs, int count, int threads) {
    pthread_mutex_lock(&call_lock);
    const int done = run_jobs(jobs, sizeof(zq_muon_apply), count, threads, muon_apply_range, apply_len);
    pthread_mutex_unlock(&call_lock);
    return done;
}

/* ---- the host's memory bandwidth ------------------------------------------------------------- */

/* STREAM's triad, a[i] = b[i] + s * c[i], over [0, n) with ``threads`` threads (the caller's included),
   each taking one contiguous part (cache-line aligned), bound as the pool's threads are (``zq_bind``);
   ``streaming``: a's stores bypass the caches (no line of a is read first), else plain stores. The
   benchmarks measure the host step's bytes per second against this (``ops.host_adam.HostAdam.triad``).
   Returns 0, or -1 when a thread could not be started. */
typedef struct {
    float *a;
    const float *b, *c;
    float s;
    int64_t lo, hi;
    int streaming, part;
} zq_triad_part;

static void *triad_part(void *arg) {
    const zq_triad_part *t = (const zq_triad_part *)arg;
    if (t->part > 0) bind_self(t->part);
    float *restrict a = t->a;
    const float *restrict b = t->b, *restrict c = t->c;
    const float s = t->s;
    int64_t i = t->lo;
#if defined(__AVX512F__)
    if (t->streaming) {
        const __m512 vs = _mm512_set1_ps(s);
        for (; i < t->hi && ((uintptr_t)(a + i) & 63); i++) a[i] = b[i] + s * c[i];
        for (; i + 16 <= t->hi; i += 16)
            _mm512_stream_ps(a + i, _mm512_add_ps(_mm512_loadu_ps(b + i), _mm512_mul_ps(vs, _mm512_loadu_ps(c + i))));
    }
#elif defined(__AVX__)
    if (t->streaming) {
        const __m256 vs = _mm256_set1_ps(s);
        for (; i < t->hi && ((uintptr_t)(a + i) & 31); i++) a[i] = b[i] + s * c[i];
        for (; i + 8 <= t->hi; i += 8)
            _mm256_stream_ps(a + i, _mm256_add_ps(_mm256_loadu_ps(b + i), _mm256_mul_ps(vs, _mm256_loadu_ps(c + i))));
    }
#endif
    for (; i < t->hi; i++) a[i] = b[i] + s * c[i];
    return NULL;
}

int zq_triad(float *a, const float *b, const float *c, float s, int64_t n, int threads, int streaming) {
    if (threads < 1) threads = 1;
    if (threads > ZQ_MAX_THREADS) threads = ZQ_MAX_THREADS;
    zq_triad_part parts[ZQ_MAX_THREADS];
    pthread_t started[ZQ_MAX_THREADS];
    const int64_t lines = (n + 15) / 16, per = (lines + threads - 1) / threads;
    int ok = 0;
    for (int t = 0; t < threads; t++) {
        int64_t lo = (int64_t)t * per * 16, hi = lo + per * 16;
        parts[t] = (zq_triad_part){a, b, c, s, lo < n ? lo : n, hi < n ? hi : n, streaming, t};
    }
    for (int t = 1; t < threads; t++, ok++)
        if (pthread_create(&started[t], NULL, triad_part, &parts[t]) != 0) break;
    triad_part(&parts[0]);
    for (int t = 1; t <= ok; t++) pthread_join(started[t], NULL);
    if (ok != threads - 1) return -1;
#if defined(__AVX512F__) || defined(__AVX__)
    _mm_sfence();
#endif
    return 0;
}
