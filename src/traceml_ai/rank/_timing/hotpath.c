/*
 * traceml_ai.rank._timing.hotpath: the step timer's per-step and per-call work in C.
 *
 * Its interface is hotpath.pyi; its pure-Python twin, hotpath_py.py, defines the same
 * names and the behaviour; timer_core.py chooses between the two.
 *
 * TimerCore is the base of step_timer.StepTimer, Slot its in-flight phase and
 * StepContext the `with trace_step(model)` context. begin, end, open, close, restart
 * and add_host run in every traced step, called by torch's hooks and the framework
 * brackets. Inside a framework's loop TraceML's objects are cold, and each Python
 * frame and object touched costs (docs/benchmarks.md has the figures), so the common
 * case runs here without a frame, its state in C fields: a step off CUDA whose model
 * stayed where it was, on the training thread, adding to a phase the step's (reused)
 * phase dict already has, its numbers left to the sender's thread. Every other case is
 * handed, untouched, to the methods of hotpath_py.TimerCore (configure()), which
 * define the behaviour; tests run the timer's suites over both.
 *
 * FastPatch is what the patches of torch put in place (the DataLoader wait, backward,
 * Tensor.to/.cuda): their common case without a Python frame or a repacking of the
 * call's arguments, every other case handed to their Python wrappers.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <limits.h>
#include <pythread.h>

/* time.perf_counter_ns(), the clock the Python methods read. */
static inline long long now_ns(void) {
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t;
    (void)PyTime_PerfCounterRaw(&t);
    return (long long)t;
#else
    return (long long)_PyTime_GetPerfCounter();
#endif
}

/* time.time_ns(), the wall clock of a step's timestamp. */
static inline long long wall_ns(void) {
#if PY_VERSION_HEX >= 0x030D0000
    PyTime_t t;
    (void)PyTime_TimeRaw(&t);
    return (long long)t;
#else
    return (long long)_PyTime_GetSystemClock();
#endif
}

/* ---- Slot ----------------------------------------------------------------- */

typedef struct {
    PyObject_HEAD
    int depth;     /* nested calls: only the outermost is counted */
    long long t0;  /* perf_counter_ns at the outermost open */
    PyObject *ev0; /* its start CUDA event, or None */
    char autotime; /* "auto": whether its hooks time it */
} SlotObject;

static PyObject *slot_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    if (PyTuple_GET_SIZE(args) || (kwargs && PyDict_GET_SIZE(kwargs))) {
        PyErr_SetString(PyExc_TypeError, "Slot() takes no arguments");
        return NULL;
    }
    SlotObject *self = (SlotObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(Py_None);
    self->ev0 = Py_None;
    self->autotime = 1;
    return (PyObject *)self;
}

static void slot_dealloc(SlotObject *self) {
    Py_XDECREF(self->ev0);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMemberDef slot_members[] = {
    {"depth", T_INT, offsetof(SlotObject, depth), 0, "nested calls open"},
    {"t0", T_LONGLONG, offsetof(SlotObject, t0), 0, "perf_counter_ns at the open"},
    {"ev0", T_OBJECT, offsetof(SlotObject, ev0), 0, "the start CUDA event, or None"},
    {"auto", T_BOOL, offsetof(SlotObject, autotime), 0, "whether its hooks time it"},
    {NULL},
};

static PyTypeObject SlotType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceml_ai.rank._timing.hotpath.Slot",
    .tp_doc = "An in-flight hook-timed phase; depth keeps nested calls from counting twice.",
    .tp_basicsize = sizeof(SlotObject),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = slot_new,
    .tp_dealloc = (destructor)slot_dealloc,
    .tp_members = slot_members,
};

/* ---- what configure() gives ---------------------------------------------- */

static PyObject *str_begin = NULL, *str_end = NULL, *str_discard = NULL;
static PyObject *py_open = NULL, *py_close = NULL, *py_restart = NULL, *py_add_host = NULL,
                *py_add_host_inner = NULL, *py_begin = NULL, *py_end = NULL, *str_fail = NULL,
                *str_get_device = NULL, *str_append = NULL, *step_time_name = NULL;
static PyTypeObject *phase_type = NULL;
static Py_ssize_t phase_cpu_ns = -1, phase_n_calls = -1, phase_missing = -1;

#define SLOT_AT(obj, offset) (*(PyObject **)((char *)(obj) + (offset)))

static Py_ssize_t slot_offset(PyTypeObject *type, const char *name) {
    PyObject *descr = PyObject_GetAttrString((PyObject *)type, name);
    if (descr == NULL) return -1;
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *def = ((PyMemberDescrObject *)descr)->d_member;
        if (def->type == T_OBJECT_EX) offset = def->offset;
    }
    Py_DECREF(descr);
    if (offset < 0) PyErr_Format(PyExc_TypeError, "%s is not a slot of the phase class", name);
    return offset;
}

static PyObject *get_function(PyObject *cls, const char *name) {
    PyObject *fn = PyObject_GetAttrString(cls, name);
    if (fn != NULL && !PyCallable_Check(fn)) {
        Py_DECREF(fn);
        PyErr_Format(PyExc_TypeError, "%s is not callable", name);
        return NULL;
    }
    return fn;
}

/* configure(py_core_class, phase_class, step_time_name): the Python methods every case
 * but the common one is handed to, where a phase keeps its counts, and the name of the
 * step's own phase. */
#define N_DELEGATES 7
static PyObject *configure(PyObject *module, PyObject *args) {
    PyObject *core, *phase, *name;
    if (!PyArg_ParseTuple(args, "O!O!U", &PyType_Type, &core, &PyType_Type, &phase, &name)) {
        return NULL;
    }
    PyObject *fns[N_DELEGATES] = {NULL};
    static const char *names[N_DELEGATES] = {"open", "close", "restart", "add_host",
                                             "_add_host", "begin", "end"};
    for (int i = 0; i < N_DELEGATES; i++) {
        fns[i] = get_function(core, names[i]);
        if (fns[i] == NULL) {
            for (int j = 0; j < i; j++) Py_DECREF(fns[j]);
            return NULL;
        }
    }
    Py_ssize_t cpu = slot_offset((PyTypeObject *)phase, "cpu_ns");
    Py_ssize_t n = cpu < 0 ? -1 : slot_offset((PyTypeObject *)phase, "n_calls");
    Py_ssize_t missing = n < 0 ? -1 : slot_offset((PyTypeObject *)phase, "missing");
    if (missing < 0) {
        for (int j = 0; j < N_DELEGATES; j++) Py_DECREF(fns[j]);
        return NULL;
    }
    Py_XSETREF(py_open, fns[0]);
    Py_XSETREF(py_close, fns[1]);
    Py_XSETREF(py_restart, fns[2]);
    Py_XSETREF(py_add_host, fns[3]);
    Py_XSETREF(py_add_host_inner, fns[4]);
    Py_XSETREF(py_begin, fns[5]);
    Py_XSETREF(py_end, fns[6]);
    Py_INCREF(phase);
    Py_XSETREF(phase_type, (PyTypeObject *)phase);
    Py_INCREF(name);
    Py_XSETREF(step_time_name, name);
    phase_cpu_ns = cpu;
    phase_n_calls = n;
    phase_missing = missing;
    Py_RETURN_NONE;
}

/* ---- TimerCore ------------------------------------------------------------ */

typedef struct {
    PyObject_HEAD
    char in_step;         /* a traced step is open */
    char enabled;         /* measuring (False after an internal error) */
    char defer;           /* a step off CUDA leaves its numbers for the builder */
    char auto_backward;   /* the backward patch times backward */
    char auto_dataloader; /* the DataLoader patch times the waits */
    char bracket;         /* backward ends forward and restarts the optimizer (FastPatch) */
    char bracket_optimizer; /* with bracket: backward's end opens the optimizer phase */
    Py_ssize_t max_ended; /* "_max_ended": MAX_ENDED_STEPS */
    Py_ssize_t wake_at;   /* "_wake_at": ENDED_WAKE_AT */
    unsigned long thread; /* the training thread's ident: other threads are ignored */
    long long step;       /* the current (or last) step's number */
    long long t0;         /* "_t0": perf_counter_ns at the step's begin */
    PyObject *cuda_index; /* the step's CUDA device index, or None */
    PyObject *acc;        /* "_acc": the phases of the current (or next) step */
    PyObject *slots[4];   /* fwd, bwd, opt, h2d */
    PyObject *device;     /* the step's device key */
    PyObject *model_ref, *probe, *probe_at; /* "_model_ref", "_probe", "_probe_at" */
    PyObject *pending, *ended, *ended_at, *spare_acc; /* "_pending", "_ended", ... */
    PyObject *wake_builder;
} CoreObject;

static PyObject *core_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    CoreObject *self = (CoreObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    self->acc = PyDict_New();
    if (self->acc == NULL) {
        Py_DECREF(self);
        return NULL;
    }
    Py_INCREF(Py_None);
    self->cuda_index = Py_None;
    self->thread = PyThread_get_thread_ident();
    return (PyObject *)self; /* StepTimer.__init__ sets the rest */
}

#define CORE_OBJECTS(X)                                                                   \
    X(cuda_index) X(acc) X(slots[0]) X(slots[1]) X(slots[2]) X(slots[3]) X(device)          \
    X(model_ref) X(probe) X(probe_at) X(pending) X(ended) X(ended_at) X(spare_acc)         \
    X(wake_builder)

static int core_traverse(CoreObject *self, visitproc visit, void *arg) {
#define VISIT(field) Py_VISIT(self->field);
    CORE_OBJECTS(VISIT)
#undef VISIT
    return 0;
}

static int core_clear(CoreObject *self) {
#define CLEAR(field) Py_CLEAR(self->field);
    CORE_OBJECTS(CLEAR)
#undef CLEAR
    return 0;
}

/* A static type: a Python subclass's dealloc (subtype_dealloc) releases its own type
 * and visits it in traverse, so neither is done here. */
static void core_dealloc(CoreObject *self) {
    PyObject_GC_UnTrack(self);
    core_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *call2(PyObject *fn, PyObject *a, PyObject *b) {
    PyObject *args[2] = {a, b};
    return PyObject_Vectorcall(fn, args, 2, NULL);
}

static PyObject *call3(PyObject *fn, PyObject *a, PyObject *b, PyObject *c) {
    PyObject *args[3] = {a, b, c};
    return PyObject_Vectorcall(fn, args, 3, NULL);
}

/* What the Python methods do with an exception of their work: fail(exc) (stop
 * measuring; training goes on). */
static PyObject *fail_with_current(CoreObject *self) {
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (!PyErr_GivenExceptionMatches(type, PyExc_Exception)) {
        PyErr_Restore(type, value, tb); /* not an Exception: it propagates, as in Python */
        return NULL;
    }
    if (tb != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    PyObject *result = PyObject_CallMethodOneArg((PyObject *)self, str_fail, value);
    Py_DECREF(value);
    return result;
}

/* Add dt to the existing phase `name` of self->acc: 1 done, 0 "not the common case"
 * (nothing changed), -1 error. */
static int add_existing(CoreObject *self, PyObject *name, long long dt) {
    PyObject *acc = self->acc;
    if (acc == NULL || !PyDict_CheckExact(acc)) return 0;
    PyObject *phase = PyDict_GetItemWithError(acc, name);
    if (phase == NULL) return PyErr_Occurred() ? -1 : 0;
    if (Py_TYPE(phase) != phase_type || SLOT_AT(phase, phase_missing) != Py_True) return 0;
    PyObject *cpu = SLOT_AT(phase, phase_cpu_ns), *n = SLOT_AT(phase, phase_n_calls);
    if (cpu == NULL || n == NULL || !PyLong_CheckExact(cpu) || !PyLong_CheckExact(n)) return 0;
    int overflow = 0;
    long long cpu_v = PyLong_AsLongLongAndOverflow(cpu, &overflow);
    if (overflow) return 0;
    long long n_v = PyLong_AsLongLongAndOverflow(n, &overflow);
    if (overflow) return 0;
    if ((cpu_v == -1 || n_v == -1) && PyErr_Occurred()) return -1;
    if ((dt > 0 && cpu_v > LLONG_MAX - dt) || (dt < 0 && cpu_v < LLONG_MIN - dt) ||
        n_v == LLONG_MAX) {
        return 0; /* Python's ints go on past 64 bits */
    }
    PyObject *new_cpu = PyLong_FromLongLong(cpu_v + dt);
    if (new_cpu == NULL) return -1;
    PyObject *new_n = PyLong_FromLongLong(n_v + 1);
    if (new_n == NULL) {
        Py_DECREF(new_cpu);
        return -1;
    }
    Py_SETREF(SLOT_AT(phase, phase_cpu_ns), new_cpu);
    Py_SETREF(SLOT_AT(phase, phase_n_calls), new_n);
    return 1;
}

/* _add_host(name, dt) for a call of this thread: the common case here, else Python's. */
static PyObject *add_host_checked(CoreObject *self, PyObject *name, long long dt) {
    int done = add_existing(self, name, dt);
    if (done == 1) Py_RETURN_NONE;
    if (done == 0) {
        PyObject *dt_obj = PyLong_FromLongLong(dt);
        if (dt_obj != NULL) {
            PyObject *r = call3(py_add_host_inner, (PyObject *)self, name, dt_obj);
            Py_DECREF(dt_obj);
            if (r != NULL) return r;
        }
    }
    return fail_with_current(self);
}

/* 0, or -1 with a TypeError: a METH_FASTCALL method given other than `want` arguments. */
static int arity(Py_ssize_t nargs, Py_ssize_t want, const char *signature) {
    if (nargs == want) return 0;
    PyErr_Format(PyExc_TypeError, "%s takes %zd arguments", signature, want);
    return -1;
}

static inline int is_slot(PyObject *obj) { return Py_IS_TYPE(obj, &SlotType); }

static int not_configured(void) {
    if (py_open != NULL) return 0;
    PyErr_SetString(PyExc_RuntimeError, "traceml_ai.rank._timing.hotpath is not configured");
    return 1;
}

static inline int other_thread(CoreObject *self) {
    return PyThread_get_thread_ident() != self->thread;
}

static PyObject *core_open(CoreObject *self, PyObject *slot_obj) {
    if (not_configured()) return NULL;
    if (!is_slot(slot_obj)) return call2(py_open, (PyObject *)self, slot_obj);
    SlotObject *slot = (SlotObject *)slot_obj;
    if (!self->in_step || other_thread(self)) Py_RETURN_NONE;
    if (slot->depth == 0) {
        if (self->cuda_index != Py_None) return call2(py_open, (PyObject *)self, slot_obj);
        if (slot->ev0 != Py_None) {
            Py_INCREF(Py_None);
            Py_XSETREF(slot->ev0, Py_None);
        }
        slot->t0 = now_ns();
    }
    slot->depth++;
    Py_RETURN_NONE;
}

static PyObject *core_close(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (arity(nargs, 2, "close(slot, name)") < 0 || not_configured()) return NULL;
    PyObject *slot_obj = args[0], *name = args[1];
    if (!is_slot(slot_obj) || !PyUnicode_CheckExact(name)) {
        return call3(py_close, (PyObject *)self, slot_obj, name);
    }
    SlotObject *slot = (SlotObject *)slot_obj;
    if (slot->depth == 0 || other_thread(self)) Py_RETURN_NONE;
    if (slot->depth < 0 || slot->ev0 != Py_None) {
        return call3(py_close, (PyObject *)self, slot_obj, name);
    }
    if (--slot->depth > 0) Py_RETURN_NONE;
    long long dt = now_ns() - slot->t0;
    if (!self->in_step) Py_RETURN_NONE;
    return add_host_checked(self, name, dt);
}

static PyObject *core_restart(CoreObject *self, PyObject *slot_obj) {
    if (not_configured()) return NULL;
    if (!is_slot(slot_obj)) return call2(py_restart, (PyObject *)self, slot_obj);
    SlotObject *slot = (SlotObject *)slot_obj;
    if (slot->depth == 0 || other_thread(self)) Py_RETURN_NONE;
    if (slot->ev0 != Py_None) return call2(py_restart, (PyObject *)self, slot_obj);
    slot->t0 = now_ns();
    Py_RETURN_NONE;
}

static PyObject *core_add_host(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (arity(nargs, 2, "add_host(name, dt_ns)") < 0 || not_configured()) return NULL;
    PyObject *name = args[0], *dt_obj = args[1];
    if (!PyUnicode_CheckExact(name) || !PyLong_CheckExact(dt_obj)) {
        return call3(py_add_host, (PyObject *)self, name, dt_obj);
    }
    int overflow = 0;
    long long dt = PyLong_AsLongLongAndOverflow(dt_obj, &overflow);
    if (overflow || (dt == -1 && PyErr_Occurred())) {
        PyErr_Clear();
        return call3(py_add_host, (PyObject *)self, name, dt_obj);
    }
    if (other_thread(self)) Py_RETURN_NONE;
    return add_host_checked(self, name, dt);
}

/* _add_host(name, dt_ns): add_host without the thread check (the step's own end). */
static PyObject *core_add_host_inner(CoreObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (arity(nargs, 2, "_add_host(name, dt_ns)") < 0 || not_configured()) return NULL;
    PyObject *name = args[0], *dt_obj = args[1];
    int overflow = 0;
    long long dt = 0;
    if (PyUnicode_CheckExact(name) && PyLong_CheckExact(dt_obj)) {
        dt = PyLong_AsLongLongAndOverflow(dt_obj, &overflow);
        if (dt == -1 && PyErr_Occurred()) return NULL;
        if (!overflow) {
            int done = add_existing(self, name, dt);
            if (done != 0) {
                if (done < 0) return NULL;
                Py_RETURN_NONE;
            }
        }
    }
    return call3(py_add_host_inner, (PyObject *)self, name, dt_obj);
}

static inline int slots_ready(CoreObject *self) {
    for (int i = 0; i < 4; i++) {
        if (self->slots[i] == NULL || !is_slot(self->slots[i])) return 0;
    }
    return 1;
}

/* Whether the model's probe tensor is where _locate found it: 1 yes, 0 no (or a case
 * Python handles: a gone tensor, an error). */
static int probe_unmoved(CoreObject *self) {
    if (self->probe == NULL || self->probe == Py_None) return 1;
    PyObject *probe = PyObject_CallNoArgs(self->probe);
    if (probe == NULL || probe == Py_None) {
        PyErr_Clear();
        Py_XDECREF(probe);
        return 0;
    }
    PyObject *where = PyObject_CallMethodNoArgs(probe, str_get_device);
    Py_DECREF(probe);
    if (where == NULL) {
        PyErr_Clear();
        return 0;
    }
    int moved = PyObject_RichCompareBool(where, self->probe_at ? self->probe_at : Py_None, Py_NE);
    Py_DECREF(where);
    if (moved < 0) PyErr_Clear();
    return moved == 0;
}

static PyObject *core_begin(CoreObject *self, PyObject *model) {
    if (not_configured()) return NULL;
    /* The common case: the model of the last step, still where it was, off CUDA. */
    if (model == Py_None || self->cuda_index != Py_None || self->model_ref == NULL ||
        self->model_ref == Py_None || !slots_ready(self)) {
        return call2(py_begin, (PyObject *)self, model);
    }
    PyObject *current = PyObject_CallNoArgs(self->model_ref);
    if (current == NULL) PyErr_Clear();
    int same = current == model;
    Py_XDECREF(current);
    if (!same || !probe_unmoved(self)) return call2(py_begin, (PyObject *)self, model);
    self->thread = PyThread_get_thread_ident();
    self->step++;
    for (int i = 0; i < 4; i++) ((SlotObject *)self->slots[i])->depth = 0;
    self->in_step = 1;
    self->t0 = now_ns();
    Py_RETURN_NONE;
}

/* (step, ts, device): what Py_BuildValue("(LLO)") gives, without parsing a format. */
static PyObject *step_at(long long step, long long ts, PyObject *device) {
    PyObject *tuple = PyTuple_New(3);
    if (tuple == NULL) return NULL;
    PyObject *step_obj = PyLong_FromLongLong(step);
    PyObject *ts_obj = step_obj == NULL ? NULL : PyLong_FromLongLong(ts);
    if (ts_obj == NULL) {
        Py_XDECREF(step_obj);
        Py_DECREF(tuple);
        return NULL;
    }
    Py_INCREF(device);
    PyTuple_SET_ITEM(tuple, 0, step_obj);
    PyTuple_SET_ITEM(tuple, 1, ts_obj);
    PyTuple_SET_ITEM(tuple, 2, device);
    return tuple;
}

static PyObject *append(PyObject *queue, PyObject *item) {
    return PyObject_CallMethodOneArg(queue, str_append, item);
}

static PyObject *core_end(CoreObject *self, PyObject *unused) {
    if (not_configured()) return NULL;
    /* The common case: a step off CUDA whose numbers wait for the builder's thread. */
    if (!self->defer || self->cuda_index != Py_None || !slots_ready(self) ||
        self->acc == NULL || self->pending == NULL || self->ended == NULL ||
        self->ended_at == NULL || self->device == NULL || self->spare_acc == NULL ||
        !PyList_CheckExact(self->spare_acc)) {
        return PyObject_CallOneArg(py_end, (PyObject *)self);
    }
    Py_ssize_t pending = PyObject_Size(self->pending);
    Py_ssize_t ended = pending == 0 ? PyObject_Size(self->ended) : -1;
    if (pending != 0 || ended < 0 || ended >= self->max_ended) {
        PyErr_Clear();
        return PyObject_CallOneArg(py_end, (PyObject *)self);
    }
    long long dt = now_ns() - self->t0;
    self->in_step = 0;
    int done = add_existing(self, step_time_name, dt);
    if (done < 0) return NULL;
    if (done == 0) {
        PyObject *dt_obj = PyLong_FromLongLong(dt);
        if (dt_obj == NULL) return NULL;
        PyObject *r = call3(py_add_host_inner, (PyObject *)self, step_time_name, dt_obj);
        Py_DECREF(dt_obj);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    for (int i = 0; i < 4; i++) ((SlotObject *)self->slots[i])->depth = 0;
    PyObject *acc = self->acc; /* the reference moves to the ended queue */
    Py_ssize_t spares = PyList_GET_SIZE(self->spare_acc);
    PyObject *next;
    if (spares > 0) {
        next = PyList_GET_ITEM(self->spare_acc, spares - 1);
        Py_INCREF(next);
        if (PyList_SetSlice(self->spare_acc, spares - 1, spares, NULL) < 0) {
            Py_DECREF(next);
            return NULL;
        }
    } else {
        next = PyDict_New();
        if (next == NULL) return NULL;
    }
    self->acc = next;
    PyObject *at = step_at(self->step, wall_ns(), self->device);
    if (at == NULL) {
        Py_DECREF(acc);
        return NULL;
    }
    /* (step, ts, device) first: a builder that sees the phases finds their numbers. */
    PyObject *r = append(self->ended_at, at);
    Py_DECREF(at);
    if (r == NULL) {
        Py_DECREF(acc);
        return NULL;
    }
    Py_DECREF(r);
    r = append(self->ended, acc);
    Py_DECREF(acc);
    if (r == NULL) return NULL;
    Py_DECREF(r);
    if (ended + 1 == self->wake_at && self->wake_builder != NULL &&
        self->wake_builder != Py_None) {
        r = PyObject_CallNoArgs(self->wake_builder);
        if (r == NULL) return NULL;
        Py_DECREF(r);
    }
    Py_RETURN_NONE;
}

static PyMethodDef core_methods[] = {
    {"open", (PyCFunction)core_open, METH_O,
     "Start a hook-timed phase (forward, backward, optimizer) inside a step."},
    {"close", (PyCFunction)(void (*)(void))core_close, METH_FASTCALL,
     "End a hook-timed phase; only the outermost of nested calls is counted."},
    {"restart", (PyCFunction)core_restart, METH_O,
     "Move an open phase's start to now (nothing when it is not open)."},
    {"add_host", (PyCFunction)(void (*)(void))core_add_host, METH_FASTCALL,
     "Add one host-timed call (the DataLoader wait) to the current or next step."},
    {"begin", (PyCFunction)core_begin, METH_O, "Start step ``self.step + 1``."},
    {"end", (PyCFunction)core_end, METH_NOARGS,
     "Finish the current step and send its items (or leave them to the builder)."},
    {"_add_host", (PyCFunction)(void (*)(void))core_add_host_inner, METH_FASTCALL,
     "Add a host-timed call to a phase of the current step, on any thread."},
    {NULL},
};

#define OBJ(name, field, doc) {name, T_OBJECT, offsetof(CoreObject, field), 0, doc},
static PyMemberDef core_members[] = {
    {"in_step", T_BOOL, offsetof(CoreObject, in_step), 0, "whether a traced step is open"},
    {"enabled", T_BOOL, offsetof(CoreObject, enabled), 0, "whether it measures"},
    {"defer", T_BOOL, offsetof(CoreObject, defer), 0, "steps off CUDA left to the builder"},
    {"auto_backward", T_BOOL, offsetof(CoreObject, auto_backward), 0,
     "whether the backward patch times backward"},
    {"auto_dataloader", T_BOOL, offsetof(CoreObject, auto_dataloader), 0,
     "whether the DataLoader patch times the waits"},
    {"bracket", T_BOOL, offsetof(CoreObject, bracket), 0,
     "whether backward ends forward and restarts the optimizer phase"},
    {"bracket_optimizer", T_BOOL, offsetof(CoreObject, bracket_optimizer), 0,
     "with bracket: whether backward's end opens the optimizer phase (not open yet)"},
    {"thread", T_ULONG, offsetof(CoreObject, thread), 0, "the training thread's ident"},
    {"step", T_LONGLONG, offsetof(CoreObject, step), 0, "the current (or last) step"},
    {"_max_ended", T_PYSSIZET, offsetof(CoreObject, max_ended), 0, "MAX_ENDED_STEPS"},
    {"_wake_at", T_PYSSIZET, offsetof(CoreObject, wake_at), 0, "ENDED_WAKE_AT"},
    {"_t0", T_LONGLONG, offsetof(CoreObject, t0), 0, "perf_counter_ns at the step's begin"},
    OBJ("cuda_index", cuda_index, "the step's CUDA device index, or None")
    {"_acc", T_OBJECT_EX, offsetof(CoreObject, acc), 0, "the current (or next) step's phases"},
    OBJ("fwd", slots[0], "the forward phase in flight")
    OBJ("bwd", slots[1], "the backward phase in flight")
    OBJ("opt", slots[2], "the optimizer phase in flight")
    OBJ("h2d", slots[3], "the host-to-device phase in flight")
    OBJ("device", device, "the step's device key")
    OBJ("_model_ref", model_ref, "the traced model, weakly")
    OBJ("_probe", probe, "a tensor of the model, weakly")
    OBJ("_probe_at", probe_at, "where that tensor was")
    OBJ("_pending", pending, "CUDA steps waiting for their events")
    OBJ("_ended", ended, "phases of ended steps left to the builder")
    OBJ("_ended_at", ended_at, "(step, ts, device) of those steps")
    OBJ("_spare_acc", spare_acc, "zeroed phase dicts for later steps")
    OBJ("wake_builder", wake_builder, "wakes the builder's thread, or None")
    {NULL},
};
#undef OBJ

static PyTypeObject CoreType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceml_ai.rank._timing.hotpath.TimerCore",
    .tp_doc = "The step timer's per-call methods in C (the base of StepTimer).",
    .tp_basicsize = sizeof(CoreObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_BASETYPE | Py_TPFLAGS_HAVE_GC,
    .tp_new = core_new,
    .tp_dealloc = (destructor)core_dealloc,
    .tp_traverse = (traverseproc)core_traverse,
    .tp_clear = (inquiry)core_clear,
    .tp_methods = core_methods,
    .tp_members = core_members,
};

/* ---- StepContext ------------------------------------------------------------
 *
 * ``with trace_step(model):`` (hotpath_py.StepContext is the same in Python): its
 * __enter__ and __exit__ run every traced step, and call the timer's begin and end
 * (its methods, whichever class defines them). An Exception from them stops the
 * timer (timer.fail) and never reaches training; a step whose body raised is
 * discarded. Exceptions of the body propagate unchanged.
 */

typedef struct {
    PyObject_HEAD
    PyObject *timer;
    PyObject *model;
    char live; /* entered, and its step began */
} ContextObject;

static PyTypeObject ContextType;

static PyObject *context_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *timer, *model;
    static char *keywords[] = {"timer", "model", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO", keywords, &timer, &model)) return NULL;
    ContextObject *self = (ContextObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(timer);
    self->timer = timer;
    Py_INCREF(model);
    self->model = model;
    return (PyObject *)self;
}

static int context_traverse(ContextObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->timer);
    Py_VISIT(self->model);
    return 0;
}

static int context_clear(ContextObject *self) {
    Py_CLEAR(self->timer);
    Py_CLEAR(self->model);
    return 0;
}

static void context_dealloc(ContextObject *self) {
    PyObject_GC_UnTrack(self);
    context_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* timer.enabled / timer.in_step: 1, 0, or -1 (error). */
static int timer_flag(PyObject *timer, int in_step) {
    if (PyObject_TypeCheck(timer, &CoreType)) {
        CoreObject *core = (CoreObject *)timer;
        return in_step ? core->in_step : core->enabled;
    }
    PyObject *value = PyObject_GetAttrString(timer, in_step ? "in_step" : "enabled");
    if (value == NULL) return -1;
    int truth = PyObject_IsTrue(value);
    Py_DECREF(value);
    return truth;
}

/* The result of a call to the timer (NULL: it raised): an Exception goes to
 * timer.fail(exc), anything else propagates. */
static PyObject *guarded(PyObject *timer, PyObject *result) {
    if (result != NULL) {
        Py_DECREF(result);
        Py_RETURN_NONE;
    }
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyErr_NormalizeException(&type, &value, &tb);
    if (!PyErr_GivenExceptionMatches(type, PyExc_Exception)) {
        PyErr_Restore(type, value, tb);
        return NULL;
    }
    if (tb != NULL) PyException_SetTraceback(value, tb);
    Py_XDECREF(type);
    Py_XDECREF(tb);
    result = PyObject_CallMethodOneArg(timer, str_fail, value);
    Py_DECREF(value);
    if (result == NULL) return NULL;
    Py_DECREF(result);
    Py_RETURN_NONE;
}

static PyObject *context_enter(ContextObject *self, PyObject *unused) {
    PyObject *timer = self->timer;
    int enabled = timer_flag(timer, 0);
    int nested = enabled > 0 ? timer_flag(timer, 1) : 0;
    if (enabled < 0 || nested < 0) return NULL;
    if (!enabled || nested) Py_RETURN_NONE; /* disabled, or a nested step: the outer one is measured */
    PyObject *result = PyObject_CallMethodOneArg(timer, str_begin, self->model);
    if (result != NULL) self->live = 1;
    return guarded(timer, result);
}

static PyObject *context_exit(ContextObject *self, PyObject *const *args, Py_ssize_t nargs) {
    if (arity(nargs, 3, "__exit__") < 0) return NULL;
    if (!self->live) Py_RETURN_NONE;
    self->live = 0;
    PyObject *timer = self->timer;
    int enabled = timer_flag(timer, 0);
    if (enabled < 0) return NULL;
    if (!enabled) Py_RETURN_NONE;
    /* A step whose body raised is discarded, as TraceML 0.5.0 does. */
    PyObject *name = args[0] != Py_None ? str_discard : str_end;
    return guarded(timer, PyObject_CallMethodNoArgs(timer, name));
}

static PyObject *context_reusable_for(ContextObject *self, PyObject *const *args,
                                      Py_ssize_t nargs) {
    if (arity(nargs, 2, "reusable_for(timer, model)") < 0) return NULL;
    return PyBool_FromLong(args[0] != Py_None && !self->live && self->timer == args[0] &&
                           self->model == args[1]);
}

static PyMethodDef context_methods[] = {
    {"__enter__", (PyCFunction)context_enter, METH_NOARGS, "Begin the step."},
    {"__exit__", (PyCFunction)(void (*)(void))context_exit, METH_FASTCALL,
     "End the step (discard it when its body raised); exceptions propagate."},
    {"reusable_for", (PyCFunction)(void (*)(void))context_reusable_for, METH_FASTCALL,
     "Whether entering this context again is trace_step(model) now: not in use, made for"
     " model and for timer, the running timer (None: never)."},
    {NULL},
};

static PyMemberDef context_members[] = {
    {"_timer", T_OBJECT_EX, offsetof(ContextObject, timer), READONLY, "the step timer"},
    {"_model", T_OBJECT_EX, offsetof(ContextObject, model), READONLY, "the traced model"},
    {"_live", T_BOOL, offsetof(ContextObject, live), 0, "whether its step began"},
    {NULL},
};

static PyTypeObject ContextType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceml_ai.rank._timing.hotpath.StepContext",
    .tp_doc = "with trace_step(model): one traced step; exceptions propagate unchanged.",
    .tp_basicsize = sizeof(ContextObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_new = context_new,
    .tp_dealloc = (destructor)context_dealloc,
    .tp_traverse = (traverseproc)context_traverse,
    .tp_clear = (inquiry)context_clear,
    .tp_methods = context_methods,
    .tp_members = context_members,
};


/* ---- FastPatch -----------------------------------------------------------------
 *
 * What install_patches and install_h2d_patch put in place of a torch function or
 * method: Tensor.to and .cuda (OUTSIDE_STEP), the DataLoader iterator's __next__
 * (DATALOADER) and torch.autograd.backward (BACKWARD). `slow` is the Python wrapper
 * that defines what the patch does (phase_hooks, wrappers); the patch does its common
 * case here, without a Python frame or a repacking of the call's arguments, and
 * hands every other case to `slow` with the arguments as they came:
 *
 * - no timer active (phase_hooks._ACTIVE is None): the original, untouched;
 * - OUTSIDE_STEP: outside a traced step, the original; inside one, `slow`;
 * - DATALOADER: auto_dataloader off, the original; else the fetch timed and added to
 *   the DataLoader phase (timer.add_host) when it returned a batch;
 * - BACKWARD: outside a step, auto_backward off, on another thread than the
 *   step's, or nested in a backward, the original; else the backward phase opened
 *   and closed around it, and with the timer's bracket on, an open forward closed
 *   before it and an open optimizer phase restarted after it (with
 *   bracket_optimizer, one not open yet opened there). (The Python wrapper also steps
 *   aside while torch.compile traces it; dynamo cannot trace into C, so this code
 *   only ever runs eagerly.)
 *
 * A timer of another class than TimerCore's, or fast patches switched off (set_fast_patches:
 * tests of the pure-Python methods), hand every call to `slow`.
 */

enum { PATCH_OUTSIDE_STEP = 0, PATCH_DATALOADER = 1, PATCH_BACKWARD = 2 };

typedef struct {
    PyObject_HEAD
    PyObject *original;
    PyObject *slow;
    PyObject *dict; /* __wrapped__, __name__, __doc__, ... (functools.update_wrapper) */
    int kind;
    vectorcallfunc vectorcall;
} FastPatchObject;

static PyObject *active_namespace = NULL; /* phase_hooks' module dict: _ACTIVE */
static PyObject *str_active = NULL;
static PyObject *dataloader_name = NULL, *forward_name = NULL, *backward_name = NULL;
static int fast_patches_on = 1;

static PyObject *patch_call(PyObject *fn, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    return PyObject_Vectorcall(fn, args, nargsf, kwnames);
}

/* A call to one of the timer's C methods (NULL: it raised what its Python twin lets
 * through, a BaseException): 0, or -1. */
static int done(PyObject *result) {
    if (result == NULL) return -1;
    Py_DECREF(result);
    return 0;
}

static PyObject *patch_dataloader(FastPatchObject *patch, CoreObject *core, PyObject *const *args,
                                 size_t nargsf, PyObject *kwnames) {
    if (!core->auto_dataloader) return patch_call(patch->original, args, nargsf, kwnames);
    long long t0 = now_ns();
    /* Only fetches that returned a batch count; the StopIteration that ends an epoch
     * is not a wait for a batch. */
    PyObject *batch = patch_call(patch->original, args, nargsf, kwnames);
    if (batch == NULL) return NULL;
    long long dt = now_ns() - t0;
    if (!other_thread(core) && done(add_host_checked(core, dataloader_name, dt)) < 0) {
        Py_DECREF(batch);
        return NULL;
    }
    return batch;
}

/* The optimizer phase where a bracketed backward ends: restarted if open (the
 * optimizer's pre-hook opened it before the closure ran), else opened when the
 * framework closes it itself (bracket_optimizer: Lightning's automatic optimization,
 * its hooks off). */
static PyObject *after_backward(CoreObject *core, PyObject *opt) {
    SlotObject *slot = (SlotObject *)opt;
    if (core->bracket_optimizer && slot->depth == 0 && slot->autotime) {
        return core_open(core, opt);
    }
    return core_restart(core, opt);
}

static PyObject *patch_backward(FastPatchObject *patch, CoreObject *core, PyObject *const *args,
                               size_t nargsf, PyObject *kwnames) {
    if (!core->in_step || !core->auto_backward || other_thread(core)) {
        return patch_call(patch->original, args, nargsf, kwnames);
    }
    PyObject *fwd = core->slots[0], *bwd = core->slots[1], *opt = core->slots[2];
    if (bwd == NULL || fwd == NULL || opt == NULL || !Py_IS_TYPE(bwd, &SlotType) ||
        !Py_IS_TYPE(fwd, &SlotType) || !Py_IS_TYPE(opt, &SlotType)) {
        return patch_call(patch->slow, args, nargsf, kwnames);
    }
    /* Already open (a backward inside a backward hook): counted by the outer call. */
    if (((SlotObject *)bwd)->depth) return patch_call(patch->original, args, nargsf, kwnames);
    Py_INCREF(fwd);
    Py_INCREF(bwd);
    Py_INCREF(opt);
    int bracket = core->bracket;
    PyObject *result = NULL;
    if (bracket && ((SlotObject *)fwd)->depth) {
        /* Inner forward hooks close their own levels; one that did not (a forward
         * that raised without always_call) must not keep the phase open. */
        ((SlotObject *)fwd)->depth = 1;
        PyObject *close_args[2] = {fwd, forward_name};
        if (done(core_close(core, close_args, 2)) < 0) goto out;
    }
    if (done(core_open(core, bwd)) < 0) goto out;
    result = patch_call(patch->original, args, nargsf, kwnames);
    /* As a `finally`: the phase ends whether backward returned or raised. */
    PyObject *type, *value, *tb;
    PyErr_Fetch(&type, &value, &tb);
    PyObject *close_args[2] = {bwd, backward_name};
    int failed = done(core_close(core, close_args, 2)) < 0 ||
                 (bracket && done(after_backward(core, opt)) < 0);
    if (failed) {
        /* What escaped the timer replaces backward's own outcome, as in Python. */
        Py_CLEAR(result);
        Py_XDECREF(type);
        Py_XDECREF(value);
        Py_XDECREF(tb);
    } else {
        PyErr_Restore(type, value, tb);
    }
out:
    Py_DECREF(fwd);
    Py_DECREF(bwd);
    Py_DECREF(opt);
    return result;
}

static PyObject *patch_vectorcall(PyObject *callable, PyObject *const *args, size_t nargsf,
                                 PyObject *kwnames) {
    FastPatchObject *patch = (FastPatchObject *)callable;
    if (!fast_patches_on || active_namespace == NULL || py_open == NULL) {
        return patch_call(patch->slow, args, nargsf, kwnames);
    }
    PyObject *timer = PyDict_GetItemWithError(active_namespace, str_active);
    if (timer == NULL) {
        return PyErr_Occurred() ? NULL : patch_call(patch->slow, args, nargsf, kwnames);
    }
    if (timer == Py_None) return patch_call(patch->original, args, nargsf, kwnames);
    if (!PyObject_TypeCheck(timer, &CoreType)) return patch_call(patch->slow, args, nargsf, kwnames);
    CoreObject *core = (CoreObject *)timer;
    PyObject *result;
    Py_INCREF(core); /* the call may make another timer the active one */
    switch (patch->kind) {
    case PATCH_DATALOADER:
        result = patch_dataloader(patch, core, args, nargsf, kwnames);
        break;
    case PATCH_BACKWARD:
        result = patch_backward(patch, core, args, nargsf, kwnames);
        break;
    default:
        result = patch_call(core->in_step ? patch->slow : patch->original, args, nargsf, kwnames);
    }
    Py_DECREF(core);
    return result;
}

static PyObject *patch_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    int kind;
    PyObject *original, *slow;
    static char *keywords[] = {"kind", "original", "slow", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iOO", keywords, &kind, &original, &slow)) {
        return NULL;
    }
    if (kind < PATCH_OUTSIDE_STEP || kind > PATCH_BACKWARD || !PyCallable_Check(original) ||
        !PyCallable_Check(slow)) {
        PyErr_SetString(PyExc_ValueError, "FastPatch(kind, original, slow): a known kind, callables");
        return NULL;
    }
    FastPatchObject *self = (FastPatchObject *)type->tp_alloc(type, 0);
    if (self == NULL) return NULL;
    Py_INCREF(original);
    self->original = original;
    Py_INCREF(slow);
    self->slow = slow;
    self->kind = kind;
    self->vectorcall = patch_vectorcall;
    return (PyObject *)self;
}

static int patch_traverse(FastPatchObject *self, visitproc visit, void *arg) {
    Py_VISIT(self->original);
    Py_VISIT(self->slow);
    Py_VISIT(self->dict);
    return 0;
}

static int patch_clear(FastPatchObject *self) {
    Py_CLEAR(self->original);
    Py_CLEAR(self->slow);
    Py_CLEAR(self->dict);
    return 0;
}

static void patch_dealloc(FastPatchObject *self) {
    PyObject_GC_UnTrack(self);
    patch_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* A method of the class it is put in, as the function it replaces was. */
static PyObject *patch_get(PyObject *self, PyObject *obj, PyObject *type) {
    if (obj == NULL || obj == Py_None) {
        Py_INCREF(self);
        return self;
    }
    return PyMethod_New(self, obj);
}

static PyMemberDef patch_members[] = {
    {"original", T_OBJECT_EX, offsetof(FastPatchObject, original), READONLY, "what it replaces"},
    {"slow", T_OBJECT_EX, offsetof(FastPatchObject, slow), READONLY, "the Python wrapper"},
    {"kind", T_INT, offsetof(FastPatchObject, kind), READONLY, "OUTSIDE_STEP, DATALOADER, BACKWARD"},
    {NULL},
};

static PyGetSetDef patch_getset[] = {
    {"__dict__", PyObject_GenericGetDict, PyObject_GenericSetDict, NULL, NULL},
    {NULL},
};

static PyTypeObject FastPatchType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "traceml_ai.rank._timing.hotpath.FastPatch",
    .tp_doc = "FastPatch(kind, original, slow): a patch's common case in C, the rest to slow.",
    .tp_basicsize = sizeof(FastPatchObject),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL |
                Py_TPFLAGS_METHOD_DESCRIPTOR,
    .tp_new = patch_new,
    .tp_dealloc = (destructor)patch_dealloc,
    .tp_traverse = (traverseproc)patch_traverse,
    .tp_clear = (inquiry)patch_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(FastPatchObject, vectorcall),
    .tp_descr_get = patch_get,
    .tp_dictoffset = offsetof(FastPatchObject, dict),
    .tp_members = patch_members,
    .tp_getset = patch_getset,
};

/* configure_fast_patches(active_namespace, dataloader, forward, backward): where the patches read
 * the active timer, and the phases they add to. */
static PyObject *configure_fast_patches(PyObject *module, PyObject *args) {
    PyObject *globals, *dataloader, *forward, *backward;
    if (!PyArg_ParseTuple(args, "O!UUU", &PyDict_Type, &globals, &dataloader, &forward,
                          &backward)) {
        return NULL;
    }
    Py_INCREF(globals);
    Py_XSETREF(active_namespace, globals);
    Py_INCREF(dataloader);
    Py_XSETREF(dataloader_name, dataloader);
    Py_INCREF(forward);
    Py_XSETREF(forward_name, forward);
    Py_INCREF(backward);
    Py_XSETREF(backward_name, backward);
    Py_RETURN_NONE;
}

/* set_fast_patches(on): False hands every fast patch's call to its Python wrapper. */
static PyObject *set_fast_patches(PyObject *module, PyObject *on) {
    int truth = PyObject_IsTrue(on);
    if (truth < 0) return NULL;
    fast_patches_on = truth;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure_fast_patches", (PyCFunction)configure_fast_patches, METH_VARARGS,
     "configure_fast_patches(active_namespace, dataloader, forward, backward): where the patches read"
     " the active timer, and the names of the phases they time."},
    {"set_fast_patches", (PyCFunction)set_fast_patches, METH_O,
     "set_fast_patches(on): False hands every fast patch's call to its Python wrapper (tests)."},
    {"configure", (PyCFunction)configure, METH_VARARGS,
     "configure(py_core_class, phase_class): the pure-Python methods every case but the"
     " common one is handed to, and the phase class whose counts are added to."},
    {NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "hotpath", "The step timer's per-call work in C (see hotpath.pyi, hotpath_py).", -1,
    module_methods,
};

PyMODINIT_FUNC PyInit_hotpath(void) {
    str_fail = PyUnicode_InternFromString("fail");
    str_get_device = PyUnicode_InternFromString("get_device");
    str_begin = PyUnicode_InternFromString("begin");
    str_end = PyUnicode_InternFromString("end");
    str_discard = PyUnicode_InternFromString("discard");
    if (str_begin == NULL || str_end == NULL || str_discard == NULL) return NULL;
    str_append = PyUnicode_InternFromString("append");
    str_active = PyUnicode_InternFromString("_ACTIVE");
    if (str_active == NULL) return NULL;
    if (str_fail == NULL || str_get_device == NULL || str_append == NULL) return NULL;
    if (PyType_Ready(&SlotType) < 0 || PyType_Ready(&CoreType) < 0 ||
        PyType_Ready(&ContextType) < 0 || PyType_Ready(&FastPatchType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&module_def);
    if (module == NULL) return NULL;
    Py_INCREF(&SlotType);
    if (PyModule_AddObject(module, "Slot", (PyObject *)&SlotType) < 0) {
        Py_DECREF(&SlotType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&CoreType);
    if (PyModule_AddObject(module, "TimerCore", (PyObject *)&CoreType) < 0) {
        Py_DECREF(&CoreType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&ContextType);
    if (PyModule_AddObject(module, "StepContext", (PyObject *)&ContextType) < 0) {
        Py_DECREF(&ContextType);
        Py_DECREF(module);
        return NULL;
    }
    Py_INCREF(&FastPatchType);
    if (PyModule_AddObject(module, "FastPatch", (PyObject *)&FastPatchType) < 0) {
        Py_DECREF(&FastPatchType);
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
