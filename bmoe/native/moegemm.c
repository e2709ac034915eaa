/* A prompt's MoE matmuls on llama.cpp's repacked experts, four tokens at a time.
 *
 * llama.cpp's CPU_REPACK buffer type runs MUL_MAT and MUL_MAT_ID on weights it has
 * interleaved (8 rows of MXFP4 into one block_mxfp4x8, 8 rows of Q4_K into one
 * block_q4_Kx8). Its MUL_MAT quantizes a batch's rows four at a time and runs its
 * *gemm* kernels, which read each weight block once for four rows; its MUL_MAT_ID (a
 * MoE layer's experts) runs the one-row *gemv* kernel for every (token, expert) pair, so
 * a prompt batch reads an expert's weights once per token routed to it. On the
 * gpt-oss-120b slice that kernel was two thirds of a prompt's CPU time.
 *
 * This file puts a wrapper in the expert tensor's `extra` (where CPU_REPACK keeps its
 * `ggml::cpu::tensor_traits` object): for MUL_MAT_ID on a batch of at least
 * MIN_TOKENS tokens it groups the rows routed to each expert, quantizes them four at a
 * time into the interleaved layout the gemm kernels take (llama.cpp's own
 * `ggml_quantize_mat_t`; a last group of two or three rows padded with copies of its
 * last row), runs llama.cpp's own gemm kernel on every group and its gemv on a single row
 * left over, and writes each row where MUL_MAT_ID puts it; every other
 * call (MUL_MAT, a decode step, another op) goes to the wrapped object unchanged.
 *
 * The kernels are llama.cpp's (the same functions its MUL_MAT runs on a batch, compiled
 * for this CPU by its build and covered by the engine's kernel probe); nothing here is
 * SIMD. The wrapped object is only ever one whose virtual `work_size` and
 * `compute_forward` are exactly those of one of the x86 kinds of the loaded libggml-cpu
 * (`KINDS`: `tensor_traits<block_mxfp4, 8, 8, Q8_0>`, Q4_K, Q4_0, IQ4_NL and Q2_K in 8x8
 * blocks; compared through the object's vtable with the symbols looked up by name),
 * which also checks the vtable slots this file calls and fills: [D1, D0, work_size,
 * compute_forward, repack]. Anything else is left alone.
 *
 * `bmoe_moegemm_evalcb` is an eval callback for a resident model: it answers "no" to
 * every node (llama.cpp then computes each split whole, as without a callback) and, at
 * the ask of a MUL_MAT_ID whose weight carries one of those objects, puts the wrapper in
 * its place. The expert streamer wraps its own tensors when it binds them.
 *
 * No ggml header is included: `struct gt` mirrors `struct ggml_tensor` of the pinned
 * llama.cpp as bmoe/engine/experts/ggml.py does, and `bmoe_moegemm_init` checks it
 * against the loaded ggml itself (a scratch context's tensors read back through it)
 * before anything is wrapped.
 */

#define _GNU_SOURCE            /* dladdr */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <dlfcn.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define EXPORT __attribute__((visibility("default")))
#define MIN_TOKENS 32          /* smaller batches keep llama.cpp's own path */
#define ALIGN 64
#define CHUNK_BYTES (192 << 10)  /* an expert's columns a pass over its groups reads */

struct gt {                    /* struct ggml_tensor */
    int32_t type;
    void *buffer;
    int64_t ne[4];
    size_t nb[4];
    int32_t op;
    int32_t op_params[16];
    int32_t flags;
    struct gt *src[10];
    struct gt *view_src;
    size_t view_offs;
    void *data;
    char name[64];
    void *extra;
    char padding[8];
};

struct cparams {               /* struct ggml_compute_params */
    int ith, nth;
    size_t wsize;
    void *wdata;
    void *threadpool;
    bool use_ref;
};

typedef void (*gemx_fn)(int n, float *s, size_t bs, const void *vx, const void *vy, int nr,
                        int nc);
typedef void (*qmat_fn)(const float *x, void *vy, int64_t nrow, int64_t n_per_row);
typedef void (*from_float_fn)(const float *x, void *y, int64_t k);
typedef bool (*work_size_fn)(void *self, int n_threads, const struct gt *op, size_t *size);
typedef bool (*compute_fn)(void *self, struct cparams *params, struct gt *op);
typedef void (*barrier_fn)(void *threadpool);

enum { K_MXFP4, K_Q4_K, K_Q4_0, K_IQ4_NL, K_Q2_K, N_KINDS };

typedef struct {
    const char *name;
    const char *work_size, *compute, *gemm, *gemv, *qmat;
    int32_t weight_type, param_type;
    /* resolved */
    void *sym_work_size, *sym_compute;
    gemx_fn gemm_fn, gemv_fn;
    qmat_fn qmat_fn;
    from_float_fn from_float;
    int64_t param_blck, param_bsize;
} kind_t;

#define TT(b, p) "_ZN4ggml3cpu6repack13tensor_traitsI" b "Ll8ELl8EL9ggml_type" p "EE"
#define KERN(f, b, p) "_ZN4ggml3cpu6repack4" f "I" b "Ll8ELl8EL9ggml_type" p "EEEviPfmPKvS7_ii"

/* One kind: its name, the block type's mangled name and ggml type, and the param type's
 * ggml type (8: Q8_0, 15: Q8_K) as it appears in the mangled names. */
#define KIND(label, blk, wtype, ptype) \
    {.name = label, \
     .work_size = TT(blk, #ptype) "9work_sizeEiPK11ggml_tensorRm", \
     .compute = TT(blk, #ptype) "15compute_forwardEP19ggml_compute_paramsP11ggml_tensor", \
     .gemm = KERN("gemm", blk, #ptype), .gemv = KERN("gemv", blk, #ptype), \
     .qmat = "_Z19ggml_quantize_mat_tILl8EL9ggml_type" #ptype "EEvPKfPvll", \
     .weight_type = wtype, .param_type = ptype}

static kind_t KINDS[N_KINDS] = {
    KIND("mxfp4 8x8", "11block_mxfp4", 39, 8),
    KIND("q4_K 8x8", "10block_q4_K", 12, 15),
    KIND("q4_0 8x8", "10block_q4_0", 2, 8),
    KIND("iq4_nl 8x8", "12block_iq4_nl", 20, 8),
    KIND("q2_K 8x8", "10block_q2_K", 10, 15),
};

/* The wrapper: laid out as a C++ object with one vtable pointer. */
typedef struct {
    void *const *vptr;
    void *orig;                /* the wrapped tensor_traits */
    kind_t *kind;
} wrap_t;

static struct {
    int ready;                 /* 0 not yet, -1 refused, else 0x100 | the kinds found */
    int32_t op_mul_mat_id;
    barrier_fn barrier;
    wrap_t wraps[N_KINDS];     /* one per kind: every tensor of a kind shares its object */
    void *vtable[7];           /* offset to top, RTTI, D1, D0, work_size, compute_forward,
                                  repack (tensor_traits_base's) */
    uint64_t gemm_ops, own_ops, swaps, padded;
} G;

static void *slot(const void *obj, int i) { return (*(void *const *const *)obj)[i]; }

/* -- the wrapper's virtual functions ------------------------------------------------------ */

static void w_dtor(void *self) { (void)self; }   /* never deleted: static, as llama.cpp's */

static size_t pad(size_t n) { return (n + ALIGN - 1) / ALIGN * ALIGN; }

/* An expert's rows in groups of four for the gemm kernel: the whole groups, and a last
 * one of two or three rows padded to four (one gemm over four rows costs about 1.1
 * gemv rows: 64 rows of a 2,880-wide MXFP4 expert take 3.34 ms by gemm, 11.70 ms by
 * gemv); a single row left over goes to gemv. */
static int64_t groups_of(int64_t count) { return count / 4 + (count % 4 >= 2); }

/* The quantized rows the groups of `routed` rows over `n_as` experts can take, at most. */
static int64_t group_rows(int64_t routed, int64_t n_as) { return 4 * (routed / 4 + n_as + 1); }

/* Where our path's parts sit in the work buffer for `op` (MUL_MAT_ID, F32 src1): byte
 * offsets, in order, and the size in all (w_work_size asks it, w_compute lays out by it). */
typedef struct {
    size_t rows, qg, qr, mine, mine_each, total;
} layout_t;

static layout_t layout_of(const kind_t *k, int nth, const struct gt *op) {
    const struct gt *src0 = op->src[0], *src1 = op->src[1], *ids = op->src[2];
    int64_t n_as = src0->ne[2], n_tok = ids->ne[1], n_ids = ids->ne[0];
    size_t rowq = (size_t)(src1->ne[0] / k->param_blck * k->param_bsize);
    layout_t l;
    l.rows = pad(sizeof(int64_t) * (size_t)n_as * 3);            /* counts, groups, rest */
    l.qg = l.rows + pad(sizeof(int32_t) * 2 * (size_t)(n_as * n_tok));  /* (slot, token) */
    l.qr = l.qg + pad((size_t)group_rows(n_tok * n_ids, n_as) * rowq);  /* the groups */
    l.mine = l.qr + pad((size_t)(3 * n_as + 1) * rowq);           /* the rest, a row each */
    l.mine_each = pad(sizeof(float) * 4 * (size_t)(src0->ne[1] + src1->ne[0]));
    l.total = l.mine + (size_t)nth * l.mine_each;                /* each thread's rows */
    return l;
}

static bool ours(const struct gt *op) {
    if (op->op != G.op_mul_mat_id)
        return false;
    const struct gt *src0 = op->src[0], *src1 = op->src[1], *ids = op->src[2];
    return src1 && ids && src1->type == 0 /* F32 */ && ids->type == 26 /* I32 */
        && ids->ne[1] >= MIN_TOKENS && src1->nb[0] == sizeof(float) && src0->ne[3] == 1
        && src1->ne[3] == 1 && op->ne[3] == 1 && op->nb[0] == sizeof(float)
        && src1->ne[2] == ids->ne[1] && op->ne[2] == ids->ne[1] && op->ne[1] == ids->ne[0]
        && op->ne[0] == src0->ne[1] && src1->ne[0] == src0->ne[0] && src0->ne[1] % 8 == 0;
}

static bool w_work_size(void *self, int n_threads, const struct gt *op, size_t *size) {
    wrap_t *w = self;
    bool got = ((work_size_fn)slot(w->orig, 2))(w->orig, n_threads, op, size);
    if (got && ours(op)) {
        size_t mine = layout_of(w->kind, n_threads, op).total;
        if (mine > *size)
            *size = mine;
    }
    return got;
}

static bool w_compute(void *self, struct cparams *p, struct gt *op) {
    wrap_t *w = self;
    if (!ours(op) || p->nth < 1 || p->ith < 0 || p->ith >= p->nth || !p->wdata)
        return ((compute_fn)slot(w->orig, 3))(w->orig, p, op);
    const layout_t lay = layout_of(w->kind, p->nth, op);
    if (p->wsize < lay.total)
        return ((compute_fn)slot(w->orig, 3))(w->orig, p, op);
    const kind_t *k = w->kind;
    const struct gt *src0 = op->src[0], *src1 = op->src[1], *ids = op->src[2];
    const int ith = p->ith, nth = p->nth;
    const int64_t n_as = src0->ne[2], n_tok = ids->ne[1], n_ids = ids->ne[0];
    const int64_t ne00 = src0->ne[0], ne01 = src0->ne[1], ne11 = src1->ne[1];
    const int64_t rowq = ne00 / k->param_blck * k->param_bsize;
    char *wd = p->wdata;
    int64_t *count = (int64_t *)wd, *gstart = count + n_as, *rstart = gstart + n_as;
    int32_t *rows = (int32_t *)(wd + lay.rows);          /* [n_as][n_tok] (slot, token) */
    char *qg = wd + lay.qg, *qr = wd + lay.qr;
    float *mine = (float *)(wd + lay.mine + (size_t)ith * lay.mine_each);
    float *gather = mine + 4 * ne01;

    if (ith == 0) {            /* the rows routed to each expert, in token order */
        memset(count, 0, sizeof(int64_t) * (size_t)n_as);
        for (int64_t t = 0; t < n_tok; t++)
            for (int64_t s = 0; s < n_ids; s++) {
                int32_t a = *(const int32_t *)((const char *)ids->data + t * ids->nb[1]
                                               + s * ids->nb[0]);
                if (a < 0 || a >= n_as)
                    continue;  /* llama.cpp's own path asserts; such a row stays unwritten */
                int32_t *r = rows + 2 * (a * n_tok + count[a]++);
                r[0] = (int32_t)s;
                r[1] = (int32_t)t;
            }
        int64_t g = 0, r = 0, padded = 0;
        for (int64_t a = 0; a < n_as; a++) {
            gstart[a] = g;
            rstart[a] = r;
            g += groups_of(count[a]);
            r += count[a] % 4 == 1;                      /* a single row left over */
            padded += count[a] % 4 >= 2;
        }
        __atomic_fetch_add(&G.padded, (uint64_t)padded, __ATOMIC_RELAXED);
    }
    G.barrier(p->threadpool);

    /* quantize: every group of four rows interleaved (a last one of two or three rows
       padded with copies of its last row), a single row left over as one row */
    int64_t item = 0;
    for (int64_t a = 0; a < n_as; a++) {
        const int32_t *r = rows + 2 * a * n_tok;
        int64_t whole = groups_of(count[a]);
        for (int64_t g = 0; g < whole + (count[a] % 4 == 1); g++, item++) {
            if (item % nth != ith)
                continue;
            if (g < whole) {
                for (int i = 0; i < 4; i++) {
                    int64_t at = 4 * g + i < count[a] ? 4 * g + i : count[a] - 1;
                    const int32_t *q = r + 2 * at;
                    memcpy(gather + i * ne00, (const char *)src1->data + (q[0] % ne11) * src1->nb[1]
                           + q[1] * src1->nb[2], sizeof(float) * (size_t)ne00);
                }
                k->qmat_fn(gather, qg + (gstart[a] + g) * 4 * rowq, 4, ne00);
            } else {
                const int32_t *q = r + 2 * (4 * whole + (g - whole));
                k->from_float((const float *)((const char *)src1->data
                                              + (q[0] % ne11) * src1->nb[1] + q[1] * src1->nb[2]),
                              qr + (rstart[a] + g - whole) * rowq, ne00);
            }
        }
    }
    G.barrier(p->threadpool);

    /* each thread its columns of every expert, as llama.cpp's MUL_MAT_ID splits them */
    int64_t c0 = ith * ne01 / nth, c1 = (ith + 1) * ne01 / nth;
    c0 = (c0 + 7) / 8 * 8;
    c1 = (c1 + 7) / 8 * 8;
    if (c1 > ne01)
        c1 = ne01;
    if (c0 < c1) {
        /* columns in chunks whose weights stay in this core's cache while every group
         * of four rows passes over them (a whole thread's columns of a large expert are
         * megabytes: read again for every group, they would come from memory each time) */
        int64_t chunk = CHUNK_BYTES / (int64_t)src0->nb[1] / 8 * 8;
        if (chunk < 8)
            chunk = 8;
        for (int64_t a = 0; a < n_as; a++) {
            if (!count[a])
                continue;
            const char *wa = (const char *)src0->data + a * src0->nb[2];
            const int32_t *r = rows + 2 * a * n_tok;
            int64_t whole = groups_of(count[a]);
            for (int64_t cc = c0; cc < c1 && whole; cc += chunk) {
                int nc = (int)(cc + chunk < c1 ? chunk : c1 - cc);
                for (int64_t g = 0; g < whole; g++) {
                    k->gemm_fn((int)ne00, mine, (size_t)nc, wa + cc * src0->nb[1],
                               qg + (gstart[a] + g) * 4 * rowq, 4, nc);
                    for (int i = 0; i < 4 && 4 * g + i < count[a]; i++) {
                        const int32_t *q = r + 2 * (4 * g + i);
                        memcpy((char *)op->data + q[0] * op->nb[1] + q[1] * op->nb[2] + cc * 4,
                               mine + i * nc, sizeof(float) * (size_t)nc);
                    }
                }
            }
            for (int64_t i = 4 * whole; i < count[a]; i++) {
                const int32_t *q = r + 2 * i;
                k->gemv_fn((int)ne00, (float *)((char *)op->data + q[0] * op->nb[1]
                                                + q[1] * op->nb[2]) + c0,
                           (size_t)ne01, wa + c0 * src0->nb[1],
                           qr + (rstart[a] + i - 4 * whole) * rowq, 1, (int)(c1 - c0));
            }
        }
    }
    if (ith == 0)
        __atomic_fetch_add(&G.own_ops, 1, __ATOMIC_RELAXED);
    return true;
}

/* tensor_traits_base::repack, which llama.cpp calls when a tensor's data is set through
 * its CPU_REPACK buffer: the wrapped object's. */
static int w_repack(void *self, struct gt *t, const void *data, size_t size) {
    wrap_t *w = self;
    typedef int (*repack_fn)(void *, struct gt *, const void *, size_t);
    return ((repack_fn)slot(w->orig, 4))(w->orig, t, data, size);
}

/* -- set-up --------------------------------------------------------------------------------- */

/* Check `struct gt` against the loaded ggml (libggml-base at `base`): two tensors and a
 * MUL_MAT_ID node made in a scratch context are read back through the mirror (ne, nb,
 * type, name, src, data right after the struct: its size), and the node's op number is
 * the one ggml names "MUL_MAT_ID". 0, or -1. */
static int check_layout(void *h) {
    struct init_params { size_t mem_size; void *mem_buffer; bool no_alloc; };
    typedef void *(*init_fn)(struct init_params);
    typedef void (*free_fn)(void *);
    typedef struct gt *(*new3_fn)(void *, int32_t, int64_t, int64_t, int64_t);
    typedef struct gt *(*new2_fn)(void *, int32_t, int64_t, int64_t);
    typedef struct gt *(*mmid_fn)(void *, struct gt *, struct gt *, struct gt *);
    typedef struct gt *(*name_fn)(struct gt *, const char *);
    typedef const char *(*op_name_fn)(int32_t);
    init_fn init = (init_fn)dlsym(h, "ggml_init");
    free_fn fr = (free_fn)dlsym(h, "ggml_free");
    new3_fn new3 = (new3_fn)dlsym(h, "ggml_new_tensor_3d");
    new2_fn new2 = (new2_fn)dlsym(h, "ggml_new_tensor_2d");
    mmid_fn mmid = (mmid_fn)dlsym(h, "ggml_mul_mat_id");
    name_fn set_name = (name_fn)dlsym(h, "ggml_set_name");
    op_name_fn op_name = (op_name_fn)dlsym(h, "ggml_op_name");
    if (!init || !fr || !new3 || !new2 || !mmid || !set_name || !op_name)
        return -1;
    void *ctx = init((struct init_params){1 << 20, NULL, false});
    if (!ctx)
        return -1;
    struct gt *as = new3(ctx, 0, 32, 16, 4);        /* F32 [32, 16, 4]: 4 experts */
    struct gt *b = new3(ctx, 0, 32, 1, 3);          /* F32 [32, 1, 3]: 3 tokens */
    struct gt *ids = new2(ctx, 26, 2, 3);           /* I32 [2, 3]: 2 experts a token */
    struct gt *mm = as && b && ids ? mmid(ctx, as, b, ids) : NULL;
    int ok = mm && set_name(as, "bmoe-moegemm-probe") == as
        && strcmp(as->name, "bmoe-moegemm-probe") == 0 && as->type == 0 && ids->type == 26
        && as->ne[0] == 32 && as->ne[1] == 16 && as->ne[2] == 4 && as->ne[3] == 1
        && as->nb[0] == 4 && as->nb[1] == 128 && as->nb[2] == 2048 && as->nb[3] == 8192
        && as->data == (void *)(as + 1) && b->data == (void *)(b + 1)
        && mm->src[0] == as && mm->src[1] == b && mm->src[2] == ids && mm->view_src == NULL
        && mm->ne[0] == 16 && mm->ne[1] == 2 && mm->ne[2] == 3 && mm->extra == NULL
        && op_name(mm->op) && strcmp(op_name(mm->op), "MUL_MAT_ID") == 0;
    if (ok)
        G.op_mul_mat_id = mm->op;
    fr(ctx);
    return ok ? 0 : -1;
}

/* Resolve llama.cpp's kernels in the libggml-cpu that holds `anchor` (an address in
 * the copy llama.cpp runs: the CPU_REPACK buffer type's get_name; a wheel's library
 * folder has the same library under several names, each a separate file, so a name
 * could map a second copy), and ggml's functions through its dependencies, after
 * checking the tensor layout against them. Returns a bit mask of the kinds found (bit i
 * for KINDS[i], see bmoe_moegemm_kind; 0: nothing to do), or -1 when ggml's layout is not the one
 * this file reads (then nothing is ever wrapped). */
EXPORT int bmoe_moegemm_init(const void *anchor) {
    if (G.ready)
        return G.ready < 0 ? -1 : (G.ready & 0xff);
    Dl_info info;
    if (!anchor || !dladdr(anchor, &info) || !info.dli_fname)
        return 0;
    void *h = dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD);
    if (!h)
        return 0;
    void *hb = h;              /* ggml-base's functions through libggml-cpu's dependencies */
    if (check_layout(hb) != 0) {
        G.ready = -1;
        return -1;
    }
    typedef size_t (*size_fn)(int32_t);
    typedef int64_t (*blck_fn)(int32_t);
    size_fn type_size = (size_fn)dlsym(hb, "ggml_type_size");
    blck_fn blck_size = (blck_fn)dlsym(hb, "ggml_blck_size");
    G.barrier = (barrier_fn)dlsym(h, "ggml_barrier");
    typedef const void *(*traits_fn)(int32_t);
    traits_fn traits = (traits_fn)dlsym(h, "ggml_get_type_traits_cpu");
    int found = 0;
    for (int i = 0; i < N_KINDS && G.barrier && traits && type_size && blck_size; i++) {
        kind_t *k = &KINDS[i];
        k->sym_work_size = dlsym(h, k->work_size);
        k->sym_compute = dlsym(h, k->compute);
        k->gemm_fn = (gemx_fn)dlsym(h, k->gemm);
        k->gemv_fn = (gemx_fn)dlsym(h, k->gemv);
        k->qmat_fn = (qmat_fn)dlsym(h, k->qmat);
        const void *tr = traits(k->param_type);
        k->from_float = tr ? *(from_float_fn const *)tr : NULL;   /* its first field */
        k->param_blck = blck_size(k->param_type);
        k->param_bsize = (int64_t)type_size(k->param_type);
        if (k->sym_work_size && k->sym_compute && k->gemm_fn && k->gemv_fn && k->qmat_fn
            && k->from_float && k->param_blck > 0 && k->param_bsize > 0)
            found |= 1 << i;
    }
    G.vtable[2] = (void *)w_dtor;
    G.vtable[3] = (void *)w_dtor;
    G.vtable[4] = (void *)w_work_size;
    G.vtable[5] = (void *)w_compute;
    G.vtable[6] = (void *)w_repack;
    G.ready = found | 0x100;
    return found;
}

/* The wrapper for `traits` (a tensor's extra), or NULL where it is not one of the kinds. */
EXPORT void *bmoe_moegemm_wrap(void *traits) {
    if (G.ready <= 0 || !(G.ready & 0xff) || !traits)
        return NULL;
    for (int i = 0; i < N_KINDS; i++) {
        if (&G.wraps[i] == traits)
            return traits;                  /* already ours */
        kind_t *k = &KINDS[i];
        if (!(G.ready & (1 << i)) || slot(traits, 2) != k->sym_work_size
            || slot(traits, 3) != k->sym_compute)
            continue;
        wrap_t *w = &G.wraps[i];
        if (w->orig && w->orig != traits)
            return NULL;                    /* a second object of a kind: not expected */
        w->vptr = &G.vtable[2];
        w->kind = k;
        w->orig = traits;
        return w;
    }
    return NULL;
}

/* An eval callback for a resident model: no node's data wanted; a MUL_MAT_ID's weight
 * carrying one of the kinds gets the wrapper. */
EXPORT bool bmoe_moegemm_evalcb(void *node, bool ask, void *user_data) {
    (void)user_data;
    struct gt *t = node;
    if (ask && t->op == G.op_mul_mat_id && t->src[0] && t->src[0]->extra) {
        void *w = bmoe_moegemm_wrap(t->src[0]->extra);
        if (w && w != t->src[0]->extra) {
            t->src[0]->extra = w;
            G.swaps++;
        }
    }
    return !ask;
}

/* Kind `i`'s name ("mxfp4 8x8", ...), or NULL past the last: bit i of init's mask. */
EXPORT const char *bmoe_moegemm_kind(int32_t i) {
    return i >= 0 && i < N_KINDS ? KINDS[i].name : NULL;
}

/* Prompt MUL_MAT_IDs run here since load, tensors given the wrapper by the callback, and
 * the last groups of two or three rows it padded to four. */
EXPORT void bmoe_moegemm_stats(uint64_t *out) {
    out[0] = __atomic_load_n(&G.own_ops, __ATOMIC_RELAXED);
    out[1] = G.swaps;
    out[2] = __atomic_load_n(&G.padded, __ATOMIC_RELAXED);
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "moegemm",
    "A prompt's MoE matmuls on llama.cpp's repacked experts with its gemm kernels "
    "(ctypes entry points).", -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_moegemm(void) { return PyModule_Create(&module); }
