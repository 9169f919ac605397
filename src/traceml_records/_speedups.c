/*
 * traceml_records._speedups: the line encoder in C.
 *
 * The generated ENCODER_PLANS (codegen, from the schemas) say, per record class,
 * which attributes to write, in which order and as which JSON kind. This module
 * walks a record by that plan and writes its line directly, instead of building a
 * dict in Python for orjson to walk again.
 *
 * It produces exactly the bytes of the pure-Python path (_codec._py_dumps_line), and
 * handles only the case where every value has the exact type its schema names.
 * Anything else (a subclass, an int in a float field, an integer beyond 64 bits, a
 * lone surrogate, a non-finite float where null is not allowed, an unknown class)
 * is handed to that Python function, which writes it or raises the precise error.
 * Floats are formatted by orjson itself (one call per line, on a tuple of them), so
 * their text is orjson's shortest round-trip form by construction.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

enum { K_INT = 0, K_FLOAT = 1, K_BOOL = 2, K_STR = 3, K_OBJECT = 4, K_MAP = 5, K_ARRAY = 6 };
enum { F_ALWAYS = 0, F_HOSTNAME = 1, F_OMIT_NONE = 2 };

/* Result of an encode step: done, a Python error is set, or "let Python do it". */
enum { OK = 0, ERR = -1, FALLBACK = 1 };

typedef struct ClassPlan ClassPlan;
typedef struct Spec Spec;

struct Spec {
    int kind;
    int nullable;
    Spec *sub;       /* K_MAP value, K_ARRAY item */
    ClassPlan *cls;  /* K_OBJECT */
    /* What the loaders check (used by encode_items only). */
    int has_min, has_max;
    long long imin, imax;  /* K_INT bounds; K_MAP: imin = least key length */
    double fmin, fmax;     /* K_FLOAT bounds */
    Py_ssize_t min_count;  /* least length (str), entries (map), items (array) */
    PyObject *allowed;     /* NULL: any; a set: must be in it (K_MAP: the keys) */
    int opaque;            /* only Python can check this value */
};

typedef struct {
    PyObject *name;     /* attribute name, interned */
    Py_ssize_t offset;  /* slot offset in the instance, or -1: use getattr */
    char *key;          /* "name": */
    Py_ssize_t key_len;
    int flag;
    Spec spec;
    PyObject *seen_key; /* the str object last seen as this key in a wire dict (owned) */
} FieldPlan;

struct ClassPlan {
    PyTypeObject *type;
    Py_ssize_t n;
    FieldPlan *fields;
    /* offset of the _traceml_checked slot (the mark the generated loaders put on a
     * record they built), or -1. dumps_line writes a marked record here and leaves an
     * unmarked one to Python, which checks it as strictly as loads_line would. */
    Py_ssize_t checked_offset;
};

/* Plans live as long as the process: configure() is called once at import. */
static ClassPlan *plans = NULL;
static Py_ssize_t n_plans = 0;
static PyObject *fallback = NULL;     /* the pure-Python dumps_line */
static PyObject *orjson_dumps = NULL;
static PyObject *kw_include_hostname = NULL;

/* ---- output buffer -------------------------------------------------------- */

#define STACK_BYTES 2048
#define STACK_FLOATS 64

typedef struct {
    char *buf;
    Py_ssize_t len, cap;
    PyObject **floats; /* owned references */
    Py_ssize_t *float_at;
    Py_ssize_t n_floats, float_cap;
    char stack[STACK_BYTES];
    PyObject *stack_floats[STACK_FLOATS];
    Py_ssize_t stack_float_at[STACK_FLOATS];
} Out;

static void out_init(Out *o) {
    o->buf = o->stack;
    o->len = 0;
    o->cap = STACK_BYTES;
    o->floats = o->stack_floats;
    o->float_at = o->stack_float_at;
    o->n_floats = 0;
    o->float_cap = STACK_FLOATS;
}

static void out_free(Out *o) {
    for (Py_ssize_t i = 0; i < o->n_floats; i++) Py_DECREF(o->floats[i]);
    if (o->buf != o->stack) PyMem_Free(o->buf);
    if (o->floats != o->stack_floats) {
        PyMem_Free(o->floats);
        PyMem_Free(o->float_at);
    }
}

/* encode_items keeps its grown buffers between calls (under the GIL), so a batch
 * neither regrows its output nor faults in fresh pages. A call takes them (a call
 * nested through a finalizer would find none and allocate its own). */
#define KEEP_LIMIT (8 << 20)
static char *kept_buf = NULL;
static Py_ssize_t kept_cap = 0;
static PyObject **kept_floats = NULL;
static Py_ssize_t *kept_float_at = NULL;
static Py_ssize_t kept_float_cap = 0;

static void out_take_kept(Out *o) {
    if (kept_buf != NULL) {
        o->buf = kept_buf;
        o->cap = kept_cap;
        kept_buf = NULL;
    }
    if (kept_floats != NULL) {
        o->floats = kept_floats;
        o->float_at = kept_float_at;
        o->float_cap = kept_float_cap;
        kept_floats = NULL;
    }
}

static void out_keep(Out *o) {
    for (Py_ssize_t i = 0; i < o->n_floats; i++) Py_DECREF(o->floats[i]);
    o->n_floats = 0;
    if (o->buf != o->stack && kept_buf == NULL && o->cap <= KEEP_LIMIT) {
        kept_buf = o->buf;
        kept_cap = o->cap;
        o->buf = o->stack;
    }
    if (o->floats != o->stack_floats && kept_floats == NULL &&
        o->float_cap * (Py_ssize_t)sizeof(PyObject *) <= KEEP_LIMIT) {
        kept_floats = o->floats;
        kept_float_at = o->float_at;
        kept_float_cap = o->float_cap;
        o->floats = o->stack_floats;
        o->float_at = o->stack_float_at;
    }
    out_free(o);
}

static int out_reserve(Out *o, Py_ssize_t more) {
    if (o->len + more <= o->cap) return OK;
    Py_ssize_t cap = o->cap * 2;
    while (cap < o->len + more) cap *= 2;
    char *buf;
    if (o->buf == o->stack) {
        buf = PyMem_Malloc(cap);
        if (buf) memcpy(buf, o->stack, o->len);
    } else {
        buf = PyMem_Realloc(o->buf, cap);
    }
    if (!buf) {
        PyErr_NoMemory();
        return ERR;
    }
    o->buf = buf;
    o->cap = cap;
    return OK;
}

static inline int out_write(Out *o, const char *s, Py_ssize_t n) {
    if (out_reserve(o, n) < 0) return ERR;
    memcpy(o->buf + o->len, s, n);
    o->len += n;
    return OK;
}

static inline int out_char(Out *o, char c) {
    if (o->len >= o->cap && out_reserve(o, 1) < 0) return ERR;
    o->buf[o->len++] = c;
    return OK;
}

/* A float whose text orjson will give; its place in the line is remembered. */
static int out_float(Out *o, PyObject *value) {
    if (o->n_floats == o->float_cap) {
        Py_ssize_t cap = o->float_cap * 2;
        PyObject **f = PyMem_Malloc(cap * sizeof(PyObject *));
        Py_ssize_t *at = PyMem_Malloc(cap * sizeof(Py_ssize_t));
        if (!f || !at) {
            PyMem_Free(f);
            PyMem_Free(at);
            PyErr_NoMemory();
            return ERR;
        }
        memcpy(f, o->floats, o->n_floats * sizeof(PyObject *));
        memcpy(at, o->float_at, o->n_floats * sizeof(Py_ssize_t));
        if (o->floats != o->stack_floats) {
            PyMem_Free(o->floats);
            PyMem_Free(o->float_at);
        }
        o->floats = f;
        o->float_at = at;
        o->float_cap = cap;
    }
    Py_INCREF(value);
    o->floats[o->n_floats] = value;
    o->float_at[o->n_floats] = o->len;
    o->n_floats++;
    return OK;
}

/* ---- scalars -------------------------------------------------------------- */

static const char DIGIT_PAIRS[] =
    "00010203040506070809101112131415161718192021222324252627282930313233343536373839"
    "40414243444546474849505152535455565758596061626364656667686970717273747576777879"
    "8081828384858687888990919293949596979899";

static int write_int(Out *o, PyObject *value) {
    int overflow = 0;
    long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
    if (overflow) return FALLBACK; /* orjson takes up to 2**64-1; let it decide */
    if (v == -1 && PyErr_Occurred()) return ERR;
    char tmp[24];
    int i = 24;
    unsigned long long u = v < 0 ? 0ULL - (unsigned long long)v : (unsigned long long)v;
    while (u >= 100) {
        unsigned d = (unsigned)(u % 100) * 2;
        u /= 100;
        tmp[--i] = DIGIT_PAIRS[d + 1];
        tmp[--i] = DIGIT_PAIRS[d];
    }
    if (u >= 10) {
        tmp[--i] = DIGIT_PAIRS[u * 2 + 1];
        tmp[--i] = DIGIT_PAIRS[u * 2];
    } else {
        tmp[--i] = (char)('0' + u);
    }
    if (v < 0) tmp[--i] = '-';
    return out_write(o, tmp + i, 24 - i);
}

static const char HEX[] = "0123456789abcdef";

#define ONES 0x0101010101010101ULL
#define HIGHS 0x8080808080808080ULL

/* Whether any of 8 bytes is a control character, '"' or '\\' (exact: the
 * subtract-and-mask tests below have no false negatives nor false positives for
 * "is there such a byte"). */
static inline int needs_escape8(uint64_t w) {
    uint64_t control = (w - ONES * 0x20) & ~w & HIGHS;
    uint64_t q = w ^ (ONES * '"');
    uint64_t b = w ^ (ONES * '\\');
    return ((control | ((q - ONES) & ~q) | ((b - ONES) & ~b)) & HIGHS) != 0;
}

/* Same escapes as orjson: quote, backslash, and control characters. */
static int write_str(Out *o, PyObject *value) {
    Py_ssize_t n;
    const char *s = PyUnicode_AsUTF8AndSize(value, &n);
    if (s == NULL) {
        if (PyErr_ExceptionMatches(PyExc_UnicodeEncodeError)) {
            PyErr_Clear();
            return FALLBACK; /* lone surrogate: Python raises the precise error */
        }
        return ERR;
    }
    if (out_reserve(o, n + 2) < 0) return ERR;
    o->buf[o->len++] = '"';
    /* Most strings need no escape: find the first byte that does, 8 at a time. */
    Py_ssize_t i = 0;
    for (; i + 8 <= n; i += 8) {
        uint64_t w;
        memcpy(&w, s + i, 8);
        if (needs_escape8(w)) break;
    }
    Py_ssize_t start = 0;
    for (; i < n; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c >= 0x20 && c != '"' && c != '\\') continue;
        if (out_write(o, s + start, i - start) < 0) return ERR;
        start = i + 1;
        char esc[6] = {'\\', 0, 0, 0, 0, 0};
        int len = 2;
        switch (c) {
            case '"': esc[1] = '"'; break;
            case '\\': esc[1] = '\\'; break;
            case '\b': esc[1] = 'b'; break;
            case '\t': esc[1] = 't'; break;
            case '\n': esc[1] = 'n'; break;
            case '\f': esc[1] = 'f'; break;
            case '\r': esc[1] = 'r'; break;
            default:
                esc[1] = 'u';
                esc[2] = '0';
                esc[3] = '0';
                esc[4] = HEX[c >> 4];
                esc[5] = HEX[c & 15];
                len = 6;
        }
        if (out_write(o, esc, len) < 0) return ERR;
    }
    if (out_write(o, s + start, n - start) < 0) return ERR;
    return out_char(o, '"');
}

/* ---- structure ------------------------------------------------------------ */

static int write_value(Out *o, PyObject *value, const Spec *spec);

static int write_object(Out *o, PyObject *obj, const ClassPlan *plan, int include_hostname) {
    if (Py_TYPE(obj) != plan->type) return FALLBACK;
    int first = 1;
    for (Py_ssize_t i = 0; i < plan->n; i++) {
        const FieldPlan *f = &plan->fields[i];
        if (f->flag == F_HOSTNAME && !include_hostname) continue;
        PyObject *value;
        if (f->offset >= 0) {
            value = *(PyObject **)((char *)obj + f->offset);
            if (value == NULL) return FALLBACK; /* unset slot */
            Py_INCREF(value);
        } else {
            value = PyObject_GetAttr(obj, f->name);
            if (value == NULL) {
                PyErr_Clear();
                return FALLBACK;
            }
        }
        if (f->flag == F_OMIT_NONE && value == Py_None) {
            Py_DECREF(value);
            continue;
        }
        int rc = out_reserve(o, f->key_len + 1);
        if (rc == OK) {
            o->buf[o->len++] = first ? '{' : ',';
            memcpy(o->buf + o->len, f->key, f->key_len);
            o->len += f->key_len;
            rc = write_value(o, value, &f->spec);
        }
        Py_DECREF(value);
        if (rc != OK) return rc;
        first = 0;
    }
    return first ? out_write(o, "{}", 2) : out_char(o, '}');
}

static int write_entry(Out *o, PyObject *key, PyObject *value, const Spec *spec) {
    int rc = write_str(o, key);
    if (rc != OK) return rc;
    if (out_char(o, ':') < 0) return ERR;
    return write_value(o, value, spec);
}

/* Code point order, as Python's sorted() on str. */
static int str_cmp(PyObject *a, PyObject *b, int *lower) {
    if (PyUnicode_KIND(a) == PyUnicode_1BYTE_KIND && PyUnicode_KIND(b) == PyUnicode_1BYTE_KIND) {
        Py_ssize_t na = PyUnicode_GET_LENGTH(a), nb = PyUnicode_GET_LENGTH(b);
        int c = memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), na < nb ? na : nb);
        *lower = c < 0 || (c == 0 && na < nb);
        return OK;
    }
    int c = PyUnicode_Compare(a, b);
    if (c == -1 && PyErr_Occurred()) return ERR;
    *lower = c < 0;
    return OK;
}

#define SMALL_MAP 64

/* The entries of a small map (at most SMALL_MAP, all keys exact str) sorted by key,
 * without allocating: ranks send few, usually already sorted, keys. */
static int sorted_entries(PyObject *map, PyObject **keys, PyObject **values) {
    Py_ssize_t pos = 0, n = 0;
    PyObject *key, *value;
    while (PyDict_Next(map, &pos, &key, &value)) {
        if (!PyUnicode_CheckExact(key)) return FALLBACK;
        Py_ssize_t j = n++;
        while (j > 0) {
            int lower;
            if (str_cmp(key, keys[j - 1], &lower) < 0) return ERR;
            if (!lower) break;
            keys[j] = keys[j - 1];
            values[j] = values[j - 1];
            j--;
        }
        keys[j] = key;
        values[j] = value;
    }
    return OK;
}

/* A map with its keys sorted (code point order, as Python's sorted()). */
static int write_map(Out *o, PyObject *map, const Spec *value_spec) {
    if (!PyDict_CheckExact(map)) return FALLBACK;
    Py_ssize_t n = PyDict_GET_SIZE(map);
    if (n == 0) return out_write(o, "{}", 2);
    if (n > SMALL_MAP) return FALLBACK; /* a big map is rare: Python's */
    PyObject *keys[SMALL_MAP], *values[SMALL_MAP];
    int rc = sorted_entries(map, keys, values);
    if (rc == OK) rc = out_char(o, '{');
    for (Py_ssize_t i = 0; i < n && rc == OK; i++) {
        if (i) rc = out_char(o, ',');
        if (rc == OK) rc = write_entry(o, keys[i], values[i], value_spec);
    }
    return rc == OK ? out_char(o, '}') : rc;
}

static int write_array(Out *o, PyObject *seq, const Spec *item_spec) {
    if (!PyList_CheckExact(seq) && !PyTuple_CheckExact(seq)) return FALLBACK;
    /* A list may not change under us: no Python code runs while writing it. */
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    if (out_char(o, '[') < 0) return ERR;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (i && out_char(o, ',') < 0) return ERR;
        int rc = write_value(o, PySequence_Fast_GET_ITEM(seq, i), item_spec);
        if (rc != OK) return rc;
    }
    return out_char(o, ']');
}

static int write_value(Out *o, PyObject *value, const Spec *spec) {
    if (value == Py_None) {
        /* orjson writes None as null; Python's dumpers fail on None where a nested
         * object, map or array belongs, so that case is theirs. */
        return spec->kind <= K_STR ? out_write(o, "null", 4) : FALLBACK;
    }
    switch (spec->kind) {
        case K_INT:
            if (!PyLong_CheckExact(value)) return FALLBACK;
            return write_int(o, value);
        case K_FLOAT: {
            if (!PyFloat_CheckExact(value)) return FALLBACK;
            if (!isfinite(PyFloat_AS_DOUBLE(value))) {
                /* orjson writes null; valid only where the field may be null. */
                return spec->nullable ? out_write(o, "null", 4) : FALLBACK;
            }
            return out_float(o, value);
        }
        case K_BOOL:
            if (value == Py_True) return out_write(o, "true", 4);
            if (value == Py_False) return out_write(o, "false", 5);
            return FALLBACK;
        case K_STR:
            if (!PyUnicode_CheckExact(value)) return FALLBACK;
            return write_str(o, value);
        case K_OBJECT:
            return write_object(o, value, spec->cls, 0);
        case K_MAP:
            return write_map(o, value, spec->sub);
        case K_ARRAY:
            return write_array(o, value, spec->sub);
    }
    return FALLBACK;
}

/* The line(s): the buffer with orjson's float texts spliced in at their places.
 * text_before, when given (n_floats + 1 entries), gets the total length of the
 * texts of floats [0, i), to map offsets in the buffer to offsets in the result. */
static PyObject *finish(Out *o, Py_ssize_t *text_before) {
    if (text_before) text_before[0] = 0;
    if (o->n_floats == 0) return PyBytes_FromStringAndSize(o->buf, o->len);
    PyObject *tuple = PyTuple_New(o->n_floats);
    if (tuple == NULL) return NULL;
    for (Py_ssize_t i = 0; i < o->n_floats; i++) {
        Py_INCREF(o->floats[i]);
        PyTuple_SET_ITEM(tuple, i, o->floats[i]);
    }
    PyObject *texts = PyObject_Vectorcall(orjson_dumps, &tuple, 1, NULL);
    Py_DECREF(tuple);
    if (texts == NULL) return NULL;
    if (!PyBytes_Check(texts)) {
        Py_DECREF(texts);
        PyErr_SetString(PyExc_TypeError, "orjson.dumps did not return bytes");
        return NULL;
    }
    /* "[t0,t1,...]": finite floats only, so no text holds a comma. */
    const char *t = PyBytes_AS_STRING(texts) + 1;
    Py_ssize_t t_len = PyBytes_GET_SIZE(texts) - 2 - (o->n_floats - 1);
    PyObject *line = PyBytes_FromStringAndSize(NULL, o->len + t_len);
    if (line == NULL) {
        Py_DECREF(texts);
        return NULL;
    }
    char *dst = PyBytes_AS_STRING(line);
    Py_ssize_t from = 0;
    for (Py_ssize_t i = 0; i < o->n_floats; i++) {
        Py_ssize_t at = o->float_at[i];
        memcpy(dst, o->buf + from, at - from);
        dst += at - from;
        from = at;
        const char *end = t;
        while (*end != ',' && *end != ']') end++;
        memcpy(dst, t, end - t);
        dst += end - t;
        if (text_before) text_before[i + 1] = text_before[i] + (end - t);
        t = end + 1;
    }
    memcpy(dst, o->buf + from, o->len - from);
    Py_DECREF(texts);
    return line;
}

static ClassPlan *plan_of(PyTypeObject *type) {
    for (Py_ssize_t i = 0; i < n_plans; i++) {
        if (plans[i].type == type) return &plans[i];
    }
    return NULL;
}

/* dumps_line(record, /, *, include_hostname=False) -> bytes */
static PyObject *dumps_line(PyObject *module, PyObject *const *args, Py_ssize_t nargs,
                            PyObject *kwnames) {
    if (fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "traceml_records._speedups is not configured");
        return NULL;
    }
    int include_hostname = 0;
    Py_ssize_t n_kw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    if (nargs != 1 || n_kw > 1) goto python;
    if (n_kw == 1) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, 0);
        if (name != kw_include_hostname &&
            PyUnicode_Compare(name, kw_include_hostname) != 0) {
            goto python; /* Python raises the TypeError */
        }
        include_hostname = PyObject_IsTrue(args[1]);
        if (include_hostname < 0) return NULL;
    }
    ClassPlan *plan = plan_of(Py_TYPE(args[0]));
    if (plan == NULL) goto python;
    if (plan->checked_offset >= 0 &&
        *(PyObject **)((char *)args[0] + plan->checked_offset) != Py_True) {
        goto python; /* not built by a loader: Python checks it first */
    }
    Out o;
    out_init(&o);
    int rc = write_object(&o, args[0], plan, include_hostname);
    if (rc == OK) rc = out_char(&o, '\n');
    if (rc == ERR) {
        out_free(&o);
        return NULL;
    }
    if (rc == FALLBACK) {
        out_free(&o);
        goto python;
    }
    PyObject *line = finish(&o, NULL);
    out_free(&o);
    return line;
python:
    return PyObject_Vectorcall(fallback, args, nargs, kwnames);
}

/* ---- wire items: check as the loaders do, and write ---------------------- */
/*
 * encode_items writes the lines of a batch's items straight from the parsed dicts,
 * for the items that are plainly valid: every value of the exact type, within its
 * bounds, in its set. Any item it cannot vouch for is left to the Python builder,
 * which takes it through the strict loader (and skips it or builds its record). So
 * this never decides that an item is invalid; it only recognises the valid ones.
 */

typedef struct {
    Py_ssize_t max_string_bytes;
    /* step_time rules the schemas cannot express (the builder's _check_events) */
    int step_rules;
    PyObject *builtin_events; /* frozenset */
    PyObject *reserved_prefix;
    PyObject *required_event;
    Py_ssize_t max_entries;
    const Spec *events_spec;       /* the events map */
    const ClassPlan *phase_plan;   /* PhaseTiming */
    Py_ssize_t cpu, duration, gpu, is_gpu; /* its fields' indexes */
    Py_ssize_t entries;            /* phase timings of the item so far */
    /* Map keys that passed item_key in this call, by identity: a batch repeats the
     * same few names (orjson hands out the same str objects for them). Borrowed: the
     * items hold them for the whole call, and no Python code runs during it. */
    PyObject *ok_keys[16];
    const Spec *ok_specs[16];
    int n_ok;
} Rules;

/* Undo what an item (or object) wrote since a mark. */
static void out_truncate(Out *o, Py_ssize_t len, Py_ssize_t n_floats) {
    while (o->n_floats > n_floats) Py_DECREF(o->floats[--o->n_floats]);
    o->len = len;
}

static int str_eq(PyObject *a, PyObject *b) {
    if (a == b) return 1;
    Py_ssize_t n = PyUnicode_GET_LENGTH(a);
    return n == PyUnicode_GET_LENGTH(b) && PyUnicode_KIND(a) == PyUnicode_KIND(b) &&
           memcmp(PyUnicode_DATA(a), PyUnicode_DATA(b), n * PyUnicode_KIND(a)) == 0;
}

static int item_value(Out *o, PyObject *value, const Spec *spec, Rules *rules);

static int item_str(Out *o, PyObject *value, const Spec *spec, const Rules *rules) {
    if (!PyUnicode_CheckExact(value) || spec->opaque) return FALLBACK;
    if (PyUnicode_GET_LENGTH(value) < spec->min_count) return FALLBACK;
    if (spec->allowed) {
        int in = PySet_Contains(spec->allowed, value);
        if (in <= 0) return in < 0 ? ERR : FALLBACK;
    }
    Py_ssize_t before = o->len;
    int rc = write_str(o, value);
    /* Escapes only lengthen, so a short output is a short UTF-8 string. */
    if (rc == OK && o->len - before - 2 > rules->max_string_bytes) {
        Py_ssize_t n;
        if (PyUnicode_AsUTF8AndSize(value, &n) == NULL) return ERR;
        if (n > rules->max_string_bytes) return FALLBACK;
    }
    return rc;
}

static int phase_rule(PyObject **values, const Rules *r) {
    PyObject *used = values[r->is_gpu] == Py_True ? values[r->gpu] : values[r->cpu];
    if (used == Py_None) return FALLBACK;
    return PyFloat_AS_DOUBLE(values[r->duration]) == PyFloat_AS_DOUBLE(used) ? OK : FALLBACK;
}

#define MAX_OBJECT_FIELDS 32

/* A wire object whose keys are exactly the class's fields. Keys usually come in the
 * schema's order as the very str objects orjson handed out last time (it caches
 * them), so they are matched by position and identity first, by name otherwise. */
static int item_object(Out *o, PyObject *d, ClassPlan *plan, Rules *rules) {
    Py_ssize_t n = plan->n;
    if (!PyDict_CheckExact(d) || PyDict_GET_SIZE(d) != n || n > MAX_OBJECT_FIELDS) {
        return FALLBACK;
    }
    PyObject *values[MAX_OBJECT_FIELDS];
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    int in_order = 1;
    for (Py_ssize_t i = 0; i < n; i++) {
        FieldPlan *f = &plan->fields[i];
        if (f->flag != F_ALWAYS) return FALLBACK;
        PyDict_Next(d, &pos, &key, &value);
        if (key != f->seen_key) {
            if (!PyUnicode_CheckExact(key) || !str_eq(key, f->name)) {
                in_order = 0;
                break;
            }
            Py_INCREF(key);
            Py_XSETREF(f->seen_key, key);
        }
        values[i] = value;
    }
    if (!in_order) {
        for (Py_ssize_t i = 0; i < n; i++) {
            values[i] = PyDict_GetItemWithError(d, plan->fields[i].name);
            if (values[i] == NULL) return PyErr_Occurred() ? ERR : FALLBACK;
        }
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        const FieldPlan *f = &plan->fields[i];
        if (out_reserve(o, f->key_len + 1) < 0) return ERR;
        o->buf[o->len++] = i ? ',' : '{';
        memcpy(o->buf + o->len, f->key, f->key_len);
        o->len += f->key_len;
        int rc = item_value(o, values[i], &f->spec, rules);
        if (rc != OK) return rc;
    }
    if (rules->step_rules && plan == rules->phase_plan && phase_rule(values, rules) != OK) {
        return FALLBACK;
    }
    return n ? out_char(o, '}') : out_write(o, "{}", 2);
}

static int item_key_checked(PyObject *key, const Spec *spec, Rules *rules);

static int item_key(PyObject *key, const Spec *spec, Rules *rules) {
    for (int i = 0; i < rules->n_ok; i++) {
        if (rules->ok_keys[i] == key && rules->ok_specs[i] == spec) return OK;
    }
    int rc = item_key_checked(key, spec, rules);
    if (rc == OK && rules->n_ok < 16) {
        rules->ok_keys[rules->n_ok] = key;
        rules->ok_specs[rules->n_ok++] = spec;
    }
    return rc;
}

static int item_key_checked(PyObject *key, const Spec *spec, Rules *rules) {
    if (!PyUnicode_CheckExact(key)) return FALLBACK;
    if (spec->has_min && PyUnicode_GET_LENGTH(key) < spec->imin) return FALLBACK;
    if (spec->allowed) {
        int in = PySet_Contains(spec->allowed, key);
        if (in <= 0) return in < 0 ? ERR : FALLBACK;
    }
    if (rules->step_rules && spec == rules->events_spec) {
        /* A _traceml_internal: name must be one of the built-in events. */
        int builtin = PySet_Contains(rules->builtin_events, key);
        if (builtin < 0) return ERR;
        if (!builtin) {
            Py_ssize_t reserved =
                PyUnicode_Tailmatch(key, rules->reserved_prefix, 0, PY_SSIZE_T_MAX, -1);
            if (reserved != 0) return reserved < 0 ? ERR : FALLBACK;
        }
    }
    return OK;
}

static int item_entry(Out *o, PyObject *key, PyObject *value, const Spec *spec, Rules *rules,
                      int first) {
    static const Spec any_str = {.kind = K_STR};
    if (!first && out_char(o, ',') < 0) return ERR;
    int rc = item_str(o, key, &any_str, rules);
    if (rc != OK) return rc;
    if (out_char(o, ':') < 0) return ERR;
    if (rules->step_rules && spec == rules->events_spec) {
        if (!PyDict_CheckExact(value)) return FALLBACK;
        rules->entries += PyDict_GET_SIZE(value);
    }
    return item_value(o, value, spec->sub, rules);
}

/* A map, written with sorted keys. */
static int item_map(Out *o, PyObject *map, const Spec *spec, Rules *rules) {
    if (!PyDict_CheckExact(map)) return FALLBACK;
    Py_ssize_t n = PyDict_GET_SIZE(map);
    if (n < spec->min_count) return FALLBACK;
    int events = rules->step_rules && spec == rules->events_spec;
    if (events) {
        if (n > rules->max_entries) return FALLBACK;
        int has = PyDict_Contains(map, rules->required_event);
        if (has <= 0) return has < 0 ? ERR : FALLBACK;
    }
    if (n == 0) return out_write(o, "{}", 2);
    if (n > SMALL_MAP) return FALLBACK; /* a big map is rare: Python's */
    PyObject *keys[SMALL_MAP], *values[SMALL_MAP];
    int rc = sorted_entries(map, keys, values);
    if (rc == OK) rc = out_char(o, '{');
    for (Py_ssize_t i = 0; i < n && rc == OK; i++) {
        rc = item_key(keys[i], spec, rules);
        if (rc == OK) rc = item_entry(o, keys[i], values[i], spec, rules, i == 0);
    }
    if (rc == OK && events && rules->entries > rules->max_entries) return FALLBACK;
    return rc == OK ? out_char(o, '}') : rc;
}

static int item_value(Out *o, PyObject *value, const Spec *spec, Rules *rules) {
    if (value == Py_None) {
        return spec->nullable && spec->kind <= K_STR ? out_write(o, "null", 4) : FALLBACK;
    }
    switch (spec->kind) {
        case K_INT: {
            if (!PyLong_CheckExact(value)) return FALLBACK;
            int overflow = 0;
            long long v = PyLong_AsLongLongAndOverflow(value, &overflow);
            if (overflow) return FALLBACK;
            if (v == -1 && PyErr_Occurred()) return ERR;
            if ((spec->has_min && v < spec->imin) || (spec->has_max && v > spec->imax)) {
                return FALLBACK;
            }
            return write_int(o, value);
        }
        case K_FLOAT: {
            /* An int here is coerced by the loader (and written as a float): Python's. */
            if (!PyFloat_CheckExact(value)) return FALLBACK;
            double v = PyFloat_AS_DOUBLE(value);
            if (!isfinite(v) || (spec->has_min && !(v >= spec->fmin)) ||
                (spec->has_max && !(v <= spec->fmax))) {
                return FALLBACK;
            }
            return out_float(o, value);
        }
        case K_BOOL:
            if (value != Py_True && value != Py_False) return FALLBACK;
            if (spec->allowed) {
                int in = PySet_Contains(spec->allowed, value);
                if (in <= 0) return in < 0 ? ERR : FALLBACK;
            }
            return value == Py_True ? out_write(o, "true", 4) : out_write(o, "false", 5);
        case K_STR:
            return item_str(o, value, spec, rules);
        case K_OBJECT:
            return item_object(o, value, spec->cls, rules);
        case K_MAP:
            return item_map(o, value, spec, rules);
        case K_ARRAY: {
            if (!PyList_CheckExact(value) || spec->opaque) return FALLBACK;
            Py_ssize_t n = PyList_GET_SIZE(value);
            if (n < spec->min_count) return FALLBACK;
            if (out_char(o, '[') < 0) return ERR;
            for (Py_ssize_t i = 0; i < n; i++) {
                if (i && out_char(o, ',') < 0) return ERR;
                int rc = item_value(o, PyList_GET_ITEM(value, i), spec->sub, rules);
                if (rc != OK) return rc;
            }
            return out_char(o, ']');
        }
    }
    return FALLBACK;
}

static Py_ssize_t field_index(const ClassPlan *plan, const char *name) {
    for (Py_ssize_t i = 0; i < plan->n; i++) {
        if (PyUnicode_CompareWithASCIIString(plan->fields[i].name, name) == 0) return i;
    }
    PyErr_Format(PyExc_ValueError, "encode_items: no field %s in the phase class", name);
    return -1;
}

/* The lines of one item, appended; FALLBACK leaves the output as it was. */
static int item_line(Out *o, PyObject *item, ClassPlan *plan, Py_ssize_t first,
                     PyObject *prefix, Rules *rules) {
    Py_ssize_t n = plan->n - first;
    if (!PyDict_CheckExact(item) || PyDict_GET_SIZE(item) != n) return FALLBACK;
    Py_ssize_t mark = o->len, mark_floats = o->n_floats;
    rules->entries = 0;
    int rc = out_write(o, PyBytes_AS_STRING(prefix), PyBytes_GET_SIZE(prefix));
    Py_ssize_t pos = 0;
    PyObject *key, *value;
    for (Py_ssize_t i = first; i < plan->n && rc == OK; i++) {
        FieldPlan *f = &plan->fields[i];
        /* by position and identity first, as in item_object */
        PyDict_Next(item, &pos, &key, &value);
        if (key != f->seen_key) {
            if (PyUnicode_CheckExact(key) && str_eq(key, f->name)) {
                Py_INCREF(key);
                Py_XSETREF(f->seen_key, key);
            } else {
                value = PyDict_GetItemWithError(item, f->name);
                if (value == NULL) {
                    rc = PyErr_Occurred() ? ERR : FALLBACK;
                    break;
                }
            }
        }
        rc = out_reserve(o, f->key_len + 1);
        if (rc != OK) break;
        o->buf[o->len++] = ',';
        memcpy(o->buf + o->len, f->key, f->key_len);
        o->len += f->key_len;
        rc = item_value(o, value, &f->spec, rules);
    }
    if (rc == OK) rc = out_write(o, "}\n", 2);
    if (rc == FALLBACK) out_truncate(o, mark, mark_floats);
    return rc;
}

/* encode_items(items, record_class, first_field, prefix, max_string_bytes, step_rules)
 *   -> (data, count, pending)
 * data: the lines (prefix + the item's fields, the record's fields from first_field
 * on) of the items it could vouch for, in order; count: how many; pending: the
 * (item index, offset in data) of each item left to Python, where its line belongs.
 * step_rules: None, or (builtin_events, reserved_prefix, required_event, max_entries,
 * phase_class). */
static PyObject *encode_items(PyObject *module, PyObject *args) {
    PyObject *items, *cls, *prefix, *step_rules, *phase_class = NULL;
    Py_ssize_t first;
    Rules rules = {0};
    if (!PyArg_ParseTuple(args, "O!OnO!nO", &PyList_Type, &items, &cls, &first, &PyBytes_Type,
                          &prefix, &rules.max_string_bytes, &step_rules)) {
        return NULL;
    }
    ClassPlan *plan = PyType_Check(cls) ? plan_of((PyTypeObject *)cls) : NULL;
    if (plan == NULL || first < 0 || first > plan->n) {
        PyErr_SetString(PyExc_ValueError, "encode_items: no plan for that class and field");
        return NULL;
    }
    if (step_rules != Py_None) {
        if (!PyArg_ParseTuple(step_rules, "O!UUnO", &PyFrozenSet_Type, &rules.builtin_events,
                              &rules.reserved_prefix, &rules.required_event,
                              &rules.max_entries, &phase_class)) {
            return NULL;
        }
        rules.step_rules = 1;
        rules.phase_plan = PyType_Check(phase_class) ? plan_of((PyTypeObject *)phase_class) : NULL;
        for (Py_ssize_t i = first; i < plan->n; i++) {
            if (plan->fields[i].spec.kind == K_MAP) rules.events_spec = &plan->fields[i].spec;
        }
        if (rules.phase_plan == NULL || rules.events_spec == NULL) {
            PyErr_SetString(PyExc_ValueError, "encode_items: step rules need events and phases");
            return NULL;
        }
        if ((rules.cpu = field_index(rules.phase_plan, "cpu_ms")) < 0 ||
            (rules.duration = field_index(rules.phase_plan, "duration_ms")) < 0 ||
            (rules.gpu = field_index(rules.phase_plan, "gpu_ms")) < 0 ||
            (rules.is_gpu = field_index(rules.phase_plan, "is_gpu")) < 0) {
            return NULL;
        }
    }
    PyObject *pending = PyList_New(0);
    if (pending == NULL) return NULL;
    Out o;
    out_init(&o);
    out_take_kept(&o);
    Py_ssize_t n = PyList_GET_SIZE(items), count = 0;
    for (Py_ssize_t k = 0; k < n; k++) {
        /* the byte offset is final only after the floats are in: keep the float
         * index too, and turn it into a byte offset below */
        Py_ssize_t at = o.len, floats_before = o.n_floats;
        int rc = item_line(&o, PyList_GET_ITEM(items, k), plan, first, prefix, &rules);
        if (rc == ERR) goto error;
        if (rc == OK) {
            count++;
            continue;
        }
        PyObject *entry = Py_BuildValue("(nnn)", k, at, floats_before);
        if (entry == NULL || PyList_Append(pending, entry) < 0) {
            Py_XDECREF(entry);
            goto error;
        }
        Py_DECREF(entry);
    }
    Py_ssize_t n_pending = PyList_GET_SIZE(pending);
    Py_ssize_t *text_before = NULL;
    if (n_pending) {
        text_before = PyMem_Malloc((o.n_floats + 1) * sizeof(Py_ssize_t));
        if (text_before == NULL) {
            PyErr_NoMemory();
            goto error;
        }
    }
    PyObject *data = finish(&o, text_before);
    if (data == NULL) {
        PyMem_Free(text_before);
        goto error;
    }
    /* A pending item's place in data: its place in the buffer, moved on by the texts
     * of the floats written before it. */
    for (Py_ssize_t i = 0; i < n_pending; i++) {
        PyObject *entry = PyList_GET_ITEM(pending, i);
        Py_ssize_t k = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 0));
        Py_ssize_t at = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 1));
        Py_ssize_t before = PyLong_AsSsize_t(PyTuple_GET_ITEM(entry, 2));
        PyObject *fixed = Py_BuildValue("(nn)", k, at + text_before[before]);
        if (fixed == NULL) {
            PyMem_Free(text_before);
            Py_DECREF(data);
            goto error;
        }
        PyList_SET_ITEM(pending, i, fixed);
        Py_DECREF(entry);
    }
    PyMem_Free(text_before);
    out_keep(&o);
    return Py_BuildValue("(NnN)", data, count, pending);
error:
    out_keep(&o);
    Py_DECREF(pending);
    return NULL;
}

/* ---- configure ------------------------------------------------------------ */

static int build_spec(PyObject *desc, Spec *spec, PyObject *classes);

static Py_ssize_t slot_offset(PyTypeObject *type, PyObject *name) {
    PyObject *descr = PyObject_GetAttr((PyObject *)type, name);
    if (descr == NULL) {
        PyErr_Clear();
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *def = ((PyMemberDescrObject *)descr)->d_member;
        if (def->type == T_OBJECT_EX && PyType_IsSubtype(type, PyDescr_TYPE(descr))) {
            offset = def->offset;
        }
    }
    Py_DECREF(descr);
    return offset;
}

static ClassPlan *plan_index(PyObject *classes, PyObject *cls) {
    PyObject *index = PyDict_GetItemWithError(classes, cls);
    if (index == NULL) {
        if (!PyErr_Occurred()) PyErr_SetString(PyExc_ValueError, "object class without a plan");
        return NULL;
    }
    return &plans[PyLong_AsSsize_t(index)];
}

static int bound(PyObject *value, int *has, long long *i, double *f) {
    *has = value != Py_None;
    if (!*has) return OK;
    *f = PyFloat_AsDouble(value);
    if (*f == -1.0 && PyErr_Occurred()) return ERR;
    if (PyLong_Check(value)) {
        *i = PyLong_AsLongLong(value);
        if (*i == -1 && PyErr_Occurred()) return ERR;
    } else {
        *i = 0;
    }
    return OK;
}

/* desc: (kind, nullable, sub, minimum, maximum, min_count, allowed); sub = class |
 * spec tuple | None; allowed = None | set | False. */
static int build_spec(PyObject *desc, Spec *spec, PyObject *classes) {
    PyObject *sub, *low, *high, *allowed;
    if (!PyArg_ParseTuple(desc, "ipOOOnO", &spec->kind, &spec->nullable, &sub, &low, &high,
                          &spec->min_count, &allowed)) {
        return ERR;
    }
    spec->sub = NULL;
    spec->cls = NULL;
    spec->allowed = NULL;
    spec->opaque = allowed == Py_False;
    if (PyAnySet_Check(allowed)) {
        Py_INCREF(allowed);
        spec->allowed = allowed;
    } else if (allowed != Py_None && allowed != Py_False) {
        PyErr_SetString(PyExc_TypeError, "allowed must be None, a set or False");
        return ERR;
    }
    if (bound(low, &spec->has_min, &spec->imin, &spec->fmin) < 0) return ERR;
    if (bound(high, &spec->has_max, &spec->imax, &spec->fmax) < 0) return ERR;
    if (spec->kind == K_OBJECT) {
        spec->cls = plan_index(classes, sub);
        return spec->cls ? OK : ERR;
    }
    if (spec->kind == K_MAP || spec->kind == K_ARRAY) {
        spec->sub = PyMem_Calloc(1, sizeof(Spec));
        if (spec->sub == NULL) {
            PyErr_NoMemory();
            return ERR;
        }
        return build_spec(sub, spec->sub, classes);
    }
    if (spec->kind < K_INT || spec->kind > K_ARRAY) {
        PyErr_Format(PyExc_ValueError, "unknown kind %d", spec->kind);
        return ERR;
    }
    return OK;
}

static int build_class(ClassPlan *plan, PyObject *cls, PyObject *fields, PyObject *classes) {
    if (!PyType_Check(cls) || !PyTuple_Check(fields)) {
        PyErr_SetString(PyExc_TypeError, "plans map a class to a tuple of fields");
        return ERR;
    }
    Py_INCREF(cls);
    plan->type = (PyTypeObject *)cls;
    PyObject *checked = PyUnicode_InternFromString("_traceml_checked");
    if (checked == NULL) return ERR;
    plan->checked_offset = slot_offset(plan->type, checked);
    Py_DECREF(checked);
    plan->n = PyTuple_GET_SIZE(fields);
    plan->fields = PyMem_Calloc(plan->n ? plan->n : 1, sizeof(FieldPlan));
    if (plan->fields == NULL) {
        PyErr_NoMemory();
        return ERR;
    }
    for (Py_ssize_t i = 0; i < plan->n; i++) {
        FieldPlan *f = &plan->fields[i];
        PyObject *name, *desc;
        if (!PyArg_ParseTuple(PyTuple_GET_ITEM(fields, i), "UOi", &name, &desc, &f->flag)) {
            return ERR;
        }
        Py_INCREF(name);
        PyUnicode_InternInPlace(&name);
        f->name = name;
        f->offset = slot_offset(plan->type, name);
        Py_ssize_t n;
        const char *s = PyUnicode_AsUTF8AndSize(name, &n);
        if (s == NULL) return ERR;
        f->key_len = n + 3;
        f->key = PyMem_Malloc(f->key_len);
        if (f->key == NULL) {
            PyErr_NoMemory();
            return ERR;
        }
        f->key[0] = '"';
        memcpy(f->key + 1, s, n);
        f->key[n + 1] = '"';
        f->key[n + 2] = ':';
        if (build_spec(desc, &f->spec, classes) < 0) return ERR;
    }
    return OK;
}

/* configure(plans: dict[type, tuple[field, ...]], fallback, orjson_dumps) */
static PyObject *configure(PyObject *module, PyObject *args) {
    PyObject *plan_map, *py_fallback, *dumps;
    if (!PyArg_ParseTuple(args, "O!OO", &PyDict_Type, &plan_map, &py_fallback, &dumps)) {
        return NULL;
    }
    if (plans != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "already configured");
        return NULL;
    }
    Py_ssize_t n = PyDict_GET_SIZE(plan_map);
    ClassPlan *built = PyMem_Calloc(n ? n : 1, sizeof(ClassPlan));
    PyObject *classes = PyDict_New();
    if (built == NULL || classes == NULL) {
        PyMem_Free(built);
        Py_XDECREF(classes);
        return PyErr_NoMemory();
    }
    Py_ssize_t pos = 0, i = 0;
    PyObject *cls, *fields;
    while (PyDict_Next(plan_map, &pos, &cls, &fields)) {
        PyObject *index = PyLong_FromSsize_t(i++);
        if (index == NULL || PyDict_SetItem(classes, cls, index) < 0) {
            Py_XDECREF(index);
            Py_DECREF(classes);
            return NULL; /* a failed configure leaks its partial plan; it runs once */
        }
        Py_DECREF(index);
    }
    plans = built;
    n_plans = n;
    pos = 0;
    i = 0;
    while (PyDict_Next(plan_map, &pos, &cls, &fields)) {
        if (build_class(&plans[i++], cls, fields, classes) < 0) {
            plans = NULL;
            n_plans = 0;
            Py_DECREF(classes);
            return NULL;
        }
    }
    Py_DECREF(classes);
    Py_INCREF(py_fallback);
    Py_INCREF(dumps);
    fallback = py_fallback;
    orjson_dumps = dumps;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"configure", (PyCFunction)configure, METH_VARARGS,
     "configure(plans, fallback, orjson_dumps): set the encoding plans, once."},
    {"dumps_line", (PyCFunction)(void (*)(void))dumps_line, METH_FASTCALL | METH_KEYWORDS,
     "dumps_line(record, /, *, include_hostname=False) -> bytes"},
    {"encode_items", (PyCFunction)encode_items, METH_VARARGS,
     "encode_items(items, record_class, first_field, prefix, max_string_bytes, step_rules)"
     " -> (data, count, pending): the lines of the plainly valid wire items; pending holds"
     " (index, offset in data) of each item left to Python."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "_speedups", "The line encoder in C (see _codec).", -1, methods,
};

PyMODINIT_FUNC PyInit__speedups(void) {
    kw_include_hostname = PyUnicode_InternFromString("include_hostname");
    if (kw_include_hostname == NULL) return NULL;
    return PyModule_Create(&module_def);
}
