/* The load generator's counting consumer for push protocols, built by bench/loadgen.py.
 *
 * Python sets the connections up (subscribe, confirm) and hands their fds over; this only
 * reads them (bench/readers.h) and counts a marker, and an error needle, across read
 * boundaries. Usage: count MARKER ERROR_NEEDLE TARGET STEP FD...
 */
#include "readers.h"

#define KEEP 64

static const char *marker, *err;
static size_t mlen, elen, keep_bytes;

static long count_in(const char *data, size_t len, const char *needle, size_t nlen) {
    long n = 0;
    const char *p = data, *end = data + len;
    while (p < end && (p = memmem(p, (size_t)(end - p), needle, nlen)) != NULL) {
        n++;
        p += nlen;
    }
    return n;
}

static long take(struct reader *r, const char *data, size_t len, size_t *keep, long *errors) {
    /* a match wholly inside the old tail was counted last time */
    long c = count_in(data, len, marker, mlen) - count_in(data, r->tail_len, marker, mlen);
    if (elen) *errors += count_in(data, len, err, elen) - count_in(data, r->tail_len, err, elen);
    *keep = len < keep_bytes ? len : keep_bytes;
    return c;
}

int main(int argc, char **argv) {
    if (argc < 6) {
        fprintf(stderr, "usage: count MARKER ERROR_NEEDLE TARGET STEP FD...\n");
        return 2;
    }
    marker = argv[1];
    err = argv[2];
    mlen = strlen(marker);
    elen = strlen(err);
    if (mlen == 0 || mlen >= KEEP || elen >= KEEP) return 2;
    keep_bytes = (mlen > elen ? mlen : elen) - 1;
    return serve_readers(argc - 5, argv + 5, atol(argv[3]), atol(argv[4]), KEEP, take);
}
