/* The expert cache's victim choice, in C (bmoe/engine/experts/cache.py).
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
 *
 * `keep` and `extra` are float64 per unit (the kept score is the larger of the two;
 * `extra` may be None); `keep` None ranks by `stamp` alone (LRU). Ties rank by `stamp`
 * (the older first), then by unit index, so the choice does not depend on the order a
 * partition happens to leave. `resident` and `pinned` are bool (one byte) per unit,
 * `stamp` and `nbytes` int64 per unit. Nothing is written: the caller updates its arrays.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

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

static PyMethodDef methods[] = {
    {"victims", victims, METH_VARARGS,
     "victims(keep, extra, resident, pinned, stamp, protect_from, nbytes, over, k) -> "
     "(units least kept first, bytes freed)"},
    {"evictable_bytes", evictable_bytes, METH_VARARGS,
     "evictable_bytes(resident, pinned, stamp, protect_from, nbytes) -> int"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "cachepick",
    "The expert cache's victim choice: one pass over the units (see cache.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_cachepick(void) { return PyModule_Create(&module); }
