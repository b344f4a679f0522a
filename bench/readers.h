/* The epoll loop that bench/count.c and bench/ack.c share.
 *
 * Python hands over the subscribed sockets' fds; this reads them all until `target`
 * deliveries arrived or stdin closes. Each read is given to `take` with the tail the previous
 * read of that fd kept right before it (a marker or a line cut by a read is seen whole). It
 * reports progress on stdout as "p <count>\n" at most every `step` deliveries, and ends with
 * "done <count> <errors> <t_last_ns> <count per fd...>\n" (CLOCK_MONOTONIC, like Python's
 * time.monotonic_ns).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <time.h>
#include <unistd.h>

#define BUF_BYTES (1 << 20)
#define MAX_FDS 256

struct reader {
    int fd;
    unsigned index;
    long count;       /* deliveries taken from this fd */
    char *tail;       /* kept from the previous read, up to the `max_tail` given to serve_readers */
    size_t tail_len;  /* until `take` returns: the old tail's length */
};

/* One read, `data` = old tail + new bytes. Returns the deliveries in it, or -1 to stop; sets
 * `*keep` to how many bytes at the end to keep as the next tail; counts errors in `*errors`. */
typedef long (*take_fn)(struct reader *r, const char *data, size_t len, size_t *keep, long *errors);

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static int serve_readers(int nfds, char **fd_args, long target, long step, size_t max_tail, take_fn take) {
    if (nfds > MAX_FDS) return 2;
    static struct reader readers[MAX_FDS];
    char *buf = malloc(max_tail + BUF_BYTES);
    if (!buf) return 2;
    int ep = epoll_create1(0);
    struct epoll_event ev;
    for (int i = 0; i < nfds; i++) {
        readers[i] = (struct reader){.fd = atoi(fd_args[i]), .index = (unsigned)i, .tail = malloc(max_tail)};
        if (!readers[i].tail) return 2;
        ev.events = EPOLLIN;
        ev.data.u32 = (unsigned)i;
        if (epoll_ctl(ep, EPOLL_CTL_ADD, readers[i].fd, &ev) < 0) { perror("epoll_ctl"); return 2; }
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
            struct reader *r = &readers[i];
            char *start = buf + max_tail - r->tail_len;
            memcpy(start, r->tail, r->tail_len);
            ssize_t got_bytes = read(r->fd, buf + max_tail, BUF_BYTES);
            if (got_bytes <= 0) {
                if (got_bytes < 0 && (errno == EAGAIN || errno == EINTR)) continue;
                fprintf(stderr, "connection %u closed after %ld\n", i, r->count);
                stop = 1;
                continue;
            }
            size_t len = r->tail_len + (size_t)got_bytes, keep = 0;
            long c = take(r, start, len, &keep, &errors);
            if (c < 0 || keep > max_tail) { stop = 1; continue; }
            memcpy(r->tail, start + len - keep, keep);
            r->tail_len = keep;
            if (c) {
                r->count += c;
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
    for (int i = 0; i < nfds; i++) printf(" %ld", readers[i].count);
    printf("\n");
    fflush(stdout);
    return 0;
}
