/* traceml_ai.run_summary._rowscan: one step_time line's checks and step row, in C.
 *
 * The C twin of the files reader's per-line work (traceml_ai.run_summary._read): the
 * scalar fields against the schema's types and bounds (_fast_check), then the one
 * phase-row rule (_phases.step_row). Reading a big file is that work a million times;
 * in Python it costs about twice the parse. Both twins take and refuse the same lines
 * (a property test feeds them the same mutated lines); the Python side says why a
 * refused line is wrong.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <float.h>
#include <string.h>

/* Interned names (made once, at import). */
static PyObject *s_events, *s_step, *s_used, *s_ts, *s_global_rank, *s_world_size,
    *s_node_rank, *s_timestamp, *s_keys, *s_key_columns, *s_steps, *s_last, *s_node,
    *s_duration, *s_cpu, *s_gpu, *s_calls, *s_closing, *s_tokens, *s_row_tokens;

enum { KIND_INT = 0, KIND_NUMBER = 1, KIND_STRING = 2, KIND_BOOL = 3 };
enum { BAD_FIELDS = 1, BAD_EVENTS = 2 };
#define MAX_CACHED_NAMES 4096

/* The checks as C reads them, made once per checks tuple (the reader passes the same
 * one every time; another tuple makes it again). */
typedef struct {
    PyObject *name; /* borrowed from plan_source */
    int kind, nullable, required;
    PyObject *low, *high; /* borrowed */
    long long ilow, ihigh; /* KIND_INT */
    double flow, fhigh;   /* KIND_NUMBER */
} check_t;

#define MAX_CHECKS 64
static check_t plan[MAX_CHECKS];
static Py_ssize_t plan_count = -1;
static PyObject *plan_source = NULL; /* strong: keeps the borrowed names alive */

static int make_plan(PyObject *checks) {
    Py_ssize_t count = PyTuple_GET_SIZE(checks);
    if (count > MAX_CHECKS) {
        PyErr_SetString(PyExc_ValueError, "too many checks");
        return -1;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *check = PyTuple_GET_ITEM(checks, i);
        if (!PyTuple_CheckExact(check) || PyTuple_GET_SIZE(check) != 6) {
            PyErr_SetString(PyExc_TypeError, "a check is (name, kind, low, high, nullable, required)");
            return -1;
        }
        check_t *c = &plan[i];
        c->name = PyTuple_GET_ITEM(check, 0);
        c->kind = (int)PyLong_AsLong(PyTuple_GET_ITEM(check, 1));
        c->low = PyTuple_GET_ITEM(check, 2);
        c->high = PyTuple_GET_ITEM(check, 3);
        c->nullable = PyObject_IsTrue(PyTuple_GET_ITEM(check, 4));
        c->required = PyObject_IsTrue(PyTuple_GET_ITEM(check, 5));
        if (PyErr_Occurred()) return -1;
        if (c->kind == KIND_INT) {
            c->ilow = PyLong_AsLongLong(c->low);
            c->ihigh = PyLong_AsLongLong(c->high);
        } else if (c->kind == KIND_NUMBER) {
            c->flow = PyFloat_AsDouble(c->low);
            c->fhigh = PyFloat_AsDouble(c->high);
        }
        if (PyErr_Occurred()) return -1;
    }
    Py_XSETREF(plan_source, Py_NewRef(checks));
    plan_count = count;
    return 0;
}

/* Whether low <= v <= high for an exact int or float v, as Python compares them. */
static int within(const check_t *c, PyObject *v) {
    if (c->kind == KIND_INT) {
        int overflow = 0;
        long long x = PyLong_AsLongLongAndOverflow(v, &overflow);
        if (overflow) return 0; /* beyond int64: beyond every integer bound */
        return c->ilow <= x && x <= c->ihigh;
    }
    if (PyFloat_CheckExact(v)) {
        double d = PyFloat_AS_DOUBLE(v);
        return c->flow <= d && d <= c->fhigh;
    }
    /* An int in a number field: Python's exact int-float comparison. */
    int ok = PyObject_RichCompareBool(c->low, v, Py_LE);
    if (ok <= 0) return ok;
    return PyObject_RichCompareBool(v, c->high, Py_LE);
}

/* 1: the scalar fields can be a valid line's; 0: not; -1: error. */
static int fields_ok(PyObject *obj, PyObject *checks) {
    if (checks != plan_source && make_plan(checks) < 0) return -1;
    for (Py_ssize_t i = 0; i < plan_count; i++) {
        const check_t *c = &plan[i];
        PyObject *v = PyDict_GetItemWithError(obj, c->name); /* borrowed */
        if (v == NULL && PyErr_Occurred()) return -1;
        if (v == NULL || v == Py_None) {
            if (v == NULL) {
                if (c->required) return 0;
                continue;
            }
            if (c->nullable) continue;
            return 0; /* an explicit null where none is allowed */
        }
        int ok;
        switch (c->kind) {
        case KIND_INT:
            ok = PyLong_CheckExact(v) ? within(c, v) : 0;
            break;
        case KIND_NUMBER:
            ok = (PyFloat_CheckExact(v) || PyLong_CheckExact(v)) ? within(c, v) : 0;
            break;
        case KIND_STRING:
            ok = PyUnicode_CheckExact(v);
            break;
        default:
            ok = PyBool_Check(v);
            break;
        }
        if (ok <= 0) return ok;
    }
    /* "world_size" in obj and not get("global_rank", 0) < obj["world_size"] */
    PyObject *world = PyDict_GetItemWithError(obj, s_world_size);
    if (world == NULL && PyErr_Occurred()) return -1;
    if (world != NULL) {
        PyObject *rank = PyDict_GetItemWithError(obj, s_global_rank);
        if (rank == NULL && PyErr_Occurred()) return -1;
        int below;
        if (rank == NULL) {
            PyObject *zero = PyLong_FromLong(0);
            if (zero == NULL) return -1;
            below = PyObject_RichCompareBool(zero, world, Py_LT);
            Py_DECREF(zero);
        } else {
            below = PyObject_RichCompareBool(rank, world, Py_LT);
        }
        if (below <= 0) return below;
    }
    return 1;
}

/* A timing value: an exact int or float, finite and not negative (0: no). */
static int timing(PyObject *v, double *out) {
    double d;
    if (PyFloat_CheckExact(v)) {
        d = PyFloat_AS_DOUBLE(v);
    } else if (PyLong_CheckExact(v)) {
        if (_PyLong_Sign(v) < 0) return 0;
        d = PyLong_AsDouble(v);
        if (d == -1.0 && PyErr_Occurred()) {
            PyErr_Clear();
            return 0; /* beyond any float: above the largest finite one */
        }
    } else {
        return 0;
    }
    if (!(0.0 <= d && d <= DBL_MAX)) return 0;
    *out = d;
    return 1;
}

/* Add ``value`` to row[key] (0.0 when absent); -1 on error. */
static int add_to(PyObject *row, PyObject *key, double value) {
    PyObject *old = PyDict_GetItemWithError(row, key);
    if (old == NULL && PyErr_Occurred()) return -1;
    double total = (old == NULL ? 0.0 : PyFloat_AS_DOUBLE(old)) + value;
    PyObject *f = PyFloat_FromDouble(total);
    if (f == NULL) return -1;
    int rc = PyDict_SetItem(row, key, f);
    Py_DECREF(f);
    return rc;
}

/* The row of a step's events (as _phases.step_row), or NULL with no error set when
 * the step cannot be read. */
static PyObject *step_row(PyObject *events, PyObject *step_event, PyObject *name_of,
                          PyObject *cache, PyObject *step_key, PyObject *used_key) {
    if (events == NULL || !PyDict_CheckExact(events)) return NULL;
    int has = PyDict_Contains(events, step_event);
    if (has <= 0) return NULL;
    PyObject *row = PyDict_New();
    if (row == NULL) return NULL;
    double used = 0.0;
    Py_ssize_t pos = 0;
    PyObject *event, *devices;
    while (PyDict_Next(events, &pos, &event, &devices)) {
        double best = -1.0;
        if (PyDict_CheckExact(devices)) {
            Py_ssize_t dpos = 0;
            PyObject *device, *t;
            while (PyDict_Next(devices, &dpos, &device, &t)) {
                if (!PyDict_CheckExact(t)) goto refused;
                PyObject *d = PyDict_GetItemWithError(t, s_duration);
                PyObject *c = PyDict_GetItemWithError(t, s_cpu);
                PyObject *g = PyDict_GetItemWithError(t, s_gpu);
                PyObject *n = PyDict_GetItemWithError(t, s_calls);
                if (PyErr_Occurred()) goto error;
                double dv, cv, gv;
                if (d == NULL || c == NULL || n == NULL) goto refused;
                if (!timing(d, &dv) || !timing(c, &cv)) goto refused;
                if (g != NULL && g != Py_None && !timing(g, &gv)) goto refused;
                if (!PyLong_CheckExact(n)) goto refused;
                int overflow = 0;
                long long calls = PyLong_AsLongLongAndOverflow(n, &overflow);
                if (overflow < 0 || (overflow == 0 && calls < 1)) goto refused;
                if (dv > best) best = dv;
            }
        }
        if (best < 0.0) goto refused; /* no device timing */
        int is_step = PyUnicode_Compare(event, step_event);
        if (is_step == -1 && PyErr_Occurred()) goto error;
        if (is_step == 0) {
            PyObject *f = PyFloat_FromDouble(best);
            if (f == NULL) goto error;
            int rc = PyDict_SetItem(row, step_key, f);
            Py_DECREF(f);
            if (rc < 0) goto error;
            continue;
        }
        PyObject *key = PyDict_GetItemWithError(cache, event); /* borrowed */
        PyObject *owned = NULL;
        if (key == NULL) {
            if (PyErr_Occurred()) goto error;
            owned = key = PyObject_CallOneArg(name_of, event);
            if (key == NULL) goto error;
            /* Bounded: a hostile rank may send any number of names. */
            if (PyDict_GET_SIZE(cache) < MAX_CACHED_NAMES &&
                PyDict_SetItem(cache, event, key) < 0) {
                Py_DECREF(owned);
                goto error;
            }
        }
        if (key != Py_None) {
            if (add_to(row, key, best) < 0) {
                Py_XDECREF(owned);
                goto error;
            }
            used += best;
        }
        Py_XDECREF(owned);
    }
    PyObject *f = PyFloat_FromDouble(used);
    if (f == NULL) goto error;
    int rc = PyDict_SetItem(row, used_key, f);
    Py_DECREF(f);
    if (rc < 0) goto error;
    return row;
refused:
    Py_DECREF(row);
    return NULL;
error:
    Py_DECREF(row);
    return NULL;
}


static int append_bytes(PyObject *buffer, const void *data, Py_ssize_t n) {
    if (!PyByteArray_CheckExact(buffer)) {
        PyErr_SetString(PyExc_TypeError, "a column is a bytearray");
        return -1;
    }
    Py_ssize_t size = PyByteArray_GET_SIZE(buffer);
    if (PyByteArray_Resize(buffer, size + n) < 0) return -1; /* grows amortized */
    memcpy(PyByteArray_AS_STRING(buffer) + size, data, (size_t)n);
    return 0;
}

/* Append ``row`` to the rank's builder when it is the common case (a step after the
 * last, every column, in the builder's key order): 1 done, 0 not (the caller's Python
 * path takes it), -1 error. */
static int append_fast(PyObject *builder, PyObject *step, PyObject *node, PyObject *row) {
    int result = 0;
    PyObject *keys = NULL, *columns = NULL, *steps = NULL, *last = NULL;
    keys = PyObject_GetAttr(builder, s_keys);
    if (keys == NULL) goto error;
    Py_ssize_t count = PyTuple_GET_SIZE(keys);
    if (!PyTuple_CheckExact(keys) || count == 0 || count != PyDict_GET_SIZE(row)) goto done;
    last = PyObject_GetAttr(builder, s_last);
    if (last == NULL) goto error;
    int after = PyObject_RichCompareBool(step, last, Py_GT);
    if (after < 0) goto error;
    if (!after) goto done;
    Py_ssize_t pos = 0, i = 0;
    PyObject *key, *value;
    while (PyDict_Next(row, &pos, &key, &value)) {
        PyObject *want = PyTuple_GET_ITEM(keys, i++);
        if (key != want) {
            int same = PyObject_RichCompareBool(key, want, Py_EQ);
            if (same < 0) goto error;
            if (!same) goto done;
        }
    }
    columns = PyObject_GetAttr(builder, s_key_columns);
    steps = PyObject_GetAttr(builder, s_steps);
    if (columns == NULL || steps == NULL) goto error;
    if (!PyList_CheckExact(columns) || PyList_GET_SIZE(columns) != count) goto done;
    int overflow = 0;
    long long step_value = PyLong_AsLongLongAndOverflow(step, &overflow);
    if (overflow || (step_value == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        goto done;
    }
    if (append_bytes(steps, &step_value, sizeof step_value) < 0) goto error;
    pos = 0;
    i = 0;
    while (PyDict_Next(row, &pos, &key, &value)) {
        double d = PyFloat_AsDouble(value);
        if (d == -1.0 && PyErr_Occurred()) goto error;
        if (append_bytes(PyList_GET_ITEM(columns, i++), &d, sizeof d) < 0) goto error;
    }
    if (PyObject_SetAttr(builder, s_last, step) < 0 || PyObject_SetAttr(builder, s_node, node) < 0)
        goto error;
    result = 1;
    goto done;
error:
    result = -1;
done:
    Py_XDECREF(keys);
    Py_XDECREF(columns);
    Py_XDECREF(steps);
    Py_XDECREF(last);
    return result;
}

/* step_line(obj, checks, step_event, name_of, cache, ranks, worlds)
 *   -> None (the row was appended to ranks[rank]; its world size added to worlds)
 *    | (rank, step, world_size, node_rank, row) for the caller to add
 *    | 1 (a scalar field is wrong) | 2 (the events are) */
static PyObject *step_line(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "step_line takes 7 arguments");
        return NULL;
    }
    PyObject *obj = args[0], *checks = args[1], *step_event = args[2], *name_of = args[3],
             *cache = args[4], *ranks = args[5], *worlds = args[6];
    if (!PyDict_CheckExact(obj) || !PyTuple_CheckExact(checks) || !PyDict_CheckExact(cache) ||
        !PyUnicode_CheckExact(step_event) || !PyDict_CheckExact(ranks) ||
        !PySet_Check(worlds)) {
        PyErr_SetString(PyExc_TypeError,
                        "step_line(dict, tuple, str, callable, dict, dict, set)");
        return NULL;
    }
    int ok = fields_ok(obj, checks);
    if (ok < 0) return NULL;
    if (ok == 0) return PyLong_FromLong(BAD_FIELDS);
    PyObject *events = PyDict_GetItemWithError(obj, s_events);
    if (events == NULL && PyErr_Occurred()) return NULL;
    PyObject *row = step_row(events, step_event, name_of, cache, s_step, s_used);
    if (row == NULL) {
        if (PyErr_Occurred()) return NULL;
        return PyLong_FromLong(BAD_EVENTS);
    }
    /* The checks made these present and of their types. */
    PyObject *stamp = PyDict_GetItemWithError(obj, s_timestamp);
    PyObject *rank = PyDict_GetItemWithError(obj, s_global_rank);
    PyObject *step = PyDict_GetItemWithError(obj, s_step);
    PyObject *world = PyDict_GetItemWithError(obj, s_world_size);
    PyObject *node = PyDict_GetItemWithError(obj, s_node_rank);
    if (stamp == NULL || rank == NULL || step == NULL || world == NULL || node == NULL) {
        Py_DECREF(row);
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_KeyError, "a step_time key the schema requires");
        return NULL;
    }
    PyObject *ts = PyNumber_Float(stamp);
    if (ts == NULL || PyDict_SetItem(row, s_ts, ts) < 0) {
        Py_XDECREF(ts);
        Py_DECREF(row);
        return NULL;
    }
    Py_DECREF(ts);
    /* the step's tokens, when the line has them (not null): the checks made them an
     * integer >= 0 */
    PyObject *tokens = PyDict_GetItemWithError(obj, s_tokens);
    if (tokens == NULL && PyErr_Occurred()) {
        Py_DECREF(row);
        return NULL;
    }
    if (tokens != NULL && tokens != Py_None) {
        PyObject *value = PyNumber_Float(tokens);
        if (value == NULL || PyDict_SetItem(row, s_row_tokens, value) < 0) {
            Py_XDECREF(value);
            Py_DECREF(row);
            return NULL;
        }
        Py_DECREF(value);
    }
    PyObject *builder = PyDict_GetItemWithError(ranks, rank);
    if (builder == NULL && PyErr_Occurred()) {
        Py_DECREF(row);
        return NULL;
    }
    if (builder != NULL) {
        int done = append_fast(builder, step, node, row);
        if (done != 0) {
            Py_DECREF(row);
            if (done < 0 || PySet_Add(worlds, world) < 0) return NULL;
            Py_RETURN_NONE;
        }
    }
    PyObject *out = PyTuple_Pack(5, rank, step, world, node, row);
    Py_DECREF(row);
    return out;
}

/* scan_lines(lines, start, loads, checks, step_event, name_of, cache, ranks, worlds)
 *   -> (index, obj)
 * Reads lines[start:] while each is a data line whose row the fast path appends (as
 * step_line returning None), and stops at the first other one: its index and its
 * object (None when it is no JSON), for the caller to take the usual way; (len(lines),
 * None) at the end. Saves the Python loop around parse and step_line per line. */
static PyObject *scan_lines(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 9) {
        PyErr_SetString(PyExc_TypeError, "scan_lines takes 9 arguments");
        return NULL;
    }
    PyObject *lines = args[0], *loads = args[2];
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) return NULL;
    if (!PyList_CheckExact(lines)) {
        PyErr_SetString(PyExc_TypeError, "lines is a list");
        return NULL;
    }
    PyObject *step_args[7] = {NULL, args[3], args[4], args[5], args[6], args[7], args[8]};
    Py_ssize_t count = PyList_GET_SIZE(lines);
    for (Py_ssize_t i = start; i < count; i++) {
        PyObject *obj = PyObject_CallOneArg(loads, PyList_GET_ITEM(lines, i));
        if (obj == NULL) {
            PyErr_Clear(); /* no JSON: the caller counts it */
            return Py_BuildValue("(nO)", i, Py_None);
        }
        if (!PyDict_CheckExact(obj) || PyDict_GetItemWithError(obj, s_closing) != NULL ||
            PyErr_Occurred()) {
            PyErr_Clear();
            PyObject *out = Py_BuildValue("(nN)", i, obj);
            return out;
        }
        step_args[0] = obj;
        PyObject *found = step_line(module, step_args, 7);
        if (found == NULL) {
            Py_DECREF(obj);
            return NULL;
        }
        int appended = found == Py_None;
        Py_DECREF(found);
        if (!appended) return Py_BuildValue("(nN)", i, obj);
        Py_DECREF(obj);
    }
    return Py_BuildValue("(nO)", count, Py_None);
}

static PyMethodDef methods[] = {
    {"step_line", (PyCFunction)(void (*)(void))step_line, METH_FASTCALL,
     "step_line(obj, checks, step_event, name_of, cache, ranks, worlds) -> None when a "
     "usable step_time line's row was appended to its rank's builder, (rank, step, "
     "world_size, node_rank, row) when the caller is to add it; 1 when a scalar field is "
     "wrong, 2 when its events are."},
    {"scan_lines", (PyCFunction)(void (*)(void))scan_lines, METH_FASTCALL,
     "scan_lines(lines, start, loads, checks, step_event, name_of, cache, ranks, worlds) "
     "-> (index, obj): parses and appends lines[start:] while step_line would append them "
     "itself; stops at the first other line (its index and object, None when no JSON)."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "traceml_ai.run_summary._rowscan",
    "One step_time line's checks and step row, in C (the files reader's twin).", -1, methods,
};

PyMODINIT_FUNC PyInit__rowscan(void) {
    s_events = PyUnicode_InternFromString("events");
    s_step = PyUnicode_InternFromString("step");
    s_used = PyUnicode_InternFromString("_used");
    s_ts = PyUnicode_InternFromString("_ts");
    s_global_rank = PyUnicode_InternFromString("global_rank");
    s_world_size = PyUnicode_InternFromString("world_size");
    s_node_rank = PyUnicode_InternFromString("node_rank");
    s_timestamp = PyUnicode_InternFromString("timestamp_unix_ns");
    s_keys = PyUnicode_InternFromString("keys");
    s_key_columns = PyUnicode_InternFromString("key_columns");
    s_steps = PyUnicode_InternFromString("steps");
    s_last = PyUnicode_InternFromString("last");
    s_node = PyUnicode_InternFromString("node");
    s_duration = PyUnicode_InternFromString("duration_ms");
    s_cpu = PyUnicode_InternFromString("cpu_ms");
    s_gpu = PyUnicode_InternFromString("gpu_ms");
    s_calls = PyUnicode_InternFromString("n_calls");
    s_closing = PyUnicode_InternFromString("closing");
    s_tokens = PyUnicode_InternFromString("tokens");
    s_row_tokens = PyUnicode_InternFromString("_tokens");
    if (!s_closing || !s_tokens || !s_row_tokens) return NULL;
    if (!s_keys || !s_key_columns || !s_steps || !s_last || !s_node || !s_duration || !s_cpu ||
        !s_gpu || !s_calls)
        return NULL;
    if (!s_events || !s_step || !s_used || !s_ts || !s_global_rank || !s_world_size ||
        !s_node_rank || !s_timestamp)
        return NULL;
    return PyModule_Create(&module_def);
}
