/* traceml_ai.monitor._feedscan: a step_time batch body read straight into what the
 * live state takes, without a Python object per value.
 *
 * The live feed used to decode every batch with orjson (a dict per item, per event,
 * per device, per timing) and then walk those dicts in Python (analysis.step_row).
 * scan_step_time reads the encoded body once and returns, per step, only what the
 * state keeps: the step, its end, its time, its phases (already labelled and summed
 * by label, the step_row rule) and its tokens, plus the same values packed for the
 * state's histogram buffers.
 *
 * It takes only the plain case and answers None for anything else, which the caller
 * then reads the Python way (decode_batch_body + LiveState.add_steps: the reference):
 * a string with an escape or a byte outside ASCII, a duplicated key the state reads,
 * an integer the scan does not hold exactly, an event name the caller's label map
 * does not have yet (the Python way names it and folds it, in order), anything not
 * valid JSON. So an answer other than None is what the Python way gives.
 * _feedscan_py.py is its pure-Python twin, which defines the behaviour.
 */
#define PY_SSIZE_T_CLEAN
#ifndef _GNU_SOURCE
#define _GNU_SOURCE /* strtod_l */
#endif
#include <Python.h>

#include <float.h>
#include <math.h>
#include <stdint.h>
#include <string.h>
#ifdef __GLIBC__
#include <locale.h>
#include <stdlib.h>
static locale_t c_locale = (locale_t)0; /* "C": a '.' whatever the process's locale */
#endif

#define DECLINE 1  /* not the plain case: the caller takes the Python way */
#define ERROR (-1) /* a Python exception is set */
#define MAX_DEPTH 64
#define MAX_NAMES 64   /* events of one step, devices of one event */
#define MAX_LABELS 64  /* label ids fit one 64-bit mask */
#define NAME_CACHE 32
#define MAX_EXACT 9007199254740992 /* 2**53: a duration held exactly as a double */

static PyObject *step_event = NULL; /* the whole-step event's name (configure) */

typedef struct {
    const char *p;
    const char *end;
    int depth;
} Cur;

typedef struct {
    int is_int;
    int plain; /* digits and at most a fraction: no sign, no exponent */
    int64_t i;
    double d;
} Num;

static inline void ws(Cur *c) {
    while (c->p < c->end && (*c->p == ' ' || *c->p == '\n' || *c->p == '\r' || *c->p == '\t'))
        c->p++;
}

/* A string of printable ASCII without escapes; *s, *n its contents. */
static int scan_string(Cur *c, const char **s, Py_ssize_t *n) {
    if (c->p >= c->end || *c->p != '"') return DECLINE;
    const char *start = ++c->p;
    while (c->p < c->end) {
        unsigned char ch = (unsigned char)*c->p;
        if (ch == '"') {
            *s = start;
            *n = c->p - start;
            c->p++;
            return 0;
        }
        if (ch == '\\' || ch < 0x20 || ch >= 0x80) return DECLINE;
        c->p++;
    }
    return DECLINE;
}

static const double POW10[23] = {1e0,  1e1,  1e2,  1e3,  1e4,  1e5,  1e6,  1e7,
                                  1e8,  1e9,  1e10, 1e11, 1e12, 1e13, 1e14, 1e15,
                                  1e16, 1e17, 1e18, 1e19, 1e20, 1e21, 1e22};

/* A JSON number, checked by its grammar; an integer within int64 (is_int), or, when
 * ``value`` asks for it or it has a sign or an exponent, its double as Python reads it
 * (correctly rounded); anything else declines. */
static int scan_number_as(Cur *c, Num *num, int value) {
    const char *start = c->p, *end = c->end, *p = c->p;
    int negative = 0, is_int = 1, has_exp = 0, dropped = 0, sig = 0, frac_digits = 0;
    uint64_t w = 0; /* the significant digits, while at most 19 */
    if (p < end && *p == '-') {
        negative = 1;
        p++;
    }
    if (p >= end) return DECLINE;
    if (*p == '0') {
        p++;
    } else if (*p >= '1' && *p <= '9') {
        for (; p < end && *p >= '0' && *p <= '9'; p++) {
            if (sig < 19) {
                w = w * 10 + (uint64_t)(*p - '0');
                sig++;
            } else {
                dropped = 1;
            }
        }
    } else {
        return DECLINE;
    }
    if (p < end && *p == '.') {
        is_int = 0;
        p++;
        const char *frac = p;
        for (; p < end && *p >= '0' && *p <= '9'; p++) {
            if (sig < 19) {
                if (w != 0 || *p != '0') {
                    w = w * 10 + (uint64_t)(*p - '0');
                    sig++;
                }
                frac_digits++;
            } else {
                dropped = 1;
            }
        }
        if (p == frac) return DECLINE;
    }
    int exp10 = 0;
    if (p < end && (*p == 'e' || *p == 'E')) {
        is_int = 0;
        has_exp = 1;
        p++;
        int exp_negative = 0;
        if (p < end && (*p == '+' || *p == '-')) exp_negative = *p++ == '-';
        const char *exp = p;
        for (; p < end && *p >= '0' && *p <= '9'; p++)
            if (exp10 < 100000) exp10 = exp10 * 10 + (*p - '0');
        if (p == exp) return DECLINE;
        if (exp_negative) exp10 = -exp10;
    }
    c->p = p;
    num->is_int = is_int;
    num->plain = !negative && !has_exp;
    if (is_int) {
        if (dropped || w > (uint64_t)INT64_MAX) return DECLINE;
        num->i = negative ? -(int64_t)w : (int64_t)w;
        return 0;
    }
    /* A plain decimal is finite and not negative: nothing more to know of a value
     * only checked (a timing's cpu_ms, gpu_ms). */
    if (!value && num->plain && p - start < 64) return 0;
    int e = exp10 - frac_digits;
    if (!dropped && w <= ((uint64_t)1 << 53) && e >= -22 && e <= 22) {
        /* Clinger's fast path: both operands exact, so one rounding, the correct one. */
        double d = (double)w;
        d = e >= 0 ? d * POW10[e] : d / POW10[-e];
        num->d = negative ? -d : d;
        return 0;
    }
    /* The token is copied: the number's text must end where the grammar ended it. */
    char buf[64];
    Py_ssize_t len = p - start;
    if (len >= (Py_ssize_t)sizeof(buf)) return DECLINE;
    memcpy(buf, start, (size_t)len);
    buf[len] = '\0';
    char *stop = NULL;
    double d;
#ifdef __GLIBC__
    /* glibc's strtod is correctly rounded, as Python's is, and several times faster. */
    if (c_locale != (locale_t)0) {
        d = strtod_l(buf, &stop, c_locale);
    } else
#endif
    {
        d = PyOS_string_to_double(buf, &stop, NULL);
        if (d == -1.0 && PyErr_Occurred()) return ERROR;
    }
    if (stop != buf + len || !isfinite(d)) return DECLINE;
    num->d = d;
    return 0;
}

static int scan_number(Cur *c, Num *num) { return scan_number_as(c, num, 1); }

static int skip_value(Cur *c);

static int skip_container(Cur *c, char close, int object) {
    if (++c->depth > MAX_DEPTH) return DECLINE;
    c->p++;
    ws(c);
    if (c->p < c->end && *c->p == close) {
        c->p++;
        c->depth--;
        return 0;
    }
    for (;;) {
        int r;
        if (object) {
            const char *s;
            Py_ssize_t n;
            if ((r = scan_string(c, &s, &n)) != 0) return r;
            ws(c);
            if (c->p >= c->end || *c->p != ':') return DECLINE;
            c->p++;
            ws(c);
        }
        if ((r = skip_value(c)) != 0) return r;
        ws(c);
        if (c->p >= c->end) return DECLINE;
        if (*c->p == ',') {
            c->p++;
            ws(c);
            continue;
        }
        if (*c->p == close) {
            c->p++;
            c->depth--;
            return 0;
        }
        return DECLINE;
    }
}

static int literal(Cur *c, const char *word, Py_ssize_t n) {
    if (c->end - c->p < n || memcmp(c->p, word, (size_t)n) != 0) return DECLINE;
    c->p += n;
    return 0;
}

/* Any JSON value, checked as orjson would take it, read into nothing. */
static int skip_value(Cur *c) {
    if (c->p >= c->end) return DECLINE;
    switch (*c->p) {
        case '{':
            return skip_container(c, '}', 1);
        case '[':
            return skip_container(c, ']', 0);
        case '"': {
            const char *s;
            Py_ssize_t n;
            return scan_string(c, &s, &n);
        }
        case 't':
            return literal(c, "true", 4);
        case 'f':
            return literal(c, "false", 5);
        case 'n':
            return literal(c, "null", 4);
        default: {
            Num num;
            return scan_number_as(c, &num, 0);
        }
    }
}

/* The separator after a member: 0 with *more set (',' read) or not ('}' or ']' read). */
static int next_member(Cur *c, char close, int *more) {
    ws(c);
    if (c->p >= c->end) return DECLINE;
    if (*c->p == ',') {
        c->p++;
        ws(c);
        *more = 1;
        return 0;
    }
    if (*c->p == close) {
        c->p++;
        *more = 0;
        return 0;
    }
    return DECLINE;
}

/* A key and its colon; the cursor left on the value. */
static int member_key(Cur *c, const char **s, Py_ssize_t *n) {
    int r = scan_string(c, s, n);
    if (r) return r;
    ws(c);
    if (c->p >= c->end || *c->p != ':') return DECLINE;
    c->p++;
    ws(c);
    return 0;
}

/* Enter an object or array: 0 with *empty set, the cursor on its first member. */
static int open_container(Cur *c, char open, char close, int *empty) {
    if (c->p >= c->end || *c->p != open) return DECLINE;
    if (++c->depth > MAX_DEPTH) return DECLINE;
    c->p++;
    ws(c);
    *empty = c->p < c->end && *c->p == close;
    if (*empty) c->p++;
    return 0;
}

#define KEY_IS(s, n, lit) ((n) == (Py_ssize_t)(sizeof(lit) - 1) && memcmp((s), (lit), (n)) == 0)

typedef struct {
    const char *s;
    Py_ssize_t n;
} Name;

static int seen_before(const Name *names, int count, const char *s, Py_ssize_t n) {
    for (int i = 0; i < count; i++)
        if (names[i].n == n && memcmp(names[i].s, s, (size_t)n) == 0) return 1;
    return 0;
}

/* One device's timing object: *ok 0 when it is not a timing step_row takes. */
static int scan_timing(Cur *c, double *duration, int *ok) {
    int empty, more = 1, r;
    if (c->p >= c->end || *c->p != '{') {
        *ok = 0;
        return skip_value(c);
    }
    if ((r = open_container(c, '{', '}', &empty))) return r;
    int has_d = 0, has_c = 0, has_g = 0, has_n = 0, good = 1;
    double d = 0.0;
    while (!empty && more) {
        const char *s;
        Py_ssize_t n;
        if ((r = member_key(c, &s, &n))) return r;
        int which = KEY_IS(s, n, "duration_ms")   ? 1
                    : KEY_IS(s, n, "cpu_ms")      ? 2
                    : KEY_IS(s, n, "gpu_ms")      ? 3
                    : KEY_IS(s, n, "n_calls")     ? 4
                                                  : 0;
        if (which == 0) {
            if ((r = skip_value(c))) return r;
        } else {
            int *has = which == 1 ? &has_d : which == 2 ? &has_c : which == 3 ? &has_g : &has_n;
            if (*has) return DECLINE; /* a duplicated key: orjson keeps the last */
            *has = 1;
            if (which == 3 && c->p < c->end && *c->p == 'n') {
                if ((r = literal(c, "null", 4))) return r;
            } else if (c->p < c->end && (*c->p == '-' || (*c->p >= '0' && *c->p <= '9'))) {
                Num num;
                if ((r = scan_number_as(c, &num, which == 1 || which == 4))) return r;
                if (which == 4) {
                    if (!num.is_int || num.i < 1) good = 0;
                } else if (!num.is_int && num.plain && which != 1) {
                    /* finite, not negative: a timing's cpu_ms or gpu_ms as it should be */
                } else {
                    double v;
                    if (num.is_int) {
                        if (num.i > MAX_EXACT || num.i < -MAX_EXACT) return DECLINE;
                        v = (double)num.i;
                    } else {
                        v = num.d;
                    }
                    if (!(v >= 0.0 && v <= DBL_MAX)) good = 0;
                    if (which == 1) d = v;
                }
            } else {
                good = 0;
                if ((r = skip_value(c))) return r;
            }
        }
        if ((r = next_member(c, '}', &more))) return r;
    }
    c->depth--;
    *ok = good && has_d && has_c && has_n;
    *duration = d;
    return 0;
}

/* One event's devices: *best the longest duration (-1: none), *ok 0 when any timing
 * is not one. */
static int scan_devices(Cur *c, double *best, int *ok) {
    int empty, more = 1, r;
    *best = -1.0;
    *ok = 1;
    if (c->p >= c->end || *c->p != '{') {
        *ok = 0;
        return skip_value(c);
    }
    if ((r = open_container(c, '{', '}', &empty))) return r;
    Name names[MAX_NAMES];
    int count = 0;
    while (!empty && more) {
        const char *s;
        Py_ssize_t n;
        if ((r = member_key(c, &s, &n))) return r;
        if (count == MAX_NAMES || seen_before(names, count, s, n)) return DECLINE;
        names[count].s = s;
        names[count].n = n;
        count++;
        double d;
        int good;
        if ((r = scan_timing(c, &d, &good))) return r;
        if (!good) *ok = 0;
        else if (d > *best) *best = d;
        if ((r = next_member(c, '}', &more))) return r;
    }
    c->depth--;
    if (*best < 0.0) *ok = 0;
    return 0;
}

typedef struct {
    const char *s;
    Py_ssize_t n;
    PyObject *label; /* borrowed from the label map (NULL: no phase) */
    int id;
} CachedName;

typedef struct {
    CachedName names[NAME_CACHE];
    int count;
    PyObject *labels;
} NameCache;

/* The label map's entry of an event name: 0 with *label (NULL: no phase) and *id. */
static int label_of(NameCache *cache, int hint, const char *s, Py_ssize_t n, PyObject **label,
                    int *id) {
    CachedName *hit = NULL;
    if (hint < cache->count && cache->names[hint].n == n &&
        memcmp(cache->names[hint].s, s, (size_t)n) == 0) {
        hit = &cache->names[hint];
    } else {
        for (int i = 0; i < cache->count; i++) {
            if (cache->names[i].n == n && memcmp(cache->names[i].s, s, (size_t)n) == 0) {
                hit = &cache->names[i];
                break;
            }
        }
    }
    if (hit == NULL) {
        PyObject *key = PyUnicode_FromStringAndSize(s, n);
        if (key == NULL) return ERROR;
        PyObject *entry = PyDict_GetItemWithError(cache->labels, key);
        Py_DECREF(key);
        if (entry == NULL) return PyErr_Occurred() ? ERROR : DECLINE; /* not named yet */
        PyObject *found = NULL;
        int found_id = 0;
        if (entry != Py_None) {
            if (!PyTuple_CheckExact(entry) || PyTuple_GET_SIZE(entry) != 2) return DECLINE;
            found = PyTuple_GET_ITEM(entry, 0);
            PyObject *num = PyTuple_GET_ITEM(entry, 1);
            if (!PyUnicode_CheckExact(found) || !PyLong_CheckExact(num)) return DECLINE;
            long v = PyLong_AsLong(num);
            if (v == -1 && PyErr_Occurred()) return ERROR;
            if (v < 0 || v >= MAX_LABELS) return DECLINE;
            found_id = (int)v;
        }
        if (cache->count == NAME_CACHE) {
            *label = found;
            *id = found_id;
            return 0;
        }
        hit = &cache->names[cache->count++];
        hit->s = s;
        hit->n = n;
        hit->label = found;
        hit->id = found_id;
    }
    *label = hit->label;
    *id = hit->id;
    return 0;
}

typedef struct {
    PyObject *label;
    int id;
    double ms;
} Phase;

typedef struct {
    char *data;
    size_t len, cap;
} Buf;

static int buf_add(Buf *b, const void *v, size_t n) {
    if (b->len + n > b->cap) {
        size_t cap = b->cap ? 2 * b->cap : 256;
        while (cap < b->len + n) cap *= 2;
        char *grown = PyMem_Realloc(b->data, cap);
        if (grown == NULL) {
            PyErr_NoMemory();
            return ERROR;
        }
        b->data = grown;
        b->cap = cap;
    }
    memcpy(b->data + b->len, v, n);
    b->len += n;
    return 0;
}

typedef struct {
    PyObject *steps, *ends, *step_ms, *phases, *tokens;
    Buf step_buf, phase_buf, id_buf;
    Py_ssize_t ignored, count, top;
    int64_t top_step;
    uint64_t mask;
    NameCache cache;
    const char *step_name;
    Py_ssize_t step_name_len;
} Out;

static int append_new(PyObject *list, PyObject *value) {
    if (value == NULL) return ERROR;
    int r = PyList_Append(list, value);
    Py_DECREF(value);
    return r < 0 ? ERROR : 0;
}

/* A step's events: *ok 0 when step_row gives no row; the phases summed by label. */
static int scan_events(Cur *c, Out *out, double *step_ms, Phase *phases, int *nphases, int *ok) {
    int empty, more = 1, r;
    if ((r = open_container(c, '{', '}', &empty))) return r;
    Name names[MAX_NAMES];
    int count = 0, has_step = 0;
    *ok = 1;
    *nphases = 0;
    while (!empty && more) {
        const char *s;
        Py_ssize_t n;
        if ((r = member_key(c, &s, &n))) return r;
        if (count == MAX_NAMES || seen_before(names, count, s, n)) return DECLINE;
        names[count].s = s;
        names[count].n = n;
        double best;
        int good;
        if ((r = scan_devices(c, &best, &good))) return r;
        if (!good) *ok = 0;
        if (n == out->step_name_len && memcmp(s, out->step_name, (size_t)n) == 0) {
            has_step = 1;
            *step_ms = best;
        } else {
            PyObject *label;
            int id;
            if ((r = label_of(&out->cache, count, s, n, &label, &id))) return r;
            if (label != NULL && good) {
                int k = 0;
                while (k < *nphases && phases[k].id != id) k++;
                if (k == *nphases) {
                    phases[k].label = label;
                    phases[k].id = id;
                    phases[k].ms = 0.0;
                    (*nphases)++;
                }
                phases[k].ms += best;
            }
        }
        count++;
        if ((r = next_member(c, '}', &more))) return r;
    }
    c->depth--;
    if (!has_step) *ok = 0;
    return 0;
}

/* A non-negative integer value, or *ok 0 for any other value (read past). */
static int scan_count(Cur *c, int64_t *value, int *ok) {
    if (c->p < c->end && (*c->p == '-' || (*c->p >= '0' && *c->p <= '9'))) {
        Num num;
        int r = scan_number(c, &num);
        if (r) return r;
        *ok = num.is_int && num.i >= 0;
        *value = num.i;
        return 0;
    }
    *ok = 0;
    return skip_value(c);
}

static int scan_item(Cur *c, Out *out) {
    int empty, more = 1, r;
    if (c->p >= c->end || *c->p != '{') {
        out->ignored++;
        return skip_value(c);
    }
    if ((r = open_container(c, '{', '}', &empty))) return r;
    int has_step = 0, has_end = 0, has_events = 0, has_tokens = 0;
    int step_ok = 0, end_ok = 0, events_ok = 0, tokens_ok = 0;
    int64_t step = 0, end_ns = 0, tokens = 0;
    double step_ms = 0.0;
    Phase phases[MAX_NAMES];
    int nphases = 0;
    while (!empty && more) {
        const char *s;
        Py_ssize_t n;
        if ((r = member_key(c, &s, &n))) return r;
        if (KEY_IS(s, n, "step")) {
            if (has_step++) return DECLINE;
            if ((r = scan_count(c, &step, &step_ok))) return r;
            step_ok = step_ok && step >= 1;
        } else if (KEY_IS(s, n, "timestamp_unix_ns")) {
            if (has_end++) return DECLINE;
            if ((r = scan_count(c, &end_ns, &end_ok))) return r;
        } else if (KEY_IS(s, n, "tokens")) {
            if (has_tokens++) return DECLINE;
            if ((r = scan_count(c, &tokens, &tokens_ok))) return r;
        } else if (KEY_IS(s, n, "events")) {
            if (has_events++) return DECLINE;
            if (c->p < c->end && *c->p == '{') {
                if ((r = scan_events(c, out, &step_ms, phases, &nphases, &events_ok))) return r;
            } else {
                events_ok = 0;
                if ((r = skip_value(c))) return r;
            }
        } else if ((r = skip_value(c))) {
            return r;
        }
        if ((r = next_member(c, '}', &more))) return r;
    }
    c->depth--;
    if (!(step_ok && end_ok && events_ok)) {
        out->ignored++;
        return 0;
    }
    PyObject *row = PyDict_New();
    if (row == NULL) return ERROR;
    for (int k = 0; k < nphases; k++) {
        PyObject *ms = PyFloat_FromDouble(phases[k].ms);
        if (ms == NULL || PyDict_SetItem(row, phases[k].label, ms) < 0) {
            Py_XDECREF(ms);
            Py_DECREF(row);
            return ERROR;
        }
        Py_DECREF(ms);
        int32_t id = phases[k].id;
        if (buf_add(&out->phase_buf, &phases[k].ms, sizeof(double)) ||
            buf_add(&out->id_buf, &id, sizeof(id))) {
            Py_DECREF(row);
            return ERROR;
        }
        out->mask |= (uint64_t)1 << id;
    }
    if (append_new(out->phases, row)) return ERROR;
    if (append_new(out->steps, PyLong_FromLongLong(step)) ||
        append_new(out->ends, PyLong_FromLongLong(end_ns)) ||
        append_new(out->step_ms, PyFloat_FromDouble(step_ms)) ||
        buf_add(&out->step_buf, &step_ms, sizeof(double)))
        return ERROR;
    if (has_tokens && tokens_ok) {
        PyObject *pair = Py_BuildValue("(Ld)", (long long)step, (double)tokens);
        if (append_new(out->tokens, pair)) return ERROR;
    }
    if (out->top < 0 || step >= out->top_step) {
        out->top = out->count;
        out->top_step = step;
    }
    out->count++;
    return 0;
}

/* identity's global_rank, node_rank, world_size: an int (new reference), or None for
 * any other value or none. */
static int scan_identity(Cur *c, PyObject **fields) {
    static const char *const keys[3] = {"global_rank", "node_rank", "world_size"};
    int empty, more = 1, r;
    if ((r = open_container(c, '{', '}', &empty))) return r;
    while (!empty && more) {
        const char *s;
        Py_ssize_t n;
        if ((r = member_key(c, &s, &n))) return r;
        int which = -1;
        for (int k = 0; k < 3; k++)
            if (n == (Py_ssize_t)strlen(keys[k]) && memcmp(s, keys[k], (size_t)n) == 0) which = k;
        if (which < 0) {
            if ((r = skip_value(c))) return r;
        } else {
            if (fields[which] != NULL) return DECLINE; /* a duplicated key */
            if (c->p < c->end && (*c->p == '-' || (*c->p >= '0' && *c->p <= '9'))) {
                Num num;
                if ((r = scan_number(c, &num))) return r;
                /* Any int, negative too (the state's own check refuses it). */
                fields[which] = num.is_int ? PyLong_FromLongLong(num.i) : Py_NewRef(Py_None);
                if (fields[which] == NULL) return ERROR;
            } else {
                if ((r = skip_value(c))) return r;
                fields[which] = Py_NewRef(Py_None);
            }
        }
        if ((r = next_member(c, '}', &more))) return r;
    }
    c->depth--;
    return 0;
}

static void out_clear(Out *out) {
    Py_XDECREF(out->steps);
    Py_XDECREF(out->ends);
    Py_XDECREF(out->step_ms);
    Py_XDECREF(out->phases);
    Py_XDECREF(out->tokens);
    PyMem_Free(out->step_buf.data);
    PyMem_Free(out->phase_buf.data);
    PyMem_Free(out->id_buf.data);
}

static PyObject *scan_step_time(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "scan_step_time takes 2 arguments (body, labels)");
        return NULL;
    }
    if (!PyBytes_CheckExact(args[0]) || !PyDict_CheckExact(args[1])) {
        PyErr_SetString(PyExc_TypeError, "scan_step_time takes (bytes, dict)");
        return NULL;
    }
    if (step_event == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "_feedscan is not configured");
        return NULL;
    }
    Out out;
    memset(&out, 0, sizeof(out));
    out.top = -1;
    out.cache.labels = args[1];
    out.step_name = PyUnicode_AsUTF8AndSize(step_event, &out.step_name_len);
    if (out.step_name == NULL) return NULL;
    PyObject *identity[3] = {NULL, NULL, NULL};
    PyObject *result = NULL;
    out.steps = PyList_New(0);
    out.ends = PyList_New(0);
    out.step_ms = PyList_New(0);
    out.phases = PyList_New(0);
    out.tokens = PyList_New(0);
    int r = ERROR;
    if (!out.steps || !out.ends || !out.step_ms || !out.phases || !out.tokens) goto done;

    Cur c = {PyBytes_AS_STRING(args[0]), PyBytes_AS_STRING(args[0]) + PyBytes_GET_SIZE(args[0]), 0};
    int empty, more = 1;
    int has_stream = 0, has_identity = 0, has_items = 0;
    ws(&c);
    if ((r = open_container(&c, '{', '}', &empty))) goto done;
    while (!empty && more) {
        const char *s;
        Py_ssize_t n;
        if ((r = member_key(&c, &s, &n))) goto done;
        if (KEY_IS(s, n, "stream")) {
            const char *v;
            Py_ssize_t vn;
            r = DECLINE;
            if (has_stream++ || scan_string(&c, &v, &vn) || !KEY_IS(v, vn, "step_time")) goto done;
        } else if (KEY_IS(s, n, "identity")) {
            r = DECLINE;
            if (has_identity++ || c.p >= c.end || *c.p != '{') goto done;
            if ((r = scan_identity(&c, identity))) goto done;
        } else if (KEY_IS(s, n, "items")) {
            int none, next = 1;
            r = DECLINE;
            if (has_items++) goto done;
            if ((r = open_container(&c, '[', ']', &none))) goto done;
            while (!none && next) {
                if ((r = scan_item(&c, &out))) goto done;
                if ((r = next_member(&c, ']', &next))) goto done;
            }
            c.depth--;
        } else if ((r = skip_value(&c))) {
            goto done;
        }
        if ((r = next_member(&c, '}', &more))) goto done;
    }
    ws(&c);
    r = DECLINE;
    if (c.p != c.end || !has_stream || !has_identity || !has_items) goto done;
    r = ERROR;
    PyObject *step_buf = PyBytes_FromStringAndSize(out.step_buf.data, (Py_ssize_t)out.step_buf.len);
    PyObject *phase_buf =
        PyBytes_FromStringAndSize(out.phase_buf.data, (Py_ssize_t)out.phase_buf.len);
    PyObject *id_buf = PyBytes_FromStringAndSize(out.id_buf.data, (Py_ssize_t)out.id_buf.len);
    PyObject *mask = PyLong_FromUnsignedLongLong(out.mask);
    PyObject *ignored = PyLong_FromSsize_t(out.ignored);
    PyObject *top = PyLong_FromSsize_t(out.top);
    if (step_buf && phase_buf && id_buf && mask && ignored && top) {
        result = PyTuple_Pack(
            14, identity[0] ? identity[0] : Py_None, identity[1] ? identity[1] : Py_None,
            identity[2] ? identity[2] : Py_None, ignored, out.steps, out.ends, out.step_ms,
            out.phases, out.tokens, top, step_buf, phase_buf, id_buf, mask);
    }
    Py_XDECREF(ignored);
    Py_XDECREF(top);
    Py_XDECREF(step_buf);
    Py_XDECREF(phase_buf);
    Py_XDECREF(id_buf);
    Py_XDECREF(mask);
    r = result ? 0 : ERROR;
done:
    for (int k = 0; k < 3; k++) Py_XDECREF(identity[k]);
    out_clear(&out);
    if (r == DECLINE) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    return result;
}


/* A selected key's value: a str, int, float, bool or None (a new reference); DECLINE
 * for an object, an array or what the scan does not hold exactly. */
static int scan_scalar(Cur *c, PyObject **value) {
    if (c->p >= c->end) return DECLINE;
    int r;
    switch (*c->p) {
        case '"': {
            const char *s;
            Py_ssize_t n;
            if ((r = scan_string(c, &s, &n))) return r;
            *value = PyUnicode_FromStringAndSize(s, n);
            return *value == NULL ? ERROR : 0;
        }
        case 't':
            if ((r = literal(c, "true", 4))) return r;
            *value = Py_NewRef(Py_True);
            return 0;
        case 'f':
            if ((r = literal(c, "false", 5))) return r;
            *value = Py_NewRef(Py_False);
            return 0;
        case 'n':
            if ((r = literal(c, "null", 4))) return r;
            *value = Py_NewRef(Py_None);
            return 0;
        case '{':
        case '[':
            return DECLINE;
        default: {
            Num num;
            if ((r = scan_number(c, &num))) return r;
            *value = num.is_int ? PyLong_FromLongLong(num.i) : PyFloat_FromDouble(num.d);
            return *value == NULL ? ERROR : 0;
        }
    }
}

#define MAX_KEYS 16

/* scan_items(body, stream, keys) -> (global_rank, node_rank, world_size, rows) or None:
 * each item of a batch of ``stream`` as a tuple of its values of ``keys`` (None where
 * absent), what ``item.get(key)`` gives for each; None for anything not the plain case
 * (an item that is not an object, a selected value that is an object or an array, a
 * duplicated selected key, an escape, a byte outside ASCII, invalid JSON). */
static PyObject *scan_items(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3 || !PyBytes_CheckExact(args[0]) || !PyUnicode_CheckExact(args[1]) ||
        !PyTuple_CheckExact(args[2])) {
        PyErr_SetString(PyExc_TypeError, "scan_items takes (bytes, str, tuple of str)");
        return NULL;
    }
    Py_ssize_t nkeys = PyTuple_GET_SIZE(args[2]);
    if (nkeys > MAX_KEYS) {
        PyErr_SetString(PyExc_ValueError, "scan_items takes at most 16 keys");
        return NULL;
    }
    Name keys[MAX_KEYS];
    for (Py_ssize_t k = 0; k < nkeys; k++) {
        PyObject *key = PyTuple_GET_ITEM(args[2], k);
        if (!PyUnicode_CheckExact(key)) {
            PyErr_SetString(PyExc_TypeError, "scan_items' keys are str");
            return NULL;
        }
        keys[k].s = PyUnicode_AsUTF8AndSize(key, &keys[k].n);
        if (keys[k].s == NULL) return NULL;
    }
    Py_ssize_t stream_len;
    const char *stream = PyUnicode_AsUTF8AndSize(args[1], &stream_len);
    if (stream == NULL) return NULL;
    PyObject *identity[3] = {NULL, NULL, NULL};
    PyObject *rows = PyList_New(0);
    PyObject *row = NULL;
    PyObject *result = NULL;
    if (rows == NULL) return NULL;
    Cur c = {PyBytes_AS_STRING(args[0]), PyBytes_AS_STRING(args[0]) + PyBytes_GET_SIZE(args[0]), 0};
    int r, empty, more = 1, has_stream = 0, has_identity = 0, has_items = 0;
    ws(&c);
    if ((r = open_container(&c, '{', '}', &empty))) goto done;
    while (!empty && more) {
        const char *s;
        Py_ssize_t n;
        if ((r = member_key(&c, &s, &n))) goto done;
        if (KEY_IS(s, n, "stream")) {
            const char *v;
            Py_ssize_t vn;
            r = DECLINE;
            if (has_stream++ || scan_string(&c, &v, &vn) || vn != stream_len ||
                memcmp(v, stream, (size_t)vn) != 0)
                goto done;
        } else if (KEY_IS(s, n, "identity")) {
            r = DECLINE;
            if (has_identity++ || c.p >= c.end || *c.p != '{') goto done;
            if ((r = scan_identity(&c, identity))) goto done;
        } else if (KEY_IS(s, n, "items")) {
            int none, next = 1;
            r = DECLINE;
            if (has_items++) goto done;
            if ((r = open_container(&c, '[', ']', &none))) goto done;
            while (!none && next) {
                int fields, further = 1;
                if ((r = open_container(&c, '{', '}', &fields))) goto done;
                row = PyTuple_New(nkeys);
                r = ERROR;
                if (row == NULL) goto done;
                while (!fields && further) {
                    const char *ks;
                    Py_ssize_t kn;
                    if ((r = member_key(&c, &ks, &kn))) goto done;
                    Py_ssize_t which = -1;
                    for (Py_ssize_t k = 0; k < nkeys; k++) {
                        if (keys[k].n == kn && memcmp(keys[k].s, ks, (size_t)kn) == 0) {
                            which = k;
                            break;
                        }
                    }
                    if (which < 0) {
                        if ((r = skip_value(&c))) goto done;
                    } else {
                        PyObject *value;
                        r = DECLINE;
                        if (PyTuple_GET_ITEM(row, which) != NULL) goto done; /* duplicated */
                        if ((r = scan_scalar(&c, &value))) goto done;
                        PyTuple_SET_ITEM(row, which, value);
                    }
                    if ((r = next_member(&c, '}', &further))) goto done;
                }
                c.depth--;
                for (Py_ssize_t k = 0; k < nkeys; k++)
                    if (PyTuple_GET_ITEM(row, k) == NULL) PyTuple_SET_ITEM(row, k, Py_NewRef(Py_None));
                r = ERROR;
                if (PyList_Append(rows, row) < 0) goto done;
                Py_CLEAR(row);
                if ((r = next_member(&c, ']', &next))) goto done;
            }
            c.depth--;
        } else if ((r = skip_value(&c))) {
            goto done;
        }
        if ((r = next_member(&c, '}', &more))) goto done;
    }
    ws(&c);
    r = DECLINE;
    if (c.p != c.end || !has_stream || !has_identity || !has_items) goto done;
    result = PyTuple_Pack(4, identity[0] ? identity[0] : Py_None,
                          identity[1] ? identity[1] : Py_None,
                          identity[2] ? identity[2] : Py_None, rows);
    r = result ? 0 : ERROR;
done:
    if (row != NULL) {
        /* A row cut short: its unset slots must not be read when it is freed. */
        for (Py_ssize_t k = 0; k < nkeys; k++)
            if (PyTuple_GET_ITEM(row, k) == NULL) PyTuple_SET_ITEM(row, k, Py_NewRef(Py_None));
        Py_DECREF(row);
    }
    for (int k = 0; k < 3; k++) Py_XDECREF(identity[k]);
    Py_DECREF(rows);
    if (r == DECLINE) {
        if (PyErr_Occurred()) return NULL;
        Py_RETURN_NONE;
    }
    return result;
}

static PyObject *configure(PyObject *module, PyObject *arg) {
    if (!PyUnicode_CheckExact(arg)) {
        PyErr_SetString(PyExc_TypeError, "configure takes the step event's name (str)");
        return NULL;
    }
    Py_INCREF(arg);
    Py_XSETREF(step_event, arg);
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"scan_step_time", (PyCFunction)(void (*)(void))scan_step_time, METH_FASTCALL,
     "scan_step_time(body, labels) -> the step_time batch's steps, or None (read it the "
     "Python way)."},
    {"scan_items", (PyCFunction)(void (*)(void))scan_items, METH_FASTCALL,
     "scan_items(body, stream, keys) -> (global_rank, node_rank, world_size, rows) or None."},
    {"configure", configure, METH_O, "configure(step_event): the whole-step event's name."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT, "traceml_ai.monitor._feedscan",
    "A step_time batch body read into what the live state takes (see _feedscan_py).", -1,
    methods,
};

PyMODINIT_FUNC PyInit__feedscan(void) {
#ifdef __GLIBC__
    if (c_locale == (locale_t)0) c_locale = newlocale(LC_ALL_MASK, "C", (locale_t)0);
#endif
    return PyModule_Create(&module_def);
}
