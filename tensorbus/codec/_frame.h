/* The frame format as the C extensions read and write it: the prefix's layout and flags, and
 * little-endian loads. Included by codec/_native.c and transports/_stream.c (the codec's format, so
 * nothing in codec/ depends on a layer above it). Each extension exports the constants it uses, and
 * the Python beside it refuses a build that disagrees with codec/frame.py (`native.agrees`).
 * setup.py compiles the hash of the .c and of this header into each extension (see codec/native.py).
 */
#ifndef TENSORBUS_FRAME_H
#define TENSORBUS_FRAME_H

#include <Python.h>
#include <stddef.h>
#include <stdint.h>

#ifndef TENSORBUS_SOURCE_HASH
#define TENSORBUS_SOURCE_HASH "unknown"
#endif

/* magic "TBUS", version u8, flags u8, reserved u16, header length u32, payload length u64, CRC32C u32 */
#define PREFIX_SIZE 24
#define CRC_AT 20
#define FORMAT_VERSION 1
#define FLAG_CHECKSUM 0x01
#define FLAG_SIGNED 0x02
#define KNOWN_FLAGS (FLAG_CHECKSUM | FLAG_SIGNED)
#define SIGNATURE_BYTES 32
/* payloads (and each tensor in them) start at multiples of this */
#define ALIGN 64
/* _crc.c's CRC32C as a C function, for the other extensions (their configure() takes the capsule): what is
 * below CRC_DIRECT_BELOW bytes is checksummed through it without a Python call; larger buffers go through
 * crc32c.crc32c, which lets go of the GIL while it reads them */
#define CRC32C_C_NAME "tensorbus.codec._crc.CRC32C_C"
#define CRC_DIRECT_BELOW 32768
typedef uint32_t (*crc32c_c_fn)(uint32_t value, const void *p, size_t n);

/* the crc32c_c_fn in a CRC32C_C capsule (None: NULL); NULL with an exception set if it is not one */
static inline int
crc32c_c_from(PyObject *capsule, crc32c_c_fn *fn)
{
    void *held = NULL;
    if (capsule != Py_None && (held = PyCapsule_GetPointer(capsule, CRC32C_C_NAME)) == NULL) {
        return 0;
    }
    *fn = held == NULL ? NULL : *(crc32c_c_fn *)held;
    return 1;
}

/* *crc carried on over the n bytes at p: by `direct` (a crc32c_c_fn, or NULL) below CRC_DIRECT_BELOW bytes,
 * else by calling `crc32c` (crc32c.crc32c or its twin, which lets go of the GIL while it reads); 0 with an
 * exception set on failure. The one rule both extensions checksum by. */
static inline int
crc32c_update(crc32c_c_fn direct, PyObject *crc32c, const void *p, Py_ssize_t n, unsigned long *crc)
{
    if (direct != NULL && n < CRC_DIRECT_BELOW) {
        *crc = direct((uint32_t)*crc, p, (size_t)n);
        return 1;
    }
    PyObject *view = PyMemoryView_FromMemory((char *)p, n, PyBUF_READ);
    PyObject *value = view == NULL ? NULL : PyObject_CallFunction(crc32c, "Ok", view, *crc);
    Py_XDECREF(view);
    if (value == NULL) {
        return 0;
    }
    *crc = PyLong_AsUnsignedLong(value);
    Py_DECREF(value);
    return !PyErr_Occurred();
}

static inline uint32_t
le32(const uint8_t *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static inline uint64_t
le64(const uint8_t *p)
{
    return (uint64_t)le32(p) | (uint64_t)le32(p + 4) << 32;
}

#endif
