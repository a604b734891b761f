/* The per-message fast path of the frame codec: one plain ndarray frame, encoded or decoded in C.
 *
 * Python (frame.py) stays the codec: it defines the format, and it alone raises. These two functions
 * take only the common case, the frame a Producer writes for one ndarray: unsigned, uncompressed,
 * metadata a flat map of scalars. On anything else (a bundle, a chunk, a signature, nested metadata,
 * a frame that fails any check) they return None and the caller runs the Python path, which then
 * accepts it or raises the precise error. So this file needs to be right only about what it accepts:
 * everything it accepts, Python accepts and decodes to the same thing (tests/unit/test_native.py
 * checks both ways, on valid and on mutated frames). It never unpickles and never trusts a length
 * before checking it against the bytes that are there.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#define NPY_NO_DEPRECATED_API NPY_1_7_API_VERSION
#include <numpy/arrayobject.h>
#include <stdint.h>
#include <string.h>

#include "_frame.h"

#if NPY_ABI_VERSION < 0x02000000 /* numpy 1.x headers */
#define PyDataType_ELSIZE(descr) ((descr)->elsize)
#endif

#define OBJECT_BYTES 64
#define MAX_PRODUCER_ID 128
#define MAX_KEY_CHARS 1024
/* what receivers take by default (Limits.max_header_bytes): a larger head is left to Python, which refuses it */
#define MAX_HEADER_BYTES (1 << 20)
#define MAX_DTYPE_NAME 32

/* set by configure(): dtype name -> {byte order -> np.dtype} (what frame.resolve accepts), the
 * dtype -> (name, order) function encoders use (dtypes.describe), and crc32c.crc32c */
static PyObject *g_resolved = NULL;
static PyObject *g_describe = NULL;
static PyObject *g_crc32c = NULL;
/* the same CRC as a C function (_crc.c's CRC32C_C capsule), where configure() was given it: frames below
 * CRC_DIRECT_BELOW are checksummed without a Python call (_frame.h) */
static crc32c_c_fn g_crc32c_c = NULL;

/* "Not the fast case": a Python error about the input is dropped (the Python path will raise its
 * own, precise one), and the caller gets None; MemoryError, KeyboardInterrupt and the like go on. */
static PyObject *
not_fast(void)
{
    if (PyErr_Occurred()) {
        if (PyErr_ExceptionMatches(PyExc_MemoryError) || !PyErr_ExceptionMatches(PyExc_Exception)) {
            return NULL;
        }
        PyErr_Clear();
    }
    Py_RETURN_NONE;
}

static inline uint64_t
align64(uint64_t n)
{
    return (n + ALIGN - 1) / ALIGN * ALIGN;
}

/* ---- little-endian prefix, big-endian msgpack --------------------------------------------------- */

static inline void
put_le32(uint8_t *p, uint32_t v)
{
    for (int i = 0; i < 4; i++) {
        p[i] = (uint8_t)(v >> (8 * i));
    }
}

static inline void
put_le64(uint8_t *p, uint64_t v)
{
    put_le32(p, (uint32_t)v);
    put_le32(p + 4, (uint32_t)(v >> 32));
}

static inline uint16_t
be16(const uint8_t *p)
{
    return (uint16_t)(p[0] << 8 | p[1]);
}

static inline uint32_t
be32(const uint8_t *p)
{
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | (uint32_t)p[3];
}

static inline uint64_t
be64(const uint8_t *p)
{
    return (uint64_t)be32(p) << 32 | be32(p + 4);
}

/* ---- reading the msgpack header: only the forms msgpack itself reads, each bounds-checked ---------- */

typedef struct {
    const uint8_t *p;
    const uint8_t *end;
} Reader;

static inline int
has(const Reader *r, size_t n)
{
    return (size_t)(r->end - r->p) >= n;
}

/* The length of the map (or array) that comes next; -1 if something else comes. */
static int64_t
read_len(Reader *r, int map)
{
    if (!has(r, 1)) {
        return -1;
    }
    uint8_t b = r->p[0];
    if ((b & 0xf0) == (map ? 0x80 : 0x90)) {
        r->p += 1;
        return b & 0x0f;
    }
    if (b == (map ? 0xde : 0xdc) && has(r, 3)) {
        r->p += 3;
        return be16(r->p - 2);
    }
    if (b == (map ? 0xdf : 0xdd) && has(r, 5)) {
        r->p += 5;
        return be32(r->p - 4);
    }
    return -1;
}

/* The raw bytes of the str that comes next; 0 if something else comes (or it is cut short). */
static int
read_str(Reader *r, const char **s, Py_ssize_t *n)
{
    if (!has(r, 1)) {
        return 0;
    }
    uint8_t b = r->p[0];
    size_t len, head;
    if ((b & 0xe0) == 0xa0) {
        len = b & 0x1f, head = 1;
    }
    else if (b == 0xd9 && has(r, 2)) {
        len = r->p[1], head = 2;
    }
    else if (b == 0xda && has(r, 3)) {
        len = be16(r->p + 1), head = 3;
    }
    else if (b == 0xdb && has(r, 5)) {
        len = be32(r->p + 1), head = 5;
    }
    else {
        return 0;
    }
    if (!has(r, head + len)) {
        return 0;
    }
    *s = (const char *)r->p + head;
    *n = (Py_ssize_t)len;
    r->p += head + len;
    return 1;
}

/* Whether the next str is exactly `literal` (consumed if so). */
static int
read_literal(Reader *r, const char *literal)
{
    Reader save = *r;
    const char *s;
    Py_ssize_t n;
    if (read_str(r, &s, &n) && (size_t)n == strlen(literal) && memcmp(s, literal, (size_t)n) == 0) {
        return 1;
    }
    *r = save;
    return 0;
}

/* The next str, decoded as msgpack does (UTF-8, strict); NULL if it is not a str or not UTF-8. */
static PyObject *
read_unicode(Reader *r)
{
    const char *s;
    Py_ssize_t n;
    if (!read_str(r, &s, &n)) {
        return NULL;
    }
    return PyUnicode_DecodeUTF8(s, n, "strict");
}

/* An integer: 1 if it fits int64 (*i), 2 if it is a uint64 above that (*u), 0 if no integer comes. */
static int
read_int(Reader *r, int64_t *i, uint64_t *u)
{
    if (!has(r, 1)) {
        return 0;
    }
    const uint8_t *p = r->p;
    uint8_t b = p[0];
    size_t size;
    if (b <= 0x7f) {
        *i = b, size = 1;
    }
    else if (b >= 0xe0) {
        *i = (int8_t)b, size = 1;
    }
    else {
        switch (b) {
            case 0xcc: size = 2; break;
            case 0xcd: size = 3; break;
            case 0xce: size = 5; break;
            case 0xcf: size = 9; break;
            case 0xd0: size = 2; break;
            case 0xd1: size = 3; break;
            case 0xd2: size = 5; break;
            case 0xd3: size = 9; break;
            default: return 0;
        }
        if (!has(r, size)) {
            return 0;
        }
        switch (b) {
            case 0xcc: *i = p[1]; break;
            case 0xcd: *i = be16(p + 1); break;
            case 0xce: *i = be32(p + 1); break;
            case 0xcf: {
                uint64_t v = be64(p + 1);
                if (v > INT64_MAX) {
                    *u = v;
                    r->p += size;
                    return 2;
                }
                *i = (int64_t)v;
                break;
            }
            case 0xd0: *i = (int8_t)p[1]; break;
            case 0xd1: *i = (int16_t)be16(p + 1); break;
            case 0xd2: *i = (int32_t)be32(p + 1); break;
            default: *i = (int64_t)be64(p + 1); break;
        }
    }
    r->p += size;
    return 1;
}

static PyObject *
read_pyint(Reader *r)
{
    int64_t i;
    uint64_t u;
    switch (read_int(r, &i, &u)) {
        case 1: return PyLong_FromLongLong(i);
        case 2: return PyLong_FromUnsignedLongLong(u);
        default: return NULL;
    }
}

/* One metadata value: nil, bool, int, float, str or bin; NULL for anything else (nested maps and
 * lists, ext types), which the Python path handles. */
static PyObject *
read_scalar(Reader *r)
{
    if (!has(r, 1)) {
        return NULL;
    }
    uint8_t b = r->p[0];
    switch (b) {
        case 0xc0: r->p += 1; Py_RETURN_NONE;
        case 0xc2: r->p += 1; Py_RETURN_FALSE;
        case 0xc3: r->p += 1; Py_RETURN_TRUE;
        case 0xca:
            if (has(r, 5)) {
                uint32_t bits = be32(r->p + 1);
                float f;
                memcpy(&f, &bits, sizeof f);
                r->p += 5;
                return PyFloat_FromDouble(f);
            }
            return NULL;
        case 0xcb:
            if (has(r, 9)) {
                uint64_t bits = be64(r->p + 1);
                double d;
                memcpy(&d, &bits, sizeof d);
                r->p += 9;
                return PyFloat_FromDouble(d);
            }
            return NULL;
        case 0xc4:
        case 0xc5:
        case 0xc6: {
            size_t head = b == 0xc4 ? 2 : b == 0xc5 ? 3 : 5;
            if (!has(r, head)) {
                return NULL;
            }
            size_t len = b == 0xc4 ? r->p[1] : b == 0xc5 ? be16(r->p + 1) : be32(r->p + 1);
            if (!has(r, head + len)) {
                return NULL;
            }
            PyObject *bytes = PyBytes_FromStringAndSize((const char *)r->p + head, (Py_ssize_t)len);
            r->p += head + len;
            return bytes;
        }
        default:
            break;
    }
    if ((b & 0xe0) == 0xa0 || b == 0xd9 || b == 0xda || b == 0xdb) {
        return read_unicode(r);
    }
    return read_pyint(r);
}

/* The metadata map: str keys, scalar values; NULL for anything else. */
static PyObject *
read_meta(Reader *r)
{
    int64_t n = read_len(r, 1);
    if (n < 0 || (uint64_t)n > (uint64_t)(r->end - r->p) / 2) { /* each entry takes two bytes at least */
        return NULL;
    }
    PyObject *meta = PyDict_New();
    if (meta == NULL) {
        return NULL;
    }
    for (int64_t k = 0; k < n; k++) {
        PyObject *name = read_unicode(r);
        PyObject *value = name == NULL ? NULL : read_scalar(r);
        if (value == NULL || PyDict_SetItem(meta, name, value) < 0) {
            Py_XDECREF(name);
            Py_XDECREF(value);
            Py_DECREF(meta);
            return NULL;
        }
        Py_DECREF(name);
        Py_DECREF(value);
    }
    return meta;
}

/* The message id: nil, or [producer id (at most MAX_PRODUCER_ID characters), int]. */
static PyObject *
read_id(Reader *r)
{
    if (has(r, 1) && r->p[0] == 0xc0) {
        r->p += 1;
        Py_RETURN_NONE;
    }
    if (read_len(r, 0) != 2) {
        return NULL;
    }
    PyObject *producer = read_unicode(r);
    if (producer == NULL || PyUnicode_GET_LENGTH(producer) > MAX_PRODUCER_ID) {
        Py_XDECREF(producer);
        return NULL;
    }
    PyObject *sequence = read_pyint(r);
    if (sequence == NULL) {
        Py_DECREF(producer);
        return NULL;
    }
    PyObject *id = PyTuple_Pack(2, producer, sequence);
    Py_DECREF(producer);
    Py_DECREF(sequence);
    return id;
}

/* What the one tensor entry says; filled by read_entry. */
typedef struct {
    PyArray_Descr *dtype; /* owned (g_resolved may be replaced while the CRC is computed) */
    int ndim;
    npy_intp dims[NPY_MAXDIMS];
    int fortran;
    uint64_t nbytes;
} Entry;

/* The entry map of a lone ndarray: exactly name, dtype, order, shape, fortran, offset (0), nbytes. */
static int
read_entry(Reader *r, Entry *e, Py_ssize_t max_ndim)
{
    if (read_len(r, 1) != 7) {
        return 0;
    }
    unsigned seen = 0;
    const char *dtype_name = NULL, *order = NULL;
    Py_ssize_t dtype_len = 0, order_len = 0;
    int64_t offset = -1, nbytes = -1;
    e->fortran = -1;
    for (int k = 0; k < 7; k++) {
        unsigned field;
        if (read_literal(r, "name")) {
            PyObject *name = read_unicode(r); /* any str: a lone ndarray's name is not used, but must decode */
            if (name == NULL) {
                return 0;
            }
            Py_DECREF(name);
            field = 1;
        }
        else if (read_literal(r, "dtype")) {
            if (!read_str(r, &dtype_name, &dtype_len)) {
                return 0;
            }
            field = 2;
        }
        else if (read_literal(r, "order")) {
            if (!read_str(r, &order, &order_len)) {
                return 0;
            }
            field = 4;
        }
        else if (read_literal(r, "shape")) {
            int64_t ndim = read_len(r, 0);
            if (ndim < 0 || ndim > max_ndim || ndim > NPY_MAXDIMS) {
                return 0;
            }
            for (int64_t d = 0; d < ndim; d++) {
                int64_t dim;
                uint64_t unused;
                if (read_int(r, &dim, &unused) != 1 || dim < 0 || (uint64_t)dim > (uint64_t)NPY_MAX_INTP) {
                    return 0;
                }
                e->dims[d] = (npy_intp)dim;
            }
            e->ndim = (int)ndim;
            field = 8;
        }
        else if (read_literal(r, "fortran")) {
            if (!has(r, 1) || (r->p[0] != 0xc2 && r->p[0] != 0xc3)) {
                return 0;
            }
            e->fortran = r->p[0] == 0xc3;
            r->p += 1;
            field = 16;
        }
        else if (read_literal(r, "offset")) {
            uint64_t unused;
            if (read_int(r, &offset, &unused) != 1) {
                return 0;
            }
            field = 32;
        }
        else if (read_literal(r, "nbytes")) {
            uint64_t unused;
            if (read_int(r, &nbytes, &unused) != 1) {
                return 0;
            }
            field = 64;
        }
        else {
            return 0;
        }
        if (seen & field) {
            return 0;
        }
        seen |= field;
    }
    /* the dtype, as frame.resolve would build it */
    if (offset != 0 || nbytes < 0 || dtype_len > MAX_DTYPE_NAME || order_len != 1 ||
        memchr(dtype_name, '\0', (size_t)dtype_len) != NULL) { /* "float32\0..." is not "float32" */
        return 0;
    }
    char name[MAX_DTYPE_NAME + 1];
    memcpy(name, dtype_name, (size_t)dtype_len);
    name[dtype_len] = '\0';
    PyObject *orders = PyDict_GetItemString(g_resolved, name); /* borrowed; NULL: not whitelisted */
    char order_key[2] = {order[0], '\0'};
    PyObject *dtype = orders == NULL ? NULL : PyDict_GetItemString(orders, order_key);
    if (dtype == NULL || !PyArray_DescrCheck(dtype)) {
        return 0;
    }
    Py_XSETREF(e->dtype, (PyArray_Descr *)Py_NewRef(dtype)); /* (a second "tensors" entry is refused after this) */
    /* nbytes must be the shape's, without overflow */
    uint64_t count = 1;
    for (int d = 0; d < e->ndim; d++) {
        if (__builtin_mul_overflow(count, (uint64_t)e->dims[d], &count)) {
            return 0;
        }
    }
    uint64_t expected;
    if (__builtin_mul_overflow(count, (uint64_t)PyDataType_ELSIZE(e->dtype), &expected) ||
        expected != (uint64_t)nbytes) {
        return 0;
    }
    e->nbytes = (uint64_t)nbytes;
    return 1;
}

/* ---- decode ----------------------------------------------------------------------------------------- */

/* CRC32C of what a frame's checksum covers: bytes 0-19, then 24 to the end (frame.checksum_of). */
static int
frame_crc(const uint8_t *p, Py_ssize_t len, unsigned long *crc)
{
    PyObject *fn = Py_NewRef(g_crc32c); /* (held: a configure() meanwhile may replace it) */
    crc32c_c_fn direct = len < CRC_DIRECT_BELOW ? g_crc32c_c : NULL; /* (the whole frame one way or the other) */
    *crc = 0;
    int ok = crc32c_update(direct, fn, p, CRC_AT, crc) &&
             crc32c_update(direct, fn, p + PREFIX_SIZE, len - PREFIX_SIZE, crc);
    Py_DECREF(fn);
    return ok;
}

typedef struct {
    PyObject *key, *meta, *id;
    Entry entry;
} Header;

static void
header_clear(Header *h)
{
    Py_CLEAR(h->key);
    Py_CLEAR(h->meta);
    Py_CLEAR(h->id);
    Py_CLEAR(h->entry.dtype);
}

/* The top-level header map, exactly as frame.encode writes it for one ndarray. */
static int
read_header(Reader *r, Header *h, Py_ssize_t max_ndim)
{
    if (read_len(r, 1) != 6) {
        return 0;
    }
    unsigned seen = 0;
    for (int k = 0; k < 6; k++) {
        unsigned field;
        if (read_literal(r, "kind")) {
            if (!read_literal(r, "ndarray")) {
                return 0;
            }
            field = 1;
        }
        else if (read_literal(r, "key")) {
            if (h->key != NULL) {
                return 0;
            }
            if (has(r, 1) && r->p[0] == 0xc0) {
                r->p += 1;
                h->key = Py_NewRef(Py_None);
            }
            else if ((h->key = read_unicode(r)) == NULL || PyUnicode_GET_LENGTH(h->key) > MAX_KEY_CHARS) {
                return 0; /* (a key over the limit: refused by the Python decoder, which says why) */
            }
            field = 2;
        }
        else if (read_literal(r, "meta")) {
            if (h->meta != NULL || (h->meta = read_meta(r)) == NULL) {
                return 0;
            }
            field = 4;
        }
        else if (read_literal(r, "id")) {
            if (h->id != NULL || (h->id = read_id(r)) == NULL) {
                return 0;
            }
            field = 8;
        }
        else if (read_literal(r, "tensors")) {
            if (read_len(r, 0) != 1 || !read_entry(r, &h->entry, max_ndim)) {
                return 0;
            }
            field = 16;
        }
        else if (read_literal(r, "comp")) {
            if (!has(r, 1) || r->p[0] != 0xc0) {
                return 0;
            }
            r->p += 1;
            field = 32;
        }
        else {
            return 0;
        }
        if (seen & field) {
            return 0;
        }
        seen |= field;
    }
    return r->p == r->end; /* msgpack refuses bytes after the map */
}

static PyObject *
decode_frame(PyObject *frame, const Py_buffer *view, PyObject *crc_given, Py_ssize_t max_header,
             unsigned long long max_payload, Py_ssize_t max_ndim)
{
    const uint8_t *p = view->buf;
    Py_ssize_t len = view->len;
    if (len < PREFIX_SIZE || memcmp(p, "TBUS", 4) != 0 || p[4] != FORMAT_VERSION || (p[5] & ~FLAG_CHECKSUM) || p[6] ||
        p[7]) {
        return not_fast(); /* signed frames, and anything frame_length refuses, go the Python way */
    }
    uint64_t header_len = le32(p + 8), payload_len = le64(p + 12);
    if (header_len > (uint64_t)max_header || payload_len > max_payload || payload_len > (uint64_t)len) {
        return not_fast();
    }
    uint64_t start = align64(PREFIX_SIZE + header_len);
    if (start + payload_len != (uint64_t)len) {
        return not_fast();
    }
    /* the header first: a frame of another kind (a chunk, a bundle) goes to Python before its bytes are
     * checksummed here, or they would be read twice */
    Header h = {NULL, NULL, NULL};
    Reader r = {p + PREFIX_SIZE, p + PREFIX_SIZE + header_len};
    if (!read_header(&r, &h, max_ndim) || h.entry.nbytes != payload_len) {
        header_clear(&h);
        return not_fast();
    }
    if (p[5] & FLAG_CHECKSUM) {
        unsigned long crc = 0;
        int known = 0;
        if (crc_given != Py_None) {
            crc = PyLong_AsUnsignedLong(crc_given);
            known = !PyErr_Occurred();
        }
        else {
            known = frame_crc(p, len, &crc);
        }
        if (!known || crc != le32(p + CRC_AT)) {
            header_clear(&h);
            return not_fast();
        }
    }
    Entry *e = &h.entry;
    Py_INCREF(e->dtype); /* (PyArray_NewFromDescr steals it) */
    int flags = (e->fortran ? NPY_ARRAY_F_CONTIGUOUS : 0) | (view->readonly ? 0 : NPY_ARRAY_WRITEABLE);
    PyObject *array = PyArray_NewFromDescr(&PyArray_Type, e->dtype, e->ndim, e->dims, NULL, (void *)(p + start),
                                           flags, NULL);
    if (array == NULL) {
        header_clear(&h);
        return not_fast();
    }
    /* a view of its own on frame's buffer: frame.release() by the caller must not free the array's memory */
    PyObject *base = PyMemoryView_FromObject(frame);
    if (base == NULL || PyArray_SetBaseObject((PyArrayObject *)array, base) < 0) { /* (steals the reference) */
        Py_DECREF(array);
        header_clear(&h);
        return NULL;
    }
    /* frame.metadata_objects of a flat map: the map plus a key and a value per entry */
    uint64_t header_bytes = start + OBJECT_BYTES * (1 + 2 * (uint64_t)PyDict_GET_SIZE(h.meta));
    PyObject *result = Py_BuildValue("(OOONK)", h.key, h.meta, h.id, array, (unsigned long long)header_bytes);
    header_clear(&h);
    return result;
}

PyDoc_STRVAR(decode_doc,
"decode(frame, crc, max_header_bytes, max_payload_bytes, max_ndim)\n--\n\n"
"(key, metadata, message id, array, header bytes) of a frame holding one plain ndarray, the array a\n"
"view of `frame` (a contiguous memoryview); None for any other frame, which frame.parse then takes.");

/* decode() on a memoryview `frame`: the tuple, None, or NULL (an error the Python path would not
 * raise, e.g. MemoryError). */
static PyObject *
decode_memoryview(PyObject *frame, PyObject *crc, Py_ssize_t max_header, unsigned long long max_payload,
                  Py_ssize_t max_ndim)
{
    if (g_resolved == NULL) {
        Py_RETURN_NONE;
    }
    /* an export of our own for the whole call: refuses a released view, and keeps the memory from being
     * released by another thread while crc32c runs without the GIL */
    Py_buffer view;
    if (PyObject_GetBuffer(frame, &view, PyBUF_ND | PyBUF_WRITABLE) < 0) {
        PyErr_Clear();
        if (PyObject_GetBuffer(frame, &view, PyBUF_ND) < 0) {
            return not_fast(); /* released, or not C-contiguous */
        }
    }
    PyObject *result = decode_frame(frame, &view, crc, max_header, max_payload, max_ndim);
    PyBuffer_Release(&view);
    return result;
}

static PyObject *
decode(PyObject *self, PyObject *args)
{
    PyObject *frame, *crc;
    Py_ssize_t max_header, max_ndim;
    unsigned long long max_payload;
    if (!PyArg_ParseTuple(args, "O!OnKn:decode", &PyMemoryView_Type, &frame, &crc, &max_header, &max_payload,
                          &max_ndim)) {
        return NULL;
    }
    return decode_memoryview(frame, crc, max_header, max_payload, max_ndim);
}

/* ---- encode: msgpack written as msgpack-python writes it (smallest form; str8, bin, float64) ------- */

typedef struct {
    uint8_t *buf;
    size_t len, cap;
    uint8_t inline_buf[512];
} Writer;

static int
reserve(Writer *w, size_t more)
{
    if (w->len + more <= w->cap) {
        return 1;
    }
    size_t cap = w->cap * 2 > w->len + more ? w->cap * 2 : w->len + more;
    uint8_t *grown = w->buf == w->inline_buf ? PyMem_Malloc(cap) : PyMem_Realloc(w->buf, cap);
    if (grown == NULL) {
        PyErr_NoMemory();
        return 0;
    }
    if (w->buf == w->inline_buf) {
        memcpy(grown, w->inline_buf, w->len);
    }
    w->buf = grown, w->cap = cap;
    return 1;
}

static int
put(Writer *w, const void *bytes, size_t n)
{
    if (!reserve(w, n)) {
        return 0;
    }
    memcpy(w->buf + w->len, bytes, n);
    w->len += n;
    return 1;
}

static int
put_byte_and(Writer *w, uint8_t code, uint64_t v, int size)
{
    uint8_t out[9] = {code};
    for (int i = 0; i < size; i++) {
        out[1 + i] = (uint8_t)(v >> (8 * (size - 1 - i)));
    }
    return put(w, out, 1 + (size_t)size);
}

static int
put_uint(Writer *w, uint64_t v)
{
    if (v < 128) {
        return put_byte_and(w, (uint8_t)v, 0, 0);
    }
    if (v < 256) {
        return put_byte_and(w, 0xcc, v, 1);
    }
    if (v < 65536) {
        return put_byte_and(w, 0xcd, v, 2);
    }
    if (v < 4294967296ULL) {
        return put_byte_and(w, 0xce, v, 4);
    }
    return put_byte_and(w, 0xcf, v, 8);
}

static int
put_int(Writer *w, int64_t v)
{
    if (v >= 0) {
        return put_uint(w, (uint64_t)v);
    }
    if (v >= -32) {
        return put_byte_and(w, (uint8_t)v, 0, 0);
    }
    if (v >= -128) {
        return put_byte_and(w, 0xd0, (uint64_t)v, 1);
    }
    if (v >= -32768) {
        return put_byte_and(w, 0xd1, (uint64_t)v, 2);
    }
    if (v >= INT32_MIN) {
        return put_byte_and(w, 0xd2, (uint64_t)v, 4);
    }
    return put_byte_and(w, 0xd3, (uint64_t)v, 8);
}

static int
put_len(Writer *w, size_t n, uint8_t fix, size_t fix_forms, uint8_t code8, uint8_t code16, uint8_t code32)
{
    if (n < fix_forms) {
        return put_byte_and(w, (uint8_t)(fix | n), 0, 0);
    }
    if (code8 && n < 256) {
        return put_byte_and(w, code8, n, 1);
    }
    if (n < 65536) {
        return put_byte_and(w, code16, n, 2);
    }
    if (n <= UINT32_MAX) {
        return put_byte_and(w, code32, n, 4);
    }
    return 0;
}

static int
put_str(Writer *w, const char *s, size_t n)
{
    return put_len(w, n, 0xa0, 32, 0xd9, 0xda, 0xdb) && put(w, s, n);
}

static int
put_cstr(Writer *w, const char *s)
{
    return put_str(w, s, strlen(s));
}

/* A str object; 0 (with a Python error) if it has no UTF-8 form (lone surrogates). */
static int
put_unicode(Writer *w, PyObject *s)
{
    Py_ssize_t n;
    const char *utf8 = PyUnicode_AsUTF8AndSize(s, &n);
    return utf8 != NULL && put_str(w, utf8, (size_t)n);
}

/* A Python int as msgpack-python packs it; 0 when it does not fit 64 bits. */
static int
put_pyint(Writer *w, PyObject *v)
{
    int overflow;
    long long i = PyLong_AsLongLongAndOverflow(v, &overflow);
    if (overflow > 0) {
        unsigned long long u = PyLong_AsUnsignedLongLong(v);
        return !PyErr_Occurred() && put_uint(w, u);
    }
    return !overflow && !(i == -1 && PyErr_Occurred()) && put_int(w, i);
}

/* One metadata value of the kinds read_scalar reads back; 0 for anything else (the Python path). */
static int
put_scalar(Writer *w, PyObject *v)
{
    if (v == Py_None) {
        return put_byte_and(w, 0xc0, 0, 0);
    }
    if (v == Py_True || v == Py_False) {
        return put_byte_and(w, v == Py_True ? 0xc3 : 0xc2, 0, 0);
    }
    if (PyLong_CheckExact(v)) {
        return put_pyint(w, v);
    }
    if (PyFloat_CheckExact(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        uint64_t bits;
        memcpy(&bits, &d, sizeof bits);
        return put_byte_and(w, 0xcb, bits, 8);
    }
    if (PyUnicode_CheckExact(v)) {
        return put_unicode(w, v);
    }
    if (PyBytes_CheckExact(v)) {
        size_t n = (size_t)PyBytes_GET_SIZE(v);
        return put_len(w, n, 0, 0, 0xc4, 0xc5, 0xc6) && put(w, PyBytes_AS_STRING(v), n);
    }
    return 0;
}

static int
put_meta(Writer *w, PyObject *meta)
{
    if (meta == Py_None) {
        return put_byte_and(w, 0x80, 0, 0);
    }
    if (!PyDict_CheckExact(meta) || !put_len(w, (size_t)PyDict_GET_SIZE(meta), 0x80, 16, 0, 0xde, 0xdf)) {
        return 0;
    }
    Py_ssize_t pos = 0;
    PyObject *name, *value;
    while (PyDict_Next(meta, &pos, &name, &value)) {
        if (!PyUnicode_CheckExact(name) || !put_unicode(w, name) || !put_scalar(w, value)) {
            return 0;
        }
    }
    return 1;
}

static int
put_id(Writer *w, PyObject *id)
{
    if (id == Py_None) {
        return put_byte_and(w, 0xc0, 0, 0);
    }
    if (!PyTuple_CheckExact(id) || PyTuple_GET_SIZE(id) != 2) {
        return 0;
    }
    PyObject *producer = PyTuple_GET_ITEM(id, 0), *sequence = PyTuple_GET_ITEM(id, 1);
    return PyUnicode_CheckExact(producer) && PyLong_CheckExact(sequence) && put_byte_and(w, 0x92, 0, 0) &&
           put_unicode(w, producer) && put_pyint(w, sequence);
}

/* The header frame.layout builds for one ndarray, key order included. */
static int
put_header(Writer *w, PyArrayObject *array, PyObject *key, PyObject *meta, PyObject *id, PyObject *described,
           int fortran)
{
    PyObject *name = PyTuple_GET_ITEM(described, 0), *order = PyTuple_GET_ITEM(described, 1);
    int ndim = PyArray_NDIM(array);
    npy_intp *dims = PyArray_DIMS(array);
    if (!put_byte_and(w, 0x86, 0, 0) || !put_cstr(w, "kind") || !put_cstr(w, "ndarray") || !put_cstr(w, "key")) {
        return 0;
    }
    if (key == Py_None ? !put_byte_and(w, 0xc0, 0, 0) : !put_unicode(w, key)) {
        return 0;
    }
    if (!put_cstr(w, "meta") || !put_meta(w, meta) || !put_cstr(w, "id") || !put_id(w, id)) {
        return 0;
    }
    if (!put_cstr(w, "tensors") || !put_byte_and(w, 0x91, 0, 0) || !put_byte_and(w, 0x87, 0, 0) ||
        !put_cstr(w, "name") || !put_cstr(w, "") || !put_cstr(w, "dtype") || !put_unicode(w, name) ||
        !put_cstr(w, "order") || !put_unicode(w, order) || !put_cstr(w, "shape") ||
        !put_len(w, (size_t)ndim, 0x90, 16, 0, 0xdc, 0xdd)) {
        return 0;
    }
    for (int d = 0; d < ndim; d++) {
        if (!put_int(w, dims[d])) {
            return 0;
        }
    }
    return put_cstr(w, "fortran") && put_byte_and(w, fortran ? 0xc3 : 0xc2, 0, 0) && put_cstr(w, "offset") &&
           put_uint(w, 0) && put_cstr(w, "nbytes") && put_uint(w, (uint64_t)PyArray_NBYTES(array)) &&
           put_cstr(w, "comp") && put_byte_and(w, 0xc0, 0, 0);
}

PyDoc_STRVAR(ndarray_head_doc,
"ndarray_head(array, key, metadata, message_id, flags)\n--\n\n"
"The frame head (prefix with a zero CRC, msgpack header, padding) frame.frame_head makes for one\n"
"plain ndarray, byte for byte; None when frame.layout must run (anything but the common case).");

/* dtypes.describe(dtype), remembered for the last few dtypes (by identity, holding them: numpy's
 * builtin dtypes are singletons, so nearly every tensor sent hits): calling describe, Python, was a
 * large part of a small tensor's encode. What describe refuses is not remembered. */
#define DESCRIBED_KEPT 8
static struct {
    PyArray_Descr *dtype;
    PyObject *described;
} g_described[DESCRIBED_KEPT];
static int g_described_next = 0;

static PyObject *
described_dtype(PyArray_Descr *dtype)
{
    for (int i = 0; i < DESCRIBED_KEPT; i++) {
        if (g_described[i].dtype == dtype) {
            return Py_NewRef(g_described[i].described);
        }
    }
    PyObject *describe = Py_NewRef(g_describe);
    PyObject *described = PyObject_CallOneArg(describe, (PyObject *)dtype);
    Py_DECREF(describe);
    if (described != NULL) {
        int slot = g_described_next;
        g_described_next = (slot + 1) % DESCRIBED_KEPT;
        Py_XDECREF(g_described[slot].dtype);
        Py_XDECREF(g_described[slot].described);
        g_described[slot].dtype = (PyArray_Descr *)Py_NewRef((PyObject *)dtype);
        g_described[slot].described = Py_NewRef(described);
    }
    return described;
}

static PyObject *
ndarray_head(PyObject *self, PyObject *args)
{
    PyObject *obj, *key, *meta, *id;
    int flags;
    if (!PyArg_ParseTuple(args, "OOOOi:ndarray_head", &obj, &key, &meta, &id, &flags)) {
        return NULL;
    }
    if (g_describe == NULL || !PyArray_CheckExact(obj) ||
        (key != Py_None && (!PyUnicode_CheckExact(key) || PyUnicode_GET_LENGTH(key) > MAX_KEY_CHARS)) || flags < 0 ||
        flags > 255) {
        Py_RETURN_NONE;
    }
    PyArrayObject *array = (PyArrayObject *)obj;
    int c_order = PyArray_IS_C_CONTIGUOUS(array);
    int fortran = PyArray_NDIM(array) > 1 && !c_order && PyArray_IS_F_CONTIGUOUS(array);
    if (!(c_order || fortran)) {
        Py_RETURN_NONE; /* strided: frame.layout copies it */
    }
    PyObject *described = described_dtype(PyArray_DESCR(array));
    if (described == NULL || !PyTuple_CheckExact(described) || PyTuple_GET_SIZE(described) != 2 ||
        !PyUnicode_CheckExact(PyTuple_GET_ITEM(described, 0)) || !PyUnicode_CheckExact(PyTuple_GET_ITEM(described, 1))) {
        Py_XDECREF(described);
        return not_fast();
    }
    Writer w = {NULL, PREFIX_SIZE, sizeof w.inline_buf};
    w.buf = w.inline_buf;
    PyObject *head = NULL;
    if (put_header(&w, array, key, meta, id, described, fortran)) {
        size_t header_len = w.len - PREFIX_SIZE;
        head = header_len <= MAX_HEADER_BYTES ? PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)align64(w.len)) : NULL;
        if (head != NULL) {
            uint8_t *out = (uint8_t *)PyByteArray_AS_STRING(head);
            memcpy(out, "TBUS", 4);
            out[4] = FORMAT_VERSION;
            out[5] = (uint8_t)flags;
            out[6] = out[7] = 0;
            put_le32(out + 8, (uint32_t)header_len);
            put_le64(out + 12, (uint64_t)PyArray_NBYTES(array));
            put_le32(out + CRC_AT, 0);
            memcpy(out + PREFIX_SIZE, w.buf + PREFIX_SIZE, header_len);
            memset(out + w.len, 0, (size_t)(PyByteArray_GET_SIZE(head) - (Py_ssize_t)w.len));
        }
    }
    Py_DECREF(described);
    if (w.buf != w.inline_buf) {
        PyMem_Free(w.buf);
    }
    return head != NULL ? head : not_fast();
}

PyDoc_STRVAR(ndarray_frame_doc,
"ndarray_frame(array, key, metadata, message_id, flags)\n--\n\n"
"The whole frame of one plain ndarray, byte for byte as frame.encode makes it (ndarray_head's head, then\n"
"the array's bytes), in a buffer of its own starting at a multiple of 64 bytes, its CRC32C stored when\n"
"flags has FLAG_CHECKSUM: (writable memoryview of the frame, CRC or None). For a small tensor (memory://\n"
"copies it at send): one call instead of a head, an allocation, two copies and a checksum from Python.\n"
"None where ndarray_head is None.");

/* A writable memoryview of a new bytearray with room for `n` bytes from a multiple of ALIGN, which start
 * `*skip` bytes into it; NULL with an exception set if memory ran out. */
static PyObject *
aligned_room(Py_ssize_t n, Py_ssize_t *skip)
{
    PyObject *raw = PyByteArray_FromStringAndSize(NULL, n + ALIGN - 1);
    PyObject *whole = raw == NULL ? NULL : PyMemoryView_FromObject(raw);
    Py_XDECREF(raw); /* (the memoryview holds it) */
    if (whole != NULL) {
        *skip = (Py_ssize_t)(-(uintptr_t)PyByteArray_AS_STRING(raw) % ALIGN);
    }
    return whole;
}

/* The bytes of `whole` (aligned_room's) from `skip`, `n` of them, as a memoryview of their own. */
static PyObject *
aligned_part(PyObject *whole, Py_ssize_t skip, Py_ssize_t n)
{
    PyObject *part = PySequence_GetSlice(whole, skip, skip + n);
    Py_DECREF(whole);
    return part;
}

static PyObject *
ndarray_frame(PyObject *self, PyObject *args)
{
    PyObject *head = ndarray_head(self, args);
    if (head == NULL || head == Py_None) {
        return head;
    }
    PyArrayObject *array = (PyArrayObject *)PyTuple_GET_ITEM(args, 0); /* (ndarray_head checked it) */
    int flags = (int)PyLong_AsLong(PyTuple_GET_ITEM(args, 4));
    Py_ssize_t at = PyByteArray_GET_SIZE(head), nbytes = PyArray_NBYTES(array), len = at + nbytes, skip = 0;
    PyObject *whole = aligned_room(len, &skip);
    if (whole == NULL) {
        Py_DECREF(head);
        return NULL;
    }
    uint8_t *p = (uint8_t *)PyByteArray_AS_STRING(PyMemoryView_GET_BASE(whole)) + skip;
    memcpy(p, PyByteArray_AS_STRING(head), (size_t)at);
    memcpy(p + at, PyArray_DATA(array), (size_t)nbytes); /* (C or Fortran contiguous: its bytes in its own order) */
    Py_DECREF(head);
    PyObject *crc = Py_NewRef(Py_None);
    if (flags & FLAG_CHECKSUM) {
        unsigned long value = 0;
        if (!frame_crc(p, len, &value)) {
            Py_DECREF(whole);
            Py_DECREF(crc);
            return NULL;
        }
        put_le32(p + CRC_AT, (uint32_t)value);
        Py_SETREF(crc, PyLong_FromUnsignedLong(value));
    }
    PyObject *frame = NULL;
    if (crc == NULL) {
        Py_DECREF(whole);
    }
    else {
        frame = aligned_part(whole, skip, len);
    }
    PyObject *result = frame == NULL ? NULL : PyTuple_Pack(2, frame, crc);
    Py_XDECREF(frame);
    Py_XDECREF(crc);
    return result;
}

PyDoc_STRVAR(aligned_copy_doc,
"aligned_copy(data: bytes) -> memoryview\n--\n\n"
"`data` itself (a memoryview of it) where its bytes start at a multiple of ALIGN, else a writable copy\n"
"that does: buffers.aligned without a pool, for a broker client's record (its bytes start 32 bytes into\n"
"the object), in a tenth of the Python path's time.");

static PyObject *
aligned_copy(PyObject *self, PyObject *data)
{
    if (!PyBytes_CheckExact(data)) {
        PyErr_SetString(PyExc_TypeError, "aligned_copy(data: bytes)");
        return NULL;
    }
    const char *source = PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data), skip = 0;
    if (n == 0 || (uintptr_t)source % ALIGN == 0) {
        return PyMemoryView_FromObject(data);
    }
    PyObject *whole = aligned_room(n, &skip);
    if (whole == NULL) {
        return NULL;
    }
    memcpy(PyByteArray_AS_STRING(PyMemoryView_GET_BASE(whole)) + skip, source, (size_t)n);
    return aligned_part(whole, skip, n);
}

/* ---- decode into a Message ------------------------------------------------------------------------- */

/* frame.Message and its fields in order (configure_message checks them against the dataclass) */
static PyObject *g_message_type = NULL;
static PyObject *s_fields[6], *s_ndarray;
static const char *const MESSAGE_FIELDS[6] = {"key", "tensor", "metadata", "message_id", "kind", "header_bytes"};

/* The Message of a decoded frame, made as Message(...) makes it, without running its __init__. */
static PyObject *
make_message(PyObject *decoded)
{
    PyTypeObject *type = (PyTypeObject *)g_message_type;
    PyObject *empty = PyTuple_New(0);
    PyObject *msg = empty == NULL ? NULL : type->tp_new(type, empty, NULL);
    Py_XDECREF(empty);
    if (msg == NULL) {
        return NULL;
    }
    PyObject *values[6] = {PyTuple_GET_ITEM(decoded, 0), PyTuple_GET_ITEM(decoded, 3), PyTuple_GET_ITEM(decoded, 1),
                           PyTuple_GET_ITEM(decoded, 2), s_ndarray, PyTuple_GET_ITEM(decoded, 4)};
    for (int i = 0; i < 6; i++) {
        if (PyObject_SetAttr(msg, s_fields[i], values[i]) < 0) {
            Py_DECREF(msg);
            return NULL;
        }
    }
    return msg;
}

PyDoc_STRVAR(decode_message_doc,
"decode_message(frame, crc, max_header_bytes, max_payload_bytes, max_ndim)\n--\n\n"
"decode() as a Message: (message, key, message id, bytes it holds: its array's plus header_bytes);\n"
"None for any other frame. What a receiver that delivers in C calls.");

static PyObject *
decode_message(PyObject *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 5 || !PyMemoryView_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "decode_message(frame: memoryview, crc, max_header_bytes, max_payload_bytes, max_ndim)");
        return NULL;
    }
    Py_ssize_t max_header = PyLong_AsSsize_t(args[2]), max_ndim = PyLong_AsSsize_t(args[4]);
    unsigned long long max_payload = PyLong_AsUnsignedLongLong(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (g_message_type == NULL) {
        Py_RETURN_NONE;
    }
    PyObject *decoded = decode_memoryview(args[0], args[1], max_header, max_payload, max_ndim);
    if (decoded == NULL || decoded == Py_None) {
        return decoded;
    }
    PyObject *msg = make_message(decoded);
    PyObject *result = NULL;
    if (msg != NULL) {
        unsigned long long held = (unsigned long long)PyArray_NBYTES((PyArrayObject *)PyTuple_GET_ITEM(decoded, 3)) +
                                  PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(decoded, 4));
        result = Py_BuildValue("(NOOK)", msg, PyTuple_GET_ITEM(decoded, 0), PyTuple_GET_ITEM(decoded, 2), held);
    }
    Py_DECREF(decoded);
    return result;
}

PyDoc_STRVAR(configure_message_doc,
"configure_message(message_type, field_names)\n--\n\n"
"Hand over frame.Message and its field names in order; refused (ValueError) unless they are the ones\n"
"make_message sets.");

static PyObject *
configure_message(PyObject *self, PyObject *args)
{
    PyObject *type, *names;
    if (!PyArg_ParseTuple(args, "O!O!:configure_message", &PyType_Type, &type, &PyTuple_Type, &names)) {
        return NULL;
    }
    int same = PyTuple_GET_SIZE(names) == 6;
    for (Py_ssize_t i = 0; same && i < 6; i++) {
        PyObject *name = PyTuple_GET_ITEM(names, i);
        same = PyUnicode_Check(name) && PyUnicode_CompareWithASCIIString(name, MESSAGE_FIELDS[i]) == 0;
    }
    if (!same) {
        PyErr_SetString(PyExc_ValueError, "Message's fields are not the ones _native.c sets");
        return NULL;
    }
    Py_XSETREF(g_message_type, Py_NewRef(type));
    Py_RETURN_NONE;
}

/* ---- module ------------------------------------------------------------------------------------------ */

PyDoc_STRVAR(configure_doc,
"configure(resolved, describe, crc32c, crc32c_c=None)\n--\n\n"
"Hand over what the fast path takes from Python: {dtype name: {byte order: np.dtype}} (frame.resolve's\n"
"whitelist), dtypes.describe, crc32c.crc32c, and the same CRC as a C function (_crc's CRC32C_C capsule),\n"
"or None to call crc32c for every frame.");

static PyObject *
configure(PyObject *self, PyObject *args)
{
    PyObject *resolved, *describe, *crc, *crc_c = Py_None;
    if (!PyArg_ParseTuple(args, "O!OO|O:configure", &PyDict_Type, &resolved, &describe, &crc, &crc_c)) {
        return NULL;
    }
    if (!crc32c_c_from(crc_c, &g_crc32c_c)) {
        return NULL;
    }
    Py_XSETREF(g_resolved, Py_NewRef(resolved));
    Py_XSETREF(g_describe, Py_NewRef(describe));
    for (int i = 0; i < DESCRIBED_KEPT; i++) { /* remembered by the describe this replaces */
        Py_CLEAR(g_described[i].dtype);
        Py_CLEAR(g_described[i].described);
    }
    Py_XSETREF(g_crc32c, Py_NewRef(crc));
    Py_RETURN_NONE;
}

/* ---- an array's bytes -------------------------------------------------------------------------------- */

/* A contiguous ndarray's memory as flat bytes (format "B"), holding the array: what frame.flat_bytes makes as a
 * memoryview through numpy's buffer export and a cast (two exports, a format string; ~0.6 us of a 4 KB send),
 * here filled in from the array's pointer and size. */
typedef struct {
    PyObject_HEAD
    PyObject *array;
    void *buf;
    Py_ssize_t len;
    int readonly;
} ArrayBytes;

static int
array_bytes_getbuffer(PyObject *self, Py_buffer *view, int flags)
{
    ArrayBytes *a = (ArrayBytes *)self;
    return PyBuffer_FillInfo(view, self, a->buf, a->len, a->readonly, flags);
}

static void
array_bytes_dealloc(PyObject *self)
{
    Py_XDECREF(((ArrayBytes *)self)->array);
    Py_TYPE(self)->tp_free(self);
}

static Py_ssize_t
array_bytes_length(PyObject *self)
{
    return ((ArrayBytes *)self)->len;
}

static PyBufferProcs array_bytes_buffer = {.bf_getbuffer = array_bytes_getbuffer};
static PySequenceMethods array_bytes_sequence = {.sq_length = array_bytes_length}; /* len(): its bytes, as a view's */

static PyTypeObject ArrayBytesType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorbus.codec._native.ArrayBytes",
    .tp_doc = PyDoc_STR("A contiguous ndarray's memory as flat bytes (the buffer protocol's \"B\"), holding the array."),
    .tp_basicsize = sizeof(ArrayBytes),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_dealloc = array_bytes_dealloc,
    .tp_as_buffer = &array_bytes_buffer,
    .tp_as_sequence = &array_bytes_sequence,
};

PyDoc_STRVAR(flat_bytes_doc,
"flat_bytes(array)\n--\n\n"
"A C- or Fortran-contiguous ndarray's memory as flat bytes in its own order, without a copy (an ArrayBytes,\n"
"holding the array); None for anything else (frame.flat_bytes decides).");

static PyObject *
flat_bytes(PyObject *self, PyObject *obj)
{
    if (!PyArray_CheckExact(obj)) {
        Py_RETURN_NONE;
    }
    PyArrayObject *array = (PyArrayObject *)obj;
    if (!PyArray_IS_C_CONTIGUOUS(array) && !PyArray_IS_F_CONTIGUOUS(array)) {
        Py_RETURN_NONE;
    }
    ArrayBytes *bytes = PyObject_New(ArrayBytes, &ArrayBytesType);
    if (bytes == NULL) {
        return NULL;
    }
    bytes->array = Py_NewRef(obj);
    bytes->buf = PyArray_DATA(array);
    bytes->len = PyArray_NBYTES(array);
    bytes->readonly = !PyArray_ISWRITEABLE(array);
    return (PyObject *)bytes;
}

static PyMethodDef methods[] = {
    {"decode", decode, METH_VARARGS, decode_doc},
    {"ndarray_head", ndarray_head, METH_VARARGS, ndarray_head_doc},
    {"ndarray_frame", ndarray_frame, METH_VARARGS, ndarray_frame_doc},
    {"aligned_copy", aligned_copy, METH_O, aligned_copy_doc},
    {"flat_bytes", flat_bytes, METH_O, flat_bytes_doc},
    {"configure", configure, METH_VARARGS, configure_doc},
    {"configure_message", configure_message, METH_VARARGS, configure_message_doc},
    {"decode_message", (PyCFunction)(void (*)(void))decode_message, METH_FASTCALL, decode_message_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_native", "The frame codec's per-message fast path (see _native.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__native(void)
{
    import_array();
    for (int i = 0; i < 6; i++) {
        if ((s_fields[i] = PyUnicode_InternFromString(MESSAGE_FIELDS[i])) == NULL) {
            return NULL;
        }
    }
    if ((s_ndarray = PyUnicode_InternFromString("ndarray")) == NULL) {
        return NULL;
    }
    if (PyType_Ready(&ArrayBytesType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    /* the format constants this file repeats from frame.py: frame.py checks they agree */
    if (m != NULL && (PyModule_AddStringConstant(m, "SOURCE_HASH", TENSORBUS_SOURCE_HASH) < 0 ||
                      PyModule_AddIntConstant(m, "PREFIX_SIZE", PREFIX_SIZE) < 0 ||
                      PyModule_AddIntConstant(m, "CRC_AT", CRC_AT) < 0 ||
                      PyModule_AddIntConstant(m, "FORMAT_VERSION", FORMAT_VERSION) < 0 ||
                      PyModule_AddIntConstant(m, "FLAG_CHECKSUM", FLAG_CHECKSUM) < 0 ||
                      PyModule_AddIntConstant(m, "ALIGN", ALIGN) < 0 ||
                      PyModule_AddIntConstant(m, "OBJECT_BYTES", OBJECT_BYTES) < 0 ||
                      PyModule_AddIntConstant(m, "MAX_PRODUCER_ID", MAX_PRODUCER_ID) < 0 ||
                      PyModule_AddIntConstant(m, "MAX_KEY_CHARS", MAX_KEY_CHARS) < 0 ||
                      PyModule_AddIntConstant(m, "MAX_HEADER_BYTES", MAX_HEADER_BYTES) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
