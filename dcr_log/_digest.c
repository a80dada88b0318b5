/* Sum digests (spec/FORMAT.md section 7.1) over raw word buffers: the element hash
 * e(f, w) = mix64(((f + 1) * G) XOR w), summed mod 2^64. numpy needs eleven passes over a
 * buffer for what is one loop here; the GIL is released, so threads hash in parallel.
 * dcr_log/digest.py holds the reference (and a numpy fallback when this is not built). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_prefetch.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "words are read as little-endian integers"
#endif

#define G 0x9E3779B97F4A7C15ULL

static inline uint64_t mix64(uint64_t z) {
    z ^= z >> 30;
    z *= 0xBF58476D1CE4E5B9ULL;
    z ^= z >> 27;
    z *= 0x94D049BB133111EBULL;
    z ^= z >> 31;
    return z;
}

/* On x86-64 glibc the hashing loops are also compiled for AVX2 (and, with GCC 11 or later, for
 * x86-64-v4: AVX-512 has a 64-bit multiply) and picked at load time (ifunc): the compiler then
 * hashes four (eight) elements per instruction; a bf16 run at 1.5 (0.74) ns per element
 * against 2.9 for the portable loop, on one core here. Elsewhere (musl has no ifunc, older
 * clang no target_clones) the one portable loop is built. */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) \
    && __GNUC__ >= 11
#define VECTOR_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#elif defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) \
    && (!defined(__clang__) || __clang_major__ >= 14)
#define VECTOR_CLONES __attribute__((target_clones("avx2", "default")))
#else
#define VECTOR_CLONES
#endif

/* Elements start .. start + n - 1, words contiguous; one loop per word width (the width is
 * not looked at per element), written so that the compiler vectorises it: the key (f + 1) * G
 * advances by G per element, an add where there was a multiply. */
#define SUM_RUN(T)                                                                   \
    VECTOR_CLONES static uint64_t sum_run_##T(const unsigned char *p, Py_ssize_t n,  \
                                              uint64_t start) {                      \
        uint64_t s = 0, k = (start + 1) * G;                                         \
        for (Py_ssize_t i = 0; i < n; i++, k += G) {                                 \
            T v;                                                                     \
            memcpy(&v, p + sizeof(T) * i, sizeof v);                                 \
            s += mix64(k ^ v);                                                       \
        }                                                                            \
        return s;                                                                    \
    }

SUM_RUN(uint8_t)
SUM_RUN(uint16_t)
SUM_RUN(uint32_t)
SUM_RUN(uint64_t)

/* On x86-64 CPUs with AVX2 and without AVX-512 (AMD before Zen 4, Intel client cores) a run
 * is hashed by the vector unit and the scalar multiplier side by side: each step hashes 8
 * elements in two vectors (AVX2 has no 64-bit multiply: three 32-bit ones each) and 3 with
 * mulx, which the vector loop leaves idle. On an AVX2-only EPYC a numpy receiver's apply at
 * verify full, which hashes the whole state, took 0.204-0.266 s against 0.276-0.325 s with
 * the AVX2 clone alone (tools/bench_apply.py --gib 0.5 --reps 9 --receivers numpy --verify
 * full --rates 0.01, two alternating pairs). */
#if defined(__x86_64__) && defined(__GNUC__) \
    && ((defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && __GNUC__ >= 11))
#include <immintrin.h>
#define HAVE_SUM_HYBRID 1
#define AVX2_TARGET __attribute__((target("avx2")))

AVX2_TARGET static inline __m256i mul64(__m256i a, __m256i c) { /* a * c mod 2^64, per lane */
    __m256i cross = _mm256_add_epi64(_mm256_mul_epu32(_mm256_srli_epi64(a, 32), c),
                                     _mm256_mul_epu32(a, _mm256_srli_epi64(c, 32)));
    return _mm256_add_epi64(_mm256_mul_epu32(a, c), _mm256_slli_epi64(cross, 32));
}

AVX2_TARGET static inline __m256i mix64x4(__m256i z) {
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 30));
    z = mul64(z, _mm256_set1_epi64x((long long)0xBF58476D1CE4E5B9ULL));
    z = _mm256_xor_si256(z, _mm256_srli_epi64(z, 27));
    z = mul64(z, _mm256_set1_epi64x((long long)0x94D049BB133111EBULL));
    return _mm256_xor_si256(z, _mm256_srli_epi64(z, 31));
}

#define STEP_WORDS 11 /* 8 in the vectors, 3 scalar */
#define SUM_HYBRID(T, LOAD4)                                                         \
    AVX2_TARGET static uint64_t sum_hybrid_##T(const unsigned char *p, Py_ssize_t n, uint64_t start) { \
        __m256i acc[2], key[2];                                                      \
        for (int v = 0; v < 2; v++) {                                                \
            uint64_t f = start + 1 + 4 * (uint64_t)v;                                \
            acc[v] = _mm256_setzero_si256();                                         \
            key[v] = _mm256_set_epi64x((long long)((f + 3) * G), (long long)((f + 2) * G), \
                                       (long long)((f + 1) * G), (long long)(f * G)); \
        }                                                                            \
        const __m256i step = _mm256_set1_epi64x((long long)(STEP_WORDS * G));        \
        uint64_t s = 0, k = (start + 1 + 8) * G;                                     \
        Py_ssize_t i = 0;                                                            \
        for (; i + STEP_WORDS <= n; i += STEP_WORDS, k += STEP_WORDS * G) {          \
            for (int v = 0; v < 2; v++) {                                            \
                __m256i z = _mm256_xor_si256(key[v], LOAD4(p + sizeof(T) * (size_t)(i + 4 * v))); \
                acc[v] = _mm256_add_epi64(acc[v], mix64x4(z));                       \
                key[v] = _mm256_add_epi64(key[v], step);                             \
            }                                                                        \
            for (int j = 0; j < 3; j++) {                                            \
                T x;                                                                 \
                memcpy(&x, p + sizeof(T) * (size_t)(i + 8 + j), sizeof x);           \
                s += mix64((k + (uint64_t)j * G) ^ x);                               \
            }                                                                        \
        }                                                                            \
        uint64_t lanes[4];                                                           \
        for (int v = 0; v < 2; v++) {                                                \
            _mm256_storeu_si256((__m256i *)(void *)lanes, acc[v]);                   \
            s += lanes[0] + lanes[1] + lanes[2] + lanes[3];                          \
        }                                                                            \
        for (; i < n; i++) {                                                         \
            T x;                                                                     \
            memcpy(&x, p + sizeof(T) * (size_t)i, sizeof x);                         \
            s += mix64(((start + 1 + (uint64_t)i) * G) ^ x);                         \
        }                                                                            \
        return s;                                                                    \
    }

static inline int load_i32(const unsigned char *q) {
    int v;
    memcpy(&v, q, sizeof v);
    return v;
}

#define LOAD4_U8(q) _mm256_cvtepu8_epi64(_mm_cvtsi32_si128(load_i32(q)))
#define LOAD4_U16(q) _mm256_cvtepu16_epi64(_mm_loadl_epi64((const __m128i *)(const void *)(q)))
#define LOAD4_U32(q) _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(const void *)(q)))
#define LOAD4_U64(q) _mm256_loadu_si256((const __m256i *)(const void *)(q))

SUM_HYBRID(uint8_t, LOAD4_U8)
SUM_HYBRID(uint16_t, LOAD4_U16)
SUM_HYBRID(uint32_t, LOAD4_U32)
SUM_HYBRID(uint64_t, LOAD4_U64)

/* AVX2 without the AVX-512 the x86-64-v4 clones need */
static int hybrid_is_best(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        int v4 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                 && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("avx512dq")
                 && __builtin_cpu_supports("avx512vl");
        known = __builtin_cpu_supports("avx2") && !v4;
    }
    return known;
}

static int have_avx2(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2");
    }
    return known;
}
#endif

/* The loops sum_run may take (RUN_PATHS): 0 the compiled loop (its best clone), 1 the hybrid
 * one; -1 picks the faster for the CPU. */
static int run_path(int asked) {
#ifdef HAVE_SUM_HYBRID
    if (asked < 0)
        return hybrid_is_best();
    return asked > 0 && have_avx2();
#else
    (void)asked;
    return 0;
#endif
}

static uint64_t sum_run_one(const unsigned char *p, Py_ssize_t n, int width, uint64_t start, int hybrid) {
#ifdef HAVE_SUM_HYBRID
    if (hybrid) {
        switch (width) {
        case 1: return sum_hybrid_uint8_t(p, n, start);
        case 2: return sum_hybrid_uint16_t(p, n, start);
        case 4: return sum_hybrid_uint32_t(p, n, start);
        default: return sum_hybrid_uint64_t(p, n, start);
        }
    }
#else
    (void)hybrid;
#endif
    switch (width) {
    case 1: return sum_run_uint8_t(p, n, start);
    case 2: return sum_run_uint16_t(p, n, start);
    case 4: return sum_run_uint32_t(p, n, start);
    default: return sum_run_uint64_t(p, n, start);
    }
}

/* A run in blocks of RUN_BLOCK bytes, each block's lines requested (one prefetch a line) before
 * it is hashed. The hashing loop asks for a line only when it reaches it, so out of cache the
 * CPU keeps few lines in flight: on a 2-core Xeon host one core hashed 512 MiB of bf16 at 1.2
 * ns a word, its memory giving 17 GB/s to a plain read; with the block's 64 lines asked for
 * together, 0.41 ns (a one-off C timing of this loop). */
#define RUN_BLOCK 4096

static uint64_t sum_run_path(const unsigned char *p, Py_ssize_t n, int width, uint64_t start, int hybrid) {
    uint64_t s = 0;
    Py_ssize_t per = RUN_BLOCK / width;
    for (Py_ssize_t lo = 0; lo < n; lo += per) {
        Py_ssize_t m = n - lo < per ? n - lo : per;
        const unsigned char *q = p + (size_t)lo * width;
        for (Py_ssize_t b = 0; b < m * width; b += 64)
            __builtin_prefetch(q + b, 0, 3);
        s += sum_run_one(q, m, width, start + (uint64_t)lo, hybrid);
    }
    return s;
}

/* The base and target sums of one record in one pass: e(positions[i] + offset, base[i]) and
 * e(positions[i] + offset, new[i]), for a record whose box is one run of the tensor's flat
 * order (a row block), so no flat index array is built. */
#define SUM_PAIR(T)                                                                  \
    VECTOR_CLONES static void sum_pair_##T(const int64_t *pos, Py_ssize_t n, uint64_t offset, \
                                           const unsigned char *b, const unsigned char *w, \
                                           uint64_t *sb, uint64_t *sw) {             \
        uint64_t s = 0, t = 0;                                                       \
        for (Py_ssize_t i = 0; i < n; i++) {                                         \
            T bv, wv;                                                                \
            int64_t at;                                                              \
            memcpy(&at, pos + i, sizeof at);                                         \
            memcpy(&bv, b + sizeof(T) * i, sizeof bv);                               \
            memcpy(&wv, w + sizeof(T) * i, sizeof wv);                               \
            uint64_t k = ((uint64_t)at + offset + 1) * G;                            \
            s += mix64(k ^ bv);                                                      \
            t += mix64(k ^ wv);                                                      \
        }                                                                            \
        *sb = s;                                                                     \
        *sw = t;                                                                     \
    }

SUM_PAIR(uint8_t)
SUM_PAIR(uint16_t)
SUM_PAIR(uint32_t)
SUM_PAIR(uint64_t)

/* e(flat[i], words[i]) summed, for flat indices in any order (a record's changed positions);
 * like SUM_PAIR, a loop per width that the compiler vectorises. */
#define SUM_AT(T)                                                                    \
    VECTOR_CLONES static uint64_t sum_at_##T(const int64_t *flat, Py_ssize_t n,       \
                                             const unsigned char *w) {               \
        uint64_t s = 0;                                                              \
        for (Py_ssize_t i = 0; i < n; i++) {                                         \
            T v;                                                                     \
            int64_t at;                                                              \
            memcpy(&at, flat + i, sizeof at);                                        \
            memcpy(&v, w + sizeof(T) * i, sizeof v);                                 \
            s += mix64(((uint64_t)at + 1) * G ^ v);                                  \
        }                                                                            \
        return s;                                                                    \
    }

SUM_AT(uint8_t)
SUM_AT(uint16_t)
SUM_AT(uint32_t)
SUM_AT(uint64_t)

static int check_width(int width) {
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "word width must be 1, 2, 4 or 8");
        return 0;
    }
    return 1;
}

/* sum_range(words, width, start[, path]): path (RUN_PATHS) picks the loop, so that tests run
 * each one the CPU has; by default the faster. */
static PyObject *py_sum_range(PyObject *self, PyObject *args) {
    Py_buffer words;
    int width, path = -1;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "y*iK|i", &words, &width, &start, &path))
        return NULL;
    if (!check_width(width) || words.len % width) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "buffer is not a whole number of words");
        PyBuffer_Release(&words);
        return NULL;
    }
    uint64_t s;
    Py_BEGIN_ALLOW_THREADS
    s = sum_run_path(words.buf, words.len / width, width, start, run_path(path));
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&words);
    return PyLong_FromUnsignedLongLong(s);
}

/* sum_runs(starts, run, words, width): runs of `run` elements starting at flat indices
 * starts[r] (int64), their words one run after another. */
static PyObject *py_sum_runs(PyObject *self, PyObject *args) {
    Py_buffer starts, words;
    Py_ssize_t run;
    int width;
    if (!PyArg_ParseTuple(args, "y*ny*i", &starts, &run, &words, &width))
        return NULL;
    Py_ssize_t nruns = starts.len / 8;
    if (!check_width(width) || starts.len % 8 || run < 0 || words.len != nruns * run * width) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "runs and words do not match");
        PyBuffer_Release(&starts);
        PyBuffer_Release(&words);
        return NULL;
    }
    uint64_t s = 0;
    int hybrid = run_path(-1);
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *w = words.buf;
    for (Py_ssize_t r = 0; r < nruns; r++) {
        int64_t first;
        memcpy(&first, (const unsigned char *)starts.buf + 8 * r, 8);
        s += sum_run_path(w + (size_t)r * run * width, run, width, (uint64_t)first, hybrid);
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&starts);
    PyBuffer_Release(&words);
    return PyLong_FromUnsignedLongLong(s);
}

/* sum_at(flat, words, width): e(flat[i], words[i]) summed; flat is int64. */
static PyObject *py_sum_at(PyObject *self, PyObject *args) {
    Py_buffer flat, words;
    int width;
    if (!PyArg_ParseTuple(args, "y*y*i", &flat, &words, &width))
        return NULL;
    Py_ssize_t n = flat.len / 8;
    if (!check_width(width) || flat.len % 8 || words.len != n * width) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "indices and words do not match");
        PyBuffer_Release(&flat);
        PyBuffer_Release(&words);
        return NULL;
    }
    uint64_t s = 0;
    Py_BEGIN_ALLOW_THREADS
    switch (width) {
    case 1: s = sum_at_uint8_t(flat.buf, n, words.buf); break;
    case 2: s = sum_at_uint16_t(flat.buf, n, words.buf); break;
    case 4: s = sum_at_uint32_t(flat.buf, n, words.buf); break;
    default: s = sum_at_uint64_t(flat.buf, n, words.buf); break;
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&flat);
    PyBuffer_Release(&words);
    return PyLong_FromUnsignedLongLong(s);
}

/* sum_pair(positions, offset, base, new, width) -> (base sum, new sum); positions int64. */
static PyObject *py_sum_pair(PyObject *self, PyObject *args) {
    Py_buffer pos, b, w;
    unsigned long long offset;
    int width;
    if (!PyArg_ParseTuple(args, "y*Ky*y*i", &pos, &offset, &b, &w, &width))
        return NULL;
    Py_ssize_t n = pos.len / 8;
    PyObject *result = NULL;
    if (!check_width(width) || pos.len % 8 || b.len != n * width || w.len != n * width) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "positions and words do not match");
    } else {
        uint64_t sb = 0, sw = 0;
        Py_BEGIN_ALLOW_THREADS
        switch (width) {
        case 1: sum_pair_uint8_t(pos.buf, n, offset, b.buf, w.buf, &sb, &sw); break;
        case 2: sum_pair_uint16_t(pos.buf, n, offset, b.buf, w.buf, &sb, &sw); break;
        case 4: sum_pair_uint32_t(pos.buf, n, offset, b.buf, w.buf, &sb, &sw); break;
        default: sum_pair_uint64_t(pos.buf, n, offset, b.buf, w.buf, &sb, &sw); break;
        }
        Py_END_ALLOW_THREADS
        result = Py_BuildValue("KK", (unsigned long long)sb, (unsigned long long)sw);
    }
    PyBuffer_Release(&pos);
    PyBuffer_Release(&b);
    PyBuffer_Release(&w);
    return result;
}

/* A receiver's record in one call: the words at its positions (gathered), its targets (each
 * word stepped by its distance in the ulp key order, spec/FORMAT.md section 11, or xor its
 * value) and both digest parts, e(pos[i], current[i]) and e(pos[i], target[i]) summed. Where
 * the gather, the step and two sum_at calls each walk the record's arrays (and Python sits
 * between them), this takes a block of CLASSIFY_BLOCK changes at a time: gathered and stepped
 * with the line PREFETCH positions ahead requested early (as _changes.c's gather, _prefetch.h:
 * a receiver's changes are too far apart for the hardware prefetcher), then hashed by
 * sum_pair's vector loop while the block is in L1. */
#define CLASSIFY_BLOCK 256

#define GATHER_STEP(T)                                                               \
    static void gather_step_##T(const T *w, const int64_t *pos, Py_ssize_t lo,        \
                                Py_ssize_t hi, Py_ssize_t k, int dense, const T *d,   \
                                int relative, T *cur, T *tgt) {                      \
        const T top = (T)((T)1 << (8 * sizeof(T) - 1));                              \
        for (Py_ssize_t i = lo; i < hi; i++) {                                       \
            if (i + PREFETCH < k)                                                    \
                PREFETCH_LINE(w + pos[i + PREFETCH], dense);                         \
            T x = w[pos[i]], y;                                                      \
            if (relative) {                                                          \
                T key = (T)((x & top) ? (T)~x : (T)(x ^ top));                       \
                key = (T)(key + d[i]);                                               \
                y = (T)((key & top) ? (T)(key ^ top) : (T)~key);                     \
            } else {                                                                 \
                y = (T)(x ^ d[i]);                                                   \
            }                                                                        \
            cur[i] = x;                                                              \
            tgt[i] = y;                                                              \
        }                                                                            \
    }                                                                                \
    static void classify_##T(const T *w, const int64_t *pos, Py_ssize_t k, const T *d, \
                             int relative, T *cur, T *tgt, uint64_t *sc, uint64_t *st) { \
        const int dense = prefetch_dense(pos, k, sizeof(T));                         \
        uint64_t a = 0, b = 0;                                                       \
        for (Py_ssize_t lo = 0; lo < k; lo += CLASSIFY_BLOCK) {                      \
            Py_ssize_t hi = lo + CLASSIFY_BLOCK < k ? lo + CLASSIFY_BLOCK : k;         \
            uint64_t x, y;                                                           \
            gather_step_##T(w, pos, lo, hi, k, dense, d, relative, cur, tgt);        \
            sum_pair_##T(pos + lo, hi - lo, 0, (const unsigned char *)(cur + lo),    \
                         (const unsigned char *)(tgt + lo), &x, &y);                 \
            a += x;                                                                  \
            b += y;                                                                  \
        }                                                                            \
        *sc = a;                                                                     \
        *st = b;                                                                     \
    }

GATHER_STEP(uint8_t)
GATHER_STEP(uint16_t)
GATHER_STEP(uint32_t)
GATHER_STEP(uint64_t)

VECTOR_CLONES static int indices_below(const int64_t *pos, Py_ssize_t k, Py_ssize_t n) {
    uint64_t bad = 0;
    for (Py_ssize_t i = 0; i < k; i++)
        bad |= (uint64_t)pos[i] >= (uint64_t)n;
    return !bad;
}

/* classify(words, positions, values, width, relative, current_out, target_out)
 *   -> (current sum, target sum); positions int64, every buffer aligned to its width (numpy
 * arrays are), each position checked against the words before any is read. */
static PyObject *py_classify(PyObject *self, PyObject *args) {
    Py_buffer w, pos, d, cur, tgt;
    int width, relative;
    if (!PyArg_ParseTuple(args, "y*y*y*ipw*w*", &w, &pos, &d, &width, &relative, &cur, &tgt))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t k = pos.len / 8;
    if (!check_width(width)) {
        /* (its error is set) */
    } else if (w.len % width || pos.len % 8 || d.len != k * width || cur.len != k * width
               || tgt.len != k * width
               || ((uintptr_t)w.buf | (uintptr_t)d.buf | (uintptr_t)cur.buf | (uintptr_t)tgt.buf) % width
               || (uintptr_t)pos.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "words, positions, values and outputs do not match");
    } else {
        Py_ssize_t n = w.len / width;
        uint64_t sc = 0, st = 0;
        int inside;
        Py_BEGIN_ALLOW_THREADS
        inside = indices_below(pos.buf, k, n);
        if (inside) {
            switch (width) {
            case 1: classify_uint8_t(w.buf, pos.buf, k, d.buf, relative, cur.buf, tgt.buf, &sc, &st); break;
            case 2: classify_uint16_t(w.buf, pos.buf, k, d.buf, relative, cur.buf, tgt.buf, &sc, &st); break;
            case 4: classify_uint32_t(w.buf, pos.buf, k, d.buf, relative, cur.buf, tgt.buf, &sc, &st); break;
            default: classify_uint64_t(w.buf, pos.buf, k, d.buf, relative, cur.buf, tgt.buf, &sc, &st); break;
            }
        }
        Py_END_ALLOW_THREADS
        if (inside)
            result = Py_BuildValue("KK", (unsigned long long)sc, (unsigned long long)st);
        else
            PyErr_SetString(PyExc_IndexError, "a position lies outside the words");
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&d);
    PyBuffer_Release(&cur);
    PyBuffer_Release(&tgt);
    return result;
}

static PyMethodDef methods[] = {
    {"sum_range", py_sum_range, METH_VARARGS, "sum of e(start + j, words[j])"},
    {"sum_runs", py_sum_runs, METH_VARARGS, "sum of e over runs of contiguous flat indices"},
    {"sum_at", py_sum_at, METH_VARARGS, "sum of e(flat[i], words[i])"},
    {"sum_pair", py_sum_pair, METH_VARARGS, "sums of e(positions[i] + offset, .) over base and new words"},
    {"classify", py_classify, METH_VARARGS, "a record's gathered words, targets and both sums in one pass"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_digest", NULL, -1, methods};

PyMODINIT_FUNC PyInit__digest(void) {
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* the loops sum_range may be asked for on this CPU (its last argument) */
    PyObject *paths = run_path(1) ? Py_BuildValue("(ii)", 0, 1) : Py_BuildValue("(i)", 0);
    if (paths == NULL || PyModule_AddObject(m, "RUN_PATHS", paths) < 0) {
        Py_XDECREF(paths);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
