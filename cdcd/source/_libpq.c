/* cdcd.source._libpq: libpq calls on psycopg2's own connection, for the two hot reads.
 *
 * Both functions take psycopg2's PGconn (connection.pgconn_ptr) and run libpq
 * functions of the very library psycopg2 loaded: load() opens psycopg2's
 * extension module, whose dlsym finds that libpq (a second copy of libpq could
 * not use psycopg2's PGconn).
 *
 * read(pgconn, limit): the replication stream, in batches.
 * copy_out(pgconn, sql, batch_rows, emit): COPY ... TO STDOUT, without the GIL.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#ifndef CDCD_NATIVE_SOURCE
#define CDCD_NATIVE_SOURCE ""
#endif

/* libpq's declarations, for the few functions used (its ABI is stable since 7.4). */
typedef struct pg_conn PGconn;
typedef struct pg_result PGresult;
typedef struct pg_cancel PGcancel;
enum { PGRES_COMMAND_OK = 1, PGRES_COPY_OUT = 3, PGRES_FATAL_ERROR = 7 };
enum { PG_DIAG_SQLSTATE = 'C' };

static int (*pq_send_query)(PGconn *, const char *);
static PGresult *(*pq_get_result)(PGconn *);
static int (*pq_result_status)(const PGresult *);
static char *(*pq_result_error_field)(const PGresult *, int);
static char *(*pq_result_error_message)(const PGresult *);
static void (*pq_clear)(PGresult *);
static int (*pq_get_copy_data)(PGconn *, char **, int);
static int (*pq_consume_input)(PGconn *);
static void (*pq_freemem)(void *);
static char *(*pq_error_message)(const PGconn *);
static PGcancel *(*pq_get_cancel)(PGconn *);
static int (*pq_cancel)(PGcancel *, char *, int);
static void (*pq_free_cancel)(PGcancel *);
static void *libpq_handle;

/* ---------------------------------------------------------------------------------------------- */
/* The replication stream: read(pgconn, limit).
 *
 * Why: psycopg2's read_message() returns one XLogData message per call. Each
 * call reads the clock twice (gettimeofday, for a status interval cdcd does
 * not use) and builds a ReplicationMessage through a Python type call, which
 * the session then unwraps to its payload. That is 1.2 calls per row of a
 * typical stream, and a measurable share of the session thread's time. This
 * runs the same libpq calls on the same connection and returns a batch of
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

/* ---------------------------------------------------------------------------------------------- */
/* COPY ... TO STDOUT: copy_out(pgconn, sql, batch_rows, emit).
 *
 * Why: psycopg2's copy_expert reads COPY output one row at a time
 * (PQgetCopyData) and for every row takes the GIL back to call the target's
 * write(). A snapshot reads COPY on a reader thread while the session thread
 * encodes and produces, holding the GIL: each of the reader's per-row
 * re-acquisitions then waits for it, and measured on the 1M-row orders table
 * the COPY took 1.86 s instead of 0.68 s next to one GIL-holding thread. This
 * runs the same libpq calls on the same connection with the GIL released for
 * a whole batch of rows, and takes it once per batch to hand the batch to
 * Python.
 *
 * copy_out(pgconn, sql, batch_rows, emit) -> rows: sends sql (a COPY ... TO
 * STDOUT), calls emit(data, rows) with every batch_rows rows (whole lines of
 * COPY text; the last batch may be shorter; none when there is no row), reads
 * the command's end, and returns the row count. A failure returns
 * ("error", sqlstate or "", message) after the connection is back in a state
 * to take the next command (the transaction is then aborted, as after any
 * failed statement); the caller raises the matching psycopg2 error. An
 * exception from emit stops the reading: the COPY is cancelled and drained
 * first, and the exception is raised.
 *
 * It must run where psycopg2 would run a statement: the connection is not in
 * use by another thread, and is in blocking mode (psycopg2's default).
 */
typedef struct {
    char *data;
    size_t size, capacity;
} buffer_t;

static int buffer_add(buffer_t *b, const char *data, size_t len) {
    if (b->size + len > b->capacity) {
        size_t capacity = b->capacity ? b->capacity : 1 << 20;
        while (capacity < b->size + len)
            capacity *= 2;
        char *grown = realloc(b->data, capacity);
        if (!grown)
            return -1;
        b->data = grown;
        b->capacity = capacity;
    }
    memcpy(b->data + b->size, data, len);
    b->size += len;
    return 0;
}

/* The error of the last result (or of the connection), as ("error", sqlstate, message). */
typedef struct {
    char sqlstate[6];
    char *message;
} failure_t;

static void fail_with(failure_t *f, const PGresult *result, PGconn *conn) {
    if (f->message)
        return; /* the first failure is the one to report */
    const char *code = result ? pq_result_error_field(result, PG_DIAG_SQLSTATE) : NULL;
    const char *text = result ? pq_result_error_message(result) : NULL;
    if (!text || !*text)
        text = pq_error_message(conn);
    snprintf(f->sqlstate, sizeof f->sqlstate, "%s", code ? code : "");
    f->message = strdup(text ? text : "unknown libpq error");
}

/* Read every result left of the command; the connection then takes the next one. */
static void drain_results(PGconn *conn, failure_t *f) {
    PGresult *result;
    while ((result = pq_get_result(conn)) != NULL) {
        int status = pq_result_status(result);
        if (status == PGRES_COPY_OUT) {
            /* Only after a cancel that came too late: read the rest away. */
            char *row;
            int len;
            while ((len = pq_get_copy_data(conn, &row, 0)) > 0)
                pq_freemem(row);
        } else if (status != PGRES_COMMAND_OK) {
            fail_with(f, result, conn);
        }
        pq_clear(result);
    }
}

static void cancel_copy(PGconn *conn) {
    PGcancel *cancel = pq_get_cancel(conn);
    if (cancel) {
        char errbuf[256];
        pq_cancel(cancel, errbuf, sizeof errbuf);
        pq_free_cancel(cancel);
    }
}

static PyObject *copy_out(PyObject *module, PyObject *args) {
    unsigned long long address;
    const char *sql;
    Py_ssize_t batch_rows;
    PyObject *emit;
    if (!PyArg_ParseTuple(args, "KsnO:copy_out", &address, &sql, &batch_rows, &emit))
        return NULL;
    if (!libpq_handle) {
        PyErr_SetString(PyExc_RuntimeError, "libpq is not loaded: call load() first");
        return NULL;
    }
    if (!address || batch_rows < 1 || !PyCallable_Check(emit)) {
        PyErr_SetString(PyExc_ValueError, "copy_out(): a PGconn address, batch_rows >= 1 and a callable");
        return NULL;
    }
    PGconn *conn = (PGconn *)(uintptr_t)address;
    failure_t failure = {{0}, NULL};
    buffer_t batch = {NULL, 0, 0};
    long long total = 0;
    int emit_failed = 0, no_memory = 0;

    PyThreadState *state = PyEval_SaveThread();
    if (!pq_send_query(conn, sql)) {
        fail_with(&failure, NULL, conn);
    } else {
        PGresult *result = pq_get_result(conn);
        int status = result ? pq_result_status(result) : -1;
        if (status != PGRES_COPY_OUT)
            fail_with(&failure, result, conn);
        if (result)
            pq_clear(result);
        if (status == PGRES_COPY_OUT) {
            Py_ssize_t rows = 0;
            for (;;) {
                char *row;
                int len = pq_get_copy_data(conn, &row, 0);
                if (len > 0) {
                    int added = buffer_add(&batch, row, (size_t)len);
                    pq_freemem(row);
                    if (added < 0) {
                        no_memory = 1;
                        cancel_copy(conn);
                        break;
                    }
                    total++;
                    if (++rows < batch_rows)
                        continue;
                } else if (len == -2) {
                    fail_with(&failure, NULL, conn);
                    break;
                } else if (len != -1) {
                    continue; /* 0 happens only in async mode */
                }
                if (rows) {
                    PyEval_RestoreThread(state);
                    PyObject *data = PyBytes_FromStringAndSize(batch.data, (Py_ssize_t)batch.size);
                    PyObject *done = data ? PyObject_CallFunction(emit, "On", data, rows) : NULL;
                    Py_XDECREF(data);
                    Py_XDECREF(done);
                    if (!done)
                        emit_failed = 1;
                    state = PyEval_SaveThread();
                    batch.size = 0;
                    rows = 0;
                    if (emit_failed) {
                        cancel_copy(conn);
                        break;
                    }
                }
                if (len == -1)
                    break; /* the COPY's data is complete */
            }
        }
        drain_results(conn, &failure);
    }
    PyEval_RestoreThread(state);
    free(batch.data);

    if (emit_failed || no_memory) {
        free(failure.message);
        return no_memory ? PyErr_NoMemory() : NULL;
    }
    if (failure.message) {
        PyObject *out = error_tuple(failure.sqlstate, failure.message);
        free(failure.message);
        return out;
    }
    return PyLong_FromLongLong(total);
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
    RESOLVE(pq_send_query, "PQsendQuery")
    RESOLVE(pq_get_result, "PQgetResult")
    RESOLVE(pq_result_status, "PQresultStatus")
    RESOLVE(pq_result_error_field, "PQresultErrorField")
    RESOLVE(pq_result_error_message, "PQresultErrorMessage")
    RESOLVE(pq_clear, "PQclear")
    RESOLVE(pq_get_copy_data, "PQgetCopyData")
    RESOLVE(pq_consume_input, "PQconsumeInput")
    RESOLVE(pq_freemem, "PQfreemem")
    RESOLVE(pq_error_message, "PQerrorMessage")
    RESOLVE(pq_get_cancel, "PQgetCancel")
    RESOLVE(pq_cancel, "PQcancel")
    RESOLVE(pq_free_cancel, "PQfreeCancel")
#undef RESOLVE
    libpq_handle = handle;
    Py_RETURN_NONE;
}

static PyMethodDef methods[] = {
    {"load", load, METH_VARARGS, "load(path): find libpq through the library at path (psycopg2's extension)"},
    {"read", read_batch, METH_VARARGS,
     "read(pgconn, limit) -> (payloads, data_start, wal_end, reply_requested), or ('error', sqlstate, message)"},
    {"copy_out", copy_out, METH_VARARGS,
     "copy_out(pgconn, sql, batch_rows, emit) -> rows, or ('error', sqlstate, message)"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "cdcd.source._libpq",
                                        "libpq calls on psycopg2's connection: the replication stream and COPY.",
                                        -1, methods};

PyMODINIT_FUNC PyInit__libpq(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module && PyModule_AddStringConstant(module, "SOURCE_SHA256", CDCD_NATIVE_SOURCE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
