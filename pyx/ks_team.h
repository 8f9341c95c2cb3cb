/* Kestrel kernels: the team of threads that runs a forward pass (no Python here).
 *
 * A pass is a fixed sequence of phases; each phase is a number of independent work items
 * that any thread may take. Every thread of the team walks the phases in order: it claims
 * items (from its own share of the phase first, then from the others', ks_claim) until none
 * is left, then waits until every item of the phase is done (the phase's inputs for the next
 * one). So a barrier waits only for items in flight, never for a thread that holds none: when
 * the kernel deschedules a thread (another process wants its core), the threads that run take
 * what is left of its share, and the late thread, once back, finds the finished phases empty
 * and joins where the others are, or, if the pass is over, waits for the next one. OpenMP's
 * teams (and llama.cpp's pool) instead give each thread a fixed share that only it does and
 * make every barrier wait for every thread, so one descheduled thread stops all of them for a
 * whole time slice, at every barrier.
 *
 * Waits spin briefly (a phase normally ends within microseconds), then sleep on a futex so
 * that the core is free for whatever holds the awaited item: an idle core is where Linux
 * moves a preempted runnable thread. Results do not depend on which thread takes an item.
 *
 * Where the team is lives in one word, `now` (pass << 32 | phase): the thread that finishes a
 * phase's last item moves it on. Only a thread that finds `now` at its own phase may claim,
 * or even count, that phase's items: a late thread must not, because a phase's item count
 * is worked out from data that later phases overwrite (the next layer's routing, the next
 * pass's job), and claiming with a stale count would do work that does not exist and count
 * it into a later phase. Claim counters also carry the pass number in their high 32 bits.
 */
#ifndef KS_TEAM_H
#define KS_TEAM_H

#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#if defined(__linux__)
#  include <linux/futex.h>
#  include <sys/prctl.h>
#  include <sys/syscall.h>
#  include <unistd.h>
#else
#  include <sched.h>
#endif

#define KS_SPIN_NS 20000      /* a wait spins this long before it sleeps */

/* One thread's share of a phase's items in the current pass: its claim counter (pass << 32 |
 * items of the share claimed), on a cache line of its own. */
typedef struct {
    uint64_t next;
    char pad[64 - sizeof(uint64_t)];
} ks_share;

/* The number of a phase's items done in the current pass, on a cache line of its own. */
typedef struct {
    uint32_t done;
    char pad[64 - sizeof(uint32_t)];
} ks_phase;

struct ks_team;
typedef void (*ks_team_fn)(struct ks_team *T, int tid, uint32_t pass);

typedef struct ks_team {
    int nthreads;                 /* the caller (tid 0) and nthreads - 1 workers */
    int n_phases;                 /* phases a pass may have */
    ks_phase *phases;
    ks_share *shares;             /* (n_phases, nthreads): share s of phase p at p * nthreads + s */
    pthread_t *workers;
    ks_team_fn fn;                /* what a pass runs, on every thread */
    const void *job;              /* its arguments, read by fn */
    uint64_t now;                 /* pass << 32 | the phase the team is in (pass 0: none yet) */
    uint32_t seq;                 /* futex word: bumped whenever something is published */
    uint32_t sleepers;            /* threads asleep on seq */
    int stop;
    uint32_t *items;              /* (nthreads) items each thread took in its last pass */
} ks_team;

typedef struct { ks_team *team; int tid; } ks_worker;

static inline int64_t ks_now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

static inline void ks_futex_wait(uint32_t *addr, uint32_t seen)
{
#if defined(__linux__)
    syscall(SYS_futex, addr, FUTEX_WAIT_PRIVATE, seen, NULL, NULL, 0);
#else
    (void)addr; (void)seen;
    sched_yield();
#endif
}

static inline void ks_futex_wake_all(uint32_t *addr)
{
#if defined(__linux__)
    syscall(SYS_futex, addr, FUTEX_WAKE_PRIVATE, INT_MAX, NULL, NULL, 0);
#else
    (void)addr;
#endif
}

/* Publishes what this thread just made visible (a finished phase, a new pass, stop). */
static inline void ks_team_publish(ks_team *T)
{
    __atomic_fetch_add(&T->seq, 1, __ATOMIC_SEQ_CST);
    if (__atomic_load_n(&T->sleepers, __ATOMIC_SEQ_CST))
        ks_futex_wake_all(&T->seq);
}

/* What a wait waits for: the team to have left `now` (a phase of a pass), or with
 * whole_pass, to have left now's pass, or stop. */
typedef struct {
    uint64_t now;
    int whole_pass;
} ks_wait_for;

static inline int ks_waited(const ks_team *T, const ks_wait_for *f)
{
    const uint64_t now = __atomic_load_n(&T->now, __ATOMIC_ACQUIRE);
    if (f->whole_pass)
        return (now >> 32) != (f->now >> 32) || __atomic_load_n(&T->stop, __ATOMIC_ACQUIRE);
    return now != f->now;
}

/* Waits for f: spins for KS_SPIN_NS, then sleeps on T->seq until a publish. */
static inline void ks_team_wait(ks_team *T, const ks_wait_for *f)
{
    if (ks_waited(T, f))
        return;
    const int64_t until = ks_now_ns() + KS_SPIN_NS;
    for (int i = 1;; i++) {
        ks_cpu_relax();
        if (ks_waited(T, f))
            return;
        if ((i & 63) == 0 && ks_now_ns() > until)
            break;
    }
    __atomic_fetch_add(&T->sleepers, 1, __ATOMIC_SEQ_CST);
    for (;;) {
        const uint32_t seen = __atomic_load_n(&T->seq, __ATOMIC_SEQ_CST);
        if (ks_waited(T, f))
            break;
        ks_futex_wait(&T->seq, seen);
    }
    __atomic_fetch_sub(&T->sleepers, 1, __ATOMIC_SEQ_CST);
}

/* ---- inside a pass: one thread's walk over the phases ------------------------------------ */

typedef struct {
    ks_team *team;
    uint32_t pass;
    int phase;        /* index of the current phase */
    int tid;
    uint32_t taken;   /* items this thread took in this pass */
    int scan;         /* shares found empty: the next to try is (tid + scan) % nthreads */
    int held;         /* items taken in this phase and not yet counted done */
    int next, end;    /* the run of items claimed last: next .. end - 1 still to do */
    int last;         /* this thread counted the phase's last item: it closes the phase */
} ks_walk;

static inline uint64_t ks_walk_now(const ks_walk *w)
{
    return (uint64_t)w->pass << 32 | (uint32_t)w->phase;
}

/* Whether the team is in this walk's phase (so its item count may be worked out). */
static inline int ks_phase_open(const ks_walk *w)
{
    return __atomic_load_n(&w->team->now, __ATOMIC_ACQUIRE) == ks_walk_now(w);
}

/* Moves the team from this walk's phase to the next one, once. */
static inline void ks_phase_close(ks_walk *w)
{
    uint64_t expect = ks_walk_now(w);
    if (__atomic_compare_exchange_n(&w->team->now, &expect, expect + 1, 0, __ATOMIC_SEQ_CST,
                                    __ATOMIC_RELAXED))
        ks_team_publish(w->team);
}

/* Items [lo, hi) of the phase's `items` that are share s of nthreads. */
static inline void ks_share_bounds(int items, int s, int nthreads, int *lo, int *hi)
{
    *lo = (int)((int64_t)items * s / nthreads);
    *hi = (int)((int64_t)items * (s + 1) / nthreads);
}

/* The next item of the walk's current phase (0 .. items - 1) for this thread to do, or -1:
 * none left, or the team is past this phase (items < 0: KS_EACH_ITEM found it so).
 *
 * A phase's items are cut into one contiguous share per thread. A thread claims from its own
 * share first, in runs of a quarter of what is left of it (down to one), then from the
 * others' shares in turn, the same way. So a thread that runs walks one stretch of a
 * matrix, each run next to the one before: the prefetches of a run's last tile ask for the
 * next run's first, and the claims touch a cache line no other thread writes until the
 * share is nearly done. Yet what a descheduled thread holds is one run, a small part of the
 * phase; the threads that run take the rest of its share.
 *
 * A thread counts the items it took as done once, when it finds none left, and the thread
 * that counts the last one (of an empty phase: the first to look) is the phase's last
 * (ks_phase_last), which closes it in ks_phase_end. (While a thread holds uncounted items
 * the phase stays open, so its count is the phase's own.) */
static inline int ks_claim(ks_walk *w, int items)
{
    if (w->next < w->end)
        return w->next++;
    ks_team *T = w->team;
    const int P = T->nthreads;
    ks_share *shares = T->shares + (int64_t)w->phase * P;
    for (; items > 0 && w->scan < P; w->scan++) {
        const int s = (w->tid + w->scan) % P;
        int lo, hi;
        ks_share_bounds(items, s, P, &lo, &hi);
        uint64_t v = __atomic_load_n(&shares[s].next, __ATOMIC_ACQUIRE);
        for (;;) {
            const int at = lo + (int)(uint32_t)v;
            if ((uint32_t)(v >> 32) != w->pass || at >= hi)
                break;
            int run = (hi - at) / 4;
            run = run < 1 ? 1 : run;
            if (__atomic_compare_exchange_n(&shares[s].next, &v, v + (uint64_t)run, 1,
                                            __ATOMIC_ACQ_REL, __ATOMIC_ACQUIRE)) {
                w->taken += (uint32_t)run;
                w->held += run;
                w->next = at + 1;
                w->end = at + run;
                return at;
            }
        }
    }
    if (w->held > 0) {
        ks_phase *ph = &T->phases[w->phase];
        if ((int)__atomic_add_fetch(&ph->done, (uint32_t)w->held, __ATOMIC_SEQ_CST) == items)
            w->last = 1;
        w->held = 0;
    }
    if (items == 0) {    /* an empty phase: the one thread whose claim lands closes it */
        uint64_t v = (uint64_t)w->pass << 32;
        if (__atomic_compare_exchange_n(&shares[0].next, &v, v + 1, 0, __ATOMIC_ACQ_REL,
                                        __ATOMIC_RELAXED))
            w->last = 1;
    }
    return -1;
}

/* Whether this thread finished the current phase's last item (its KS_EACH_ITEM loop is
 * over): then what must follow the whole phase and is too small for a phase of its own (one
 * token's residual add and norm) is this thread's to do, before its ks_phase_end lets the
 * team on; the others wait for it as they would at a phase of one item, minus a hand-over. */
static inline int ks_phase_last(const ks_walk *w) { return w->last; }

/* Ends the walk's current phase: closes it if this thread is its last, and waits until the
 * team has left it; 1 then (the walk moves to the next phase: a late thread finds it closed
 * too and passes through), 0 if the pass is over. */
static inline int ks_phase_end(ks_walk *w)
{
    if (w->last) {
        w->last = 0;
        ks_phase_close(w);
    }
    const ks_wait_for f = {ks_walk_now(w), 0};
    ks_team_wait(w->team, &f);
    if ((__atomic_load_n(&w->team->now, __ATOMIC_ACQUIRE) >> 32) != w->pass)
        return 0;
    w->phase++;
    w->scan = w->next = w->end = 0;
    return 1;
}

/* Every item of the current phase, for `it` from 0 .. items - 1, by whichever threads get
 * there (`items` is evaluated only while the team is in this phase); then
 * `if (!ks_phase_end(w)) return;` */
#define KS_EACH_ITEM(w, items, it) \
    for (int it; ((it) = ks_claim((w), ks_phase_open(w) ? (int)(items) : -1)) >= 0;)

/* ---- the team's life ---------------------------------------------------------------------- */

static void *ks_worker_main(void *arg)
{
    ks_team *T = ((ks_worker *)arg)->team;
    const int tid = ((ks_worker *)arg)->tid;
    uint64_t seen = 0;
    free(arg);
#if defined(__linux__)
    prctl(PR_SET_NAME, "kestrel-forward", 0, 0, 0);     /* as top -H and /proc show it */
#endif
    for (;;) {
        const ks_wait_for next = {seen, 1};
        ks_team_wait(T, &next);
        if (__atomic_load_n(&T->stop, __ATOMIC_ACQUIRE))
            return NULL;
        seen = __atomic_load_n(&T->now, __ATOMIC_ACQUIRE);
        T->fn(T, tid, (uint32_t)(seen >> 32));
    }
}

static void ks_team_free(ks_team *T);

/* A team of nthreads (the caller and nthreads - 1 new threads) for passes of up to n_phases
 * phases of fn; 0, or -1 with nothing left allocated. */
static int ks_team_init(ks_team *T, int nthreads, int n_phases, ks_team_fn fn)
{
    void *mem = NULL;
    memset(T, 0, sizeof *T);
    T->fn = fn;
    T->n_phases = n_phases;
    if (posix_memalign(&mem, 64, sizeof(ks_phase) * (size_t)n_phases) != 0)
        return -1;
    T->phases = mem;
    memset(T->phases, 0, sizeof(ks_phase) * (size_t)n_phases);
    const size_t share_bytes = sizeof(ks_share) * (size_t)n_phases * (size_t)nthreads;
    if (posix_memalign(&mem, 64, share_bytes) != 0)
        mem = NULL;
    T->shares = mem;
    T->items = calloc((size_t)nthreads, sizeof(uint32_t));
    T->workers = calloc((size_t)nthreads, sizeof(pthread_t));
    if (!T->shares || !T->items || !T->workers) {
        ks_team_free(T);
        return -1;
    }
    for (int tid = 1; tid < nthreads; tid++) {
        ks_worker *arg = malloc(sizeof *arg);
        if (!arg || (arg->team = T, arg->tid = tid,
                     pthread_create(&T->workers[tid], NULL, ks_worker_main, arg) != 0)) {
            free(arg);
            ks_team_free(T);
            return -1;
        }
        T->nthreads = tid + 1;    /* the threads started so far, for ks_team_free */
    }
    T->nthreads = nthreads;
    return 0;
}

/* Stops and joins the workers, frees the team's memory. */
static void ks_team_free(ks_team *T)
{
    __atomic_store_n(&T->stop, 1, __ATOMIC_RELEASE);
    ks_team_publish(T);
    for (int tid = 1; tid < T->nthreads; tid++)
        pthread_join(T->workers[tid], NULL);
    free(T->phases);
    free(T->shares);
    free(T->items);
    free(T->workers);
    memset(T, 0, sizeof *T);
}

/* Runs one pass of the team's fn over job, the caller taking part as thread 0; returns when
 * every phase is done. Only one thread may call this, one pass at a time. */
static void ks_team_run(ks_team *T, const void *job)
{
    uint32_t pass = (uint32_t)(__atomic_load_n(&T->now, __ATOMIC_RELAXED) >> 32) + 1;
    if (pass == 0)
        pass = 1;
    T->job = job;
    for (int p = 0; p < T->n_phases; p++) {
        for (int s = 0; s < T->nthreads; s++)
            __atomic_store_n(&T->shares[p * T->nthreads + s].next, (uint64_t)pass << 32,
                             __ATOMIC_RELAXED);
        __atomic_store_n(&T->phases[p].done, 0, __ATOMIC_RELEASE);
    }
    __atomic_store_n(&T->now, (uint64_t)pass << 32, __ATOMIC_SEQ_CST);
    ks_team_publish(T);
    T->fn(T, 0, pass);
}

/* Threads that took work in their last pass (the threads that get to run, under load). */
static inline int ks_team_working(const ks_team *T)
{
    int n = 0;
    for (int tid = 0; tid < T->nthreads; tid++)
        n += __atomic_load_n(&T->items[tid], __ATOMIC_RELAXED) > 0;
    return n;
}

#endif /* KS_TEAM_H */
