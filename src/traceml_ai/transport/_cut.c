/* traceml_ai.transport._cut: the batches of a relay's connection, cut out of a
 * received chunk in one call.
 *
 * A relay forwards the frames of many ranks over one connection, so the aggregator
 * reads several frames per chunk and, for each, has to find where it ends, check that
 * it is our senders' batch and read the rank its identity names. Done frame by frame
 * in Python that was about 3 us a frame, a sizeable share of the aggregator's CPU at
 * ten thousand ranks (docs/benchmarks.md); here it is a scan of the bytes. The rules
 * are those of its pure-Python twin, _cut_py.py, which is the reference.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdint.h>
#include <string.h>

#define HEADER 4
/* Where in a body the identity's global_rank is looked for (wire.BATCH_RANK_SPAN). */
#define RANK_SPAN 4096
#define STATUS_NEED_MORE 0
#define STATUS_PYTHON 1
#define STATUS_OVERSIZED 2

static const char RANK_KEY[] = "\"global_rank\":";
#define RANK_KEY_LEN ((Py_ssize_t)(sizeof(RANK_KEY) - 1))

/* Whether one of ``streams`` (bytes: a name and its closing quote) starts at s. */
static int known_stream(PyObject *streams, const char *s, Py_ssize_t n) {
    Py_ssize_t count = PyTuple_GET_SIZE(streams);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *name = PyTuple_GET_ITEM(streams, i);
        Py_ssize_t len = PyBytes_GET_SIZE(name);
        if (len <= n && memcmp(s, PyBytes_AS_STRING(name), (size_t)len) == 0) return 1;
    }
    return 0;
}

/* The first "global_rank":<0 or 1-19 digits without a leading zero> followed by ',' or
 * '}' that ends within the first RANK_SPAN bytes (wire.BATCH_GLOBAL_RANK); -1 if none. */
static int64_t rank_in(const char *body, Py_ssize_t n, uint64_t *rank) {
    Py_ssize_t span = n < RANK_SPAN ? n : RANK_SPAN;
    const char *p = body;
    const char *end = body + span;
    while (end - p > RANK_KEY_LEN) {
        const char *hit = memchr(p, '"', (size_t)(end - p));
        if (hit == NULL || end - hit <= RANK_KEY_LEN) return -1;
        p = hit + 1;
        if (memcmp(hit, RANK_KEY, (size_t)RANK_KEY_LEN) != 0) continue;
        const char *d = hit + RANK_KEY_LEN;
        const char *q = d;
        uint64_t value = 0;
        while (q < end && *q >= '0' && *q <= '9' && q - d < 19) {
            value = value * 10 + (uint64_t)(*q - '0');
            q++;
        }
        Py_ssize_t digits = q - d;
        if (digits == 0 || (digits > 1 && *d == '0')) continue;
        if (q >= end || (*q != ',' && *q != '}')) continue;
        *rank = value;
        return 0;
    }
    return -1;
}

/* cut_batches(data, pos, prefix, streams, max_frame_bytes) -> (batches, pos, status) */
static PyObject *cut_batches(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError,
                        "cut_batches takes 5 arguments (data, pos, prefix, streams, "
                        "max_frame_bytes)");
        return NULL;
    }
    PyObject *data = args[0], *prefix = args[2], *streams = args[3];
    if (!PyBytes_CheckExact(data) || !PyBytes_CheckExact(prefix) || !PyTuple_CheckExact(streams)) {
        PyErr_SetString(PyExc_TypeError, "cut_batches takes bytes, int, bytes, tuple, int");
        return NULL;
    }
    for (Py_ssize_t i = 0; i < PyTuple_GET_SIZE(streams); i++) {
        if (!PyBytes_CheckExact(PyTuple_GET_ITEM(streams, i))) {
            PyErr_SetString(PyExc_TypeError, "streams must be a tuple of bytes");
            return NULL;
        }
    }
    Py_ssize_t pos = PyLong_AsSsize_t(args[1]);
    if (pos == -1 && PyErr_Occurred()) return NULL;
    long long max_frame = PyLong_AsLongLong(args[4]);
    if (max_frame == -1 && PyErr_Occurred()) return NULL;
    const char *buf = PyBytes_AS_STRING(data);
    Py_ssize_t size = PyBytes_GET_SIZE(data);
    if (pos < 0 || pos > size) {
        PyErr_SetString(PyExc_ValueError, "pos outside data");
        return NULL;
    }
    const char *head = PyBytes_AS_STRING(prefix);
    Py_ssize_t head_len = PyBytes_GET_SIZE(prefix);
    PyObject *batches = PyList_New(0);
    if (batches == NULL) return NULL;
    int status = STATUS_NEED_MORE;
    while (size - pos >= HEADER) {
        const unsigned char *h = (const unsigned char *)buf + pos;
        uint32_t length = ((uint32_t)h[0] << 24) | ((uint32_t)h[1] << 16) |
                          ((uint32_t)h[2] << 8) | (uint32_t)h[3];
        if ((long long)length > max_frame) {
            status = STATUS_OVERSIZED;
            break;
        }
        Py_ssize_t end = pos + HEADER + (Py_ssize_t)length;
        if (end > size) break;
        const char *body = buf + pos + HEADER;
        Py_ssize_t n = (Py_ssize_t)length;
        uint64_t rank;
        if (n < head_len || memcmp(body, head, (size_t)head_len) != 0 ||
            !known_stream(streams, body + head_len, n - head_len) || rank_in(body, n, &rank) < 0) {
            status = STATUS_PYTHON;
            break;
        }
        PyObject *entry = Py_BuildValue("(y#nK)", body, n, n, (unsigned long long)rank);
        if (entry == NULL || PyList_Append(batches, entry) < 0) {
            Py_XDECREF(entry);
            Py_DECREF(batches);
            return NULL;
        }
        Py_DECREF(entry);
        pos = end;
    }
    return Py_BuildValue("(Nni)", batches, pos, status);
}

static PyMethodDef methods[] = {
    {"cut_batches", (PyCFunction)(void (*)(void))cut_batches, METH_FASTCALL,
     "cut_batches(data, pos, prefix, streams, max_frame_bytes) -> (batches, pos, status)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_cut",
    "The batches of a relay's connection cut out of a chunk (see _cut_py.py).", -1, methods,
};

PyMODINIT_FUNC PyInit__cut(void) { return PyModule_Create(&module); }
