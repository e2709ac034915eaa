/* The expert cache's victim choice and its `reuse` policy's arithmetic, in C
 * (bmoe/engine/experts/cache.py).
 *
 * The cache keeps its bookkeeping in numpy arrays indexed by unit (layer * n_expert +
 * expert). Choosing victims looks at every unit that may be evicted (resident, not pinned
 * by a read in flight, not used since the tick `protect_from`), ranks them by how long the
 * policy would keep them, and frees the least kept until `over` bytes are free. In numpy
 * that is a dozen calls over all units (a mask, a gather, a partition, a sort, a cumsum),
 * and it runs two or three times per MoE layer and token: 5-10 ms per token on a whole
 * model of 36-48 layers. Here it is one pass over the units with a heap of the k least
 * kept, k = the most units `over` bytes can take.
 *
 *   victims(keep, extra, resident, pinned, stamp, protect_from, nbytes, over, k)
 *       -> (list of unit indices, least kept first; bytes they free)
 *   evictable_bytes(resident, pinned, stamp, protect_from, nbytes) -> int
 *   learn(...), score(...): `reuse`'s per-admit learning over one layer's row and its
 *       chances per unit (ExpertCache._learn and _score_rows, the same arithmetic as
 *       numpy's, which a dozen numpy calls per admit cost 20-50 us in the engine)
 *
 * `keep` and `extra` are float64 per unit (the kept score is the larger of the two;
 * `extra` may be None); `keep` None ranks by `stamp` alone (LRU). Ties rank by `stamp`
 * (the older first), then by unit index, so the choice does not depend on the order a
 * partition happens to leave. `resident` and `pinned` are bool (one byte) per unit,
 * `stamp` and `nbytes` int64 per unit. `victims` writes nothing: the caller updates its
 * arrays; `learn` and `score` write the rows they are given. Every size and index is
 * checked here first (a ValueError, never a write out of bounds).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

typedef struct {
    double score;
    int64_t stamp;
    Py_ssize_t unit;
} rank_t;

static inline bool before(const rank_t *a, const rank_t *b) {
    if (a->score != b->score)
        return a->score < b->score;
    if (a->stamp != b->stamp)
        return a->stamp < b->stamp;
    return a->unit < b->unit;
}

static int compare(const void *pa, const void *pb) {
    const rank_t *a = pa, *b = pb;
    return before(a, b) ? -1 : (before(b, a) ? 1 : 0);
}

/* A max-heap on `before` (its top is the most kept of the k held). */
static void sift_down(rank_t *h, Py_ssize_t n, Py_ssize_t i) {
    for (;;) {
        Py_ssize_t l = 2 * i + 1, r = l + 1, m = i;
        if (l < n && before(&h[m], &h[l]))
            m = l;
        if (r < n && before(&h[m], &h[r]))
            m = r;
        if (m == i)
            return;
        rank_t t = h[i];
        h[i] = h[m];
        h[m] = t;
        i = m;
    }
}

static void sift_up(rank_t *h, Py_ssize_t i) {
    while (i > 0) {
        Py_ssize_t p = (i - 1) / 2;
        if (!before(&h[p], &h[i]))
            return;
        rank_t t = h[i];
        h[i] = h[p];
        h[p] = t;
        i = p;
    }
}

/* The per-unit arrays, checked against one unit count. */
typedef struct {
    Py_buffer keep, extra, resident, pinned, stamp, nbytes;
    bool has_keep, has_extra;
    Py_ssize_t n;
} units_t;

static void release(units_t *u) {
    if (u->has_keep)
        PyBuffer_Release(&u->keep);
    if (u->has_extra)
        PyBuffer_Release(&u->extra);
    PyBuffer_Release(&u->resident);
    PyBuffer_Release(&u->pinned);
    PyBuffer_Release(&u->stamp);
    PyBuffer_Release(&u->nbytes);
}

static bool sized(const Py_buffer *b, Py_ssize_t n, Py_ssize_t item, const char *what) {
    if (b->len != n * item) {
        PyErr_Format(PyExc_ValueError, "%s holds %zd bytes, not %zd for %zd units", what,
                     b->len, n * item, n);
        return false;
    }
    return true;
}

static bool check(units_t *u, PyObject *keep, PyObject *extra) {
    u->n = u->resident.len;
    u->has_keep = keep != Py_None;
    u->has_extra = extra != Py_None;
    if (u->has_keep && PyObject_GetBuffer(keep, &u->keep, PyBUF_C_CONTIGUOUS) < 0) {
        u->has_keep = u->has_extra = false;
        return false;
    }
    if (u->has_extra && PyObject_GetBuffer(extra, &u->extra, PyBUF_C_CONTIGUOUS) < 0) {
        u->has_extra = false;
        return false;
    }
    return sized(&u->pinned, u->n, 1, "pinned") && sized(&u->stamp, u->n, 8, "stamp")
        && sized(&u->nbytes, u->n, 8, "nbytes")
        && (!u->has_keep || sized(&u->keep, u->n, 8, "keep"))
        && (!u->has_extra || sized(&u->extra, u->n, 8, "extra"));
}

/* The heap pass: the k least kept evictable units, least kept first, into `heap`
 * (room for k); how many were found. */
static Py_ssize_t pick(rank_t *heap, Py_ssize_t k, Py_ssize_t n, const double *ks,
                       const double *ex, const uint8_t *resident, const uint8_t *pinned,
                       const int64_t *stamp, long long protect_from) {
    Py_ssize_t held = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (!resident[i] || pinned[i] || stamp[i] >= protect_from)
            continue;
        rank_t r = {ks != NULL ? ks[i] : (double)stamp[i], stamp[i], i};
        if (ex != NULL && ex[i] > r.score)
            r.score = ex[i];
        if (held < k) {
            heap[held] = r;
            sift_up(heap, held++);
        } else if (before(&r, &heap[0])) {
            heap[0] = r;
            sift_down(heap, k, 0);
        }
    }
    qsort(heap, (size_t)held, sizeof(rank_t), compare);
    return held;
}

static PyObject *victims(PyObject *self, PyObject *args) {
    (void)self;
    PyObject *keep, *extra;
    units_t u = {0};
    long long protect_from, over;
    Py_ssize_t k;
    if (!PyArg_ParseTuple(args, "OOy*y*y*Ly*Ln:victims", &keep, &extra, &u.resident,
                          &u.pinned, &u.stamp, &protect_from, &u.nbytes, &over, &k))
        return NULL;
    PyObject *out = NULL;
    rank_t *heap = NULL;
    if (!check(&u, keep, extra))
        goto done;
    const int64_t *nbytes = u.nbytes.buf;
    if (k > u.n)
        k = u.n;
    if (k < 1 || over <= 0) {
        out = Py_BuildValue("(NL)", PyList_New(0), 0LL);
        goto done;
    }
    heap = PyMem_Malloc(sizeof(rank_t) * (size_t)k);
    if (heap == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    Py_ssize_t held = pick(heap, k, u.n, u.has_keep ? u.keep.buf : NULL,
                           u.has_extra ? u.extra.buf : NULL, u.resident.buf, u.pinned.buf,
                           u.stamp.buf, protect_from);
    long long freed = 0;
    Py_ssize_t cut = 0;
    while (cut < held && freed < over)
        freed += nbytes[heap[cut++].unit];
    PyObject *list = PyList_New(cut);
    if (list == NULL)
        goto done;
    for (Py_ssize_t j = 0; j < cut; j++) {
        PyObject *v = PyLong_FromSsize_t(heap[j].unit);
        if (v == NULL) {
            Py_DECREF(list);
            goto done;
        }
        PyList_SET_ITEM(list, j, v);
    }
    out = Py_BuildValue("(NL)", list, freed);
done:
    PyMem_Free(heap);
    release(&u);
    return out;
}

static PyObject *evictable_bytes(PyObject *self, PyObject *args) {
    (void)self;
    units_t u = {0};
    long long protect_from;
    if (!PyArg_ParseTuple(args, "y*y*y*Ly*:evictable_bytes", &u.resident, &u.pinned,
                          &u.stamp, &protect_from, &u.nbytes))
        return NULL;
    PyObject *out = NULL;
    if (check(&u, Py_None, Py_None)) {
        const uint8_t *resident = u.resident.buf, *pinned = u.pinned.buf;
        const int64_t *stamp = u.stamp.buf, *nbytes = u.nbytes.buf;
        long long total = 0;
        for (Py_ssize_t i = 0; i < u.n; i++)
            if (resident[i] && !pinned[i] && stamp[i] < protect_from)
                total += nbytes[i];
        out = PyLong_FromLongLong(total);
    }
    release(&u);
    return out;
}

/* own_pin(resident, pinned, saved, layer, ids, share, n_expert) -> 0, 1 or 2: what
 * ExpertCache.admit_own decides before its admission (see cache.py, `_own_pin`, the
 * numpy reference), with `pinned` first copied into `saved` (the caller copies it back
 * after the admission). 1: the layer holds `share` units or more and has as many it may
 * evict as the ids miss; every other layer is pinned. 2: otherwise, the layers holding
 * more than their share (the layer itself aside) have that many units they may evict;
 * every other layer is pinned. 0: neither; nothing is pinned. */
static PyObject *own_pin(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer res, pin, saved, ids;
    int layer;
    long long share;
    Py_ssize_t n;
    if (!PyArg_ParseTuple(args, "y*w*w*iy*Ln:own_pin", &res, &pin, &saved, &layer, &ids,
                          &share, &n))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t layers = n > 0 ? res.len / n : 0;
    if (n <= 0 || res.len % n || pin.len != res.len || saved.len != res.len
        || ids.len % 8) {
        PyErr_SetString(PyExc_ValueError, "own_pin: arrays of different shapes");
        goto done;
    }
    if (layer < 0 || layer >= layers) {
        PyErr_Format(PyExc_ValueError, "layer %d outside 0..%zd", layer, layers - 1);
        goto done;
    }
    const uint8_t *r = res.buf;
    uint8_t *p = pin.buf;
    const int64_t *id = ids.buf;
    Py_ssize_t k = ids.len / 8, base = (Py_ssize_t)layer * n;
    long long n_in = 0, hits = 0, held = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (id[j] < 0 || id[j] >= n) {
            PyErr_Format(PyExc_ValueError, "expert %lld outside 0..%zd", (long long)id[j],
                         n - 1);
            goto done;
        }
        hits += r[base + id[j]] != 0;
    }
    for (Py_ssize_t i = 0; i < n; i++) {
        n_in += r[base + i] != 0;
        held += r[base + i] && p[base + i];
    }
    long long need = (long long)k - hits;
    memcpy(saved.buf, p, (size_t)res.len);
    long mode = 0;
    if (n_in >= share && n_in - held - hits >= need) {
        memset(p, 1, (size_t)res.len);
        memcpy(p + base, (const uint8_t *)saved.buf + base, (size_t)n);
        mode = 1;
    } else {
        long long free = 0;
        int any = 0;
        for (Py_ssize_t l = 0; l < layers; l++) {
            if (l == layer)
                continue;
            long long in = 0, ok = 0;
            for (Py_ssize_t i = l * n; i < (l + 1) * n; i++) {
                in += r[i] != 0;
                ok += r[i] && !p[i];
            }
            if (in > share) {
                any = 1;
                free += ok;
            }
        }
        if (any && free >= need) {
            for (Py_ssize_t l = 0; l < layers; l++) {
                long long in = 0;
                for (Py_ssize_t i = l * n; i < (l + 1) * n; i++)
                    in += r[i] != 0;
                if (l == layer || in <= share)
                    memset(p + l * n, 1, (size_t)n);
            }
            mode = 2;
        }
    }
    out = PyLong_FromLong(mode);
done:
    PyBuffer_Release(&res);
    PyBuffer_Release(&pin);
    PyBuffer_Release(&saved);
    PyBuffer_Release(&ids);
    return out;
}

/* The `reuse` policy's per-admit learning (ExpertCache._learn), for one layer's row of
 * n units: each unit adds one observation to the hazard table [2][gaps][buckets] at its
 * cell (gap since its last use, its bucket; the routed half when `routed` has it), then
 * the routed units' last visit becomes `visits + 1`, every count decays by `decay` and
 * the routed ones gain 1, and the level log2(count + 1) (at most buckets - 1) and its
 * bucket (the level rounded) are remade. The arithmetic is numpy's, in the same order.
 * The buckets were checked to lie in the table. */
static void learn_row(const uint8_t *routed, Py_ssize_t n, long long visits, int64_t *lv,
                      double *ct, double *lvl, int64_t *bk, double *hz, int gaps,
                      int buckets, double decay) {
    for (Py_ssize_t i = 0; i < n; i++) {
        long long gap = visits + 1 - lv[i];
        if (gap > gaps - 1)
            gap = gaps - 1;
        if (gap < 0)
            gap = 0;
        hz[(routed[i] ? gaps * buckets : 0) + gap * buckets + bk[i]] += 1.0;
    }
    double keep = 1.0 - decay, top = (double)(buckets - 1);
    for (Py_ssize_t i = 0; i < n; i++) {
        double c = ct[i] * keep;
        if (routed[i]) {
            lv[i] = visits + 1;
            c += 1.0;
        }
        ct[i] = c;
        double l = log2(c + 1.0);
        if (l > top)
            l = top;
        lvl[i] = l;
        bk[i] = (int64_t)(l + 0.5);
    }
}

static bool buckets_ok(const int64_t *bk, Py_ssize_t n, int buckets) {
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bk[i] < 0 || bk[i] >= buckets) {
            PyErr_SetString(PyExc_ValueError, "learn: a bucket outside the table");
            return false;
        }
    }
    return true;
}

static PyObject *learn(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer ids, last, count, level, bucket, hazard;
    long long visits;
    int gaps, buckets;
    double decay;
    if (!PyArg_ParseTuple(args, "y*Lw*w*w*w*w*iid:learn", &ids, &visits, &last, &count, &level,
                          &bucket, &hazard, &gaps, &buckets, &decay))
        return NULL;
    PyObject *out = NULL;
    uint8_t *routed = NULL;
    Py_ssize_t n = last.len / 8, k = ids.len / 8;
    if (gaps < 2 || buckets < 1 || last.len != n * 8 || ids.len != k * 8
        || !sized(&count, n, 8, "count") || !sized(&level, n, 8, "level")
        || !sized(&bucket, n, 8, "bucket")
        || !sized(&hazard, 2 * (Py_ssize_t)gaps * buckets, 8, "hazard")) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "learn: arrays of unexpected sizes");
        goto done;
    }
    routed = PyMem_Calloc((size_t)n + 1, 1);
    if (routed == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    const int64_t *id = ids.buf;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (id[j] < 0 || id[j] >= n) {
            PyErr_Format(PyExc_ValueError, "learn: expert %lld outside 0..%zd",
                         (long long)id[j], n - 1);
            goto done;
        }
        routed[id[j]] = 1;
    }
    if (!buckets_ok(bucket.buf, n, buckets))
        goto done;
    learn_row(routed, n, visits, last.buf, count.buf, level.buf, bucket.buf, hazard.buf, gaps,
              buckets, decay);
    out = Py_NewRef(Py_None);
done:
    PyMem_Free(routed);
    PyBuffer_Release(&ids);
    PyBuffer_Release(&last);
    PyBuffer_Release(&count);
    PyBuffer_Release(&level);
    PyBuffer_Release(&bucket);
    PyBuffer_Release(&hazard);
    return out;
}

/* `reuse` chances of rows r0 .. r1-1 (n units each): the chance of use within the
 * horizon from `within` [gaps][buckets + 1] at the unit's gap, interpolated between the
 * buckets around its level. */
static void score_rows(double *ch, const int64_t *lv, const double *lvl, const int64_t *vs,
                       const double *w, Py_ssize_t n, Py_ssize_t r0, Py_ssize_t r1, int gaps,
                       int buckets) {
    for (Py_ssize_t r = r0; r < r1; r++) {
        for (Py_ssize_t i = r * n; i < (r + 1) * n; i++) {
            long long gap = vs[r] + 1 - lv[i];
            if (gap > gaps - 1)
                gap = gaps - 1;
            if (gap < 0)
                gap = 0;
            double l = lvl[i];
            int64_t lo = (int64_t)l;
            if (lo < 0)
                lo = 0;
            if (lo > buckets - 1)
                lo = buckets - 1;
            const double *cell = w + gap * (buckets + 1);
            double below = cell[lo];
            ch[i] = below + (cell[lo + 1] - below) * (l - (double)lo);
        }
    }
}

/* ExpertCache._score_rows: layer `row`'s units, or every layer's with row -1. */
static PyObject *score(PyObject *self, PyObject *args) {
    (void)self;
    Py_buffer chance, last, level, visits, within;
    int row, gaps, buckets;
    if (!PyArg_ParseTuple(args, "w*y*y*y*y*iii:score", &chance, &last, &level, &visits,
                          &within, &row, &gaps, &buckets))
        return NULL;
    PyObject *out = NULL;
    Py_ssize_t layers = visits.len / 8;
    Py_ssize_t n = layers > 0 ? chance.len / 8 / layers : 0;
    if (gaps < 2 || buckets < 1 || visits.len != layers * 8 || chance.len != layers * n * 8
        || !sized(&last, layers * n, 8, "last_visit") || !sized(&level, layers * n, 8, "level")
        || !sized(&within, (Py_ssize_t)gaps * (buckets + 1), 8, "within")
        || row < -1 || row >= layers) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "score: arrays of unexpected sizes");
        goto done;
    }
    score_rows(chance.buf, last.buf, level.buf, visits.buf, within.buf, n,
               row < 0 ? 0 : row, row < 0 ? layers : row + 1, gaps, buckets);
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&chance);
    PyBuffer_Release(&last);
    PyBuffer_Release(&level);
    PyBuffer_Release(&visits);
    PyBuffer_Release(&within);
    return out;
}

/* ---- Book: a `reuse` cache's admissions in one call ------------------------------
 *
 * Book(resident, stamp, loaded, pinned, spec_p, bytes_of, unit_bytes, visits, last_visit,
 *      count, level, bucket, hazard, chance, stale, out, gaps, buckets, decay, budget,
 *      min_unit)
 * holds the cache's own arrays (their buffers, for its lifetime) and does what
 * ExpertCache.admit and admit_spec do with the `reuse` policy, in the same order and
 * with the same arithmetic, as long as the table of chances `within` is not due to be
 * remade (the caller checks; it is remade in Python once per token):
 *
 *   admit(layer, ids, tick, within, resident_bytes)
 *       -> (misses written to `out`, hits, rereads, victims [(layer, expert)], freed)
 *   admit_spec(layer, ids, tick, demand_tick, chance, within, resident_bytes)
 *       -> (misses written to `out`, victims, freed)
 *
 * `stale` (one byte per layer) marks the rows of `chance` to score again before a
 * choice; scoring clears it. Every index is checked before anything is written. */

enum { B_RESIDENT, B_STAMP, B_LOADED, B_PINNED, B_SPEC, B_BYTES, B_UNIT, B_VISITS, B_LAST,
       B_COUNT, B_LEVEL, B_BUCKET, B_HAZARD, B_CHANCE, B_STALE, B_OUT, B_N };

typedef struct {
    PyObject_HEAD
    Py_buffer b[B_N];
    int held;                   /* buffers acquired */
    Py_ssize_t n_layer, n_expert;
    int gaps, buckets;
    double decay;
    long long budget, min_unit;
    uint8_t *routed;            /* n_expert scratch */
    rank_t *heap;               /* n_layer * n_expert scratch */
} Book;

#define BUF(o, i, T) ((T *)(o)->b[i].buf)

static void Book_dealloc(Book *self) {
    for (int i = 0; i < self->held; i++)
        PyBuffer_Release(&self->b[i]);
    PyMem_Free(self->routed);
    PyMem_Free(self->heap);
    Py_TYPE(self)->tp_free((PyObject *)self);
}

static int Book_init(Book *self, PyObject *args, PyObject *kw) {
    (void)kw;
    if (self->held) {
        PyErr_SetString(PyExc_TypeError, "Book is made once");
        return -1;
    }
    static const char *names[B_N] = {"resident", "stamp", "loaded", "pinned", "spec_p",
                                     "bytes_of", "unit_bytes", "visits", "last_visit",
                                     "count", "level", "bucket", "hazard", "chance", "stale",
                                     "out"};
    Py_ssize_t nargs = PyTuple_Size(args);
    if (nargs != B_N + 5) {
        PyErr_Format(PyExc_TypeError, "Book takes %d arguments", B_N + 5);
        return -1;
    }
    for (int i = 0; i < B_N; i++) {
        if (PyObject_GetBuffer(PyTuple_GET_ITEM(args, i), &self->b[i],
                               PyBUF_C_CONTIGUOUS | PyBUF_WRITABLE) < 0)
            return -1;
        self->held++;
    }
    PyObject *rest = PyTuple_GetSlice(args, B_N, nargs);
    if (rest == NULL)
        return -1;
    int ok = PyArg_ParseTuple(rest, "iidLL:Book", &self->gaps, &self->buckets, &self->decay,
                              &self->budget, &self->min_unit);
    Py_DECREF(rest);
    if (!ok)
        return -1;
    Py_ssize_t layers = self->b[B_UNIT].len / 8;
    Py_ssize_t n = layers > 0 ? self->b[B_RESIDENT].len / layers : 0;
    Py_ssize_t units = layers * n;
    self->n_layer = layers;
    self->n_expert = n;
    static const Py_ssize_t item[B_N] = {1, 8, 1, 1, 8, 8, 8, 8, 8, 8, 8, 8, 8, 8, 1, 8};
    for (int i = 0; i < B_N; i++) {
        Py_ssize_t want = i == B_UNIT || i == B_VISITS || i == B_STALE ? layers
                        : i == B_HAZARD ? 2 * (Py_ssize_t)self->gaps * self->buckets
                        : i == B_OUT ? n : units;
        if (!sized(&self->b[i], want, item[i], names[i]))
            return -1;
    }
    if (layers < 1 || n < 1 || self->gaps < 2 || self->buckets < 1 || self->min_unit < 1) {
        PyErr_SetString(PyExc_ValueError, "Book: an empty cache or a bad table shape");
        return -1;
    }
    self->routed = PyMem_Calloc((size_t)n, 1);
    self->heap = PyMem_Malloc(sizeof(rank_t) * (size_t)units);
    if (self->routed == NULL || self->heap == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    return 0;
}

/* The layer and its ids (each in 0 .. n_expert - 1), checked. */
static bool book_ids(Book *self, int layer, const Py_buffer *ids) {
    if (layer < 0 || layer >= self->n_layer) {
        PyErr_Format(PyExc_ValueError, "layer %d outside 0..%zd", layer, self->n_layer - 1);
        return false;
    }
    if (ids->len % 8 || ids->len / 8 > self->n_expert) {
        PyErr_SetString(PyExc_ValueError, "ids: more than the layer's experts, or not int64");
        return false;
    }
    const int64_t *id = ids->buf;
    for (Py_ssize_t j = 0; j < ids->len / 8; j++) {
        if (id[j] < 0 || id[j] >= self->n_expert) {
            PyErr_Format(PyExc_ValueError, "expert %lld outside 0..%zd", (long long)id[j],
                         self->n_expert - 1);
            return false;
        }
    }
    return true;
}

static bool book_within(Book *self, const Py_buffer *within) {
    return sized(within, (Py_ssize_t)self->gaps * (self->buckets + 1), 8, "within");
}

/* ExpertCache._take after the misses are in `out`: victims if over the budget (the
 * stale rows scored first), then the misses resident and loaded. */
static PyObject *book_take(Book *self, int layer, Py_ssize_t m, long long protect_from,
                           const double *within, long long resident_bytes, long long *freed) {
    Py_ssize_t n = self->n_expert, units = self->n_layer * n;
    uint8_t *resident = BUF(self, B_RESIDENT, uint8_t);
    const int64_t *out = BUF(self, B_OUT, int64_t);
    long long need = BUF(self, B_UNIT, int64_t)[layer] * (long long)m;
    long long over = resident_bytes + need - self->budget;
    *freed = 0;
    PyObject *list = NULL;
    Py_ssize_t cut = 0;
    if (over > 0) {
        uint8_t *stale = BUF(self, B_STALE, uint8_t);
        Py_ssize_t nstale = 0;
        for (Py_ssize_t r = 0; r < self->n_layer; r++)
            nstale += stale[r] != 0;
        double *chance = BUF(self, B_CHANCE, double);
        const int64_t *lv = BUF(self, B_LAST, int64_t), *vs = BUF(self, B_VISITS, int64_t);
        const double *lvl = BUF(self, B_LEVEL, double);
        if (nstale > 2) {
            score_rows(chance, lv, lvl, vs, within, n, 0, self->n_layer, self->gaps,
                       self->buckets);
        } else {
            for (Py_ssize_t r = 0; r < self->n_layer; r++)
                if (stale[r])
                    score_rows(chance, lv, lvl, vs, within, n, r, r + 1, self->gaps,
                               self->buckets);
        }
        memset(stale, 0, (size_t)self->n_layer);
        Py_ssize_t k = (Py_ssize_t)((over + self->min_unit - 1) / self->min_unit);
        if (k > units)
            k = units;
        Py_ssize_t held = pick(self->heap, k, units, chance, BUF(self, B_SPEC, double),
                               resident, BUF(self, B_PINNED, uint8_t),
                               BUF(self, B_STAMP, int64_t), protect_from);
        const int64_t *nbytes = BUF(self, B_BYTES, int64_t);
        while (cut < held && *freed < over)
            *freed += nbytes[self->heap[cut++].unit];
    }
    list = PyList_New(cut);
    if (list == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < cut; j++) {
        Py_ssize_t u = self->heap[j].unit;
        PyObject *t = Py_BuildValue("(nn)", u / n, u % n);
        if (t == NULL) {
            Py_DECREF(list);
            return NULL;
        }
        PyList_SET_ITEM(list, j, t);
    }
    for (Py_ssize_t j = 0; j < cut; j++)
        resident[self->heap[j].unit] = 0;
    uint8_t *loaded = BUF(self, B_LOADED, uint8_t);
    for (Py_ssize_t j = 0; j < m; j++) {
        resident[layer * n + out[j]] = 1;
        loaded[layer * n + out[j]] = 1;
    }
    return list;
}

static PyObject *Book_admit(Book *self, PyObject *args) {
    int layer;
    Py_buffer ids, within;
    long long tick, resident_bytes;
    if (!PyArg_ParseTuple(args, "iy*Ly*L:admit", &layer, &ids, &tick, &within,
                          &resident_bytes))
        return NULL;
    PyObject *ret = NULL;
    if (!book_ids(self, layer, &ids) || !book_within(self, &within))
        goto done;
    Py_ssize_t n = self->n_expert, k = ids.len / 8, base = (Py_ssize_t)layer * n;
    const int64_t *id = ids.buf;
    int64_t *bucket = BUF(self, B_BUCKET, int64_t) + base;
    if (!buckets_ok(bucket, n, self->buckets))
        goto done;
    const uint8_t *resident = BUF(self, B_RESIDENT, uint8_t) + base;
    const uint8_t *loaded = BUF(self, B_LOADED, uint8_t) + base;
    int64_t *out = BUF(self, B_OUT, int64_t);
    Py_ssize_t m = 0, hits = 0, rereads = 0;
    for (Py_ssize_t j = 0; j < k; j++) {
        if (resident[id[j]])
            hits++;
        else
            out[m++] = id[j];
    }
    for (Py_ssize_t j = 0; j < m; j++)
        rereads += loaded[out[j]] != 0;
    int64_t *stamp = BUF(self, B_STAMP, int64_t) + base;
    for (Py_ssize_t j = 0; j < k; j++)
        stamp[id[j]] = tick;
    memset(self->routed, 0, (size_t)n);
    for (Py_ssize_t j = 0; j < k; j++)
        self->routed[id[j]] = 1;
    int64_t *visits = BUF(self, B_VISITS, int64_t);
    learn_row(self->routed, n, visits[layer], BUF(self, B_LAST, int64_t) + base,
              BUF(self, B_COUNT, double) + base, BUF(self, B_LEVEL, double) + base, bucket,
              BUF(self, B_HAZARD, double), self->gaps, self->buckets, self->decay);
    visits[layer] += 1;
    BUF(self, B_STALE, uint8_t)[layer] = 1;
    double *spec = BUF(self, B_SPEC, double) + base;
    for (Py_ssize_t i = 0; i < n; i++)
        spec[i] = 0.0;
    long long freed;
    PyObject *victims = book_take(self, layer, m, tick, within.buf, resident_bytes, &freed);
    if (victims != NULL)
        ret = Py_BuildValue("(nnnNL)", m, hits, rereads, victims, freed);
done:
    PyBuffer_Release(&ids);
    PyBuffer_Release(&within);
    return ret;
}

static PyObject *Book_admit_spec(Book *self, PyObject *args) {
    int layer;
    Py_buffer ids, within;
    long long tick, demand_tick, resident_bytes;
    double chance;
    if (!PyArg_ParseTuple(args, "iy*LLdy*L:admit_spec", &layer, &ids, &tick, &demand_tick,
                          &chance, &within, &resident_bytes))
        return NULL;
    PyObject *ret = NULL;
    if (!book_ids(self, layer, &ids) || !book_within(self, &within))
        goto done;
    Py_ssize_t n = self->n_expert, k = ids.len / 8, base = (Py_ssize_t)layer * n;
    Py_ssize_t units = self->n_layer * n;
    const int64_t *id = ids.buf;
    const uint8_t *resident = BUF(self, B_RESIDENT, uint8_t);
    const uint8_t *pinned = BUF(self, B_PINNED, uint8_t);
    int64_t *out = BUF(self, B_OUT, int64_t);
    Py_ssize_t m = 0;
    for (Py_ssize_t j = 0; j < k; j++)
        if (!resident[base + id[j]] && !pinned[base + id[j]])
            out[m++] = id[j];
    long long freed = 0;
    if (m == 0) {
        ret = Py_BuildValue("(nNL)", m, PyList_New(0), freed);
        goto done;
    }
    long long unit = BUF(self, B_UNIT, int64_t)[layer];
    long long need = unit * (long long)m;
    if (resident_bytes + need > self->budget) {
        const int64_t *stamp = BUF(self, B_STAMP, int64_t), *nbytes = BUF(self, B_BYTES, int64_t);
        long long free = 0;
        for (Py_ssize_t i = 0; i < units; i++)
            if (resident[i] && !pinned[i] && stamp[i] < demand_tick)
                free += nbytes[i];
        if (resident_bytes + need - free > self->budget) {
            long long room = self->budget - resident_bytes + free;
            long long fit = room <= 0 ? 0 : room / (unit > 1 ? unit : 1);
            if (fit < m)
                m = (Py_ssize_t)fit;
            if (m == 0) {
                ret = Py_BuildValue("(nNL)", m, PyList_New(0), freed);
                goto done;
            }
        }
    }
    int64_t *stamp = BUF(self, B_STAMP, int64_t) + base;
    double *spec = BUF(self, B_SPEC, double) + base;
    for (Py_ssize_t j = 0; j < m; j++) {
        stamp[out[j]] = tick;
        spec[out[j]] = chance;
    }
    PyObject *victims = book_take(self, layer, m, demand_tick, within.buf, resident_bytes,
                                  &freed);
    if (victims != NULL)
        ret = Py_BuildValue("(nNL)", m, victims, freed);
done:
    PyBuffer_Release(&ids);
    PyBuffer_Release(&within);
    return ret;
}

static PyMethodDef Book_methods[] = {
    {"admit", (PyCFunction)Book_admit, METH_VARARGS,
     "admit(layer, ids, tick, within, resident_bytes) -> (misses in out, hits, rereads, "
     "victims, bytes freed)"},
    {"admit_spec", (PyCFunction)Book_admit_spec, METH_VARARGS,
     "admit_spec(layer, ids, tick, demand_tick, chance, within, resident_bytes) -> "
     "(misses in out, victims, bytes freed)"},
    {NULL, NULL, 0, NULL},
};

static PyTypeObject BookType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "bmoe.native.cachepick.Book",
    .tp_doc = "A reuse cache's admissions over its own arrays (see cache.py).",
    .tp_basicsize = sizeof(Book),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Book_init,
    .tp_dealloc = (destructor)Book_dealloc,
    .tp_methods = Book_methods,
};

static PyMethodDef methods[] = {
    {"victims", victims, METH_VARARGS,
     "victims(keep, extra, resident, pinned, stamp, protect_from, nbytes, over, k) -> "
     "(units least kept first, bytes freed)"},
    {"own_pin", own_pin, METH_VARARGS,
     "own_pin(resident, pinned, saved, layer, ids, share, n_expert) -> 0, 1 or 2"},
    {"evictable_bytes", evictable_bytes, METH_VARARGS,
     "evictable_bytes(resident, pinned, stamp, protect_from, nbytes) -> int"},
    {"learn", learn, METH_VARARGS,
     "learn(ids, visits, last_visit, count, level, bucket, hazard, gaps, buckets, decay)"},
    {"score", score, METH_VARARGS,
     "score(chance, last_visit, level, visits, within, row, gaps, buckets)"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cachepick",
    "The expert cache's victim choice: one pass over the units (see cache.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_cachepick(void) {
    if (PyType_Ready(&BookType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddObjectRef(m, "Book", (PyObject *)&BookType) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
