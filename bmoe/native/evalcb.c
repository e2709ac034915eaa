/* The expert streamer's graph-eval callback (llama.cpp's `cb_eval`), in C.
 *
 * llama.cpp's scheduler calls the callback for every node of every graph, first to ask
 * whether we want the node's data (the "ask" phase), then, for the nodes we said yes to,
 * with the data computed (the "data" phase). Only two kinds of node matter to the
 * streamer (see bmoe/engine/experts/streamer.py):
 *
 *   - the VIEW nodes named "ffn_moe_topk-<l>" (the router's choice for layer l): we want
 *     their data; in the data phase we hand layer, shape, row stride and data pointer to
 *     Python's `route` function, which makes those experts resident (one call per MoE
 *     layer and graph), unless every expert is resident for good (the model fits the
 *     cache), where the routing is only counted here (`bmoe_evalcb_resident`), and a
 *     one-token graph's ids copied into Python's rows for the routing record
 *     (`bmoe_evalcb_record`);
 *   - the MUL_MAT_ID nodes, while Python still has expert tensors to rebind (the first
 *     evaluation only): their ask phase goes to Python's `bind` function, which returns
 *     how many tensors are still unbound; at 0 we stop forwarding them.
 *
 * Every other node is answered here ("no") without entering Python: about 1,300 nodes
 * per token on the benchmark model, which cost 2-7 ms per token as a ctypes callback.
 *
 * No llama.cpp or ggml header is included: the offsets of the ggml_tensor fields read
 * here (op, name, ne, nb, data, src) and the two op numbers are handed over at init by
 * Python, which checks them against the loaded ggml first (bmoe/engine/experts/ggml.py)
 * and then reads a probe tensor back through `bmoe_evalcb_read` to check this side too.
 *
 * The state lives in memory Python allocates (`bmoe_evalcb_size` bytes) and keeps for as
 * long as the llama.cpp context exists; its address is the callback's user_data. The
 * callback runs on the thread that called llama_decode; the Python functions are ctypes
 * callbacks, which take the GIL themselves. Nothing here can fail in a way llama.cpp
 * would have to handle: a Python failure comes back as `route` returning false, which
 * stops the graph, and Python reports it after llama_decode returns.
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))
#define STATE_MAGIC 0x626d6f65u /* "bmoe" */

typedef bool (*route_fn)(void *node, int32_t layer, int64_t k, int64_t n, int64_t row,
                         void *data);
typedef int32_t (*bind_fn)(void *node);
typedef bool (*eval_fn)(void *node, bool ask, void *user_data);

/* The order of the offsets array handed to bmoe_evalcb_init. */
enum { L_OP, L_NAME, L_NE, L_NB, L_DATA, L_SRC, L_SIZE, L_OP_VIEW, L_OP_MUL_MAT_ID, L_COUNT };

typedef struct {
    uint32_t magic;
    int32_t binding;           /* 1 while Python still rebinds expert tensors */
    size_t op, name, ne, nb, data, src;
    int32_t op_view, op_mul_mat_id;
    route_fn route;
    bind_fn bind;
    eval_fn forward;           /* when set, every call goes to it (the Python callback) */
    int32_t resident;          /* every expert resident for good: routings stay here */
    int32_t n_layer, n_expert;
    uint64_t resident_routes;  /* routings answered here (resident), and their experts */
    uint64_t resident_hits;
    uint64_t asks;             /* ask-phase calls, all answered here */
    uint64_t bind_calls;       /* ask-phase calls forwarded to Python's bind */
    uint64_t route_calls;      /* data-phase calls (one per MoE layer and graph) */
    int32_t *rec;              /* Python's [rec_layers][rec_k] rows: a one-token graph's */
    int32_t rec_layers, rec_k; /* routing, written here while resident (routing records) */
    int32_t local_layers;      /* layers from here on are held by an RPC helper: not ours */
} state_t;

static const char TOPK[] = "ffn_moe_topk-";
#define TOPK_LEN (sizeof TOPK - 1)
#define NAME_MAX_LEN 64        /* GGML_MAX_NAME */

EXPORT size_t bmoe_evalcb_size(void) { return sizeof(state_t); }

/* Fill `state` (bmoe_evalcb_size() bytes). Returns 0, or -1 when an offset would read
 * outside a tensor of `lay[L_SIZE]` bytes or is misaligned for its field. */
EXPORT int bmoe_evalcb_init(void *state, const int64_t *lay, int32_t count, route_fn route,
                            bind_fn bind, int32_t binding) {
    state_t *st = state;
    if (!st || !lay || count != L_COUNT || !route || !bind)
        return -1;
    int64_t size = lay[L_SIZE];
    struct { int64_t off, len, align; } f[] = {
        {lay[L_OP], 4, 4}, {lay[L_NAME], NAME_MAX_LEN, 1}, {lay[L_NE], 16, 8},
        {lay[L_NB], 16, 8}, {lay[L_DATA], 8, 8}, {lay[L_SRC], 8, 8},
    };
    for (size_t i = 0; i < sizeof f / sizeof f[0]; i++)
        if (f[i].off < 0 || f[i].off + f[i].len > size || f[i].off % f[i].align)
            return -1;
    memset(st, 0, sizeof *st);
    st->op = (size_t)lay[L_OP];
    st->name = (size_t)lay[L_NAME];
    st->ne = (size_t)lay[L_NE];
    st->nb = (size_t)lay[L_NB];
    st->data = (size_t)lay[L_DATA];
    st->src = (size_t)lay[L_SRC];
    st->op_view = (int32_t)lay[L_OP_VIEW];
    st->op_mul_mat_id = (int32_t)lay[L_OP_MUL_MAT_ID];
    st->route = route;
    st->bind = bind;
    st->binding = binding ? 1 : 0;
    st->local_layers = INT32_MAX;
    st->magic = STATE_MAGIC;
    return 0;
}

/* Layers `n` and after are held by RPC helpers (their data is not in this process): their
 * routing nodes are not asked for. */
EXPORT int bmoe_evalcb_local(void *state, int32_t n) {
    state_t *st = state;
    if (!st || n < 0)
        return -1;
    st->local_layers = n;
    return 0;
}

/* The fields this file reads, read from `node` with the state's offsets (for the check at
 * load): op, ne[0], ne[1], nb[0], nb[1], data, src[0], the name's address. */
EXPORT int bmoe_evalcb_read(const void *state, const void *node, int64_t *out) {
    const state_t *st = state;
    if (!st || st->magic != STATE_MAGIC || !node || !out)
        return -1;
    const char *p = node;
    out[0] = *(const int32_t *)(p + st->op);
    out[1] = ((const int64_t *)(p + st->ne))[0];
    out[2] = ((const int64_t *)(p + st->ne))[1];
    out[3] = (int64_t)((const size_t *)(p + st->nb))[0];
    out[4] = (int64_t)((const size_t *)(p + st->nb))[1];
    out[5] = (int64_t)(intptr_t)*(void *const *)(p + st->data);
    out[6] = (int64_t)(intptr_t)((void *const *)(p + st->src))[0];
    out[7] = (int64_t)(intptr_t)(p + st->name);
    return 0;
}

/* asks, bind_calls, route_calls, binding, resident_routes, resident_hits, resident. */
EXPORT void bmoe_evalcb_stats(const void *state, uint64_t *out) {
    const state_t *st = state;
    out[0] = st->asks;
    out[1] = st->bind_calls;
    out[2] = st->route_calls;
    out[3] = (uint64_t)st->binding;
    out[4] = st->resident_routes;
    out[5] = st->resident_hits;
    out[6] = (uint64_t)st->resident;
}

/* Send every call to `fn` (a ggml_backend_sched_eval_callback: the streamer's Python
 * callback), or, with NULL, answer here again. For comparisons within one context: the
 * switch is made between two llama_decode calls, on the thread that makes them. */
EXPORT void bmoe_evalcb_forward(void *state, eval_fn fn) {
    state_t *st = state;
    st->forward = fn;
}

#define MAX_EXPERT 4096

/* Python says every expert of every layer is resident and nothing can evict one (the
 * model fits the cache): from now on a routing whose ids are all in 0..n_expert-1 is only
 * counted here (how many distinct experts it used: the cache's hits), without entering
 * Python. Anything else still goes to Python's route. 0 turns it off. */
EXPORT int bmoe_evalcb_resident(void *state, int32_t on, int32_t n_layer, int32_t n_expert) {
    state_t *st = state;
    if (on && (n_layer <= 0 || n_expert <= 0 || n_expert > MAX_EXPERT))
        return -1;
    st->n_layer = n_layer;
    st->n_expert = n_expert;
    st->resident = on ? 1 : 0;
    return 0;
}

/* Where a one-token graph's routing is written while resident (`buf`, n_layer rows of k
 * ids, owned by Python and kept alive by it), so a routing record needs no Python per
 * layer; NULL stops it. */
EXPORT int bmoe_evalcb_record(void *state, int32_t *buf, int32_t n_layer, int32_t k) {
    state_t *st = state;
    if (buf && (n_layer <= 0 || k <= 0 || k > MAX_EXPERT))
        return -1;
    st->rec = buf;
    st->rec_layers = buf ? n_layer : 0;
    st->rec_k = buf ? k : 0;
    return 0;
}

/* The distinct experts of a routing I32 [k, n] (rows `row` bytes apart), or -1 when an id
 * is out of range or the layout is not one this reads. */
static int64_t distinct(const char *data, int64_t k, int64_t n, int64_t row, int32_t n_expert) {
    uint64_t seen[MAX_EXPERT / 64];
    if (!data || k <= 0 || n <= 0 || row < 4 * k || row % 4)
        return -1;
    memset(seen, 0, sizeof(uint64_t) * (size_t)((n_expert + 63) / 64));
    int64_t count = 0;
    for (int64_t j = 0; j < n; j++) {
        const int32_t *ids = (const int32_t *)(data + j * row);
        for (int64_t i = 0; i < k; i++) {
            int32_t e = ids[i];
            if (e < 0 || e >= n_expert)
                return -1;
            uint64_t bit = (uint64_t)1 << (e & 63);
            if (!(seen[e >> 6] & bit)) {
                seen[e >> 6] |= bit;
                count++;
            }
        }
    }
    return count;
}

/* "ffn_moe_topk-<l>" -> l, or -1. */
static int32_t topk_layer(const char *name) {
    if (strncmp(name, TOPK, TOPK_LEN) != 0)
        return -1;
    int64_t layer = 0;
    const char *c = name + TOPK_LEN;
    if (*c < '0' || *c > '9')
        return -1;
    for (int i = 0; *c >= '0' && *c <= '9'; c++, i++) {
        if (i >= 9)
            return -1;
        layer = layer * 10 + (*c - '0');
    }
    return *c == '\0' ? (int32_t)layer : -1;
}

/* llama.cpp's ggml_backend_sched_eval_callback. */
EXPORT bool bmoe_evalcb(void *node, bool ask, void *user_data) {
    state_t *st = user_data;
    const char *p = node;
    if (st->forward)
        return st->forward(node, ask, NULL);
    if (ask) {
        st->asks++;
        int32_t op = *(const int32_t *)(p + st->op);
        if (op == st->op_view) {
            int32_t layer = topk_layer(p + st->name);
            return layer >= 0 && layer < st->local_layers;
        }
        if (op == st->op_mul_mat_id && st->binding) {
            st->bind_calls++;
            if (st->bind(node) == 0)
                st->binding = 0;
        }
        return false;
    }
    /* the data phase: only for the topk views we asked for */
    const int64_t *ne = (const int64_t *)(p + st->ne);
    const size_t *nb = (const size_t *)(p + st->nb);
    int32_t layer = topk_layer(p + st->name);
    void *data = *(void *const *)(p + st->data);
    if (st->resident && !st->binding && layer >= 0 && layer < st->n_layer) {
        if (ne[0] == 0 || ne[1] == 0) {
            st->resident_routes++;   /* a chunk's last layer that outputs no logits */
            return true;
        }
        int64_t hits = distinct(data, ne[0], ne[1], (int64_t)nb[1], st->n_expert);
        if (hits >= 0) {
            st->resident_routes++;
            st->resident_hits += (uint64_t)hits;
            if (st->rec && ne[1] == 1 && ne[0] == st->rec_k && layer < st->rec_layers)
                memcpy(st->rec + (size_t)layer * (size_t)st->rec_k, data,
                       sizeof(int32_t) * (size_t)st->rec_k);   /* ids checked by distinct */
            return true;
        }
    }
    st->route_calls++;
    return st->route(node, layer, ne[0], ne[1], (int64_t)nb[1], data);
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "evalcb",
    "The expert streamer's graph-eval callback for llama.cpp (C functions, loaded with "
    "ctypes from this module's file; see bmoe/engine/experts/evalcb.py).",
    0, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_evalcb(void) { return PyModule_Create(&module); }
