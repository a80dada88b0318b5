/* The `ulp-rans` encoding's coder (spec/FORMAT.md section 11): a record's changes as gaps and
 * ulp distances (the `ulp` encoding's values), each split into a bin (one of 252 symbols)
 * and the bits below it. The bins are coded by static rANS (12-bit frequencies, 32-bit states
 * renormalized 16 bits at a time, four streams so that four chains run side by side), the
 * bits below are stored as they are. Encoding is one pass over the changes (bins, bits,
 * histograms) and one backward pass (rANS); decoding is the rANS pass, then the values, a
 * block of changes at a time. With AVX-512 (picked at run time) the per-change passes run 8
 * changes at a time, with AVX2 4: on bf16 Adam steps at 1-10% changed, on a Zen 3 EPYC,
 * encode took 7.0-7.6 ns a change against the scalar passes' 8.7-9.3 (1.19-1.23x), decode
 * 7.5-7.6 against 8.2-8.3 (1.08-1.10x) (tools/bench_codec.py --rates 0.01 0.03 0.10
 * --repeats 15, its coder rows). Against pcodec (the `ulp` encoding's coder, which searches
 * its bins per file) on bf16 Adam steps: 1% smaller, a quarter of the CPU to encode, about
 * as much to decode (tools/bench_codec.py --levels 8).
 *
 * Decoding checks everything it reads: a payload that is not what the spec allows is
 * refused with an error code (IntegrityError in dcr_log.codec.ulp_rans), and every write
 * stays inside the outputs whatever the payload holds. The GIL is released while coding.
 * tools/rans_spec.py is the same coder in plain Python, written from the spec, that this one
 * is checked against byte for byte (tests/test_ulp_rans.py). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if !defined(__BYTE_ORDER__) || __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "words are read as little-endian integers"
#endif

#define SCALE_BITS 12
#define SCALE (1u << SCALE_BITS)
#define RANS_L (1u << 16)          /* the states live in [2^16, 2^32) */
#define NBINS 252                  /* bins 0..251 cover every 64-bit value */
#define LANES 2                    /* changes per round: change i is in lane i % LANES */
/* (rans_rounds is written out for LANES 2) */
#define STREAMS (2 * LANES)        /* each lane's gap bins and distance bins */
#define TABLE_BITMAP 32            /* bytes: one bit per symbol 0..255 */

/* The loops are also compiled for x86-64-v3 (BMI2's shifts and bit extracts) and picked at
 * load time, as in _digest.c. GCC 11 and clang 14 know that level (and AVX-512's intrinsics,
 * below); older compilers build the portable loops. */
#if defined(__x86_64__) && defined(__GNUC__) \
    && ((defined(__clang__) && __clang_major__ >= 14) || (!defined(__clang__) && __GNUC__ >= 11))
#define NEW_X86_COMPILER 1
#endif
#if defined(NEW_X86_COMPILER) && defined(__GLIBC__)
#define ARCH_CLONES __attribute__((target_clones("arch=x86-64-v3", "default")))
#else
#define ARCH_CLONES
#endif

/* --- bins: value u >= 0 -> (bin, extra bits) ------------------------------------------ */

/* u < 4: bin u, no extra bits. Else e = floor(log2 u), nb = e - 2, bin = 4 nb + (u >> nb)
 * (which is 4 + 4 (e - 2) + the two bits below the leading one), extra = the nb low bits. */
static inline unsigned extra_bits_of(uint64_t u) {
    int t = 61 - __builtin_clzll(u | 1); /* e - 2 */
    return (unsigned)(t & ~(t >> 31));   /* max(t, 0) without a branch */
}

static inline unsigned bin_of(uint64_t u, unsigned nb) { return 4 * nb + (unsigned)(u >> nb); }

/* bin -> the number of its extra bits and its value with those bits zero */
typedef struct {
    uint64_t base;
    uint64_t nb;
} Bin;

static Bin bins[256];

static void init_bins(void) {
    for (unsigned b = 0; b < 256; b++) {
        if (b < 4) {
            bins[b].base = b;
            bins[b].nb = 0;
        } else if (b < NBINS) {
            bins[b].nb = (b - 4) / 4;
            bins[b].base = (uint64_t)(4 + (b - 4) % 4) << bins[b].nb;
        } else {
            bins[b].base = bins[b].nb = 0;
        }
    }
}

/* --- the bit stream: least significant bit first ---------------------------------------- */

typedef struct {
    const unsigned char *in;
    size_t len;    /* bytes */
    uint64_t pos;  /* bits read */
} BitReader;

static inline uint64_t load_le64(const unsigned char *in, size_t len, size_t at) {
    uint64_t v = 0;
    if (at + 8 <= len) {
        memcpy(&v, in + at, 8);
    } else {
        for (size_t j = 0; at + j < len && j < 8; j++)
            v |= (uint64_t)in[at + j] << (8 * j);
    }
    return v;
}

/* n <= 56 bits at a time; reading past the end gives zero bits (the caller checks the
 * position against the length at the end). */
static inline uint64_t get_bits56(BitReader *r, unsigned n) {
    uint64_t v = load_le64(r->in, r->len, (size_t)(r->pos >> 3)) >> (r->pos & 7);
    r->pos += n;
    return v & ((1ULL << n) - 1);
}

static inline uint64_t get_bits(BitReader *r, unsigned n) { /* n <= 63 */
    if (n <= 56)
        return get_bits56(r, n);
    uint64_t lo = get_bits56(r, 32);
    return lo | get_bits56(r, n - 32) << 32;
}

/* --- frequency tables ------------------------------------------------------------------ */

/* Counts -> frequencies that sum to SCALE, each present symbol at least 1 (informative: the
 * spec leaves the rounding to the writer). Proportional rounding, then the difference taken
 * from (or given to) the largest frequencies, which stay at least 1. */
static void normalize(const uint64_t *count, uint64_t total, uint32_t *freq) {
    int64_t sum = 0;
    int largest = -1;
    for (int s = 0; s < 256; s++) {
        if (!count[s]) {
            freq[s] = 0;
            continue;
        }
        uint64_t f = (count[s] * SCALE + total / 2) / total;
        freq[s] = f ? (uint32_t)f : 1;
        sum += freq[s];
        if (largest < 0 || count[s] > count[largest])
            largest = s;
    }
    if (largest < 0)
        return;
    while (sum != SCALE) {
        if (sum < SCALE) {
            freq[largest] += (uint32_t)(SCALE - sum);
            sum = SCALE;
        } else {
            /* take one from the largest frequency above 1 (sum > SCALE needs many symbols
             * forced up to 1; at most 252, so this ends quickly) */
            int top = -1;
            for (int s = 0; s < 256; s++)
                if (freq[s] > 1 && (top < 0 || freq[s] > freq[top]))
                    top = s;
            uint32_t take = (uint32_t)(sum - SCALE);
            uint32_t can = freq[top] - 1;
            if (take > can)
                take = can;
            freq[top] -= take;
            sum -= take;
        }
    }
}

static size_t write_table(unsigned char *out, const uint32_t *freq) {
    memset(out, 0, TABLE_BITMAP);
    size_t at = TABLE_BITMAP;
    for (int s = 0; s < 256; s++) {
        if (freq[s]) {
            out[s >> 3] |= (unsigned char)(1u << (s & 7));
            out[at] = (unsigned char)freq[s];
            out[at + 1] = (unsigned char)(freq[s] >> 8);
            at += 2;
        }
    }
    return at;
}

/* A decoding table: per slot (0..SCALE-1) one 32-bit entry, the symbol (8 bits), its
 * frequency - 1 (12 bits) and slot - its cumulative frequency (12 bits): one load per symbol. */
typedef struct {
    uint32_t slot[SCALE];
} DecodeTable;

/* Parse one table at in[0..len); returns its size in bytes, or -1 if it is not valid. */
static Py_ssize_t read_table(const unsigned char *in, size_t len, DecodeTable *t) {
    if (len < TABLE_BITMAP)
        return -1;
    size_t at = TABLE_BITMAP;
    uint32_t cum = 0;
    for (unsigned s = 0; s < 256; s++) {
        if (!(in[s >> 3] >> (s & 7) & 1))
            continue;
        if (s >= NBINS || at + 2 > len)
            return -1;
        uint32_t f = (uint32_t)in[at] | (uint32_t)in[at + 1] << 8;
        at += 2;
        if (f == 0 || f > SCALE - cum)
            return -1;
        for (uint32_t j = 0; j < f; j++)
            t->slot[cum + j] = s | (f - 1) << 8 | j << 20;
        cum += f;
    }
    return cum == SCALE ? (Py_ssize_t)at : -1;
}

/* --- rANS -------------------------------------------------------------------------------- */

/* An encoder's symbol: x -> ((x / freq) << 12) + x % freq + cum, the division by a
 * multiply (Lemire, Kaser and Kurz, "Faster remainder by direct computation", 2019: exact for
 * every 32-bit x): q = (x * m) >> 64 with m = floor((2^64 - 1) / freq) + 1, and then
 * x' = x + cum + q * (SCALE - freq). For freq 1, m would be 2^64: m = 2^64 - 1 gives
 * q = x - 1 instead (x >= 1), which a bias of cum + SCALE - 1 makes up for (as in ryg_rans),
 * so that every symbol takes the same steps. 16 bytes, so that a symbol's entry is one shift
 * away from its index. */
typedef struct {
    uint64_t m;
    uint32_t x_max; /* renormalize first while x >= x_max (freq << 20; for freq 4096, never) */
    uint16_t bias;  /* cum, or cum + SCALE - 1 for freq 1 */
    uint16_t cmpl;  /* SCALE - freq */
} EncSymbol;

static void enc_symbols(const uint32_t *freq, EncSymbol *sym) {
    uint32_t cum = 0;
    for (int s = 0; s < 256; s++) {
        uint32_t f = freq[s];
        sym[s].m = f > 1 ? UINT64_MAX / f + 1 : UINT64_MAX;
        uint64_t x_max = (uint64_t)((RANS_L >> SCALE_BITS) << 16) * f;
        sym[s].x_max = x_max > UINT32_MAX ? UINT32_MAX : (uint32_t)x_max; /* a state never reaches 2^32 - 1 */
        sym[s].bias = (uint16_t)(f == 1 ? cum + SCALE - 1 : cum);
        sym[s].cmpl = (uint16_t)(SCALE - f);
        cum += f;
    }
}

static inline void rans_put(uint32_t *x, uint16_t **ptr, const EncSymbol *s) {
    uint32_t v = *x;
    /* renormalize without a branch: the word is stored either way, kept only if needed */
    int out = v >= s->x_max;
    (*ptr)[-1] = (uint16_t)v;
    *ptr -= out;
    v = out ? v >> 16 : v;
    uint32_t q = (uint32_t)(((unsigned __int128)s->m * v) >> 64);
    *x = v + s->bias + q * s->cmpl;
}

/* The whole rounds, changes i, i - 1, ..., 0 (i + 1 a multiple of LANES), with the states and
 * stream pointers in locals (registers), not in the arrays the partial round indexes. */
static inline void rans_rounds(uint32_t *x, uint16_t **ptrs, const EncSymbol *gsym, const EncSymbol *dsym,
                               const unsigned char *gbin, const unsigned char *dbin, Py_ssize_t i) {
    uint32_t x0 = x[0], x1 = x[1], x2 = x[2], x3 = x[3];
    uint16_t *p0 = ptrs[0], *p1 = ptrs[1], *p2 = ptrs[2], *p3 = ptrs[3];
    for (; i >= 1; i -= 2) {
        rans_put(&x3, &p3, &dsym[dbin[i]]);
        rans_put(&x2, &p2, &gsym[gbin[i]]);
        rans_put(&x1, &p1, &dsym[dbin[i - 1]]);
        rans_put(&x0, &p0, &gsym[gbin[i - 1]]);
    }
    x[0] = x0, x[1] = x1, x[2] = x2, x[3] = x3;
    ptrs[0] = p0, ptrs[1] = p1, ptrs[2] = p2, ptrs[3] = p3;
}

/* --- encode ------------------------------------------------------------------------------ */

enum { OK = 0, E_ORDER = 1, E_UNCHANGED = 2, E_SPACE = 3 };

/* The bit writer: whole 64-bit words to out as they fill, the rest in acc (fill bits). */
static inline void put_bits(unsigned char *out, size_t *len, uint64_t *acc, unsigned *fill, uint64_t v,
                            unsigned n) { /* n <= 56, v < 2^n */
    *acc |= v << *fill;
    unsigned f = *fill + n;
    if (f >= 64) {
        memcpy(out + *len, acc, 8);
        *len += 8;
        f -= 64;
        *acc = v >> (n - f); /* the bits that did not fit (none when f is 0) */
    }
    *fill = f;
}

/* Up to 63 bits in pieces of at most 32 (put_bits takes 56). */
static inline void put_pieces(unsigned char *out, size_t *len, uint64_t *acc, unsigned *fill, uint64_t v,
                              unsigned n) {
    put_bits(out, len, acc, fill, v & 0xFFFFFFFFu, n < 32 ? n : 32);
    if (n > 32)
        put_bits(out, len, acc, fill, v >> 32, n - 32);
}

/* One change of pass 1: its bins into *gbin, *dbin, its extra bits to the bit writer.
 * Returns an error for a position not after the last one, or a position whose words are
 * equal. */
#define PASS1_ONE(T, S, BITS)                                                        \
    static inline int pass1_one_##T(int64_t p, int64_t *prev, const unsigned char *b, \
                                    const unsigned char *w, unsigned char *gbin,     \
                                    unsigned char *dbin, unsigned char *out, size_t *len, \
                                    uint64_t *acc, unsigned *fill) {                 \
        const T top = (T)1 << ((BITS) - 1);                                          \
        if (p <= *prev)                                                              \
            return E_ORDER;                                                          \
        uint64_t gap = (uint64_t)p - (uint64_t)*prev - 1;                            \
        *prev = p;                                                                   \
        T x, y;                                                                      \
        memcpy(&x, b, sizeof(T));                                                    \
        memcpy(&y, w, sizeof(T));                                                    \
        T kx = (x & top) ? (T)~x : (T)(x ^ top);                                     \
        T ky = (y & top) ? (T)~y : (T)(y ^ top);                                     \
        T dd = (T)(ky - kx);                                                         \
        if (dd == 0)                                                                 \
            return E_UNCHANGED;                                                      \
        S s = (S)dd;                                                                 \
        T zz = (T)((T)((T)s << 1) ^ (T)(s >> ((BITS) - 1)));                         \
        uint64_t u = (uint64_t)zz - 1;                                               \
        unsigned gnb = extra_bits_of(gap), dnb = extra_bits_of(u);                   \
        *gbin = (unsigned char)bin_of(gap, gnb);                                     \
        *dbin = (unsigned char)bin_of(u, dnb);                                       \
        uint64_t ge = gap & ((1ULL << gnb) - 1), de = u & ((1ULL << dnb) - 1);       \
        if (__builtin_expect(gnb + dnb <= 56, 1)) {                                  \
            put_bits(out, len, acc, fill, ge | de << gnb, gnb + dnb);                \
        } else {                                                                     \
            put_pieces(out, len, acc, fill, ge, gnb);                                \
            put_pieces(out, len, acc, fill, de, dnb);                                \
        }                                                                            \
        return OK;                                                                   \
    }

PASS1_ONE(uint8_t, int8_t, 8)
PASS1_ONE(uint16_t, int16_t, 16)
PASS1_ONE(uint32_t, int32_t, 32)
PASS1_ONE(uint64_t, int64_t, 64)

/* The bit writer's last bits, whole bytes (the unused high bits 0). */
static void flush_pending(unsigned char *out, size_t *len, uint64_t acc, unsigned fill) {
    for (; fill > 0; fill = fill > 8 ? fill - 8 : 0) {
        out[(*len)++] = (unsigned char)acc;
        acc >>= 8;
    }
}

/* Pass 1's changes i .. k - 1, one at a time, then the bit writer's last bits: the whole of
 * the scalar pass, the last changes of the vector ones. Stops at the first error. */
#define PASS1_REST(T)                                                                \
    static inline int pass1_rest_##T(const int64_t *pos, const unsigned char *b,     \
                                     const unsigned char *w, Py_ssize_t i, Py_ssize_t k, \
                                     unsigned char *gbin, unsigned char *dbin, unsigned char *out, \
                                     size_t len, uint64_t acc, unsigned fill, size_t *out_len) { \
        int64_t prev = i ? pos[i - 1] : -1;                                          \
        for (; i < k; i++) {                                                         \
            int rc = pass1_one_##T(pos[i], &prev, b + sizeof(T) * i, w + sizeof(T) * i, \
                                   gbin + i, dbin + i, out, &len, &acc, &fill);      \
            if (rc != OK)                                                            \
                return rc;                                                           \
        }                                                                            \
        flush_pending(out, &len, acc, fill);                                         \
        *out_len = len;                                                              \
        return OK;                                                                   \
    }

PASS1_REST(uint8_t)
PASS1_REST(uint16_t)
PASS1_REST(uint32_t)
PASS1_REST(uint64_t)

/* Pass 1 for one word type, change by change: the bins into gbin, dbin, the extra bits into
 * out (its length comes back). Stops at the first error. */
#define PASS1(T)                                                                     \
    ARCH_CLONES static int pass1_##T(const int64_t *pos, const unsigned char *b,     \
                         const unsigned char *w, Py_ssize_t k, unsigned char *gbin,  \
                         unsigned char *dbin, unsigned char *out, size_t *out_len) { \
        return pass1_rest_##T(pos, b, w, 0, k, gbin, dbin, out, 0, 0, 0, out_len);   \
    }

PASS1(uint8_t)
PASS1(uint16_t)
PASS1(uint32_t)
PASS1(uint64_t)

/* Byte histograms of the bins (counted after pass 1, whichever ran), four at a time so that a
 * run of one bin does not wait on its own count. */
static void histogram(const unsigned char *bins, Py_ssize_t k, uint64_t *count) {
    uint32_t c4[4][256];
    memset(c4, 0, sizeof c4);
    Py_ssize_t i = 0;
    for (; i + 4 <= k; i += 4) {
        c4[0][bins[i]]++;
        c4[1][bins[i + 1]]++;
        c4[2][bins[i + 2]]++;
        c4[3][bins[i + 3]]++;
    }
    for (; i < k; i++)
        c4[0][bins[i]]++;
    for (int s = 0; s < 256; s++)
        count[s] += (uint64_t)c4[0][s] + c4[1][s] + c4[2][s] + c4[3][s];
}

#ifdef NEW_X86_COMPILER
#include <immintrin.h>
#define HAVE_VECTOR_PASSES 1
#define AVX512_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512cd,bmi2")))

/* Pass 1 with AVX-512, 8 changes at a time in 64-bit lanes: gaps, keys, zigzagged distances,
 * bins and extra bits computed side by side (vplzcntq for the bit lengths); only the bit
 * writer, which appends each change's bits to the last, runs change by change. A block with
 * a change of more than 56 extra bits takes the scalar writer's pieces. */
#define PASS1_AVX512(T, BITS, LOAD8)                                                 \
    AVX512_TARGET static int pass1_##T##_avx512(const int64_t *pos, const unsigned char *b, \
                                                const unsigned char *w, Py_ssize_t k, \
                                                unsigned char *gbin, unsigned char *dbin, \
                                                unsigned char *out, size_t *out_len) { \
        const __m512i top = _mm512_set1_epi64((int64_t)1 << ((BITS) - 1));           \
        const __m512i ones = _mm512_set1_epi64((int64_t)(((BITS) == 64) ? ~0ULL : (1ULL << ((BITS) & 63)) - 1)); \
        const __m512i one = _mm512_set1_epi64(1), zero = _mm512_setzero_si512();     \
        const __m512i c61 = _mm512_set1_epi64(61);                                   \
        __m512i last = _mm512_set1_epi64(-1);                                        \
        __mmask8 bad_order = 0, unchanged = 0;                                       \
        size_t len = 0;                                                              \
        uint64_t acc = 0;                                                            \
        unsigned fill = 0;                                                           \
        Py_ssize_t i = 0;                                                            \
        for (; i + 8 <= k; i += 8) {                                                 \
            __m512i p = _mm512_loadu_si512((const void *)(pos + i));                 \
            __m512i prev = _mm512_alignr_epi64(p, last, 7);                          \
            last = p;                                                                \
            bad_order |= _mm512_cmple_epi64_mask(p, prev);                           \
            __m512i gap = _mm512_sub_epi64(_mm512_sub_epi64(p, prev), one);          \
            __m512i x = LOAD8(b + sizeof(T) * i), y = LOAD8(w + sizeof(T) * i);      \
            __m512i kx = _mm512_xor_si512(x, _mm512_mask_blend_epi64(_mm512_test_epi64_mask(x, top), top, ones)); \
            __m512i ky = _mm512_xor_si512(y, _mm512_mask_blend_epi64(_mm512_test_epi64_mask(y, top), top, ones)); \
            __m512i dd = _mm512_and_si512(_mm512_sub_epi64(ky, kx), ones);           \
            unchanged |= _mm512_cmpeq_epi64_mask(dd, zero);                          \
            __m512i sd = _mm512_sub_epi64(_mm512_xor_si512(dd, top), top);           \
            if ((BITS) == 64)                                                        \
                sd = dd;                                                             \
            __m512i u = _mm512_sub_epi64(_mm512_xor_si512(_mm512_slli_epi64(sd, 1), _mm512_srai_epi64(sd, 63)), one); \
            __m512i gnb = _mm512_max_epi64(_mm512_sub_epi64(c61, _mm512_lzcnt_epi64(_mm512_or_si512(gap, one))), zero); \
            __m512i dnb = _mm512_max_epi64(_mm512_sub_epi64(c61, _mm512_lzcnt_epi64(_mm512_or_si512(u, one))), zero); \
            __m512i gb = _mm512_add_epi64(_mm512_slli_epi64(gnb, 2), _mm512_srlv_epi64(gap, gnb)); \
            __m512i db = _mm512_add_epi64(_mm512_slli_epi64(dnb, 2), _mm512_srlv_epi64(u, dnb)); \
            _mm_storel_epi64((__m128i *)(void *)(gbin + i), _mm512_cvtepi64_epi8(gb)); \
            _mm_storel_epi64((__m128i *)(void *)(dbin + i), _mm512_cvtepi64_epi8(db)); \
            __m512i ge = _mm512_and_si512(gap, _mm512_sub_epi64(_mm512_sllv_epi64(one, gnb), one)); \
            __m512i de = _mm512_and_si512(u, _mm512_sub_epi64(_mm512_sllv_epi64(one, dnb), one)); \
            __m512i nbits = _mm512_add_epi64(gnb, dnb);                              \
            uint64_t v8[8], n8[8];                                                   \
            _mm512_storeu_si512((void *)v8, _mm512_or_si512(ge, _mm512_sllv_epi64(de, gnb))); \
            _mm512_storeu_si512((void *)n8, nbits);                                  \
            if (__builtin_expect(!_mm512_cmpgt_epu64_mask(nbits, _mm512_set1_epi64(56)), 1)) { \
                for (int j = 0; j < 8; j++)                                          \
                    put_bits(out, &len, &acc, &fill, v8[j], (unsigned)n8[j]);        \
            } else {                                                                 \
                uint64_t g8[8], e8[8], gn8[8], dn8[8];                               \
                _mm512_storeu_si512((void *)g8, ge);                                 \
                _mm512_storeu_si512((void *)e8, de);                                 \
                _mm512_storeu_si512((void *)gn8, gnb);                               \
                _mm512_storeu_si512((void *)dn8, dnb);                               \
                for (int j = 0; j < 8; j++) {                                        \
                    put_pieces(out, &len, &acc, &fill, g8[j], (unsigned)gn8[j]);     \
                    put_pieces(out, &len, &acc, &fill, e8[j], (unsigned)dn8[j]);     \
                }                                                                    \
            }                                                                        \
        }                                                                            \
        if (bad_order)                                                               \
            return E_ORDER;                                                          \
        if (unchanged)                                                               \
            return E_UNCHANGED;                                                      \
        /* the last changes, one at a time (the scalar pass's steps) */              \
        return pass1_rest_##T(pos, b, w, i, k, gbin, dbin, out, len, acc, fill, out_len); \
    }

#define LOAD8_U16(p) _mm512_cvtepu16_epi64(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define LOAD8_U32(p) _mm512_cvtepu32_epi64(_mm256_loadu_si256((const __m256i *)(const void *)(p)))

PASS1_AVX512(uint16_t, 16, LOAD8_U16)
PASS1_AVX512(uint32_t, 32, LOAD8_U32)

/* AVX2 (x86-64-v3, the common server level: AMD EPYC before Zen 4, Intel since Haswell). */
#define AVX2_TARGET __attribute__((target("avx2,bmi2")))

/* floor(log2 v) - 2, at least 0, in each 64-bit lane holding v < 2^52 (AVX2 has no vplzcntq):
 * v as a double, exactly (its bits put under 2^52's exponent, 2^52 then taken away), whose
 * exponent less 1025 is saturated at 0 in the 16-bit word it lies in. */
AVX2_TARGET static inline __m256i extra_bits4(__m256i v) {
    const __m256i magic = _mm256_set1_epi64x(0x4330000000000000LL);
    __m256d d = _mm256_sub_pd(_mm256_castsi256_pd(_mm256_or_si256(v, magic)), _mm256_castsi256_pd(magic));
    return _mm256_subs_epu16(_mm256_srli_epi64(_mm256_castpd_si256(d), 52), _mm256_set1_epi64x(1025));
}

/* Prefix sums of 4 lanes (lane j: the sum of lanes 0..j). */
AVX2_TARGET static inline __m256i scan4(__m256i x) {
    x = _mm256_add_epi64(x, _mm256_blend_epi32(_mm256_permute4x64_epi64(x, 0x90), _mm256_setzero_si256(), 0x03));
    return _mm256_add_epi64(x, _mm256_permute2x128_si256(x, x, 0x08));
}

/* Pass 1 with AVX2, 4 changes at a time in 64-bit lanes: the AVX-512 pass's steps, the bit
 * lengths from extra_bits4. A block with a position out of order, an unchanged word or a gap
 * of 2^52 or more (no box has that many elements) takes the scalar steps, which stop at the
 * error; one with a change of more than 56 extra bits, the scalar writer's pieces. */
#define PASS1_AVX2(T, BITS, LOAD4)                                                   \
    AVX2_TARGET static int pass1_##T##_avx2(const int64_t *pos, const unsigned char *b, \
                                            const unsigned char *w, Py_ssize_t k,    \
                                            unsigned char *gbin, unsigned char *dbin, \
                                            unsigned char *out, size_t *out_len) {   \
        const __m256i top = _mm256_set1_epi64x((int64_t)1 << ((BITS) - 1));         \
        const __m256i ones = _mm256_set1_epi64x((int64_t)((1ULL << (BITS)) - 1));   \
        const __m256i one = _mm256_set1_epi64x(1), zero = _mm256_setzero_si256();   \
        const __m256i far = _mm256_set1_epi64x(((int64_t)1 << 52) - 1);             \
        const __m256i c56 = _mm256_set1_epi64x(56);                                  \
        __m256i last = _mm256_set1_epi64x(-1);                                       \
        size_t len = 0;                                                              \
        uint64_t acc = 0;                                                            \
        unsigned fill = 0;                                                           \
        Py_ssize_t i = 0;                                                            \
        for (; i + 4 <= k; i += 4) {                                                 \
            __m256i p = _mm256_loadu_si256((const __m256i *)(const void *)(pos + i)); \
            __m256i prev = _mm256_blend_epi32(_mm256_permute4x64_epi64(p, 0x93),     \
                                              _mm256_permute4x64_epi64(last, 0xFF), 0x03); \
            last = p;                                                                \
            __m256i gap = _mm256_sub_epi64(_mm256_sub_epi64(p, prev), one);          \
            __m256i x = LOAD4(b + sizeof(T) * i), y = LOAD4(w + sizeof(T) * i);      \
            __m256i kx = _mm256_xor_si256(x, _mm256_blendv_epi8(top, ones, _mm256_cmpeq_epi64(_mm256_and_si256(x, top), top))); \
            __m256i ky = _mm256_xor_si256(y, _mm256_blendv_epi8(top, ones, _mm256_cmpeq_epi64(_mm256_and_si256(y, top), top))); \
            __m256i dd = _mm256_and_si256(_mm256_sub_epi64(ky, kx), ones);           \
            /* p <= prev (signed, as the scalar step), gap >= 2^52, or dd == 0 */     \
            __m256i odd = _mm256_or_si256(_mm256_or_si256(                           \
                _mm256_xor_si256(_mm256_cmpgt_epi64(p, prev), _mm256_cmpeq_epi64(zero, zero)), \
                _mm256_cmpgt_epi64(gap, far)), _mm256_cmpeq_epi64(dd, zero));        \
            if (__builtin_expect(!_mm256_testz_si256(odd, odd), 0)) {                \
                int64_t prevp = i ? pos[i - 1] : -1;                                 \
                for (Py_ssize_t j = i; j < i + 4; j++) {                             \
                    int rc = pass1_one_##T(pos[j], &prevp, b + sizeof(T) * j, w + sizeof(T) * j, \
                                           gbin + j, dbin + j, out, &len, &acc, &fill); \
                    if (rc != OK)                                                    \
                        return rc;                                                   \
                }                                                                    \
                continue;                                                            \
            }                                                                        \
            __m256i sd = _mm256_sub_epi64(_mm256_xor_si256(dd, top), top);           \
            __m256i u = _mm256_sub_epi64(_mm256_xor_si256(_mm256_slli_epi64(sd, 1), _mm256_cmpgt_epi64(zero, sd)), one); \
            __m256i gnb = extra_bits4(gap), dnb = extra_bits4(u);                    \
            __m256i gb = _mm256_add_epi64(_mm256_slli_epi64(gnb, 2), _mm256_srlv_epi64(gap, gnb)); \
            __m256i db = _mm256_add_epi64(_mm256_slli_epi64(dnb, 2), _mm256_srlv_epi64(u, dnb)); \
            __m256i ge = _mm256_and_si256(gap, _mm256_sub_epi64(_mm256_sllv_epi64(one, gnb), one)); \
            __m256i de = _mm256_and_si256(u, _mm256_sub_epi64(_mm256_sllv_epi64(one, dnb), one)); \
            __m256i nbits = _mm256_add_epi64(gnb, dnb);                              \
            uint64_t v4[4], n4[4], g4[4], d4[4];                                     \
            _mm256_storeu_si256((__m256i *)(void *)v4, _mm256_or_si256(ge, _mm256_sllv_epi64(de, gnb))); \
            _mm256_storeu_si256((__m256i *)(void *)n4, nbits);                       \
            _mm256_storeu_si256((__m256i *)(void *)g4, gb);                          \
            _mm256_storeu_si256((__m256i *)(void *)d4, db);                          \
            for (int j = 0; j < 4; j++) {                                            \
                gbin[i + j] = (unsigned char)g4[j];                                  \
                dbin[i + j] = (unsigned char)d4[j];                                  \
            }                                                                        \
            if (__builtin_expect(_mm256_testz_si256(_mm256_cmpgt_epi64(nbits, c56), _mm256_cmpgt_epi64(nbits, c56)), 1)) { \
                for (int j = 0; j < 4; j++)                                          \
                    put_bits(out, &len, &acc, &fill, v4[j], (unsigned)n4[j]);        \
            } else {                                                                 \
                uint64_t ge4[4], de4[4], gn4[4], dn4[4];                             \
                _mm256_storeu_si256((__m256i *)(void *)ge4, ge);                     \
                _mm256_storeu_si256((__m256i *)(void *)de4, de);                     \
                _mm256_storeu_si256((__m256i *)(void *)gn4, gnb);                    \
                _mm256_storeu_si256((__m256i *)(void *)dn4, dnb);                    \
                for (int j = 0; j < 4; j++) {                                        \
                    put_pieces(out, &len, &acc, &fill, ge4[j], (unsigned)gn4[j]);    \
                    put_pieces(out, &len, &acc, &fill, de4[j], (unsigned)dn4[j]);    \
                }                                                                    \
            }                                                                        \
        }                                                                            \
        return pass1_rest_##T(pos, b, w, i, k, gbin, dbin, out, len, acc, fill, out_len); \
    }

#define LOAD4_U16(p) _mm256_cvtepu16_epi64(_mm_loadl_epi64((const __m128i *)(const void *)(p)))
#define LOAD4_U32(p) _mm256_cvtepu32_epi64(_mm_loadu_si128((const __m128i *)(const void *)(p)))

PASS1_AVX2(uint16_t, 16, LOAD4_U16)
PASS1_AVX2(uint32_t, 32, LOAD4_U32)

static int have_avx2(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("bmi2");
    }
    return known;
}

static int have_avx512(void) {
    static int known = -1;
    if (known < 0) {
        __builtin_cpu_init();
        known = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw")
                && __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq")
                && __builtin_cpu_supports("avx512cd") && __builtin_cpu_supports("bmi2");
    }
    return known;
}
#endif

/* The paths the coder's passes may take: 0 scalar, 1 AVX2, 2 AVX-512 (widths 2 and 4; the
 * others are always scalar). Each call takes the best the CPU has, capped by its `path`
 * argument, so that tests run every path the CPU can. */
enum { PATH_SCALAR = 0, PATH_AVX2 = 1, PATH_AVX512 = 2 };

static int best_path(void) {
#ifdef HAVE_VECTOR_PASSES
    if (have_avx512())
        return PATH_AVX512;
    if (have_avx2())
        return PATH_AVX2;
#endif
    return PATH_SCALAR;
}

static int vector_path(int width, int cap) {
    if (width != 2 && width != 4)
        return PATH_SCALAR;
    int best = best_path();
    return best < cap ? best : cap;
}

/* The payload bound for k changes (what `out` must hold): the bit stream's length, at most
 * 122 extra bits per change (16 bytes) and its last partial word, the two tables, the stream
 * lengths and states, and at most one 16-bit word per symbol. */
static size_t encoded_bound(Py_ssize_t k) {
    return 8 + 16 * (size_t)k + 8 + 2 * (TABLE_BITMAP + 2 * NBINS) + 4 * (STREAMS - 1) + 4 * STREAMS
           + 4 * (size_t)k;
}

/* What encode's scratch must hold: 2k bytes of bins, then the streams built backwards, each
 * in a region of 2 (k / LANES + 4) bytes (its words, its state and a word of slack). */
static size_t scratch_bound(Py_ssize_t k) {
    return 2 * (size_t)k + STREAMS * 2 * ((size_t)k / LANES + 4);
}

/* payload = u64 B | bit stream (B bytes) | gap table | distance table | the byte lengths of
 * streams 0 .. STREAMS - 2 (u32 each) | the streams. scratch holds scratch_bound(k) bytes. */
ARCH_CLONES static int encode_record(const int64_t *pos, const unsigned char *b, const unsigned char *w,
                                     Py_ssize_t k, int width, unsigned char *out, size_t out_len,
                                     unsigned char *scratch, size_t *written, int path) {
    if (out_len < encoded_bound(k))
        return E_SPACE;
    unsigned char *gbin = scratch, *dbin = scratch + k;
    size_t blen = 0;
    int rc;
#ifdef HAVE_VECTOR_PASSES
    if (path == PATH_AVX512) {
        rc = width == 2 ? pass1_uint16_t_avx512(pos, b, w, k, gbin, dbin, out + 8, &blen)
                        : pass1_uint32_t_avx512(pos, b, w, k, gbin, dbin, out + 8, &blen);
    } else if (path == PATH_AVX2) {
        rc = width == 2 ? pass1_uint16_t_avx2(pos, b, w, k, gbin, dbin, out + 8, &blen)
                        : pass1_uint32_t_avx2(pos, b, w, k, gbin, dbin, out + 8, &blen);
    } else
#endif
    switch (width) {
    case 1: rc = pass1_uint8_t(pos, b, w, k, gbin, dbin, out + 8, &blen); break;
    case 2: rc = pass1_uint16_t(pos, b, w, k, gbin, dbin, out + 8, &blen); break;
    case 4: rc = pass1_uint32_t(pos, b, w, k, gbin, dbin, out + 8, &blen); break;
    default: rc = pass1_uint64_t(pos, b, w, k, gbin, dbin, out + 8, &blen); break;
    }
    if (rc != OK)
        return rc;
    uint64_t gcount[256] = {0}, dcount[256] = {0};
    histogram(gbin, k, gcount);
    histogram(dbin, k, dcount);
    uint64_t blen64 = blen;
    memcpy(out, &blen64, 8);
    size_t at = 8 + blen;

    uint32_t gfreq[256], dfreq[256];
    normalize(gcount, (uint64_t)k, gfreq);
    normalize(dcount, (uint64_t)k, dfreq);
    EncSymbol gsym[256], dsym[256];
    enc_symbols(gfreq, gsym);
    enc_symbols(dfreq, dsym);
    at += write_table(out + at, gfreq);
    at += write_table(out + at, dfreq);

    /* rANS, backwards, into 2 LANES streams: change i's gap bin goes to stream
     * 2 (i % LANES), its distance bin to stream 2 (i % LANES) + 1 (chains that never wait for
     * one another) */
    size_t region = 2 * ((size_t)k / LANES + 4); /* bytes: the symbols' words, the state, slack */
    uint16_t *ends[STREAMS], *ptrs[STREAMS];
    for (int j = 0; j < STREAMS; j++)
        ends[j] = ptrs[j] = (uint16_t *)(void *)(scratch + 2 * (size_t)k + (j + 1) * region);
    uint32_t x[STREAMS];
    for (int j = 0; j < STREAMS; j++)
        x[j] = RANS_L;
    Py_ssize_t i = k - 1;
    for (; i >= 0 && (i + 1) % LANES; i--) { /* the last, partial round */
        int j = 2 * (int)(i % LANES);
        rans_put(&x[j + 1], &ptrs[j + 1], &dsym[dbin[i]]);
        rans_put(&x[j], &ptrs[j], &gsym[gbin[i]]);
    }
    rans_rounds(x, ptrs, gsym, dsym, gbin, dbin, i);
    /* each stream: its state (u32, little-endian), then its words; the lengths of all but
     * the last first */
    size_t len[STREAMS];
    for (int j = 0; j < STREAMS; j++) {
        *--ptrs[j] = (uint16_t)(x[j] >> 16);
        *--ptrs[j] = (uint16_t)x[j];
        len[j] = (size_t)(ends[j] - ptrs[j]) * 2;
        if (len[j] > UINT32_MAX) /* a length field is 32 bits (a record of 2^31 changes or more) */
            return E_SPACE;
    }
    for (int j = 0; j < STREAMS - 1; j++) {
        uint32_t l = (uint32_t)len[j];
        memcpy(out + at, &l, 4);
        at += 4;
    }
    for (int j = 0; j < STREAMS; j++) {
        memcpy(out + at, ptrs[j], len[j]);
        at += len[j];
    }
    *written = at;
    return OK;
}

/* --- decode ------------------------------------------------------------------------------ */

enum {
    D_HEADER = 1,   /* the bit stream's length */
    D_GTABLE,       /* the gap table */
    D_DTABLE,       /* the distance table */
    D_STREAM,       /* the rANS stream's length or initial states */
    D_GAP,          /* a gap or position past the box */
    D_DISTANCE,     /* a distance that does not fit the word */
    D_STATES,       /* the final states, or words left in the rANS stream */
    D_BITS,         /* the bit stream's length or its padding */
};

/* cond ? a : b, as a conditional move: the compiler would branch, and whether a state needs
 * a word is a coin toss. */
static inline uint32_t select_u32(uint32_t cond, uint32_t a, uint32_t b) {
#if defined(__x86_64__) && defined(__GNUC__)
    __asm__("test %1, %1\n\tcmovnz %2, %0" : "+r"(b) : "r"(cond), "r"(a) : "cc");
    return b;
#else
    return cond ? a : b;
#endif
}

/* One symbol of stream J (decoding table T) into OUT: the state's slot gives the symbol and
 * the state moves on; a word is read without a branch and kept only if the state fell below
 * 2^16 (CHECKED, near the end: past the stream's end its last word is read again, which the
 * final check refuses). */
#define GET(J, T, OUT, CHECKED)                                                      \
    do {                                                                             \
        uint32_t x_ = x[J], e_ = (T)->slot[x_ & (SCALE - 1)];                         \
        unsigned s_ = e_ & 0xFF;                                                     \
        x_ = ((e_ >> 8 & 0xFFF) + 1) * (x_ >> SCALE_BITS) + (e_ >> 20);              \
        uint32_t in_ = x_ < RANS_L;                                                  \
        size_t at_ = (CHECKED) ? (r[J] < rw[J] ? r[J] : rw[J] - 1) : r[J];           \
        uint16_t w_;                                                                 \
        memcpy(&w_, rs[J] + 2 * at_, 2);                                             \
        x[J] = select_u32(in_, x_ << 16 | w_, x_);                                  \
        r[J] += in_;                                                                 \
        OUT = (unsigned char)s_;                                                     \
    } while (0)

/* The rANS streams being decoded: stream 2 (i % LANES) holds change i's gap bin, stream
 * 2 (i % LANES) + 1 its distance bin: chains, each with its own words, that never wait for
 * one another. */
typedef struct {
    uint32_t x[STREAMS];
    size_t r[STREAMS];            /* 16-bit words read */
    const unsigned char *rs[STREAMS];
    size_t rw[STREAMS];           /* 16-bit words in each */
} BinStreams;

static int bins_start(BinStreams *st) {
    for (int j = 0; j < STREAMS; j++) {
        memcpy(&st->x[j], st->rs[j], 4);
        if (st->x[j] < RANS_L)
            return D_STREAM;
        st->r[j] = 2; /* the state */
    }
    return OK;
}

/* Pass 1 over changes i0 .. i1 - 1 (i0 a multiple of LANES): their bins into gbin[0..],
 * dbin[0..]. */
ARCH_CLONES static void decode_bins(BinStreams *st, const DecodeTable *ga, const DecodeTable *da, Py_ssize_t i0,
                        Py_ssize_t i1, unsigned char *gbin, unsigned char *dbin) {
    uint32_t x[STREAMS];
    size_t r[STREAMS], rw[STREAMS];
    const unsigned char *rs[STREAMS];
    for (int j = 0; j < STREAMS; j++) {
        x[j] = st->x[j];
        r[j] = st->r[j];
        rw[j] = st->rw[j];
        rs[j] = st->rs[j];
    }
    Py_ssize_t i = i0;
    while (i + LANES <= i1) {
        /* a symbol takes at most one word: this many rounds need no check */
        size_t rounds = (size_t)(i1 - i) / LANES;
        for (int j = 0; j < STREAMS; j++)
            if (rw[j] - r[j] < rounds)
                rounds = rw[j] - r[j];
        if (rounds == 0)
            break;
        for (; rounds; rounds--, i += LANES) {
            for (int l = 0; l < LANES; l++) {
                GET(2 * l, ga, gbin[i - i0 + l], 0);
                GET(2 * l + 1, da, dbin[i - i0 + l], 0);
            }
        }
    }
    for (; i < i1; i++) {
        int j = 2 * (int)(i % LANES);
        GET(j, ga, gbin[i - i0], 1);
        GET(j + 1, da, dbin[i - i0], 1);
    }
    for (int j = 0; j < STREAMS; j++) {
        st->x[j] = x[j];
        st->r[j] = r[j];
    }
}

static int bins_finished(const BinStreams *st) {
    for (int j = 0; j < STREAMS; j++)
        if (st->x[j] != RANS_L || st->r[j] != st->rw[j])
            return D_STATES;
    return OK;
}

static inline uint64_t unchecked_le64(const unsigned char *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

/* The values being decoded: the bit stream's position, the last position, the errors. */
typedef struct {
    const unsigned char *bits;
    size_t blen;
    uint64_t bp;       /* bits read */
    uint64_t prev;     /* the last position (-1 before the first: it is its gap) */
    uint64_t bad;      /* BAD_GAP | BAD_DISTANCE, as seen so far */
} Values;

#define BAD_GAP 1
#define BAD_DISTANCE 2

/* Pass 2 over m changes whose bins pass 1 left in gbin, dbin: their extra bits, positions
 * and distances. Errors are collected and looked at after the last block: every write stays
 * inside the outputs whatever the payload holds. Few live values, so that the loop keeps
 * them all in registers. */
static inline __attribute__((always_inline)) void
decode_values(Values *v, const unsigned char *gbin, const unsigned char *dbin, Py_ssize_t n,
              Py_ssize_t m, int64_t *pos, unsigned char *dist, const int width) {
    const unsigned char *bits = v->bits;
    /* below this bit position an 8-byte load stays inside the stream */
    const uint64_t fast_end = v->blen >= 8 ? 8 * (v->blen - 8) : 0;
    uint64_t bp = v->bp, prev = v->prev, bad = v->bad;
    const uint64_t un = (uint64_t)n;
    for (Py_ssize_t i = 0; i < m; i++) {
        const Bin g = bins[gbin[i]], d = bins[dbin[i]];
        uint64_t ge, de;
        if (__builtin_expect(g.nb + d.nb <= 56 && bp < fast_end, 1)) {
            uint64_t both = unchecked_le64(bits + (bp >> 3)) >> (bp & 7);
            ge = both & ((1ULL << g.nb) - 1);
            de = (both >> g.nb) & ((1ULL << d.nb) - 1);
            bp += g.nb + d.nb;
        } else {
            BitReader br = {bits, v->blen, bp};
            ge = get_bits(&br, (unsigned)g.nb);
            de = get_bits(&br, (unsigned)d.nb);
            bp = br.pos;
        }
        uint64_t gap = g.base + ge;
        /* the first gap >= n or position >= n is seen where it happens (a sum that wraps
         * after it changes nothing: the error stays) */
        uint64_t p = prev + 1 + gap;
        bad |= (gap >= un) | (p >= un);
        pos[i] = (int64_t)p;
        prev = p;
        uint64_t zz = d.base + de + 1; /* the zigzagged distance, 1 .. 2^W - 1 */
        uint64_t dv = (zz >> 1) ^ (0 - (zz & 1));
        switch (width) {
        case 1: bad |= (uint64_t)((zz >> 8) != 0) << 1; ((uint8_t *)dist)[i] = (uint8_t)dv; break;
        case 2: bad |= (uint64_t)((zz >> 16) != 0) << 1; ((uint16_t *)dist)[i] = (uint16_t)dv; break;
        case 4: bad |= (uint64_t)((zz >> 32) != 0) << 1; ((uint32_t *)dist)[i] = (uint32_t)dv; break;
        default: bad |= (uint64_t)(zz == 0) << 1; ((uint64_t *)dist)[i] = dv; break;
        }
    }
    v->bp = bp;
    v->prev = prev;
    v->bad = bad;
}

#ifdef HAVE_VECTOR_PASSES
/* Prefix sums of 8 lanes (lane j: the sum of lanes 0..j), in three shifted adds. */
AVX512_TARGET static inline __m512i scan8(__m512i x) {
    const __m512i zero = _mm512_setzero_si512();
    x = _mm512_add_epi64(x, _mm512_alignr_epi64(x, zero, 7));
    x = _mm512_add_epi64(x, _mm512_alignr_epi64(x, zero, 6));
    return _mm512_add_epi64(x, _mm512_alignr_epi64(x, zero, 4));
}

AVX512_TARGET static inline uint64_t lane7(__m512i x) {
    return (uint64_t)_mm_extract_epi64(_mm512_extracti64x2_epi64(x, 3), 1);
}

/* Pass 2 with AVX-512, 8 changes at a time: bins to bit counts and bases, the bit offsets and
 * the positions by prefix sums, the extra bits by one gather of 8 words. A block whose bits
 * may reach past the fast region of the stream, or with a change of more than 56 extra bits,
 * takes the scalar pass. */
#define VALUES_AVX512(WIDTH, STORE, OVER)                                            \
    AVX512_TARGET static void decode_values_w##WIDTH##_avx512(Values *v, const unsigned char *gbin, \
                                                              const unsigned char *dbin, Py_ssize_t n, \
                                                              Py_ssize_t m, int64_t *pos, \
                                                              unsigned char *dist) {  \
        const __m512i zero = _mm512_setzero_si512(), one = _mm512_set1_epi64(1);     \
        const __m512i c3 = _mm512_set1_epi64(3), c4 = _mm512_set1_epi64(4), c7 = _mm512_set1_epi64(7); \
        const __m512i vn = _mm512_set1_epi64(n);                                     \
        const uint64_t fast_end = v->blen >= 8 ? 8 * (v->blen - 8) : 0;              \
        Py_ssize_t i = 0;                                                            \
        __mmask8 bad_gap = 0, bad_dist = 0;                                          \
        for (; i + 8 <= m; i += 8) {                                                 \
            __m512i gb = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(const void *)(gbin + i))); \
            __m512i db = _mm512_cvtepu8_epi64(_mm_loadl_epi64((const __m128i *)(const void *)(dbin + i))); \
            __m512i gnb = _mm512_max_epi64(_mm512_srai_epi64(_mm512_sub_epi64(gb, c4), 2), zero); \
            __m512i dnb = _mm512_max_epi64(_mm512_srai_epi64(_mm512_sub_epi64(db, c4), 2), zero); \
            __m512i t = _mm512_add_epi64(gnb, dnb);                                  \
            if (v->bp + 8 * 122 >= fast_end || _mm512_cmpgt_epu64_mask(t, _mm512_set1_epi64(56))) { \
                decode_values(v, gbin + i, dbin + i, n, 8, pos + i, dist + (WIDTH) * i, (WIDTH)); \
                continue;                                                            \
            }                                                                        \
            __m512i gbase = _mm512_mask_blend_epi64(_mm512_cmplt_epu64_mask(gb, c4), \
                _mm512_sllv_epi64(_mm512_add_epi64(c4, _mm512_and_si512(_mm512_sub_epi64(gb, c4), c3)), gnb), gb); \
            __m512i dbase = _mm512_mask_blend_epi64(_mm512_cmplt_epu64_mask(db, c4), \
                _mm512_sllv_epi64(_mm512_add_epi64(c4, _mm512_and_si512(_mm512_sub_epi64(db, c4), c3)), dnb), db); \
            __m512i incl = scan8(t);                                                 \
            __m512i off = _mm512_add_epi64(_mm512_set1_epi64((int64_t)v->bp), _mm512_sub_epi64(incl, t)); \
            __m512i words = _mm512_i64gather_epi64(_mm512_srli_epi64(off, 3), (const void *)v->bits, 1); \
            __m512i both = _mm512_srlv_epi64(words, _mm512_and_si512(off, c7));      \
            __m512i ge = _mm512_and_si512(both, _mm512_sub_epi64(_mm512_sllv_epi64(one, gnb), one)); \
            __m512i de = _mm512_and_si512(_mm512_srlv_epi64(both, gnb), _mm512_sub_epi64(_mm512_sllv_epi64(one, dnb), one)); \
            v->bp += lane7(incl);                                                    \
            __m512i gap = _mm512_add_epi64(gbase, ge);                               \
            __m512i p = _mm512_add_epi64(_mm512_set1_epi64((int64_t)v->prev), scan8(_mm512_add_epi64(gap, one))); \
            bad_gap |= _mm512_cmpge_epu64_mask(gap, vn) | _mm512_cmpge_epu64_mask(p, vn); \
            _mm512_storeu_si512((void *)(pos + i), p);                               \
            v->prev = lane7(p);                                                      \
            __m512i zz = _mm512_add_epi64(_mm512_add_epi64(dbase, de), one);         \
            bad_dist |= OVER;                                                        \
            __m512i d = _mm512_xor_si512(_mm512_srli_epi64(zz, 1), _mm512_sub_epi64(zero, _mm512_and_si512(zz, one))); \
            STORE;                                                                   \
        }                                                                            \
        v->bad |= (bad_gap ? BAD_GAP : 0) | (bad_dist ? BAD_DISTANCE : 0);           \
        if (i < m)                                                                   \
            decode_values(v, gbin + i, dbin + i, n, m - i, pos + i, dist + (WIDTH) * i, (WIDTH)); \
    }

VALUES_AVX512(2, _mm_storeu_si128((__m128i *)(void *)(dist + 2 * i), _mm512_cvtepi64_epi16(d)),
              _mm512_test_epi64_mask(zz, _mm512_set1_epi64(~0xFFFFLL)))
VALUES_AVX512(4, _mm256_storeu_si256((__m256i *)(void *)(dist + 4 * i), _mm512_cvtepi64_epi32(d)),
              _mm512_test_epi64_mask(zz, _mm512_set1_epi64(~0xFFFFFFFFLL)))
#endif

#ifdef HAVE_VECTOR_PASSES
/* Pass 2 with AVX2, 4 changes at a time: the AVX-512 pass's steps (one gather of 4 words for
 * the extra bits, prefix sums for the bit offsets and positions), its unsigned compares made
 * signed by flipping the sign bits. The same blocks take the scalar pass. */
#define VALUES_AVX2(WIDTH, STORE, OVER)                                              \
    AVX2_TARGET static void decode_values_w##WIDTH##_avx2(Values *v, const unsigned char *gbin, \
                                                          const unsigned char *dbin, Py_ssize_t n, \
                                                          Py_ssize_t m, int64_t *pos, \
                                                          unsigned char *dist) {      \
        const __m256i zero = _mm256_setzero_si256(), one = _mm256_set1_epi64x(1);   \
        const __m256i c3 = _mm256_set1_epi64x(3), c4 = _mm256_set1_epi64x(4), c7 = _mm256_set1_epi64x(7); \
        const __m256i c56 = _mm256_set1_epi64x(56), sign = _mm256_set1_epi64x(INT64_MIN); \
        const __m256i vn = _mm256_xor_si256(_mm256_set1_epi64x(n), sign);            \
        const __m128i four = _mm_set1_epi8(4);                                       \
        const uint64_t fast_end = v->blen >= 8 ? 8 * (v->blen - 8) : 0;              \
        Py_ssize_t i = 0;                                                            \
        __m256i bad_gap = zero, bad_dist = zero;                                     \
        for (; i + 4 <= m; i += 4) {                                                 \
            uint32_t g4, d4;                                                         \
            memcpy(&g4, gbin + i, 4);                                                \
            memcpy(&d4, dbin + i, 4);                                                \
            __m128i g8 = _mm_cvtsi32_si128((int)g4), d8 = _mm_cvtsi32_si128((int)d4); \
            __m256i gb = _mm256_cvtepu8_epi64(g8), db = _mm256_cvtepu8_epi64(d8);    \
            __m256i gs = _mm256_cvtepu8_epi64(_mm_subs_epu8(g8, four));             \
            __m256i ds = _mm256_cvtepu8_epi64(_mm_subs_epu8(d8, four));             \
            __m256i gnb = _mm256_srli_epi64(gs, 2), dnb = _mm256_srli_epi64(ds, 2);  \
            __m256i t = _mm256_add_epi64(gnb, dnb);                                  \
            if (v->bp + 8 * 122 >= fast_end || !_mm256_testz_si256(_mm256_cmpgt_epi64(t, c56), _mm256_cmpgt_epi64(t, c56))) { \
                decode_values(v, gbin + i, dbin + i, n, 4, pos + i, dist + (WIDTH) * i, (WIDTH)); \
                continue;                                                            \
            }                                                                        \
            __m256i gbase = _mm256_blendv_epi8(                                      \
                _mm256_sllv_epi64(_mm256_add_epi64(c4, _mm256_and_si256(gs, c3)), gnb), gb, _mm256_cmpgt_epi64(c4, gb)); \
            __m256i dbase = _mm256_blendv_epi8(                                      \
                _mm256_sllv_epi64(_mm256_add_epi64(c4, _mm256_and_si256(ds, c3)), dnb), db, _mm256_cmpgt_epi64(c4, db)); \
            __m256i incl = scan4(t);                                                 \
            __m256i off = _mm256_add_epi64(_mm256_set1_epi64x((int64_t)v->bp), _mm256_sub_epi64(incl, t)); \
            __m256i words = _mm256_i64gather_epi64((const long long *)(const void *)v->bits, _mm256_srli_epi64(off, 3), 1); \
            __m256i both = _mm256_srlv_epi64(words, _mm256_and_si256(off, c7));      \
            __m256i ge = _mm256_and_si256(both, _mm256_sub_epi64(_mm256_sllv_epi64(one, gnb), one)); \
            __m256i de = _mm256_and_si256(_mm256_srlv_epi64(both, gnb), _mm256_sub_epi64(_mm256_sllv_epi64(one, dnb), one)); \
            v->bp += (uint64_t)_mm256_extract_epi64(incl, 3);                        \
            __m256i gap = _mm256_add_epi64(gbase, ge);                               \
            __m256i p = _mm256_add_epi64(_mm256_set1_epi64x((int64_t)v->prev), scan4(_mm256_add_epi64(gap, one))); \
            /* gap >= n or p >= n, unsigned: not (n > x) with the sign bits flipped */ \
            bad_gap = _mm256_or_si256(bad_gap, _mm256_andnot_si256(                  \
                _mm256_and_si256(_mm256_cmpgt_epi64(vn, _mm256_xor_si256(gap, sign)), \
                                 _mm256_cmpgt_epi64(vn, _mm256_xor_si256(p, sign))), _mm256_cmpeq_epi64(zero, zero))); \
            _mm256_storeu_si256((__m256i *)(void *)(pos + i), p);                    \
            v->prev = (uint64_t)_mm256_extract_epi64(p, 3);                          \
            __m256i zz = _mm256_add_epi64(_mm256_add_epi64(dbase, de), one);         \
            bad_dist = _mm256_or_si256(bad_dist, OVER);                              \
            __m256i d = _mm256_xor_si256(_mm256_srli_epi64(zz, 1), _mm256_sub_epi64(zero, _mm256_and_si256(zz, one))); \
            STORE;                                                                   \
        }                                                                            \
        v->bad |= (_mm256_testz_si256(bad_gap, bad_gap) ? 0 : BAD_GAP)               \
                  | (_mm256_testz_si256(bad_dist, bad_dist) ? 0 : BAD_DISTANCE);     \
        if (i < m)                                                                   \
            decode_values(v, gbin + i, dbin + i, n, m - i, pos + i, dist + (WIDTH) * i, (WIDTH)); \
    }

/* The low 16 or 32 bits of each 64-bit lane, side by side in the low 8 or 16 bytes. */
AVX2_TARGET static inline __m128i low16x4(__m256i d) {
    const __m256i pick = _mm256_setr_epi8(0, 1, 8, 9, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1,
                                          0, 1, 8, 9, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1, -1);
    __m256i s = _mm256_shuffle_epi8(d, pick);
    return _mm_unpacklo_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
}

AVX2_TARGET static inline __m128i low32x4(__m256i d) {
    return _mm256_castsi256_si128(_mm256_permutevar8x32_epi32(d, _mm256_setr_epi32(0, 2, 4, 6, 0, 2, 4, 6)));
}

VALUES_AVX2(2, _mm_storel_epi64((__m128i *)(void *)(dist + 2 * i), low16x4(d)),
            _mm256_and_si256(zz, _mm256_set1_epi64x(~0xFFFFLL)))
VALUES_AVX2(4, _mm_storeu_si128((__m128i *)(void *)(dist + 4 * i), low32x4(d)),
            _mm256_and_si256(zz, _mm256_set1_epi64x(~0xFFFFFFFFLL)))
#endif

/* Both passes, a block of changes at a time: the block's bins stay in the L1 cache. */
#define BLOCK 4096

static inline __attribute__((always_inline)) int
decode_blocks(BinStreams *st, const DecodeTable *ga, const DecodeTable *da, Values *v, Py_ssize_t n,
              Py_ssize_t k, int64_t *pos, unsigned char *dist, const int width, int path, int64_t origin) {
    unsigned char gbin[BLOCK], dbin[BLOCK];
    for (Py_ssize_t i = 0; i < k; i += BLOCK) {
        Py_ssize_t m = k - i < BLOCK ? k - i : BLOCK;
        decode_bins(st, ga, da, i, i + m, gbin, dbin);
        unsigned char *d = dist + (size_t)width * (size_t)i;
#ifdef HAVE_VECTOR_PASSES
        if (path == PATH_AVX512) {
            if (width == 2)
                decode_values_w2_avx512(v, gbin, dbin, n, m, pos + i, d);
            else
                decode_values_w4_avx512(v, gbin, dbin, n, m, pos + i, d);
            goto placed;
        }
        if (path == PATH_AVX2) {
            if (width == 2)
                decode_values_w2_avx2(v, gbin, dbin, n, m, pos + i, d);
            else
                decode_values_w4_avx2(v, gbin, dbin, n, m, pos + i, d);
            goto placed;
        }
#endif
        decode_values(v, gbin, dbin, n, m, pos + i, d, width);
    placed:
        /* a row block's flat start added while the block's positions are in the L1 cache:
         * the tensor's flat positions without a second array and pass over them */
        if (origin)
            for (Py_ssize_t j = i; j < i + m; j++)
                pos[j] += origin;
    }
    if (v->bad & BAD_GAP)
        return D_GAP;
    if (v->bad & BAD_DISTANCE)
        return D_DISTANCE;
    return bins_finished(st);
}

ARCH_CLONES static int decode_record(const unsigned char *in, size_t len, Py_ssize_t n, Py_ssize_t k,
                                     int width, int64_t *pos, unsigned char *dist, int path, int64_t origin) {
    if (len < 8)
        return D_HEADER;
    uint64_t blen;
    memcpy(&blen, in, 8);
    if (blen > len - 8)
        return D_HEADER;
    size_t at = 8 + (size_t)blen;
    DecodeTable *tables = PyMem_RawMalloc(2 * sizeof(DecodeTable));
    if (!tables)
        return -1;
    int rc = OK;
    Py_ssize_t used = read_table(in + at, len - at, &tables[0]);
    if (used < 0) {
        rc = D_GTABLE;
        goto done;
    }
    at += (size_t)used;
    used = read_table(in + at, len - at, &tables[1]);
    if (used < 0) {
        rc = D_DTABLE;
        goto done;
    }
    at += (size_t)used;
    /* the lengths of every stream but the last, then the streams; the last is the rest */
    if (len - at < 4 * (STREAMS - 1)) {
        rc = D_STREAM;
        goto done;
    }
    size_t slen[STREAMS], rest = len - at - 4 * (STREAMS - 1);
    BinStreams st;
    for (int j = 0; j < STREAMS - 1; j++) {
        uint32_t l;
        memcpy(&l, in + at + 4 * j, 4);
        slen[j] = l;
    }
    at += 4 * (STREAMS - 1);
    for (int j = 0; j < STREAMS; j++) {
        if (j == STREAMS - 1)
            slen[j] = rest;
        if (slen[j] > rest || slen[j] < 4 || slen[j] % 2) {
            rc = D_STREAM;
            goto done;
        }
        st.rs[j] = in + at;
        st.rw[j] = slen[j] / 2;
        at += slen[j];
        rest -= slen[j];
    }
    rc = bins_start(&st);
    if (rc != OK)
        goto done;
    Values v = {in + 8, (size_t)blen, 0, ~0ULL, 0};
    switch (width) {
    case 1: rc = decode_blocks(&st, &tables[0], &tables[1], &v, n, k, pos, dist, 1, path, origin); break;
    case 2: rc = decode_blocks(&st, &tables[0], &tables[1], &v, n, k, pos, dist, 2, path, origin); break;
    case 4: rc = decode_blocks(&st, &tables[0], &tables[1], &v, n, k, pos, dist, 4, path, origin); break;
    default: rc = decode_blocks(&st, &tables[0], &tables[1], &v, n, k, pos, dist, 8, path, origin); break;
    }
    /* every bit read, the stream exactly as long as they need, its padding zero */
    uint64_t used_bits = v.bp;
    if (rc == OK && ((used_bits + 7) / 8 != blen || (used_bits % 8 && in[8 + blen - 1] >> (used_bits % 8))))
        rc = D_BITS;
done:
    PyMem_RawFree(tables);
    return rc;
}

/* --- Python ------------------------------------------------------------------------------ */

static int check_width(int width) {
    if (width != 1 && width != 2 && width != 4 && width != 8) {
        PyErr_SetString(PyExc_ValueError, "word width must be 1, 2, 4 or 8");
        return 0;
    }
    return 1;
}

/* The one argument of bound and scratch: a count of changes, k >= 0 (-1 on error). */
static Py_ssize_t parse_count(PyObject *args) {
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "n", &k))
        return -1;
    if (k < 0) {
        PyErr_SetString(PyExc_ValueError, "k must be >= 0");
        return -1;
    }
    return k;
}

/* bound(k) -> the bytes `out` of encode must hold for k changes */
static PyObject *py_bound(PyObject *self, PyObject *args) {
    Py_ssize_t k = parse_count(args);
    return k < 0 ? NULL : PyLong_FromSize_t(encoded_bound(k));
}

/* scratch(k) -> the bytes `scratch` of encode must hold for k changes */
static PyObject *py_scratch(PyObject *self, PyObject *args) {
    Py_ssize_t k = parse_count(args);
    return k < 0 ? NULL : PyLong_FromSize_t(scratch_bound(k));
}

/* encode(positions, base, new, width, out, scratch[, path]) -> payload length, written into
 * out. positions int64 strictly increasing and >= 0; base and new the words there (each
 * position changed); out holds bound(k) bytes, scratch scratch(k) bytes (aligned to 2).
 * `path` (CODER_PATHS) caps the vector path taken; the payload is the same on every path. */
static PyObject *py_encode(PyObject *self, PyObject *args) {
    Py_buffer pos, b, w, out, scratch;
    int width, path = PATH_AVX512;
    if (!PyArg_ParseTuple(args, "y*y*y*iw*w*|i", &pos, &b, &w, &width, &out, &scratch, &path))
        return NULL;
    PyObject *result = NULL;
    Py_ssize_t k = pos.len / 8;
    if (!check_width(width)) {
    } else if (path < PATH_SCALAR) {
        PyErr_SetString(PyExc_ValueError, "path must be >= 0");
    } else if (pos.len % 8 || k < 1 || b.len != k * width || w.len != k * width
               || (uintptr_t)pos.buf % 8) {
        PyErr_SetString(PyExc_ValueError, "positions and words do not match (k >= 1)");
    } else if ((size_t)scratch.len < scratch_bound(k) || (uintptr_t)scratch.buf % 2) {
        PyErr_SetString(PyExc_ValueError, "scratch must hold scratch(k) bytes");
    } else if ((size_t)out.len < encoded_bound(k)) {
        PyErr_SetString(PyExc_ValueError, "out must hold bound(k) bytes");
    } else {
        size_t written = 0;
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = encode_record(pos.buf, b.buf, w.buf, k, width, out.buf, (size_t)out.len, scratch.buf, &written,
                           vector_path(width, path));
        Py_END_ALLOW_THREADS
        if (rc == E_ORDER)
            PyErr_SetString(PyExc_ValueError, "positions must be increasing and >= 0");
        else if (rc == E_UNCHANGED)
            PyErr_SetString(PyExc_ValueError, "a position whose base and new words are equal");
        else if (rc != OK)
            PyErr_SetString(PyExc_ValueError, "out is too small, or a stream longer than 2^32 - 1 bytes");
        else
            result = PyLong_FromSize_t(written);
    }
    PyBuffer_Release(&pos);
    PyBuffer_Release(&b);
    PyBuffer_Release(&w);
    PyBuffer_Release(&out);
    PyBuffer_Release(&scratch);
    return result;
}

/* decode(payload, n, k, width, positions_out, distances_out[, path], *, origin=0) -> 0, or an
 * error code > 0 (which part of the payload is wrong; the caller names it). positions_out
 * int64[k], distances_out k words of `width` bytes. `path` as for encode: every path reads
 * the same values and refuses the same payloads. `origin` is added to every position written
 * (the payload's positions are still checked against n before it is added). */
static PyObject *py_decode(PyObject *self, PyObject *args, PyObject *kwargs) {
    static char *kwlist[] = {"", "", "", "", "", "", "path", "origin", NULL};
    Py_buffer in, pos, dist;
    Py_ssize_t n, k;
    int width, path = PATH_AVX512;
    long long origin = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*nniw*w*|i$L", kwlist, &in, &n, &k, &width, &pos, &dist,
                                     &path, &origin))
        return NULL;
    PyObject *result = NULL;
    if (!check_width(width)) {
    } else if (path < PATH_SCALAR) {
        PyErr_SetString(PyExc_ValueError, "path must be >= 0");
    } else if (k < 1 || n < k || pos.len != 8 * k || dist.len != k * width
               || (uintptr_t)pos.buf % 8 || (uintptr_t)dist.buf % width) {
        PyErr_SetString(PyExc_ValueError, "outputs must hold k entries (1 <= k <= n)");
    } else if (origin < 0 || origin > INT64_MAX - (long long)n) {
        PyErr_SetString(PyExc_ValueError, "origin must be >= 0, and origin + n fit in 64 bits");
    } else {
        int rc;
        Py_BEGIN_ALLOW_THREADS
        rc = decode_record(in.buf, (size_t)in.len, n, k, width, pos.buf, dist.buf, vector_path(width, path),
                           (int64_t)origin);
        Py_END_ALLOW_THREADS
        if (rc < 0)
            PyErr_NoMemory();
        else
            result = PyLong_FromLong(rc);
    }
    PyBuffer_Release(&in);
    PyBuffer_Release(&pos);
    PyBuffer_Release(&dist);
    return result;
}

static PyMethodDef methods[] = {
    {"bound", py_bound, METH_VARARGS, "the payload bound for k changes"},
    {"scratch", py_scratch, METH_VARARGS, "the scratch bytes encode needs for k changes"},
    {"encode", py_encode, METH_VARARGS, "a record's changes as an ulp-rans payload"},
    {"decode", (PyCFunction)(void (*)(void))py_decode, METH_VARARGS | METH_KEYWORDS,
     "an ulp-rans payload's positions and distances"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_rans", NULL, -1, methods};

PyMODINIT_FUNC PyInit__rans(void) {
    init_bins();
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    /* CODER_PATHS: the paths this CPU can take, 0 (scalar) up to its best */
    PyObject *paths = PyTuple_New(best_path() + 1);
    if (paths != NULL)
        for (int p = 0; p <= best_path(); p++)
            PyTuple_SET_ITEM(paths, p, PyLong_FromLong(p));
    if (paths == NULL || PyModule_AddObject(m, "CODER_PATHS", paths) < 0) {
        Py_XDECREF(paths);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
