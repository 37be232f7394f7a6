/* cdcd.snapshot._copyout: COPY ... TO STDOUT on a psycopg2 connection, read without the GIL.
 *
 * Why: psycopg2's copy_expert reads COPY output one row at a time
 * (PQgetCopyData) and for every row takes the GIL back to call the target's
 * write(). A snapshot reads COPY on a reader thread while the session thread
 * encodes and produces, holding the GIL: each of the reader's per-row
 * re-acquisitions then waits for it, and measured on the 1M-row orders table
 * the COPY took 1.86 s instead of 0.68 s next to one GIL-holding thread. This
 * module runs the same libpq calls on the same connection (psycopg2's PGconn,
 * connection.pgconn_ptr, and the libpq psycopg2 loaded: load() opens
 * psycopg2's extension module, whose dlsym finds it) with the GIL released
 * for a whole batch of rows, and takes it once per batch to hand the batch to
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
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdlib.h>
#include <string.h>

#ifndef CDCD_NATIVE_SOURCE
#define CDCD_NATIVE_SOURCE ""
#endif

/* libpq's declarations, for the few functions used (its ABI is stable since 7.4). */
typedef struct pg_conn PGconn;
typedef struct pg_result PGresult;
typedef struct pg_cancel PGcancel;
enum { PGRES_COMMAND_OK = 1, PGRES_COPY_OUT = 3 };
enum { PG_DIAG_SQLSTATE = 'C' };

static int (*pq_send_query)(PGconn *, const char *);
static PGresult *(*pq_get_result)(PGconn *);
static int (*pq_result_status)(const PGresult *);
static char *(*pq_result_error_field)(const PGresult *, int);
static char *(*pq_result_error_message)(const PGresult *);
static void (*pq_clear)(PGresult *);
static int (*pq_get_copy_data)(PGconn *, char **, int);
static void (*pq_freemem)(void *);
static char *(*pq_error_message)(const PGconn *);
static PGcancel *(*pq_get_cancel)(PGconn *);
static int (*pq_cancel)(PGcancel *, char *, int);
static void (*pq_free_cancel)(PGcancel *);
static void *libpq_handle;

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
        PyObject *out = Py_BuildValue("(sss)", "error", failure.sqlstate, failure.message);
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
    {"copy_out", copy_out, METH_VARARGS,
     "copy_out(pgconn, sql, batch_rows, emit) -> rows, or ('error', sqlstate, message)"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "cdcd.snapshot._copyout",
                                        "COPY TO STDOUT on a psycopg2 connection, read without the GIL.", -1,
                                        methods};

PyMODINIT_FUNC PyInit__copyout(void) {
    PyObject *module = PyModule_Create(&module_def);
    if (module && PyModule_AddStringConstant(module, "SOURCE_SHA256", CDCD_NATIVE_SOURCE) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
