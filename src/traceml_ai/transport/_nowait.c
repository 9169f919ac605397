/* traceml_ai.transport._nowait: a rank sender's socket calls that never block, made
 * without releasing the interpreter's lock.
 *
 * Python's socket methods release the lock around every system call. Each release by
 * the sender's thread lets it be made to hand the lock back to the training thread and
 * take it again later: on a virtual machine that handoff cost the sender ~40-120 us of
 * CPU each, and the training thread a forced switch, several times per flush
 * (docs/benchmarks.md). A send or a peek with MSG_DONTWAIT returns at once (what the
 * kernel's buffer has no room for is left to the caller, which then waits for room the
 * Python way), so holding the lock through it costs the training thread less than the
 * handoff would.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <errno.h>
#include <limits.h>
#include <sys/socket.h>
#include <sys/types.h>

#ifndef MSG_NOSIGNAL
#define MSG_NOSIGNAL 0
#endif

/* A file descriptor from a Python int: 0, or -1 with an exception set. */
static int as_fd(PyObject *obj, int *fd) {
    long value = PyLong_AsLong(obj);
    if (value == -1 && PyErr_Occurred()) return -1;
    if (value < 0 || value > INT_MAX) {
        PyErr_SetString(PyExc_ValueError, "not a file descriptor");
        return -1;
    }
    *fd = (int)value;
    return 0;
}

/* send_nowait(fd, data) -> bytes the kernel took (0: no room now); OSError on a
 * broken connection. */
static PyObject *send_nowait(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "send_nowait takes 2 arguments (fd, data)");
        return NULL;
    }
    int fd;
    if (as_fd(args[0], &fd) < 0) return NULL;
    Py_buffer view;
    if (PyObject_GetBuffer(args[1], &view, PyBUF_SIMPLE) < 0) return NULL;
    ssize_t sent;
    do {
        sent = send(fd, view.buf, (size_t)view.len, MSG_DONTWAIT | MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    int error = errno;
    PyBuffer_Release(&view);
    if (sent < 0) {
        if (error == EAGAIN || error == EWOULDBLOCK) return PyLong_FromLong(0);
        errno = error;
        return PyErr_SetFromErrno(PyExc_OSError);
    }
    return PyLong_FromSsize_t((Py_ssize_t)sent);
}

/* peer_gone(fd) -> whether the peer closed, reset or wrote (an aggregator never writes
 * to a rank: anything readable means the connection is over). */
static PyObject *peer_gone(PyObject *module, PyObject *fd_obj) {
    int fd;
    if (as_fd(fd_obj, &fd) < 0) return NULL;
    char byte;
    ssize_t got;
    do {
        got = recv(fd, &byte, 1, MSG_DONTWAIT | MSG_PEEK);
    } while (got < 0 && errno == EINTR);
    if (got < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) Py_RETURN_FALSE;
    Py_RETURN_TRUE;
}

static PyMethodDef methods[] = {
    {"send_nowait", (PyCFunction)(void (*)(void))send_nowait, METH_FASTCALL,
     "send_nowait(fd, data) -> int: bytes the kernel took at once, without blocking or "
     "releasing the interpreter's lock (0: its buffer is full)."},
    {"peer_gone", (PyCFunction)peer_gone, METH_O,
     "peer_gone(fd) -> bool: whether the connection's peer closed, reset or wrote."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "traceml_ai.transport._nowait",
    "A rank sender's non-blocking socket calls, made without releasing the interpreter's "
    "lock.",
    -1, methods,
};

PyMODINIT_FUNC PyInit__nowait(void) { return PyModule_Create(&module_def); }
