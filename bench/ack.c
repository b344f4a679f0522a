/* The load generator's manual-ack consumer for MQKS, built by bench/loadgen.py.
 *
 * Like count.c, but it answers: Python subscribes the connections (consume --manual-ack) and
 * hands their fds over; this reads them all through epoll, takes each whole delivery line
 * "{consumer} ok {msg_id} event=...", and after each read sends one batch ack per consumer:
 * "a ack {consumer} {msg_id} {msg_id}...\n". In Python that parsing was half a core at
 * 400k deliveries/s, which on a small machine is CPU taken from the broker under test.
 * Output as count.c: "p <count>\n" at most every `step` deliveries, then
 * "done <count> <errors> <t_last_ns> <count per fd...>\n". Usage: ack TARGET STEP FD...
 */
#define _GNU_SOURCE
#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#define BUF_BYTES (1 << 20)
#define MAX_FDS 256
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

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

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

int main(int argc, char **argv) {
    if (argc < 4) {
        fprintf(stderr, "usage: ack TARGET STEP FD...\n");
        return 2;
    }
    long target = atol(argv[1]), step = atol(argv[2]);
    int nfds = argc - 3;
    if (nfds > MAX_FDS) return 2;
    static int fds[MAX_FDS];
    static long per_fd[MAX_FDS];
    static char *tails[MAX_FDS];
    static size_t tail_len[MAX_FDS];
    static char buf[MAX_LINE + BUF_BYTES];

    int ep = epoll_create1(0);
    struct epoll_event ev;
    for (int i = 0; i < nfds; i++) {
        fds[i] = atoi(argv[3 + i]);
        tails[i] = malloc(MAX_LINE);
        ev.events = EPOLLIN;
        ev.data.u32 = (unsigned)i;
        if (epoll_ctl(ep, EPOLL_CTL_ADD, fds[i], &ev) < 0) { perror("epoll_ctl"); return 2; }
    }
    ev.events = EPOLLIN;  /* stdin closing means: stop now */
    ev.data.u32 = MAX_FDS;
    epoll_ctl(ep, EPOLL_CTL_ADD, 0, &ev);

    long got = 0, errors = 0, reported = 0;
    long long t_last = 0;
    struct epoll_event events[64];
    while (got < target) {
        int n = epoll_wait(ep, events, 64, 1000);
        if (n < 0) {
            if (errno == EINTR) continue;
            break;
        }
        int stop = 0;
        for (int k = 0; k < n; k++) {
            unsigned i = events[k].data.u32;
            if (i == MAX_FDS) { stop = 1; continue; }
            /* the partial last line of the previous read goes right before the new bytes */
            char *start = buf + MAX_LINE - tail_len[i];
            memcpy(start, tails[i], tail_len[i]);
            ssize_t r = read(fds[i], buf + MAX_LINE, BUF_BYTES);
            if (r <= 0) {
                if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
                fprintf(stderr, "connection %u closed after %ld\n", i, per_fd[i]);
                stop = 1;
                continue;
            }
            const char *p = start, *end = buf + MAX_LINE + r;
            long c = 0;
            n_consumers = 0;
            for (const char *nl; p < end && (nl = memchr(p, '\n', (size_t)(end - p))) != NULL; p = nl + 1)
                c += take_line(p, (size_t)(nl - p), &errors);
            if ((size_t)(end - p) >= MAX_LINE) {
                fprintf(stderr, "a line longer than %d bytes on connection %u\n", MAX_LINE, i);
                stop = 1;
                continue;
            }
            tail_len[i] = (size_t)(end - p);
            memcpy(tails[i], p, tail_len[i]);
            if (send_acks(fds[i]) < 0) {
                fprintf(stderr, "connection %u: acks not sent: %s\n", i, strerror(errno));
                stop = 1;
                continue;
            }
            if (c) {
                per_fd[i] += c;
                got += c;
                t_last = now_ns();
            }
        }
        if (got - reported >= step || (got >= target && got != reported)) {
            printf("p %ld\n", got);
            fflush(stdout);
            reported = got;
        }
        if (stop) break;
    }
    printf("done %ld %ld %lld", got, errors, t_last);
    for (int i = 0; i < nfds; i++) printf(" %ld", per_fd[i]);
    printf("\n");
    fflush(stdout);
    return 0;
}
