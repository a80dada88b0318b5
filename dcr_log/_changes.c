/* Change detection in one pass: the positions where two word buffers differ, with the base
 * and new words there. numpy needs a compare pass, a nonzero pass and gathers (two to three
 * passes over the box); this reads each buffer once, 32 bytes at a time, and skips equal
 * blocks. The GIL is released, so the boxes of a tensor are compared in parallel.
 * dcr_log/delta.py holds the numpy reference (and the fallback when this is not built). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#include "_prefetch.h"

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "words are read as little-endian integers"
#endif

/* The top bit of each lane of a 64-bit group, set where the lane is not zero (SWAR: the low
 * bits plus all-ones-but-top carry into the top bit unless they are zero). */
#define NONZERO_LANES(d, LOW) (((((d) & (LOW)) + (LOW)) | (d)) & ~(LOW))

/* Those top bits gathered into the low 64 / BITS bits, lane 0 lowest (multiplies that move
 * each top bit to its own place; no carries, every partial product lands on a distinct bit). */
static inline uint64_t lane_bits_8(uint64_t t) { return ((t >> 7) * 0x0102040810204080ULL) >> 56; }
static inline uint64_t lane_bits_16(uint64_t t) {
    return (((t >> 15) * ((1ULL << 48) | (1ULL << 33) | (1ULL << 18) | (1ULL << 3))) >> 48) & 0xF;
}
static inline uint64_t lane_bits_32(uint64_t t) { return ((t >> 31) & 1) | ((t >> 62) & 2); }
static inline uint64_t lane_bits_64(uint64_t t) { return t >> 63; }

/* Blocks of four 8-byte groups: equal blocks cost one compare; in the others a mask of the
 * differing lanes is built without branches and its set bits are emitted in order. Branches
 * per change, not per lane, is what makes this faster than numpy's passes. */
#define FIND(T, BITS, LOW)                                                           \
    static Py_ssize_t find_##T(const unsigned char *a, const unsigned char *b,       \
                               Py_ssize_t n, int64_t *pos, unsigned char *bout,      \
                               unsigned char *nout) {                                \
        enum { LANES = 64 / (BITS) };                                                \
        Py_ssize_t k = 0, groups = n / LANES, g = 0;                                 \
        T *bw = (T *)bout, *nw = (T *)nout;                                          \
        for (; g + 4 <= groups; g += 4) {                                            \
            uint64_t a4[4], b4[4];                                                   \
            memcpy(a4, a + 8 * g, 32);                                               \
            memcpy(b4, b + 8 * g, 32);                                               \
            uint64_t d0 = a4[0] ^ b4[0], d1 = a4[1] ^ b4[1];                         \
            uint64_t d2 = a4[2] ^ b4[2], d3 = a4[3] ^ b4[3];                         \
            if ((d0 | d1 | d2 | d3) == 0)                                            \
                continue;                                                            \
            uint64_t mask = lane_bits_##BITS(NONZERO_LANES(d0, LOW))                 \
                | lane_bits_##BITS(NONZERO_LANES(d1, LOW)) << LANES                  \
                | lane_bits_##BITS(NONZERO_LANES(d2, LOW)) << (2 * LANES)            \
                | lane_bits_##BITS(NONZERO_LANES(d3, LOW)) << (3 * LANES);           \
            const T *ab = (const T *)a4, *bb = (const T *)b4;                        \
            int64_t first = (int64_t)g * LANES;                                      \
            while (mask) {                                                           \
                int lane = __builtin_ctzll(mask);                                    \
                mask &= mask - 1;                                                    \
                pos[k] = first + lane;                                               \
                bw[k] = ab[lane];                                                    \
                nw[k] = bb[lane];                                                    \
                k++;                                                                 \
            }                                                                        \
        }                                                                            \
        for (Py_ssize_t i = g * LANES; i < n; i++) {                                 \
            T va, vb;                                                                \
            memcpy(&va, a + sizeof(T) * i, sizeof(T));                               \
            memcpy(&vb, b + sizeof(T) * i, sizeof(T));                               \
            if (va != vb) {                                                          \
                pos[k] = i;                                                          \
                bw[k] = va;                                                          \
                nw[k] = vb;                                                          \
                k++;                                                                 \
            }                                                                        \
        }                                                                            \
        return k;                                                                    \
    }

FIND(uint8_t, 8, 0x7F7F7F7F7F7F7F7FULL)
FIND(uint16_t, 16, 0x7FFF7FFF7FFF7FFFULL)
FIND(uint32_t, 32, 0x7FFFFFFF7FFFFFFFULL)
FIND(uint64_t, 64, 0x7FFFFFFFFFFFFFFFULL)

/* With AVX-512 (x86-64 with BW and VBMI2, GCC or clang): 64 bytes compared per step, the
 * differing words packed with vpcompress into registers and stored whole (the outputs hold
 * FIND_SLACK entries past n for that), their positions likewise from a vector of lane
 * indices. No branch per change: at 10% of bf16 words changed the scalar loop above
 * mispredicts its exit once per block; here a block with changes costs the same whatever
 * their number. Picked at run time (__builtin_cpu_supports), 2- and 4-byte words only. */
#define FIND_SLACK 64

#if defined(__x86_64__) && defined(__GNUC__) \
    && ((defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && __GNUC__ >= 11))
#include <immintrin.h>
#define HAVE_FIND_AVX512 1
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512vbmi2,popcnt")))

/* Positions first + the compressed lane indices (16-bit lanes of idx), c of them: widened to
 * int64 eight at a time. */
AVX512_TARGET static inline void put_positions16(int64_t *pos, __m512i idx, int c, int64_t first) {
    __m512i base = _mm512_set1_epi64(first);
    /* the first eight always (no branch for the common block of 0-8 changes) */
    _mm512_storeu_si512((void *)pos, _mm512_add_epi64(_mm512_cvtepu16_epi64(_mm512_castsi512_si128(idx)), base));
    for (int j = 8; j < c; j += 8) {
        idx = _mm512_alignr_epi32(idx, idx, 4); /* the next 8 16-bit lanes down */
        _mm512_storeu_si512((void *)(pos + j),
                            _mm512_add_epi64(_mm512_cvtepu16_epi64(_mm512_castsi512_si128(idx)), base));
    }
}

/* The words i..n-1 after the vector steps: the scalar pass, its positions moved up by i. */
static inline Py_ssize_t find_tail(Py_ssize_t (*scalar)(const unsigned char *, const unsigned char *, Py_ssize_t,
                                                        int64_t *, unsigned char *, unsigned char *),
                                   const unsigned char *a, const unsigned char *b, Py_ssize_t i, Py_ssize_t n,
                                   int width, int64_t *pos, unsigned char *bout, unsigned char *nout,
                                   Py_ssize_t k) {
    Py_ssize_t t = scalar(a + width * i, b + width * i, n - i, pos + k, bout + width * k, nout + width * k);
    for (Py_ssize_t j = k; j < k + t; j++)
        pos[j] += i;
    return t;
}

AVX512_TARGET static Py_ssize_t find_uint16_t_avx512(const unsigned char *a, const unsigned char *b,
                                                     Py_ssize_t n, int64_t *pos, unsigned char *bout,
                                                     unsigned char *nout) {
    Py_ssize_t k = 0, i = 0;
    uint16_t *bw = (uint16_t *)bout, *nw = (uint16_t *)nout;
    const __m512i lanes = _mm512_set_epi16(31, 30, 29, 28, 27, 26, 25, 24, 23, 22, 21, 20, 19, 18, 17, 16,
                                           15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (; i + 32 <= n; i += 32) {
        __m512i va = _mm512_loadu_si512((const void *)(a + 2 * i));
        __m512i vb = _mm512_loadu_si512((const void *)(b + 2 * i));
        __mmask32 m = _mm512_cmpneq_epi16_mask(va, vb);
        if (!m)
            continue;
        int c = __builtin_popcount(m);
        _mm512_storeu_si512((void *)(bw + k), _mm512_maskz_compress_epi16(m, va));
        _mm512_storeu_si512((void *)(nw + k), _mm512_maskz_compress_epi16(m, vb));
        put_positions16(pos + k, _mm512_maskz_compress_epi16(m, lanes), c, (int64_t)i);
        k += c;
    }
    return k + find_tail(find_uint16_t, a, b, i, n, 2, pos, bout, nout, k);
}

AVX512_TARGET static Py_ssize_t find_uint32_t_avx512(const unsigned char *a, const unsigned char *b,
                                                     Py_ssize_t n, int64_t *pos, unsigned char *bout,
                                                     unsigned char *nout) {
    Py_ssize_t k = 0, i = 0;
    uint32_t *bw = (uint32_t *)bout, *nw = (uint32_t *)nout;
    const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
    for (; i + 16 <= n; i += 16) {
        __m512i va = _mm512_loadu_si512((const void *)(a + 4 * i));
        __m512i vb = _mm512_loadu_si512((const void *)(b + 4 * i));
        __mmask16 m = _mm512_cmpneq_epi32_mask(va, vb);
        if (!m)
            continue;
        int c = __builtin_popcount(m);
        _mm512_storeu_si512((void *)(bw + k), _mm512_maskz_compress_epi32(m, va));
        _mm512_storeu_si512((void *)(nw + k), _mm512_maskz_compress_epi32(m, vb));
        __m512i idx = _mm512_maskz_compress_epi32(m, lanes);
        __m512i first = _mm512_set1_epi64((int64_t)i);
        _mm512_storeu_si512((void *)(pos + k),
                            _mm512_add_epi64(_mm512_cvtepu32_epi64(_mm512_castsi512_si256(idx)), first));
        if (c > 8)
            _mm512_storeu_si512((void *)(pos + k + 8),
                                _mm512_add_epi64(_mm512_cvtepu32_epi64(_mm512_extracti64x4_epi64(idx, 1)), first));
        k += c;
    }
    return k + find_tail(find_uint32_t, a, b, i, n, 4, pos, bout, nout, k);
}

static int have_avx512(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512vbmi2");
    }
    return known;
}

/* With AVX2 only (AMD before Zen 4, Intel client cores): 16 words compared per step, the
 * differing ones packed with byte shuffles from a table indexed by each 8-lane mask (AVX2
 * has no vpcompress), their positions likewise from a table of lane indices. The same
 * branch-free stores and FIND_SLACK as the AVX-512 path; the scalar loop's exit per change
 * mispredicts at high rates (an append of 512 MiB at 10% changed took 0.59-0.61 s of CPU
 * with this path against 0.73-0.77 s with the scalar loop on an AVX2-only EPYC:
 * tools/bench_encode.py --mib 512 --rates 0.01 0.10 --repeats 5 --no-create, the default
 * against --find-path 0, two alternating pairs). */
#define AVX2_TARGET __attribute__((target("avx2,popcnt")))

static unsigned char pack16_shuffle[256][16]; /* bytes of the 16-bit lanes set in the mask */
static unsigned char pack_lanes[256][8];      /* the lanes set in the mask, lowest first */

static void init_pack_tables(void) {
    for (int m = 0; m < 256; m++) {
        int c = 0;
        for (int lane = 0; lane < 8; lane++) {
            if (!(m >> lane & 1))
                continue;
            pack16_shuffle[m][2 * c] = (unsigned char)(2 * lane);
            pack16_shuffle[m][2 * c + 1] = (unsigned char)(2 * lane + 1);
            pack_lanes[m][c++] = (unsigned char)lane;
        }
        for (; c < 8; c++) {
            pack16_shuffle[m][2 * c] = pack16_shuffle[m][2 * c + 1] = 0x80; /* zero */
            pack_lanes[m][c] = 0;
        }
    }
}

/* Eight positions first + the lanes of mask m (entries past its count are junk). */
AVX2_TARGET static inline void put_positions8(int64_t *pos, unsigned m, __m256i first) {
    __m128i lanes = _mm_loadl_epi64((const __m128i *)(const void *)pack_lanes[m]);
    _mm256_storeu_si256((__m256i *)(void *)pos, _mm256_add_epi64(_mm256_cvtepu8_epi64(lanes), first));
    _mm256_storeu_si256((__m256i *)(void *)(pos + 4),
                        _mm256_add_epi64(_mm256_cvtepu8_epi64(_mm_srli_si128(lanes, 4)), first));
}

/* Eight 16-bit lanes: those set in m stored packed at bw + k, nw + k, with their positions. */
AVX2_TARGET static inline Py_ssize_t put_lanes16(__m128i va, __m128i vb, unsigned m, int64_t first,
                                                 int64_t *pos, uint16_t *bw, uint16_t *nw, Py_ssize_t k) {
    __m128i shuffle = _mm_loadu_si128((const __m128i *)(const void *)pack16_shuffle[m]);
    _mm_storeu_si128((__m128i *)(void *)(bw + k), _mm_shuffle_epi8(va, shuffle));
    _mm_storeu_si128((__m128i *)(void *)(nw + k), _mm_shuffle_epi8(vb, shuffle));
    put_positions8(pos + k, m, _mm256_set1_epi64x(first));
    return k + __builtin_popcount(m);
}

AVX2_TARGET static Py_ssize_t find_uint16_t_avx2(const unsigned char *a, const unsigned char *b, Py_ssize_t n,
                                                 int64_t *pos, unsigned char *bout, unsigned char *nout) {
    Py_ssize_t k = 0, i = 0;
    uint16_t *bw = (uint16_t *)bout, *nw = (uint16_t *)nout;
    for (; i + 16 <= n; i += 16) {
        __m256i va = _mm256_loadu_si256((const __m256i *)(const void *)(a + 2 * i));
        __m256i vb = _mm256_loadu_si256((const __m256i *)(const void *)(b + 2 * i));
        __m256i eq = _mm256_cmpeq_epi16(va, vb);
        if ((unsigned)_mm256_movemask_epi8(eq) == 0xFFFFFFFFu)
            continue;
        /* one bit per lane: the compare's lanes saturated to bytes */
        unsigned m = ~(unsigned)_mm_movemask_epi8(_mm_packs_epi16(_mm256_castsi256_si128(eq),
                                                                  _mm256_extracti128_si256(eq, 1))) & 0xFFFF;
        k = put_lanes16(_mm256_castsi256_si128(va), _mm256_castsi256_si128(vb), m & 0xFF, (int64_t)i, pos, bw,
                        nw, k);
        k = put_lanes16(_mm256_extracti128_si256(va, 1), _mm256_extracti128_si256(vb, 1), m >> 8,
                        (int64_t)i + 8, pos, bw, nw, k);
    }
    return k + find_tail(find_uint16_t, a, b, i, n, 2, pos, bout, nout, k);
}

AVX2_TARGET static Py_ssize_t find_uint32_t_avx2(const unsigned char *a, const unsigned char *b, Py_ssize_t n,
                                                 int64_t *pos, unsigned char *bout, unsigned char *nout) {
    Py_ssize_t k = 0, i = 0;
    uint32_t *bw = (uint32_t *)bout, *nw = (uint32_t *)nout;
    for (; i + 8 <= n; i += 8) {
        __m256i va = _mm256_loadu_si256((const __m256i *)(const void *)(a + 4 * i));
        __m256i vb = _mm256_loadu_si256((const __m256i *)(const void *)(b + 4 * i));
        unsigned m = ~(unsigned)_mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpeq_epi32(va, vb))) & 0xFF;
        if (!m)
            continue;
        __m256i lanes = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i *)(const void *)pack_lanes[m]));
        _mm256_storeu_si256((__m256i *)(void *)(bw + k), _mm256_permutevar8x32_epi32(va, lanes));
        _mm256_storeu_si256((__m256i *)(void *)(nw + k), _mm256_permutevar8x32_epi32(vb, lanes));
        put_positions8(pos + k, m, _mm256_set1_epi64x((int64_t)i));
        k += __builtin_popcount(m);
    }
    return k + find_tail(find_uint32_t, a, b, i, n, 4, pos, bout, nout, k);
}

static int have_avx2(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("popcnt");
    }
    return known;
}
#endif

/* The vector paths find may take: 0 scalar, 1 AVX2, 2 AVX-512. */
enum { FIND_SCALAR = 0, FIND_AVX2 = 1, FIND_AVX512 = 2 };

static int best_find_path(void) {
#ifdef HAVE_FIND_AVX512
    if (have_avx512())
        return FIND_AVX512;
    if (have_avx2())
        return FIND_AVX2;
#endif
    return FIND_SCALAR;
}

/* find(base, new, width, positions, base_out, new_out[, path]) -> k. base and new hold n
 * words of `width` bytes; positions (int64), base_out and new_out (words) hold at least n
 * entries (n + FIND_SLACK for the vector paths, which are skipped when they hold fewer).
 * `path` (FIND_PATHS) caps the vector path taken, so that tests run each one the CPU has. */
static PyObject *py_find(PyObject *self, PyObject *args) {
    Py_buffer a, b, pos, bout, nout;
    int width, path = FIND_AVX512;
    if (!PyArg_ParseTuple(args, "y*y*iw*w*w*|i", &a, &b, &width, &pos, &bout, &nout, &path))
        return NULL;
    Py_ssize_t n = width > 0 ? a.len / width : 0;
    PyObject *result = NULL;
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "word width must be 1, 2, 4 or 8");
    } else if (path < FIND_SCALAR) {
        PyErr_SetString(PyExc_ValueError, "path must be >= 0");
    } else if (a.len != b.len || a.len % width) {
        PyErr_SetString(PyExc_ValueError, "base and new must be the same whole number of words");
    } else if (pos.len < 8 * n || bout.len < width * n || nout.len < width * n) {
        PyErr_SetString(PyExc_ValueError, "output buffers must hold n entries");
    } else {
        Py_ssize_t k = 0;
        int vector = FIND_SCALAR;
        if ((width == 2 || width == 4) && pos.len >= 8 * (n + FIND_SLACK)
            && bout.len >= width * (n + FIND_SLACK) && nout.len >= width * (n + FIND_SLACK)) {
            vector = best_find_path();
            vector = vector < path ? vector : path;
        }
        Py_BEGIN_ALLOW_THREADS
        if (vector != FIND_SCALAR) {
#ifdef HAVE_FIND_AVX512
            if (vector == FIND_AVX512)
                k = width == 2 ? find_uint16_t_avx512(a.buf, b.buf, n, pos.buf, bout.buf, nout.buf)
                               : find_uint32_t_avx512(a.buf, b.buf, n, pos.buf, bout.buf, nout.buf);
            else
                k = width == 2 ? find_uint16_t_avx2(a.buf, b.buf, n, pos.buf, bout.buf, nout.buf)
                               : find_uint32_t_avx2(a.buf, b.buf, n, pos.buf, bout.buf, nout.buf);
#endif
        } else {
            switch (width) {
            case 1: k = find_uint8_t(a.buf, b.buf, n, pos.buf, bout.buf, nout.buf); break;
            case 2: k = find_uint16_t(a.buf, b.buf, n, pos.buf, bout.buf, nout.buf); break;
            case 4: k = find_uint32_t(a.buf, b.buf, n, pos.buf, bout.buf, nout.buf); break;
            default: k = find_uint64_t(a.buf, b.buf, n, pos.buf, bout.buf, nout.buf); break;
            }
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromSsize_t(k);
    }
    PyBuffer_Release(&a);
    PyBuffer_Release(&b);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&bout);
    PyBuffer_Release(&nout);
    return result;
}

/* The ulp encoding's step (spec/FORMAT.md section 11): key(x) flips every bit of a word with
 * the top bit set and only the top bit otherwise; out = key^-1(key(base) +- distance) mod 2^W.
 * One pass where numpy needs eight. */
#define STEP(T, BITS)                                                                \
    static void step_##T(const unsigned char *b, const unsigned char *d, Py_ssize_t n, \
                         int backwards, unsigned char *o) {                          \
        const T top = (T)1 << ((BITS) - 1);                                          \
        for (Py_ssize_t i = 0; i < n; i++) {                                         \
            T x, dx;                                                                 \
            memcpy(&x, b + sizeof(T) * i, sizeof(T));                               \
            memcpy(&dx, d + sizeof(T) * i, sizeof(T));                              \
            T key = (x & top) ? (T)~x : (T)(x ^ top);                                \
            key = backwards ? (T)(key - dx) : (T)(key + dx);                         \
            T y = (key & top) ? (T)(key ^ top) : (T)~key;                            \
            memcpy(o + sizeof(T) * i, &y, sizeof(T));                                \
        }                                                                            \
    }

STEP(uint8_t, 8)
STEP(uint16_t, 16)
STEP(uint32_t, 32)
STEP(uint64_t, 64)

/* step(base, distance, width, backwards, out): out[i] = key^-1(key(base[i]) +- distance[i]). */
static PyObject *py_step(PyObject *self, PyObject *args) {
    Py_buffer b, d, o;
    int width, backwards;
    if (!PyArg_ParseTuple(args, "y*y*ipw*", &b, &d, &width, &backwards, &o))
        return NULL;
    PyObject *result = NULL;
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "word width must be 1, 2, 4 or 8");
    } else if (b.len != d.len || b.len != o.len || b.len % width) {
        PyErr_SetString(PyExc_ValueError, "base, distance and out must be the same whole number of words");
    } else {
        Py_ssize_t n = b.len / width;
        Py_BEGIN_ALLOW_THREADS
        switch (width) {
        case 1: step_uint8_t(b.buf, d.buf, n, backwards, o.buf); break;
        case 2: step_uint16_t(b.buf, d.buf, n, backwards, o.buf); break;
        case 4: step_uint32_t(b.buf, d.buf, n, backwards, o.buf); break;
        default: step_uint64_t(b.buf, d.buf, n, backwards, o.buf); break;
        }
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&b);
    PyBuffer_Release(&d);
    PyBuffer_Release(&o);
    return result;
}

/* Gathers and scatters at sorted (or any) flat indices, with the line PREFETCH indices
 * ahead requested early: a receiver's changes are one or two per cache line, too far apart
 * for the hardware prefetcher, and numpy's loop waits for each line in turn (on 1% of a
 * 512 MiB array numpy's gather takes 2.3x as long; its scatter about as long as this one,
 * tools/bench_codec.py --gather-mib 512; these figures are an AMD EPYC host's). 64 ahead, not
 * 32: tools/bench_codec.py --rates 0.01 --levels 2 --gather-mib 512 --repeats 7 gathered 1% in
 * 7.6 ms against 8.7. (A one-off build of each distance, timed on 0.3%, 1% and 3% of 512 MiB
 * not in cache: 2.5, 2.8 and 2.1 ns per change at 64 against 3.2, 3.2 and 2.3 at 32; scatters
 * the same either way; 96 and 128 no better.) Every index is checked against the buffer first.
 * The distance, and where a line goes by the changes' density: _prefetch.h. */
#define MOVE(T)                                                                      \
    static void gather_##T(const T *w, const int64_t *pos, Py_ssize_t k, T *out) {   \
        const int dense = prefetch_dense(pos, k, sizeof(T));                         \
        for (Py_ssize_t i = 0; i < k; i++) {                                         \
            if (i + PREFETCH < k)                                                    \
                PREFETCH_LINE(w + pos[i + PREFETCH], dense);                         \
            out[i] = w[pos[i]];                                                      \
        }                                                                            \
    }                                                                                \
    static void scatter_##T(T *w, const int64_t *pos, Py_ssize_t k, const T *v) {    \
        const int dense = prefetch_dense(pos, k, sizeof(T));                         \
        for (Py_ssize_t i = 0; i < k; i++) {                                         \
            if (i + PREFETCH < k)                                                    \
                PREFETCH_LINE(w + pos[i + PREFETCH], dense);                         \
            w[pos[i]] = v[i];                                                        \
        }                                                                            \
    }

MOVE(uint8_t)
MOVE(uint16_t)
MOVE(uint32_t)
MOVE(uint64_t)

/* Every index in [0, n): one unsigned compare each (a negative index wraps above n), the loop
 * also built for AVX2 and AVX-512 and picked at load time (ifunc, as in _digest.c): SSE2 has
 * no 64-bit compare, so the portable build checked one index at a time (tools/bench_codec.py
 * --rates 0.01 --levels 2 --gather-mib 512 --repeats 7: gather 7.3-7.4 ms against 7.9-8.3,
 * scatter 6.1-6.2 ms against 6.9-7.3). */
#if defined(__x86_64__) && defined(__GLIBC__) && defined(__GNUC__) && !defined(__clang__) \
    && __GNUC__ >= 11
#define CHECK_CLONES __attribute__((target_clones("arch=x86-64-v4", "avx2", "default")))
#else
#define CHECK_CLONES
#endif

CHECK_CLONES static int indices_inside(const int64_t *pos, Py_ssize_t k, Py_ssize_t n) {
    uint64_t bad = 0;
    for (Py_ssize_t i = 0; i < k; i++)
        bad |= (uint64_t)pos[i] >= (uint64_t)n;
    return !bad;
}

/* gather(words, positions, width, out): out[i] = words[positions[i]]; scatter(words,
 * positions, width, values): words[positions[i]] = values[i]. Buffers aligned to their word
 * width (numpy arrays are), positions int64. */
static PyObject *move(PyObject *args, int scatter) {
    Py_buffer w, pos, v;
    int width;
    if (!PyArg_ParseTuple(args, scatter ? "w*y*iy*" : "y*y*iw*", &w, &pos, &width, &v))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t n = width > 0 ? w.len / width : 0, k = pos.len / 8;
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "word width must be 1, 2, 4 or 8");
    } else if (w.len % width || pos.len % 8 || v.len != k * width
               || ((uintptr_t)w.buf | (uintptr_t)v.buf) % width || (uintptr_t)pos.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "words, positions and values do not match");
    } else {
        int inside;
        Py_BEGIN_ALLOW_THREADS
        inside = indices_inside(pos.buf, k, n);
        if (inside) {
            switch (width * (scatter ? -1 : 1)) {
            case 1: gather_uint8_t(w.buf, pos.buf, k, v.buf); break;
            case 2: gather_uint16_t(w.buf, pos.buf, k, v.buf); break;
            case 4: gather_uint32_t(w.buf, pos.buf, k, v.buf); break;
            case 8: gather_uint64_t(w.buf, pos.buf, k, v.buf); break;
            case -1: scatter_uint8_t(w.buf, pos.buf, k, v.buf); break;
            case -2: scatter_uint16_t(w.buf, pos.buf, k, v.buf); break;
            case -4: scatter_uint32_t(w.buf, pos.buf, k, v.buf); break;
            default: scatter_uint64_t(w.buf, pos.buf, k, v.buf); break;
            }
        }
        Py_END_ALLOW_THREADS
        if (!inside) {
            PyErr_SetString(PyExc_IndexError, "a position lies outside the words");
        } else {
            Py_INCREF(Py_None);
            result = Py_None;
        }
    }
    PyBuffer_Release(&w);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&v);
    return result;
}

static PyObject *py_gather(PyObject *self, PyObject *args) { return move(args, 0); }
static PyObject *py_scatter(PyObject *self, PyObject *args) { return move(args, 1); }

/* The ulp encoding's two sequences in one pass over a record's changes (spec/FORMAT.md
 * section 11): gaps[0] = positions[0], gaps[i] = positions[i] - positions[i-1] - 1 (as
 * uint32; the largest gap is returned, so a caller seeing one of 2^32 or more redoes them
 * wider), and distances key(new) - key(base) mod 2^W as signed integers (int16 for 1- and
 * 2-byte words, else the word's width). numpy needs nine passes and four temporaries. */
#define ULP_PREPARE(T, S, D, BITS)                                                   \
    static uint64_t ulp_prepare_##T(const int64_t *pos, const unsigned char *b,       \
                                    const unsigned char *w, Py_ssize_t k,            \
                                    uint32_t *gaps, D *dist) {                       \
        const T top = (T)1 << ((BITS) - 1);                                          \
        uint64_t most = 0;                                                           \
        int64_t prev = -1;                                                           \
        for (Py_ssize_t i = 0; i < k; i++) {                                         \
            uint64_t gap = (uint64_t)(pos[i] - prev - 1);                            \
            prev = pos[i];                                                           \
            most = gap > most ? gap : most;                                          \
            gaps[i] = (uint32_t)gap;                                                 \
            T x, y;                                                                  \
            memcpy(&x, b + sizeof(T) * i, sizeof(T));                               \
            memcpy(&y, w + sizeof(T) * i, sizeof(T));                               \
            T kx = (x & top) ? (T)~x : (T)(x ^ top);                                 \
            T ky = (y & top) ? (T)~y : (T)(y ^ top);                                 \
            dist[i] = (D)(S)(T)(ky - kx);                                            \
        }                                                                            \
        return most;                                                                 \
    }

ULP_PREPARE(uint8_t, int8_t, int16_t, 8)
ULP_PREPARE(uint16_t, int16_t, int16_t, 16)
ULP_PREPARE(uint32_t, int32_t, int32_t, 32)
ULP_PREPARE(uint64_t, int64_t, int64_t, 64)

/* ulp_prepare(positions, base, new, width, gaps_out, distances_out) -> largest gap. */
static PyObject *py_ulp_prepare(PyObject *self, PyObject *args) {
    Py_buffer pos, b, w, g, d;
    int width;
    if (!PyArg_ParseTuple(args, "y*y*y*iw*w*", &pos, &b, &w, &width, &g, &d))
        return NULL;
    Py_ssize_t k = pos.len / 8;
    int dwidth = width < 2 ? 2 : width;
    PyObject *result = NULL;
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "word width must be 1, 2, 4 or 8");
    } else if (pos.len % 8 || b.len != k * width || w.len != k * width || g.len < 4 * k
               || d.len < dwidth * k) {
        PyErr_SetString(PyExc_ValueError, "positions, words and outputs do not match");
    } else {
        uint64_t most = 0;
        Py_BEGIN_ALLOW_THREADS
        switch (width) {
        case 1: most = ulp_prepare_uint8_t(pos.buf, b.buf, w.buf, k, g.buf, d.buf); break;
        case 2: most = ulp_prepare_uint16_t(pos.buf, b.buf, w.buf, k, g.buf, d.buf); break;
        case 4: most = ulp_prepare_uint32_t(pos.buf, b.buf, w.buf, k, g.buf, d.buf); break;
        default: most = ulp_prepare_uint64_t(pos.buf, b.buf, w.buf, k, g.buf, d.buf); break;
        }
        Py_END_ALLOW_THREADS
        result = PyLong_FromUnsignedLongLong(most);
    }
    PyBuffer_Release(&pos);
    PyBuffer_Release(&b);
    PyBuffer_Release(&w);
    PyBuffer_Release(&g);
    PyBuffer_Release(&d);
    return result;
}

/* Byte planes (the dense and sparse encodings' layout): byte j of word i goes to
 * out[j * n + i]. One pass with the GIL released, where numpy needs a shift and a
 * truncating copy per plane. */
#define PLANES(T)                                                                    \
    static void planes_##T(const unsigned char *src, Py_ssize_t n, unsigned char *out) { \
        for (Py_ssize_t i = 0; i < n; i++) {                                         \
            T v;                                                                     \
            memcpy(&v, src + sizeof(T) * i, sizeof(T));                             \
            for (size_t j = 0; j < sizeof(T); j++)                                   \
                out[j * (size_t)n + i] = (unsigned char)(v >> (8 * j));              \
        }                                                                            \
    }

PLANES(uint16_t)
PLANES(uint32_t)
PLANES(uint64_t)

/* The inverse: word i from byte i of each plane, in one pass (numpy widens the first plane,
 * then shifts and ors each further one over the whole output). */
#define UNPLANES(T)                                                                  \
    CHECK_CLONES static void unplanes_##T(const unsigned char *planes, Py_ssize_t n,   \
                                          unsigned char *out) {                      \
        for (Py_ssize_t i = 0; i < n; i++) {                                         \
            T v = 0;                                                                 \
            for (size_t j = 0; j < sizeof(T); j++)                                   \
                v |= (T)((T)planes[j * (size_t)n + i] << (8 * j));                   \
            memcpy(out + sizeof(T) * i, &v, sizeof(T));                             \
        }                                                                            \
    }

UNPLANES(uint16_t)
UNPLANES(uint32_t)
UNPLANES(uint64_t)

/* planes(words, width, out) and unplanes(planes, width, out): the n words of width bytes
 * to their n * width bytes of planes, or back; out is as long as the source. */
static PyObject *planes_call(PyObject *args, int inverse) {
    Py_buffer src, out;
    int width;
    if (!PyArg_ParseTuple(args, "y*iw*", &src, &width, &out))
        return NULL;
    PyObject *result = NULL;
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "word width must be 1, 2, 4 or 8");
    } else if (src.len % width || out.len != src.len) {
        PyErr_SetString(PyExc_ValueError, "out must be as long as the source");
    } else {
        Py_ssize_t n = src.len / width;
        Py_BEGIN_ALLOW_THREADS
        switch (width) {
        case 1: memcpy(out.buf, src.buf, (size_t)n); break;
        case 2: (inverse ? unplanes_uint16_t : planes_uint16_t)(src.buf, n, out.buf); break;
        case 4: (inverse ? unplanes_uint32_t : planes_uint32_t)(src.buf, n, out.buf); break;
        default: (inverse ? unplanes_uint64_t : planes_uint64_t)(src.buf, n, out.buf); break;
        }
        Py_END_ALLOW_THREADS
        Py_INCREF(Py_None);
        result = Py_None;
    }
    PyBuffer_Release(&src);
    PyBuffer_Release(&out);
    return result;
}

static PyObject *py_planes(PyObject *self, PyObject *args) { return planes_call(args, 0); }
static PyObject *py_unplanes(PyObject *self, PyObject *args) { return planes_call(args, 1); }

/* The sparse encoding's body (spec/FORMAT.md section 11) unpacked in one pass: k gaps of
 * gap_width bytes as byte planes, then k values of word_width bytes as byte planes;
 * positions[i] = sum(gap[0..i] + 1) - 1. Returns 0, or 1 when a gap is n or more, else 2
 * when a position reaches n (the order dcr_log.codec.base.positions_from_gaps checks them
 * in, whose numpy steps are a dozen calls for a record of a few changes). */
static uint64_t plane_word(const unsigned char *planes, Py_ssize_t k, int width, Py_ssize_t i) {
    uint64_t v = 0;
    for (int j = 0; j < width; j++)
        v |= (uint64_t)planes[(size_t)j * (size_t)k + (size_t)i] << (8 * j);
    return v;
}

static int sparse_unpack(const unsigned char *body, Py_ssize_t k, int gap_width, int word_width,
                         uint64_t n, int64_t *positions, unsigned char *values) {
    uint64_t p = 0, bad_gap = 0, bad_position = 0;
    for (Py_ssize_t i = 0; i < k; i++) {
        uint64_t gap = plane_word(body, k, gap_width, i);
        bad_gap |= gap >= n;
        p = i == 0 ? gap : p + gap + 1; /* (no wrap while every gap and p are below n <= 2^63) */
        bad_position |= p >= n;
        positions[i] = (int64_t)p;
    }
    const unsigned char *planes = body + (size_t)k * (size_t)gap_width;
    for (int j = 0; j < word_width; j++) /* byte j of each little-endian value */
        for (Py_ssize_t i = 0; i < k; i++)
            values[(size_t)i * (size_t)word_width + (size_t)j] = planes[(size_t)j * (size_t)k + (size_t)i];
    return bad_gap ? 1 : bad_position ? 2 : 0;
}

/* sparse_unpack(body, k, gap_width, word_width, n, positions, values) -> 0, 1 or 2 (above);
 * positions: k int64, values: k words of word_width bytes. */
static PyObject *py_sparse_unpack(PyObject *self, PyObject *args) {
    Py_buffer body, pos, val;
    Py_ssize_t k, n;
    int gw, ww;
    if (!PyArg_ParseTuple(args, "y*niinw*w*", &body, &k, &gw, &ww, &n, &pos, &val))
        return NULL;
    PyObject *result = NULL;
    if ((gw != 1 && gw != 2 && gw != 4 && gw != 8) || (ww != 1 && ww != 2 && ww != 4 && ww != 8)) {
        PyErr_SetString(PyExc_ValueError, "gap and word widths must be 1, 2, 4 or 8");
    } else if (k < 0 || n < 0 || body.len != k * (gw + ww) || pos.len != k * 8 || val.len != k * ww
               || (uintptr_t)pos.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "body, positions and values do not match");
    } else {
        int code;
        Py_BEGIN_ALLOW_THREADS
        code = sparse_unpack(body.buf, k, gw, ww, (uint64_t)n, pos.buf, val.buf);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLong(code);
    }
    PyBuffer_Release(&body);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&val);
    return result;
}

/* A deferred-sync image's positions and words (RECEIVER.md's image layout, kinds 1 and 2):
 * the first position (8 bytes), the gaps positions[i] - positions[i - 1] - 1 narrowed to the
 * fewest bytes (1 or 2) that hold the largest, then the words. Returns that kind, or 0 (and
 * writes nothing) when a gap is negative or of 2^16 or more: the caller takes another kind.
 * The gaps as numpy computes them (int64, wrapping). numpy's path took eight calls and a
 * temporary a record, each call taking the GIL again: laid on two threads it was slower than
 * on one. */
static int image_lay(const int64_t *p, Py_ssize_t k, const unsigned char *w, int width, unsigned char *out) {
    int64_t most = 0, sign = 0;
    for (Py_ssize_t i = 1; i < k; i++) {
        int64_t g = (int64_t)((uint64_t)p[i] - (uint64_t)p[i - 1] - 1u);
        sign |= g;
        most = g > most ? g : most;
    }
    if (sign < 0 || most >= (1 << 16))
        return 0;
    int kind = most < (1 << 8) ? 1 : 2;
    memcpy(out, p, 8);
    unsigned char *gaps = out + 8;
    if (kind == 1) {
        for (Py_ssize_t i = 1; i < k; i++)
            gaps[i - 1] = (unsigned char)(p[i] - p[i - 1] - 1);
    } else {
        for (Py_ssize_t i = 1; i < k; i++) {
            uint16_t g = (uint16_t)(p[i] - p[i - 1] - 1);
            memcpy(gaps + 2 * (i - 1), &g, 2);
        }
    }
    memcpy(gaps + (size_t)kind * (size_t)(k - 1), w, (size_t)width * (size_t)k);
    return kind;
}

/* image_lay(positions, words, width, out) -> kind (see image_lay above); positions int64, at
 * least two; out at least 8 + 2 (k - 1) + width k bytes. The GIL released. */
static PyObject *py_image_lay(PyObject *self, PyObject *args) {
    Py_buffer pos, w, out;
    int width;
    if (!PyArg_ParseTuple(args, "y*y*iw*", &pos, &w, &width, &out))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t k = pos.len / 8;
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "word width must be 1, 2, 4 or 8");
    } else if (pos.len % 8 || (uintptr_t)pos.buf % 8 || k < 2 || w.len != k * width
               || out.len < 8 + 2 * (k - 1) + k * width) {
        PyErr_SetString(PyExc_ValueError, "positions, words and image do not match");
    } else {
        int kind;
        Py_BEGIN_ALLOW_THREADS
        kind = image_lay(pos.buf, k, w.buf, width, out.buf);
        Py_END_ALLOW_THREADS
        result = PyLong_FromLong(kind);
    }
    PyBuffer_Release(&pos);
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    return result;
}

#ifdef __linux__
#include <sys/mman.h>
#include <unistd.h>
#ifndef MADV_POPULATE_WRITE
#define MADV_POPULATE_WRITE 23 /* Linux 5.14 */
#endif
#else /* (page_advice answers False without calling madvise) */
#undef MADV_POPULATE_WRITE
#undef MADV_DONTNEED
#define MADV_POPULATE_WRITE 0
#define MADV_DONTNEED 0
#endif

/* populate_write(buffer, start, length) -> bool: fault buffer[start:start + length] in for
 * writing in one call (MADV_POPULATE_WRITE), the GIL released: Python's mmap.madvise holds
 * it, so the write pass's threads took turns at their faults. False where the kernel or
 * the platform has no such advice (the writes fault the pages in then).
 *
 * drop_pages(buffer, start, length) -> bool: drop the page-table entries of the pages that
 * hold buffer[start:start + length] (MADV_DONTNEED). Pages that reads mapped read-only take
 * a write-protect fault each when written, 4 KiB at a time; unmapped, populate_write maps
 * them for writing a folio at a time (tools/bench_pagecache.py). ONLY for a shared file
 * mapping: its pages, and whatever was written to them, stay in the page cache; on private
 * or anonymous memory the drop discards the contents. */
static PyObject *page_advice(PyObject *args, int advice) {
    Py_buffer b;
    Py_ssize_t start, length;
    if (!PyArg_ParseTuple(args, "w*nn", &b, &start, &length))
        return NULL;
    PyObject *result = NULL;
    if (start < 0 || length < 0 || start > b.len || length > b.len - start) {
        PyErr_SetString(PyExc_ValueError, "the range lies outside the buffer");
    } else {
        int ok = 0;
#ifdef __linux__
        uintptr_t page = (uintptr_t)sysconf(_SC_PAGESIZE);
        uintptr_t lo = (uintptr_t)b.buf + (uintptr_t)start, hi = lo + (uintptr_t)length;
        lo -= lo % page; /* the page that holds the first byte (madvise takes whole pages) */
        Py_BEGIN_ALLOW_THREADS
        ok = length == 0 || madvise((void *)lo, hi - lo, advice) == 0;
        Py_END_ALLOW_THREADS
#else
        (void)advice;
#endif
        result = PyBool_FromLong(ok);
    }
    PyBuffer_Release(&b);
    return result;
}

static PyObject *py_populate_write(PyObject *self, PyObject *args) { return page_advice(args, MADV_POPULATE_WRITE); }
static PyObject *py_drop_pages(PyObject *self, PyObject *args) { return page_advice(args, MADV_DONTNEED); }

/* dirty_pages(fd, start, length) -> int | None: how many of the file's pages in
 * [start, start + length) the page cache holds dirty (cachestat, Linux 6.5: one walk of the
 * range's folios, no page touched). Writeback write-protects each page it cleans, so
 * pages a map wrote that are still dirty are still mapped for writing. None where the
 * kernel or the platform has no such call. */
#if defined(__linux__)
#include <errno.h>
#include <sys/syscall.h>
#ifndef __NR_cachestat
#define __NR_cachestat 451 /* the same number on every architecture */
#endif
struct cachestat_range_ { uint64_t off, len; };
struct cachestat_ { uint64_t nr_cache, nr_dirty, nr_writeback, nr_evicted, nr_recently_evicted; };
#endif

static PyObject *py_dirty_pages(PyObject *self, PyObject *args) {
    int fd;
    long long start, length;
    if (!PyArg_ParseTuple(args, "iLL", &fd, &start, &length))
        return NULL;
    if (start < 0 || length < 0) {
        PyErr_SetString(PyExc_ValueError, "a range starts and lasts at least 0 bytes");
        return NULL;
    }
#if defined(__linux__)
    struct cachestat_range_ range = {(uint64_t)start, (uint64_t)length};
    struct cachestat_ stat;
    long rc;
    if (length == 0)
        return PyLong_FromLong(0); /* (a length of 0 asks cachestat for the whole file) */
    Py_BEGIN_ALLOW_THREADS
    rc = syscall(__NR_cachestat, fd, &range, &stat, 0);
    Py_END_ALLOW_THREADS
    if (rc == 0)
        return PyLong_FromUnsignedLongLong(stat.nr_dirty);
    if (errno != ENOSYS && errno != EPERM && errno != EOPNOTSUPP)
        return PyErr_SetFromErrno(PyExc_OSError);
#endif
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"gather", py_gather, METH_VARARGS, "words at int64 positions, into out"},
    {"scatter", py_scatter, METH_VARARGS, "values into words at int64 positions"},
    {"find", py_find, METH_VARARGS, "positions, base words and new words where two buffers differ"},
    {"step", py_step, METH_VARARGS, "the words distance steps from base in the ulp key order"},
    {"ulp_prepare", py_ulp_prepare, METH_VARARGS, "the ulp encoding's gaps and distances of a record's changes"},
    {"planes", py_planes, METH_VARARGS, "the byte planes of words, into out"},
    {"unplanes", py_unplanes, METH_VARARGS, "words from their byte planes, into out"},
    {"sparse_unpack", py_sparse_unpack, METH_VARARGS, "the sparse encoding's positions and values from its body"},
    {"image_lay", py_image_lay, METH_VARARGS, "a deferred-sync image's first position, narrowed gaps and words"},
    {"populate_write", py_populate_write, METH_VARARGS, "fault a buffer's pages in for writing, the GIL released"},
    {"drop_pages", py_drop_pages, METH_VARARGS, "drop a shared file map's page-table entries, the GIL released"},
    {"dirty_pages", py_dirty_pages, METH_VARARGS, "how many of a file range's pages the page cache holds dirty"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_changes", NULL, -1, methods};

PyMODINIT_FUNC PyInit__changes(void) {
#ifdef HAVE_FIND_AVX512
    init_pack_tables();
#endif
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* the entries find's outputs hold past n for its vector paths (dcr_log.write.differ);
     * the paths this CPU can take, scalar first (find's last argument) */
    PyObject *paths = PyTuple_New(best_find_path() + 1);
    if (paths != NULL)
        for (int p = 0; p <= best_find_path(); p++)
            PyTuple_SET_ITEM(paths, p, PyLong_FromLong(p));
    if (paths == NULL || PyModule_AddIntConstant(m, "FIND_SLACK", FIND_SLACK) < 0
        || PyModule_AddObject(m, "FIND_PATHS", paths) < 0) {
        Py_XDECREF(paths);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
