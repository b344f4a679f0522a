/* The load generator's manual-ack consumer for MQKS, built by bench/loadgen.py.
 *
 * Like count.c, but it answers: Python subscribes the connections (consume --manual-ack) and
 * hands their fds over; this reads them (bench/readers.h), takes each whole delivery line
 * "{consumer} ok {msg_id} event=...", and after each read sends one batch ack per consumer:
 * "a ack {consumer} {msg_id} {msg_id}...\n". In Python that parsing was half a core at
 * 400k deliveries/s, which on a small machine is CPU taken from the broker under test.
 * Usage: ack TARGET STEP FD...
 */
#include "readers.h"  /* first: it defines _GNU_SOURCE */

#include <poll.h>

#define MAX_LINE (1 << 16)     /* a partial line kept between reads; a longer one is an error */
#define MAX_CONSUMERS 256      /* distinct consumer ids in one read */
#define MAX_ID 64

struct consumer {
    char id[MAX_ID];
    size_t id_len;
    char *acks;                /* "a ack {id}" then " {msg_id}" per delivery */
    size_t len, cap;
};

static struct consumer consumers[MAX_CONSUMERS];
static int n_consumers;

static void append(struct consumer *c, const char *data, size_t len) {
    if (c->len + len > c->cap) {
        c->cap = (c->len + len) * 2;
        c->acks = realloc(c->acks, c->cap);
        if (!c->acks) { perror("realloc"); exit(2); }
    }
    memcpy(c->acks + c->len, data, len);
    c->len += len;
}

static struct consumer *consumer_for(const char *id, size_t len) {
    for (int k = 0; k < n_consumers; k++)
        if (consumers[k].id_len == len && memcmp(consumers[k].id, id, len) == 0) return &consumers[k];
    if (n_consumers == MAX_CONSUMERS || len >= MAX_ID) return NULL;
    struct consumer *c = &consumers[n_consumers++];
    memcpy(c->id, id, len);
    c->id_len = len;
    c->len = 0;
    append(c, "a ack ", 6);
    append(c, id, len);
    return c;
}

/* One whole line (no newline): 1 if it was a delivery (its id added to its consumer's ack), 0 if not. */
static int take_line(const char *line, size_t len, long *errors) {
    const char *end = line + len;
    const char *sp1 = memchr(line, ' ', len);
    if (!sp1 || end - sp1 < 5) return 0;
    if (memcmp(sp1, " ok ", 4) != 0) {
        if (memmem(line, len, " error ", 7)) (*errors)++;
        return 0;
    }
    const char *msg = sp1 + 4;
    const char *sp2 = memchr(msg, ' ', (size_t)(end - msg));
    if (!sp2 || end - sp2 < 7 || memcmp(sp2, " event=", 7) != 0) return 0;  /* an answer, not a delivery */
    struct consumer *c = consumer_for(line, (size_t)(sp1 - line));
    if (!c) return 0;
    append(c, " ", 1);
    append(c, msg, (size_t)(sp2 - msg));
    return 1;
}

/* Everything in `data`, whole, to a non-blocking socket. */
static int write_all(int fd, const char *data, size_t len) {
    while (len) {
        ssize_t w = write(fd, data, len);
        if (w < 0) {
            if (errno == EINTR) continue;
            if (errno == EAGAIN) {
                struct pollfd p = {.fd = fd, .events = POLLOUT};
                poll(&p, 1, 1000);
                continue;
            }
            return -1;
        }
        data += w;
        len -= (size_t)w;
    }
    return 0;
}

static int send_acks(int fd) {
    static char *out;
    static size_t out_cap;
    size_t total = 0;
    for (int k = 0; k < n_consumers; k++) total += consumers[k].len + 1;
    if (total > out_cap) {
        out_cap = total * 2;
        out = realloc(out, out_cap);
        if (!out) { perror("realloc"); exit(2); }
    }
    size_t at = 0;
    for (int k = 0; k < n_consumers; k++) {
        struct consumer *c = &consumers[k];
        if (c->len > 6 + c->id_len) {
            memcpy(out + at, c->acks, c->len);
            at += c->len;
            out[at++] = '\n';
        }
        c->len = 6 + c->id_len;  /* keep "a ack {id}" for the next read */
    }
    return at ? write_all(fd, out, at) : 0;
}

static long take(struct reader *r, const char *data, size_t len, size_t *keep, long *errors) {
    const char *p = data, *end = data + len;
    long c = 0;
    n_consumers = 0;
    for (const char *nl; p < end && (nl = memchr(p, '\n', (size_t)(end - p))) != NULL; p = nl + 1)
        c += take_line(p, (size_t)(nl - p), errors);
    *keep = (size_t)(end - p);
    if (*keep >= MAX_LINE) {
        fprintf(stderr, "a line longer than %d bytes on connection %u\n", MAX_LINE, r->index);
        return -1;
    }
    if (send_acks(r->fd) < 0) {
        fprintf(stderr, "connection %u: acks not sent: %s\n", r->index, strerror(errno));
        return -1;
    }
    return c;
}

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: ack TARGET STEP FD...\n");
        return 2;
    }
    return serve_readers(argc - 3, argv + 3, atol(argv[1]), atol(argv[2]), MAX_LINE, take);
}
