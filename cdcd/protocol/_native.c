/* cdcd.protocol._native: the pgoutput messages of every transaction, parsed in C.
 *
 * The compiled twin of cdcd.protocol.decoder for the messages nearly every
 * payload is, outside stream blocks: Begin, Commit, Insert, Update and
 * Delete. It builds the very same message objects (the frozen dataclasses of
 * cdcd.protocol.messages, their slots filled directly, as
 * messages.fast_constructor does in Python). Anything else, and anything
 * irregular (a truncated message, an unknown TupleData kind, trailing bytes,
 * a message inside a stream block), goes to the Python decoder, which is the
 * reference and raises the ProtocolError with its offset. The tests compare
 * both on every message kind and on garbage (tests/protocol/test_native.py).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <structmember.h>
#include <stdint.h>
#include <string.h>

#ifndef CDCD_NATIVE_SOURCE
#define CDCD_NATIVE_SOURCE ""
#endif

/* MaxTupleAttributeNumber, as cdcd.protocol.decoder.MAX_COLUMNS. */
#define MAX_COLUMNS 1664

enum { C_BEGIN, C_COMMIT, C_INSERT, C_UPDATE, C_DELETE, C_TUPLE, C_COUNT };

typedef struct {
    PyTypeObject *type;
    Py_ssize_t nfields;
    Py_ssize_t offsets[8];
} MessageClass;

/* Set by configure(): the message classes and the Lsn type. */
static MessageClass classes[C_COUNT];
static PyTypeObject *lsn_type = NULL;
static PyObject *str_K = NULL, *str_O = NULL;

static const Py_ssize_t expected_fields[C_COUNT] = {3, 4, 3, 5, 4, 2};

/* ------------------------------------------------------------------ helpers */

static inline uint32_t be32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

static inline uint64_t be64(const unsigned char *p) {
    return ((uint64_t)be32(p) << 32) | be32(p + 4);
}

/* A new instance of class `which` with its fields set from `values` (references stolen). */
static PyObject *build(int which, PyObject **values) {
    MessageClass *c = &classes[which];
    PyObject *obj = c->type->tp_alloc(c->type, 0);
    if (obj == NULL) {
        for (Py_ssize_t i = 0; i < c->nfields; i++) {
            Py_XDECREF(values[i]);
        }
        return NULL;
    }
    for (Py_ssize_t i = 0; i < c->nfields; i++) {
        *(PyObject **)((char *)obj + c->offsets[i]) = values[i];
    }
    /* Frozen, and holding only ints, strings, bytes, None and other such
     * messages: no cycle can run through it, so the cyclic GC need not scan it
     * (every row makes several; CPython untracks atomic tuples the same way). */
    if (PyObject_GC_IsTracked(obj)) {
        PyObject_GC_UnTrack(obj);
    }
    return obj;
}

static PyObject *new_lsn(uint64_t value) {
    PyObject *number = PyLong_FromUnsignedLongLong(value);
    if (number == NULL) {
        return NULL;
    }
    PyObject *args = PyTuple_Pack(1, number);
    Py_DECREF(number);
    if (args == NULL) {
        return NULL;
    }
    /* int.__new__(Lsn, value): the uint64 is in range, so Lsn.__new__'s check is not needed. */
    PyObject *lsn = PyLong_Type.tp_new(lsn_type, args, NULL);
    Py_DECREF(args);
    return lsn;
}

#define NOT_MINE ((PyObject *)1) /* sentinel: let the Python decoder take it */

/* TupleData at buf[*pos]: the object, *pos moved past it; NOT_MINE if irregular. */
static PyObject *tuple_data(const unsigned char *buf, Py_ssize_t size, Py_ssize_t *pos) {
    Py_ssize_t p = *pos;
    if (p + 2 > size) {
        return NOT_MINE;
    }
    Py_ssize_t count = ((Py_ssize_t)buf[p] << 8) | buf[p + 1];
    p += 2;
    if (count > MAX_COLUMNS || count > size - p) {
        return NOT_MINE;
    }
    char kinds[MAX_COLUMNS];
    PyObject *values = PyTuple_New(count);
    if (values == NULL) {
        return NULL;
    }
    for (Py_ssize_t i = 0; i < count; i++) {
        if (p >= size) {
            Py_DECREF(values);
            return NOT_MINE;
        }
        unsigned char kind = buf[p];
        kinds[i] = (char)kind;
        if (kind == 't' || kind == 'b') {
            if (p + 5 > size) {
                Py_DECREF(values);
                return NOT_MINE;
            }
            uint32_t length = be32(buf + p + 1);
            if ((uint64_t)length > (uint64_t)(size - p - 5)) {
                Py_DECREF(values); /* includes a negative Int32 length */
                return NOT_MINE;
            }
            PyObject *value = PyBytes_FromStringAndSize((const char *)buf + p + 5, (Py_ssize_t)length);
            if (value == NULL) {
                Py_DECREF(values);
                return NULL;
            }
            PyTuple_SET_ITEM(values, i, value);
            p += 5 + (Py_ssize_t)length;
        } else if (kind == 'n' || kind == 'u') {
            Py_INCREF(Py_None);
            PyTuple_SET_ITEM(values, i, Py_None);
            p += 1;
        } else {
            Py_DECREF(values);
            return NOT_MINE;
        }
    }
    PyObject_GC_UnTrack(values); /* bytes and None only */
    PyObject *kinds_bytes = PyBytes_FromStringAndSize(kinds, count);
    if (kinds_bytes == NULL) {
        Py_DECREF(values);
        return NULL;
    }
    PyObject *fields[2] = {kinds_bytes, values};
    PyObject *data = build(C_TUPLE, fields);
    if (data != NULL) {
        *pos = p;
    }
    return data;
}

/* ------------------------------------------------------------------ messages */

static PyObject *parse_begin(const unsigned char *buf, Py_ssize_t size) {
    if (size != 1 + 20) {
        return NOT_MINE;
    }
    PyObject *fields[3] = {new_lsn(be64(buf + 1)),
                           PyLong_FromLongLong((int64_t)be64(buf + 9)),
                           PyLong_FromUnsignedLong(be32(buf + 17))};
    if (fields[0] == NULL || fields[1] == NULL || fields[2] == NULL) {
        Py_XDECREF(fields[0]);
        Py_XDECREF(fields[1]);
        Py_XDECREF(fields[2]);
        return NULL;
    }
    return build(C_BEGIN, fields);
}

static PyObject *parse_commit(const unsigned char *buf, Py_ssize_t size) {
    if (size != 1 + 25) {
        return NOT_MINE;
    }
    PyObject *fields[4] = {PyLong_FromLong(buf[1]), new_lsn(be64(buf + 2)), new_lsn(be64(buf + 10)),
                           PyLong_FromLongLong((int64_t)be64(buf + 18))};
    for (int i = 0; i < 4; i++) {
        if (fields[i] == NULL) {
            for (int j = 0; j < 4; j++) {
                Py_XDECREF(fields[j]);
            }
            return NULL;
        }
    }
    return build(C_COMMIT, fields);
}

/* Insert, Update or Delete outside a stream block (no xid). */
static PyObject *parse_row(const unsigned char *buf, Py_ssize_t size) {
    unsigned char tag = buf[0];
    if (size < 1 + 5) {
        return NOT_MINE;
    }
    uint32_t relation_id = be32(buf + 1);
    Py_ssize_t pos = 5;
    unsigned char part = buf[pos];
    PyObject *old = NULL, *new = NULL, *old_kind = NULL;
    if (tag == 'I') {
        if (part != 'N') {
            return NOT_MINE;
        }
        pos += 1;
        new = tuple_data(buf, size, &pos);
        if (new == NULL || new == NOT_MINE) {
            return new;
        }
    } else if (tag == 'U') {
        if (part == 'K' || part == 'O') {
            pos += 1;
            old = tuple_data(buf, size, &pos);
            if (old == NULL || old == NOT_MINE) {
                return old;
            }
            if (pos >= size) {
                Py_DECREF(old);
                return NOT_MINE;
            }
            old_kind = part == 'K' ? str_K : str_O;
            part = buf[pos];
        }
        if (part != 'N') {
            Py_XDECREF(old);
            return NOT_MINE;
        }
        pos += 1;
        new = tuple_data(buf, size, &pos);
        if (new == NULL || new == NOT_MINE) {
            Py_XDECREF(old);
            return new;
        }
    } else { /* 'D' */
        if (part != 'K' && part != 'O') {
            return NOT_MINE;
        }
        old_kind = part == 'K' ? str_K : str_O;
        pos += 1;
        old = tuple_data(buf, size, &pos);
        if (old == NULL || old == NOT_MINE) {
            return old;
        }
    }
    if (pos != size) { /* trailing bytes: the Python decoder names them */
        Py_XDECREF(old);
        Py_XDECREF(new);
        return NOT_MINE;
    }
    PyObject *relid = PyLong_FromUnsignedLong(relation_id);
    if (relid == NULL) {
        Py_XDECREF(old);
        Py_XDECREF(new);
        return NULL;
    }
    Py_INCREF(Py_None);
    if (tag == 'I') {
        PyObject *fields[3] = {Py_None, relid, new};
        return build(C_INSERT, fields);
    }
    if (old_kind == NULL) {
        old_kind = Py_None;
        old = Py_None;
        Py_INCREF(Py_None);
    }
    Py_INCREF(old_kind);
    if (tag == 'U') {
        PyObject *fields[5] = {Py_None, relid, old_kind, old, new};
        return build(C_UPDATE, fields);
    }
    PyObject *fields[4] = {Py_None, relid, old_kind, old};
    return build(C_DELETE, fields);
}

/* ------------------------------------------------------------------ the decoder */

typedef struct {
    PyObject_HEAD
    PyObject *owner; /* the PgOutputDecoder: its in_stream slot is read per message */
    Py_ssize_t in_stream_offset;
    PyObject *fallback; /* the Python decode(payload) */
    vectorcallfunc vectorcall;
} Decoder;

static int decoder_traverse(Decoder *self, visitproc visit, void *arg) {
    Py_VISIT(self->owner);
    Py_VISIT(self->fallback);
    return 0;
}

static int decoder_clear(Decoder *self) {
    Py_CLEAR(self->owner);
    Py_CLEAR(self->fallback);
    return 0;
}

static void decoder_dealloc(Decoder *self) {
    PyObject_GC_UnTrack(self);
    decoder_clear(self);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyObject *decoder_call(Decoder *self, PyObject *const *args, size_t nargsf, PyObject *kwnames) {
    Py_ssize_t nargs = PyVectorcall_NARGS(nargsf);
    if (nargs != 1 || kwnames != NULL) {
        PyErr_SetString(PyExc_TypeError, "decode() takes one payload");
        return NULL;
    }
    PyObject *payload = args[0];
    PyObject *result = NOT_MINE;
    PyObject *in_stream = self->owner == NULL
                              ? NULL
                              : *(PyObject **)((char *)self->owner + self->in_stream_offset);
    if (in_stream == Py_False && PyBytes_CheckExact(payload) && PyBytes_GET_SIZE(payload) > 0) {
        const unsigned char *buf = (const unsigned char *)PyBytes_AS_STRING(payload);
        Py_ssize_t size = PyBytes_GET_SIZE(payload);
        switch (buf[0]) {
        case 'I':
        case 'U':
        case 'D':
            result = parse_row(buf, size);
            break;
        case 'B':
            result = parse_begin(buf, size);
            break;
        case 'C':
            result = parse_commit(buf, size);
            break;
        default:
            break;
        }
    }
    if (result != NOT_MINE) {
        return result; /* a message, or NULL with an exception (out of memory) */
    }
    return PyObject_Vectorcall(self->fallback, args, 1, NULL);
}

/* Decoder(owner, fallback): calling it decodes one payload, like PgOutputDecoder.decode. */
/* The byte offset of the object slot `name` of `type`, or -1: with an exception set
 * when the attribute lookup failed, without one when it is not an object slot. */
static Py_ssize_t slot_offset(PyObject *type, PyObject *name) {
    PyObject *descr = PyObject_GetAttr(type, name);
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
    return offset;
}

static PyObject *decoder_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    PyObject *owner, *fallback;
    static char *kwlist[] = {"owner", "fallback", NULL};
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "OO:Decoder", kwlist, &owner, &fallback)) {
        return NULL;
    }
    if (lsn_type == NULL) {
        PyErr_SetString(PyExc_RuntimeError, "configure() was not called");
        return NULL;
    }
    if (!PyCallable_Check(fallback)) {
        PyErr_SetString(PyExc_TypeError, "fallback must be callable");
        return NULL;
    }
    PyObject *in_stream = PyUnicode_InternFromString("in_stream");
    if (in_stream == NULL) {
        return NULL;
    }
    Py_ssize_t offset = slot_offset((PyObject *)Py_TYPE(owner), in_stream);
    Py_DECREF(in_stream);
    if (offset < 0) {
        if (!PyErr_Occurred()) {
            PyErr_SetString(PyExc_TypeError, "owner.in_stream must be a slot");
        }
        return NULL;
    }
    Decoder *self = (Decoder *)type->tp_alloc(type, 0);
    if (self == NULL) {
        return NULL;
    }
    Py_INCREF(owner);
    self->owner = owner;
    self->in_stream_offset = offset;
    Py_INCREF(fallback);
    self->fallback = fallback;
    self->vectorcall = (vectorcallfunc)decoder_call;
    return (PyObject *)self;
}

static PyTypeObject DecoderType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "cdcd.protocol._native.Decoder",
    .tp_basicsize = sizeof(Decoder),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC | Py_TPFLAGS_HAVE_VECTORCALL,
    .tp_doc = "decode(payload) -> Message for one PgOutputDecoder (see the module docstring).",
    .tp_new = decoder_new,
    .tp_dealloc = (destructor)decoder_dealloc,
    .tp_traverse = (traverseproc)decoder_traverse,
    .tp_clear = (inquiry)decoder_clear,
    .tp_call = PyVectorcall_Call,
    .tp_vectorcall_offset = offsetof(Decoder, vectorcall),
};

/* ------------------------------------------------------------------ module */

/* configure(lsn_type, begin, commit, insert, update, delete, tuple_data): each message
 * class as (class, field names in constructor order). */
static PyObject *module_configure(PyObject *module, PyObject *args) {
    PyObject *lsn, *specs[C_COUNT];
    if (!PyArg_ParseTuple(args, "O!OOOOOO:configure", &PyType_Type, &lsn, &specs[C_BEGIN],
                          &specs[C_COMMIT], &specs[C_INSERT], &specs[C_UPDATE], &specs[C_DELETE],
                          &specs[C_TUPLE])) {
        return NULL;
    }
    if (!PyType_IsSubtype((PyTypeObject *)lsn, &PyLong_Type)) {
        PyErr_SetString(PyExc_TypeError, "lsn_type must subclass int");
        return NULL;
    }
    MessageClass configured[C_COUNT];
    for (int c = 0; c < C_COUNT; c++) {
        PyObject *type, *names;
        if (!PyArg_ParseTuple(specs[c], "O!O:message class", &PyType_Type, &type, &names)) {
            return NULL;
        }
        PyObject *seq = PySequence_Fast(names, "field names must be a sequence");
        if (seq == NULL) {
            return NULL;
        }
        Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
        if (n != expected_fields[c]) {
            Py_DECREF(seq);
            PyErr_Format(PyExc_ValueError, "%s has %zd fields, expected %zd",
                         ((PyTypeObject *)type)->tp_name, n, expected_fields[c]);
            return NULL;
        }
        configured[c].type = (PyTypeObject *)type;
        configured[c].nfields = n;
        for (Py_ssize_t i = 0; i < n; i++) {
            Py_ssize_t offset = slot_offset(type, PySequence_Fast_GET_ITEM(seq, i));
            if (offset < 0) {
                Py_DECREF(seq);
                if (!PyErr_Occurred()) {
                    PyErr_Format(PyExc_TypeError, "%s: field %zd is not a slot",
                                 ((PyTypeObject *)type)->tp_name, i);
                }
                return NULL;
            }
            configured[c].offsets[i] = offset;
        }
        Py_DECREF(seq);
    }
    for (int c = 0; c < C_COUNT; c++) {
        Py_INCREF(configured[c].type);
        Py_XDECREF(classes[c].type);
        classes[c] = configured[c];
    }
    Py_INCREF(lsn);
    Py_XDECREF(lsn_type);
    lsn_type = (PyTypeObject *)lsn;
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"configure", module_configure, METH_VARARGS,
     "configure(lsn_type, begin, commit, insert, update, delete, tuple_data): the classes built"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef native_module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "cdcd.protocol._native",
    .m_doc = "Compiled pgoutput parser; cdcd.protocol.decoder is the reference.",
    .m_size = -1,
    .m_methods = module_methods,
};

PyMODINIT_FUNC PyInit__native(void) {
    if (PyType_Ready(&DecoderType) < 0) {
        return NULL;
    }
    str_K = PyUnicode_InternFromString("K");
    str_O = PyUnicode_InternFromString("O");
    if (str_K == NULL || str_O == NULL) {
        return NULL;
    }
    PyObject *module = PyModule_Create(&native_module);
    if (module == NULL) {
        return NULL;
    }
    Py_INCREF(&DecoderType);
    if (PyModule_AddObject(module, "Decoder", (PyObject *)&DecoderType) < 0 ||
        PyModule_AddStringConstant(module, "SOURCE_SHA256", CDCD_NATIVE_SOURCE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
