/* librdkafka's own CPU per message, with no Python in the process.
 *
 * Built and run by tests/bench/bench_kafka_floor.py, which links it against
 * the librdkafka that confluent-kafka ships. Usage:
 *
 *   kafka_floor MESSAGES HEADERS TOPIC MESSAGE_FILE [PROPERTY VALUE]...
 *
 * MESSAGE_FILE holds the messages to send, cycled: a 4-byte big-endian key
 * length (0xFFFFFFFF: null key), the key, a 4-byte value length, the value.
 * HEADERS=1 adds the two headers every cdcd change message carries (a commit
 * LSN and an ordinal). Every message gets a delivery report, counted here (a
 * failed one makes the run fail). Prints one JSON line: CPU seconds of this
 * process (all threads, librdkafka's included) from the first produce to the
 * end of the flush, wall seconds, messages.
 */
#include <librdkafka/rdkafka.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <time.h>

typedef struct {
    const char *key;
    size_t key_len;
    const char *value;
    size_t value_len;
} sample_t;

static long delivered, failed;

static void on_delivery(rd_kafka_t *rk, const rd_kafka_message_t *msg, void *opaque) {
    if (msg->err)
        failed++;
    else
        delivered++;
}

static double cpu_seconds(void) {
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    return usage.ru_utime.tv_sec + usage.ru_utime.tv_usec / 1e6 + usage.ru_stime.tv_sec +
           usage.ru_stime.tv_usec / 1e6;
}

static double wall_seconds(void) {
    struct timespec now;
    clock_gettime(CLOCK_MONOTONIC, &now);
    return now.tv_sec + now.tv_nsec / 1e9;
}

static uint32_t read_u32(const unsigned char *p) {
    return ((uint32_t)p[0] << 24) | ((uint32_t)p[1] << 16) | ((uint32_t)p[2] << 8) | p[3];
}

/* The samples of MESSAGE_FILE; they point into its contents, which stay loaded. */
static sample_t *load_samples(const char *path, size_t *count) {
    FILE *file = fopen(path, "rb");
    if (!file) {
        perror(path);
        exit(2);
    }
    fseek(file, 0, SEEK_END);
    long size = ftell(file);
    fseek(file, 0, SEEK_SET);
    unsigned char *data = malloc(size);
    if (fread(data, 1, size, file) != (size_t)size) {
        fprintf(stderr, "%s: short read\n", path);
        exit(2);
    }
    fclose(file);
    size_t capacity = 1024, n = 0;
    sample_t *samples = malloc(capacity * sizeof *samples);
    long at = 0;
    while (at + 8 <= size) {
        if (n == capacity)
            samples = realloc(samples, (capacity *= 2) * sizeof *samples);
        uint32_t key_len = read_u32(data + at);
        at += 4;
        samples[n].key = key_len == UINT32_MAX ? NULL : (const char *)data + at;
        samples[n].key_len = key_len == UINT32_MAX ? 0 : key_len;
        at += samples[n].key_len;
        uint32_t value_len = read_u32(data + at);
        at += 4;
        samples[n].value = (const char *)data + at;
        samples[n].value_len = value_len;
        at += value_len;
        if (at > size) {
            fprintf(stderr, "%s: truncated at message %zu\n", path, n);
            exit(2);
        }
        n++;
    }
    *count = n;
    return samples;
}

int main(int argc, char **argv) {
    if (argc < 5 || argc % 2 == 0) {
        fprintf(stderr, "usage: %s MESSAGES HEADERS TOPIC MESSAGE_FILE [PROPERTY VALUE]...\n", argv[0]);
        return 2;
    }
    long total = atol(argv[1]);
    int headers = atoi(argv[2]);
    const char *topic = argv[3];
    size_t count;
    sample_t *samples = load_samples(argv[4], &count);
    if (count == 0) {
        fprintf(stderr, "no messages in %s\n", argv[4]);
        return 2;
    }
    char err[512];
    rd_kafka_conf_t *conf = rd_kafka_conf_new();
    for (int i = 5; i + 1 < argc; i += 2)
        if (rd_kafka_conf_set(conf, argv[i], argv[i + 1], err, sizeof err) != RD_KAFKA_CONF_OK) {
            fprintf(stderr, "%s\n", err);
            return 2;
        }
    rd_kafka_conf_set_dr_msg_cb(conf, on_delivery);
    rd_kafka_t *rk = rd_kafka_new(RD_KAFKA_PRODUCER, conf, err, sizeof err);
    if (!rk) {
        fprintf(stderr, "%s\n", err);
        return 2;
    }
    /* Connected and holding a producer id before the measurement starts. */
    rd_kafka_producev(rk, RD_KAFKA_V_TOPIC(topic), RD_KAFKA_V_VALUE("warm-up", 7), RD_KAFKA_V_END);
    rd_kafka_flush(rk, 30000);
    delivered = failed = 0;

    double cpu_start = cpu_seconds(), wall_start = wall_seconds();
    char seq[24];
    for (long i = 0; i < total; i++) {
        const sample_t *s = &samples[i % count];
        for (;;) {
            rd_kafka_resp_err_t e;
            if (headers) {
                int seq_len = snprintf(seq, sizeof seq, "%ld", i);
                rd_kafka_headers_t *h = rd_kafka_headers_new(2);
                rd_kafka_header_add(h, "cdcd.lsn", 8, "0/1A2B3C4D", 10);
                rd_kafka_header_add(h, "cdcd.seq", 8, seq, seq_len);
                e = rd_kafka_producev(rk, RD_KAFKA_V_TOPIC(topic), RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
                                      RD_KAFKA_V_KEY(s->key, s->key_len),
                                      RD_KAFKA_V_VALUE((void *)s->value, s->value_len),
                                      RD_KAFKA_V_HEADERS(h), RD_KAFKA_V_END);
                if (e)
                    rd_kafka_headers_destroy(h); /* not taken: ours to free */
            } else {
                e = rd_kafka_producev(rk, RD_KAFKA_V_TOPIC(topic), RD_KAFKA_V_MSGFLAGS(RD_KAFKA_MSG_F_COPY),
                                      RD_KAFKA_V_KEY(s->key, s->key_len),
                                      RD_KAFKA_V_VALUE((void *)s->value, s->value_len), RD_KAFKA_V_END);
            }
            if (e == RD_KAFKA_RESP_ERR_NO_ERROR)
                break;
            if (e != RD_KAFKA_RESP_ERR__QUEUE_FULL) {
                fprintf(stderr, "produce: %s\n", rd_kafka_err2str(e));
                return 1;
            }
            /* A full queue is sent now, whatever linger.ms says, as cdcd's sink first does. */
            rd_kafka_flush(rk, 2);
        }
        if ((i & 1023) == 0)
            rd_kafka_poll(rk, 0);
    }
    while (rd_kafka_outq_len(rk) > 0)
        rd_kafka_flush(rk, 1000);
    double cpu = cpu_seconds() - cpu_start, wall = wall_seconds() - wall_start;
    rd_kafka_destroy(rk);
    if (failed || delivered != total) {
        fprintf(stderr, "delivered %ld of %ld, %ld failed\n", delivered, total, failed);
        return 1;
    }
    printf("{\"messages\": %ld, \"cpu_s\": %.4f, \"seconds\": %.4f, \"librdkafka\": \"%s\"}\n", total, cpu,
           wall, rd_kafka_version_str());
    return 0;
}
