/* The intake's C delivery of plain frames, and the state it shares with the Python intake.
 *
 * tensorbus/intake_state.py describes the two state objects field by field and chooses these types or
 * their Python twins (one place). The Python intake (intake.py) owns an IntakeState; its `table` is the
 * consumer's Rendezvous, whose queues and counts are its TableState base. FastDelivery.take reads and
 * writes those fields, and nothing else of any Python class: it does, for the common frame, what
 * Intake.__call__, Reassembler.feed and Rendezvous.put do in Python, and leaves every other frame to them.
 *
 * It takes only the case with nothing to decide: a plain ndarray frame (the codec's decode_message says
 * so), its id not seen before, both locks free at once, the table not aborted and not full (nor the
 * share of the producer it came from, `source`, where the transport names one), no
 * recv_async callback first in line, a key that names no incarnation (fencing is Python's), no chunked
 * message part way (feeding the reassembler is what expires those). On anything else it changes nothing
 * and returns None, and the caller delivers the frame the Python way, which decides. It runs no Python
 * code, so a Ctrl-C lands before it or after it. What can fail (a MemoryError) fails before anything
 * changed, but for the table's own writes, as in Rendezvous.put: the id is then forgotten again, and
 * the reactor drops the connection, so the frame comes again.
 *
 * The two rules it shares with Python come from Python, once: which keys may name an incarnation
 * (keys.INCARNATION_SEPARATORS, given to configure) and the dedup window's eviction (oldest first,
 * as dedup.SeenIds does; tests/unit/test_fast_delivery.py compares the two).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>

#ifndef TENSORBUS_SOURCE_HASH
#define TENSORBUS_SOURCE_HASH "unknown"
#endif

/* set by configure() */
static PyObject *g_decode = NULL;    /* codec: _native.decode_message */
static PyObject *g_any = NULL;       /* intake_state.ANY, the waiter key of arrival-order receivers */
static PyObject *g_deque = NULL;     /* collections.deque */
static PyObject *g_handoff = NULL;   /* intake_state.Handoff: a waiter's callback this delivery hands messages to */
static Py_ssize_t g_separators = -1; /* a key with this many ';' may name an incarnation */
static PyObject *g_aligned_copy = NULL; /* codec: _native.aligned_copy (a record's bytes, 64-byte aligned) */
static PyObject *g_chunk_mark = NULL;   /* frame.CHUNK_MARK: the bytes a chunk's header begins with ... */
static Py_ssize_t g_chunk_at = -1;      /* ... this far into its frame */

static PyObject *s_acquire, *s_release, *s_popleft, *s_append, *s_pop, *s_popitem, *s_callback, *s_done, *s_result,
    *s_received, *s_buffered, *s_semicolon, *s_one, *s_zero, *s_error, *s_partition, *s_offset, *s_value, *s_complete;

/* ---- the state ------------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    PyObject *lock;                             /* _lock: an RLock guarding all of the below */
    PyObject *waiters;                          /* _waiters: {key or ANY: deque of Waiter} */
    PyObject *arrivals;                         /* _arrivals: OrderedDict {number: (message, bytes)} */
    PyObject *by_key;                           /* _by_key: {key: deque of numbers} */
    PyObject *by_source;                        /* _by_source: {source: bytes buffered}, sources with some */
    PyObject *buffered_bytes, *max_buffered_bytes, *max_source_bytes, *counter; /* ints */
    PyObject *taken;                            /* _taken: messages receives took from the table (an int) */
    PyObject *aborted;                          /* _aborted: None, or the Aborted error */
    PyObject *stats;                            /* a collections.Counter */
} TableState;

typedef struct {
    PyObject_HEAD
    PyObject *lock;         /* a Lock guarding seen, reassembling, interrupted and stats */
    PyObject *seen;         /* OrderedDict {message id: None}, oldest first, at most `window` */
    Py_ssize_t window;
    PyObject *reassembling; /* True while a chunked message is part way */
    PyObject *interrupted;  /* None, or a frame whose delivery was interrupted (Python delivers it again) */
    PyObject *stats;        /* a collections.Counter */
    PyObject *table;        /* a TableState (the consumer's Rendezvous) */
} IntakeState;

#define OBJ(type, field, name, doc) {name, T_OBJECT_EX, offsetof(type, field), 0, doc}

static PyMemberDef table_members[] = {
    OBJ(TableState, lock, "_lock", "RLock guarding the table"),
    OBJ(TableState, waiters, "_waiters", "key (or ANY) -> deque of Waiter"),
    OBJ(TableState, arrivals, "_arrivals", "arrival number -> (message, bytes counted, source)"),
    OBJ(TableState, by_key, "_by_key", "key -> deque of arrival numbers"),
    OBJ(TableState, by_source, "_by_source", "source -> bytes its buffered messages count"),
    OBJ(TableState, buffered_bytes, "buffered_bytes", "bytes of the buffered messages"),
    OBJ(TableState, max_buffered_bytes, "max_buffered_bytes", "the limit on buffered_bytes"),
    OBJ(TableState, max_source_bytes, "max_source_bytes", "the limit on one source's buffered bytes"),
    OBJ(TableState, counter, "_counter", "the last arrival number"),
    OBJ(TableState, taken, "_taken", "messages receives took from the table"),
    OBJ(TableState, aborted, "_aborted", "None, or the Aborted error"),
    OBJ(TableState, stats, "stats", "counts (a collections.Counter)"),
    {NULL, 0, 0, 0, NULL},
};

static PyMemberDef intake_members[] = {
    OBJ(IntakeState, lock, "lock", "Lock guarding the intake's fields"),
    OBJ(IntakeState, seen, "seen", "message id -> None, oldest first"),
    {"window", T_PYSSIZET, offsetof(IntakeState, window), 0, "how many ids `seen` keeps"},
    OBJ(IntakeState, reassembling, "reassembling", "True while a chunked message is part way"),
    OBJ(IntakeState, interrupted, "interrupted", "None, or a frame whose delivery was interrupted"),
    OBJ(IntakeState, stats, "stats", "counts (a collections.Counter)"),
    OBJ(IntakeState, table, "table", "the table (a TableState)"),
    {NULL, 0, 0, 0, NULL},
};

/* Both state types hold only the objects their members name (and `window`): traversed, cleared and
 * freed by walking their PyMemberDef tables. */
#define MEMBER(self, m) ((PyObject **)((char *)(self) + (m)->offset))

static PyTypeObject IntakeStateType;

static PyMemberDef *
members_of(PyObject *self)
{
    return PyObject_TypeCheck(self, &IntakeStateType) ? intake_members : table_members;
}

/* Visit each object member (`visit` NULL: clear it). */
static int
walk_members(PyObject *self, visitproc visit, void *arg)
{
    for (PyMemberDef *m = members_of(self); m->name != NULL; m++) {
        if (m->type != T_OBJECT_EX) {
            continue;
        }
        if (visit == NULL) {
            Py_CLEAR(*MEMBER(self, m));
        }
        else {
            Py_VISIT(*MEMBER(self, m));
        }
    }
    return 0;
}

static int
state_traverse(PyObject *self, visitproc visit, void *arg)
{
    return walk_members(self, visit, arg);
}

static int
state_clear(PyObject *self)
{
    return walk_members(self, NULL, NULL);
}

static void
state_dealloc(PyObject *self)
{
    PyObject_GC_UnTrack(self);
    state_clear(self);
    Py_TYPE(self)->tp_free(self); /* (a Python subclass's type is released by its own dealloc, after this) */
}

/* The two state types differ only in their fields, and the table's has its C take (`_take_buffered`). */
#define STATE_TYPE(name, fields, members_, methods_, doc)                                                            \
    {                                                                                                                \
        PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorbus._intake." name, .tp_basicsize = sizeof(fields),          \
        .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_BASETYPE, .tp_doc = PyDoc_STR(doc),         \
        .tp_new = PyType_GenericNew, .tp_dealloc = state_dealloc, .tp_traverse = state_traverse,                    \
        .tp_clear = state_clear, .tp_members = members_, .tp_methods = methods_,                                     \
    }

static PyObject *take_buffered(TableState *t, PyObject *const *args, Py_ssize_t nargs);

PyDoc_STRVAR(take_buffered_doc,
"_take_buffered(key, timeout)\n--\n\n"
"A receive of `key` (a str, or None) whose message is buffered already, as Rendezvous._wait takes it: the\n"
"oldest message of `key`, out of the table and counted as taken (the caller then hands it out). None\n"
"where it changed nothing, and the Python way decides: no such message, a timeout that is not a\n"
"plain number of seconds or None (Python says why), an aborted table, its lock held by another\n"
"thread, or a take that opens room in a full table or a producer's room at its share (what waits for\n"
"room is woken by Python). A message counted against its producer is uncounted here, as Python does.");

static PyMethodDef table_methods[] = {
    {"_take_buffered", (PyCFunction)(void (*)(void))take_buffered, METH_FASTCALL, take_buffered_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject TableStateType = STATE_TYPE("TableState", TableState, table_members, table_methods,
                                                "The rendezvous table's queues and counts (see intake_state.py).");
static PyTypeObject IntakeStateType = STATE_TYPE("IntakeState", IntakeState, intake_members, NULL,
                                                 "What the intake's C delivery reads and writes (see intake_state.py).");

/* ---- small helpers ---------------------------------------------------------------------------------------- */

static int
try_lock(PyObject *lock)
{
    PyObject *got = PyObject_CallMethodOneArg(lock, s_acquire, Py_False);
    int ok = got == Py_True;
    Py_XDECREF(got);
    return got == NULL ? -1 : ok;
}

static int
unlock(PyObject *lock)
{
    PyObject *r = PyObject_CallMethodNoArgs(lock, s_release);
    Py_XDECREF(r);
    return r == NULL ? -1 : 0;
}

/* counter[name] += 1 on a collections.Counter (a dict: its __missing__ is not called) */
static int
count(PyObject *counter, PyObject *name)
{
    PyObject *old = PyDict_GetItemWithError(counter, name);
    if (old == NULL && PyErr_Occurred()) {
        return -1;
    }
    PyObject *new = old == NULL ? Py_NewRef(s_one) : PyNumber_Add(old, s_one);
    int r = new == NULL ? -1 : PyDict_SetItem(counter, name, new);
    Py_XDECREF(new);
    return r;
}

/* count(), for a delivery already made: a count it cannot make (no memory) is not worth undoing it */
static void
counted(PyObject *counter, PyObject *name)
{
    if (count(counter, name) < 0) {
        PyErr_Clear();
    }
}

/* The queue of the receiver that gets a message of `key` (its own, else an arrival-order one), or NULL
 * (none waiting); borrowed. As Rendezvous.put looks. */
static PyObject *
waiting_queue(TableState *table, PyObject *key)
{
    if (!PyDict_Check(table->waiters) || PyDict_GET_SIZE(table->waiters) == 0) {
        return NULL;
    }
    PyObject *wanted[2] = {key, g_any};
    for (int i = 0; i < 2; i++) {
        PyObject *queue = PyDict_GetItemWithError(table->waiters, wanted[i]);
        if (queue == NULL && PyErr_Occurred()) {
            return NULL;
        }
        if (queue != NULL && PyObject_Length(queue) > 0) {
            return queue;
        }
    }
    return NULL;
}

/* ---- the table's C take ---------------------------------------------------------------------------------- */

/* Whether `timeout` is one Rendezvous._wait takes as it is: None, or a float or int of 0 seconds or more
 * (NaN compares false). Anything else goes the Python way, which raises the ConfigError. */
static int
plain_timeout(PyObject *timeout)
{
    if (timeout == Py_None) {
        return 1;
    }
    if (PyFloat_CheckExact(timeout)) {
        return PyFloat_AS_DOUBLE(timeout) >= 0.0;
    }
    if (!PyLong_CheckExact(timeout)) {
        return 0;
    }
    int overflow = 0;
    long long seconds = PyLong_AsLongLongAndOverflow(timeout, &overflow);
    return overflow > 0 || (overflow == 0 && seconds >= 0); /* (-1 with no error set is -1 seconds) */
}

static PyObject *
take_buffered(TableState *t, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "_take_buffered(key: str | None, timeout: float | None)");
        return NULL;
    }
    PyObject *key = args[0];
    if ((key != Py_None && !PyUnicode_CheckExact(key)) || !plain_timeout(args[1]) || t->lock == NULL ||
        t->arrivals == NULL || t->by_key == NULL || !PyDict_Check(t->by_key) || t->buffered_bytes == NULL ||
        t->max_buffered_bytes == NULL || t->taken == NULL || t->by_source == NULL || t->max_source_bytes == NULL ||
        !PyDict_Check(t->by_source) || t->aborted != Py_None) {
        Py_RETURN_NONE; /* (ANY, arrival order, is Python's too) */
    }
    int locked = try_lock(t->lock);
    if (locked <= 0) {
        return locked < 0 ? NULL : Py_NewRef(Py_None);
    }
    PyObject *result = NULL, *number = NULL, *entry = NULL, *left = NULL, *taken = NULL, *popped = NULL;
    PyObject *had = NULL, *source_left = NULL;
    PyObject *numbers = PyDict_GetItemWithError(t->by_key, key); /* (borrowed) */
    Py_ssize_t queued = numbers == NULL ? (PyErr_Occurred() ? -1 : 0) : PyObject_Length(numbers);
    if (queued <= 0 || t->aborted != Py_None) {
        result = queued < 0 ? NULL : Py_NewRef(Py_None);
        goto out;
    }
    /* first whatever can fail, while nothing has changed */
    if ((number = PySequence_GetItem(numbers, 0)) == NULL || (entry = PyObject_GetItem(t->arrivals, number)) == NULL) {
        goto out;
    }
    if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 3) {
        result = Py_NewRef(Py_None);
        goto out;
    }
    PyObject *nbytes = PyTuple_GET_ITEM(entry, 1), *source = PyTuple_GET_ITEM(entry, 2); /* (borrowed) */
    if ((left = PyNumber_Subtract(t->buffered_bytes, nbytes)) == NULL || (taken = PyNumber_Add(t->taken, s_one)) == NULL) {
        goto out;
    }
    int full = PyObject_RichCompareBool(t->buffered_bytes, t->max_buffered_bytes, Py_GE);
    int room = full > 0 ? PyObject_RichCompareBool(left, t->max_buffered_bytes, Py_LT) : 0;
    if (full < 0 || room < 0 || room) {
        result = full < 0 || room < 0 ? NULL : Py_NewRef(Py_None); /* room opens: Python wakes what waits for it */
        goto out;
    }
    /* a message counted against its producer (Rendezvous._uncount): what the source has left, unless that
     * opens the source's room (it was at its share: Python wakes what waits for it) */
    if (source != Py_None) {
        had = Py_XNewRef(PyDict_GetItemWithError(t->by_source, source)); /* (held: comparing it may run code) */
        if (had == NULL) {
            result = PyErr_Occurred() ? NULL : Py_NewRef(Py_None); /* (not counted after all: Python's to judge) */
            goto out;
        }
        if ((source_left = PyNumber_Subtract(had, nbytes)) == NULL) {
            goto out;
        }
        int at_share = PyObject_RichCompareBool(had, t->max_source_bytes, Py_GE);
        int opens = at_share > 0 ? PyObject_RichCompareBool(source_left, t->max_source_bytes, Py_LT) : 0;
        int gone = at_share >= 0 && opens == 0 ? PyObject_RichCompareBool(source_left, s_zero, Py_LE) : 0;
        if (at_share < 0 || opens < 0 || gone < 0 || opens) {
            result = at_share < 0 || opens < 0 || gone < 0 ? NULL : Py_NewRef(Py_None);
            goto out;
        }
        /* (a dict's existing key replaced or deleted: neither allocates) */
        if ((gone ? PyDict_DelItem(t->by_source, source) : PyDict_SetItem(t->by_source, source, source_left)) < 0) {
            goto out;
        }
    }
    /* then the writes, none of which fails: a deque that has the number, keys that are there */
    if ((popped = PyObject_CallMethodNoArgs(numbers, s_popleft)) == NULL || PyObject_DelItem(t->arrivals, number) < 0 ||
        (queued == 1 && PyDict_DelItem(t->by_key, key) < 0)) {
        goto out;
    }
    Py_SETREF(t->taken, Py_NewRef(taken));
    Py_SETREF(t->buffered_bytes, Py_NewRef(left));
    result = Py_NewRef(PyTuple_GET_ITEM(entry, 0));
out:
    Py_XDECREF(number);
    Py_XDECREF(entry);
    Py_XDECREF(left);
    Py_XDECREF(taken);
    Py_XDECREF(popped);
    Py_XDECREF(had);
    Py_XDECREF(source_left);
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback); /* (release() with an error set would turn it into a SystemError) */
    if (unlock(t->lock) < 0) {
        Py_CLEAR(result);
    }
    if (type != NULL) {
        PyErr_Restore(type, value, traceback);
    }
    return result;
}

/* ---- FastDelivery ------------------------------------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    IntakeState *state;
    PyObject *max_header, *max_payload, *max_ndim; /* the limits, as decode_message takes them */
    Py_ssize_t taken;                              /* frames delivered here (tests check it is used) */
} FastDelivery;

/* 1: the frame is in the table (or with its receiver), *taken its message; 0: nothing changed, deliver it
 * the Python way; -1: an error (also nothing changed, but for a MemoryError half way, which drops the
 * connection: the frame was not acknowledged, so it comes again, and a copy already taken is a duplicate). */
static int
fast_take(FastDelivery *self, PyObject *frame, PyObject *crc, PyObject *source, PyObject **taken, PyObject **taken_id)
{
    IntakeState *s = self->state;
    TableState *t = (TableState *)s->table;
    if (g_decode == NULL || s->lock == NULL || s->seen == NULL || s->stats == NULL || t->lock == NULL ||
        t->waiters == NULL || t->arrivals == NULL || t->by_key == NULL || t->buffered_bytes == NULL ||
        t->max_buffered_bytes == NULL || t->counter == NULL || t->stats == NULL || t->by_source == NULL ||
        t->max_source_bytes == NULL || !PyDict_Check(s->seen) || !PyDict_Check(t->by_key) ||
        !PyDict_Check(t->waiters) || !PyDict_Check(t->by_source)) {
        return 0; /* not set up (yet): the Python way */
    }
    PyObject *args[5] = {frame, crc, self->max_header, self->max_payload, self->max_ndim};
    PyObject *decoded = PyObject_Vectorcall(g_decode, args, 5, NULL);
    if (decoded == NULL || decoded == Py_None) {
        Py_XDECREF(decoded);
        return decoded == NULL ? -1 : 0;
    }
    PyObject *msg = PyTuple_GET_ITEM(decoded, 0), *key = PyTuple_GET_ITEM(decoded, 1);
    PyObject *id = PyTuple_GET_ITEM(decoded, 2), *size = PyTuple_GET_ITEM(decoded, 3);
    Py_ssize_t separators = key == Py_None ? 0 : PyUnicode_Count(key, s_semicolon, 0, PY_SSIZE_T_MAX);
    if (separators < 0 || separators == g_separators || id == Py_None) { /* fencing is Python's; no id: no dedup */
        Py_DECREF(decoded);
        return separators < 0 ? -1 : 0;
    }
    int result = 0, intake_locked = 0, table_locked = 0, ok = 1, handoff = 0;
    PyObject *waiter = NULL, *done = NULL, *number = NULL, *entry = NULL, *fresh = NULL, *queue, *keyed = NULL;
    PyObject *more = NULL, *share = NULL;
    if ((intake_locked = try_lock(s->lock)) <= 0 || (table_locked = try_lock(t->lock)) <= 0) {
        result = intake_locked < 0 || table_locked < 0 ? -1 : 0;
        goto out;
    }
    if (s->reassembling != Py_False || s->interrupted != Py_None || t->aborted != Py_None ||
        (ok = PyDict_Contains(s->seen, id)) != 0) {
        result = ok < 0 ? -1 : 0; /* (contains: 1 is a duplicate: Python counts it) */
        goto out;
    }
    if ((queue = waiting_queue(t, key)) == NULL && PyErr_Occurred()) {
        result = -1;
        goto out;
    }
    /* first whatever can fail, while nothing has changed */
    if (queue != NULL) { /* a receiver is waiting: it gets the message, which needs no room */
        PyObject *callback = NULL;
        if ((waiter = PySequence_GetItem(queue, 0)) == NULL || (callback = PyObject_GetAttr(waiter, s_callback)) == NULL) {
            result = -1;
            goto out;
        }
        ok = callback == Py_None;
        handoff = !ok && g_handoff != NULL && PyObject_TypeCheck(callback, (PyTypeObject *)g_handoff); /* (or a subclass: tensorbus.aio's receive) */
        Py_DECREF(callback);
        if (!ok && !handoff) { /* (a recv_async callback runs the application's Python: Python calls it) */
            result = 0;
            goto out;
        }
        if (!handoff && (done = PyObject_GetAttr(waiter, s_done)) == NULL) {
            result = -1;
            goto out;
        }
    }
    else {
        ok = PyObject_RichCompareBool(t->buffered_bytes, t->max_buffered_bytes, Py_LT);
        if (ok > 0 && source != Py_None) { /* the source's share, as Rendezvous._has_room_for */
            PyObject *had = PyDict_GetItemWithError(t->by_source, source); /* (borrowed) */
            ok = had == NULL ? (PyErr_Occurred() ? -1 : 1) : PyObject_RichCompareBool(had, t->max_source_bytes, Py_LT);
            share = ok <= 0 ? NULL : had == NULL ? Py_NewRef(size) : PyNumber_Add(had, size);
            ok = ok > 0 && share == NULL ? -1 : ok;
        }
        if (ok <= 0) { /* full (or the source's share is): Python holds it back */
            result = ok;
            goto out;
        }
        more = PyNumber_Add(t->buffered_bytes, size);
        number = more == NULL ? NULL : PyNumber_Add(t->counter, s_one);
        entry = number == NULL ? NULL : PyTuple_Pack(3, msg, size, source);
        keyed = entry == NULL ? NULL : PyDict_GetItemWithError(t->by_key, key); /* (borrowed) */
        if (keyed == NULL && entry != NULL && !PyErr_Occurred()) {
            keyed = fresh = PyObject_CallNoArgs(g_deque);
        }
        if (keyed == NULL) {
            result = -1;
            goto out;
        }
    }
    /* from here on it is taken: first marked as seen (a copy sent again meanwhile is a duplicate), and
     * forgotten again should anything below fail (a MemoryError: the connection is dropped, the frame
     * comes again, and must not then pass for a duplicate); the oldest id past the window goes, as
     * SeenIds.add does */
    if (PyObject_SetItem(s->seen, id, Py_None) < 0) {
        result = -1;
        goto out;
    }
    ok = 1;
    if (PyDict_GET_SIZE(s->seen) > s->window) {
        PyObject *oldest = PyObject_CallMethodOneArg(s->seen, s_popitem, Py_False);
        ok = oldest != NULL;
        Py_XDECREF(oldest);
    }
    if (ok && waiter != NULL) { /* (none of these fail: a slot, a deque that has it, a key that is there, a held lock) */
        PyObject *popped = NULL;
        ok = PyObject_SetAttr(waiter, s_result, msg) == 0 && (popped = PyObject_CallMethodNoArgs(queue, s_popleft));
        Py_XDECREF(popped);
        if (ok && PyObject_Length(queue) == 0) {
            PyObject *wanted = PyDict_GetItemWithError(t->waiters, key) == queue ? key : g_any;
            ok = PyDict_DelItem(t->waiters, wanted) == 0;
        }
        ok = ok && (handoff || unlock(done) == 0); /* (a Handoff is called below, the locks let go) */
    }
    else if (ok) { /* four writes that may allocate, each undone should a later one fail; then two that do not */
        int placed = PyObject_SetItem(t->arrivals, number, entry) == 0;
        int keyed_here = placed && (fresh == NULL || PyDict_SetItem(t->by_key, key, fresh) == 0);
        PyObject *appended = keyed_here ? PyObject_CallMethodOneArg(keyed, s_append, number) : NULL;
        int shared = appended != NULL && (share == NULL || PyDict_SetItem(t->by_source, source, share) == 0);
        ok = shared;
        if (!ok) {
            PyObject *type, *value, *traceback, *popped = NULL;
            PyErr_Fetch(&type, &value, &traceback);
            if ((appended != NULL && (popped = PyObject_CallMethodNoArgs(keyed, s_pop)) == NULL) ||
                (keyed_here && fresh != NULL && PyDict_DelItem(t->by_key, key) < 0) ||
                (placed && PyObject_DelItem(t->arrivals, number) < 0)) {
                PyErr_Clear();
            }
            Py_XDECREF(popped);
            PyErr_Restore(type, value, traceback);
        }
        else {
            Py_SETREF(t->counter, Py_NewRef(number));
            Py_SETREF(t->buffered_bytes, Py_NewRef(more));
            counted(t->stats, s_buffered);
        }
        Py_XDECREF(appended);
    }
    if (ok) {
        counted(s->stats, s_received);
        result = 1;
        self->taken++;
        *taken = Py_NewRef(msg);
        if (taken_id != NULL) {
            *taken_id = Py_NewRef(id);
        }
    }
    else {
        result = -1;
        PyObject *type, *value, *traceback;
        PyErr_Fetch(&type, &value, &traceback);
        if (PyObject_DelItem(s->seen, id) < 0) {
            PyErr_Clear();
        }
        PyErr_Restore(type, value, traceback);
    }
out:
    Py_XDECREF(done);
    Py_XDECREF(number);
    Py_XDECREF(entry);
    Py_XDECREF(fresh);
    Py_XDECREF(more);
    Py_XDECREF(share);
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback); /* (release() with an error set would turn it into a SystemError) */
    if (table_locked > 0 && unlock(t->lock) < 0) {
        result = -1;
    }
    if (intake_locked > 0 && unlock(s->lock) < 0) {
        result = -1;
    }
    if (type != NULL) {
        PyErr_Restore(type, value, traceback); /* the first error is the one reported */
    }
    if (result == 1 && handoff) { /* as Rendezvous.put, outside the locks: the Handoff's callback runs Python */
        PyObject *completed = PyObject_CallMethodObjArgs(s->table, s_complete, waiter, msg, NULL);
        result = completed == NULL ? -1 : 1; /* (CallbackInterrupted: the callback had it, as in Python) */
        Py_XDECREF(completed);
    }
    Py_XDECREF(waiter);
    Py_DECREF(decoded);
    return result;
}

PyDoc_STRVAR(fast_take_doc,
"take(frame, crc, source=None)\n--\n\n"
"Deliver a whole received frame (a memoryview handed over; crc as the stream reader gives it; source:\n"
"the producer it came from, whose share of the table it counts against): its Message once it is in\n"
"the table or with its receiver; None when it changed nothing (deliver it the Python way).");

static PyObject *
fast_take_method(FastDelivery *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs < 2 || nargs > 3 || !PyMemoryView_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "take(frame: memoryview, crc: int | None, source: object = None)");
        return NULL;
    }
    PyObject *taken = NULL;
    int r = fast_take(self, args[0], args[1], nargs == 3 ? args[2] : Py_None, &taken, NULL);
    if (r < 0) {
        Py_XDECREF(taken);
        return NULL;
    }
    return r ? taken : Py_NewRef(Py_None);
}

/* A broker record's whole plain frame, 64-byte aligned (a new reference), or NULL: a record this run stops at
 * (an error, another partition, an offset out of turn, no value, a chunk), or an error (set). */
static PyObject *
record_frame(PyObject *record, PyObject *partition, long long offset)
{
    PyObject *got = PyObject_CallMethodNoArgs(record, s_error);
    int ok = got == Py_None;
    Py_XDECREF(got);
    if (ok && (got = PyObject_CallMethodNoArgs(record, s_partition)) != NULL) {
        ok = PyObject_RichCompareBool(got, partition, Py_EQ);
        Py_DECREF(got);
    }
    if (ok > 0 && (got = PyObject_CallMethodNoArgs(record, s_offset)) != NULL) {
        ok = PyLong_Check(got) && PyLong_AsLongLong(got) == offset;
        Py_DECREF(got);
    }
    PyObject *value = ok > 0 ? PyObject_CallMethodNoArgs(record, s_value) : NULL;
    if (value == NULL || !PyBytes_CheckExact(value) || PyBytes_GET_SIZE(value) == 0) {
        Py_XDECREF(value);
        return NULL;
    }
    Py_ssize_t mark = PyBytes_GET_SIZE(g_chunk_mark);
    if (PyBytes_GET_SIZE(value) >= g_chunk_at + mark &&
        memcmp(PyBytes_AS_STRING(value) + g_chunk_at, PyBytes_AS_STRING(g_chunk_mark), (size_t)mark) == 0) {
        Py_DECREF(value); /* a chunk: the reassembler's, and not worth an aligned copy */
        return NULL;
    }
    PyObject *frame = PyObject_CallOneArg(g_aligned_copy, value);
    Py_DECREF(value);
    return frame;
}

PyDoc_STRVAR(take_records_doc,
"take_records(records, partition, offset)\n--\n\n"
"Deliver the run of broker records at the left of `records` (a deque of confluent_kafka Messages, the first\n"
"at `offset` of `partition`) that take() takes one after the other: each without an error, of `partition`,\n"
"at the offset after the one before, a whole plain frame (its bytes copied to a 64-byte aligned buffer, as\n"
"kafka_offsets.take_record does). Each taken record leaves `records`; the run stops at the first that is\n"
"not, left there for the Python way. Returns the taken messages' ids, in order (empty: the first was not\n"
"taken). An error raises only if nothing was taken yet; after, the run ends before the record it met.");

static PyObject *
fast_take_records_method(FastDelivery *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3 || !PyObject_TypeCheck(args[0], (PyTypeObject *)g_deque) || !PyLong_Check(args[2])) {
        PyErr_SetString(PyExc_TypeError, "take_records(records: deque, partition: int, offset: int)");
        return NULL;
    }
    if (g_aligned_copy == NULL || g_chunk_mark == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "take_records: configure() first");
        return NULL;
    }
    PyObject *records = args[0], *partition = args[1], *ids = PyList_New(0);
    long long offset = PyLong_AsLongLong(args[2]);
    if (ids == NULL || (offset == -1 && PyErr_Occurred())) {
        Py_XDECREF(ids);
        return NULL;
    }
    while (PyObject_Length(records) > 0) {
        PyObject *record = PySequence_GetItem(records, 0), *frame = NULL, *taken = NULL, *id = NULL, *popped = NULL;
        frame = record == NULL ? NULL : record_frame(record, partition, offset);
        Py_XDECREF(record);
        int r = frame == NULL ? (PyErr_Occurred() ? -1 : 0) : fast_take(self, frame, Py_None, Py_None, &taken, &id);
        Py_XDECREF(frame);
        Py_XDECREF(taken);
        if (r > 0 && (PyList_Append(ids, id) < 0 || (popped = PyObject_CallMethodNoArgs(records, s_popleft)) == NULL)) {
            r = -1; /* (no memory for the id: the record stays, and its id is a duplicate when it comes again) */
        }
        Py_XDECREF(id);
        Py_XDECREF(popped);
        if (r <= 0) {
            if (r < 0 && PyList_GET_SIZE(ids) == 0) {
                Py_DECREF(ids);
                return NULL;
            }
            PyErr_Clear(); /* (after records were taken: they are booked first, and this record is met again) */
            break;
        }
        offset++;
    }
    return ids;
}

static int
fast_init(FastDelivery *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"state", "max_header_bytes", "max_payload_bytes", "max_ndim", NULL};
    PyObject *state, *header, *payload, *ndim;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "O!O!O!O!:FastDelivery", names, &IntakeStateType, &state,
                                     &PyLong_Type, &header, &PyLong_Type, &payload, &PyLong_Type, &ndim)) {
        return -1;
    }
    PyObject *table = ((IntakeState *)state)->table;
    if (table == NULL || !PyObject_TypeCheck(table, &TableStateType)) {
        PyErr_SetString(PyExc_TypeError, "FastDelivery: state.table must be a TableState");
        return -1;
    }
    Py_XSETREF(self->state, (IntakeState *)Py_NewRef(state));
    Py_XSETREF(self->max_header, Py_NewRef(header));
    Py_XSETREF(self->max_payload, Py_NewRef(payload));
    Py_XSETREF(self->max_ndim, Py_NewRef(ndim));
    return 0;
}

static int
fast_traverse(FastDelivery *self, visitproc visit, void *arg)
{
    Py_VISIT(self->state);
    return 0;
}

static int
fast_clear(FastDelivery *self)
{
    Py_CLEAR(self->state);
    Py_CLEAR(self->max_header);
    Py_CLEAR(self->max_payload);
    Py_CLEAR(self->max_ndim);
    return 0;
}

static void
fast_dealloc(FastDelivery *self)
{
    PyObject_GC_UnTrack(self);
    fast_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
get_taken(FastDelivery *self, void *closure)
{
    return PyLong_FromSsize_t(self->taken);
}

static PyMethodDef fast_methods[] = {
    {"take", (PyCFunction)(void (*)(void))fast_take_method, METH_FASTCALL, fast_take_doc},
    {"take_records", (PyCFunction)(void (*)(void))fast_take_records_method, METH_FASTCALL, take_records_doc},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef fast_getset[] = {
    {"taken", (getter)get_taken, NULL, "frames delivered here", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject FastDeliveryType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorbus._intake.FastDelivery",
    .tp_basicsize = sizeof(FastDelivery),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = PyDoc_STR("FastDelivery(state, max_header_bytes, max_payload_bytes, max_ndim)\n--\n\n"
                        "The C delivery of plain frames into an intake's table (see _intake.c)."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)fast_init,
    .tp_dealloc = (destructor)fast_dealloc,
    .tp_traverse = (traverseproc)fast_traverse,
    .tp_clear = (inquiry)fast_clear,
    .tp_methods = fast_methods,
    .tp_getset = fast_getset,
};

/* ---- Wakeup: a receive's wait, spinning without the GIL -------------------------------------------------- */

/* A receive that waits for another thread of its process (memory://'s producer delivering into its table)
 * would sleep on a lock, and a sleeping thread wakes late (tens of µs on an idle vCPU, ~100 on this VM), and
 * twice: once for the lock, once more for the GIL its waker still holds. This wait spins instead for
 * `spin_s`, without the GIL (so the thread it waits for runs meanwhile), and only then sleeps; once rung it
 * spins on, without the GIL still, until its ringer let go of the GIL (`g_let_go` moved: a thread entered a
 * wait here, which lets go first) or HANDOVER_NS passed (a ringer that blocks elsewhere lets go of the GIL
 * unseen; one that goes on running keeps it), so that it takes the GIL without sleeping for it. Each turn of
 * a spin yields the CPU to any thread ready to run on it: on a loaded machine, the thread it waits for may be
 * the one waiting for that CPU. A spin that ran out (the ring came later, or not) halves the next one, down
 * to none, and one rung while spinning restores spin_s: where rings come late (a loaded machine, a receive
 * between long computations) waits sleep at once, as a lock's would, trying a spin again now and then.
 * A wait with spin_s 0 (a background thread) sleeps at once and takes the GIL as any thread does.
 * transports/wakeup.py has its Python twin (a lock, which cannot spin: a Python loop holds the GIL). */

#define WAKEUP_NAP_NS 50000000LL /* the main thread's longest sleep between looks at pending signals (Ctrl-C) */
#define HANDOVER_NS 50000LL      /* the longest a rung wait spins for its ringer to let go of the GIL */
#define SPIN_HALVINGS 6          /* spins that ran out in a row before waits sleep at once (1 ms: 16 µs, then 0) */
#define SPIN_AGAIN_EVERY 64      /* ... and of the waits that then sleep at once, each this many-th spins again */

/* waits entered here so far, each having let go of the GIL: a change tells a rung wait that the GIL was let go */
static _Atomic uint64_t g_let_go = 0;
/* the main thread (threading.main_thread()), the one that handles signals: its waits nap */
static unsigned long g_main_thread = 0;

/* threading.main_thread().ident into g_main_thread; -1 with an error */
static int
find_main_thread(void)
{
    PyObject *threading = PyImport_ImportModule("threading");
    PyObject *main = threading == NULL ? NULL : PyObject_CallMethod(threading, "main_thread", NULL);
    PyObject *ident = main == NULL ? NULL : PyObject_GetAttrString(main, "ident");
    if (ident != NULL) {
        g_main_thread = PyLong_AsUnsignedLong(ident);
    }
    Py_XDECREF(ident);
    Py_XDECREF(main);
    Py_XDECREF(threading);
    return ident == NULL || PyErr_Occurred() ? -1 : 0;
}

typedef struct {
    PyObject_HEAD
    _Atomic int rung;         /* ring() was called, and no wait has returned True for it yet */
    _Atomic uint64_t rung_at; /* g_let_go when it was rung */
    _Atomic int sleeping;     /* a wait sleeps on `cond` (written under `mutex`) */
    _Atomic int halvings;     /* the next wait spins spin_s halved this often (SPIN_HALVINGS: not at all) */
    _Atomic int unspun;       /* waits that did not spin since the last that did */
    int ready;                /* mutex and cond were made (and are destroyed with it) */
    pthread_mutex_t mutex;
    pthread_cond_t cond; /* on CLOCK_MONOTONIC */
} Wakeup;

static int64_t
monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* One turn of a spin: the CPU told so, and any other thread ready to run on it runs first (on a loaded
 * machine the thread this spin waits for may be that one; on a quiet one this returns at once) */
static inline void
spin_turn(void)
{
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#elif defined(__aarch64__)
    __asm__ __volatile__("yield");
#endif
    sched_yield();
}

/* seconds -> ns: None or a negative value is no limit (-1); NaN is refused */
static int
wakeup_ns(PyObject *arg, int64_t *out)
{
    if (arg == Py_None) {
        *out = -1;
        return 0;
    }
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    if (seconds != seconds) {
        PyErr_SetString(PyExc_ValueError, "Wakeup.wait: NaN seconds");
        return -1;
    }
    *out = seconds < 0 ? -1 : seconds >= 4.6e9 ? (1LL << 62) : (int64_t)(seconds * 1e9);
    return 0;
}

static PyObject *
wakeup_new(PyTypeObject *type, PyObject *args, PyObject *kwds)
{
    if (PyTuple_GET_SIZE(args) != 0 || (kwds != NULL && PyDict_GET_SIZE(kwds) != 0)) {
        PyErr_SetString(PyExc_TypeError, "Wakeup() takes no arguments");
        return NULL;
    }
    Wakeup *self = (Wakeup *)type->tp_alloc(type, 0); /* (zeroed: not rung, nobody sleeping) */
    if (self == NULL) {
        return NULL;
    }
    pthread_condattr_t attr;
    int err = pthread_condattr_init(&attr);
    if (err == 0) {
        err = pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
        if (err == 0 && (err = pthread_mutex_init(&self->mutex, NULL)) == 0 &&
            (err = pthread_cond_init(&self->cond, &attr)) != 0) {
            pthread_mutex_destroy(&self->mutex);
        }
        pthread_condattr_destroy(&attr);
    }
    if (err != 0) {
        Py_DECREF(self);
        errno = err;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    self->ready = 1;
    return (PyObject *)self;
}

static void
wakeup_dealloc(Wakeup *self)
{
    if (self->ready) {
        pthread_cond_destroy(&self->cond);
        pthread_mutex_destroy(&self->mutex);
    }
    Py_TYPE(self)->tp_free((PyObject *)self);
}

PyDoc_STRVAR(wakeup_ring_doc, "ring()\n--\n\n"
                              "Make the wait waiting now, or else the next one, return True (a ring while rung "
                              "already is one ring).");

static PyObject *
wakeup_ring(Wakeup *self, PyObject *Py_UNUSED(ignored))
{
    atomic_store(&self->rung_at, atomic_load(&g_let_go));
    atomic_store(&self->rung, 1);
    /* (both sequentially consistent: a wait that set `sleeping` before this looked finds `rung`, or is signalled) */
    if (atomic_load(&self->sleeping) && self->ready) {
        pthread_mutex_lock(&self->mutex);
        pthread_cond_signal(&self->cond);
        pthread_mutex_unlock(&self->mutex);
    }
    Py_RETURN_NONE;
}

/* 1 if rung, and the ring is now consumed (the load first: a spin reads, and writes only once rung) */
static inline int
take_ring(Wakeup *self)
{
    return atomic_load(&self->rung) && atomic_exchange(&self->rung, 0);
}

/* Sleep on `cond` until rung or `until` (ns, -1: no limit) or, with `nap`, WAKEUP_NAP_NS passed; 1 if rung
 * (consumed). */
static int
wakeup_sleep(Wakeup *self, int64_t until, int nap)
{
    int64_t nap_end = nap ? monotonic_ns() + WAKEUP_NAP_NS : until;
    if (until >= 0 && until < nap_end) {
        nap_end = until;
    }
    struct timespec ts = {(time_t)(nap_end / 1000000000LL), (long)(nap_end % 1000000000LL)};
    int rung = 0;
    pthread_mutex_lock(&self->mutex);
    atomic_store(&self->sleeping, 1);
    while (!(rung = take_ring(self))) {
        if (nap_end < 0) {
            pthread_cond_wait(&self->cond, &self->mutex);
        }
        else if (pthread_cond_timedwait(&self->cond, &self->mutex, &ts) == ETIMEDOUT) {
            rung = take_ring(self);
            break;
        }
    }
    atomic_store(&self->sleeping, 0);
    pthread_mutex_unlock(&self->mutex);
    return rung;
}

/* How long this wait spins: spin_s, halved once per spin that ran out in a row, or none (but every
 * SPIN_AGAIN_EVERY-th wait then) */
static int64_t
spin_budget(Wakeup *self, int64_t spin)
{
    if (spin <= 0) {
        return 0;
    }
    int halvings = atomic_load_explicit(&self->halvings, memory_order_relaxed);
    if (halvings < SPIN_HALVINGS) {
        return spin >> halvings;
    }
    if (atomic_fetch_add_explicit(&self->unspun, 1, memory_order_relaxed) + 1 < SPIN_AGAIN_EVERY) {
        return 0;
    }
    atomic_store_explicit(&self->unspun, 0, memory_order_relaxed);
    return spin;
}

/* A spin was rung (the next spins in full) or ran out (the next is halved) */
static void
spun(Wakeup *self, int rung)
{
    int halvings = atomic_load_explicit(&self->halvings, memory_order_relaxed);
    int next = rung ? 0 : halvings < SPIN_HALVINGS ? halvings + 1 : SPIN_HALVINGS;
    atomic_store_explicit(&self->halvings, next, memory_order_relaxed);
}

PyDoc_STRVAR(wakeup_wait_doc,
             "wait(timeout_s=None, spin_s=0.0) -> bool\n--\n\n"
             "Wait until rung (True) or timeout_s passed (False; None: no limit), without the GIL: spinning for "
             "spin_s first (less after spins that ran out: see _intake.c), then sleeping; once rung (with spin_s), "
             "spinning on until the ringer let go of the GIL (50 µs at most).");

static PyObject *
wakeup_wait(Wakeup *self, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs > 2) {
        PyErr_SetString(PyExc_TypeError, "Wakeup.wait takes at most 2 arguments (timeout_s, spin_s)");
        return NULL;
    }
    int64_t timeout, spin;
    if (wakeup_ns(nargs > 0 ? args[0] : Py_None, &timeout) < 0 || wakeup_ns(nargs > 1 ? args[1] : Py_None, &spin) < 0) {
        return NULL;
    }
    int rung = 0;
    int64_t spin_now = spin_budget(self, spin); /* (the first pass alone spins: after a nap it sleeps again) */
    int nap = PyThread_get_thread_ident() == g_main_thread; /* (only the main thread handles signals) */
    for (;;) {
        int64_t now;
        Py_BEGIN_ALLOW_THREADS
        atomic_fetch_add(&g_let_go, 1);
        now = monotonic_ns();
        int64_t until = timeout < 0 ? -1 : timeout > INT64_MAX - now ? INT64_MAX : now + timeout;
        int64_t spin_until = spin_now <= 0 ? now : until >= 0 && until - now < spin_now ? until : now + spin_now;
        while (!(rung = take_ring(self)) && now < spin_until) {
            spin_turn();
            now = monotonic_ns();
        }
        if (spin_now > 0) {
            spun(self, rung);
        }
        if (!rung && (until < 0 || now < until)) {
            rung = wakeup_sleep(self, until, nap);
            now = monotonic_ns();
        }
        if (rung && spin > 0) { /* the ringer may hold the GIL still: take it once let go, not sleeping for it */
            uint64_t rung_at = atomic_load(&self->rung_at);
            int64_t handover_until = now + HANDOVER_NS;
            while (atomic_load(&g_let_go) == rung_at && now < handover_until) {
                spin_turn();
                now = monotonic_ns();
            }
        }
        if (until >= 0) {
            timeout = until > now ? until - now : 0;
        }
        Py_END_ALLOW_THREADS
        if (rung || timeout == 0) {
            break;
        }
        if (PyErr_CheckSignals() < 0) { /* a nap ended: Ctrl-C is heard (on the main thread) */
            return NULL;
        }
        spin_now = 0;
    }
    return PyBool_FromLong(rung);
}

static PyObject *
wakeup_get_halvings(Wakeup *self, void *Py_UNUSED(closure))
{
    return PyLong_FromLong(atomic_load_explicit(&self->halvings, memory_order_relaxed));
}

static PyGetSetDef wakeup_getset[] = {
    {"halvings", (getter)wakeup_get_halvings, NULL,
     PyDoc_STR("how often the next wait's spin is halved: 0 after a spin that was rung, one more after each that ran "
               "out, up to _intake.c's SPIN_HALVINGS (the wait then sleeps at once)"),
     NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyMethodDef wakeup_methods[] = {
    {"ring", (PyCFunction)wakeup_ring, METH_NOARGS, wakeup_ring_doc},
    {"wait", (PyCFunction)(void (*)(void))wakeup_wait, METH_FASTCALL, wakeup_wait_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject WakeupType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorbus._intake.Wakeup",
    .tp_basicsize = sizeof(Wakeup),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("Wakeup()\n--\n\nA receive's wait for a ring from another thread, spinning without the GIL "
                        "first (see _intake.c)."),
    .tp_new = wakeup_new,
    .tp_dealloc = (destructor)wakeup_dealloc,
    .tp_methods = wakeup_methods,
    .tp_getset = wakeup_getset,
};

/* ---- module ------------------------------------------------------------------------------------------------ */

PyDoc_STRVAR(configure_doc,
"configure(decode_message, any, deque_type, incarnation_separators, aligned_copy, chunk_at, chunk_mark,\n"
"          handoff_type)\n--\n\n"
"Hand over what FastDelivery takes from Python: the codec's decode_message, the arrival-order waiter\n"
"key, collections.deque, how many ';' a key that may name an incarnation has, the codec's aligned_copy,\n"
"where and with what bytes a chunk's header begins (frame.CHUNK_MARK), and intake_state.Handoff (a\n"
"waiter with such a callback gets its message from the C delivery too, by the table's _complete).");

static PyObject *
configure(PyObject *self, PyObject *args)
{
    PyObject *decode, *any, *deque, *aligned_copy, *chunk_mark, *handoff;
    Py_ssize_t separators, chunk_at;
    if (!PyArg_ParseTuple(args, "OOO!nOnO!O!:configure", &decode, &any, &PyType_Type, &deque, &separators,
                          &aligned_copy, &chunk_at, &PyBytes_Type, &chunk_mark, &PyType_Type, &handoff)) {
        return NULL;
    }
    if (chunk_at < 0) {
        PyErr_SetString(PyExc_ValueError, "configure: chunk_at must be 0 or more");
        return NULL;
    }
    Py_XSETREF(g_aligned_copy, Py_NewRef(aligned_copy));
    Py_XSETREF(g_chunk_mark, Py_NewRef(chunk_mark));
    g_chunk_at = chunk_at;
    Py_XSETREF(g_handoff, Py_NewRef(handoff));
    Py_XSETREF(g_decode, Py_NewRef(decode));
    Py_XSETREF(g_any, Py_NewRef(any));
    Py_XSETREF(g_deque, Py_NewRef(deque));
    g_separators = separators;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", configure, METH_VARARGS, configure_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_intake", "The intake's C delivery of plain frames (see _intake.c).", -1, methods,
};

PyMODINIT_FUNC
PyInit__intake(void)
{
    struct {
        PyObject **slot;
        const char *text;
    } names[] = {
        {&s_acquire, "acquire"}, {&s_release, "release"}, {&s_popleft, "popleft"},
        {&s_append, "append"},   {&s_pop, "pop"},         {&s_popitem, "popitem"}, {&s_callback, "callback"}, {&s_done, "done"},
        {&s_result, "result"},   {&s_received, "received"}, {&s_buffered, "buffered"}, {&s_semicolon, ";"},
        {&s_error, "error"},     {&s_partition, "partition"}, {&s_offset, "offset"}, {&s_value, "value"},
        {&s_complete, "_complete"},
    };
    for (size_t i = 0; i < sizeof names / sizeof names[0]; i++) {
        if ((*names[i].slot = PyUnicode_InternFromString(names[i].text)) == NULL) {
            return NULL;
        }
    }
    if (find_main_thread() < 0 || (s_one = PyLong_FromLong(1)) == NULL || (s_zero = PyLong_FromLong(0)) == NULL ||
        PyType_Ready(&TableStateType) < 0 || PyType_Ready(&IntakeStateType) < 0 || PyType_Ready(&FastDeliveryType) < 0 ||
        PyType_Ready(&WakeupType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && (PyModule_AddObjectRef(m, "TableState", (PyObject *)&TableStateType) < 0 ||
                      PyModule_AddObjectRef(m, "IntakeState", (PyObject *)&IntakeStateType) < 0 ||
                      PyModule_AddObjectRef(m, "FastDelivery", (PyObject *)&FastDeliveryType) < 0 ||
                      PyModule_AddObjectRef(m, "Wakeup", (PyObject *)&WakeupType) < 0 ||
                      PyModule_AddStringConstant(m, "SOURCE_HASH", TENSORBUS_SOURCE_HASH) < 0)) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
