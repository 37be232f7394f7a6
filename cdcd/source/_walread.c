/* cdcd.source._walread: the walsender's messages read in batches, straight from libpq.
 *
 * Why: psycopg2's read_message() returns one XLogData message per call. Each
 * call reads the clock twice (gettimeofday, for a status interval cdcd does
 * not use) and builds a ReplicationMessage through a Python type call, which
 * the session then unwraps to its payload. That is 1.2 calls per row of a
 * typical stream, and a measurable share of the session thread's time. This
 * module runs the same libpq calls on the same connection (psycopg2's PGconn,
 * connection.pgconn_ptr, and the libpq psycopg2 loaded: load() opens
 * psycopg2's extension module, whose dlsym finds it) and returns a batch of
 * payloads as bytes.
 *
 * read(pgconn, limit) -> (payloads, data_start, wal_end, reply_requested), or
 * ("error", sqlstate, message):
 * - payloads: up to limit XLogData payloads ('w' messages), in order. Fewer
 *   means the socket is drained: like psycopg2, it reads the socket
 *   (PQconsumeInput) only when libpq's buffer holds no whole message, and
 *   stops when a read brought none;
 * - data_start: the WAL start of the last payload (0 when none);
 * - wal_end: the server's sent position from the last data or keepalive
 *   message of the batch (0 when there was none);
 * - reply_requested: a keepalive ('k') of the batch asked for a reply. Unlike
 *   psycopg2, which answers it with its own positions, nothing is sent here:
 *   the caller answers at once with cdcd's (cdcd.source.feedback).
 * A failure returns the error tuple (sqlstate "" for a connection-level
 * error) and the caller raises the matching psycopg2 error; messages read
 * before it in the batch are dropped (the session then restarts from the
 * slot's confirmed position, as after psycopg2's exception). When the server
 * ends the stream without an error, the batch returns what it read; the next
 * call fails with libpq's "no COPY in progress", as psycopg2's would.
 *
 * It must run where psycopg2's read_message would: on the thread that owns
 * the replication connection, after START_REPLICATION.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <string.h>

#ifndef CDCD_NATIVE_SOURCE
#define CDCD_NATIVE_SOURCE ""
#endif

/* libpq's declarations, for the few functions used (its ABI is stable since 7.4). */
typedef struct pg_conn PGconn;
typedef struct pg_result PGresult;
enum { PGRES_FATAL_ERROR = 7 };
enum { PG_DIAG_SQLSTATE = 'C' };

static int (*pq_get_copy_data)(PGconn *, char **, int);
static int (*pq_consume_input)(PGconn *);
static void (*pq_freemem)(void *);
static PGresult *(*pq_get_result)(PGconn *);
static int (*pq_result_status)(const PGresult *);
static char *(*pq_result_error_field)(const PGresult *, int);
static char *(*pq_result_error_message)(const PGresult *);
static void (*pq_clear)(PGresult *);
static char *(*pq_error_message)(const PGconn *);
static void *libpq_handle;

/* XLogData: 'w', dataStart, walEnd, sendTime (8 bytes each), then the payload. */
#define DATA_HEADER (1 + 8 + 8 + 8)
/* Primary keepalive: 'k', walEnd, sendTime (8 bytes each), replyRequested (1 byte). */
#define KEEPALIVE_HEADER (1 + 8 + 8)

static uint64_t big_endian64(const char *p) {
    const unsigned char *u = (const unsigned char *)p;
    uint64_t v = 0;
    for (int i = 0; i < 8; i++)
        v = (v << 8) | u[i];
    return v;
}

static PyObject *error_tuple(const char *sqlstate, const char *message) {
    return Py_BuildValue("(sss)", "error", sqlstate ? sqlstate : "", message ? message : "unknown libpq error");
}

static PyObject *connection_error(PGconn *conn) {
    return error_tuple("", pq_error_message(conn));
}

/* The stream ended (PQgetCopyData -1): the server's error, or NULL when it ended cleanly. */
static PyObject *stream_end(PGconn *conn) {
    PGresult *result;
    Py_BEGIN_ALLOW_THREADS;
    result = pq_get_result(conn);
    Py_END_ALLOW_THREADS;
    if (!result)
        return NULL;
    PyObject *error = NULL;
    if (pq_result_status(result) == PGRES_FATAL_ERROR) {
        const char *text = pq_result_error_message(result);
        error = error_tuple(pq_result_error_field(result, PG_DIAG_SQLSTATE),
                            text && *text ? text : pq_error_message(conn));
    }
    pq_clear(result);
    return error;
}

static PyObject *read_batch(PyObject *module, PyObject *args) {
    unsigned long long address;
    Py_ssize_t limit;
    if (!PyArg_ParseTuple(args, "Kn:read", &address, &limit))
        return NULL;
    if (!libpq_handle) {
        PyErr_SetString(PyExc_RuntimeError, "libpq is not loaded: call load() first");
        return NULL;
    }
    if (!address || limit < 1) {
        PyErr_SetString(PyExc_ValueError, "read(): a PGconn address and limit >= 1");
        return NULL;
    }
    PGconn *conn = (PGconn *)(uintptr_t)address;
    PyObject *payloads = PyList_New(0);
    if (!payloads)
        return NULL;
    uint64_t data_start = 0, wal_end = 0;
    int reply = 0, tried_socket = 0;
    PyObject *failure = NULL;

    while (PyList_GET_SIZE(payloads) < limit) {
        char *buffer = NULL;
        int len = pq_get_copy_data(conn, &buffer, 1 /* async: never blocks */);
        if (len == 0) {
            /* No whole message buffered: read the socket once; stop if that brought none. */
            if (tried_socket)
                break;
            int ok;
            Py_BEGIN_ALLOW_THREADS;
            ok = pq_consume_input(conn);
            Py_END_ALLOW_THREADS;
            if (!ok) {
                failure = connection_error(conn);
                break;
            }
            tried_socket = 1;
            continue;
        }
        if (len == -2) {
            failure = connection_error(conn);
            break;
        }
        if (len == -1) {
            failure = stream_end(conn);
            break;
        }
        tried_socket = 0;
        if (buffer[0] == 'w' && len > DATA_HEADER) {
            data_start = big_endian64(buffer + 1);
            wal_end = big_endian64(buffer + 9);
            PyObject *payload = PyBytes_FromStringAndSize(buffer + DATA_HEADER, len - DATA_HEADER);
            int appended = payload ? PyList_Append(payloads, payload) : -1;
            Py_XDECREF(payload);
            pq_freemem(buffer);
            if (appended < 0) {
                Py_DECREF(payloads);
                return NULL;
            }
        } else if (buffer[0] == 'k' && len > KEEPALIVE_HEADER) {
            wal_end = big_endian64(buffer + 1);
            reply |= buffer[KEEPALIVE_HEADER] != 0;
            pq_freemem(buffer);
        } else {
            char message[96];
            snprintf(message, sizeof message,
                     "unrecognized or truncated replication message: type 0x%02x, %d bytes",
                     (unsigned char)buffer[0], len);
            pq_freemem(buffer);
            failure = error_tuple("", message);
            break;
        }
    }
    if (failure) {
        Py_DECREF(payloads);
        return failure;
    }
    if (PyErr_Occurred()) { /* only from error_tuple's Py_BuildValue */
        Py_DECREF(payloads);
        return NULL;
    }
    return Py_BuildValue("(NKKO)", payloads, (unsigned long long)data_start, (unsigned long long)wal_end,
                         reply ? Py_True : Py_False);
}

static PyObject *load(PyObject *module, PyObject *args) {
    const char *path;
    if (!PyArg_ParseTuple(args, "s:load", &path))
        return NULL;
    if (libpq_handle)
        Py_RETURN_NONE;
    void *handle = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!handle) {
        PyErr_Format(PyExc_OSError, "cannot open %s: %s", path, dlerror());
        return NULL;
    }
#define RESOLVE(pointer, name)                                                                     \
    *(void **)&pointer = dlsym(handle, name);                                                      \
    if (!pointer) {                                                                                \
        PyErr_Format(PyExc_OSError, "%s: no %s", path, name);                                      \
        dlclose(handle);                                                                           \
        return NULL;                                                                               \
    }
    RESOLVE(pq_get_copy_data, "PQgetCopyData")
    RESOLVE(pq_consume_input, "PQconsumeInput")
    RESOLVE(pq_freemem, "PQfreemem")
    RESOLVE(pq_get_result, "PQgetResult")
    RESOLVE(pq_result_status, "PQresultStatus")
    RESOLVE(pq_result_error_field, "PQresultErrorField")
    RESOLVE(pq_result_error_message, "PQresultErrorMessage")
    RESOLVE(pq_clear, "PQclear")
    RESOLVE(pq_error_message, "PQerrorMessage")
#undef RESOLVE
    libpq_handle = handle;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path): find libpq through the library at path (psycopg2's extension)"},
    {"read", read_batch, METH_VARARGS,
     "read(pgconn, limit) -> (payloads, data_start, wal_end, reply_requested), or ('error', sqlstate, message)"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "cdcd.source._walread",
                                        "The walsender's messages read in batches from libpq.", -1, methods};

PyMODINIT_FUNC PyInit__walread(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module && PyModule_AddStringConstant(module, "SOURCE_SHA256", CDCD_NATIVE_SOURCE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
