/* The load generator's counting consumer for push protocols, built by bench/loadgen.py.
 *
 * Python sets the connections up (subscribe, confirm) and hands their fds over; this only
 * reads them all through epoll and counts a marker (and an error needle) across chunk
 * boundaries until `target` markers arrived or stdin closes. It reports progress on stdout
 * as "p <count>\n" at most every `step` markers, and ends with
 * "done <count> <errors> <t_last_ns> <count per fd...>\n" (CLOCK_MONOTONIC, like Python's
 * time.monotonic_ns). Usage: count MARKER ERROR_NEEDLE TARGET STEP FD...
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
#define KEEP 64

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (long long)t.tv_sec * 1000000000LL + t.tv_nsec;
}

static long count_in(const char *data, size_t len, const char *needle, size_t nlen) {
    long n = 0;
    const char *p = data, *end = data + len;
    while (p < end && (p = memmem(p, (size_t)(end - p), needle, nlen)) != NULL) {
        n++;
        p += nlen;
    }
    return n;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: count MARKER ERROR_NEEDLE TARGET STEP FD...\n");
        return 2;
    }
    const char *marker = argv[1], *err = argv[2];
    size_t mlen = strlen(marker), elen = strlen(err);
    long target = atol(argv[3]), step = atol(argv[4]);
    int nfds = argc - 5;
    if (nfds > MAX_FDS || mlen == 0 || mlen >= KEEP || elen >= KEEP) return 2;
    static int fds[MAX_FDS];
    static long per_fd[MAX_FDS];
    static char tails[MAX_FDS][KEEP];
    static size_t tail_len[MAX_FDS];
    static char buf[KEEP + BUF_BYTES];
    size_t keep = (mlen > elen ? mlen : elen) - 1;

    int ep = epoll_create1(0);
    struct epoll_event ev;
    for (int i = 0; i < nfds; i++) {
        fds[i] = atoi(argv[5 + i]);
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
            /* the previous tail goes right before the new bytes: a marker split across reads counts once */
            char *start = buf + KEEP - tail_len[i];
            memcpy(start, tails[i], tail_len[i]);
            ssize_t r = read(fds[i], buf + KEEP, BUF_BYTES);
            if (r <= 0) {
                if (r < 0 && (errno == EAGAIN || errno == EINTR)) continue;
                fprintf(stderr, "connection %u closed after %ld\n", i, per_fd[i]);
                stop = 1;
                continue;
            }
            size_t len = tail_len[i] + (size_t)r;
            /* a match wholly inside the old tail was counted last time */
            long c = count_in(start, len, marker, mlen) - count_in(start, tail_len[i], marker, mlen);
            if (elen) errors += count_in(start, len, err, elen) - count_in(start, tail_len[i], err, elen);
            size_t t = len < keep ? len : keep;
            memcpy(tails[i], start + len - t, t);
            tail_len[i] = t;
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
