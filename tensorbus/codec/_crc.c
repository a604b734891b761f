/* CRC32C (Castagnoli) with the crc32c package's answers, faster where the CPU has AVX2 and
 * VPCLMULQDQ (docs/PERFORMANCE.md has the measurements).
 *
 * Why: every frame is checksummed on both ends, and at 16 MB on two cores that pass was most of
 * what separated tcp:// from a bare socket.
 *
 * How: the crc32 instruction the package uses tops out at 8 bytes per cycle, and so, on Zen 3,
 * does 256-bit carry-less multiplication. They run on different units, so each 64 KiB block
 * is split in two halves, read by one loop:
 * - Folding reads the first half, 128 bytes at a time, into eight 128-bit lanes. Each step
 *   multiplies every lane by x^1024 mod P (its halves times x^1088 and x^1024 mod P) and adds the
 *   next 128 bytes. The lanes stay a 128-byte message with the CRC of all that was read, which
 *   the crc32 instruction then finishes: no Barrett reduction.
 * - Four crc32 streams read the second half.
 * - Each stream's CRC is then joined on: the register times x^(8 * STREAM) mod P.
 * The constants carry one power of x fewer (x^1087, x^1023, ...), because a carry-less product
 * of bit-reflected values lands one bit low.
 *
 * crc32c_copy copies the bytes it reads (the reassembler's check of a chunk and its copy into place in
 * one pass), and combine is crc.py's CRC combining in C (a 256 MB version over Kafka takes ~540).
 *
 * tests/unit/test_crc_folding.py checks every boundary against the package. Without those
 * instructions (or off x86-64), ACCELERATED is False and tensorbus uses the package.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && (defined(__GNUC__) || defined(__clang__))
#define HAVE_FOLD 1
#include <cpuid.h>
#include <immintrin.h>
#else
#define HAVE_FOLD 0
#endif

#define FOLD_FROM 256            /* shorter: the crc32 instruction alone is as fast (and folding needs 128) */
#define RELEASE_GIL_FROM 32768   /* the crc32c package's choice too */

#if HAVE_FOLD
#define TARGET __attribute__((target("sse4.2,avx2,pclmul,vpclmulqdq")))

#define POLY 0x82F63B78u         /* P, bit-reflected */
#define BLOCK 65536              /* crc_block's bytes: half folded, half in four crc32 streams */
#define STREAM (BLOCK / 2 / 4)   /* one of those streams */
_Static_assert(FOLD_FROM >= 128 && FOLD_FROM <= BLOCK, "crc_lanes reads 128 bytes before it looks at n");

/* set once, at import (x_to_the): the fold's x^1087 and x^1023 modulo P, bit-reflected in the upper
 * half of a 64-bit word (the low, then the high half of a lane is multiplied by them), and the
 * join's x^(8 * STREAM - 33) */
static uint64_t g_fold_lo, g_fold_hi;
static uint32_t g_skip;

static inline uint64_t
load64(const uint8_t *p)
{
    uint64_t word;
    memcpy(&word, p, 8);
    return word;
}

/* the CRC register after `n` more bytes, by the crc32 instruction alone */
TARGET static uint32_t
crc_bytes(uint32_t state, const uint8_t *p, size_t n)
{
    for (; n >= 8; p += 8, n -= 8) {
        state = (uint32_t)_mm_crc32_u64(state, load64(p));
    }
    for (; n; p++, n--) {
        state = _mm_crc32_u8(state, *p);
    }
    return state;
}

/* the lanes of one ymm register times x^1024 mod P, plus the next 32 bytes */
TARGET static inline __m256i
fold(__m256i lanes, __m256i k, const uint8_t *next)
{
    __m256i lo = _mm256_clmulepi64_epi128(lanes, k, 0x00), hi = _mm256_clmulepi64_epi128(lanes, k, 0x11);
    return _mm256_xor_si256(_mm256_xor_si256(lo, hi), _mm256_loadu_si256((const __m256i *)next));
}

/* eight 128-bit lanes: 128 bytes of message with the CRC of everything folded into them */
typedef struct {
    __m256i x0, x1, x2, x3;
} Lanes;

/* the first 128 bytes, with the CRC register so far added to the first four */
TARGET static inline Lanes
lanes_start(uint32_t state, const uint8_t *p)
{
    Lanes l = {_mm256_loadu_si256((const __m256i *)p), _mm256_loadu_si256((const __m256i *)(p + 32)),
               _mm256_loadu_si256((const __m256i *)(p + 64)), _mm256_loadu_si256((const __m256i *)(p + 96))};
    l.x0 = _mm256_xor_si256(l.x0, _mm256_set_epi32(0, 0, 0, 0, 0, 0, 0, (int)state));
    return l;
}

/* the lanes moved on past the next 128 bytes, which are added in */
TARGET static inline void
lanes_fold(Lanes *l, __m256i k, const uint8_t *p)
{
    l->x0 = fold(l->x0, k, p);
    l->x1 = fold(l->x1, k, p + 32);
    l->x2 = fold(l->x2, k, p + 64);
    l->x3 = fold(l->x3, k, p + 96);
}

/* the CRC register of the lanes' 128 bytes, from zero */
TARGET static inline uint32_t
lanes_crc(const Lanes *l)
{
    uint8_t bytes[128];
    _mm256_storeu_si256((__m256i *)bytes, l->x0);
    _mm256_storeu_si256((__m256i *)(bytes + 32), l->x1);
    _mm256_storeu_si256((__m256i *)(bytes + 64), l->x2);
    _mm256_storeu_si256((__m256i *)(bytes + 96), l->x3);
    return crc_bytes(0, bytes, sizeof bytes);
}

#define FOLD_CONSTANTS \
    _mm256_set_epi64x((long long)g_fold_hi, (long long)g_fold_lo, (long long)g_fold_hi, (long long)g_fold_lo)

/* the CRC register after 128 bytes or more, by folding alone */
TARGET static uint32_t
crc_lanes(uint32_t state, const uint8_t *p, size_t n)
{
    const __m256i k = FOLD_CONSTANTS;
    Lanes l = lanes_start(state, p);
    for (p += 128, n -= 128; n >= 128; p += 128, n -= 128) {
        lanes_fold(&l, k, p);
    }
    return crc_bytes(lanes_crc(&l), p, n);
}

/* r * x^(8 * STREAM) modulo P, for a CRC register r: the product with x^(8 * STREAM - 33), whose
 * 63 bits the crc32 instruction reduces (it multiplies by x^32, and the product sits one bit low) */
TARGET static inline uint32_t
skip_stream(uint32_t r)
{
    __m128i product = _mm_clmulepi64_si128(_mm_cvtsi32_si128((int)r), _mm_cvtsi32_si128((int)g_skip), 0x00);
    return (uint32_t)_mm_crc32_u64(0, (uint64_t)_mm_cvtsi128_si64(product));
}

/* the crc32 instruction's register after 32 more bytes */
TARGET static inline uint64_t
crc_next32(uint64_t state, const uint8_t *p)
{
    state = _mm_crc32_u64(state, load64(p));
    state = _mm_crc32_u64(state, load64(p + 8));
    state = _mm_crc32_u64(state, load64(p + 16));
    return _mm_crc32_u64(state, load64(p + 24));
}

/* The CRC register after one BLOCK: its first half folded while the crc32 instruction reads its
 * second half as four streams, in the same loop (the two run on different units; each alone does
 * about 8 bytes per cycle here). The streams' CRCs are joined on with skip_stream. */
TARGET static uint32_t
crc_block(uint32_t state, const uint8_t *p)
{
    const __m256i k = FOLD_CONSTANTS;
    const uint8_t *c = p + BLOCK / 2;
    Lanes l = lanes_start(state, p);
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i < STREAM / 32; i++) {
        if (i) {  /* (lanes_start took the first 128 bytes) */
            lanes_fold(&l, k, p + 128 * i);
        }
        const uint8_t *o = c + 32 * i;
        s0 = crc_next32(s0, o);
        s1 = crc_next32(s1, o + STREAM);
        s2 = crc_next32(s2, o + 2 * STREAM);
        s3 = crc_next32(s3, o + 3 * STREAM);
    }
    uint32_t r = lanes_crc(&l);
    r = skip_stream(r) ^ (uint32_t)s0;
    r = skip_stream(r) ^ (uint32_t)s1;
    r = skip_stream(r) ^ (uint32_t)s2;
    return skip_stream(r) ^ (uint32_t)s3;
}

/* the CRC register (inverted CRC) after `n` more bytes */
TARGET static uint32_t
crc_fold(uint32_t state, const uint8_t *p, size_t n)
{
    for (; n >= BLOCK; p += BLOCK, n -= BLOCK) {
        state = crc_block(state, p);
    }
    return n < FOLD_FROM ? crc_bytes(state, p, n) : crc_lanes(state, p, n);
}

/* dst[:n] = src[:n], around the cache where dst is 32-byte aligned (streaming stores): a reassembled
 * message is far larger than the cache and read long after, and a plain store first reads the line it
 * writes (memcpy does the same for copies this large, not for one block) */
TARGET static void
stream_copy(uint8_t *dst, const uint8_t *src, size_t n)
{
    size_t head = (32 - ((uintptr_t)dst & 31)) & 31;
    if (n < head + 32) {
        memcpy(dst, src, n);
        return;
    }
    memcpy(dst, src, head);
    dst += head, src += head, n -= head;
    for (; n >= 128; dst += 128, src += 128, n -= 128) {  /* (four loads, then four stores: a line pair a turn) */
        __m256i a = _mm256_loadu_si256((const __m256i *)src), b = _mm256_loadu_si256((const __m256i *)(src + 32));
        __m256i c = _mm256_loadu_si256((const __m256i *)(src + 64)), d = _mm256_loadu_si256((const __m256i *)(src + 96));
        _mm256_stream_si256((__m256i *)dst, a);
        _mm256_stream_si256((__m256i *)(dst + 32), b);
        _mm256_stream_si256((__m256i *)(dst + 64), c);
        _mm256_stream_si256((__m256i *)(dst + 96), d);
    }
    for (; n >= 32; dst += 32, src += 32, n -= 32) {
        _mm256_stream_si256((__m256i *)dst, _mm256_loadu_si256((const __m256i *)src));
    }
    memcpy(dst, src, n);
}

/* The CRC register after `n` more bytes of `src`, which are copied to `dst` on the way: block by block,
 * each block's CRC read brings it into the cache the copy then reads it from, so the chunk crosses the
 * memory bus once, not twice (the reassembler's check and its copy into place, in one pass). */
TARGET static uint32_t
crc_copy(uint32_t state, uint8_t *dst, const uint8_t *src, size_t n)
{
    for (size_t k; n; dst += k, src += k, n -= k) {
        k = n < BLOCK ? n : BLOCK;
        state = crc_fold(state, src, k);
        stream_copy(dst, src, k);
    }
    _mm_sfence();  /* (the streamed stores are seen by every core before the caller goes on) */
    return state;
}

/* x^n modulo P, bit-reflected: once, at import */
static uint32_t
x_to_the(unsigned n)
{
    uint32_t p = 0x80000000u;
    while (n--) {
        p = (p & 1) ? (p >> 1) ^ POLY : p >> 1;
    }
    return p;
}

/* SSE4.2, PCLMULQDQ, AVX2 and VPCLMULQDQ, and an OS that saves the ymm registers (OSXSAVE, and
 * XCR0's SSE and AVX bits): asked of the CPU itself, the same under any compiler */
static int
cpu_folds(void)
{
    unsigned a, b, c, d;
    if (!__get_cpuid(1, &a, &b, &c, &d) || !(c & bit_SSE4_2) || !(c & bit_PCLMUL) || !(c & bit_OSXSAVE) ||
        !(c & bit_AVX)) {
        return 0;
    }
    unsigned xcr0_lo, xcr0_hi;
    __asm__("xgetbv" : "=a"(xcr0_lo), "=d"(xcr0_hi) : "c"(0));
    if ((xcr0_lo & 6) != 6 || !__get_cpuid_count(7, 0, &a, &b, &c, &d)) {
        return 0;
    }
    return (b & bit_AVX2) && (c & (1u << 10));  /* CPUID.7.0:ECX bit 10 is VPCLMULQDQ */
}
#endif

static int g_accelerated = 0;

PyDoc_STRVAR(crc32c_doc,
"crc32c(data, value=0, gil_release_mode=-1)\n--\n\n"
"CRC32C of `data` (any C-contiguous buffer), continuing from the CRC `value` of what came before:\n"
"crc32c.crc32c's answers and call (gil_release_mode: -1 from 32 KiB, 0 never, 1 always). Only\n"
"when ACCELERATED (else RuntimeError).");

static PyObject *
crc32c(PyObject *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"data", "value", "gil_release_mode", NULL};
    Py_buffer data;
    unsigned int value = 0;  /* "I": masked to 32 bits, as the package takes it (-1 is 0xFFFFFFFF) */
    int gil_release_mode = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "y*|Ii:crc32c", names, &data, &value, &gil_release_mode)) {
        return NULL;
    }
    if (!g_accelerated) {
        PyBuffer_Release(&data);
        PyErr_SetString(PyExc_RuntimeError, "crc32c: this CPU lacks VPCLMULQDQ/AVX2 (use the crc32c package)");
        return NULL;
    }
    uint32_t state = ~(uint32_t)value;
#if HAVE_FOLD
    if (gil_release_mode > 0 || (gil_release_mode < 0 && data.len >= RELEASE_GIL_FROM)) {
        Py_BEGIN_ALLOW_THREADS
        state = crc_fold(state, data.buf, (size_t)data.len);
        Py_END_ALLOW_THREADS
    } else {
        state = crc_fold(state, data.buf, (size_t)data.len);
    }
#endif
    PyBuffer_Release(&data);
    return PyLong_FromUnsignedLong(~state);
}

PyDoc_STRVAR(crc32c_copy_doc,
"crc32c_copy(dst, src, value=0)\n--\n\n"
"Copy `src` into `dst` (a writable buffer of the same length) and return the CRC32C of `src`, continuing\n"
"from `value`: crc32c(src, value) and dst[:] = src in one pass over src. Only when ACCELERATED (else\n"
"RuntimeError).");

/* A copy's arguments, parsed by `format` (dst, src and, for crc32c_copy, value): 0, or -1 with the error set
 * and no buffer held (not ACCELERATED, or dst and src of different lengths) */
static int
copy_arguments(PyObject *args, const char *format, Py_buffer *dst, Py_buffer *src, unsigned int *value)
{
    if (!PyArg_ParseTuple(args, format, dst, src, value)) {
        return -1;
    }
    const char *name = strchr(format, ':') + 1;
    if (!g_accelerated) {
        PyErr_Format(PyExc_RuntimeError, "%s: this CPU lacks VPCLMULQDQ/AVX2 (use the Python path)", name);
    } else if (dst->len != src->len) {
        PyErr_Format(PyExc_ValueError, "%s: %zd bytes into a buffer of %zd", name, src->len, dst->len);
    } else {
        return 0;
    }
    PyBuffer_Release(dst);
    PyBuffer_Release(src);
    return -1;
}

static PyObject *
crc32c_copy(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    unsigned int value = 0;
    if (copy_arguments(args, "w*y*|I:crc32c_copy", &dst, &src, &value) < 0) {
        return NULL;
    }
    uint32_t state = ~(uint32_t)value;
#if HAVE_FOLD
    Py_BEGIN_ALLOW_THREADS
    state = crc_copy(state, dst.buf, src.buf, (size_t)src.len);
    Py_END_ALLOW_THREADS
#endif
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    return PyLong_FromUnsignedLong(~state);
}

PyDoc_STRVAR(copy_streamed_doc,
"copy_streamed(dst, src)\n--\n\n"
"dst[:] = src with streaming stores, around the cache: for copies far larger than it whose bytes another\n"
"core reads next (a shared memory slot). dst and src must not overlap. Only when ACCELERATED (else\n"
"RuntimeError).");

static PyObject *
copy_streamed(PyObject *self, PyObject *args)
{
    Py_buffer dst, src;
    if (copy_arguments(args, "w*y*:copy_streamed", &dst, &src, NULL) < 0) {
        return NULL;
    }
#if HAVE_FOLD
    Py_BEGIN_ALLOW_THREADS
    stream_copy(dst.buf, src.buf, (size_t)src.len);
    _mm_sfence();
    Py_END_ALLOW_THREADS
#endif
    PyBuffer_Release(&dst);
    PyBuffer_Release(&src);
    Py_RETURN_NONE;
}

/* a(x) * b(x) modulo P, bit-reflected: crc.py's _multmodp */
static uint32_t
multmodp(uint32_t a, uint32_t b)
{
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if (!(a & (m - 1))) {
                return p;
            }
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ 0x82F63B78u : b >> 1;
    }
}

/* x^(2^k) modulo P for k < 67 (3 for bytes to bits, 64 bits of length): crc.py's _X2N, set at import */
static uint32_t g_x2n[67];

PyDoc_STRVAR(combine_doc,
"combine(crc_a, crc_b, len_b)\n--\n\n"
"CRC32C of a + b from CRC32C(a), CRC32C(b) and len(b): crc.combine's answers, in C.");

static PyObject *
combine(PyObject *self, PyObject *args)
{
    unsigned int crc_a, crc_b;
    Py_ssize_t len_b;
    if (!PyArg_ParseTuple(args, "IIn:combine", &crc_a, &crc_b, &len_b)) {
        return NULL;
    }
    if (len_b < 0) {
        PyErr_Format(PyExc_ValueError, "combine: len_b=%zd; a length is not negative", len_b);
        return NULL;
    }
    uint32_t shift = 1u << 31;  /* x^(8 * len_b): x^(2^k) for each bit k of len_b in bits */
    for (unsigned k = 3; len_b; len_b >>= 1, k++) {
        if (len_b & 1) {
            shift = multmodp(g_x2n[k], shift);
        }
    }
    return PyLong_FromUnsignedLong(multmodp(shift, crc_a) ^ crc_b);
}

/* The CRC of `n` more bytes at `p` after the CRC `value` (crc32c.crc32c's answer), called from C by
 * other extensions through the CRC32C_C capsule (the codec's decoding, _native.c): a small frame's
 * checksum without two Python calls around it. Only when accelerated: the capsule is None otherwise. */
static uint32_t
crc32c_update(uint32_t value, const void *p, size_t n)
{
#if HAVE_FOLD
    return ~crc_fold(~value, (const uint8_t *)p, n);
#else
    return value;
#endif
}

/* what the capsule holds (its name: CRC32C_C_NAME) */
static struct {
    uint32_t (*crc32c)(uint32_t value, const void *p, size_t n);
} g_c_api = {crc32c_update};

#define CRC32C_C_NAME "tensorbus.codec._crc.CRC32C_C"

static PyMethodDef methods[] = {
    {"crc32c", (PyCFunction)(void (*)(void))crc32c, METH_VARARGS | METH_KEYWORDS, crc32c_doc},
    {"crc32c_copy", crc32c_copy, METH_VARARGS, crc32c_copy_doc},
    {"copy_streamed", copy_streamed, METH_VARARGS, copy_streamed_doc},
    {"combine", combine, METH_VARARGS, combine_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tensorbus.codec._crc",
    "CRC32C by carry-less multiplication (AVX2 + VPCLMULQDQ), with crc32c.crc32c's answers.", -1, methods,
};

PyMODINIT_FUNC
PyInit__crc(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    g_x2n[0] = 1u << 30;  /* x^1 */
    for (unsigned k = 1; k < sizeof g_x2n / sizeof g_x2n[0]; k++) {
        g_x2n[k] = multmodp(g_x2n[k - 1], g_x2n[k - 1]);
    }
#if HAVE_FOLD
    g_accelerated = cpu_folds();
    g_fold_lo = (uint64_t)x_to_the(1087) << 32;
    g_fold_hi = (uint64_t)x_to_the(1023) << 32;
    g_skip = x_to_the(8 * STREAM - 33);
#endif
    PyObject *c_api = g_accelerated ? PyCapsule_New(&g_c_api, CRC32C_C_NAME, NULL) : Py_NewRef(Py_None);
    int failed = c_api == NULL || PyModule_AddObjectRef(m, "CRC32C_C", c_api) < 0 ||
                 PyModule_AddIntConstant(m, "ACCELERATED", g_accelerated) < 0 ||
                 PyModule_AddStringConstant(m, "SOURCE_HASH", TENSORBUS_SOURCE_HASH) < 0;
    Py_XDECREF(c_api);
    if (failed) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
