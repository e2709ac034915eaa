/* The expert reader's lanes in C: threads that serve one priority queue of reads.

   `bmoe.engine.experts.reader.LaneQueue` is the same queue on Python threads. Each
   Python lane needs the GIL to take a read, move its pages and start the `preadv`, so a
   lane competes with the engine thread (which runs the routing callback while llama.cpp's
   other compute thread waits for it) and the engine thread waits for the lanes. These
   lanes are plain pthreads that never touch Python: the engine thread hands them a
   group of reads (`submit`), and waits for groups with the GIL released (`wait`).

   A read is (file offset, length, address where that file byte lands, the bounds of the
   buffer it lands in, page moves). Its page moves run first, in the lane: each hands a
   victim's committed pages to the slice (`mremap` with MREMAP_DONTUNMAP), or frees them
   (`madvise(MADV_DONTNEED)`) once a move has failed. Then the read: with O_DIRECT, the
   page-aligned superset of the slice (the buffer's page phase equals the slice's in the
   file, so it is aligned in memory too and ends inside the buffer), falling back to the
   buffered descriptor for good when the kernel refuses a direct read (EINVAL); else the
   slice itself through the page cache.

   Every address range a read writes is checked against its buffer's bounds at `submit`,
   in the caller's thread, so a bad read is a ValueError and never a write elsewhere.
   Errors are kept in the group as (kind, errno, offset) and turned into the reader's own
   exceptions by the `on_error` callable the queue was made with (reader.py). */

#define PY_SSIZE_T_CLEAN
#define _GNU_SOURCE
#include <Python.h>

#include <errno.h>
#include <stddef.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#if defined(__SSE2__)
#include <emmintrin.h>
#endif

#ifndef MREMAP_DONTUNMAP
#define MREMAP_DONTUNMAP 4
#endif

#define KIND_READ 1      /* a read failed: errno, the slice's file offset */
#define KIND_SHORT 2     /* the file ended early: the offset where it did */
#define KIND_CLOSED 3    /* the queue closed before the read ran */
#define KIND_FREE 4      /* madvise(MADV_DONTNEED) failed: errno */

typedef struct {
    int64_t src, dst, n;
} Move;

struct GroupC;

typedef struct {
    struct GroupC *g;
    int64_t off, len;     /* the slice in the file */
    int64_t addr;         /* where file byte `off` lands */
    int64_t lo, hi;       /* the buffer it lands in */
    Move *moves;
    int nmoves;
    int taken;
} Item;

typedef struct GroupC {
    int refs;             /* the Python object + heap entries + reads running */
    int left;             /* reads not finished */
    int prio;
    int waited;           /* callers waiting on it: a finish wakes them */
    int64_t nbytes;
    int kind, err;
    int64_t at;
    int n_items;
    Item *items;
    Move *moves;
} GroupC;

typedef struct {
    int prio;
    uint64_t seq;
    Item *it;
} Entry;

/* A buffer whose expert slices are rewritten in llama.cpp's repacked MXFP4 layout after
   each read (see pack_mxfp4_8): [lo, hi) the buffer, `start` where its first expert's
   bytes begin, `rowbytes` one weight row's bytes in the file's layout. */
typedef struct {
    int64_t lo, hi, start, rowbytes;
} Pack;

typedef struct {
    PyObject_HEAD
    pthread_mutex_t mu;
    pthread_cond_t work;  /* lanes wait for reads */
    pthread_cond_t done;  /* callers wait for groups */
    int sync_ok;
    Entry *heap;
    size_t n_heap, cap_heap;
    uint64_t seq;
    int closed, idle, joined;
    int n_lanes, started;
    pthread_t *threads;
    int direct_fd, buffered_fd;
    int64_t file_size, page;
    int use_direct;       /* atomics: a lane may clear them */
    int refused_errno;
    int recycle;
    int exact;            /* write only the slice's own bytes (see read_exact) */
    Pack *packs;          /* buffers whose slices are repacked after their read */
    Py_ssize_t n_packs;
    int64_t moved_bytes;
    double busy_s;        /* summed lane time spent on reads (under mu) */
    PyObject *on_error;
} Lanes;

typedef struct {
    PyObject_HEAD
    Lanes *q;
    GroupC *g;
    PyObject *error;
} Group;

static PyTypeObject LanesType;
static PyTypeObject GroupType;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* ---- the heap (under mu) ---- */

static int entry_less(const Entry *a, const Entry *b) {
    return a->prio < b->prio || (a->prio == b->prio && a->seq < b->seq);
}

static int heap_push(Lanes *q, int prio, Item *it) {
    if (q->n_heap == q->cap_heap) {
        size_t cap = q->cap_heap ? 2 * q->cap_heap : 64;
        Entry *h = realloc(q->heap, cap * sizeof(Entry));
        if (!h)
            return -1;
        q->heap = h;
        q->cap_heap = cap;
    }
    size_t i = q->n_heap++;
    Entry e = {prio, q->seq++, it};
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!entry_less(&e, &q->heap[p]))
            break;
        q->heap[i] = q->heap[p];
        i = p;
    }
    q->heap[i] = e;
    it->g->refs++;
    return 0;
}

static Entry heap_pop(Lanes *q) {
    Entry top = q->heap[0];
    Entry last = q->heap[--q->n_heap];
    size_t i = 0, n = q->n_heap;
    while (n) {
        size_t c = 2 * i + 1;
        if (c >= n)
            break;
        if (c + 1 < n && entry_less(&q->heap[c + 1], &q->heap[c]))
            c++;
        if (!entry_less(&q->heap[c], &last))
            break;
        q->heap[i] = q->heap[c];
        i = c;
    }
    if (n)
        q->heap[i] = last;
    return top;
}

static void group_unref(GroupC *g) {   /* under mu, or with no lane left */
    if (--g->refs == 0) {
        free(g->items);
        free(g->moves);
        free(g);
    }
}

static void wake_lanes(Lanes *q, int n) {   /* under mu */
    if (n > q->idle)
        n = q->idle;
    for (int i = 0; i < n; i++)
        pthread_cond_signal(&q->work);
}

/* ---- a lane ---- */

static void fail(int kind, int err, int64_t at, int *kind_out, int *err_out,
                 int64_t *at_out) {
    *kind_out = kind;
    *err_out = err;
    *at_out = at;
}

/* A direct read that writes the slice's own bytes and nothing around them, for buffers
   whose neighbouring slices hold other experts (expert slots): the whole pages inside
   the slice land in place and the partial first and last pages in a scratch pair of
   pages, from which only the slice's bytes are copied; one preadv. Returns the bytes
   read, 0 when the slice has no whole page (the caller reads it buffered), or -1 with
   errno set (EINVAL: the kernel refuses direct reads here). */
static int64_t read_exact(Lanes *q, Item *it) {
    static __thread char *scratch = NULL;     /* two pages per lane, for good */
    int64_t page = q->page, off = it->off, end = it->off + it->len;
    int64_t lo = off / page * page;
    int64_t a = off == lo ? off : lo + page;  /* the whole pages: [a, b) */
    int64_t b = end / page * page;
    if (b <= a)
        return 0;
    if (!scratch && posix_memalign((void **)&scratch, (size_t)page, (size_t)(2 * page))) {
        scratch = NULL;
        errno = ENOMEM;
        return -1;
    }
    char *dst = (char *)(intptr_t)it->addr;
    struct iovec iov[3];
    int n = 0;
    if (a != off)
        iov[n++] = (struct iovec){scratch, (size_t)page};
    iov[n++] = (struct iovec){dst + (a - off), (size_t)(b - a)};
    if (end != b)
        iov[n++] = (struct iovec){scratch + page, (size_t)page};
    int64_t first = a != off ? lo : a, got = 0, need = end - first;
    while (got < need) {
        /* after a short read, the rest one vector at a time (rare: the file's end) */
        ssize_t r;
        if (got == 0) {
            r = preadv(q->direct_fd, iov, n, first);
        } else {
            int64_t skip = got;
            int i = 0;
            while (i < n && skip >= (int64_t)iov[i].iov_len)
                skip -= (int64_t)iov[i++].iov_len;
            if (i == n || skip % page)
                break;
            r = pread(q->direct_fd, (char *)iov[i].iov_base + skip, iov[i].iov_len - (size_t)skip,
                      first + got);
        }
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -1;
        }
        if (r == 0)
            break;
        got += r;
    }
    if (got < need) {
        errno = 0;
        return -2 - (first + got);            /* short: where the file ended */
    }
    if (a != off)
        memcpy(dst, scratch + (off - lo), (size_t)(a - off));
    if (end != b)
        memcpy(dst + (b - off), scratch + page, (size_t)(end - b));
    return it->len;
}

/* MXFP4 rows in llama.cpp's CPU_REPACK layout for AVX2 / AVX-512 (`block_mxfp4x8`, the
   layout `repack_mxfp4_to_mxfp4_8_bl` in ggml-cpu/repack.cpp writes at a resident load):
   every 8 rows of `nb` 17-byte blocks (one exponent byte, 16 bytes of nibbles) become
   `nb` 136-byte blocks: the 8 rows' exponents, then their nibbles in 8-byte pieces, row
   by row, the first halves of the 8 rows before the second halves. The same bytes,
   permuted inside each group of 8 rows, in place; `n` is whole groups. */
static int pack_mxfp4_8(char *p, int64_t n, int64_t rowbytes) {
    static __thread char *tmp = NULL;
    static __thread int64_t tmp_n = 0;
    int64_t group = 8 * rowbytes, nb = rowbytes / 17;
    if (rowbytes <= 0 || rowbytes % 17 || n % group)
        return -1;
    if (tmp_n < group) {
        char *t = realloc(tmp, (size_t)group);
        if (!t)
            return -1;
        tmp = t;
        tmp_n = group;
    }
    for (int64_t g = 0; g < n; g += group) {
        char *d = p + g;
        memcpy(tmp, d, (size_t)group);
        const char *next = g + group < n ? p + g + group : NULL;
        for (int64_t x = 0; x < nb; x++) {
            const char *blk = tmp + x * 17;
            if (next)          /* the next group's lines on their way while this permutes */
                for (int64_t o = x * group / nb & ~(int64_t)63; o < (x + 1) * group / nb;
                     o += 64)
                    __builtin_prefetch(next + o, 1);
            for (int i = 0; i < 8; i++)
                d[i] = blk[i * rowbytes];
#if defined(__SSE2__)
            /* each row's 16 bytes of nibbles in one load; two rows' first halves (or
               second halves) to one 16-byte store: half the moves of 8-byte pieces */
            for (int i = 0; i < 8; i += 2) {
                __m128i a = _mm_loadu_si128((const __m128i *)(blk + i * rowbytes + 1));
                __m128i b = _mm_loadu_si128((const __m128i *)(blk + (i + 1) * rowbytes + 1));
                _mm_storeu_si128((__m128i *)(d + 8 + i * 8), _mm_unpacklo_epi64(a, b));
                _mm_storeu_si128((__m128i *)(d + 72 + i * 8), _mm_unpackhi_epi64(a, b));
            }
#else
            for (int h = 0; h < 2; h++)
                for (int i = 0; i < 8; i++)
                    memcpy(d + 8 + (h * 8 + i) * 8, blk + i * rowbytes + 1 + h * 8, 8);
#endif
            d += 136;
        }
    }
    return 0;
}

/* The item's slices repacked where its buffer is one of the lanes' packs: 0, or -1 when
   the item is not whole groups of its buffer's rows (nothing is changed then). */
static int pack_item(Lanes *q, Item *it) {
    for (Py_ssize_t i = 0; i < q->n_packs; i++) {
        Pack *k = &q->packs[i];
        if (k->lo != it->lo || k->hi != it->hi)
            continue;
        int64_t group = 8 * k->rowbytes;
        if (it->addr < k->start || (it->addr - k->start) % group || it->len % group
            || it->addr + it->len > k->hi)
            return -1;
        return pack_mxfp4_8((char *)(intptr_t)it->addr, it->len, k->rowbytes);
    }
    return 0;
}

/* The item's page moves and read, without the lock. Returns the bytes read; on failure
   sets kind (and err, at). */
static int64_t read_item(Lanes *q, Item *it, int *kind, int *err, int64_t *at) {
    for (int i = 0; i < it->nmoves; i++) {
        Move m = it->moves[i];
        if (__atomic_load_n(&q->recycle, __ATOMIC_RELAXED)) {
            void *p = mremap((void *)(intptr_t)m.src, (size_t)m.n, (size_t)m.n,
                             MREMAP_MAYMOVE | MREMAP_FIXED | MREMAP_DONTUNMAP,
                             (void *)(intptr_t)m.dst);
            if (p == (void *)(intptr_t)m.dst) {
                __atomic_fetch_add(&q->moved_bytes, m.n, __ATOMIC_RELAXED);
                continue;
            }
            __atomic_store_n(&q->recycle, 0, __ATOMIC_RELAXED);  /* freeing still works */
        }
        if (madvise((void *)(intptr_t)m.src, (size_t)m.n, MADV_DONTNEED) != 0) {
            fail(KIND_FREE, errno, m.src, kind, err, at);
            return 0;
        }
    }
    if (__atomic_load_n(&q->exact, __ATOMIC_RELAXED)
        && __atomic_load_n(&q->use_direct, __ATOMIC_RELAXED)) {
        int64_t r = read_exact(q, it);
        if (r > 0)
            return r;
        if (r <= -2) {
            fail(KIND_SHORT, 0, -2 - r, kind, err, at);
            return 0;
        }
        if (r == -1 && errno == EINVAL) {
            int expected = 0;
            __atomic_compare_exchange_n(&q->refused_errno, &expected, EINVAL, 0,
                                        __ATOMIC_RELAXED, __ATOMIC_RELAXED);
            __atomic_store_n(&q->use_direct, 0, __ATOMIC_RELAXED);
        } else if (r == -1) {
            fail(KIND_READ, errno, it->off, kind, err, at);
            return 0;
        }
        /* r == 0 (no whole page) or refused: the buffered read below is exact */
    } else if (__atomic_load_n(&q->use_direct, __ATOMIC_RELAXED)) {
        int64_t page = q->page;
        int64_t lo = it->off / page * page;
        int64_t end = it->off + it->len;
        int64_t hi = (end + page - 1) / page * page;
        if (hi > q->file_size)
            hi = q->file_size;
        int64_t length = (hi - lo + page - 1) / page * page;
        char *start = (char *)(intptr_t)(it->addr - (it->off - lo));
        int64_t got = 0;
        int refused = 0;
        while (lo + got < hi) {
            ssize_t n = pread(q->direct_fd, start + got, (size_t)(length - got), lo + got);
            if (n < 0) {
                if (errno == EINTR)
                    continue;
                if (errno == EINVAL) {
                    int expected = 0;
                    __atomic_compare_exchange_n(&q->refused_errno, &expected, EINVAL, 0,
                                                __ATOMIC_RELAXED, __ATOMIC_RELAXED);
                    __atomic_store_n(&q->use_direct, 0, __ATOMIC_RELAXED);
                    refused = 1;
                    break;
                }
                fail(KIND_READ, errno, it->off, kind, err, at);
                return 0;
            }
            if (n == 0)
                break;
            got += n;
        }
        if (!refused) {
            if (lo + got < end) {
                fail(KIND_SHORT, 0, lo + got, kind, err, at);
                return 0;
            }
            return got;
        }
    }
    char *dst = (char *)(intptr_t)it->addr;
    int64_t got = 0;
    while (got < it->len) {
        ssize_t n = pread(q->buffered_fd, dst + got, (size_t)(it->len - got), it->off + got);
        if (n < 0) {
            if (errno == EINTR)
                continue;
            fail(KIND_READ, errno, it->off, kind, err, at);
            return 0;
        }
        if (n == 0) {
            fail(KIND_SHORT, 0, it->off + got, kind, err, at);
            return 0;
        }
        got += n;
    }
    return got;
}

/* read_item, then the slices repacked where the buffer asks for it. */
static int64_t run_item(Lanes *q, Item *it, int *kind, int *err, int64_t *at) {
    int64_t got = read_item(q, it, kind, err, at);
    if (!*kind && got > 0 && q->n_packs && pack_item(q, it) != 0) {
        fail(KIND_READ, EINVAL, it->off, kind, err, at);
        return 0;
    }
    return got;
}

static void *lane_main(void *arg) {
    Lanes *q = arg;
    pthread_setname_np(pthread_self(), "bmoe-read");   /* for top -H, ps -L, perf */
    pthread_mutex_lock(&q->mu);
    for (;;) {
        while (!q->n_heap && !q->closed) {
            q->idle++;
            pthread_cond_wait(&q->work, &q->mu);
            q->idle--;
        }
        if (!q->n_heap)
            break;                      /* closed */
        Entry e = heap_pop(q);
        if (q->n_heap)
            wake_lanes(q, 1);           /* more queued: the next idle lane takes one */
        Item *it = e.it;
        GroupC *g = it->g;
        if (it->taken) {                /* promoted, and the other entry ran it */
            group_unref(g);
            continue;
        }
        it->taken = 1;
        pthread_mutex_unlock(&q->mu);
        int kind = 0, err = 0;
        int64_t at = 0;
        double t0 = now_s();
        int64_t n = run_item(q, it, &kind, &err, &at);
        double t1 = now_s();
        pthread_mutex_lock(&q->mu);
        q->busy_s += t1 - t0;
        g->nbytes += n;
        if (kind && !g->kind) {
            g->kind = kind;
            g->err = err;
            g->at = at;
        }
        if (--g->left == 0 && g->waited)
            pthread_cond_broadcast(&q->done);
        group_unref(g);
    }
    pthread_mutex_unlock(&q->mu);
    return NULL;
}

/* ---- Lanes ---- */

static void lanes_stop(Lanes *q) {      /* with the GIL released */
    pthread_mutex_lock(&q->mu);
    q->closed = 1;
    int waited = 0;
    while (q->n_heap) {
        Entry e = q->heap[--q->n_heap];
        Item *it = e.it;
        GroupC *g = it->g;
        if (!it->taken) {
            it->taken = 1;
            if (!g->kind)
                g->kind = KIND_CLOSED;
            if (--g->left == 0 && g->waited)
                waited = 1;
        }
        group_unref(g);
    }
    if (waited)
        pthread_cond_broadcast(&q->done);
    pthread_cond_broadcast(&q->work);
    int join = !q->joined;
    q->joined = 1;
    pthread_mutex_unlock(&q->mu);
    if (join)
        for (int i = 0; i < q->started; i++)
            pthread_join(q->threads[i], NULL);
}

static int Lanes_init(Lanes *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"direct_fd", "buffered_fd", "file_size", "lanes", "recycle",
                            "on_error", NULL};
    int direct_fd, buffered_fd, n_lanes, recycle;
    long long file_size;
    PyObject *on_error;
    if (self->threads || self->sync_ok) {
        PyErr_SetString(PyExc_RuntimeError, "Lanes is already set up");
        return -1;
    }
    if (!PyArg_ParseTupleAndKeywords(args, kw, "iiLipO", names, &direct_fd, &buffered_fd,
                                     &file_size, &n_lanes, &recycle, &on_error))
        return -1;
    if (n_lanes < 1 || n_lanes > 64) {
        PyErr_SetString(PyExc_ValueError, "lanes must be 1 to 64");
        return -1;
    }
    if (buffered_fd < 0 || file_size < 0) {
        PyErr_SetString(PyExc_ValueError, "a buffered descriptor and the file size are needed");
        return -1;
    }
    if (!PyCallable_Check(on_error)) {
        PyErr_SetString(PyExc_TypeError, "on_error must be callable");
        return -1;
    }
    long page = sysconf(_SC_PAGESIZE);
    self->page = page > 0 ? page : 4096;
    self->direct_fd = direct_fd;
    self->buffered_fd = buffered_fd;
    self->file_size = file_size;
    self->use_direct = direct_fd >= 0;
    self->recycle = recycle;
    Py_INCREF(on_error);
    self->on_error = on_error;
    pthread_condattr_t ca;
    pthread_condattr_init(&ca);
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    if (pthread_mutex_init(&self->mu, NULL) || pthread_cond_init(&self->work, NULL)
        || pthread_cond_init(&self->done, &ca)) {
        pthread_condattr_destroy(&ca);
        PyErr_SetString(PyExc_OSError, "could not make the lanes' lock");
        return -1;
    }
    pthread_condattr_destroy(&ca);
    self->sync_ok = 1;
    self->threads = calloc((size_t)n_lanes, sizeof(pthread_t));
    if (!self->threads) {
        PyErr_NoMemory();
        return -1;
    }
    self->n_lanes = n_lanes;
    for (int i = 0; i < n_lanes; i++) {
        int rc = pthread_create(&self->threads[i], NULL, lane_main, self);
        if (rc) {
            Py_BEGIN_ALLOW_THREADS
            lanes_stop(self);
            Py_END_ALLOW_THREADS
            errno = rc;
            PyErr_SetFromErrno(PyExc_OSError);
            return -1;
        }
        self->started++;
    }
    return 0;
}

static void Lanes_dealloc(Lanes *self) {
    if (self->sync_ok) {
        Py_BEGIN_ALLOW_THREADS
        lanes_stop(self);
        Py_END_ALLOW_THREADS
        pthread_mutex_destroy(&self->mu);
        pthread_cond_destroy(&self->work);
        pthread_cond_destroy(&self->done);
    }
    free(self->heap);
    free(self->threads);
    free(self->packs);
    Py_CLEAR(self->on_error);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int64_t item_int(PyObject *seq, Py_ssize_t i, int *bad) {
    long long v = PyLong_AsLongLong(PySequence_Fast_GET_ITEM(seq, i));
    if (v == -1 && PyErr_Occurred())
        *bad = 1;
    return (int64_t)v;
}

static int sort_desc(const void *a, const void *b) {
    const Item *x = *(Item *const *)a, *y = *(Item *const *)b;
    return (x->len < y->len) - (x->len > y->len);
}

/* Whether reads can be queued at `prio` (else an exception is set): checked before a
   plan frees any page. */
static int queue_ok(Lanes *self, int prio) {
    if (!self->sync_ok) {
        PyErr_SetString(PyExc_RuntimeError, "Lanes is not set up");
        return 0;
    }
    if (prio < 0) {
        PyErr_SetString(PyExc_ValueError, "prio must be 0 or more");
        return 0;
    }
    return 1;
}

/* submit(spec, prio, wake=True) -> Group. `spec` is a flat sequence of ints, per read:
   offset, length, address, buffer start, buffer end, number of moves, then (src, dst,
   length) per move. */
static PyObject *submit_core(Lanes *self, const int64_t *spec, Py_ssize_t n, int prio,
                             int wake) {
    if (!queue_ok(self, prio))
        return NULL;
    /* count reads and moves first */
    Py_ssize_t i = 0, n_items = 0, n_moves = 0;
    int bad = 0;
    while (i < n) {
        if (i + 6 > n) {
            bad = 2;
            break;
        }
        int64_t nm = spec[i + 5];
        if (nm < 0 || nm > (n - i - 6) / 3) {
            bad = 2;
            break;
        }
        n_items++;
        n_moves += nm;
        i += 6 + 3 * nm;
    }
    if (bad) {
        PyErr_SetString(PyExc_ValueError, "spec is not a list of reads");
        return NULL;
    }
    GroupC *g = calloc(1, sizeof(GroupC));
    Item *items = n_items ? calloc((size_t)n_items, sizeof(Item)) : NULL;
    Move *moves = n_moves ? calloc((size_t)n_moves, sizeof(Move)) : NULL;
    Item **order = n_items ? malloc((size_t)n_items * sizeof(Item *)) : NULL;
    if (!g || (n_items && (!items || !order)) || (n_moves && !moves)) {
        free(g);
        free(items);
        free(moves);
        free(order);
        return PyErr_NoMemory();
    }
    g->items = items;
    g->moves = moves;
    g->n_items = (int)n_items;
    g->prio = prio;
    const char *why = NULL;
    Py_ssize_t m = 0;
    i = 0;
    for (Py_ssize_t k = 0; k < n_items && !bad && !why; k++) {
        Item *it = &items[k];
        it->g = g;
        it->off = spec[i];
        it->len = spec[i + 1];
        it->addr = spec[i + 2];
        it->lo = spec[i + 3];
        it->hi = spec[i + 4];
        it->nmoves = (int)spec[i + 5];
        it->moves = moves + m;
        for (int j = 0; j < it->nmoves && !bad; j++) {
            Move *mv = &moves[m++];
            mv->src = spec[i + 6 + 3 * j];
            mv->dst = spec[i + 7 + 3 * j];
            mv->n = spec[i + 8 + 3 * j];
            if (!bad && (mv->src <= 0 || mv->dst <= 0 || mv->n <= 0 || mv->src % self->page
                         || mv->dst % self->page || mv->n % self->page
                         || mv->dst < it->lo || mv->dst + mv->n > it->hi))
                why = "a page move is not page-aligned inside its buffer";
        }
        i += 6 + 3 * (Py_ssize_t)it->nmoves;
        if (bad || why)
            break;
        int64_t page = self->page;
        if (it->off < 0 || it->len <= 0 || it->off + it->len > self->file_size
            || it->lo <= 0 || it->hi <= it->lo || it->addr < it->lo
            || it->addr + it->len > it->hi) {
            why = "a read does not fit its buffer or the file";
            break;
        }
        if (self->direct_fd >= 0) {       /* the direct read's extent must fit too */
            int64_t lo = it->off / page * page;
            int64_t hi = (it->off + it->len + page - 1) / page * page;
            if (hi > self->file_size)
                hi = self->file_size;
            int64_t start = it->addr - (it->off - lo);
            int64_t length = (hi - lo + page - 1) / page * page;
            if (start < it->lo || start + length > it->hi)
                why = "a direct read's pages do not fit its buffer";
        }
        order[k] = it;
    }
    if (bad || why) {
        PyErr_SetString(PyExc_ValueError, why ? why : "spec is not a list of reads");
        free(items);
        free(moves);
        free(order);
        free(g);
        return NULL;
    }
    Group *obj = PyObject_New(Group, &GroupType);
    if (!obj) {
        free(items);
        free(moves);
        free(order);
        free(g);
        return NULL;
    }
    Py_INCREF(self);
    obj->q = self;
    obj->g = g;
    obj->error = NULL;
    g->refs = 1;
    g->left = (int)n_items;
    if (n_items > 1)
        qsort(order, (size_t)n_items, sizeof(Item *), sort_desc);
    int nomem = 0;
    pthread_mutex_lock(&self->mu);
    if (self->closed) {
        for (Py_ssize_t k = 0; k < n_items; k++)
            items[k].taken = 1;
        g->left = 0;
        if (n_items)
            g->kind = KIND_CLOSED;
    } else {
        for (Py_ssize_t k = 0; k < n_items; k++) {
            if (heap_push(self, prio, order[k])) {
                /* the rest never run: the group fails, its pushed reads still do */
                for (Py_ssize_t r = k; r < n_items; r++) {
                    order[r]->taken = 1;
                    g->left--;
                }
                if (!g->kind)
                    g->kind = KIND_CLOSED;
                nomem = 1;
                break;
            }
        }
        if (wake && n_items)
            wake_lanes(self, prio == 0 ? (int)n_items : 1);
    }
    pthread_mutex_unlock(&self->mu);
    free(order);
    if (nomem) {
        Py_DECREF(obj);
        return PyErr_NoMemory();
    }
    return (PyObject *)obj;
}

/* submit(spec, prio, wake=True) -> Group (submit_core over the sequence's ints) */
static PyObject *Lanes_submit(Lanes *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"spec", "prio", "wake", NULL};
    PyObject *spec_in;
    int prio, wake = 1;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "Oi|p", names, &spec_in, &prio, &wake))
        return NULL;
    PyObject *seq = PySequence_Fast(spec_in, "spec must be a sequence of ints");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    int64_t *spec = malloc((size_t)(n ? n : 1) * sizeof(int64_t));
    if (!spec) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    int bad = 0;
    for (Py_ssize_t i = 0; i < n && !bad; i++)
        spec[i] = item_int(seq, i, &bad);
    Py_DECREF(seq);
    PyObject *g = NULL;
    if (bad) {
        if (PyErr_ExceptionMatches(PyExc_TypeError)
            || PyErr_ExceptionMatches(PyExc_OverflowError)) {
            PyErr_Clear();
            PyErr_SetString(PyExc_ValueError, "spec is not a list of reads");
        }
    } else {
        g = submit_core(self, spec, n, prio, wake);
    }
    free(spec);
    return g;
}

static PyObject *Lanes_wake(Lanes *self, PyObject *unused) {
    (void)unused;
    if (self->sync_ok) {
        pthread_mutex_lock(&self->mu);
        if (self->n_heap)
            wake_lanes(self, 1);
        pthread_mutex_unlock(&self->mu);
    }
    Py_RETURN_NONE;
}

static PyObject *Lanes_promote(Lanes *self, PyObject *arg) {
    if (!PyObject_TypeCheck(arg, &GroupType) || ((Group *)arg)->q != self) {
        PyErr_SetString(PyExc_TypeError, "promote takes a group of this queue");
        return NULL;
    }
    GroupC *g = ((Group *)arg)->g;
    int nomem = 0;
    pthread_mutex_lock(&self->mu);
    if (g->prio != 0 && g->left > 0 && !self->closed) {
        g->prio = 0;
        int pushed = 0;
        for (int k = 0; k < g->n_items; k++) {
            Item *it = &g->items[k];
            if (!it->taken) {
                if (heap_push(self, 0, it)) {
                    nomem = 1;       /* its first entry still runs it, later */
                    break;
                }
                pushed++;
            }
        }
        wake_lanes(self, pushed);
    }
    pthread_mutex_unlock(&self->mu);
    if (nomem)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* wait(groups, timeout) -> True when every group finished within `timeout` seconds. */
static PyObject *Lanes_wait(Lanes *self, PyObject *args) {
    PyObject *seq_in;
    double timeout;
    if (!PyArg_ParseTuple(args, "Od", &seq_in, &timeout))
        return NULL;
    PyObject *seq = PySequence_Fast(seq_in, "groups must be a sequence");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    GroupC *one[16];
    GroupC **gs = n <= 16 ? one : malloc((size_t)n * sizeof(GroupC *));
    if (!gs) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t k = 0; k < n; k++) {
        PyObject *o = PySequence_Fast_GET_ITEM(seq, k);
        if (!PyObject_TypeCheck(o, &GroupType) || ((Group *)o)->q != self) {
            if (gs != one)
                free(gs);
            Py_DECREF(seq);
            PyErr_SetString(PyExc_TypeError, "wait takes groups of this queue");
            return NULL;
        }
        gs[k] = ((Group *)o)->g;
    }
    int all = 1;
    if (timeout < 0)
        timeout = 0;
    Py_BEGIN_ALLOW_THREADS
    struct timespec dl;
    clock_gettime(CLOCK_MONOTONIC, &dl);
    double whole = (double)(long long)timeout;
    dl.tv_sec += (time_t)whole;
    dl.tv_nsec += (long)((timeout - whole) * 1e9);
    if (dl.tv_nsec >= 1000000000L) {
        dl.tv_sec++;
        dl.tv_nsec -= 1000000000L;
    }
    pthread_mutex_lock(&self->mu);
    for (Py_ssize_t k = 0; k < n; k++)
        gs[k]->waited++;
    for (;;) {
        all = 1;
        for (Py_ssize_t k = 0; k < n && all; k++)
            all = gs[k]->left == 0;
        if (all)
            break;
        if (pthread_cond_timedwait(&self->done, &self->mu, &dl) == ETIMEDOUT) {
            all = 1;
            for (Py_ssize_t k = 0; k < n && all; k++)
                all = gs[k]->left == 0;
            break;
        }
    }
    for (Py_ssize_t k = 0; k < n; k++)
        gs[k]->waited--;
    pthread_mutex_unlock(&self->mu);
    Py_END_ALLOW_THREADS
    if (gs != one)
        free(gs);
    Py_DECREF(seq);
    return PyBool_FromLong(all);
}

static PyObject *Lanes_close(Lanes *self, PyObject *unused) {
    (void)unused;
    if (self->sync_ok) {
        Py_BEGIN_ALLOW_THREADS
        lanes_stop(self);
        Py_END_ALLOW_THREADS
    }
    Py_RETURN_NONE;
}

/* set_packs([(lo, hi, start, rowbytes), ...]): the buffers whose slices the lanes repack
   after reading them (once, before the first read is queued). */
static PyObject *Lanes_set_packs(Lanes *self, PyObject *arg) {
    if (!self->sync_ok) {
        PyErr_SetString(PyExc_RuntimeError, "the lanes are not set up");
        return NULL;
    }
    PyObject *seq = PySequence_Fast(arg, "set_packs takes a list of (lo, hi, start, rowbytes)");
    if (!seq)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    Pack *packs = n ? calloc((size_t)n, sizeof(Pack)) : NULL;
    if (n && !packs) {
        Py_DECREF(seq);
        return PyErr_NoMemory();
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        long long lo, hi, start, rowbytes;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, i), "LLLL", &lo, &hi, &start,
                              &rowbytes)) {
            free(packs);
            Py_DECREF(seq);
            return NULL;
        }
        if (lo < 0 || hi <= lo || start < lo || start > hi || rowbytes <= 0 || rowbytes % 17) {
            free(packs);
            Py_DECREF(seq);
            PyErr_SetString(PyExc_ValueError, "a pack's buffer or row size is wrong");
            return NULL;
        }
        packs[i] = (Pack){lo, hi, start, rowbytes};
    }
    Py_DECREF(seq);
    pthread_mutex_lock(&self->mu);
    int busy = self->n_packs || self->n_heap;
    if (!busy) {
        self->packs = packs;
        self->n_packs = n;
    }
    pthread_mutex_unlock(&self->mu);
    if (busy) {
        free(packs);
        PyErr_SetString(PyExc_RuntimeError, "the packs are set once, before any read");
        return NULL;
    }
    Py_RETURN_NONE;
}

static PyObject *Lanes_get_packs(Lanes *self, void *c) {
    (void)c;
    return PyLong_FromSsize_t(self->n_packs);
}

static PyObject *Lanes_get_busy(Lanes *self, void *c) {
    (void)c;
    double v = 0;
    if (self->sync_ok) {
        pthread_mutex_lock(&self->mu);
        v = self->busy_s;
        pthread_mutex_unlock(&self->mu);
    }
    return PyFloat_FromDouble(v);
}

static PyObject *Lanes_get_moved(Lanes *self, void *c) {
    (void)c;
    return PyLong_FromLongLong(__atomic_load_n(&self->moved_bytes, __ATOMIC_RELAXED));
}

/* A switch of the lanes (an int read by the lanes atomically), at offset `c` in Lanes. */
static PyObject *Lanes_get_flag(Lanes *self, void *c) {
    int *flag = (int *)((char *)self + (intptr_t)c);
    return PyBool_FromLong(__atomic_load_n(flag, __ATOMIC_RELAXED));
}

static int Lanes_set_flag(Lanes *self, PyObject *v, void *c) {
    if (!v) {
        PyErr_SetString(PyExc_AttributeError, "a lanes' switch cannot be deleted");
        return -1;
    }
    int on = PyObject_IsTrue(v);
    if (on < 0)
        return -1;
    __atomic_store_n((int *)((char *)self + (intptr_t)c), on, __ATOMIC_RELAXED);
    return 0;
}

static PyObject *Lanes_get_direct(Lanes *self, void *c) {
    (void)c;
    return PyBool_FromLong(__atomic_load_n(&self->use_direct, __ATOMIC_RELAXED));
}

static PyObject *Lanes_get_refused(Lanes *self, void *c) {
    (void)c;
    return PyLong_FromLong(__atomic_load_n(&self->refused_errno, __ATOMIC_RELAXED));
}

static PyObject *Lanes_get_n(Lanes *self, void *c) {
    (void)c;
    return PyLong_FromLong(self->n_lanes);
}

static PyObject *Lanes_plan_submit(Lanes *self, PyObject *args, PyObject *kw);

static PyMethodDef Lanes_methods[] = {
    {"submit", (PyCFunction)(void (*)(void))Lanes_submit, METH_VARARGS | METH_KEYWORDS,
     "submit(spec, prio, wake=True) -> Group: queue reads as one group."},
    {"plan_submit", (PyCFunction)(void (*)(void))Lanes_plan_submit,
     METH_VARARGS | METH_KEYWORDS,
     "plan_submit(table, starts, layer, misses, victims, recycle, split, prio, wake, "
     "give=None, take=None) -> (groups, taken): plan's reads queued as groups."},
    {"wake", (PyCFunction)Lanes_wake, METH_NOARGS, "Wake one idle lane if reads are queued."},
    {"promote", (PyCFunction)Lanes_promote, METH_O,
     "Queue a group's reads not yet started again, at priority 0."},
    {"wait", (PyCFunction)Lanes_wait, METH_VARARGS,
     "wait(groups, timeout) -> bool: every group finished in time."},
    {"set_packs", (PyCFunction)Lanes_set_packs, METH_O,
     "set_packs([(lo, hi, start, rowbytes), ...]): buffers whose expert slices are "
     "rewritten in llama.cpp's repacked MXFP4 layout after each read (set once)."},
    {"close", (PyCFunction)Lanes_close, METH_NOARGS,
     "Stop the lanes after the reads in progress; queued reads fail their groups."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Lanes_getset[] = {
    {"busy_s", (getter)Lanes_get_busy, NULL, "summed lane time spent on reads", NULL},
    {"moved_bytes", (getter)Lanes_get_moved, NULL, "bytes of pages moved", NULL},
    {"recycle", (getter)Lanes_get_flag, (setter)Lanes_set_flag,
     "page moves on (a failed move turns them off)", (void *)offsetof(Lanes, recycle)},
    {"exact", (getter)Lanes_get_flag, (setter)Lanes_set_flag,
     "reads write only their slices' bytes, not the rest of the first and last pages "
     "(for buffers whose slices hold other experts than the file's neighbours)",
     (void *)offsetof(Lanes, exact)},
    {"use_direct", (getter)Lanes_get_direct, NULL, "direct reads on", NULL},
    {"refused_errno", (getter)Lanes_get_refused, NULL,
     "the errno of the direct read the kernel refused (0: none)", NULL},
    {"lanes", (getter)Lanes_get_n, NULL, "the number of lanes", NULL},
    {"packs", (getter)Lanes_get_packs, NULL, "how many buffers the lanes repack", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject LanesType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "bmoe.native.readlanes.Lanes",
    .tp_basicsize = sizeof(Lanes),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Lanes(direct_fd, buffered_fd, file_size, lanes, recycle, on_error): "
              "read lanes on pthreads serving one priority queue.",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Lanes_init,
    .tp_dealloc = (destructor)Lanes_dealloc,
    .tp_methods = Lanes_methods,
    .tp_getset = Lanes_getset,
};

/* ---- Group ---- */

static void Group_dealloc(Group *self) {
    Lanes *q = self->q;
    if (q && self->g) {
        pthread_mutex_lock(&q->mu);
        group_unref(self->g);
        pthread_mutex_unlock(&q->mu);
    }
    Py_CLEAR(self->error);
    Py_XDECREF(q);
    PyObject_Free(self);
}

static PyObject *Group_finished(Group *self, PyObject *unused) {
    (void)unused;
    pthread_mutex_lock(&self->q->mu);
    int done = self->g->left == 0;
    pthread_mutex_unlock(&self->q->mu);
    return PyBool_FromLong(done);
}

static PyObject *Group_get_nbytes(Group *self, void *c) {
    (void)c;
    pthread_mutex_lock(&self->q->mu);
    int64_t v = self->g->nbytes;
    pthread_mutex_unlock(&self->q->mu);
    return PyLong_FromLongLong(v);
}

static PyObject *Group_get_prio(Group *self, void *c) {
    (void)c;
    pthread_mutex_lock(&self->q->mu);
    int v = self->g->prio;
    pthread_mutex_unlock(&self->q->mu);
    return PyLong_FromLong(v);
}

static PyObject *Group_get_error(Group *self, void *c) {
    (void)c;
    if (self->error) {
        Py_INCREF(self->error);
        return self->error;
    }
    pthread_mutex_lock(&self->q->mu);
    int kind = self->g->kind, err = self->g->err;
    int64_t at = self->g->at;
    pthread_mutex_unlock(&self->q->mu);
    if (!kind)
        Py_RETURN_NONE;
    PyObject *e = PyObject_CallFunction(self->q->on_error, "iiL", kind, err, (long long)at);
    if (!e)
        return NULL;
    self->error = e;
    Py_INCREF(e);
    return e;
}

static PyMethodDef Group_methods[] = {
    {"finished", (PyCFunction)Group_finished, METH_NOARGS,
     "True once every read of the group ran (or failed)."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef Group_getset[] = {
    {"nbytes", (getter)Group_get_nbytes, NULL, "bytes read so far", NULL},
    {"prio", (getter)Group_get_prio, NULL, "the group's priority (0: needed now)", NULL},
    {"error", (getter)Group_get_error, NULL, "the first failure, or None", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PyTypeObject GroupType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "bmoe.native.readlanes.Group",
    .tp_basicsize = sizeof(Group),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Reads a caller waits on together (made by Lanes.submit).",
    .tp_dealloc = (destructor)Group_dealloc,
    .tp_methods = Group_methods,
    .tp_getset = Group_getset,
};


/* ---- read planning: the streamer's _victim_pages + _reads_for + take_spare ---- */

/* A victim's interior pages, spare to hand on (dict-of-lists semantics: `spare[n]` is a
   list appended in order and popped from its end; lengths keep their first-seen order). */
typedef struct {
    int64_t n, addr;
    int64_t unit_layer, unit_expert;
    int used;
} Spare;

typedef struct {
    const int64_t *table;        /* [n_tensors, 5]: file offset, slice bytes, base, phase, size */
    const int64_t *starts;       /* [n_layer + 1]: each layer's first row */
    int64_t n_layer, page;
} Tables;

static inline int64_t pceil(int64_t x, int64_t p) { return (x + p - 1) / p * p; }
static inline int64_t pfloor(int64_t x, int64_t p) { return x / p * p; }

/* (address, length) of the whole pages of slice e of tensor row r */
static void interior(const Tables *t, Py_ssize_t r, int64_t e, int64_t *addr, int64_t *n) {
    const int64_t *row = t->table + 5 * r;
    int64_t s = row[1], base = row[2], phase = row[3];
    int64_t lo = pceil(phase + e * s, t->page), hi = pfloor(phase + (e + 1) * s, t->page);
    *addr = base + lo;
    *n = hi > lo ? hi - lo : 0;
}

typedef struct {
    Spare *v;
    Py_ssize_t n;
    int64_t *keys;               /* lengths in first-seen order */
    Py_ssize_t n_keys;
} SparePool;

static Py_ssize_t last_unused(SparePool *sp, int64_t n) {
    for (Py_ssize_t i = sp->n - 1; i >= 0; i--)
        if (!sp->v[i].used && sp->v[i].n == n)
            return i;
    return -1;
}

/* take_spare: the same length first; else the nearest larger (its pages past n are
   freed); else the largest smaller. Returns the entry, or -1; *cut is the freed tail. */
static Py_ssize_t take_spare_c(SparePool *sp, int64_t n, int64_t *take, int64_t *cut) {
    Py_ssize_t i = last_unused(sp, n);
    *cut = 0;
    if (i >= 0) {
        sp->v[i].used = 1;
        *take = n;
        return i;
    }
    int64_t larger = -1, largest = -1;
    for (Py_ssize_t k = 0; k < sp->n_keys; k++) {
        int64_t len = sp->keys[k];
        if (last_unused(sp, len) < 0)
            continue;
        if (len > n && (larger < 0 || len < larger))
            larger = len;
        if (len > largest)
            largest = len;
    }
    int64_t k = larger >= 0 ? larger : largest;
    if (k < 0)
        return -1;
    i = last_unused(sp, k);
    sp->v[i].used = 1;
    if (k > n) {
        *cut = k - n;
        *take = n;
    } else {
        *take = k;
    }
    return i;
}

static int get_i64(PyObject *o, Py_buffer *b, const char *what) {
    if (PyObject_GetBuffer(o, b, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
        return -1;
    if (b->itemsize != 8 || !b->format || (strcmp(b->format, "l") && strcmp(b->format, "q")
                                           && strcmp(b->format, "<q") && strcmp(b->format, "=q")
                                           && strcmp(b->format, "<l") && strcmp(b->format, "=l"))) {
        PyBuffer_Release(b);
        PyErr_Format(PyExc_TypeError, "%s must be a contiguous int64 array", what);
        return -1;
    }
    return 0;
}

/* A growing int64 array. */
typedef struct {
    int64_t *v;
    Py_ssize_t n, cap;
} Vec;

static int vec_push(Vec *x, int64_t v) {
    if (x->n == x->cap) {
        Py_ssize_t cap = x->cap ? 2 * x->cap : 64;
        int64_t *nv = realloc(x->v, (size_t)cap * sizeof(int64_t));
        if (!nv) {
            PyErr_NoMemory();
            return -1;
        }
        x->v = nv;
        x->cap = cap;
    }
    x->v[x->n++] = v;
    return 0;
}

/* What a plan makes: the specs one after the other (`ends[g]`: where spec g ends), the
   taken victims as (layer, expert) pairs (`taken_ends[g]`: where group g's end, in
   pairs), the (address, length) pairs not freed (without `release`), and with `fresh`
   each slice's interior pages no victim's cover (`fresh_ends[g]`: where group g's end,
   in pairs), for fresh pages to be given there before the reads are queued. */
typedef struct {
    Vec spec, ends, taken, taken_ends, released;
    Vec fresh, fresh_ends;      /* with `fresh`: (address, length) no victim covers */
} PlanOut;

static void plan_free(PlanOut *o) {
    free(o->spec.v);
    free(o->ends.v);
    free(o->taken.v);
    free(o->taken_ends.v);
    free(o->released.v);
    free(o->fresh.v);
    free(o->fresh_ends.v);
}

/* The buffers plan and Lanes.plan_submit take, checked. */
typedef struct {
    Py_buffer tb, sb, mb, vb;
    int held;
} PlanArgs;

static void plan_args_release(PlanArgs *a) {
    Py_buffer *b[4] = {&a->tb, &a->sb, &a->mb, &a->vb};
    for (int i = 0; i < a->held; i++)
        PyBuffer_Release(b[i]);
    a->held = 0;
}

static int plan_args(PlanArgs *a, PyObject *table_o, PyObject *starts_o, PyObject *misses_o,
                     PyObject *victims_o) {
    PyObject *o[4] = {table_o, starts_o, misses_o, victims_o};
    Py_buffer *b[4] = {&a->tb, &a->sb, &a->mb, &a->vb};
    static const char *what[4] = {"table", "starts", "misses", "victims"};
    a->held = 0;
    for (int i = 0; i < 4; i++) {
        if (get_i64(o[i], b[i], what[i]) < 0) {
            plan_args_release(a);
            return -1;
        }
        a->held++;
    }
    return 0;
}

/* The planning itself (see plan below); 0, or -1 with an exception set. */
static int plan_core(PlanArgs *a, long long layer, int recycle, int split, int release,
                     int fresh, PlanOut *out) {
    SparePool sp = {0};
    Tables t;
    int rc = -1;
    long pg = sysconf(_SC_PAGESIZE);
    t.page = pg > 0 ? pg : 4096;
    t.table = a->tb.buf;
    t.starts = a->sb.buf;
    Py_ssize_t n_rows = a->tb.len / 8 / 5, n_miss = a->mb.len / 8, n_vict = a->vb.len / 8 / 2;
    t.n_layer = a->sb.len / 8 - 1;
    const int64_t *misses = a->mb.buf, *victims = a->vb.buf;
    const char *why = NULL;
    if (a->tb.len % 40 || t.n_layer < 1 || a->vb.len % 16)
        why = "plan: the tables' shapes are wrong";
    for (int64_t l = 0; !why && l <= t.n_layer; l++)
        if (t.starts[l] < 0 || t.starts[l] > n_rows || (l && t.starts[l] < t.starts[l - 1]))
            why = "plan: the layer starts are wrong";
    if (!why && (layer < 0 || layer >= t.n_layer))
        why = "plan: no such layer";
    for (Py_ssize_t r = 0; !why && r < n_rows; r++) {
        const int64_t *row = t.table + 5 * r;
        if (row[0] < 0 || row[1] <= 0 || row[2] <= 0 || row[2] % t.page || row[3] < 0
            || row[3] >= t.page || row[4] <= 0 || row[4] % t.page)
            why = "plan: a tensor's row is wrong";
    }
    /* every slice asked for must lie in its tensor's buffer */
    for (Py_ssize_t i = 0; !why && i < n_miss; i++)
        for (int64_t r = t.starts[layer]; !why && r < t.starts[layer + 1]; r++) {
            const int64_t *row = t.table + 5 * r;
            if (misses[i] < 0 || row[3] + (misses[i] + 1) * row[1] > row[4])
                why = "plan: an expert id is outside its tensor";
        }
    for (Py_ssize_t i = 0; !why && i < n_vict; i++) {
        int64_t vl = victims[2 * i], ve = victims[2 * i + 1];
        if (vl < 0 || vl >= t.n_layer)
            why = "plan: a victim's layer is outside the model";
        for (int64_t r = why ? 0 : t.starts[vl]; !why && r < t.starts[vl + 1]; r++) {
            const int64_t *row = t.table + 5 * r;
            if (ve < 0 || row[3] + (ve + 1) * row[1] > row[4])
                why = "plan: a victim's expert id is outside its tensor";
        }
    }
    if (why) {
        PyErr_SetString(PyExc_ValueError, why);
        return -1;
    }
    /* the victims' interior pages, in _victim_pages' order */
    Py_ssize_t cap = 1;
    for (Py_ssize_t i = 0; i < n_vict; i++) {
        int64_t vl = victims[2 * i];
        cap += t.starts[vl + 1] - t.starts[vl];
    }
    sp.v = calloc((size_t)cap, sizeof(Spare));
    sp.keys = calloc((size_t)cap, sizeof(int64_t));
    if (!sp.v || !sp.keys) {
        PyErr_NoMemory();
        goto done;
    }
    for (Py_ssize_t i = 0; i < n_vict; i++) {
        int64_t vl = victims[2 * i], ve = victims[2 * i + 1];
        for (int64_t r = t.starts[vl]; r < t.starts[vl + 1]; r++) {
            int64_t addr, n;
            interior(&t, r, ve, &addr, &n);
            if (!n)
                continue;
            Spare *x = &sp.v[sp.n++];
            x->n = n;
            x->addr = addr;
            x->unit_layer = vl;
            x->unit_expert = ve;
            int seen = 0;
            for (Py_ssize_t k = 0; k < sp.n_keys && !seen; k++)
                seen = sp.keys[k] == n;
            if (!seen)
                sp.keys[sp.n_keys++] = n;
        }
    }
    /* the reads: runs of consecutive misses (one miss each with `split`) */
    Py_ssize_t n_groups = split ? n_miss : (n_miss ? 1 : 0);
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        Py_ssize_t m0 = split ? g : 0, m1 = split ? g + 1 : n_miss;
        for (int64_t r = t.starts[layer]; r < t.starts[layer + 1]; r++) {
            const int64_t *row = t.table + 5 * r;
            int64_t off = row[0], s = row[1], base = row[2], phase = row[3], size = row[4];
            Py_ssize_t i = m0;
            while (i < m1) {
                Py_ssize_t j = i + 1;
                while (j < m1 && misses[j] == misses[j - 1] + 1)
                    j++;
                int64_t e0 = misses[i], e1 = misses[j - 1] + 1;
                /* the read's head; its move count is filled in after its moves */
                Py_ssize_t head = out->spec.n;
                if (vec_push(&out->spec, off + e0 * s) < 0
                    || vec_push(&out->spec, (e1 - e0) * s) < 0
                    || vec_push(&out->spec, base + phase + e0 * s) < 0
                    || vec_push(&out->spec, base) < 0 || vec_push(&out->spec, base + size) < 0
                    || vec_push(&out->spec, 0) < 0)
                    goto done;
                int64_t nm = 0;
                for (int64_t e = e0; recycle && e < e1; e++) {
                    int64_t dst, n;
                    interior(&t, r, e, &dst, &n);
                    if (!n)
                        continue;
                    int64_t take, cut;
                    Py_ssize_t k = take_spare_c(&sp, n, &take, &cut);
                    if (k < 0) {
                        if (fresh && (vec_push(&out->fresh, dst) < 0
                                      || vec_push(&out->fresh, n) < 0))
                            goto done;
                        continue;
                    }
                    Spare *x = &sp.v[k];
                    if (cut) {
                        if (release) {
                            if (madvise((void *)(intptr_t)(x->addr + n), (size_t)cut,
                                        MADV_DONTNEED) != 0) {
                                PyErr_SetFromErrno(PyExc_OSError);
                                goto done;
                            }
                        } else if (vec_push(&out->released, x->addr + n) < 0
                                   || vec_push(&out->released, cut) < 0) {
                            goto done;
                        }
                    }
                    if (vec_push(&out->spec, x->addr) < 0 || vec_push(&out->spec, dst) < 0
                        || vec_push(&out->spec, take) < 0
                        || vec_push(&out->taken, x->unit_layer) < 0
                        || vec_push(&out->taken, x->unit_expert) < 0)
                        goto done;
                    if (fresh && n > take && (vec_push(&out->fresh, dst + take) < 0
                                              || vec_push(&out->fresh, n - take) < 0))
                        goto done;
                    nm++;
                }
                out->spec.v[head + 5] = nm;
                i = j;
            }
        }
        if (vec_push(&out->ends, out->spec.n) < 0
            || vec_push(&out->taken_ends, out->taken.n / 2) < 0
            || vec_push(&out->fresh_ends, out->fresh.n / 2) < 0)
            goto done;
    }
    /* the victims' pages no miss took */
    for (Py_ssize_t k = 0; k < sp.n_keys; k++)
        for (Py_ssize_t i = 0; i < sp.n; i++) {
            Spare *x = &sp.v[i];
            if (x->used || x->n != sp.keys[k])
                continue;
            if (release) {
                if (madvise((void *)(intptr_t)x->addr, (size_t)x->n, MADV_DONTNEED) != 0) {
                    PyErr_SetFromErrno(PyExc_OSError);
                    goto done;
                }
            } else if (vec_push(&out->released, x->addr) < 0
                       || vec_push(&out->released, x->n) < 0) {
                goto done;
            }
        }
    rc = 0;
done:
    free(sp.v);
    free(sp.keys);
    return rc;
}

/* Group g's taken victims as a list of (layer, expert). */
static PyObject *taken_list(const PlanOut *o, Py_ssize_t g) {
    Py_ssize_t t0 = g ? o->taken_ends.v[g - 1] : 0, t1 = o->taken_ends.v[g];
    PyObject *tk = PyList_New(t1 - t0);
    for (Py_ssize_t q = t0; tk && q < t1; q++) {
        PyObject *u = Py_BuildValue("(LL)", (long long)o->taken.v[2 * q],
                                    (long long)o->taken.v[2 * q + 1]);
        if (!u) {
            Py_CLEAR(tk);
            break;
        }
        PyList_SET_ITEM(tk, q - t0, u);
    }
    return tk;
}

/* plan(table, starts, layer, misses, victims, recycle, split, release)
   -> (specs, taken, released)

   The reads of `misses` of `layer` (expert ids, in order), each slice taking over a
   victim's interior pages where one is spare, as `Lanes.submit` specs: one spec for
   them all (consecutive misses in one read per tensor, tensor by tensor), or with
   `split` one per miss (tensor by tensor within it). `taken` lists, per spec, the
   (layer, expert) victims whose pages its reads move. The victims' pages no miss took
   are freed (`madvise(MADV_DONTNEED)`) when `release`, else returned in `released` as
   (address, length) pairs, with the tails cut off larger victims. */
static PyObject *plan(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *table_o, *starts_o, *misses_o, *victims_o;
    long long layer;
    int recycle, split, release;
    if (!PyArg_ParseTuple(args, "OOLOOppp", &table_o, &starts_o, &layer, &misses_o,
                          &victims_o, &recycle, &split, &release))
        return NULL;
    PlanArgs a;
    if (plan_args(&a, table_o, starts_o, misses_o, victims_o) < 0)
        return NULL;
    PlanOut o = {0};
    PyObject *result = NULL, *specs = NULL, *taken = NULL, *released = NULL;
    if (plan_core(&a, layer, recycle, split, release, 0, &o) < 0)
        goto done;
    Py_ssize_t n_groups = o.ends.n;
    specs = PyList_New(n_groups);
    taken = PyList_New(n_groups);
    released = PyList_New(o.released.n / 2);
    if (!specs || !taken || !released)
        goto done;
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        Py_ssize_t s0 = g ? o.ends.v[g - 1] : 0, s1 = o.ends.v[g];
        PyObject *spec = PyList_New(s1 - s0);
        if (!spec)
            goto done;
        PyList_SET_ITEM(specs, g, spec);
        for (Py_ssize_t q = s0; q < s1; q++) {
            PyObject *x = PyLong_FromLongLong(o.spec.v[q]);
            if (!x)
                goto done;
            PyList_SET_ITEM(spec, q - s0, x);
        }
        PyObject *tk = taken_list(&o, g);
        if (!tk)
            goto done;
        PyList_SET_ITEM(taken, g, tk);
    }
    for (Py_ssize_t q = 0; q < o.released.n / 2; q++) {
        PyObject *pair = Py_BuildValue("(LL)", (long long)o.released.v[2 * q],
                                       (long long)o.released.v[2 * q + 1]);
        if (!pair)
            goto done;
        PyList_SET_ITEM(released, q, pair);
    }
    result = Py_BuildValue("(OOO)", specs, taken, released);
done:
    Py_XDECREF(specs);
    Py_XDECREF(taken);
    Py_XDECREF(released);
    plan_free(&o);
    plan_args_release(&a);
    return result;
}

/* plan_submit(table, starts, layer, misses, victims, recycle, split, prio, wake,
               give=None, take=None) -> (groups, taken)

   `plan` with the victims' spare pages freed, each spec queued at once as a group (no
   spec leaves C): one group for every miss, or with `split` one per miss. With `split`
   the groups are queued without waking a lane and one lane is woken after the last (the
   lanes wake each other for the rest); without it the group wakes lanes as `submit`
   does. No misses: no group. `give(address, length)`, when given, is called for each
   slice's interior pages no victim's pages cover, before anything is queued (a page
   supply puts fresh pages there; an exception from it queues nothing). `take(address,
   length)`, when given, receives the victims' pages no miss keeps instead of their being
   freed, before any `give` (a page supply keeps them for later slices; where it raises,
   they are freed). */
static PyObject *Lanes_plan_submit(Lanes *self, PyObject *args, PyObject *kw) {
    static char *names[] = {"table", "starts", "layer", "misses", "victims", "recycle",
                            "split", "prio", "wake", "give", "take", NULL};
    PyObject *table_o, *starts_o, *misses_o, *victims_o, *give = Py_None, *take = Py_None;
    long long layer;
    int recycle, split, prio, wake;
    if (!PyArg_ParseTupleAndKeywords(args, kw, "OOLOOppip|OO", names, &table_o, &starts_o,
                                     &layer, &misses_o, &victims_o, &recycle, &split, &prio,
                                     &wake, &give, &take))
        return NULL;
    if ((give != Py_None && !PyCallable_Check(give))
        || (take != Py_None && !PyCallable_Check(take))) {
        PyErr_SetString(PyExc_TypeError, "give and take must be callable or None");
        return NULL;
    }
    if (!queue_ok(self, prio))
        return NULL;
    PlanArgs a;
    if (plan_args(&a, table_o, starts_o, misses_o, victims_o) < 0)
        return NULL;
    PlanOut o = {0};
    PyObject *result = NULL, *groups = NULL, *taken = NULL;
    if (plan_core(&a, layer, recycle, split, take == Py_None, give != Py_None, &o) < 0)
        goto done;
    /* the victims' pages no miss keeps go to `take` (they may come back through `give`
       below); where it fails they are freed, as without it */
    for (Py_ssize_t q = 0; take != Py_None && q < o.released.n / 2; q++) {
        int64_t addr = o.released.v[2 * q], n = o.released.v[2 * q + 1];
        PyObject *r = PyObject_CallFunction(take, "LL", (long long)addr, (long long)n);
        if (r) {
            Py_DECREF(r);
            continue;
        }
        PyErr_Clear();
        if (madvise((void *)(intptr_t)addr, (size_t)n, MADV_DONTNEED) != 0) {
            PyErr_SetFromErrno(PyExc_OSError);
            goto done;
        }
    }
    for (Py_ssize_t q = 0; give != Py_None && q < o.fresh.n / 2; q++) {
        PyObject *r = PyObject_CallFunction(give, "LL", (long long)o.fresh.v[2 * q],
                                            (long long)o.fresh.v[2 * q + 1]);
        if (!r)
            goto done;
        Py_DECREF(r);
    }
    Py_ssize_t n_groups = o.ends.n;
    groups = PyList_New(n_groups);
    taken = PyList_New(n_groups);
    if (!groups || !taken)
        goto done;
    for (Py_ssize_t g = 0; g < n_groups; g++) {
        Py_ssize_t s0 = g ? o.ends.v[g - 1] : 0, s1 = o.ends.v[g];
        PyObject *grp = submit_core(self, o.spec.v + s0, s1 - s0, prio, split ? 0 : wake);
        if (!grp)
            goto done;
        PyList_SET_ITEM(groups, g, grp);
        PyObject *tk = taken_list(&o, g);
        if (!tk)
            goto done;
        PyList_SET_ITEM(taken, g, tk);
    }
    if (split && wake && n_groups) {
        pthread_mutex_lock(&self->mu);
        if (self->n_heap)
            wake_lanes(self, 1);
        pthread_mutex_unlock(&self->mu);
    }
    result = Py_BuildValue("(OO)", groups, taken);
done:
    Py_XDECREF(groups);
    Py_XDECREF(taken);
    plan_free(&o);
    plan_args_release(&a);
    return result;
}

/* pack_mxfp4(buffer, rowbytes): a writable buffer of whole groups of 8 MXFP4 rows,
   rewritten in place in llama.cpp's repacked layout (pack_mxfp4_8), the GIL released. */
static PyObject *pack_mxfp4(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer b;
    long long rowbytes;
    if (!PyArg_ParseTuple(args, "w*L", &b, &rowbytes))
        return NULL;
    int rc;
    if (rowbytes <= 0 || rowbytes % 17 || b.len % (8 * rowbytes)) {
        PyBuffer_Release(&b);
        PyErr_SetString(PyExc_ValueError,
                        "pack_mxfp4: the buffer is not whole groups of 8 rows of that size");
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    rc = pack_mxfp4_8(b.buf, b.len, rowbytes);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&b);
    if (rc != 0)
        return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"pack_mxfp4", pack_mxfp4, METH_VARARGS,
     "pack_mxfp4(buffer, rowbytes): whole groups of 8 MXFP4 rows rewritten in place in "
     "llama.cpp's repacked (CPU_REPACK, 8x8) layout."},
    {"plan", plan, METH_VARARGS,
     "plan(table, starts, layer, misses, victims, recycle, split, release) -> (specs, taken, released)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "readlanes",
    "The expert reader's lanes on pthreads (see reader.py's LaneQueue), and the read "
    "planning that feeds them (streamer.py's _reads_for).", -1,
    module_methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_readlanes(void) {
    if (PyType_Ready(&LanesType) < 0 || PyType_Ready(&GroupType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (!m)
        return NULL;
    Py_INCREF(&LanesType);
    Py_INCREF(&GroupType);
    if (PyModule_AddObject(m, "Lanes", (PyObject *)&LanesType) < 0
        || PyModule_AddObject(m, "Group", (PyObject *)&GroupType) < 0
        || PyModule_AddIntConstant(m, "KIND_READ", KIND_READ) < 0
        || PyModule_AddIntConstant(m, "KIND_SHORT", KIND_SHORT) < 0
        || PyModule_AddIntConstant(m, "KIND_CLOSED", KIND_CLOSED) < 0
        || PyModule_AddIntConstant(m, "KIND_FREE", KIND_FREE) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
