/* Sum digests (spec/FORMAT.md section 7.1) over raw word buffers: the element hash
 * e(f, w) = mix64(((f + 1) * G) XOR w), summed mod 2^64. numpy needs eleven passes over a
 * buffer for what is one loop here; the GIL is released, so threads hash in parallel.
 * dcr_log/digest.py holds the reference (and a numpy fallback when this is not built). */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

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

static uint64_t sum_run(const unsigned char *p, Py_ssize_t n, int width, uint64_t start) {
    switch (width) {
    case 1: return sum_run_uint8_t(p, n, start);
    case 2: return sum_run_uint16_t(p, n, start);
    case 4: return sum_run_uint32_t(p, n, start);
    default: return sum_run_uint64_t(p, n, start);
    }
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

/* sum_range(words, width, start) */
static PyObject *py_sum_range(PyObject *self, PyObject *args) {
    Py_buffer words;
    int width;
    unsigned long long start;
    if (!PyArg_ParseTuple(args, "y*iK", &words, &width, &start))
        return NULL;
    if (!check_width(width) || words.len % width) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "buffer is not a whole number of words");
        PyBuffer_Release(&words);
        return NULL;
    }
    uint64_t s;
    Py_BEGIN_ALLOW_THREADS
    s = sum_run(words.buf, words.len / width, width, start);
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
    Py_BEGIN_ALLOW_THREADS
    const unsigned char *w = words.buf;
    for (Py_ssize_t r = 0; r < nruns; r++) {
        int64_t first;
        memcpy(&first, (const unsigned char *)starts.buf + 8 * r, 8);
        s += sum_run(w + (size_t)r * run * width, run, width, (uint64_t)first);
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

static PyMethodDef methods[] = {
    {"sum_range", py_sum_range, METH_VARARGS, "sum of e(start + j, words[j])"},
    {"sum_runs", py_sum_runs, METH_VARARGS, "sum of e over runs of contiguous flat indices"},
    {"sum_at", py_sum_at, METH_VARARGS, "sum of e(flat[i], words[i])"},
    {"sum_pair", py_sum_pair, METH_VARARGS, "sums of e(positions[i] + offset, .) over base and new words"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_digest", NULL, -1, methods};

PyMODINIT_FUNC PyInit__digest(void) { return PyModule_Create(&module); }
