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
 * With read-ahead on (`bmoe_evalcb_guess`), a one-token graph's routing node also has the
 * next layers' experts guessed here before Python's `route` runs: layer l's router input
 * h (found from the topk view: argsort -> probs -> "ffn_moe_logits-<l>" -> src[1]) times
 * the routers of layers l+1 .. l+depth, which Python hands over in bfloat16 (half the
 * bytes of the float32 product numpy did: these products run beside the expert matmuls
 * and are bound by memory), the top k kept where their softmax probability passes the
 * gate. The ids go into rows Python owns and reads in `route` (predict.Predictor.from_rows).
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

#include <math.h>
#include <stdbool.h>
#include <stdio.h>
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
enum { L_OP, L_NAME, L_NE, L_NB, L_DATA, L_SRC, L_SIZE, L_OP_VIEW, L_OP_MUL_MAT_ID, L_TYPE,
       L_VIEW_SRC, L_TYPE_F32, L_COUNT };

typedef struct {
    uint32_t magic;
    int32_t binding;           /* 1 while Python still rebinds expert tensors */
    size_t op, name, ne, nb, data, src, type, view_src;
    int32_t op_view, op_mul_mat_id, type_f32;
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
    /* read-ahead guesses (bmoe_evalcb_guess), all arrays owned by Python */
    const uint16_t *g_w;       /* bf16 routers [g_layers][g_experts][g_embd] */
    const uint8_t *g_has;      /* [g_layers]: 1 where the layer's router is in g_w */
    int32_t *g_out;            /* [g_depth][1 + g_k]: a count, then the ids */
    float *g_logits;           /* [g_experts] scratch */
    const float *g_bias;       /* NULL, or the routers' biases [g_layers][g_experts] */
    int32_t g_layers, g_experts, g_embd, g_depth, g_k;
    float g_gate;
    uint64_t g_rows;           /* layers guessed here from their router */
    uint64_t g_missing;        /* layers not guessed here: no router, or no router input */
    /* expert slots (bmoe_evalcb_slots): Python's permutations and a row of scratch */
    const int64_t *s_perm;     /* [s_layers][s_experts]: expert -> slot */
    float *s_scratch;          /* [s_experts] */
    int32_t s_layers, s_experts;
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
        {lay[L_NB], 16, 8}, {lay[L_DATA], 8, 8}, {lay[L_SRC], 16, 8}, {lay[L_TYPE], 4, 4},
        {lay[L_VIEW_SRC], 8, 8},
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
    st->type = (size_t)lay[L_TYPE];
    st->view_src = (size_t)lay[L_VIEW_SRC];
    st->op_view = (int32_t)lay[L_OP_VIEW];
    st->op_mul_mat_id = (int32_t)lay[L_OP_MUL_MAT_ID];
    st->type_f32 = (int32_t)lay[L_TYPE_F32];
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
 * load): op, ne[0], ne[1], nb[0], nb[1], data, src[0], the name's address, type, view_src,
 * src[1]. */
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
    out[8] = *(const int32_t *)(p + st->type);
    out[9] = (int64_t)(intptr_t)*(void *const *)(p + st->view_src);
    out[10] = (int64_t)(intptr_t)((void *const *)(p + st->src))[1];
    return 0;
}

/* asks, bind_calls, route_calls, binding, resident_routes, resident_hits, resident,
 * guessed (layers guessed here from their router), guess_missing. */
EXPORT void bmoe_evalcb_stats(const void *state, uint64_t *out) {
    const state_t *st = state;
    out[0] = st->asks;
    out[1] = st->bind_calls;
    out[2] = st->route_calls;
    out[3] = (uint64_t)st->binding;
    out[4] = st->resident_routes;
    out[5] = st->resident_hits;
    out[6] = (uint64_t)st->resident;
    out[7] = st->g_rows;
    out[8] = st->g_missing;
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

/* -- read-ahead guesses ------------------------------------------------------------------ */

/* Hand over the routers for read-ahead guesses: `w` bf16 [n_layer][n_expert][n_embd] (the
 * rows of layers whose `has` is 0 are not read), `out` [depth][1 + k] int32 and `logits`
 * [n_expert] float, all owned by Python and kept alive by it for as long as the state.
 * From the next one-token graph on, each routing node of layer l writes into row d of
 * `out` the guess for layer l+1+d: its count, then that many expert ids, the most probable
 * first (the top k of w[l+1+d] . h whose softmax probability is >= gate); the count is -1
 * where layer l+1+d has no router here or h was not found, -2 past the last layer. NULL
 * `w` turns guessing off. Returns 0, or -1 for a shape this does not take. */
EXPORT int bmoe_evalcb_guess(void *state, const uint16_t *w, const uint8_t *has,
                             int32_t n_layer, int32_t n_expert, int32_t n_embd, int32_t depth,
                             int32_t k, float gate, int32_t *out, float *logits) {
    state_t *st = state;
    if (!st || st->magic != STATE_MAGIC)
        return -1;
    if (!w) {
        st->g_w = NULL;
        return 0;
    }
    if (!has || !out || !logits || n_layer <= 0 || n_expert <= 0 || n_expert > MAX_EXPERT
        || n_embd <= 0 || depth <= 0 || depth > n_layer || k <= 0 || k > n_expert
        || !(gate >= 0.0f && gate <= 1.0f))
        return -1;
    st->g_bias = NULL;         /* bmoe_evalcb_guess_bias sets them */
    st->g_has = has;
    st->g_out = out;
    st->g_logits = logits;
    st->g_layers = n_layer;
    st->g_experts = n_expert;
    st->g_embd = n_embd;
    st->g_depth = depth;
    st->g_k = k;
    st->g_gate = gate;
    st->g_w = w;
    return 0;
}

/* The routers' biases for the guesses (float [n_layer][n_expert] as given to
 * bmoe_evalcb_guess, 0 where a layer's router has none; owned by Python and kept alive
 * by it), added to each guessed layer's logits as llama.cpp adds them before its top k
 * (gpt-oss); NULL forgets them. 0, or -1 without guessing on. */
EXPORT int bmoe_evalcb_guess_bias(void *state, const float *bias) {
    state_t *st = state;
    if (!st || st->magic != STATE_MAGIC || !st->g_w)
        return -1;
    st->g_bias = bias;
    return 0;
}

/* out[i] = sum_j w[i][j] * h[j], w in bfloat16 (the high half of a float32). Built for
 * each of these instruction sets and chosen at load by the CPU's own cpuid (GCC's
 * target_clones): every CPU runs one it has. Sixteen partial sums a row, so the loop
 * vectorises without reordering float additions the compiler may not reorder. */
__attribute__((target_clones("avx512f", "avx2", "default")))
static void matvec_bf16(const uint16_t *w, const float *h, int64_t rows, int64_t cols,
                        float *out) {
    for (int64_t i = 0; i < rows; i++) {
        const uint16_t *r = w + i * cols;
        float acc[16] = {0};
        int64_t j = 0;
        for (; j + 16 <= cols; j += 16)
            for (int q = 0; q < 16; q++) {
                uint32_t bits = (uint32_t)r[j + q] << 16;
                float f;
                memcpy(&f, &bits, sizeof f);
                acc[q] += f * h[j + q];
            }
        float sum = 0.0f;
        for (int q = 0; q < 16; q++)
            sum += acc[q];
        for (; j < cols; j++) {
            uint32_t bits = (uint32_t)r[j] << 16;
            float f;
            memcpy(&f, &bits, sizeof f);
            sum += f * h[j];
        }
        out[i] = sum;
    }
}

/* Layer `layer`'s router input for the graph's last token, found from its topk view the
 * way predict._router_h finds it, or NULL where the graph differs. */
static const float *router_input(const state_t *st, const char *topk, int32_t layer) {
#define PTR(t, off) (*(const char *const *)((t) + (off)))
    const char *argsort = PTR(topk, st->view_src);
    if (!argsort)
        argsort = PTR(topk, st->src);
    const char *probs = argsort ? PTR(argsort, st->src) : NULL;
    const char *logits = probs ? PTR(probs, st->src) : NULL;
    if (!logits)
        return NULL;
    char want[NAME_MAX_LEN];
    snprintf(want, sizeof want, "ffn_moe_logits-%d", (int)layer);
    if (strncmp(logits + st->name, want, NAME_MAX_LEN) != 0)
        return NULL;
    const char *h = PTR(logits + sizeof(void *), st->src);    /* src[1] */
    if (!h || *(const int32_t *)(h + st->type) != st->type_f32)
        return NULL;
    const char *data = PTR(h, st->data);
    const int64_t *ne = (const int64_t *)(h + st->ne);
    const size_t *nb = (const size_t *)(h + st->nb);
    if (!data || ne[0] != st->g_embd || ne[1] < 1 || nb[1] < (size_t)(4 * ne[0]) || nb[1] % 4)
        return NULL;
    return (const float *)(data + (size_t)(ne[1] - 1) * nb[1]);
#undef PTR
}

/* The guesses of layers layer+1 .. layer+depth from router input `h` (NULL: not found)
 * into g_out (see bmoe_evalcb_guess). */
static void guess_from(state_t *st, int32_t layer, const float *h) {
    int32_t n_expert = st->g_experts, k = st->g_k;
    float *logits = st->g_logits;
    for (int32_t d = 0; d < st->g_depth; d++) {
        int32_t *out = st->g_out + (size_t)d * (size_t)(1 + k);
        int32_t j = layer + 1 + d;
        if (j < 0 || j >= st->g_layers) {
            out[0] = -2;
            continue;
        }
        if (!h || !st->g_has[j]) {
            out[0] = -1;
            st->g_missing++;
            continue;
        }
        matvec_bf16(st->g_w + (size_t)j * (size_t)n_expert * (size_t)st->g_embd, h, n_expert,
                    st->g_embd, logits);
        if (st->g_bias) {
            const float *b = st->g_bias + (size_t)j * (size_t)n_expert;
            for (int32_t e = 0; e < n_expert; e++)
                logits[e] += b[e];
        }
        float top = -INFINITY;
        for (int32_t e = 0; e < n_expert; e++)
            if (logits[e] > top)
                top = logits[e];
        float norm = 0.0f;
        if (st->g_gate > 0.0f)
            for (int32_t e = 0; e < n_expert; e++)
                norm += expf(logits[e] - top);
        /* the k largest, the lower id first among equals (numpy's stable argsort), as far
         * as their probability passes the gate; a NaN is never taken */
        int32_t n = 0;
        uint64_t taken[MAX_EXPERT / 64];
        memset(taken, 0, sizeof(uint64_t) * (size_t)((n_expert + 63) / 64));
        while (n < k) {
            int32_t best = -1;
            for (int32_t e = 0; e < n_expert; e++)
                if (!(taken[e >> 6] & ((uint64_t)1 << (e & 63)))
                    && (best < 0 ? logits[e] == logits[e] : logits[e] > logits[best]))
                    best = e;
            if (best < 0)
                break;
            if (st->g_gate > 0.0f && !(expf(logits[best] - top) / norm >= st->g_gate))
                break;
            taken[best >> 6] |= (uint64_t)1 << (best & 63);
            out[1 + n++] = best;
        }
        out[0] = n;
        st->g_rows++;
    }
}

/* The guess of a router input given by the caller (tests compare it with numpy's). */
EXPORT int bmoe_evalcb_guess_for(void *state, int32_t layer, const float *h) {
    state_t *st = state;
    if (!st || st->magic != STATE_MAGIC || !st->g_w)
        return -1;
    guess_from(st, layer, h);
    return 0;
}

/* -- expert slots ------------------------------------------------------------------------ */

/* Hand over the expert slots' permutations (`perm` int64 [n_layer][n_expert], expert ->
 * slot, and `scratch` float [n_expert], both owned by Python and kept alive by it), for
 * bmoe_evalcb_rewrite; NULL `perm` forgets them. Returns 0, or -1 for a shape this does not
 * take. */
EXPORT int bmoe_evalcb_slots(void *state, const int64_t *perm, int32_t n_layer,
                             int32_t n_expert, float *scratch) {
    state_t *st = state;
    if (!st || st->magic != STATE_MAGIC)
        return -1;
    if (!perm) {
        st->s_perm = NULL;
        return 0;
    }
    if (!scratch || n_layer <= 0 || n_expert <= 0 || n_expert > MAX_EXPERT)
        return -1;
    st->s_scratch = scratch;
    st->s_layers = n_layer;
    st->s_experts = n_expert;
    st->s_perm = perm;
    return 0;
}

/* Rewrite the routing node `node` of layer `layer` (I32 [k, n], a view of the argsort of
 * the router's probabilities) in place from expert ids to their slots, and permute the
 * probabilities (F32 [n_expert, n] "ffn_moe_probs-<l>", which the weights' gather reads by
 * the same ids afterwards) to match: probs'[perm[e]] = probs[e]. What the streamer's
 * `_slot_rewrite` does with numpy, for one MoE layer of a graph, on the engine thread.
 * Returns 0; -1 without slots or a layer outside them; -2 where the routing's layout is
 * not one this reads; -3 where the probabilities are not where slots expect them; -4 for
 * a slot out of range (nothing written) or an id out of range (nothing written from its
 * row on). */
EXPORT int bmoe_evalcb_rewrite(void *state, const void *node, int32_t layer) {
#define PTR(t, off) (*(char *const *)((t) + (off)))
    state_t *st = state;
    if (!st || st->magic != STATE_MAGIC || !st->s_perm || !node || layer < 0
        || layer >= st->s_layers)
        return -1;
    const char *p = node;
    const int64_t *ne = (const int64_t *)(p + st->ne);
    const size_t *nb = (const size_t *)(p + st->nb);
    int64_t k = ne[0], n = ne[1], row = (int64_t)nb[1];
    if (k == 0 || n == 0)
        return 0;
    char *data = PTR(p, st->data);
    if (!data || k < 0 || n < 0 || nb[0] != 4 || row < 4 * k || row % 4)
        return -2;
    const char *argsort = PTR(p, st->view_src);
    const char *probs = argsort ? PTR(argsort, st->src) : NULL;
    int32_t E = st->s_experts;
    if (!probs || strncmp(probs + st->name, "ffn_moe_probs-", 14) != 0
        || *(const int32_t *)(probs + st->type) != st->type_f32)
        return -3;
    const int64_t *pne = (const int64_t *)(probs + st->ne);
    const size_t *pnb = (const size_t *)(probs + st->nb);
    char *pdata = PTR(probs, st->data);
    if (!pdata || pne[0] != E || pne[1] < n || pnb[0] != 4 || pnb[1] < (size_t)(4 * E)
        || pnb[1] % 4)
        return -3;
    const int64_t *perm = st->s_perm + (size_t)layer * (size_t)E;
    for (int32_t e = 0; e < E; e++)
        if ((uint64_t)perm[e] >= (uint64_t)E)
            return -4;
    float *scratch = st->s_scratch;
    for (int64_t j = 0; j < n; j++) {
        int32_t *ids = (int32_t *)(data + j * row);
        for (int64_t i = 0; i < k; i++)
            if (ids[i] < 0 || ids[i] >= E)
                return -4;
        float *pr = (float *)(pdata + (size_t)j * pnb[1]);
        memcpy(scratch, pr, sizeof(float) * (size_t)E);
        for (int32_t e = 0; e < E; e++)
            pr[perm[e]] = scratch[e];
        for (int64_t i = 0; i < k; i++)
            ids[i] = (int32_t)perm[ids[i]];
    }
    return 0;
#undef PTR
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
    if (st->g_w && ne[1] == 1 && ne[0] > 0 && layer >= 0)
        guess_from(st, layer, router_input(st, p, layer));
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
