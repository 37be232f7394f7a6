/* cdcd.envelope._native: a change's Kafka key and Avro envelope from TupleData, in C.
 *
 * The compiled twin of cdcd.envelope.encoder.TableEncoder.change for the
 * rows nearly every change has: each column text ('t') or null ('n'). The
 * pure-Python encoder (cdcd.envelope.rowcode, cdcd.decode.*) is the reference;
 * this file must produce the very same bytes, which the tests check value by
 * value (tests/envelope/test_native.py). Whatever this code does not take
 * on, it hands back to Python unchanged:
 *
 * - per value: text the C parsers do not accept (an int with a '+' or 19
 *   digits, a numeric with more fractional digits than the scale, a
 *   timestamp with a BC year, 'infinity', ...) goes to the column's Python
 *   converter, so the result, or the exception, is the converter's own;
 * - per change: unchanged TOAST ('u'), binary ('b') or unknown kinds, a null
 *   in a column that may not be null, a key column that is not text, a
 *   column count that does not match, a converter that raises: the whole
 *   change is redone by the Python method, which raises the EncodeError with
 *   table, column and LSN, or handles the TOAST fill.
 *
 * RowCodec.copy_reads does the same for snapshot reads straight from COPY
 * text (cdcd.snapshot.rows.encode_reads): it splits each line itself and
 * hands a line it does not take on (an escaped value, a field count that
 * does not match, anything the row encoding hands back) to Python, which
 * parses that line and encodes it with the reference (tests/snapshot/
 * test_copy_reads.py). Its output is packed, no Python object per row (see
 * codec_copy_reads).
 *
 * Column kinds (the Python side maps each converter to one):
 *   0 OTHER        the Python converter, always
 *   1 STRING       Avro string/bytes of the text as sent: length, bytes
 *   2 INT          int2/int4/int8/oid: zig-zag varint
 *   3 BOOL         't'/'f'
 *   4 DECIMAL      numeric(p, s): minimal two's-complement big-endian bytes
 *   5 TIMESTAMPTZ  microseconds since 1970-01-01 UTC, clamped
 *   6 TIMESTAMP    microseconds since 1970-01-01 (local), clamped
 *   7 DATE         days since 1970-01-01, clamped
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>
#include <time.h>

#ifndef CDCD_NATIVE_SOURCE
#define CDCD_NATIVE_SOURCE ""
#endif

enum {
    K_OTHER = 0,
    K_STRING = 1,
    K_INT = 2,
    K_BOOL = 3,
    K_DECIMAL = 4,
    K_TIMESTAMPTZ = 5,
    K_TIMESTAMP = 6,
    K_DATE = 7,
    K_LAST = 7
};

#define KIND_TEXT 0x74 /* 't' */
#define KIND_NULL 0x6E /* 'n' */

/* Clamp bounds of cdcd.decode.temporal (SPEC §5). */
#define DATE_MIN (-719162LL)
#define DATE_MAX 2932896LL
#define TIMESTAMP_MIN (-62135596800000000LL)
#define TIMESTAMP_MAX 253402300799999999LL

/* Outcomes of the per-column encoders. */
#define OK 0
#define SLOW 1    /* not for the C parser: use the Python converter */
#define FAIL (-1) /* a Python exception is set */

/* ------------------------------------------------------------------ buffer */

typedef struct {
    char *data;
    Py_ssize_t size;
    Py_ssize_t capacity;
    char inline_data[1024];
} Buffer;

static void buffer_init(Buffer *b) {
    b->data = b->inline_data;
    b->size = 0;
    b->capacity = (Py_ssize_t)sizeof(b->inline_data);
}

static void buffer_free(Buffer *b) {
    if (b->data != b->inline_data) {
        PyMem_Free(b->data);
    }
    b->data = b->inline_data;
}

static int buffer_reserve(Buffer *b, Py_ssize_t extra) {
    if (b->size + extra <= b->capacity) {
        return 0;
    }
    Py_ssize_t want = b->capacity * 2;
    while (want < b->size + extra) {
        want *= 2;
    }
    char *grown;
    if (b->data == b->inline_data) {
        grown = PyMem_Malloc((size_t)want);
        if (grown != NULL) {
            memcpy(grown, b->data, (size_t)b->size);
        }
    } else {
        grown = PyMem_Realloc(b->data, (size_t)want);
    }
    if (grown == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    b->data = grown;
    b->capacity = want;
    return 0;
}

static inline int buffer_put(Buffer *b, const char *p, Py_ssize_t n) {
    if (buffer_reserve(b, n) < 0) {
        return -1;
    }
    memcpy(b->data + b->size, p, (size_t)n);
    b->size += n;
    return 0;
}

static inline int buffer_byte(Buffer *b, unsigned char c) {
    if (buffer_reserve(b, 1) < 0) {
        return -1;
    }
    b->data[b->size++] = (char)c;
    return 0;
}

/* The Avro long varint of an already zig-zagged value. */
static inline int buffer_varint(Buffer *b, uint64_t n) {
    if (buffer_reserve(b, 10) < 0) {
        return -1;
    }
    unsigned char *out = (unsigned char *)b->data + b->size;
    Py_ssize_t i = 0;
    while (n >= 0x80) {
        out[i++] = (unsigned char)((n & 0x7F) | 0x80);
        n >>= 7;
    }
    out[i++] = (unsigned char)n;
    b->size += i;
    return 0;
}

static inline uint64_t zigzag(int64_t v) {
    return ((uint64_t)v << 1) ^ (uint64_t)(v >> 63);
}

static inline int buffer_long(Buffer *b, int64_t v) {
    return buffer_varint(b, zigzag(v));
}

static inline int buffer_bytes_object(Buffer *b, PyObject *bytes) {
    return buffer_put(b, PyBytes_AS_STRING(bytes), PyBytes_GET_SIZE(bytes));
}

/* ------------------------------------------------------------------ parsers */

static const int64_t POW10[19] = {
    1LL,
    10LL,
    100LL,
    1000LL,
    10000LL,
    100000LL,
    1000000LL,
    10000000LL,
    100000000LL,
    1000000000LL,
    10000000000LL,
    100000000000LL,
    1000000000000LL,
    10000000000000LL,
    100000000000000LL,
    1000000000000000LL,
    10000000000000000LL,
    100000000000000000LL,
    1000000000000000000LL,
};

static inline int is_digit(char c) { return c >= '0' && c <= '9'; }

/* Up to 18 decimal digits, optionally after '-': what int() gives, or SLOW. */
static int parse_int(const char *p, Py_ssize_t n, int64_t *out) {
    int negative = 0;
    Py_ssize_t i = 0;
    if (n > 0 && p[0] == '-') {
        negative = 1;
        i = 1;
    }
    Py_ssize_t digits = n - i;
    if (digits < 1 || digits > 18) {
        return SLOW;
    }
    int64_t v = 0;
    for (; i < n; i++) {
        if (!is_digit(p[i])) {
            return SLOW;
        }
        v = v * 10 + (p[i] - '0');
    }
    *out = negative ? -v : v;
    return OK;
}

/* Exactly `count` digits at p as a number. */
static inline int fixed_digits(const char *p, int count, int *out) {
    int v = 0;
    for (int i = 0; i < count; i++) {
        if (!is_digit(p[i])) {
            return 0;
        }
        v = v * 10 + (p[i] - '0');
    }
    *out = v;
    return 1;
}

static inline int is_leap(int year) {
    return (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
}

static int days_in_month(int year, int month) {
    static const int days[12] = {31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31};
    return month == 2 && is_leap(year) ? 29 : days[month - 1];
}

/* Days since 1970-01-01 of a proleptic Gregorian date (cdcd.decode.temporal). */
static int64_t days_from_civil(int64_t year, int64_t month, int64_t day) {
    if (month <= 2) {
        year -= 1;
        month += 9;
    } else {
        month -= 3;
    }
    int64_t era = (year >= 0 ? year : year - 399) / 400;
    int64_t yoe = year - era * 400;
    int64_t doe = yoe * 365 + yoe / 4 - yoe / 100 + (153 * month + 2) / 5 + day - 1;
    return era * 146097 + doe - 719468;
}

/* "YYYY-MM-DD" (a four-digit year 0001..9999, a valid day) at p: days, or 0. */
static int parse_ymd(const char *p, int64_t *days) {
    int year, month, day;
    if (!fixed_digits(p, 4, &year) || p[4] != '-' || !fixed_digits(p + 5, 2, &month) ||
        p[7] != '-' || !fixed_digits(p + 8, 2, &day)) {
        return 0;
    }
    if (year < 1 || month < 1 || month > 12 || day < 1 || day > days_in_month(year, month)) {
        return 0;
    }
    *days = days_from_civil(year, month, day);
    return 1;
}

static int parse_date(const char *p, Py_ssize_t n, int64_t *out) {
    int64_t days;
    if (n != 10 || !parse_ymd(p, &days)) {
        return SLOW;
    }
    *out = days; /* years 1..9999 lie inside the clamp bounds */
    return OK;
}

/* "YYYY-MM-DD HH:MM:SS[.f{1,6}]" then, with a zone, "+HH[:MM[:SS]]" or "-...".
 * Years 0001..9999 only; BC, five-digit years and the infinities are SLOW. */
static int parse_timestamp(const char *p, Py_ssize_t n, int with_zone, int64_t *out) {
    int64_t days;
    int hour, minute, second;
    if (n < 19 || !parse_ymd(p, &days) || p[10] != ' ' || !fixed_digits(p + 11, 2, &hour) ||
        p[13] != ':' || !fixed_digits(p + 14, 2, &minute) || p[16] != ':' ||
        !fixed_digits(p + 17, 2, &second)) {
        return SLOW;
    }
    if (hour > 23 || minute > 59 || second > 59) {
        return SLOW;
    }
    Py_ssize_t pos = 19;
    int64_t micros = 0;
    if (pos < n && p[pos] == '.') {
        Py_ssize_t start = ++pos;
        while (pos < n && is_digit(p[pos])) {
            pos++;
        }
        Py_ssize_t count = pos - start;
        if (count < 1 || count > 6) {
            return SLOW;
        }
        for (Py_ssize_t i = start; i < pos; i++) {
            micros = micros * 10 + (p[i] - '0');
        }
        micros *= POW10[6 - count];
    }
    int64_t seconds = days * 86400 + hour * 3600 + minute * 60 + second;
    if (with_zone) {
        if (pos >= n || (p[pos] != '+' && p[pos] != '-')) {
            return SLOW;
        }
        int sign = p[pos] == '+' ? 1 : -1;
        Py_ssize_t left = n - pos - 1;
        const char *z = p + pos + 1;
        int oh = 0, om = 0, os = 0;
        if (!(left == 2 || left == 5 || left == 8) || !fixed_digits(z, 2, &oh)) {
            return SLOW;
        }
        if (left >= 5 && (z[2] != ':' || !fixed_digits(z + 3, 2, &om))) {
            return SLOW;
        }
        if (left == 8 && (z[5] != ':' || !fixed_digits(z + 6, 2, &os))) {
            return SLOW;
        }
        if (oh > 23 || om > 59 || os > 59) {
            return SLOW;
        }
        /* The text is local time at that offset: UTC = local - offset. */
        seconds -= sign * (oh * 3600 + om * 60 + os);
    } else if (pos != n) {
        return SLOW;
    }
    int64_t result = seconds * 1000000 + micros;
    if (result > TIMESTAMP_MAX) {
        result = TIMESTAMP_MAX;
    } else if (result < TIMESTAMP_MIN) {
        result = TIMESTAMP_MIN;
    }
    *out = result;
    return OK;
}

/* numeric(p, s) text with at most 18 digits once scaled: the unscaled value, or SLOW. */
static int parse_decimal(const char *p, Py_ssize_t n, int scale, int64_t *out) {
    Py_ssize_t i = 0;
    int negative = 0;
    if (n > 0 && p[0] == '-') {
        negative = 1;
        i = 1;
    }
    Py_ssize_t int_start = i;
    while (i < n && is_digit(p[i])) {
        i++;
    }
    Py_ssize_t int_digits = i - int_start;
    if (int_digits < 1) {
        return SLOW;
    }
    Py_ssize_t frac_start = i, frac_digits = 0;
    if (i < n) {
        if (p[i] != '.') {
            return SLOW;
        }
        frac_start = ++i;
        while (i < n && is_digit(p[i])) {
            i++;
        }
        frac_digits = i - frac_start;
        if (i != n || frac_digits < 1) {
            return SLOW;
        }
    }
    /* More fractional digits than the scale: Python checks that they are zeros. */
    if (frac_digits > scale || int_digits + scale > 18) {
        return SLOW;
    }
    int64_t v = 0;
    for (Py_ssize_t k = int_start; k < int_start + int_digits; k++) {
        v = v * 10 + (p[k] - '0');
    }
    for (Py_ssize_t k = frac_start; k < frac_start + frac_digits; k++) {
        v = v * 10 + (p[k] - '0');
    }
    v *= POW10[scale - frac_digits];
    *out = negative ? -v : v;
    return OK;
}

/* ------------------------------------------------------------------ columns */

typedef struct {
    int kind;
    int plain;           /* no union branch: a null is an error (Python raises) */
    int has_branch;      /* the value's branch byte is written */
    unsigned char branch;
    unsigned char null_branch;
    int scale;           /* DECIMAL */
    int64_t limit;       /* DECIMAL: 10**precision, or 0 when above int64 */
    PyObject *convert;   /* the Python converter (strong reference) */
} Column;

/* The Avro encoding of text `p[0:n]` of column `c`, without branch; `value` is
 * that text as a bytes object, or NULL (made here if the converter needs it). */
static int put_text(Buffer *b, const Column *c, const char *p, Py_ssize_t n, PyObject *value) {
    int64_t v;
    int r = SLOW;
    switch (c->kind) {
    case K_STRING:
        if (buffer_varint(b, (uint64_t)n << 1) < 0 || buffer_put(b, p, n) < 0) {
            return FAIL;
        }
        return OK;
    case K_INT:
        r = parse_int(p, n, &v);
        if (r == OK) {
            return buffer_long(b, v) < 0 ? FAIL : OK;
        }
        break;
    case K_BOOL:
        if (n == 1 && (p[0] == 't' || p[0] == 'f')) {
            return buffer_byte(b, p[0] == 't' ? 1 : 0) < 0 ? FAIL : OK;
        }
        break;
    case K_DECIMAL:
        r = parse_decimal(p, n, c->scale, &v);
        if (r == OK && c->limit != 0 && (v >= c->limit || v <= -c->limit)) {
            r = SLOW; /* the converter raises "numeric value exceeds decimal(p,s)" */
        }
        if (r == OK) {
            /* Minimal two's complement, big-endian, as Python's
             * unscaled.to_bytes((unscaled + (unscaled < 0)).bit_length() // 8 + 1):
             * |v| < 10**18 < 2**60, so at most 8 bytes, the low ones of v. */
            uint64_t u = v < 0 ? ~(uint64_t)v : (uint64_t)v;
            int bits = u == 0 ? 0 : 64 - __builtin_clzll(u);
            int size = bits / 8 + 1;
            unsigned char out[9];
            out[0] = (unsigned char)(size << 1); /* the length's varint: one byte */
            uint64_t raw = (uint64_t)v;
            for (int k = size; k >= 1; k--) {
                out[k] = (unsigned char)(raw & 0xFF);
                raw >>= 8;
            }
            return buffer_put(b, (const char *)out, size + 1) < 0 ? FAIL : OK;
        }
        break;
    case K_TIMESTAMPTZ:
    case K_TIMESTAMP:
        r = parse_timestamp(p, n, c->kind == K_TIMESTAMPTZ, &v);
        if (r == OK) {
            return buffer_long(b, v) < 0 ? FAIL : OK;
        }
        break;
    case K_DATE:
        r = parse_date(p, n, &v);
        if (r == OK) {
            return buffer_long(b, v) < 0 ? FAIL : OK;
        }
        break;
    default:
        break;
    }
    /* OTHER, or text the C parsers leave to the converter. */
    PyObject *made = NULL;
    if (value == NULL) {
        value = made = PyBytes_FromStringAndSize(p, n);
        if (made == NULL) {
            return FAIL;
        }
    }
    PyObject *encoded = PyObject_CallOneArg(c->convert, value);
    Py_XDECREF(made);
    if (encoded == NULL) {
        return FAIL;
    }
    if (!PyBytes_CheckExact(encoded)) {
        Py_DECREF(encoded);
        PyErr_SetString(PyExc_TypeError, "a column converter returned something other than bytes");
        return FAIL;
    }
    int result = buffer_bytes_object(b, encoded) < 0 ? FAIL : OK;
    Py_DECREF(encoded);
    return result;
}

/* put_text of a bytes object's text. */
static inline int put_value(Buffer *b, const Column *c, PyObject *value) {
    return put_text(b, c, PyBytes_AS_STRING(value), PyBytes_GET_SIZE(value), value);
}

/* ------------------------------------------------------------------ the codec */

typedef struct {
    PyObject_HEAD
    Py_ssize_t count;
    Column *columns;
    Py_ssize_t key_count;
    Py_ssize_t *key_indexes;
    PyObject *value_header; /* bytes */
    PyObject *source_prefix; /* bytes */
    PyObject *key_header; /* bytes */
    PyObject *fallback; /* the Python change(op, before, after, stamp, seq) */
    PyTypeObject *tuple_type; /* cdcd.protocol.messages.TupleData */
    Py_ssize_t kinds_offset; /* TupleData.kinds slot */
    Py_ssize_t values_offset; /* TupleData.values slot */
} RowCodec;

static void codec_clear_columns(RowCodec *self) {
    if (self->columns != NULL) {
        for (Py_ssize_t i = 0; i < self->count; i++) {
            Py_CLEAR(self->columns[i].convert);
        }
        PyMem_Free(self->columns);
        self->columns = NULL;
    }
    PyMem_Free(self->key_indexes);
    self->key_indexes = NULL;
}

static int codec_traverse(RowCodec *self, visitproc visit, void *arg) {
    if (self->columns != NULL) {
        for (Py_ssize_t i = 0; i < self->count; i++) {
            Py_VISIT(self->columns[i].convert);
        }
    }
    Py_VISIT(self->fallback);
    Py_VISIT(self->tuple_type);
    return 0;
}

static int codec_clear(RowCodec *self) {
    if (self->columns != NULL) {
        for (Py_ssize_t i = 0; i < self->count; i++) {
            Py_CLEAR(self->columns[i].convert);
        }
    }
    Py_CLEAR(self->fallback);
    Py_CLEAR(self->tuple_type);
    return 0;
}

static void codec_dealloc(RowCodec *self) {
    PyObject_GC_UnTrack(self);
    codec_clear(self);
    codec_clear_columns(self);
    Py_CLEAR(self->value_header);
    Py_CLEAR(self->source_prefix);
    Py_CLEAR(self->key_header);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

/* The byte offset of slot `name` of `type` (a member descriptor), or -1. */
static Py_ssize_t slot_offset(PyTypeObject *type, const char *name) {
    PyObject *descr = PyObject_GetAttrString((PyObject *)type, name);
    if (descr == NULL) {
        return -1;
    }
    Py_ssize_t offset = -1;
    if (Py_IS_TYPE(descr, &PyMemberDescr_Type)) {
        PyMemberDef *member = ((PyMemberDescrObject *)descr)->d_member;
        if (member->type == T_OBJECT_EX || member->type == T_OBJECT) {
            offset = member->offset;
        }
    }
    Py_DECREF(descr);
    if (offset < 0) {
        PyErr_Format(PyExc_TypeError, "%s.%s is not a slot", type->tp_name, name);
    }
    return offset;
}

static int one_byte_or_empty(PyObject *value, const char *what, int *has, unsigned char *byte) {
    if (!PyBytes_Check(value) || PyBytes_GET_SIZE(value) > 1) {
        PyErr_Format(PyExc_ValueError, "%s must be b'' or one byte", what);
        return -1;
    }
    *has = PyBytes_GET_SIZE(value) == 1;
    *byte = *has ? (unsigned char)PyBytes_AS_STRING(value)[0] : 0;
    return 0;
}

/* RowCodec(columns, key_indexes, key_header, value_header, source_prefix, fallback, tuple_type)
 * columns: one (kind, branch, null_branch, convert, precision, scale) per column. */
static PyObject *codec_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *columns, *key_indexes, *key_header, *value_header, *source_prefix, *fallback;
    PyTypeObject *tuple_type;
    static char *kwlist[] = {"columns", "key_indexes", "key_header", "value_header",
                             "source_prefix", "fallback", "tuple_type", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOSSSOO!:RowCodec", kwlist, &columns,
                                     &key_indexes, &key_header, &value_header, &source_prefix,
                                     &fallback, &PyType_Type, &tuple_type)) {
        return NULL;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be callable");
        return NULL;
    }
    PyObject *cols = PySequence_Fast(columns, "columns must be a sequence");
    if (cols == NULL) {
        return NULL;
    }
    PyObject *keys = PySequence_Fast(key_indexes, "key_indexes must be a sequence");
    if (keys == NULL) {
        Py_DECREF(cols);
        return NULL;
    }
    RowCodec *self = (RowCodec *)type->tp_alloc(type, 0);
    if (self == NULL) {
        goto error;
    }
    self->count = PySequence_Fast_GET_SIZE(cols);
    self->columns = PyMem_Calloc((size_t)(self->count ? self->count : 1), sizeof(Column));
    self->key_count = PySequence_Fast_GET_SIZE(keys);
    self->key_indexes = PyMem_Calloc((size_t)(self->key_count ? self->key_count : 1), sizeof(Py_ssize_t));
    if (self->columns == NULL || self->key_indexes == NULL) {
        PyErr_NoMemory();
        goto error;
    }
    for (Py_ssize_t i = 0; i < self->count; i++) {
        PyObject *spec = PySequence_Fast_GET_ITEM(cols, i);
        int kind, precision, scale, has_null;
        PyObject *branch, *null_branch, *convert;
        if (!PyArg_ParseTuple(spec, "iSSOii:column", &kind, &branch, &null_branch, &convert,
                              &precision, &scale)) {
            goto error;
        }
        Column *c = &self->columns[i];
        if (kind < 0 || kind > K_LAST || !PyCallable_Check(convert)) {
            PyErr_Format(PyExc_ValueError, "column %zd: bad kind or converter", i);
            goto error;
        }
        if (one_byte_or_empty(branch, "branch", &c->has_branch, &c->branch) < 0 ||
            one_byte_or_empty(null_branch, "null_branch", &has_null, &c->null_branch) < 0) {
            goto error;
        }
        if (!has_null) {
            PyErr_SetString(PyExc_ValueError, "null_branch must be one byte");
            goto error;
        }
        c->plain = !c->has_branch;
        c->kind = kind;
        if (kind == K_DECIMAL) {
            if (scale < 0 || scale > 18 || precision < 1) {
                c->kind = K_OTHER; /* outside what the C parser takes: the converter */
            }
            c->scale = scale;
            c->limit = precision <= 18 ? POW10[precision] : 0;
        }
        Py_INCREF(convert);
        c->convert = convert;
    }
    for (Py_ssize_t k = 0; k < self->key_count; k++) {
        Py_ssize_t index = PyLong_AsSsize_t(PySequence_Fast_GET_ITEM(keys, k));
        if (index == -1 && PyErr_Occurred()) {
            goto error;
        }
        if (index < 0 || index >= self->count) {
            PyErr_SetString(PyExc_ValueError, "key index out of range");
            goto error;
        }
        self->key_indexes[k] = index;
    }
    self->kinds_offset = slot_offset(tuple_type, "kinds");
    if (self->kinds_offset < 0) {
        goto error;
    }
    self->values_offset = slot_offset(tuple_type, "values");
    if (self->values_offset < 0) {
        goto error;
    }
    Py_INCREF(key_header);
    self->key_header = key_header;
    Py_INCREF(value_header);
    self->value_header = value_header;
    Py_INCREF(source_prefix);
    self->source_prefix = source_prefix;
    Py_INCREF(fallback);
    self->fallback = fallback;
    Py_INCREF(tuple_type);
    self->tuple_type = tuple_type;
    Py_DECREF(cols);
    Py_DECREF(keys);
    return (PyObject *)self;

error:
    Py_DECREF(cols);
    Py_DECREF(keys);
    Py_XDECREF(self);
    return NULL;
}

/* The kinds (bytes) and values (tuple) of a TupleData, if it is one of this
 * table's shape with only 't'/'n' values; else 0 (SLOW). */
static int row_parts(RowCodec *self, PyObject *data, const unsigned char **kinds, PyObject **values) {
    if (!Py_IS_TYPE(data, self->tuple_type)) {
        return 0;
    }
    PyObject *k = *(PyObject **)((char *)data + self->kinds_offset);
    PyObject *v = *(PyObject **)((char *)data + self->values_offset);
    if (k == NULL || v == NULL || !PyBytes_CheckExact(k) || !PyTuple_CheckExact(v) ||
        PyBytes_GET_SIZE(k) != self->count || PyTuple_GET_SIZE(v) != self->count) {
        return 0;
    }
    *kinds = (const unsigned char *)PyBytes_AS_STRING(k);
    *values = v;
    return 1;
}

/* Append the row record of `data`: OK, SLOW (hand the change to Python) or FAIL. */
static int put_row(RowCodec *self, Buffer *b, PyObject *data) {
    const unsigned char *kinds;
    PyObject *values;
    if (!row_parts(self, data, &kinds, &values)) {
        return SLOW;
    }
    for (Py_ssize_t i = 0; i < self->count; i++) {
        const Column *c = &self->columns[i];
        if (kinds[i] == KIND_TEXT) {
            PyObject *value = PyTuple_GET_ITEM(values, i);
            if (!PyBytes_CheckExact(value)) {
                return SLOW;
            }
            if (c->has_branch && buffer_byte(b, c->branch) < 0) {
                return FAIL;
            }
            int r = put_value(b, c, value);
            if (r != OK) {
                return r == FAIL ? SLOW : r; /* Python raises it again, with its context */
            }
        } else if (kinds[i] == KIND_NULL && !c->plain) {
            if (buffer_byte(b, c->null_branch) < 0) {
                return FAIL;
            }
        } else {
            return SLOW; /* 'u', 'b', unknown, or a null Python refuses */
        }
    }
    return OK;
}

/* Append the key columns of `data`, plain: OK or SLOW. */
static int put_key(RowCodec *self, Buffer *b, PyObject *data) {
    const unsigned char *kinds;
    PyObject *values;
    if (!row_parts(self, data, &kinds, &values)) {
        return SLOW;
    }
    for (Py_ssize_t k = 0; k < self->key_count; k++) {
        Py_ssize_t i = self->key_indexes[k];
        PyObject *value = PyTuple_GET_ITEM(values, i);
        if (kinds[i] != KIND_TEXT || !PyBytes_CheckExact(value)) {
            return SLOW;
        }
        int r = put_value(b, &self->columns[i], value);
        if (r != OK) {
            return r == FAIL ? SLOW : r;
        }
    }
    return OK;
}

/* Key columns of an image must be text: Python's key encoder refuses anything else. */
static int key_columns_text(RowCodec *self, PyObject *data) {
    const unsigned char *kinds;
    PyObject *values;
    if (!row_parts(self, data, &kinds, &values)) {
        return 0;
    }
    for (Py_ssize_t k = 0; k < self->key_count; k++) {
        if (kinds[self->key_indexes[k]] != KIND_TEXT) {
            return 0;
        }
    }
    return 1;
}

static PyObject *codec_fallback(RowCodec *self, PyObject *const *args, Py_ssize_t nargs) {
    if (PyErr_Occurred()) {
        if (!PyErr_ExceptionMatches(PyExc_Exception)) {
            return NULL; /* KeyboardInterrupt, SystemExit: not the data's fault */
        }
        PyErr_Clear(); /* Python redoes the change and raises with table, column and LSN */
    }
    return PyObject_Vectorcall(self->fallback, args, (size_t)nargs, NULL);
}

/* change(op, before, after, stamp, seq) -> (key or None, value): TableEncoder.change. */
static PyObject *codec_change(RowCodec *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "change() takes op, before, after, stamp, seq");
        return NULL;
    }
    PyObject *op = args[0], *before = args[1], *after = args[2], *stamp = args[3];
    if (!PyBytes_CheckExact(op) || !PyTuple_Check(stamp) || PyTuple_GET_SIZE(stamp) < 8 ||
        !PyLong_CheckExact(args[4]) || (before == Py_None && after == Py_None)) {
        return codec_fallback(self, args, nargs);
    }
    long long seq = PyLong_AsLongLong(args[4]);
    PyObject *ts_ms = PyTuple_GET_ITEM(stamp, 5);
    PyObject *txid_lsn = PyTuple_GET_ITEM(stamp, 6);
    PyObject *tail = PyTuple_GET_ITEM(stamp, 7);
    if (seq < 0 || !PyBytes_CheckExact(ts_ms) || !PyBytes_CheckExact(txid_lsn) ||
        !PyBytes_CheckExact(tail)) {
        return codec_fallback(self, args, nargs);
    }
    if (self->key_count &&
        ((before != Py_None && !key_columns_text(self, before)) ||
         (after != Py_None && !key_columns_text(self, after)))) {
        return codec_fallback(self, args, nargs);
    }
    Buffer value;
    buffer_init(&value);
    PyObject *key = NULL, *result = NULL;
    int r = buffer_bytes_object(&value, self->value_header) < 0 ? FAIL : OK;
    if (r == OK) {
        if (before == Py_None) {
            r = buffer_byte(&value, 0x00) < 0 ? FAIL : OK;
        } else if ((r = buffer_byte(&value, 0x02) < 0 ? FAIL : OK) == OK) {
            r = put_row(self, &value, before);
        }
    }
    if (r == OK) {
        if (after == Py_None) {
            r = buffer_byte(&value, 0x00) < 0 ? FAIL : OK;
        } else if ((r = buffer_byte(&value, 0x02) < 0 ? FAIL : OK) == OK) {
            r = put_row(self, &value, after);
        }
    }
    if (r == OK &&
        (buffer_bytes_object(&value, op) < 0 || buffer_bytes_object(&value, ts_ms) < 0 ||
         buffer_bytes_object(&value, self->source_prefix) < 0 ||
         buffer_bytes_object(&value, txid_lsn) < 0 || buffer_long(&value, (int64_t)seq) < 0 ||
         buffer_bytes_object(&value, tail) < 0 || buffer_byte(&value, 0x00) < 0)) {
        r = FAIL;
    }
    if (r == OK && self->key_count) {
        Buffer k;
        buffer_init(&k);
        r = buffer_bytes_object(&k, self->key_header) < 0 ? FAIL : OK;
        if (r == OK) {
            r = put_key(self, &k, after != Py_None ? after : before);
        }
        if (r == OK) {
            key = PyBytes_FromStringAndSize(k.data, k.size);
            if (key == NULL) {
                r = FAIL;
            }
        }
        buffer_free(&k);
    }
    if (r == OK) {
        PyObject *encoded = PyBytes_FromStringAndSize(value.data, value.size);
        if (encoded != NULL) {
            result = PyTuple_New(2);
            if (result != NULL) {
                if (key == NULL) {
                    Py_INCREF(Py_None);
                    key = Py_None;
                }
                PyTuple_SET_ITEM(result, 0, key);
                PyTuple_SET_ITEM(result, 1, encoded);
                PyObject_GC_UnTrack(result); /* bytes and None: no cycle through it */
                key = NULL;
            } else {
                Py_DECREF(encoded);
            }
        }
    }
    buffer_free(&value);
    Py_XDECREF(key);
    if (result != NULL) {
        return result;
    }
    if (r == SLOW || r == OK) {
        return codec_fallback(self, args, nargs);
    }
    return NULL; /* out of memory */
}

/* ------------------------------------------------------------------ COPY rows */

/* Split one line of COPY text output (no newline) into this table's fields:
 * OK, or SLOW for what Python is to parse (or refuse) itself: a field count
 * that does not match, an escaped value. A field that is exactly \N is a
 * null (nulls[i] = 1). */
static int copy_fields(RowCodec *self, const char *line, Py_ssize_t len, const char **at,
                       Py_ssize_t *size, unsigned char *nulls) {
    const char *s = line, *end = line + len;
    int escaped = memchr(line, '\\', (size_t)len) != NULL;
    Py_ssize_t count = 0;
    for (;;) {
        const char *tab = memchr(s, '\t', (size_t)(end - s));
        const char *stop = tab != NULL ? tab : end;
        if (count >= self->count) {
            return SLOW;
        }
        at[count] = s;
        size[count] = stop - s;
        nulls[count] = 0;
        if (escaped && memchr(s, '\\', (size_t)(stop - s)) != NULL) {
            if (stop - s != 2 || s[1] != 'N') {
                return SLOW; /* an escape sequence: Python unescapes the row */
            }
            nulls[count] = 1;
        }
        count++;
        if (tab == NULL) {
            break;
        }
        s = tab + 1;
    }
    return count == self->count ? OK : SLOW;
}

/* The key and value of one snapshot read (before null, after = the row):
 * OK, SLOW or FAIL (a Python exception set), as codec_change. */
static int copy_read(RowCodec *self, Buffer *value, Buffer *key, const char **at,
                     const Py_ssize_t *size, const unsigned char *nulls, PyObject *op,
                     PyObject *const *stamp_parts, long long seq) {
    value->size = 0;
    if (buffer_bytes_object(value, self->value_header) < 0 || buffer_byte(value, 0x00) < 0 ||
        buffer_byte(value, 0x02) < 0) {
        return FAIL;
    }
    for (Py_ssize_t i = 0; i < self->count; i++) {
        const Column *c = &self->columns[i];
        if (nulls[i]) {
            if (c->plain) {
                return SLOW; /* Python refuses it, naming the column */
            }
            if (buffer_byte(value, c->null_branch) < 0) {
                return FAIL;
            }
            continue;
        }
        if (c->has_branch && buffer_byte(value, c->branch) < 0) {
            return FAIL;
        }
        int r = put_text(value, c, at[i], size[i], NULL);
        if (r != OK) {
            return r;
        }
    }
    if (buffer_bytes_object(value, op) < 0 || buffer_bytes_object(value, stamp_parts[0]) < 0 ||
        buffer_bytes_object(value, self->source_prefix) < 0 ||
        buffer_bytes_object(value, stamp_parts[1]) < 0 || buffer_long(value, (int64_t)seq) < 0 ||
        buffer_bytes_object(value, stamp_parts[2]) < 0 || buffer_byte(value, 0x00) < 0) {
        return FAIL;
    }
    key->size = 0;
    if (self->key_count == 0) {
        return OK;
    }
    if (buffer_bytes_object(key, self->key_header) < 0) {
        return FAIL;
    }
    for (Py_ssize_t k = 0; k < self->key_count; k++) {
        Py_ssize_t i = self->key_indexes[k];
        if (nulls[i]) {
            return SLOW;
        }
        int r = put_text(key, &self->columns[i], at[i], size[i], NULL);
        if (r != OK) {
            return r;
        }
    }
    return OK;
}

/* A bytes object written in place: the packed reads of a chunk are megabytes,
 * and building them in a Buffer first would cost a second allocation (fresh
 * pages) and a copy per chunk. */
typedef struct {
    PyObject *bytes; /* NULL after a failure */
    Py_ssize_t size;
} BytesBuilder;

static int builder_init(BytesBuilder *b, Py_ssize_t capacity) {
    b->size = 0;
    b->bytes = PyBytes_FromStringAndSize(NULL, capacity > 0 ? capacity : 1);
    return b->bytes != NULL ? OK : FAIL;
}

static int builder_put(BytesBuilder *b, const char *p, Py_ssize_t n) {
    Py_ssize_t capacity = PyBytes_GET_SIZE(b->bytes);
    if (b->size + n > capacity) {
        Py_ssize_t want = capacity * 2 > b->size + n ? capacity * 2 : b->size + n;
        if (_PyBytes_Resize(&b->bytes, want) < 0) {
            return FAIL; /* b->bytes is NULL now */
        }
    }
    memcpy(PyBytes_AS_STRING(b->bytes) + b->size, p, (size_t)n);
    b->size += n;
    return OK;
}

/* The bytes written, trimmed; the builder is empty after. */
static PyObject *builder_finish(BytesBuilder *b) {
    if (_PyBytes_Resize(&b->bytes, b->size) < 0) {
        return NULL;
    }
    PyObject *out = b->bytes;
    b->bytes = NULL;
    return out;
}

/* Appends one read to the packed output: its key (none: length -1) and value
 * bytes to `blob`, their two lengths (native int32) to `index`. */
static int pack_read(BytesBuilder *blob, BytesBuilder *index, const char *key, Py_ssize_t key_len,
                     const char *value, Py_ssize_t value_len) {
    if (key_len > INT32_MAX || value_len > INT32_MAX) {
        PyErr_SetString(PyExc_OverflowError, "copy_reads(): a message over 2 GiB");
        return FAIL;
    }
    int32_t lengths[2] = {key ? (int32_t)key_len : -1, (int32_t)value_len};
    if ((key && builder_put(blob, key, key_len) != OK) || builder_put(blob, value, value_len) != OK ||
        builder_put(index, (const char *)lengths, sizeof(lengths)) != OK) {
        return FAIL;
    }
    return OK;
}

/* What copy_reads and insert_run share: a row's fields (where each starts,
 * its length, whether it is null), the envelope and key being written, and
 * the packed output. */
typedef struct {
    const char **at;
    Py_ssize_t *size;
    unsigned char *nulls;
    PyObject *stamp_parts[3]; /* the TxnStamp's pre-encoded source fields */
    Buffer value, key;
    BytesBuilder blob, index;
} Packer;

static int packer_init(Packer *k, RowCodec *self, PyObject *stamp, Py_ssize_t blob_capacity,
                       Py_ssize_t index_capacity, const char *what) {
    k->at = NULL;
    k->size = NULL;
    k->nulls = NULL;
    k->blob = (BytesBuilder){NULL, 0};
    k->index = (BytesBuilder){NULL, 0};
    buffer_init(&k->value);
    buffer_init(&k->key);
    if (!PyTuple_Check(stamp) || PyTuple_GET_SIZE(stamp) < 8) {
        PyErr_Format(PyExc_TypeError, "%s(): not a TxnStamp", what);
        return FAIL;
    }
    for (int i = 0; i < 3; i++) {
        k->stamp_parts[i] = PyTuple_GET_ITEM(stamp, 5 + i);
        if (!PyBytes_CheckExact(k->stamp_parts[i])) {
            PyErr_Format(PyExc_TypeError, "%s(): not a TxnStamp", what);
            return FAIL;
        }
    }
    Py_ssize_t columns = self->count > 0 ? self->count : 1;
    k->at = PyMem_Malloc(sizeof(char *) * (size_t)columns);
    k->size = PyMem_Malloc(sizeof(Py_ssize_t) * (size_t)columns);
    k->nulls = PyMem_Malloc((size_t)columns);
    if (k->at == NULL || k->size == NULL || k->nulls == NULL) {
        PyErr_NoMemory();
        return FAIL;
    }
    return builder_init(&k->blob, blob_capacity) == OK && builder_init(&k->index, index_capacity) == OK
               ? OK : FAIL;
}

/* The fields in k->at/size/nulls as the change seq, into k->key and k->value:
 * OK, SLOW (left to Python) or FAIL (an exception is set). */
static int packer_read(Packer *k, RowCodec *self, PyObject *op, long long seq) {
    return copy_read(self, &k->value, &k->key, k->at, k->size, k->nulls, op, k->stamp_parts, seq);
}

/* The change packer_read wrote, appended to the output. */
static int packer_pack(Packer *k, RowCodec *self) {
    return pack_read(&k->blob, &k->index, self->key_count ? k->key.data : NULL, k->key.size,
                     k->value.data, k->value.size);
}

/* The packed reads as (blob, index, *extra): a new tuple, or NULL. */
static PyObject *packer_finish(Packer *k, const char *extra_format, Py_ssize_t a, Py_ssize_t b) {
    PyObject *packed = builder_finish(&k->blob);
    PyObject *lengths = packed != NULL ? builder_finish(&k->index) : NULL;
    PyObject *out = NULL;
    if (lengths != NULL) {
        out = extra_format ? Py_BuildValue(extra_format, packed, lengths, a, b)
                           : PyTuple_Pack(2, packed, lengths);
    }
    Py_XDECREF(packed);
    Py_XDECREF(lengths);
    return out;
}

static void packer_free(Packer *k) {
    Py_XDECREF(k->blob.bytes);
    Py_XDECREF(k->index.bytes);
    buffer_free(&k->value);
    buffer_free(&k->key);
    PyMem_Free(k->at);
    PyMem_Free(k->size);
    PyMem_Free(k->nulls);
}

/* copy_reads(data, op, stamp, seq, slow) -> (blob, index): every line of
 * `data` (COPY text output, whole lines) as a snapshot read with ordinals
 * seq, seq + 1, ...; a line it does not take on goes to slow(line, seq) ->
 * (key, value), the Python reference. The reads come packed, no Python
 * object per row: `blob` holds each read's key (if any) then value, `index`
 * two native int32 per read, the key's length (-1: no key) and the value's
 * (cdcd.envelope.rowcode.PackedReads reads them; the compiled producer
 * produces straight from them). */
static PyObject *codec_copy_reads(RowCodec *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 5) {
        PyErr_SetString(PyExc_TypeError, "copy_reads() takes data, op, stamp, seq, slow");
        return NULL;
    }
    PyObject *data = args[0], *op = args[1], *stamp = args[2], *slow = args[4];
    if (!PyBytes_CheckExact(data) || !PyBytes_CheckExact(op) || !PyLong_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "copy_reads(): bad argument types");
        return NULL;
    }
    long long seq = PyLong_AsLongLong(args[3]);
    if (seq == -1 && PyErr_Occurred()) {
        return NULL;
    }
    const char *p = PyBytes_AS_STRING(data);
    Py_ssize_t n = PyBytes_GET_SIZE(data);
    if (seq < 0 || (n > 0 && p[n - 1] != '\n')) {
        PyErr_SetString(PyExc_ValueError, "copy_reads(): a negative seq, or not whole lines");
        return NULL;
    }
    PyObject *out = NULL;
    Packer k;
    /* An envelope is about as long as its COPY line plus the source block:
     * room for most chunks at once. */
    if (packer_init(&k, self, stamp, n * 2, 1024, "copy_reads") != OK) {
        goto done;
    }
    for (Py_ssize_t pos = 0; pos < n; seq++) {
        const char *line = p + pos;
        const char *newline = memchr(line, '\n', (size_t)(n - pos));
        Py_ssize_t len = newline - line;
        pos += len + 1;
        int r = copy_fields(self, line, len, k.at, k.size, k.nulls);
        if (r == OK) {
            r = packer_read(&k, self, op, seq);
        }
        if (r == OK) {
            if (packer_pack(&k, self) != OK) {
                goto done;
            }
            continue;
        }
        if (r == FAIL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                goto done; /* KeyboardInterrupt, SystemExit: not the data's fault */
            }
            PyErr_Clear(); /* Python redoes the row and raises with its context */
        }
        PyObject *text = PyBytes_FromStringAndSize(line, len);
        PyObject *number = text != NULL ? PyLong_FromLongLong(seq) : NULL;
        PyObject *pair = number != NULL ? PyObject_CallFunctionObjArgs(slow, text, number, NULL)
                                        : NULL;
        Py_XDECREF(text);
        Py_XDECREF(number);
        if (pair == NULL) {
            goto done;
        }
        PyObject *key = PyTuple_CheckExact(pair) && PyTuple_GET_SIZE(pair) == 2
                            ? PyTuple_GET_ITEM(pair, 0) : NULL;
        PyObject *value = key != NULL ? PyTuple_GET_ITEM(pair, 1) : NULL;
        if (key == NULL || !PyBytes_CheckExact(value) || (key != Py_None && !PyBytes_CheckExact(key))) {
            Py_DECREF(pair);
            PyErr_SetString(PyExc_TypeError, "copy_reads(): slow() must return (key, value)");
            goto done;
        }
        r = pack_read(&k.blob, &k.index, key == Py_None ? NULL : PyBytes_AS_STRING(key),
                      key == Py_None ? 0 : PyBytes_GET_SIZE(key), PyBytes_AS_STRING(value),
                      PyBytes_GET_SIZE(value));
        Py_DECREF(pair);
        if (r != OK) {
            goto done;
        }
    }
    out = packer_finish(&k, NULL, 0, 0);

done:
    packer_free(&k);
    return out;
}

/* ------------------------------------------------------------- stream Inserts */

static inline uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | (uint32_t)p[3];
}

/* Split one pgoutput Insert of a plain transaction ('I', relation id, 'N',
 * TupleData; no xid, which only streamed transactions carry) into this
 * table's fields: OK, or SLOW for anything else — another message or
 * relation, a column count that does not match, a kind other than text or
 * null ('b', 'u'), a truncated or overlong message. Nothing is raised here:
 * the caller stops its run at that message and the Python decoder takes it,
 * raising the ProtocolError with its offset where the bytes are wrong. */
static int insert_fields(RowCodec *self, const unsigned char *p, Py_ssize_t n, uint32_t relation_id,
                         const char **at, Py_ssize_t *size, unsigned char *nulls) {
    if (n < 8 || p[0] != 'I' || be32(p + 1) != relation_id || p[5] != 'N') {
        return SLOW;
    }
    Py_ssize_t columns = ((Py_ssize_t)p[6] << 8) | (Py_ssize_t)p[7];
    if (columns != self->count) {
        return SLOW;
    }
    Py_ssize_t pos = 8;
    for (Py_ssize_t i = 0; i < columns; i++) {
        if (pos >= n) {
            return SLOW;
        }
        unsigned char kind = p[pos++];
        if (kind == 'n') {
            nulls[i] = 1;
            continue;
        }
        if (kind != 't' || n - pos < 4) {
            return SLOW;
        }
        uint32_t len = be32(p + pos);
        pos += 4;
        if (len > (uint32_t)INT32_MAX || (Py_ssize_t)len > n - pos) {
            return SLOW;
        }
        nulls[i] = 0;
        at[i] = (const char *)p + pos;
        size[i] = (Py_ssize_t)len;
        pos += (Py_ssize_t)len;
    }
    return pos == n ? OK : SLOW;
}

/* insert_run(batch, start, relation_id, op, stamp, seq) -> (blob, index, end, size):
 * the Inserts of batch[start:] (a list of pgoutput messages of one plain
 * transaction) for relation_id, as consecutive changes seq, seq + 1, ...,
 * packed as copy_reads packs them (key if any, then value; two int32 per
 * change). It stops at `end`, the first message that is not such an Insert
 * or that the C encoder leaves to Python (a value a converter refuses, a
 * null where none may be): that one goes through the decoder and
 * TableEncoder.change, which raise with their context. `size` is the bytes
 * of the messages taken. */
static PyObject *codec_insert_run(RowCodec *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 6 || !PyList_CheckExact(args[0]) || !PyBytes_CheckExact(args[3])) {
        PyErr_SetString(PyExc_TypeError, "insert_run(batch: list, start, relation_id, op: bytes, stamp, seq)");
        return NULL;
    }
    PyObject *batch = args[0], *op = args[3];
    Py_ssize_t start = PyLong_AsSsize_t(args[1]);
    if (start == -1 && PyErr_Occurred()) {
        return NULL;
    }
    unsigned long relation_id = PyLong_AsUnsignedLong(args[2]);
    if (relation_id == (unsigned long)-1 && PyErr_Occurred()) {
        return NULL;
    }
    long long seq = PyLong_AsLongLong(args[5]);
    if (seq == -1 && PyErr_Occurred()) {
        return NULL;
    }
    Py_ssize_t count = PyList_GET_SIZE(batch);
    if (seq < 0 || start < 0 || start > count || relation_id > UINT32_MAX) {
        PyErr_SetString(PyExc_ValueError, "insert_run(): a negative seq, start out of range, or a bad relation id");
        return NULL;
    }
    PyObject *out = NULL;
    Py_ssize_t end = start, taken_bytes = 0;
    Packer k;
    if (packer_init(&k, self, args[4], 4096, 256, "insert_run") != OK) {
        goto done;
    }
    for (; end < count; end++, seq++) {
        PyObject *payload = PyList_GET_ITEM(batch, end);
        if (!PyBytes_CheckExact(payload)) {
            break;
        }
        Py_ssize_t n = PyBytes_GET_SIZE(payload);
        if (insert_fields(self, (const unsigned char *)PyBytes_AS_STRING(payload), n,
                          (uint32_t)relation_id, k.at, k.size, k.nulls) != OK) {
            break;
        }
        int r = packer_read(&k, self, op, seq);
        if (r == FAIL) {
            if (!PyErr_ExceptionMatches(PyExc_Exception)) {
                goto done; /* KeyboardInterrupt, SystemExit: not the data's fault */
            }
            PyErr_Clear(); /* the Python path redoes the change and raises with its context */
            break;
        }
        if (r != OK) {
            break;
        }
        if (packer_pack(&k, self) != OK) {
            goto done;
        }
        taken_bytes += n;
    }
    out = packer_finish(&k, "(OOnn)", end, taken_bytes);

done:
    packer_free(&k);
    return out;
}

static PyMethodDef codec_methods[] = {
    {"change", (PyCFunction)(void (*)(void))codec_change, METH_FASTCALL,
     "change(op, before, after, stamp, seq) -> (key or None, value), as TableEncoder.change"},
    {"insert_run", (PyCFunction)(void (*)(void))codec_insert_run, METH_FASTCALL,
     "insert_run(batch, start, relation_id, op, stamp, seq) -> (blob, index, end, size): "
     "a plain transaction's Inserts of one table, packed"},
    {"copy_reads", (PyCFunction)(void (*)(void))codec_copy_reads, METH_FASTCALL,
     "copy_reads(data, op, stamp, seq, slow) -> (blob, index): the reads packed"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject RowCodecType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cdcd.envelope._native.RowCodec",
    .tp_basicsize = sizeof(RowCodec),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "One table version's change encoder (see the module docstring).",
    .tp_new = codec_new,
    .tp_dealloc = (destructor)codec_dealloc,
    .tp_traverse = (traverseproc)codec_traverse,
    .tp_clear = (inquiry)codec_clear,
    .tp_methods = codec_methods,
};

/* ------------------------------------------------------------------ module */

/* encode_value(kind, value, precision, scale) -> bytes or None: one value through
 * the C parser alone (None where it hands over to the converter); for tests. */
static PyObject *module_encode_value(PyObject *module, PyObject *args) {
    int kind, precision, scale;
    PyObject *value;
    if (!PyArg_ParseTuple(args, "iSii:encode_value", &kind, &value, &precision, &scale)) {
        return NULL;
    }
    if (kind < 1 || kind > K_LAST) {
        Py_RETURN_NONE;
    }
    Column c = {0};
    c.kind = kind;
    c.scale = scale;
    c.limit = precision <= 18 ? POW10[precision] : 0;
    if (kind == K_DECIMAL && (scale < 0 || scale > 18 || precision < 1)) {
        Py_RETURN_NONE;
    }
    c.convert = Py_None; /* never called: SLOW is reported instead */
    Buffer b;
    buffer_init(&b);
    const char *p = PyBytes_AS_STRING(value);
    Py_ssize_t n = PyBytes_GET_SIZE(value);
    int64_t v;
    int r;
    switch (kind) {
    case K_INT:
        r = parse_int(p, n, &v);
        break;
    case K_BOOL:
        r = n == 1 && (p[0] == 't' || p[0] == 'f') ? OK : SLOW;
        break;
    case K_DECIMAL:
        r = parse_decimal(p, n, scale, &v);
        if (r == OK && c.limit != 0 && (v >= c.limit || v <= -c.limit)) {
            r = SLOW;
        }
        break;
    case K_TIMESTAMPTZ:
    case K_TIMESTAMP:
        r = parse_timestamp(p, n, kind == K_TIMESTAMPTZ, &v);
        break;
    case K_DATE:
        r = parse_date(p, n, &v);
        break;
    default:
        r = OK;
        break;
    }
    if (r != OK) {
        Py_RETURN_NONE;
    }
    if (put_value(&b, &c, value) != OK) {
        buffer_free(&b);
        return NULL;
    }
    PyObject *out = PyBytes_FromStringAndSize(b.data, b.size);
    buffer_free(&b);
    return out;
}

/* ------------------------------------------------------------------ stamps */

/* Set by configure_stamp(): the TxnStamp class and the Python make_stamp. */
static PyTypeObject *stamp_type = NULL;
static PyObject *stamp_fallback = NULL;

static PyObject *bytes_of(Buffer *b) {
    return PyBytes_FromStringAndSize(b->data, b->size);
}

/* make_stamp(xid, lsn, commit_ts_ms, snapshot=False, now_ms=None) -> TxnStamp, as
 * cdcd.envelope.encoder.make_stamp_python; values outside an Avro long go to it. */
static PyObject *module_make_stamp(PyObject *module, PyObject *args, PyObject *kwargs) {
    PyObject *xid, *lsn, *commit, *snapshot = Py_False, *now = Py_None;
    static char *kwlist[] = {"xid", "lsn", "commit_ts_ms", "snapshot", "now_ms", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OOO|OO:make_stamp", kwlist, &xid, &lsn,
                                     &commit, &snapshot, &now)) {
        return NULL;
    }
    if (stamp_type == NULL || stamp_fallback == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure_stamp() was not called");
        return NULL;
    }
    int overflow = 0;
    long long x = PyLong_Check(xid) ? PyLong_AsLongLongAndOverflow(xid, &overflow) : 0;
    long long l = !overflow && PyLong_Check(lsn) ? PyLong_AsLongLongAndOverflow(lsn, &overflow) : 0;
    long long c = !overflow && PyLong_Check(commit) ? PyLong_AsLongLongAndOverflow(commit, &overflow) : 0;
    long long n = 0;
    if (!overflow && now != Py_None) {
        n = PyLong_Check(now) ? PyLong_AsLongLongAndOverflow(now, &overflow) : 0;
    } else if (!overflow) {
        struct timespec ts;
        clock_gettime(CLOCK_REALTIME, &ts); /* time.time_ns() // 1_000_000 */
        n = (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
    }
    if (PyErr_Occurred()) {
        return NULL;
    }
    if (overflow || !PyLong_Check(xid) || !PyLong_Check(lsn) || !PyLong_Check(commit) ||
        (now != Py_None && !PyLong_Check(now)) || l < 0 || (snapshot != Py_True && snapshot != Py_False)) {
        /* The reference raises, or handles what this does not. */
        return PyObject_Call(stamp_fallback, args, kwargs);
    }
    char header[32];
    int header_len = snprintf(header, sizeof header, "%llX/%08llX",
                              (unsigned long long)l >> 32, (unsigned long long)l & 0xFFFFFFFFULL);
    Buffer ts_ms, txid_lsn, tail;
    buffer_init(&ts_ms);
    buffer_init(&txid_lsn);
    buffer_init(&tail);
    PyObject *items[8] = {NULL};
    if (buffer_long(&ts_ms, n) == 0 && buffer_long(&txid_lsn, x) == 0 &&
        buffer_long(&txid_lsn, l) == 0 && buffer_long(&tail, c) == 0 &&
        buffer_byte(&tail, snapshot == Py_True ? 1 : 0) == 0) {
        Py_INCREF(xid);
        items[0] = xid;
        Py_INCREF(lsn);
        items[1] = lsn;
        Py_INCREF(commit);
        items[2] = commit;
        Py_INCREF(snapshot);
        items[3] = snapshot;
        items[4] = PyBytes_FromStringAndSize(header, header_len);
        items[5] = bytes_of(&ts_ms);
        items[6] = bytes_of(&txid_lsn);
        items[7] = bytes_of(&tail);
    }
    buffer_free(&ts_ms);
    buffer_free(&txid_lsn);
    buffer_free(&tail);
    PyObject *fields = NULL, *result = NULL;
    int complete = 1;
    for (int i = 0; i < 8; i++) {
        complete &= items[i] != NULL;
    }
    if (complete) {
        fields = PyTuple_New(8);
    }
    if (fields != NULL) {
        for (int i = 0; i < 8; i++) {
            PyTuple_SET_ITEM(fields, i, items[i]);
            items[i] = NULL;
        }
        PyObject *call_args = PyTuple_Pack(1, fields);
        if (call_args != NULL) {
            /* tuple.__new__(TxnStamp, fields): what the NamedTuple's __new__ does. */
            result = PyTuple_Type.tp_new(stamp_type, call_args, NULL);
            Py_DECREF(call_args);
            if (result != NULL && PyObject_GC_IsTracked(result)) {
                PyObject_GC_UnTrack(result); /* ints, bytes and a bool */
            }
        }
        Py_DECREF(fields);
    }
    for (int i = 0; i < 8; i++) {
        Py_XDECREF(items[i]);
    }
    return result;
}

static PyObject *module_configure_stamp(PyObject *module, PyObject *args) {
    PyObject *type, *fallback;
    if (!PyArg_ParseTuple(args, "O!O:configure_stamp", &PyType_Type, &type, &fallback)) {
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)type, &PyTuple_Type) || !PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "configure_stamp(tuple subclass, callable)");
        return NULL;
    }
    Py_INCREF(type);
    Py_XDECREF(stamp_type);
    stamp_type = (PyTypeObject *)type;
    Py_INCREF(fallback);
    Py_XDECREF(stamp_fallback);
    stamp_fallback = fallback;
    Py_RETURN_NONE;
}

/* packed_start(index, i) -> where read i starts in the blob of packed reads
 * (cdcd.envelope.rowcode.PackedReads): the sum of the lengths before it, a
 * key of -1 (none) counting 0. The producer asks for the one read a full
 * queue stopped at; summing in Python made a generator step per read. */
static PyObject *module_packed_start(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 2 || !PyBytes_Check(args[0])) {
        PyErr_SetString(PyExc_TypeError, "packed_start(index: bytes, i: int)");
        return NULL;
    }
    Py_ssize_t i = PyLong_AsSsize_t(args[1]);
    if (i == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t count = PyBytes_GET_SIZE(args[0]) / (Py_ssize_t)(2 * sizeof(int32_t));
    if (i < 0 || i > count) {
        PyErr_SetString(PyExc_IndexError, "packed_start(): read index out of range");
        return NULL;
    }
    const char *index = PyBytes_AS_STRING(args[0]);
    long long start = 0;
    for (Py_ssize_t k = 0; k < i; k++) {
        int32_t lengths[2];
        memcpy(lengths, index + k * (Py_ssize_t)sizeof lengths, sizeof lengths);
        start += (lengths[0] > 0 ? lengths[0] : 0) + (long long)lengths[1];
    }
    return PyLong_FromLongLong(start);
}

static PyMethodDef module_methods[] = {
    {"packed_start", (PyCFunction)(void (*)(void))module_packed_start, METH_FASTCALL,
     "packed_start(index, i) -> the offset of packed read i in its blob"},
    {"encode_value", module_encode_value, METH_VARARGS,
     "encode_value(kind, value, precision, scale) -> Avro bytes, or None where C hands over"},
    {"make_stamp", (PyCFunction)(void (*)(void))module_make_stamp, METH_VARARGS | METH_KEYWORDS,
     "make_stamp(xid, lsn, commit_ts_ms, snapshot=False, now_ms=None) -> TxnStamp"},
    {"configure_stamp", module_configure_stamp, METH_VARARGS,
     "configure_stamp(TxnStamp, make_stamp_python): what make_stamp builds and falls back to"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cdcd.envelope._native",
    .m_doc = "Compiled change encoder; cdcd.envelope.encoder is the reference.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&RowCodecType) < 0) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&RowCodecType);
    if (PyModule_AddObject(module, "RowCodec", (PyObject *)&RowCodecType) < 0 ||
        PyModule_AddStringConstant(module, "SOURCE_SHA256", CDCD_NATIVE_SOURCE) < 0 ||
        PyModule_AddIntConstant(module, "K_OTHER", K_OTHER) < 0 ||
        PyModule_AddIntConstant(module, "K_STRING", K_STRING) < 0 ||
        PyModule_AddIntConstant(module, "K_INT", K_INT) < 0 ||
        PyModule_AddIntConstant(module, "K_BOOL", K_BOOL) < 0 ||
        PyModule_AddIntConstant(module, "K_DECIMAL", K_DECIMAL) < 0 ||
        PyModule_AddIntConstant(module, "K_TIMESTAMPTZ", K_TIMESTAMPTZ) < 0 ||
        PyModule_AddIntConstant(module, "K_TIMESTAMP", K_TIMESTAMP) < 0 ||
        PyModule_AddIntConstant(module, "K_DATE", K_DATE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
