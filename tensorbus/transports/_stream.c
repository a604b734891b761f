/* The stream sockets' per-frame work in C: the consumer's per-connection frame reader (StreamReader),
 * the producer's send of one frame (send_frame), and the consumer's background reader's timer (IdleTimer).
 *
 * The reader turns bytes off a non-blocking stream socket into whole frames: the state machine of
 * reader.py's Python reader (`PyStreamReader.read`), minus its per-frame interpreter work.
 *
 * It reads ahead (one system call for several small frames), sizes each frame from its prefix,
 * receives it into one buffer (large frames straight into place, checksummed slice by slice while
 * in cache), and moves a CRC sent after the frame (stream.py, TRAILING_CRC) into place. Whatever is
 * not the common case goes back to Python as an event: an ack request, a prefix that is over the
 * limits or not a frame at all (Python decides, with frame.frame_length's own errors), the end of
 * the stream. TLS connections are read in Python.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <limits.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>

#include "../codec/_frame.h"

#define TRAILING_CRC 0x80
#define CRC_TRAILER 4
/* bytes read at once while a prefix is wanted after a frame below LARGE_FRAME: many small frames per system
 * call (FAIR_SHARE, the most the reactor takes from one connection in a row, are 1 MiB of 64 KB ones); a
 * connection holds it only while it holds unread bytes */
#define READ_AHEAD (1 << 20)
/* after a frame of LARGE_FRAME bytes or more, the read-ahead for the next prefix is only SHORT_READ_AHEAD
 * bytes (its prefix, its header and a little of its body): the rest of such a frame is then received
 * straight into place, not read ahead and copied over; below SCATTER_BELOW the system call that receives
 * it reads the next SHORT_READ_AHEAD bytes after it too (a scatter read: see `take`), so a stream of 64 KB
 * frames costs one system call a frame and no copy (1 MiB read ahead and each frame copied out of it cost
 * the consumer a tenth of its CPU at 64 KB: docs/PERFORMANCE.md, "Socket readers: a 64 KB frame's end...") */
#define LARGE_FRAME (32 << 10)
#define SHORT_READ_AHEAD (4 << 10)
/* frames from this size are received to their last byte alone, as before the scatter read: with it, 1 MB frames
 * were received at half the speed (the consumer's CPU per frame doubled, in page faults and thread hand-offs) */
#define SCATTER_BELOW (128 << 10)
#define SPARE_INBOXES 4
/* frames from this size wait for recv_lowat bytes at a time (see set_lowat); 1 MB ones gained nothing
 * measurable, so they are left alone */
#define LOWAT_FROM (4 << 20)

/* what read() returns besides a frame (a tuple) and None (no more bytes for now); MORE: what read_taken()
 * returns when it stopped with bytes perhaps still to come */
enum { MORE = 0, ACK_REQUEST = 1, SKIPPED = 2, CHECK_PREFIX = 3, END = 4 };

static const uint8_t ack_request[PREFIX_SIZE] = {'T', 'B', 'A', 'K'};

/* drained read-ahead buffers kept for the next connection that needs one: their pages are touched
 * already (fresh pages are slow on VMs); only touched with the GIL held */
static uint8_t *spare_inboxes[SPARE_INBOXES];
static int spare_count = 0;

typedef struct {
    PyObject_HEAD
    PyObject *sock; /* the socket: its fileno() at each read (-1 once closed, never another file's) */
    int fd, busy, broken;
    uint64_t max_header, max_payload;
    Py_ssize_t pooled_from, checksum_from, crc_slice;
    PyObject *take_buffer; /* n -> writable memoryview, for frames of pooled_from bytes and more */
    PyObject *crc32c;
    uint8_t *inbox;
    Py_ssize_t in_lo, in_hi;
    uint8_t prefix[PREFIX_SIZE];
    Py_ssize_t prefix_got;
    PyObject *frame; /* the frame being received (a memoryview), and its buffer while it is */
    Py_buffer buffer;
    Py_ssize_t got, total, crc_end;
    int crc_after, crc_on;
    unsigned long crc;
    uint64_t skip_left;
    Py_ssize_t last_total;
    int recv_lowat, lowat; /* SO_RCVLOWAT for large frames (0: never set), and the socket's now */
    Py_ssize_t budget;     /* bytes of a frame's body one read() takes at most before it returns None (0: all) */
    int drained;           /* the last recv() found the socket empty, or took less than it asked for */
} Reader;

static void
give_back_inbox(Reader *self)
{
    if (self->inbox == NULL || self->in_lo != self->in_hi) {
        return;
    }
    if (spare_count < SPARE_INBOXES) {
        spare_inboxes[spare_count++] = self->inbox;
    }
    else {
        PyMem_RawFree(self->inbox);
    }
    self->inbox = NULL;
    self->in_lo = self->in_hi = 0;
}

static void
drop_frame(Reader *self)
{
    if (self->frame != NULL) {
        PyBuffer_Release(&self->buffer);
        Py_CLEAR(self->frame);
    }
}

/* recvmsg() into the `count` buffers of `iov` (with `flags`, e.g. MSG_PEEK): bytes received, 0 at the end of
 * the stream, -2 when none are there yet, -1 on an error (a Python exception is set; signals are handled as
 * socket.recv_into handles them). Without flags, `drained` says whether it found less than it asked for. */
static Py_ssize_t
receive_into(Reader *self, struct iovec *iov, int count, int flags)
{
    struct msghdr message = {.msg_iov = iov, .msg_iovlen = (size_t)count};
    Py_ssize_t want = 0;
    for (int i = 0; i < count; i++) {
        want += (Py_ssize_t)iov[i].iov_len;
    }
    for (;;) {
        ssize_t n;
        Py_BEGIN_ALLOW_THREADS
        n = recvmsg(self->fd, &message, flags);
        Py_END_ALLOW_THREADS
        if (n >= 0) {
            if (flags == 0) {
                self->drained = n < want;
            }
            return n;
        }
        if (errno == EAGAIN || errno == EWOULDBLOCK) {
            if (flags == 0) {
                self->drained = 1;
            }
            return -2;
        }
        if (errno != EINTR) {
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        if (PyErr_CheckSignals() < 0) {
            return -1;
        }
    }
}

/* receive_into() into one buffer */
static Py_ssize_t
receive(Reader *self, uint8_t *into, Py_ssize_t want, int flags)
{
    struct iovec iov = {.iov_base = into, .iov_len = (size_t)want};
    return receive_into(self, &iov, 1, flags);
}

/* A frame's last bytes: into `into` (`want` bytes) and on into the empty read-ahead buffer (`ahead` bytes),
 * one system call for the end of a frame and what follows it; the bytes beyond `want` are left in the
 * read-ahead buffer. Returns as receive() does, counting both. */
static Py_ssize_t
receive_scatter(Reader *self, uint8_t *into, Py_ssize_t want, Py_ssize_t ahead)
{
    struct iovec iov[2] = {{.iov_base = into, .iov_len = (size_t)want},
                           {.iov_base = self->inbox, .iov_len = (size_t)ahead}};
    Py_ssize_t n = receive_into(self, iov, 2, 0);
    if (n > want) {
        self->in_lo = 0, self->in_hi = n - want;
    }
    return n;
}

/* The read-ahead buffer, made (or a spare taken) if the connection holds none; NULL with MemoryError set. */
static uint8_t *
ensure_inbox(Reader *self)
{
    if (self->inbox == NULL) {
        self->inbox = spare_count ? spare_inboxes[--spare_count] : PyMem_RawMalloc(READ_AHEAD);
        if (self->inbox == NULL) {
            PyErr_NoMemory();
        }
    }
    return self->inbox;
}

/* Fill up to `want` bytes of `into` from what was read ahead; read ahead again (one system call)
 * when that is empty, unless this is a frame's body or a large read, which go straight into place
 * (after a large frame, only a short read ahead: see SHORT_READ_AHEAD). `ahead`: the body's read takes
 * the frame's last `want` bytes, and that system call reads up to `ahead` bytes after them too (0: no). */
static Py_ssize_t
take(Reader *self, uint8_t *into, Py_ssize_t want, int straight, Py_ssize_t ahead)
{
    if (self->in_lo == self->in_hi) {
        if (into != NULL && (straight || want >= READ_AHEAD)) {
            if (ahead > 0 && ensure_inbox(self) == NULL) {
                return -1;
            }
            Py_ssize_t n = ahead > 0 ? receive_scatter(self, into, want, ahead) : receive(self, into, want, 0);
            return n > want ? want : n;
        }
        if (ensure_inbox(self) == NULL) {
            return -1;
        }
        int skipping = into == NULL && want > 0;
        Py_ssize_t ahead_now = skipping || self->last_total < LARGE_FRAME ? READ_AHEAD : SHORT_READ_AHEAD;
        Py_ssize_t n = receive(self, self->inbox, ahead_now, 0);
        if (n <= 0) {
            return n;
        }
        self->in_lo = 0, self->in_hi = n;
    }
    Py_ssize_t n = self->in_hi - self->in_lo < want ? self->in_hi - self->in_lo : want;
    if (into != NULL) {
        memcpy(into, self->inbox + self->in_lo, (size_t)n);
    }
    self->in_lo += n;
    return n;
}

/* _crc.c's CRC32C as a C function, where configure() was given it (a 4 KB frame's three Python calls of
 * crc32c, each with a memoryview, were a ninth of a producer's CPU per tensor) */
static crc32c_c_fn g_crc32c_c = NULL;

/* *crc, carried on over the n bytes at p by crc32c.crc32c (the reader's and the sender's one way to
 * checksum), or by the same CRC in C below CRC_DIRECT_BELOW bytes (_frame.h); 0 with an exception set. */
static int
crc_update(PyObject *crc32c, const void *p, Py_ssize_t n, unsigned long *crc)
{
    return crc32c_update(g_crc32c_c, crc32c, p, n, crc);
}

/* Running CRC32C over [from, to) of the frame being received. */
static int
update_crc(Reader *self, Py_ssize_t from, Py_ssize_t to)
{
    return crc_update(self->crc32c, (const uint8_t *)self->buffer.buf + from, to - from, &self->crc);
}

/* A checked prefix: get the frame's buffer and start receiving into it. 0 with an exception set on
 * failure (MemoryError from the pool, typically: the reactor drops the connection). */
static int
start_frame(Reader *self)
{
    const uint8_t *p = self->prefix;
    uint64_t header_len = le32(p + 8), payload_len = le64(p + 12);
    uint64_t signature = p[5] & FLAG_SIGNED ? SIGNATURE_BYTES : 0;
    uint64_t start = (PREFIX_SIZE + header_len + ALIGN - 1) / ALIGN * ALIGN;
    uint64_t total = start + payload_len + signature; /* (no overflow: the limits are under 2^62, see init) */
    uint64_t whole = total + (self->crc_after ? CRC_TRAILER : 0);
    if (whole > (uint64_t)PY_SSIZE_T_MAX) {
        PyErr_NoMemory();
        return 0;
    }
    PyObject *frame;
    if ((Py_ssize_t)whole < self->pooled_from) {
        /* a view of a new bytearray, from its first byte at a multiple of 64: so is every tensor in it */
        PyObject *bytes = PyByteArray_FromStringAndSize(NULL, (Py_ssize_t)whole + ALIGN);
        PyObject *all = bytes == NULL ? NULL : PyMemoryView_FromObject(bytes);
        Py_ssize_t skip = bytes == NULL ? 0 : (Py_ssize_t)(-(uintptr_t)PyByteArray_AS_STRING(bytes) % ALIGN);
        frame = all == NULL ? NULL : PySequence_GetSlice(all, skip, skip + (Py_ssize_t)whole);
        Py_XDECREF(all);
        Py_XDECREF(bytes);
    }
    else {
        frame = PyObject_CallFunction(self->take_buffer, "n", (Py_ssize_t)whole);
    }
    if (frame == NULL) {
        return 0;
    }
    if (PyObject_GetBuffer(frame, &self->buffer, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        Py_DECREF(frame);
        return 0;
    }
    if (self->buffer.len != (Py_ssize_t)whole) {
        PyBuffer_Release(&self->buffer);
        Py_DECREF(frame);
        PyErr_SetString(PyExc_ValueError, "take_buffer returned a buffer of another size");
        return 0;
    }
    self->frame = frame;
    memcpy(self->buffer.buf, p, PREFIX_SIZE);
    self->got = PREFIX_SIZE;
    self->total = (Py_ssize_t)whole;
    self->crc_on = (Py_ssize_t)total >= self->checksum_from && (p[5] & FLAG_CHECKSUM);
    if (self->crc_on) {
        self->crc_end = (Py_ssize_t)(total - signature);
        self->crc = 0;
        if (!update_crc(self, 0, CRC_AT)) {
            drop_frame(self);
            return 0;
        }
    }
    return 1;
}

/* Whether frame.frame_length would take this prefix under the reader's limits. */
static int
prefix_ok(const Reader *self)
{
    const uint8_t *p = self->prefix;
    return memcmp(p, "TBUS", 4) == 0 && p[4] == FORMAT_VERSION && !(p[5] & ~KNOWN_FLAGS) && p[6] == 0 && p[7] == 0 &&
           le32(p + 8) <= self->max_header && le64(p + 12) <= self->max_payload;
}

/* How many bytes the kernel gathers before the socket counts as readable (SO_RCVLOWAT; TCP only, as
 * epoll honours it only there). Waiting in the middle of a large frame, `recv_lowat`: the reader wakes
 * once per that many bytes instead of once per loopback packet, which streams large frames faster
 * (docs/PERFORMANCE.md); a larger mark was no better and less steady. Never more
 * than the frame still owes: those bytes come, or the stream ends, which wakes the reader anyway. Back
 * to 1 byte at the frame's end, so nothing smaller ever waits for bytes that may not come. reactor.py
 * passes recv_lowat 0 where the kernel may hold a reader past that (before Linux 5.8, or not Linux).
 * 0 with an exception set on failure. */
static int
set_lowat(Reader *self, int bytes)
{
    if (!self->recv_lowat || bytes == self->lowat) {
        return 1;
    }
    if (setsockopt(self->fd, SOL_SOCKET, SO_RCVLOWAT, &bytes, sizeof bytes) != 0) {
        PyErr_SetFromErrno(PyExc_OSError);
        return 0;
    }
    self->lowat = bytes;
    return 1;
}

/* The end of the stream (n == 0), no bytes yet (n == -2: None) or an error (NULL) as read() returns it.
 * No bytes yet means the caller waits next: the low-water mark is set for that wait here. */
static PyObject *
stopped(Reader *self, Py_ssize_t n)
{
    if (n == -2) {
        int wake_after = self->frame != NULL && self->total >= LOWAT_FROM && self->total - self->got >= self->recv_lowat
                             ? self->recv_lowat
                             : 1;
        return set_lowat(self, wake_after) ? Py_NewRef(Py_None) : NULL;
    }
    if (n == 0) {
        return PyLong_FromLong(END);
    }
    return NULL;
}

PyDoc_STRVAR(read_doc,
"read()\n--\n\n"
"The next event of the stream: (frame, crc) for a whole frame (a memoryview handed over to the caller;\n"
"crc is its CRC32C when computed while receiving, else None); ACK_REQUEST; CHECK_PREFIX (`prefix` is\n"
"over the limits or not a frame: skip(n) it, or drop the connection); SKIPPED (a skipped frame's bytes\n"
"are all gone; `prefix` is its prefix); END (`mid_frame` says where); None when no more bytes are there.");

static PyObject *read_next(Reader *self);

/* Take the socket's descriptor afresh (-1 once it is closed: recv then says EBADF); -1 with an exception set
 * on failure. */
static int
refresh_fd(Reader *self)
{
    PyObject *fd = PyObject_CallMethod(self->sock, "fileno", NULL);
    long number = fd == NULL ? -1 : PyLong_AsLong(fd);
    Py_XDECREF(fd);
    if (number == -1 && PyErr_Occurred()) {
        return -1;
    }
    self->fd = number < INT_MIN || number > INT_MAX ? -1 : (int)number;
    return 0;
}

static PyObject *
read_event(Reader *self, PyObject *unused)
{
    if (self->sock == NULL || self->busy || self->broken) {
        PyErr_SetString(PyExc_RuntimeError, self->sock == NULL ? "StreamReader was not initialised"
                                            : self->busy       ? "StreamReader.read is already running (another thread)"
                                                               : "StreamReader failed earlier: drop its connection");
        return NULL;
    }
    if (refresh_fd(self) < 0) {
        return NULL;
    }
    self->busy = 1;
    PyObject *event = read_next(self);
    self->busy = 0;
    if (event == NULL && self->frame == NULL && !self->skip_left && self->prefix_got == PREFIX_SIZE) {
        self->broken = 1; /* no buffer for the frame this prefix began: the stream cannot go on */
    }
    give_back_inbox(self); /* drained: an idle connection holds no read-ahead buffer */
    return event;
}

static PyObject *
read_next(Reader *self)
{
    Py_ssize_t n;
    while (self->skip_left) {
        Py_ssize_t want = self->skip_left < READ_AHEAD ? (Py_ssize_t)self->skip_left : READ_AHEAD;
        if ((n = take(self, NULL, want, 0, 0)) <= 0) {
            return stopped(self, n);
        }
        self->skip_left -= (uint64_t)n;
        if (!self->skip_left) {
            self->prefix_got = 0;
            self->last_total = PREFIX_SIZE;
            return PyLong_FromLong(SKIPPED);
        }
    }
    while (self->frame == NULL) {
        if ((n = take(self, self->prefix + self->prefix_got, PREFIX_SIZE - self->prefix_got, 0, 0)) <= 0) {
            return stopped(self, n);
        }
        self->prefix_got += n;
        if (self->prefix_got < PREFIX_SIZE) {
            continue;
        }
        if (memcmp(self->prefix, ack_request, PREFIX_SIZE) == 0) {
            self->prefix_got = 0;
            return PyLong_FromLong(ACK_REQUEST);
        }
        self->crc_after = (self->prefix[5] & TRAILING_CRC) != 0;
        self->prefix[5] &= (uint8_t)~TRAILING_CRC; /* the frame as it was sealed (and checksummed) */
        if (!prefix_ok(self)) {
            return PyLong_FromLong(CHECK_PREFIX);
        }
        if (!start_frame(self)) {
            return NULL;
        }
    }
    uint8_t *frame = self->buffer.buf;
    Py_ssize_t taken_now = 0;
    while (self->got < self->total) {
        if (self->budget > 0 && taken_now >= self->budget) {
            return stopped(self, -2); /* an event loop's turn is over (its next wait set, as for no bytes) */
        }
        Py_ssize_t end = self->crc_on && self->got + self->crc_slice < self->total ? self->got + self->crc_slice
                                                                                   : self->total;
        if (self->budget > 0 && end - self->got > self->budget - taken_now) {
            /* (one receive asks for no more than the turn has left: a receive buffer grown to tens of MB
             * would be copied in one, into fresh pages at 0.4-0.7 GB/s) */
            end = self->got + (self->budget - taken_now);
        }
        /* (the end of a frame of LARGE_FRAME up to SCATTER_BELOW bytes: the next SHORT_READ_AHEAD in the same call) */
        Py_ssize_t ahead = end == self->total && self->total >= LARGE_FRAME && self->total < SCATTER_BELOW
                               ? SHORT_READ_AHEAD
                               : 0;
        if ((n = take(self, frame + self->got, end - self->got, 1, ahead)) <= 0) {
            return stopped(self, n);
        }
        if (self->crc_on && self->got < self->crc_end) {
            Py_ssize_t to = self->got + n < self->crc_end ? self->got + n : self->crc_end;
            if (!update_crc(self, self->got < PREFIX_SIZE ? PREFIX_SIZE : self->got, to)) {
                return NULL;
            }
        }
        self->got += n;
        taken_now += n;
    }
    PyObject *view = self->frame;
    if (self->crc_after) { /* its CRC came after it: put it where `encode` puts it */
        Py_ssize_t end = self->total - CRC_TRAILER;
        memcpy(frame + CRC_AT, frame + end, CRC_TRAILER);
        view = PySequence_GetSlice(self->frame, 0, end);
        if (view == NULL) {
            return NULL;
        }
    }
    else {
        Py_INCREF(view);
    }
    if (!set_lowat(self, 1)) { /* (the connection is dropped: the producer sends this frame again) */
        Py_DECREF(view);
        return NULL;
    }
    PyObject *crc = self->crc_on ? PyLong_FromUnsignedLong(self->crc) : Py_NewRef(Py_None);
    self->last_total = self->total;
    drop_frame(self); /* the next frame starts afresh, whatever the caller does with this one */
    self->prefix_got = 0;
    if (crc == NULL) {
        Py_DECREF(view);
        return NULL;
    }
    PyObject *result = PyTuple_Pack(2, view, crc);
    Py_DECREF(view);
    Py_DECREF(crc);
    return result;
}

PyDoc_STRVAR(read_taken_doc,
"read_taken(take, source, max_frames, max_bytes) -> (ids, event, nbytes, largest)\n--\n\n"
"read() and hand each whole frame to take(frame, crc, source) (the consumer's C delivery) for as long as\n"
"take takes them, in one call: at most max_frames, none after the one that brings their bytes to\n"
"max_bytes, and after the first only while bytes are read ahead (what a `recv` reading for itself reads\n"
"on). ids: the message_id of each frame taken, in order; nbytes and largest: their bytes as last_total\n"
"counts them, summed and the largest. event: what ended it, the caller's to handle: MORE (a limit, or\n"
"nothing read ahead), None (no more bytes), an event of read() other than a frame, a frame take declined\n"
"(deliver it the Python way), or, once frames were taken, the exception that came (book them, raise it).");

/* An exception raised now, as an object (normalised, its traceback on it), and cleared. */
static PyObject *
raised(void)
{
    PyObject *type, *value, *traceback;
    PyErr_Fetch(&type, &value, &traceback);
    PyErr_NormalizeException(&type, &value, &traceback);
    if (value != NULL && traceback != NULL) {
        PyException_SetTraceback(value, traceback);
    }
    Py_XDECREF(type);
    Py_XDECREF(traceback);
    return value != NULL ? value : Py_NewRef(Py_None);
}

static PyObject *
read_taken(Reader *self, PyObject *const *args, Py_ssize_t nargs)
{
    static PyObject *s_message_id = NULL;
    if (s_message_id == NULL && (s_message_id = PyUnicode_InternFromString("message_id")) == NULL) {
        return NULL;
    }
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "read_taken(take, source, max_frames: int, max_bytes: int)");
        return NULL;
    }
    Py_ssize_t max_frames = PyLong_AsSsize_t(args[2]);
    long long max_bytes = max_frames == -1 && PyErr_Occurred() ? -1 : PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (self->sock == NULL || self->busy || self->broken) {
        return read_event(self, NULL); /* (raises what is wrong) */
    }
    if (refresh_fd(self) < 0) {
        return NULL;
    }
    PyObject *ids = PyList_New(0);
    if (ids == NULL) {
        return NULL;
    }
    long long nbytes = 0;
    Py_ssize_t largest = 0;
    PyObject *event;
    self->busy = 1;
    for (;;) {
        event = read_next(self);
        if (event == NULL) {
            if (self->frame == NULL && !self->skip_left && self->prefix_got == PREFIX_SIZE) {
                self->broken = 1; /* (as read() says) */
            }
            break;
        }
        if (!PyTuple_Check(event)) {
            break; /* no more bytes, or an event for the caller */
        }
        PyObject *call[3] = {PyTuple_GET_ITEM(event, 0), PyTuple_GET_ITEM(event, 1), args[1]};
        PyObject *taken = PyObject_Vectorcall(args[0], call, 3, NULL);
        if (taken == Py_None) {
            Py_DECREF(taken);
            break; /* declined: the frame is the caller's */
        }
        Py_DECREF(event);
        event = NULL;
        PyObject *id = taken == NULL ? NULL : PyObject_GetAttr(taken, s_message_id);
        Py_XDECREF(taken);
        if (id == NULL || PyList_Append(ids, id) < 0) {
            Py_XDECREF(id);
            break; /* (taken but not booked: the connection is dropped, the frame comes again, a duplicate) */
        }
        Py_DECREF(id);
        nbytes += self->last_total;
        largest = self->last_total > largest ? self->last_total : largest;
        if (PyList_GET_SIZE(ids) >= max_frames || nbytes >= max_bytes || self->in_lo >= self->in_hi) {
            event = PyLong_FromLong(MORE);
            break;
        }
    }
    self->busy = 0;
    give_back_inbox(self);
    if (event == NULL) {
        if (PyList_GET_SIZE(ids) == 0) {
            Py_DECREF(ids);
            return NULL;
        }
        event = raised(); /* (the frames taken are the caller's to book first) */
    }
    PyObject *result = Py_BuildValue("(NNLn)", ids, event, nbytes, largest);
    return result;
}

PyDoc_STRVAR(fill_doc,
"fill() -> bool\n--\n\n"
"Whether read() has anything to look at (bytes, the stream's end, an error), found out with one system\n"
"call that, between frames, reads ahead what is there: the read() that follows then needs none. For a\n"
"waiting reader's busy-poll, in place of a poll: a Ctrl-C that lands in it leaves no frame half taken.");

static PyObject *
fill(Reader *self, PyObject *unused)
{
    if (self->sock == NULL || self->busy || self->broken || self->in_lo < self->in_hi) {
        Py_RETURN_TRUE; /* (read() says what is wrong, or takes what is read ahead) */
    }
    if (refresh_fd(self) < 0) {
        return NULL;
    }
    Py_ssize_t n;
    self->busy = 1;
    if (self->frame != NULL || self->skip_left || self->prefix_got) { /* part way: read() reads into place */
        uint8_t byte;
        n = receive(self, &byte, 1, MSG_PEEK); /* (only looks) */
    }
    else {
        n = take(self, NULL, 0, 0, 0); /* (want 0: reads ahead, takes nothing; 0 also when it read some) */
    }
    self->busy = 0;
    if (n == -1 && PyErr_ExceptionMatches(PyExc_OSError)) {
        PyErr_Clear(); /* read() meets the error (or the end it left) and reports it */
        n = 0;
    }
    give_back_inbox(self); /* (only when nothing was read) */
    if (n == -1) {
        return NULL; /* a signal's exception (Ctrl-C), or no memory for the read-ahead buffer */
    }
    return PyBool_FromLong(n != -2);
}

PyDoc_STRVAR(skip_doc, "skip(n)\n--\n\nDiscard the next n bytes (the rest of a frame over the limits), then report SKIPPED.");

static PyObject *
skip(Reader *self, PyObject *arg)
{
    unsigned long long n = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_OverflowError)) {
            return NULL;
        }
        PyErr_Clear();
        PyObject *zero = PyLong_FromLong(0);
        int negative = zero == NULL ? -1 : PyObject_RichCompareBool(arg, zero, Py_LT);
        Py_XDECREF(zero);
        if (negative != 0) {
            if (negative > 0) {
                PyErr_SetString(PyExc_ValueError, "skip: a negative count");
            }
            return NULL;
        }
        n = UINT64_MAX; /* a frame past 2^64 bytes: skipping it never ends, as in Python */
    }
    self->skip_left = n;
    if (!n) {
        self->prefix_got = 0;
    }
    Py_RETURN_NONE;
}

static int
reader_init(Reader *self, PyObject *args, PyObject *kwargs)
{
    static char *names[] = {"sock", "max_header_bytes", "max_payload_bytes", "take_buffer", "crc32c",
                            "pooled_from", "checksum_from", "crc_slice", "recv_lowat", NULL};
    PyObject *sock, *header_limit, *payload_limit, *take_buffer, *crc;
    Py_ssize_t pooled_from, checksum_from, crc_slice;
    int recv_lowat = 0;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO!O!OOnnn|i:StreamReader", names, &sock, &PyLong_Type,
                                     &header_limit, &PyLong_Type, &payload_limit, &take_buffer, &crc, &pooled_from,
                                     &checksum_from, &crc_slice, &recv_lowat)) {
        return -1;
    }
    if (self->sock != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "StreamReader is initialised already");
        return -1;
    }
    unsigned long long max_header = PyLong_AsUnsignedLongLong(header_limit);
    if (PyErr_Occurred()) { /* negative, or past 64 bits: refused below */
        PyErr_Clear();
        max_header = UINT64_MAX;
    }
    unsigned long long max_payload = PyLong_AsUnsignedLongLong(payload_limit);
    if (PyErr_Occurred()) {
        PyErr_Clear();
        max_payload = UINT64_MAX;
    }
    if (crc_slice < 1 || crc_slice > (1 << 30) || pooled_from < 0 || checksum_from < 0 || max_header > UINT32_MAX ||
        max_payload > (1ULL << 62) || recv_lowat < 0) {
        PyErr_SetString(PyExc_ValueError, "StreamReader: a limit or size out of range (frame.Limits.native)");
        return -1;
    }
    self->sock = Py_NewRef(sock);
    self->fd = -1;
    self->max_header = max_header, self->max_payload = max_payload;
    self->pooled_from = pooled_from, self->checksum_from = checksum_from, self->crc_slice = crc_slice;
    self->recv_lowat = recv_lowat, self->lowat = 1;
    Py_XSETREF(self->take_buffer, Py_NewRef(take_buffer));
    Py_XSETREF(self->crc32c, Py_NewRef(crc));
    return 0;
}

static void
reader_dealloc(Reader *self)
{
    drop_frame(self);
    self->in_lo = self->in_hi; /* (unread bytes go with the connection) */
    give_back_inbox(self);
    Py_XDECREF(self->sock);
    Py_XDECREF(self->take_buffer);
    Py_XDECREF(self->crc32c);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *
get_prefix(Reader *self, void *closure)
{
    return PyBytes_FromStringAndSize((const char *)self->prefix, PREFIX_SIZE);
}

static PyObject *
get_buffered(Reader *self, void *closure)
{
    return PyLong_FromSsize_t(self->in_hi - self->in_lo);
}

static PyObject *
get_mid_frame(Reader *self, void *closure)
{
    return PyBool_FromLong(self->frame != NULL || self->skip_left || self->prefix_got > 0);
}

static PyObject *
get_progress(Reader *self, void *closure)
{
    /* (grows or shrinks with every byte taken in: a connection stalled part way through a frame keeps it) */
    return PyLong_FromLongLong((long long)self->got + self->prefix_got + self->in_hi - (long long)self->skip_left);
}

static PyObject *
get_crc_after(Reader *self, void *closure)
{
    return PyBool_FromLong(self->crc_after);
}

static PyObject *
get_inbox_held(Reader *self, void *closure)
{
    return PyBool_FromLong(self->inbox != NULL);
}

static PyObject *
get_last_total(Reader *self, void *closure)
{
    return PyLong_FromSsize_t(self->last_total);
}

static PyObject *
get_drained(Reader *self, void *closure)
{
    return PyBool_FromLong(self->drained);
}

static PyObject *
get_budget(Reader *self, void *closure)
{
    return PyLong_FromSsize_t(self->budget);
}

static int
set_budget(Reader *self, PyObject *value, void *closure)
{
    Py_ssize_t budget = value == NULL ? -1 : PyLong_AsSsize_t(value);
    if (budget == -1 && PyErr_Occurred()) {
        return -1;
    }
    if (budget < 0) {
        PyErr_SetString(PyExc_ValueError, "budget: a count of bytes, 0 or more");
        return -1;
    }
    self->budget = budget;
    return 0;
}

static PyGetSetDef reader_getset[] = {
    {"prefix", (getter)get_prefix, NULL, "the last prefix read (its TRAILING_CRC bit cleared)", NULL},
    {"buffered", (getter)get_buffered, NULL, "bytes read ahead and not yet taken", NULL},
    {"mid_frame", (getter)get_mid_frame, NULL, "whether part of a frame has been read", NULL},
    {"progress", (getter)get_progress, NULL, "a figure that changes as bytes of the frame under way come in", NULL},
    {"crc_after", (getter)get_crc_after, NULL, "whether the last prefix said its CRC follows the frame", NULL},
    {"inbox_held", (getter)get_inbox_held, NULL, "whether it holds a read-ahead buffer now", NULL},
    {"last_total", (getter)get_last_total, NULL, "bytes the last frame (or skipped frame's prefix) took", NULL},
    {"drained", (getter)get_drained, NULL,
     "whether the last read found the socket empty (it took less than it asked for): a poll sees what comes next",
     NULL},
    {"budget", (getter)get_budget, (setter)set_budget,
     "bytes of a frame's body one read() takes at most before it returns None (0: no limit)", NULL},
    {NULL},
};

static PyMethodDef reader_methods[] = {
    {"read", (PyCFunction)read_event, METH_NOARGS, read_doc},
    {"skip", (PyCFunction)skip, METH_O, skip_doc},
    {"fill", (PyCFunction)fill, METH_NOARGS, fill_doc},
    {"read_taken", (PyCFunction)(void (*)(void))read_taken, METH_FASTCALL, read_taken_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject ReaderType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorbus.transports._stream.StreamReader",
    .tp_basicsize = sizeof(Reader),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("StreamReader(sock, max_header_bytes, max_payload_bytes, take_buffer, crc32c, pooled_from, "
                        "checksum_from, crc_slice, recv_lowat=0)\n--\n\n"
                        "Frames off one non-blocking stream socket (see _stream.c); recv_lowat: SO_RCVLOWAT while "
                        "waiting in a large frame (TCP only; 0: never set)."),
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)reader_init,
    .tp_dealloc = (destructor)reader_dealloc,
    .tp_methods = reader_methods,
    .tp_getset = reader_getset,
};


/* ---- sending --------------------------------------------------------------------------------------- */

#define IOV_BATCH 512

static int
is_unsealed(const uint8_t *head, Py_ssize_t len)
{
    return len >= PREFIX_SIZE && head[5] == FLAG_CHECKSUM && le32(head + CRC_AT) == 0;
}

/* CRC32C over a frame's head (all but its CRC field) and body, by crc32c.crc32c, into the CRC field. */
static int
seal_head(PyObject *crc32c, Py_buffer *views, Py_ssize_t count)
{
    uint8_t *head = views[0].buf; /* (is_unsealed: at least PREFIX_SIZE bytes) */
    unsigned long crc = 0;
    int ok = crc_update(crc32c, head, CRC_AT, &crc) &&
             crc_update(crc32c, head + PREFIX_SIZE, views[0].len - PREFIX_SIZE, &crc);
    for (Py_ssize_t i = 1; ok && i < count; i++) {
        ok = crc_update(crc32c, views[i].buf, views[i].len, &crc);
    }
    if (!ok) {
        return 0;
    }
    for (int i = 0; i < 4; i++) {
        head[CRC_AT + i] = (uint8_t)(crc >> (8 * i));
    }
    return 1;
}

/* sendmsg() the bytes of `views` from byte `*done` on, `*done` counting those sent. A blocking socket (whose
 * SO_SNDTIMEO makes it give up) sends every byte; a non-blocking one (`partial`) stops where it is full. */
static int
send_views(int fd, Py_buffer *views, Py_ssize_t count, Py_ssize_t *done, int partial)
{
    struct iovec iov[IOV_BATCH];
    Py_ssize_t first = 0, offset = *done; /* the first buffer not wholly sent, and how much of it is */
    while (first < count && offset >= views[first].len) {
        offset -= views[first].len;
        first++;
    }
    while (first < count) {
        int n = 0;
        for (Py_ssize_t i = first; i < count && n < IOV_BATCH; i++) {
            Py_ssize_t skip = i == first ? offset : 0;
            if (views[i].len > skip) {
                iov[n].iov_base = (char *)views[i].buf + skip;
                iov[n].iov_len = (size_t)(views[i].len - skip);
                n++;
            }
        }
        if (n == 0) {
            break;
        }
        struct msghdr message = {.msg_iov = iov, .msg_iovlen = (size_t)n};
        ssize_t sent;
        Py_BEGIN_ALLOW_THREADS
        sent = sendmsg(fd, &message, MSG_NOSIGNAL);
        Py_END_ALLOW_THREADS
        if (sent < 0) {
            if (errno == EINTR) {
                if (PyErr_CheckSignals() < 0) {
                    return 0;
                }
                continue;
            }
            if (partial && (errno == EAGAIN || errno == EWOULDBLOCK)) {
                return 1;
            }
            PyErr_SetFromErrno(PyExc_OSError);
            return 0;
        }
        *done += sent;
        while (first < count && sent >= views[first].len - offset) {
            sent -= views[first].len - offset;
            first++, offset = 0;
        }
        offset += sent;
    }
    return 1;
}

PyDoc_STRVAR(send_frame_doc,
"send_frame(fd, frame, large_from, crc32c)\n--\n\n"
"Send a frame (a list of buffers, its head first) on a blocking socket with one scatter-gather sendmsg\n"
"where it can, first writing its CRC32C if its head is a bytearray encoded with deferred_checksum;\n"
"the bytes sent. None, sending nothing, when such an unsealed frame's payload is large_from bytes or\n"
"more (stream.send_frame checksums those slice by slice as it sends them). Errors are socket.sendmsg's.");

PyDoc_STRVAR(send_frame_from_doc,
"send_frame_from(fd, frame, done, large_from, crc32c)\n--\n\n"
"send_frame's twin for a non-blocking socket (an event loop's): send the frame from byte `done` on, as far\n"
"as the socket takes; (bytes of the frame sent in all, its bytes). From byte 0 it seals an unsealed head\n"
"first, as send_frame does (None when send_frame would leave the frame to stream.send_frame).");

/* send_frame and send_frame_from: from byte `done` (-1: send_frame, a blocking socket, every byte) */
static PyObject *
send_some(int fd, PyObject *buffers, Py_ssize_t done, unsigned long long large_from, PyObject *crc32c)
{
    PyObject *frame = PySequence_Fast(buffers, "send_frame: a frame is a sequence of buffers");
    if (frame == NULL) {
        return NULL;
    }
    Py_ssize_t count = PySequence_Fast_GET_SIZE(frame), got = 0, total = 0;
    Py_buffer *views = PyMem_Calloc(count ? (size_t)count : 1, sizeof(Py_buffer));
    if (views == NULL) {
        Py_DECREF(frame);
        return PyErr_NoMemory();
    }
    PyObject *result = NULL;
    int partial = done >= 0;
    Py_ssize_t sent = partial ? done : 0;
    for (; got < count; got++) {
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(frame, got), &views[got], PyBUF_SIMPLE) < 0) {
            goto done;
        }
        total += views[got].len;
    }
    if (sent > total) {
        PyErr_Format(PyExc_ValueError, "send_frame_from: %zd bytes done of a frame of %zd", sent, total);
        goto done;
    }
    if (sent == 0 && count && PyByteArray_Check(PySequence_Fast_GET_ITEM(frame, 0)) &&
        is_unsealed(views[0].buf, views[0].len)) {
        if (le64((const uint8_t *)views[0].buf + 12) >= large_from) {
            result = Py_NewRef(Py_None);
            goto done;
        }
        if (!seal_head(crc32c, views, count)) {
            goto done;
        }
    }
    if (send_views(fd, views, count, &sent, partial)) {
        result = partial ? Py_BuildValue("(nn)", sent, total) : PyLong_FromSsize_t(total);
    }
done:
    for (Py_ssize_t i = 0; i < got; i++) {
        PyBuffer_Release(&views[i]);
    }
    PyMem_Free(views);
    Py_DECREF(frame);
    return result;
}

static PyObject *
send_frame(PyObject *module, PyObject *args)
{
    int fd;
    PyObject *buffers, *crc32c;
    unsigned long long large_from;
    if (!PyArg_ParseTuple(args, "iOKO:send_frame", &fd, &buffers, &large_from, &crc32c)) {
        return NULL;
    }
    return send_some(fd, buffers, -1, large_from, crc32c);
}

static PyObject *
send_frame_from(PyObject *module, PyObject *args)
{
    int fd;
    PyObject *buffers, *crc32c;
    Py_ssize_t done;
    unsigned long long large_from;
    if (!PyArg_ParseTuple(args, "iOnKO:send_frame_from", &fd, &buffers, &done, &large_from, &crc32c)) {
        return NULL;
    }
    if (done < 0) {
        PyErr_SetString(PyExc_ValueError, "send_frame_from: a negative count of bytes done");
        return NULL;
    }
    return send_some(fd, buffers, done, large_from, crc32c);
}

/* ---- the background reader's timer ------------------------------------------------------------------ */

/* reactor.py's background thread reads only once no application thread has led for `linger_s`.
 * Waiting for that in Python wakes the thread (and takes the GIL from the application) every
 * linger_s while the application receives, which made round trips longer, at the tail most. This
 * waits without the GIL, so an application that keeps receiving never meets it. */

#define IDLE_NAP_NS 50000000LL /* the longest nap between looks at `woken` (close) */

typedef struct {
    PyObject_HEAD
    _Atomic int64_t idle_at; /* CLOCK_MONOTONIC ns from which the application counts as idle */
    _Atomic int woken;
} IdleTimer;

static int64_t
monotonic_ns(void)
{
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return (int64_t)now.tv_sec * 1000000000LL + now.tv_nsec;
}

/* seconds -> ns, clamped to [0, 2^62): the callers' values are options (a linger of 1e300 means "never") */
static int
seconds_ns(PyObject *arg, int64_t *out)
{
    double seconds = PyFloat_AsDouble(arg);
    if (seconds == -1.0 && PyErr_Occurred()) {
        return -1;
    }
    if (seconds != seconds) {
        PyErr_SetString(PyExc_ValueError, "NaN seconds");
        return -1;
    }
    *out = seconds <= 0 ? 0 : seconds >= 4.6e9 ? (1LL << 62) : (int64_t)(seconds * 1e9);
    return 0;
}

PyDoc_STRVAR(touch_doc, "touch(linger_s)\n--\n\nThe application stopped leading: idle once linger_s pass without another touch.");

static PyObject *
idle_touch(IdleTimer *self, PyObject *arg)
{
    int64_t linger;
    if (seconds_ns(arg, &linger) < 0) {
        return NULL;
    }
    int64_t now = monotonic_ns();
    atomic_store(&self->idle_at, linger > INT64_MAX - now ? INT64_MAX : now + linger);
    Py_RETURN_NONE;
}

PyDoc_STRVAR(idle_wait_doc, "wait(timeout_s) -> bool\n--\n\n"
                            "Sleep, without the GIL, until the application is idle (True), or until timeout_s pass "
                            "or wake() is called (False).");

static PyObject *
idle_wait(IdleTimer *self, PyObject *arg)
{
    int64_t timeout;
    if (seconds_ns(arg, &timeout) < 0) {
        return NULL;
    }
    int idle = 0;
    Py_BEGIN_ALLOW_THREADS
    int64_t now = monotonic_ns();
    int64_t deadline = timeout > INT64_MAX - now ? INT64_MAX : now + timeout;
    for (;;) {
        int64_t idle_at = atomic_load(&self->idle_at);
        if (now >= idle_at) {
            idle = 1;
            break;
        }
        if (atomic_load(&self->woken) || now >= deadline) {
            break;
        }
        int64_t nap = (idle_at < deadline ? idle_at : deadline) - now;
        if (nap > IDLE_NAP_NS) {
            nap = IDLE_NAP_NS;
        }
        struct timespec ts = {(time_t)(nap / 1000000000LL), (long)(nap % 1000000000LL)};
        nanosleep(&ts, NULL); /* (a signal cuts it short: the loop looks again) */
        now = monotonic_ns();
    }
    Py_END_ALLOW_THREADS
    return PyBool_FromLong(idle);
}

PyDoc_STRVAR(wake_doc, "wake()\n--\n\nMake every wait, now and later, return at once (False unless the application is "
                      "idle): the consumer is closing.");

static PyObject *
idle_wake(IdleTimer *self, PyObject *Py_UNUSED(ignored))
{
    atomic_store(&self->woken, 1);
    Py_RETURN_NONE;
}

static PyMethodDef idle_methods[] = {
    {"touch", (PyCFunction)idle_touch, METH_O, touch_doc},
    {"wait", (PyCFunction)idle_wait, METH_O, idle_wait_doc},
    {"wake", (PyCFunction)idle_wake, METH_NOARGS, wake_doc},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject IdleTimerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "tensorbus.transports._stream.IdleTimer",
    .tp_basicsize = sizeof(IdleTimer),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = PyDoc_STR("IdleTimer()\n--\n\nWhen the application last led, for the background reader (see _stream.c)."),
    .tp_new = PyType_GenericNew, /* (zeroed: idle from the start, not woken) */
    .tp_methods = idle_methods,
};

PyDoc_STRVAR(configure_doc,
"configure(crc32c_c)\n--\n\n"
"Hand over _crc's CRC32C_C capsule (the CRC32C as a C function), or None: buffers below 32 KiB are then\n"
"checksummed without calling the crc32c given to send_frame or a StreamReader.");

static PyObject *
configure(PyObject *module, PyObject *crc_c)
{
    if (!crc32c_c_from(crc_c, &g_crc32c_c)) {
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", configure, METH_O, configure_doc},
    {"send_frame", send_frame, METH_VARARGS, send_frame_doc},
    {"send_frame_from", send_frame_from, METH_VARARGS, send_frame_from_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_stream", "The stream sockets' per-frame work (see _stream.c).", -1, module_methods,
};

PyMODINIT_FUNC
PyInit__stream(void)
{
    if (PyType_Ready(&ReaderType) < 0 || PyType_Ready(&IdleTimerType) < 0) {
        return NULL;
    }
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddObjectRef(m, "StreamReader", (PyObject *)&ReaderType) < 0 ||
        PyModule_AddObjectRef(m, "IdleTimer", (PyObject *)&IdleTimerType) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_HASH", TENSORBUS_SOURCE_HASH) < 0 ||
        PyModule_AddIntConstant(m, "ACK_REQUEST", ACK_REQUEST) < 0 || PyModule_AddIntConstant(m, "MORE", MORE) < 0 ||
        PyModule_AddIntConstant(m, "SKIPPED", SKIPPED) < 0 ||
        PyModule_AddIntConstant(m, "CHECK_PREFIX", CHECK_PREFIX) < 0 || PyModule_AddIntConstant(m, "END", END) < 0 ||
        /* the format and protocol constants this file repeats: stream.py checks they agree */
        PyModule_AddIntConstant(m, "PREFIX_SIZE", PREFIX_SIZE) < 0 || PyModule_AddIntConstant(m, "CRC_AT", CRC_AT) < 0 ||
        PyModule_AddIntConstant(m, "FORMAT_VERSION", FORMAT_VERSION) < 0 ||
        PyModule_AddIntConstant(m, "KNOWN_FLAGS", KNOWN_FLAGS) < 0 ||
        PyModule_AddIntConstant(m, "TRAILING_CRC", TRAILING_CRC) < 0 ||
        PyModule_AddIntConstant(m, "CRC_TRAILER", CRC_TRAILER) < 0 ||
        PyModule_AddIntConstant(m, "SIGNATURE_BYTES", SIGNATURE_BYTES) < 0 ||
        PyModule_AddIntConstant(m, "ALIGN", ALIGN) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
