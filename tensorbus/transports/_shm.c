/* shm://'s C: the notification ring (Ring) and the consumer's view of a frame (FrameView).
 *
 * Ring: a producer's "frame" notices to its consumer through shared memory (shm_ring.py says what it is
 * for and when it is used; without this extension every notice is a datagram).
 *
 * One producer writes, one consumer reads. The memory (a sealed memfd the producer passes over the control
 * socket) holds, each word on a cache line of its own so the two sides do not take turns owning one line:
 *
 *     0    magic, capacity                  written once by the producer, before the consumer maps it
 *     64   tail      entries written        the producer's
 *     128  head      entries read           the consumer's
 *     192  sleeping  1: the consumer is about to sleep on its control socket; set by the consumer,
 *                    taken back (exchanged for 0) by whichever side sees it first
 *     256  capacity entries of four uint64: position, segment id, offset, length
 *
 * Waking: the producer publishes an entry (tail, sequentially consistent) and then reads `sleeping`; the
 * consumer sets `sleeping` and then reads tail. With both in one total order, at least one side sees the
 * other: the producer sees `sleeping` (and sends a wake-up datagram) or the consumer sees the entry (and does
 * not sleep). A wake-up nobody needed is harmless; a missed one cannot happen.
 *
 * Neither side trusts the other's words: the capacity each side uses is its own copy (checked against the
 * mapping's size), a tail or head out of range is a ValueError, and the consumer copies an entry out before
 * anyone checks it (shm_consumer.py checks its segment and bounds).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define RING_MAGIC 0x31474e4952425455ULL /* "UTBRING1", little-endian */
#define TAIL_AT 64
#define HEAD_AT 128
#define SLEEPING_AT 192
#define ENTRIES_AT 256
#define ENTRY_WORDS 4

typedef struct {
    PyObject_HEAD
    Py_buffer view;
    int has_view;
    uint64_t capacity;
    uint64_t *tail, *head, *sleeping, *entries;
} Ring;

static int
ring_init(Ring *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"buffer", "capacity", "fresh", NULL};
    PyObject *buffer;
    unsigned long long capacity;
    int fresh = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OK|p", names, &buffer, &capacity, &fresh)) {
        return -1;
    }
    if (self->has_view) {
        PyErr_SetString(PyExc_TypeError, "a Ring is initialised once");
        return -1;
    }
    if (capacity == 0 || (capacity & (capacity - 1)) != 0 || capacity > (1ULL << 24)) {
        PyErr_SetString(PyExc_ValueError, "a ring's capacity is a power of two up to 2**24");
        return -1;
    }
    Py_buffer view;
    if (PyObject_GetBuffer(buffer, &view, PyBUF_WRITABLE) < 0) {
        return -1;
    }
    /* (kept only once it passed every check: a Ring whose init failed holds no view, and its methods refuse) */
    uint64_t need = ENTRIES_AT + capacity * ENTRY_WORDS * sizeof(uint64_t);
    if ((uint64_t)view.len < need || ((uintptr_t)view.buf & 63) != 0) {
        PyErr_Format(PyExc_ValueError, "a ring of %llu entries needs %llu aligned bytes, not %zd", capacity,
                     (unsigned long long)need, view.len);
        PyBuffer_Release(&view);
        return -1;
    }
    uint8_t *base = view.buf;
    uint64_t *words = (uint64_t *)base;
    if (fresh) {
        memset(base, 0, ENTRIES_AT);
        words[0] = RING_MAGIC;
        words[1] = capacity;
    } else if (words[0] != RING_MAGIC || words[1] != capacity) {
        PyErr_SetString(PyExc_ValueError, "not a ring of the announced capacity");
        PyBuffer_Release(&view);
        return -1;
    }
    self->view = view;
    self->has_view = 1;
    self->capacity = capacity;
    self->tail = (uint64_t *)(base + TAIL_AT);
    self->head = (uint64_t *)(base + HEAD_AT);
    self->sleeping = (uint64_t *)(base + SLEEPING_AT);
    self->entries = (uint64_t *)(base + ENTRIES_AT);
    return 0;
}

static int
ready(Ring *self)
{
    if (!self->has_view) {
        PyErr_SetString(PyExc_ValueError, "the ring is closed");
        return 0;
    }
    return 1;
}

PyDoc_STRVAR(put_doc, "put(pos, seg_id, offset, length) -> int: the producer's notice of a frame.\n\n"
                      "-1: the ring is full (nothing written); 1: written, and the consumer was about to sleep "
                      "(send it a wake-up); 0: written.");

static PyObject *
ring_put(Ring *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (!ready(self)) {
        return NULL;
    }
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "put(pos, seg_id, offset, length)");
        return NULL;
    }
    uint64_t entry[ENTRY_WORDS];
    for (int i = 0; i < ENTRY_WORDS; i++) {
        entry[i] = PyLong_AsUnsignedLongLong(args[i]);
        if (entry[i] == (uint64_t)-1 && PyErr_Occurred()) {
            return NULL;
        }
    }
    uint64_t tail = __atomic_load_n(self->tail, __ATOMIC_RELAXED); /* (this side's own word) */
    uint64_t head = __atomic_load_n(self->head, __ATOMIC_ACQUIRE);
    if (tail - head > self->capacity) {
        PyErr_SetString(PyExc_ValueError, "the consumer's ring head is out of range");
        return NULL;
    }
    if (tail - head == self->capacity) {
        return PyLong_FromLong(-1);
    }
    memcpy(self->entries + (tail & (self->capacity - 1)) * ENTRY_WORDS, entry, sizeof entry);
    __atomic_store_n(self->tail, tail + 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(self->sleeping, __ATOMIC_SEQ_CST) &&
        __atomic_exchange_n(self->sleeping, 0, __ATOMIC_SEQ_CST)) {
        return PyLong_FromLong(1);
    }
    return PyLong_FromLong(0);
}

PyDoc_STRVAR(take_doc, "take() -> (pos, seg_id, offset, length) | None: the consumer's next notice, if any.");

static PyObject *
ring_take(Ring *self, PyObject *unused)
{
    if (!ready(self)) {
        return NULL;
    }
    uint64_t head = __atomic_load_n(self->head, __ATOMIC_RELAXED); /* (this side's own word) */
    uint64_t tail = __atomic_load_n(self->tail, __ATOMIC_ACQUIRE);
    if (tail == head) {
        Py_RETURN_NONE;
    }
    if (tail - head > self->capacity) {
        PyErr_SetString(PyExc_ValueError, "the producer's ring tail is out of range");
        return NULL;
    }
    uint64_t entry[ENTRY_WORDS];
    memcpy(entry, self->entries + (head & (self->capacity - 1)) * ENTRY_WORDS, sizeof entry);
    __atomic_store_n(self->head, head + 1, __ATOMIC_RELEASE);
    return Py_BuildValue("(KKKK)", (unsigned long long)entry[0], (unsigned long long)entry[1],
                         (unsigned long long)entry[2], (unsigned long long)entry[3]);
}

PyDoc_STRVAR(pending_doc, "pending() -> bool: whether a notice waits to be taken.");

static PyObject *
ring_pending(Ring *self, PyObject *unused)
{
    if (!ready(self)) {
        return NULL;
    }
    uint64_t head = __atomic_load_n(self->head, __ATOMIC_RELAXED);
    return PyBool_FromLong(__atomic_load_n(self->tail, __ATOMIC_ACQUIRE) != head);
}

PyDoc_STRVAR(sleep_doc, "sleep() -> bool: the consumer says it will sleep; False (and it does not) if a notice "
                        "came meanwhile.\n\nTrue: the producer's next notice sends a wake-up datagram.");

static PyObject *
ring_sleep(Ring *self, PyObject *unused)
{
    if (!ready(self)) {
        return NULL;
    }
    __atomic_store_n(self->sleeping, 1, __ATOMIC_SEQ_CST);
    uint64_t head = __atomic_load_n(self->head, __ATOMIC_RELAXED);
    if (__atomic_load_n(self->tail, __ATOMIC_SEQ_CST) != head) {
        __atomic_store_n(self->sleeping, 0, __ATOMIC_SEQ_CST);
        Py_RETURN_FALSE;
    }
    Py_RETURN_TRUE;
}

PyDoc_STRVAR(awake_doc, "awake(): the consumer is awake again (the producer need not wake it).");

static PyObject *
ring_awake(Ring *self, PyObject *unused)
{
    if (!ready(self)) {
        return NULL;
    }
    __atomic_store_n(self->sleeping, 0, __ATOMIC_SEQ_CST);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(free_doc, "free() -> int: room for this many notices more (the producer's view).");

static PyObject *
ring_free(Ring *self, PyObject *unused)
{
    if (!ready(self)) {
        return NULL;
    }
    uint64_t tail = __atomic_load_n(self->tail, __ATOMIC_RELAXED);
    uint64_t used = tail - __atomic_load_n(self->head, __ATOMIC_ACQUIRE);
    return PyLong_FromUnsignedLongLong(used > self->capacity ? 0 : self->capacity - used);
}

PyDoc_STRVAR(close_doc, "close(): let go of the buffer (its mapping may then be closed); idempotent.");

static PyObject *
ring_close(Ring *self, PyObject *unused)
{
    if (self->has_view) {
        self->has_view = 0;
        PyBuffer_Release(&self->view);
    }
    Py_RETURN_NONE;
}

static void
ring_dealloc(Ring *self)
{
    if (self->has_view) {
        PyBuffer_Release(&self->view);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef ring_methods[] = {
    {"put", (PyCFunction)(void (*)(void))ring_put, METH_FASTCALL, put_doc},
    {"take", (PyCFunction)ring_take, METH_NOARGS, take_doc},
    {"pending", (PyCFunction)ring_pending, METH_NOARGS, pending_doc},
    {"sleep", (PyCFunction)ring_sleep, METH_NOARGS, sleep_doc},
    {"awake", (PyCFunction)ring_awake, METH_NOARGS, awake_doc},
    {"free", (PyCFunction)ring_free, METH_NOARGS, free_doc},
    {"close", (PyCFunction)ring_close, METH_NOARGS, close_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RingType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorbus.transports._shm.Ring",
    .tp_doc = PyDoc_STR("Ring(buffer, capacity, fresh=False): one side of a notification ring in `buffer`."),
    .tp_basicsize = sizeof(Ring),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)ring_init,
    .tp_dealloc = (destructor)ring_dealloc,
    .tp_methods = ring_methods,
};

/* FrameView: `length` bytes of a producer's segment from `offset`, read-only, as a buffer; when the last
 * view of it (memoryviews, arrays, anything over them) is gone, it calls `on_free(pos, length)`. The consumer's
 * readable twin is an ndarray from np.frombuffer with a weakref.finalize on it (shm_consumer.py): one object made
 * a frame instead of three, and no registry of finalizers. */
typedef struct {
    PyObject_HEAD
    Py_buffer source; /* the mapping's, held while this lives */
    int has_source;
    char *start;
    Py_ssize_t length;
    PyObject *on_free, *pos;
} FrameView;

static int
is_finalizing(void)
{
#if PY_VERSION_HEX >= 0x030D0000
    return Py_IsFinalizing();
#else
    return _Py_IsFinalizing();
#endif
}

static int
view_init(FrameView *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"mapped", "offset", "length", "on_free", "pos", NULL};
    PyObject *mapped, *on_free, *pos;
    Py_ssize_t offset, length;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OnnOO", names, &mapped, &offset, &length, &on_free, &pos)) {
        return -1;
    }
    if (self->has_source) {
        PyErr_SetString(PyExc_TypeError, "a FrameView is initialised once");
        return -1;
    }
    if (PyObject_GetBuffer(mapped, &self->source, PyBUF_SIMPLE) < 0) {
        return -1;
    }
    self->has_source = 1;
    if (offset < 0 || length <= 0 || offset > self->source.len - length) {
        PyErr_SetString(PyExc_ValueError, "a frame outside its segment");
        return -1;
    }
    self->start = (char *)self->source.buf + offset;
    self->length = length;
    Py_INCREF(on_free);
    Py_XSETREF(self->on_free, on_free);
    Py_INCREF(pos);
    Py_XSETREF(self->pos, pos);
    return 0;
}

static int
view_getbuffer(FrameView *self, Py_buffer *view, int flags)
{
    if (!self->has_source || self->on_free == NULL) {
        PyErr_SetString(PyExc_BufferError, "an uninitialised FrameView");
        return -1;
    }
    return PyBuffer_FillInfo(view, (PyObject *)self, self->start, self->length, 1, flags);
}

static PyBufferProcs view_as_buffer = {(getbufferproc)view_getbuffer, NULL};

static void
view_dealloc(FrameView *self)
{
    if (self->on_free != NULL && !is_finalizing()) { /* (as weakref.finalize's atexit=False: not at exit) */
        PyObject *error_type, *error, *trace;
        PyErr_Fetch(&error_type, &error, &trace);
        PyObject *length = PyLong_FromSsize_t(self->length);
        PyObject *result = length == NULL ? NULL : PyObject_CallFunctionObjArgs(self->on_free, self->pos, length, NULL);
        if (result == NULL) {
            PyErr_WriteUnraisable(self->on_free);
        }
        Py_XDECREF(result);
        Py_XDECREF(length);
        PyErr_Restore(error_type, error, trace);
    }
    if (self->has_source) {
        PyBuffer_Release(&self->source);
    }
    Py_XDECREF(self->on_free);
    Py_XDECREF(self->pos);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyTypeObject FrameViewType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorbus.transports._shm.FrameView",
    .tp_doc = PyDoc_STR("FrameView(mapped, offset, length, on_free, pos): a frame's bytes, read-only; "
                        "on_free(pos, length) once no view of it is left."),
    .tp_basicsize = sizeof(FrameView),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)view_init,
    .tp_dealloc = (destructor)view_dealloc,
    .tp_as_buffer = &view_as_buffer,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_shm", "shm://'s notification ring and frame views (see _shm.c).", -1, NULL,
};

PyMODINIT_FUNC
PyInit__shm(void)
{
    if (PyType_Ready(&RingType) < 0 || PyType_Ready(&FrameViewType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "Ring", (PyObject *)&RingType) < 0 ||
        PyModule_AddObjectRef(m, "FrameView", (PyObject *)&FrameViewType) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_HASH", TENSORBUS_SOURCE_HASH) < 0 ||
        PyModule_AddIntConstant(m, "ENTRIES_AT", ENTRIES_AT) < 0 ||
        PyModule_AddIntConstant(m, "ENTRY_BYTES", ENTRY_WORDS * sizeof(uint64_t)) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
