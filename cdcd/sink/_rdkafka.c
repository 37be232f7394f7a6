/* cdcd.sink._rdkafka: a Kafka producer straight on librdkafka, for the hot path.
 *
 * Why it exists: confluent-kafka's Producer costs about 1 µs of CPU per
 * message on top of librdkafka's own (tests/bench/bench_kafka_floor.py): it
 * allocates a message state per produce and, for every delivery report,
 * builds a Python Message (copying topic, key and value) and calls a Python
 * callback. cdcd needs one report per message, but only as a count per
 * transaction. This type produces the same messages through the same
 * librdkafka (the one confluent-kafka ships, opened with dlopen by load(), so
 * nothing is linked at build time and both clients run one library version)
 * and serves reports in C: a run of successful reports for the same
 * transaction becomes one Python call, on_delivered(count).
 *
 * The Python surface is the subset of confluent_kafka.Producer that
 * cdcd.sink.producer.KafkaSink uses, with the same semantics, so that the sink
 * runs either: Producer(config) with error_cb, stats_cb and logger among the
 * properties; produce(topic, value, key, partition, on_delivery, callback,
 * timestamp, headers) raising BufferError on a full queue and KafkaException
 * otherwise; poll(timeout); flush(timeout); purge(in_queue, in_flight,
 * blocking); len(); close().
 *
 * Delivery reports: every message holds a reference to its on_delivery
 * callable (librdkafka's per-message opaque). A callable that is a bound
 * method named on_delivery of an object whose type has on_delivered(count)
 * (cdcd.ack.TxnTicket) promises that on_delivered(n) equals n successful
 * on_delivery calls: consecutive successful reports for it are served as one
 * call. Any other callable, and every failed report, is called per message
 * as confluent-kafka does, with a KafkaError and a confluent_kafka.Message
 * (topic, partition, offset, key, value; no headers).
 *
 * Threads: librdkafka serves delivery reports, errors and statistics from
 * rd_kafka_poll/rd_kafka_flush on the calling thread, and logs too once
 * "log.queue" forwards them to the main queue (set at construction; lines
 * logged while the handle is created arrive on librdkafka's own threads, so
 * those records take a lock). The callbacks only record into C arrays while
 * the GIL is released; the records are turned into Python calls after the
 * call returns, with the GIL held. An exception from a callback is raised
 * by the poll/flush that served it, after every record of that call was
 * served (none is dropped or leaked). close() serves the reports of what it
 * purges; a producer deallocated without close() calls no Python code (the
 * cyclic GC may have torn its callbacks' objects down already).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <librdkafka/rdkafka.h>
#include <pthread.h>
#include <stdint.h>
#include <string.h>

#ifndef CDCD_NATIVE_SOURCE
#define CDCD_NATIVE_SOURCE ""
#endif

/* ---------------------------------------------------------------- librdkafka */

/* Every librdkafka function used, resolved by load() from the library
 * confluent-kafka loaded: the declarations come from rdkafka.h, the addresses
 * from dlsym, so this module has no link-time dependency. */
#define RDK_FUNCTIONS(X)                                                                            \
    X(rd_kafka_version)                                                                             \
    X(rd_kafka_version_str)                                                                         \
    X(rd_kafka_conf_new)                                                                            \
    X(rd_kafka_conf_set)                                                                            \
    X(rd_kafka_conf_destroy)                                                                        \
    X(rd_kafka_conf_set_dr_msg_cb)                                                                  \
    X(rd_kafka_conf_set_error_cb)                                                                   \
    X(rd_kafka_conf_set_stats_cb)                                                                   \
    X(rd_kafka_conf_set_log_cb)                                                                     \
    X(rd_kafka_conf_set_opaque)                                                                     \
    X(rd_kafka_new)                                                                                 \
    X(rd_kafka_destroy)                                                                             \
    X(rd_kafka_name)                                                                                \
    X(rd_kafka_opaque)                                                                              \
    X(rd_kafka_producev)                                                                            \
    X(rd_kafka_poll)                                                                                \
    X(rd_kafka_flush)                                                                               \
    X(rd_kafka_purge)                                                                               \
    X(rd_kafka_headers_new)                                                                         \
    X(rd_kafka_header_add)                                                                          \
    X(rd_kafka_headers_destroy)                                                                     \
    X(rd_kafka_err2str)                                                                             \
    X(rd_kafka_fatal_error)                                                                         \
    X(rd_kafka_topic_name)                                                                          \
    X(rd_kafka_topic_new)                                                                           \
    X(rd_kafka_topic_destroy)                                                                       \
    X(rd_kafka_set_log_queue)

#define RDK_DECLARE(name) static __typeof__(&name) p_##name;
RDK_FUNCTIONS(RDK_DECLARE)
#undef RDK_DECLARE

static void *rdk_library;

/* Python classes from confluent_kafka, given to load(). */
static PyObject *KafkaError_type, *KafkaException_type, *Message_type;
static PyObject *str_on_delivery, *str_on_delivered, *str_log, *str_name;

/* ------------------------------------------------------------------ records */

/* The low bit of a message's opaque says its callable may be coalesced. */
#define COALESCE_BIT ((uintptr_t)1)

typedef struct {
    uintptr_t callback; /* PyObject * holding one reference, | COALESCE_BIT */
    rd_kafka_resp_err_t err;
    int32_t partition;
    int64_t offset;
    /* Copied only for reports that reach Python one by one. */
    char *topic;
    char *key;
    char *value;
    size_t key_len, value_len;
    int has_key, has_value;
} report_t;

enum { EVENT_LOG, EVENT_ERROR, EVENT_STATS };

typedef struct {
    int kind;
    int level;                 /* EVENT_LOG: syslog level */
    rd_kafka_resp_err_t err;   /* EVENT_ERROR */
    int fatal;                 /* EVENT_ERROR */
    char *facility;            /* EVENT_LOG */
    char *text;                /* log line, error reason, statistics JSON */
} event_t;

typedef struct {
    PyObject_HEAD
    rd_kafka_t *rk;
    PyObject *error_cb, *stats_cb, *logger;
    /* Delivery reports recorded during the current poll/flush (its thread only). */
    report_t *reports;
    size_t n_reports, cap_reports;
    /* Logs, errors, statistics: logs may come from librdkafka's threads. */
    pthread_mutex_t events_lock;
    event_t *events;
    size_t n_events, cap_events;
    /* Topic name (str) -> capsule of its rd_kafka_topic_t, kept until close. */
    PyObject *topics;
    /* The last function checked for coalescing, and the answer. */
    PyObject *checked_function;
    int checked_coalesces;
    /* Messages librdkafka took and has not reported yet: len() and flush().
     * rd_kafka_outq_len also counts logs and errors waiting to be served,
     * which made len() jump with a broker's connection errors. Atomic: any
     * thread may ask while another produces or polls. */
    long unreported;
} Producer;

static void count_produced(Producer *self, long count) {
    if (count)
        __atomic_add_fetch(&self->unreported, count, __ATOMIC_RELAXED);
}

static char *copy_bytes(const void *data, size_t len) {
    char *out = malloc(len + 1);
    if (out) {
        if (len)
            memcpy(out, data, len);
        out[len] = '\0';
    }
    return out;
}

static char *copy_text(const char *text) { return copy_bytes(text, text ? strlen(text) : 0); }

static void on_delivery_report(rd_kafka_t *rk, const rd_kafka_message_t *msg, void *opaque) {
    Producer *self = opaque;
    if (self->n_reports == self->cap_reports) {
        size_t cap = self->cap_reports ? self->cap_reports * 2 : 4096;
        report_t *grown = realloc(self->reports, cap * sizeof *grown);
        if (!grown)
            abort(); /* no memory to keep the report: losing it would lose a count */
        self->reports = grown;
        self->cap_reports = cap;
    }
    report_t *r = &self->reports[self->n_reports++];
    __atomic_sub_fetch(&self->unreported, 1, __ATOMIC_RELAXED);
    memset(r, 0, sizeof *r);
    r->callback = (uintptr_t)msg->_private;
    r->err = msg->err;
    r->partition = msg->partition;
    r->offset = msg->offset;
    if (msg->err || !(r->callback & COALESCE_BIT)) {
        r->topic = copy_text(msg->rkt ? p_rd_kafka_topic_name(msg->rkt) : "");
        /* Without memory for a copy the report says None: it still counts. */
        if (msg->key && (r->key = copy_bytes(msg->key, msg->key_len))) {
            r->key_len = msg->key_len;
            r->has_key = 1;
        }
        if (msg->payload && (r->value = copy_bytes(msg->payload, msg->len))) {
            r->value_len = msg->len;
            r->has_value = 1;
        }
    }
}

static void add_event(Producer *self, event_t event) {
    pthread_mutex_lock(&self->events_lock);
    if (self->n_events == self->cap_events) {
        size_t cap = self->cap_events ? self->cap_events * 2 : 16;
        event_t *grown = realloc(self->events, cap * sizeof *grown);
        if (!grown) {
            pthread_mutex_unlock(&self->events_lock);
            free(event.facility);
            free(event.text);
            return; /* a log line or statistics lost for lack of memory: not a message */
        }
        self->events = grown;
        self->cap_events = cap;
    }
    self->events[self->n_events++] = event;
    pthread_mutex_unlock(&self->events_lock);
}

static void on_log(const rd_kafka_t *rk, int level, const char *facility, const char *text) {
    Producer *self = p_rd_kafka_opaque(rk);
    if (!self)
        return;
    event_t event = {.kind = EVENT_LOG, .level = level, .facility = copy_text(facility), .text = copy_text(text)};
    add_event(self, event);
}

static void on_error(rd_kafka_t *rk, int err, const char *reason, void *opaque) {
    Producer *self = opaque;
    event_t event = {.kind = EVENT_ERROR, .err = err};
    if (err == RD_KAFKA_RESP_ERR__FATAL) {
        /* The generic code says only "fatal": the cause is kept by the handle. */
        char cause[512];
        event.err = p_rd_kafka_fatal_error(rk, cause, sizeof cause);
        event.fatal = 1;
        event.text = copy_text(cause);
    } else {
        event.text = copy_text(reason);
    }
    add_event(self, event);
}

static int on_stats(rd_kafka_t *rk, char *json, size_t json_len, void *opaque) {
    Producer *self = opaque;
    event_t event = {.kind = EVENT_STATS, .text = copy_bytes(json, json_len)};
    add_event(self, event);
    return 0; /* librdkafka frees the JSON */
}

/* ------------------------------------------------------------ serving them */

/* Python's logging level for a syslog level, as confluent-kafka maps them. */
static int python_level(int syslog_level) {
    static const int levels[8] = {50, 50, 50, 40, 30, 20, 20, 10};
    return syslog_level >= 0 && syslog_level < 8 ? levels[syslog_level] : 10;
}

static PyObject *make_error(rd_kafka_resp_err_t err, const char *reason, int fatal) {
    PyObject *kwargs = Py_BuildValue("{s:i}", "fatal", fatal);
    if (!kwargs)
        return NULL;
    /* Text from brokers is not always UTF-8: never let it fail the report. */
    PyObject *args = reason ? Py_BuildValue("(iN)", (int)err,
                                            PyUnicode_DecodeUTF8(reason, (Py_ssize_t)strlen(reason), "replace"))
                            : Py_BuildValue("(i)", (int)err);
    PyObject *error = args ? PyObject_Call(KafkaError_type, args, kwargs) : NULL;
    Py_XDECREF(args);
    Py_DECREF(kwargs);
    return error;
}

/* Keep the first exception of a serving pass; later ones are reported as unraisable. */
static void keep_exception(PyObject **first_type, PyObject **first_value, PyObject **first_tb) {
    if (*first_type == NULL)
        PyErr_Fetch(first_type, first_value, first_tb);
    else
        PyErr_WriteUnraisable(NULL);
}

static int serve_events(Producer *self, PyObject **et, PyObject **ev, PyObject **etb) {
    pthread_mutex_lock(&self->events_lock);
    event_t *events = self->events;
    size_t n = self->n_events;
    self->events = NULL;
    self->n_events = self->cap_events = 0;
    pthread_mutex_unlock(&self->events_lock);
    for (size_t i = 0; i < n; i++) {
        event_t *e = &events[i];
        PyObject *result = NULL;
        if (e->kind == EVENT_LOG) {
            if (self->logger && self->logger != Py_None) {
                PyObject *level = PyLong_FromLong(python_level(e->level));
                PyObject *fmt = PyUnicode_FromString("%s [%s] %s");
                const char *facility = e->facility ? e->facility : "", *line = e->text ? e->text : "";
                PyObject *fac = PyUnicode_DecodeUTF8(facility, (Py_ssize_t)strlen(facility), "replace");
                PyObject *name = PyUnicode_FromString(self->rk ? p_rd_kafka_name(self->rk) : "");
                PyObject *text = PyUnicode_DecodeUTF8(line, (Py_ssize_t)strlen(line), "replace");
                if (level && fmt && fac && name && text)
                    result = PyObject_CallMethodObjArgs(self->logger, str_log, level, fmt, fac, name, text, NULL);
                Py_XDECREF(level);
                Py_XDECREF(fmt);
                Py_XDECREF(fac);
                Py_XDECREF(name);
                Py_XDECREF(text);
            } else {
                result = Py_NewRef(Py_None);
            }
        } else if (e->kind == EVENT_ERROR) {
            if (self->error_cb && self->error_cb != Py_None) {
                PyObject *error = make_error(e->err, e->text, e->fatal);
                if (error) {
                    result = PyObject_CallOneArg(self->error_cb, error);
                    Py_DECREF(error);
                }
            } else {
                result = Py_NewRef(Py_None);
            }
        } else {
            if (self->stats_cb && self->stats_cb != Py_None) {
                const char *text = e->text ? e->text : "{}";
                PyObject *json = PyUnicode_DecodeUTF8(text, (Py_ssize_t)strlen(text), "replace");
                if (json) {
                    result = PyObject_CallOneArg(self->stats_cb, json);
                    Py_DECREF(json);
                }
            } else {
                result = Py_NewRef(Py_None);
            }
        }
        if (result)
            Py_DECREF(result);
        else
            keep_exception(et, ev, etb);
        free(e->facility);
        free(e->text);
    }
    free(events);
    return (int)n;
}

/* One report to its callable, as confluent-kafka makes it: (KafkaError or None, Message). */
static PyObject *call_one(PyObject *callback, report_t *r) {
    PyObject *error = Py_None, *message = NULL, *result = NULL;
    Py_INCREF(error);
    if (r->err) {
        Py_DECREF(error);
        error = make_error(r->err, NULL, 0);
        if (!error)
            return NULL;
    }
    PyObject *kwargs = Py_BuildValue(
        "{s:s,s:i,s:L,s:N,s:N,s:O}", "topic", r->topic ? r->topic : "", "partition", (int)r->partition,
        "offset", (long long)r->offset, "key",
        r->has_key ? PyBytes_FromStringAndSize(r->key, (Py_ssize_t)r->key_len) : Py_NewRef(Py_None), "value",
        r->has_value ? PyBytes_FromStringAndSize(r->value, (Py_ssize_t)r->value_len) : Py_NewRef(Py_None),
        "error", r->err ? error : Py_None);
    if (kwargs) {
        PyObject *empty = PyTuple_New(0);
        message = empty ? PyObject_Call(Message_type, empty, kwargs) : NULL;
        Py_XDECREF(empty);
        Py_DECREF(kwargs);
    }
    if (message) {
        result = PyObject_CallFunctionObjArgs(callback, error, message, NULL);
        Py_DECREF(message);
    }
    Py_DECREF(error);
    return result;
}

static PyObject *call_delivered(PyObject *method, size_t count) {
    PyObject *owner = PyMethod_GET_SELF(method);
    PyObject *n = PyLong_FromSize_t(count);
    PyObject *result = n ? PyObject_CallMethodOneArg(owner, str_on_delivered, n) : NULL;
    Py_XDECREF(n);
    return result;
}

/* Reports kept between serves: an array of up to 65,536 (4.7 MB) is reused.
 * Freed after every serve, a block that large made glibc consolidate the
 * small chunks the messages' frees had just binned (malloc_consolidate, 5 %
 * of the samples of a snapshot profile). */
#define KEEP_REPORTS_CAP ((size_t)1 << 16)

static int serve_reports(Producer *self, PyObject **et, PyObject **ev, PyObject **etb) {
    report_t *reports = self->reports;
    size_t n = self->n_reports, cap = self->cap_reports;
    /* Detached while Python runs: a callback that polls records into a new array. */
    self->reports = NULL;
    self->n_reports = self->cap_reports = 0;
    PyObject *run = NULL; /* the coalesced callable of the current run of successes */
    size_t run_count = 0;
    for (size_t i = 0; i <= n; i++) {
        report_t *r = i < n ? &reports[i] : NULL;
        PyObject *callback = r ? (PyObject *)(r->callback & ~COALESCE_BIT) : NULL;
        int coalesces = r && !r->err && (r->callback & COALESCE_BIT);
        /* Bound methods are new objects per attribute access: a run is one owner. */
        if (run && (!coalesces || PyMethod_GET_SELF(callback) != PyMethod_GET_SELF(run))) {
            PyObject *result = call_delivered(run, run_count);
            if (result)
                Py_DECREF(result);
            else
                keep_exception(et, ev, etb);
            Py_DECREF(run);
            run = NULL;
        }
        if (!r)
            break;
        if (coalesces) {
            if (run) {
                run_count++;
                Py_DECREF(callback); /* the run holds one reference */
            } else {
                run = callback;
                run_count = 1;
            }
            continue;
        }
        if (callback && callback != Py_None) {
            PyObject *result = call_one(callback, r);
            if (result)
                Py_DECREF(result);
            else
                keep_exception(et, ev, etb);
        }
        Py_XDECREF(callback);
        free(r->topic);
        free(r->key);
        free(r->value);
    }
    if (!self->reports && cap <= KEEP_REPORTS_CAP) {
        self->reports = reports; /* empty now; its room is kept */
        self->cap_reports = cap;
    } else {
        free(reports);
    }
    return (int)n;
}

/* Serve what the last librdkafka call recorded; -1 with the first callback's exception set. */
static int serve(Producer *self) {
    PyObject *et = NULL, *ev = NULL, *etb = NULL;
    int served = serve_events(self, &et, &ev, &etb);
    served += serve_reports(self, &et, &ev, &etb);
    if (et) {
        PyErr_Restore(et, ev, etb);
        return -1;
    }
    return served;
}

/* ---------------------------------------------------------------- the type */

static int producer_closed(Producer *self) {
    if (!self->rk) {
        PyErr_SetString(PyExc_RuntimeError, "Producer has been closed");
        return 1;
    }
    return 0;
}

static PyObject *raise_kafka(rd_kafka_resp_err_t err, const char *reason) {
    PyObject *error = make_error(err, reason, 0);
    if (error) {
        PyErr_SetObject(KafkaException_type, error);
        Py_DECREF(error);
    }
    return NULL;
}

static int set_property(rd_kafka_conf_t *conf, PyObject *name, PyObject *value) {
    const char *key = PyUnicode_AsUTF8(name);
    if (!key)
        return -1;
    PyObject *text;
    if (PyBool_Check(value))
        text = PyUnicode_FromString(value == Py_True ? "true" : "false");
    else if (PyUnicode_Check(value))
        text = Py_NewRef(value);
    else if (PyLong_Check(value) || PyFloat_Check(value))
        text = PyObject_Str(value);
    else {
        PyErr_Format(PyExc_TypeError, "expected a string, number or bool for %s, not %s", key, Py_TYPE(value)->tp_name);
        return -1;
    }
    if (!text)
        return -1;
    char errstr[512];
    const char *utf8 = PyUnicode_AsUTF8(text);
    if (!utf8) {
        Py_DECREF(text);
        return -1;
    }
    rd_kafka_conf_res_t rc = p_rd_kafka_conf_set(conf, key, utf8, errstr, sizeof errstr);
    Py_DECREF(text);
    if (rc != RD_KAFKA_CONF_OK) {
        raise_kafka(RD_KAFKA_RESP_ERR__INVALID_ARG, errstr);
        return -1;
    }
    return 0;
}

static int Producer_init(Producer *self, PyObject *args, PyObject *kwargs) {
    PyObject *config;
    if (!rdk_library) {
        PyErr_SetString(PyExc_RuntimeError, "librdkafka is not loaded: call cdcd.sink._rdkafka.load() first");
        return -1;
    }
    if (self->rk) {
        PyErr_SetString(PyExc_RuntimeError, "Producer is already initialised");
        return -1;
    }
    if (!PyArg_ParseTuple(args, "O!:Producer", &PyDict_Type, &config))
        return -1;
    rd_kafka_conf_t *conf = p_rd_kafka_conf_new();
    PyObject *name, *value;
    Py_ssize_t pos = 0;
    while (PyDict_Next(config, &pos, &name, &value)) {
        if (!PyUnicode_Check(name)) {
            PyErr_SetString(PyExc_TypeError, "property names must be strings");
            goto fail;
        }
        const char *key = PyUnicode_AsUTF8(name);
        if (!key)
            goto fail;
        PyObject **slot = !strcmp(key, "error_cb") ? &self->error_cb
                          : !strcmp(key, "stats_cb") ? &self->stats_cb
                          : !strcmp(key, "logger")   ? &self->logger
                                                     : NULL;
        if (slot) {
            Py_XSETREF(*slot, Py_NewRef(value));
            continue;
        }
        if (PyCallable_Check(value)) {
            PyErr_Format(PyExc_ValueError, "%s: this producer takes no Python callback for it", key);
            goto fail;
        }
        if (set_property(conf, name, value) < 0)
            goto fail;
    }
    p_rd_kafka_conf_set_opaque(conf, self);
    p_rd_kafka_conf_set_dr_msg_cb(conf, on_delivery_report);
    p_rd_kafka_conf_set_error_cb(conf, on_error);
    if (self->stats_cb && self->stats_cb != Py_None)
        p_rd_kafka_conf_set_stats_cb(conf, on_stats);
    if (self->logger && self->logger != Py_None) {
        char errstr[512];
        p_rd_kafka_conf_set_log_cb(conf, on_log);
        if (p_rd_kafka_conf_set(conf, "log.queue", "true", errstr, sizeof errstr) != RD_KAFKA_CONF_OK) {
            raise_kafka(RD_KAFKA_RESP_ERR__INVALID_ARG, errstr);
            goto fail;
        }
    }
    char errstr[512];
    rd_kafka_t *rk;
    Py_BEGIN_ALLOW_THREADS
    rk = p_rd_kafka_new(RD_KAFKA_PRODUCER, conf, errstr, sizeof errstr);
    Py_END_ALLOW_THREADS
    if (!rk) {
        raise_kafka(RD_KAFKA_RESP_ERR__INVALID_ARG, errstr);
        goto fail; /* not owned by librdkafka when rd_kafka_new fails */
    }
    self->rk = rk;
    if (self->logger && self->logger != Py_None)
        p_rd_kafka_set_log_queue(rk, NULL); /* logs served by poll(), on the caller's thread */
    return 0;
fail:
    p_rd_kafka_conf_destroy(conf);
    return -1;
}

/* Whether reports for ``callback`` may be served as on_delivered(count); see the module comment. */
static int coalesces(Producer *self, PyObject *callback) {
    if (!PyMethod_Check(callback))
        return 0;
    PyObject *function = PyMethod_GET_FUNCTION(callback);
    if (function == self->checked_function)
        return self->checked_coalesces;
    int answer = 0;
    PyObject *fname = PyObject_GetAttr(function, str_name);
    if (fname) {
        answer = PyUnicode_Check(fname) && PyUnicode_Compare(fname, str_on_delivery) == 0 &&
                 PyObject_HasAttr((PyObject *)Py_TYPE(PyMethod_GET_SELF(callback)), str_on_delivered);
        Py_DECREF(fname);
    } else {
        PyErr_Clear();
    }
    Py_XSETREF(self->checked_function, Py_NewRef(function));
    self->checked_coalesces = answer;
    return answer;
}

static int bytes_or_none(PyObject *obj, const char *what, const char **data, Py_ssize_t *len) {
    if (obj == NULL || obj == Py_None) {
        *data = NULL;
        *len = 0;
        return 0;
    }
    if (PyBytes_Check(obj)) {
        *data = PyBytes_AS_STRING(obj);
        *len = PyBytes_GET_SIZE(obj);
        return 0;
    }
    if (PyUnicode_Check(obj)) {
        *data = PyUnicode_AsUTF8AndSize(obj, len);
        return *data ? 0 : -1;
    }
    PyErr_Format(PyExc_TypeError, "%s must be bytes, str or None, not %s", what, Py_TYPE(obj)->tp_name);
    return -1;
}

static rd_kafka_headers_t *build_headers(PyObject *headers) {
    PyObject *items = PyDict_Check(headers) ? PyDict_Items(headers) : PySequence_Fast(headers, "headers must be a list of (name, value) or a dict");
    if (!items)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(items);
    rd_kafka_headers_t *out = p_rd_kafka_headers_new((size_t)n);
    for (Py_ssize_t i = 0; i < n; i++) {
        PyObject *item = PySequence_Fast_GET_ITEM(items, i);
        PyObject *name, *value;
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 2) {
            PyErr_SetString(PyExc_TypeError, "each header must be a (name, value) tuple");
            goto fail;
        }
        name = PyTuple_GET_ITEM(item, 0);
        value = PyTuple_GET_ITEM(item, 1);
        Py_ssize_t name_len, value_len;
        const char *name_data = PyUnicode_Check(name) ? PyUnicode_AsUTF8AndSize(name, &name_len) : NULL;
        if (!name_data) {
            if (!PyErr_Occurred())
                PyErr_SetString(PyExc_TypeError, "header names must be str");
            goto fail;
        }
        const char *value_data;
        if (bytes_or_none(value, "a header value", &value_data, &value_len) < 0)
            goto fail;
        p_rd_kafka_header_add(out, name_data, name_len, value_data, value_data ? value_len : 0);
    }
    Py_DECREF(items);
    return out;
fail:
    Py_DECREF(items);
    p_rd_kafka_headers_destroy(out);
    return NULL;
}

/* The topic handle for ``name``, created once: producev by name would look it up per message. */
static rd_kafka_topic_t *topic_handle(Producer *self, PyObject *name) {
    if (!self->topics && !(self->topics = PyDict_New()))
        return NULL;
    PyObject *capsule = PyDict_GetItemWithError(self->topics, name);
    if (capsule)
        return PyCapsule_GetPointer(capsule, NULL);
    if (PyErr_Occurred())
        return NULL;
    const char *text = PyUnicode_AsUTF8(name);
    if (!text)
        return NULL;
    rd_kafka_topic_t *rkt = p_rd_kafka_topic_new(self->rk, text, NULL);
    if (!rkt) {
        raise_kafka(RD_KAFKA_RESP_ERR__INVALID_ARG, "invalid topic name");
        return NULL;
    }
    capsule = PyCapsule_New(rkt, NULL, NULL);
    if (!capsule || PyDict_SetItem(self->topics, name, capsule) < 0) {
        Py_XDECREF(capsule);
        p_rd_kafka_topic_destroy(rkt);
        return NULL;
    }
    Py_DECREF(capsule);
    return rkt;
}

static void destroy_topics(Producer *self) {
    if (!self->topics)
        return;
    PyObject *name, *capsule;
    Py_ssize_t pos = 0;
    while (PyDict_Next(self->topics, &pos, &name, &capsule))
        p_rd_kafka_topic_destroy(PyCapsule_GetPointer(capsule, NULL));
    Py_CLEAR(self->topics);
}

enum { ARG_TOPIC, ARG_VALUE, ARG_KEY, ARG_PARTITION, ARG_ON_DELIVERY, ARG_CALLBACK, ARG_TIMESTAMP, ARG_HEADERS, N_ARGS };
static const char *const produce_names[N_ARGS] = {"topic",       "value",    "key",       "partition",
                                                 "on_delivery", "callback", "timestamp", "headers"};

/* Arguments by position or name, as confluent-kafka takes them; vectorcall keeps the
 * positional call of the hot path free of argument tuples and dicts. */
static int produce_arguments(PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames, PyObject **slots) {
    if (nargs > N_ARGS) {
        PyErr_Format(PyExc_TypeError, "produce() takes at most %d arguments (%zd given)", N_ARGS, nargs);
        return -1;
    }
    for (Py_ssize_t i = 0; i < nargs; i++)
        slots[i] = args[i];
    Py_ssize_t nkw = kwnames ? PyTuple_GET_SIZE(kwnames) : 0;
    for (Py_ssize_t k = 0; k < nkw; k++) {
        PyObject *name = PyTuple_GET_ITEM(kwnames, k);
        int at = -1;
        for (int i = 0; i < N_ARGS; i++)
            if (PyUnicode_CompareWithASCIIString(name, produce_names[i]) == 0)
                at = i;
        if (at < 0) {
            PyErr_Format(PyExc_TypeError, "produce() got an unexpected keyword argument '%U'", name);
            return -1;
        }
        if (slots[at]) {
            PyErr_Format(PyExc_TypeError, "produce() got multiple values for argument '%s'", produce_names[at]);
            return -1;
        }
        slots[at] = args[nargs + k];
    }
    if (!slots[ARG_TOPIC] || !PyUnicode_Check(slots[ARG_TOPIC])) {
        PyErr_SetString(PyExc_TypeError, "produce() needs a topic name (str)");
        return -1;
    }
    return 0;
}

static PyObject *Producer_produce(Producer *self, PyObject *const *args, Py_ssize_t nargs, PyObject *kwnames) {
    PyObject *slots[N_ARGS] = {NULL};
    if (produce_arguments(args, nargs, kwnames, slots) < 0 || producer_closed(self))
        return NULL;
    int partition = RD_KAFKA_PARTITION_UA;
    long long timestamp = 0;
    if (slots[ARG_PARTITION] && slots[ARG_PARTITION] != Py_None) {
        long value = PyLong_AsLong(slots[ARG_PARTITION]);
        if (value == -1 && PyErr_Occurred())
            return NULL;
        partition = (int)value;
    }
    if (slots[ARG_TIMESTAMP] && slots[ARG_TIMESTAMP] != Py_None) {
        timestamp = PyLong_AsLongLong(slots[ARG_TIMESTAMP]);
        if (timestamp == -1 && PyErr_Occurred())
            return NULL;
    }
    PyObject *on_delivery = slots[ARG_ON_DELIVERY];
    if (on_delivery == NULL || on_delivery == Py_None)
        on_delivery = slots[ARG_CALLBACK]; /* confluent-kafka's older name for it */
    if (on_delivery == Py_None)
        on_delivery = NULL;
    const char *value_data, *key_data;
    Py_ssize_t value_len, key_len;
    if (bytes_or_none(slots[ARG_VALUE], "value", &value_data, &value_len) < 0 ||
        bytes_or_none(slots[ARG_KEY], "key", &key_data, &key_len) < 0)
        return NULL;
    rd_kafka_topic_t *rkt = topic_handle(self, slots[ARG_TOPIC]);
    if (!rkt)
        return NULL;
    PyObject *headers = slots[ARG_HEADERS];
    rd_kafka_headers_t *hdrs = NULL;
    if (headers && headers != Py_None && !(hdrs = build_headers(headers)))
        return NULL;
    uintptr_t opaque = 0;
    if (on_delivery) {
        opaque = (uintptr_t)Py_NewRef(on_delivery);
        if (coalesces(self, on_delivery))
            opaque |= COALESCE_BIT;
    }
    /* No headers: a NULL list, which librdkafka takes as none. */
    rd_kafka_resp_err_t err = p_rd_kafka_producev(
        self->rk, RD_KAFKA_V_RKT(rkt), RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY), RD_KAFKA_V_PARTITION(partition),
        RD_KAFKA_V_KEY(key_data, (size_t)key_len), RD_KAFKA_V_VALUE((void *)value_data, (size_t)value_len),
        RD_KAFKA_V_TIMESTAMP(timestamp), RD_KAFKA_V_HEADERS(hdrs), RD_KAFKA_V_OPAQUE((void *)opaque), RD_KAFKA_V_END);
    if (err) {
        if (hdrs)
            p_rd_kafka_headers_destroy(hdrs); /* not taken on failure */
        Py_XDECREF(on_delivery);
        if (err == RD_KAFKA_RESP_ERR__QUEUE_FULL) {
            PyErr_Format(PyExc_BufferError, "%s", p_rd_kafka_err2str(err));
            return NULL;
        }
        if (err == RD_KAFKA_RESP_ERR__FATAL) {
            /* The producer is unusable: its cause, flagged fatal, as confluent-kafka raises it. */
            char cause[512];
            rd_kafka_resp_err_t code = p_rd_kafka_fatal_error(self->rk, cause, sizeof cause);
            PyObject *error = make_error(code ? code : err, code ? cause : NULL, 1);
            if (error) {
                PyErr_SetObject(KafkaException_type, error);
                Py_DECREF(error);
            }
            return NULL;
        }
        return raise_kafka(err, NULL);
    }
    count_produced(self, 1);
    Py_RETURN_NONE;
}

/* The opaque of a batch's messages, with one reference to on_delivery per message (as produce() takes). */
static uintptr_t batch_opaque(Producer *self, PyObject *on_delivery, Py_ssize_t count) {
    if (!on_delivery)
        return 0;
    for (Py_ssize_t i = 0; i < count; i++)
        Py_INCREF(on_delivery);
    return (uintptr_t)on_delivery | (coalesces(self, on_delivery) ? COALESCE_BIT : 0);
}

/* After a batch: `produced` of `count` taken; the others' references go (the caller produces them again). */
static void batch_done(Producer *self, PyObject *on_delivery, Py_ssize_t produced, Py_ssize_t count) {
    count_produced(self, (long)produced);
    if (on_delivery)
        for (Py_ssize_t i = produced; i < count; i++)
            Py_DECREF(on_delivery);
}

/* One message of produce_many's list, as pointers into the Python objects it holds. */
typedef struct {
    const char *key, *value;
    Py_ssize_t key_len, value_len;
    Py_ssize_t first_header, headers; /* into the call's header array */
} batch_message_t;

typedef struct {
    const char *name, *value;
    Py_ssize_t value_len;
} batch_header_t;

/* produce_many(topic, messages, on_delivery, start=0) -> the index of the first message not produced.
 *
 * messages: a list of (key, value, headers) tuples (headers: a list of
 * (str, bytes) pairs), as the snapshot's encoder makes them; every message
 * goes to ``topic`` with ``on_delivery``. The messages are read with the GIL
 * held, then produced with it released (librdkafka copies them; the list
 * and the objects in it stay referenced by the caller), so the per-message
 * work of librdkafka overlaps other threads' Python. It stops at the first
 * message librdkafka does not take (a full queue, or a refusal) and returns
 * its index: the caller hands that one to produce(), which blocks for
 * space or raises the error. Call it from the thread that polls. */
static PyObject *Producer_produce_many(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 4 || !PyUnicode_Check(args[0]) || !PyList_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "produce_many(topic, messages: list, on_delivery, start=0)");
        return NULL;
    }
    if (producer_closed(self))
        return NULL;
    PyObject *messages = args[1], *on_delivery = args[2] == Py_None ? NULL : args[2];
    Py_ssize_t start = nargs == 4 ? PyLong_AsSsize_t(args[3]) : 0;
    if (start == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t n = PyList_GET_SIZE(messages);
    if (start < 0 || start > n) {
        PyErr_SetString(PyExc_ValueError, "produce_many(): start out of range");
        return NULL;
    }
    rd_kafka_topic_t *rkt = topic_handle(self, args[0]);
    if (!rkt)
        return NULL;
    Py_ssize_t count = n - start, total_headers = 0;
    if (count == 0)
        return PyLong_FromSsize_t(n);
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(messages, start + i);
        if (!PyTuple_Check(item) || PyTuple_GET_SIZE(item) != 3 || !PyList_Check(PyTuple_GET_ITEM(item, 2))) {
            PyErr_SetString(PyExc_TypeError, "produce_many(): each message is (key, value, [headers])");
            return NULL;
        }
        total_headers += PyList_GET_SIZE(PyTuple_GET_ITEM(item, 2));
    }
    batch_message_t *batch = PyMem_Malloc(sizeof *batch * (size_t)count);
    batch_header_t *headers = PyMem_Malloc(sizeof *headers * (size_t)(total_headers ? total_headers : 1));
    if (!batch || !headers) {
        PyMem_Free(batch);
        PyMem_Free(headers);
        return PyErr_NoMemory();
    }
    Py_ssize_t at = 0;
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *item = PyList_GET_ITEM(messages, start + i), *list = PyTuple_GET_ITEM(item, 2);
        batch_message_t *m = &batch[i];
        if (bytes_or_none(PyTuple_GET_ITEM(item, 0), "key", &m->key, &m->key_len) < 0 ||
            bytes_or_none(PyTuple_GET_ITEM(item, 1), "value", &m->value, &m->value_len) < 0)
            goto invalid;
        m->first_header = at;
        m->headers = PyList_GET_SIZE(list);
        for (Py_ssize_t h = 0; h < m->headers; h++, at++) {
            PyObject *pair = PyList_GET_ITEM(list, h);
            if (!PyTuple_Check(pair) || PyTuple_GET_SIZE(pair) != 2 || !PyBytes_Check(PyTuple_GET_ITEM(pair, 1)) ||
                !PyUnicode_Check(PyTuple_GET_ITEM(pair, 0))) {
                PyErr_SetString(PyExc_TypeError, "produce_many(): a header is (str, bytes)");
                goto invalid;
            }
            if (!(headers[at].name = PyUnicode_AsUTF8(PyTuple_GET_ITEM(pair, 0))))
                goto invalid;
            headers[at].value = PyBytes_AS_STRING(PyTuple_GET_ITEM(pair, 1));
            headers[at].value_len = PyBytes_GET_SIZE(PyTuple_GET_ITEM(pair, 1));
        }
    }
    uintptr_t opaque = batch_opaque(self, on_delivery, count);
    Py_ssize_t produced = 0;
    Py_BEGIN_ALLOW_THREADS
    for (; produced < count; produced++) {
        batch_message_t *m = &batch[produced];
        rd_kafka_headers_t *hdrs = m->headers ? p_rd_kafka_headers_new((size_t)m->headers) : NULL;
        for (Py_ssize_t h = m->first_header; h < m->first_header + m->headers; h++)
            p_rd_kafka_header_add(hdrs, headers[h].name, -1, headers[h].value, (size_t)headers[h].value_len);
        rd_kafka_resp_err_t err = p_rd_kafka_producev(
            self->rk, RD_KAFKA_V_RKT(rkt), RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
            RD_KAFKA_V_KEY(m->key, (size_t)m->key_len), RD_KAFKA_V_VALUE((void *)m->value, (size_t)m->value_len),
            RD_KAFKA_V_HEADERS(hdrs), RD_KAFKA_V_OPAQUE((void *)opaque), RD_KAFKA_V_END);
        if (err) {
            if (hdrs)
                p_rd_kafka_headers_destroy(hdrs); /* not taken on failure */
            break;
        }
    }
    Py_END_ALLOW_THREADS
    batch_done(self, on_delivery, produced, count);
    PyMem_Free(batch);
    PyMem_Free(headers);
    return PyLong_FromSsize_t(start + produced);

invalid:
    PyMem_Free(batch);
    PyMem_Free(headers);
    return NULL;
}

/* Formats a non-negative ordinal in decimal into `out` (room for 20 digits); returns its length. */
static size_t decimal(char *out, long long value) {
    char digits[24];
    size_t n = 0;
    do {
        digits[n++] = (char)('0' + value % 10);
        value /= 10;
    } while (value > 0);
    for (size_t i = 0; i < n; i++)
        out[i] = digits[n - 1 - i];
    return n;
}

/* produce_packed(topic, blob, index, seq, lsn_name, lsn_value, seq_name, on_delivery, start=0)
 *   -> the index of the first message not produced.
 *
 * The snapshot's reads as cdcd.envelope._native's copy_reads packs them (see
 * cdcd.envelope.rowcode.PackedReads): read i is blob's next key (index[2i]
 * bytes; -1: none) and value (index[2i+1] bytes), with the headers
 * (lsn_name, lsn_value) and (seq_name, decimal seq + i). No Python object
 * per message: it runs with the GIL released from start to the first
 * message librdkafka does not take, and returns that one's index, as
 * produce_many does (the caller hands it to produce()). */
static PyObject *Producer_produce_packed(Producer *self, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 8 || nargs > 9 || !PyUnicode_Check(args[0]) || !PyBytes_CheckExact(args[1]) ||
        !PyBytes_CheckExact(args[2]) || !PyUnicode_Check(args[4]) || !PyBytes_Check(args[5]) ||
        !PyUnicode_Check(args[6])) {
        PyErr_SetString(PyExc_TypeError, "produce_packed(topic, blob: bytes, index: bytes, seq, lsn_name: str, "
                                         "lsn_value: bytes, seq_name: str, on_delivery, start=0)");
        return NULL;
    }
    if (producer_closed(self))
        return NULL;
    const char *blob = PyBytes_AS_STRING(args[1]);
    Py_ssize_t blob_len = PyBytes_GET_SIZE(args[1]);
    Py_ssize_t index_len = PyBytes_GET_SIZE(args[2]);
    if (index_len % (Py_ssize_t)(2 * sizeof(int32_t))) {
        PyErr_SetString(PyExc_ValueError, "produce_packed(): the index is not whole (key, value) lengths");
        return NULL;
    }
    Py_ssize_t n = index_len / (Py_ssize_t)(2 * sizeof(int32_t));
    long long seq = PyLong_AsLongLong(args[3]);
    if (seq == -1 && PyErr_Occurred())
        return NULL;
    Py_ssize_t start = nargs == 9 ? PyLong_AsSsize_t(args[8]) : 0;
    if (start == -1 && PyErr_Occurred())
        return NULL;
    if (seq < 0 || start < 0 || start > n) {
        PyErr_SetString(PyExc_ValueError, "produce_packed(): a negative seq, or start out of range");
        return NULL;
    }
    Py_ssize_t lsn_name_len, seq_name_len;
    const char *lsn_name = PyUnicode_AsUTF8AndSize(args[4], &lsn_name_len);
    const char *seq_name = lsn_name ? PyUnicode_AsUTF8AndSize(args[6], &seq_name_len) : NULL;
    if (!seq_name)
        return NULL;
    const char *lsn_value = PyBytes_AS_STRING(args[5]);
    size_t lsn_value_len = (size_t)PyBytes_GET_SIZE(args[5]);
    /* Checked whole before anything is produced: a bad index is refused, not half sent. */
    const int32_t *lengths = (const int32_t *)(const void *)PyBytes_AS_STRING(args[2]);
    Py_ssize_t offset = 0, first = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        int32_t key_len = lengths[2 * i], value_len = lengths[2 * i + 1];
        if (i == start)
            first = offset;
        if (key_len < -1 || value_len < 0 || offset + (key_len > 0 ? key_len : 0) + value_len > blob_len) {
            PyErr_SetString(PyExc_ValueError, "produce_packed(): the index does not fit the blob");
            return NULL;
        }
        offset += (key_len > 0 ? key_len : 0) + value_len;
    }
    if (start == n)
        return PyLong_FromSsize_t(n);
    rd_kafka_topic_t *rkt = topic_handle(self, args[0]);
    if (!rkt)
        return NULL;
    PyObject *on_delivery = args[7] == Py_None ? NULL : args[7];
    Py_ssize_t count = n - start;
    uintptr_t opaque = batch_opaque(self, on_delivery, count);
    Py_ssize_t produced = 0;
    Py_BEGIN_ALLOW_THREADS
    const char *at = blob + first;
    char number[24];
    for (; produced < count; produced++) {
        int32_t key_len = lengths[2 * (start + produced)], value_len = lengths[2 * (start + produced) + 1];
        const char *key = key_len >= 0 ? at : NULL;
        const char *value = at + (key_len > 0 ? key_len : 0);
        rd_kafka_headers_t *hdrs = p_rd_kafka_headers_new(2);
        p_rd_kafka_header_add(hdrs, lsn_name, lsn_name_len, lsn_value, lsn_value_len);
        p_rd_kafka_header_add(hdrs, seq_name, seq_name_len, number, decimal(number, seq + start + produced));
        rd_kafka_resp_err_t err = p_rd_kafka_producev(
            self->rk, RD_KAFKA_V_RKT(rkt), RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
            RD_KAFKA_V_KEY(key, key ? (size_t)key_len : 0), RD_KAFKA_V_VALUE((void *)value, (size_t)value_len),
            RD_KAFKA_V_HEADERS(hdrs), RD_KAFKA_V_OPAQUE((void *)opaque), RD_KAFKA_V_END);
        if (err) {
            p_rd_kafka_headers_destroy(hdrs); /* not taken on failure */
            break;
        }
        at = value + value_len;
    }
    Py_END_ALLOW_THREADS
    batch_done(self, on_delivery, produced, count);
    return PyLong_FromSsize_t(start + produced);
}

static int timeout_ms(double seconds) {
    if (seconds < 0)
        return -1; /* wait forever, like confluent-kafka */
    double ms = seconds * 1000.0;
    return ms > INT32_MAX ? INT32_MAX : (int)ms;
}

static PyObject *Producer_poll(Producer *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"timeout", NULL};
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|d:poll", names, &timeout) || producer_closed(self))
        return NULL;
    int ms = timeout_ms(timeout);
    /* Even without a wait: serving reports frees every delivered message,
     * librdkafka's work, which other threads' Python may overlap. */
    Py_BEGIN_ALLOW_THREADS
    p_rd_kafka_poll(self->rk, ms);
    Py_END_ALLOW_THREADS
    int served = serve(self);
    return served < 0 ? NULL : PyLong_FromLong(served);
}

static PyObject *Producer_flush(Producer *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"timeout", NULL};
    double timeout = -1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|d:flush", names, &timeout) || producer_closed(self))
        return NULL;
    int ms = timeout_ms(timeout);
    Py_BEGIN_ALLOW_THREADS
    p_rd_kafka_flush(self->rk, ms);
    Py_END_ALLOW_THREADS
    if (serve(self) < 0)
        return NULL;
    return PyLong_FromLong(__atomic_load_n(&self->unreported, __ATOMIC_RELAXED));
}

static PyObject *Producer_purge(Producer *self, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"in_queue", "in_flight", "blocking", NULL};
    int in_queue = 1, in_flight = 1, blocking = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "|ppp:purge", names, &in_queue, &in_flight, &blocking) ||
        producer_closed(self))
        return NULL;
    int flags = (in_queue ? RD_KAFKA_PURGE_F_QUEUE : 0) | (in_flight ? RD_KAFKA_PURGE_F_INFLIGHT : 0) |
                (blocking ? 0 : RD_KAFKA_PURGE_F_NON_BLOCKING);
    rd_kafka_resp_err_t err;
    Py_BEGIN_ALLOW_THREADS
    err = p_rd_kafka_purge(self->rk, flags);
    Py_END_ALLOW_THREADS
    if (err)
        return raise_kafka(err, NULL);
    Py_RETURN_NONE;
}

/* Forget what was recorded without calling Python: the references the reports
 * hold are released, the copies freed. */
static void drop_records(Producer *self) {
    for (size_t i = 0; i < self->n_reports; i++) {
        report_t *r = &self->reports[i];
        Py_XDECREF((PyObject *)(r->callback & ~COALESCE_BIT));
        free(r->topic);
        free(r->key);
        free(r->value);
    }
    self->n_reports = 0;
    pthread_mutex_lock(&self->events_lock);
    for (size_t i = 0; i < self->n_events; i++) {
        free(self->events[i].facility);
        free(self->events[i].text);
    }
    self->n_events = 0;
    pthread_mutex_unlock(&self->events_lock);
}

/* Destroy the handle. With ``serve_python`` (close()), the reports and
 * events of the purge are served to their callbacks, as confluent-kafka's
 * close does. Without (deallocation, possibly by the cyclic GC, when the
 * callbacks' objects may be half torn down), no Python code runs: the
 * records are dropped. Reports librdkafka still owes once destroyed are
 * never served: their callables' references are kept (a bounded leak)
 * rather than risk a use after free. */
static void destroy_handle(Producer *self, int serve_python) {
    if (!self->rk)
        return;
    rd_kafka_t *rk = self->rk;
    PyObject *et = NULL, *ev = NULL, *etb = NULL;
    Py_BEGIN_ALLOW_THREADS
    p_rd_kafka_purge(rk, RD_KAFKA_PURGE_F_QUEUE | RD_KAFKA_PURGE_F_INFLIGHT | RD_KAFKA_PURGE_F_NON_BLOCKING);
    p_rd_kafka_poll(rk, 0);
    Py_END_ALLOW_THREADS
    if (serve_python) {
        serve_events(self, &et, &ev, &etb);
        serve_reports(self, &et, &ev, &etb);
    }
    destroy_topics(self);
    Py_BEGIN_ALLOW_THREADS
    p_rd_kafka_destroy(rk);
    Py_END_ALLOW_THREADS
    self->rk = NULL;
    if (serve_python) { /* records librdkafka made while shutting down (logs, errors) */
        serve_events(self, &et, &ev, &etb);
        serve_reports(self, &et, &ev, &etb);
    }
    drop_records(self);
    if (et) {
        PyErr_Restore(et, ev, etb);
        PyErr_WriteUnraisable(NULL); /* never self: it may be in its deallocation */
    }
}

static PyObject *Producer_close(Producer *self, PyObject *unused) {
    destroy_handle(self, 1);
    Py_CLEAR(self->error_cb);
    Py_CLEAR(self->stats_cb);
    Py_CLEAR(self->logger);
    Py_CLEAR(self->checked_function);
    Py_RETURN_NONE;
}

/* Messages not reported yet (confluent-kafka's len() also counts unserved logs and errors). */
static Py_ssize_t Producer_len(Producer *self) {
    return self->rk ? (Py_ssize_t)__atomic_load_n(&self->unreported, __ATOMIC_RELAXED) : 0;
}

static int Producer_traverse(Producer *self, visitproc visit, void *arg) {
    Py_VISIT(self->error_cb);
    Py_VISIT(self->stats_cb);
    Py_VISIT(self->logger);
    Py_VISIT(self->checked_function);
    return 0;
}

static int Producer_clear(Producer *self) {
    Py_CLEAR(self->error_cb);
    Py_CLEAR(self->stats_cb);
    Py_CLEAR(self->logger);
    Py_CLEAR(self->checked_function);
    return 0;
}

static PyObject *Producer_new(PyTypeObject *type, PyObject *args, PyObject *kwargs) {
    Producer *self = (Producer *)type->tp_alloc(type, 0);
    if (self)
        pthread_mutex_init(&self->events_lock, NULL);
    return (PyObject *)self;
}

static void Producer_dealloc(Producer *self) {
    PyObject_GC_UnTrack(self);
    destroy_handle(self, 0);
    Producer_clear(self);
    pthread_mutex_destroy(&self->events_lock);
    free(self->reports);
    free(self->events);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static PyMethodDef Producer_methods[] = {
    {"produce", (PyCFunction)(void (*)(void))Producer_produce, METH_FASTCALL | METH_KEYWORDS,
     "produce(topic, value=None, key=None, partition=-1, on_delivery=None, callback=None, timestamp=0, headers=None)"},
    {"produce_many", (PyCFunction)(void (*)(void))Producer_produce_many, METH_FASTCALL,
     "produce_many(topic, messages, on_delivery, start=0) -> index of the first message not produced"},
    {"produce_packed", (PyCFunction)(void (*)(void))Producer_produce_packed, METH_FASTCALL,
     "produce_packed(topic, blob, index, seq, lsn_name, lsn_value, seq_name, on_delivery, start=0) -> "
     "index of the first message not produced"},
    {"poll", (PyCFunction)(void (*)(void))Producer_poll, METH_VARARGS | METH_KEYWORDS,
     "poll(timeout=-1): serve delivery reports, errors, logs and statistics; the number served"},
    {"flush", (PyCFunction)(void (*)(void))Producer_flush, METH_VARARGS | METH_KEYWORDS,
     "flush(timeout=-1): send at once, wait for the reports; the messages still queued"},
    {"purge", (PyCFunction)(void (*)(void))Producer_purge, METH_VARARGS | METH_KEYWORDS,
     "purge(in_queue=True, in_flight=True, blocking=True)"},
    {"close", (PyCFunction)Producer_close, METH_NOARGS, "close(): purge what is left and destroy the handle"},
    {NULL}};

static PySequenceMethods Producer_sequence = {.sq_length = (lenfunc)Producer_len};

static PyTypeObject ProducerType = {
    PyVarObject_HEAD_INIT(NULL, 0).tp_name = "cdcd.sink._rdkafka.Producer",
    .tp_basicsize = sizeof(Producer),
    .tp_flags = Py_TPFLAGS_DEFAULT | Py_TPFLAGS_HAVE_GC,
    .tp_doc = "A librdkafka producer serving delivery reports in C; see the module source.",
    .tp_new = Producer_new,
    .tp_init = (initproc)Producer_init,
    .tp_dealloc = (destructor)Producer_dealloc,
    .tp_traverse = (traverseproc)Producer_traverse,
    .tp_clear = (inquiry)Producer_clear,
    .tp_methods = Producer_methods,
    .tp_as_sequence = &Producer_sequence,
};

/* ------------------------------------------------------------------ module */

static PyObject *module_load(PyObject *module, PyObject *args) {
    const char *path;
    PyObject *error_type, *exception_type, *message_type;
    if (!PyArg_ParseTuple(args, "sOOO:load", &path, &error_type, &exception_type, &message_type))
        return NULL;
    if (!rdk_library) {
        void *library = dlopen(path, RTLD_NOW | RTLD_LOCAL);
        if (!library) {
            PyErr_Format(PyExc_OSError, "cannot open %s: %s", path, dlerror());
            return NULL;
        }
#define RDK_RESOLVE(name)                                                                                   \
    p_##name = (__typeof__(p_##name))dlsym(library, #name);                                                \
    if (!p_##name) {                                                                                        \
        PyErr_Format(PyExc_OSError, "%s has no %s", path, #name);                                           \
        dlclose(library);                                                                                   \
        return NULL;                                                                                        \
    }
        RDK_FUNCTIONS(RDK_RESOLVE)
#undef RDK_RESOLVE
        rdk_library = library;
    }
    Py_XSETREF(KafkaError_type, Py_NewRef(error_type));
    Py_XSETREF(KafkaException_type, Py_NewRef(exception_type));
    Py_XSETREF(Message_type, Py_NewRef(message_type));
    return PyLong_FromLong(p_rd_kafka_version());
}

static PyMethodDef module_methods[] = {
    {"load", module_load, METH_VARARGS,
     "load(path, KafkaError, KafkaException, Message): open librdkafka at path; its version as an int"},
    {NULL}};

static struct PyModuleDef module_def = {PyModuleDef_HEAD_INIT, "cdcd.sink._rdkafka",
                                        "A librdkafka producer serving delivery reports in C.", -1, module_methods};

PyMODINIT_FUNC PyInit__rdkafka(void) {
    if (PyType_Ready(&ProducerType) < 0)
        return NULL;
    str_on_delivery = PyUnicode_InternFromString("on_delivery");
    str_on_delivered = PyUnicode_InternFromString("on_delivered");
    str_log = PyUnicode_InternFromString("log");
    str_name = PyUnicode_InternFromString("__name__");
    if (!str_on_delivery || !str_on_delivered || !str_log || !str_name)
        return NULL;
    PyObject *module = PyModule_Create(&module_def);
    if (!module)
        return NULL;
    if (PyModule_AddObjectRef(module, "Producer", (PyObject *)&ProducerType) < 0 ||
        PyModule_AddStringConstant(module, "SOURCE_SHA256", CDCD_NATIVE_SOURCE) < 0 ||
        PyModule_AddIntConstant(module, "HEADER_VERSION", RD_KAFKA_VERSION) < 0) {
        Py_DECREF(module);
        return NULL;
    }
    return module;
}
