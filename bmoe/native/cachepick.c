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
    const uint8_t *resident = u.resident.buf, *pinned = u.pinned.buf;
    const int64_t *stamp = u.stamp.buf, *nbytes = u.nbytes.buf;
    const double *ks = u.has_keep ? u.keep.buf : NULL;
    const double *ex = u.has_extra ? u.extra.buf : NULL;
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
    Py_ssize_t held = 0;
    for (Py_ssize_t i = 0; i < u.n; i++) {
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

/* The `reuse` policy's per-admit learning (ExpertCache._learn), for one layer's row of
 * n units: each unit adds one observation to the hazard table [2][gaps][buckets] at its
 * cell (gap since its last use, its bucket; the routed half when `ids` has it), then the
 * routed units' last visit becomes `visits + 1`, every count decays by `decay` and the
 * routed ones gain 1, and the level log2(count + 1) (at most buckets - 1) and its bucket
 * (the level rounded) are remade. The arithmetic is numpy's, in the same order. */
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
    int64_t *lv = last.buf, *bk = bucket.buf;
    double *ct = count.buf, *lvl = level.buf, *hz = hazard.buf;
    for (Py_ssize_t i = 0; i < n; i++) {
        if (bk[i] < 0 || bk[i] >= buckets) {
            PyErr_SetString(PyExc_ValueError, "learn: a bucket outside the table");
            goto done;
        }
    }
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

/* `reuse` chances (ExpertCache._score_rows) of layer `row`'s units, or of every layer's
 * with row -1: the chance of use within the horizon from `within` [gaps][buckets + 1] at
 * the unit's gap, interpolated between the buckets around its level. */
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
    double *ch = chance.buf;
    const int64_t *lv = last.buf, *vs = visits.buf;
    const double *lvl = level.buf, *w = within.buf;
    Py_ssize_t r0 = row < 0 ? 0 : row, r1 = row < 0 ? layers : row + 1;
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
    out = Py_NewRef(Py_None);
done:
    PyBuffer_Release(&chance);
    PyBuffer_Release(&last);
    PyBuffer_Release(&level);
    PyBuffer_Release(&visits);
    PyBuffer_Release(&within);
    return out;
}

static PyMethodDef methods[] = {
    {"victims", victims, METH_VARARGS,
     "victims(keep, extra, resident, pinned, stamp, protect_from, nbytes, over, k) -> "
     "(units least kept first, bytes freed)"},
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

PyMODINIT_FUNC PyInit_cachepick(void) { return PyModule_Create(&module); }
