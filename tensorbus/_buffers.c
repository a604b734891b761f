/* The C twin of buffers.aligned for a `bytes` object: a broker client's record (kafka://), whose bytes start
 * 32 bytes into their object, copied to a buffer that starts at a multiple of ALIGN, so the tensors of a
 * frame received there are aligned as the frame puts them. buffers.py chooses it or its Python path (one
 * place), with ALIGN held equal to buffers.ALIGN (`native.agrees`); tests/unit/test_buffers.py compares them.
 * In Python the copy costs about 4 us a record, most of it finding addresses; here a fraction of that.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#ifndef TENSORBUS_SOURCE_HASH
#define TENSORBUS_SOURCE_HASH "unknown"
#endif

#define ALIGN 64 /* buffers.ALIGN */

PyDoc_STRVAR(aligned_copy_doc,
"aligned_copy(data: bytes) -> memoryview\n--\n\n"
"`data` itself (a memoryview of it) where its bytes start at a multiple of ALIGN, else a writable copy\n"
"that does (a view of a bytearray). Like buffers.aligned without a pool, for bytes only.");

static PyObject *
aligned_copy(PyObject *module, PyObject *data)
{
    if (!PyBytes_CheckExact(data)) {
        PyErr_SetString(PyExc_TypeError, "aligned_copy(data: bytes)");
        return NULL;
    }
    const char *source = PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    if (n == 0 || (uintptr_t)source % ALIGN == 0) {
        return PyMemoryView_FromObject(data);
    }
    PyObject *raw = PyByteArray_FromStringAndSize(NULL, n + ALIGN - 1);
    if (raw == NULL) {
        return NULL;
    }
    char *start = PyByteArray_AS_STRING(raw);
    Py_ssize_t skip = (Py_ssize_t)((ALIGN - (uintptr_t)start % ALIGN) % ALIGN);
    memcpy(start + skip, source, (size_t)n);
    PyObject *whole = PyMemoryView_FromObject(raw);
    Py_DECREF(raw); /* (the view holds it) */
    if (whole == NULL) {
        return NULL;
    }
    PyObject *copy = PySequence_GetSlice(whole, skip, skip + n);
    Py_DECREF(whole);
    return copy;
}

static PyMethodDef methods[] = {
    {"aligned_copy", aligned_copy, METH_O, aligned_copy_doc},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "tensorbus._buffers", "The C twin of buffers.aligned for bytes.", -1, methods,
};

PyMODINIT_FUNC
PyInit__buffers(void)
{
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) {
        return NULL;
    }
    if (PyModule_AddIntConstant(m, "ALIGN", ALIGN) < 0 ||
        PyModule_AddStringConstant(m, "SOURCE_HASH", TENSORBUS_SOURCE_HASH) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
