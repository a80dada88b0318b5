/* How the receiver's gathers and scatters (_changes.c) and its one-call classification
 * (_digest.c) request the lines of changes PREFETCH positions ahead. A receiver's changes
 * are one or two per cache line, too far apart for the hardware prefetcher to find alone.
 *
 * Where the changes lie DENSE_GAP bytes apart or closer on average, a line goes to L2
 * (prefetcht1), whose streamer then fetches the lines between them too, most of which the
 * next changes use; where they lie further apart, to L1 only (prefetchnta), leaving the
 * streamer untrained (the lines it would fetch go unused). On a 2-core Xeon host, one
 * core, 512 MiB of bf16 out of cache, one-off builds alternating (ns a change, t1 against
 * nta, random sorted positions): gather 5.1-6.1 against 9.0-9.5 at 1% changed, 4.9-5.0
 * against 8.2-8.3 at 3%, 2.0 against 3.0-3.1 at 10%; scatter 7.0-7.2 against 9.9-10.0,
 * 5.1-5.3 against 7.6-7.7, 2.1-2.2 against 3.4; but at 0.2-0.4% nta was the faster by
 * 10-40%. With the choice by density, tools/bench_percost.py --gib 0.25 --repeats 3's apply
 * stages classify and scatter took 2.5 and 2.0 ns a change against 4.1 and 3.2. */
#ifndef DCR_PREFETCH_H
#define DCR_PREFETCH_H

#include <stddef.h>
#include <stdint.h>

#define PREFETCH 64
#define DENSE_GAP 224

/* Whether k changes at sorted positions lie DENSE_GAP bytes apart or closer, on average
 * (unsorted ones count as far apart). */
static inline int prefetch_dense(const int64_t *pos, ptrdiff_t k, size_t width) {
    return k > 1 && pos[k - 1] > pos[0] &&
           (uint64_t)(pos[k - 1] - pos[0]) * width <= (uint64_t)(k - 1) * DENSE_GAP;
}

/* One request for the line holding p (__builtin_prefetch takes its locality as a constant). */
#define PREFETCH_LINE(p, dense)                                                      \
    do {                                                                             \
        if (dense)                                                                   \
            __builtin_prefetch((p), 0, 2);                                           \
        else                                                                         \
            __builtin_prefetch((p), 0, 0);                                           \
    } while (0)

#endif
