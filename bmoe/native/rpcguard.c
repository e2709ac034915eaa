/* A guard around llama.cpp calls for models split over RPC helpers (bmoe/engine/rpc.py).
 *
 * llama.cpp's RPC backend ends the process when a helper stops answering: its client
 * checks every reply with RPC_STATUS_ASSERT, which calls GGML_ABORT. ggml calls the
 * function registered with ggml_set_abort_callback before abort(); this module registers
 * one, and wraps llama_decode so that an abort raised while the guarded decode runs
 * comes back to Python as a return code instead:
 *
 *   - the engine thread calls `bmoe_rpcguard_decode`, which takes a sigsetjmp and calls
 *     llama_decode. If the abort happens on that thread, the callback siglongjmps back
 *     at once.
 *   - In ggml-rpc the socket is driven by one dispatcher thread per helper, so the abort
 *     usually happens there while the engine thread waits for that thread's reply. The
 *     callback then records the message, and signals the engine thread (GUARD_SIGNAL)
 *     until it has jumped; it never returns (returning would abort), it parks for good.
 *     The engine thread's handler jumps only when the thread is not inside an OpenMP
 *     parallel region (the CPU backend's workers wait for it there); otherwise the next
 *     signal, 20 ms later, tries again. In practice the engine thread is waiting for the
 *     helper's reply (a futex wait), which is where the jump lands.
 *
 * The load (llama_model_load_from_file) and the context's creation (llama_init_from_model)
 * are guarded the same way: a helper that hangs up while its layers are sent fails the
 * load, not the process.
 *
 * After a jump nothing of that llama.cpp context may be used or freed: the jump skipped
 * C++ destructors, the dispatcher thread is parked holding its socket, and freeing the
 * model would join that thread. Python marks the session failed and leaks it.
 *
 * No llama.cpp or ggml header is included and nothing is linked: Python passes the
 * addresses of ggml_set_abort_callback, llama_decode and llama_synchronize (in the loaded
 * libraries) and of omp_in_parallel (NULL if the CPU backend has no OpenMP).
 */

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

/* llama.h's struct llama_batch, passed by value (Python checks the field list). */
typedef struct {
    int32_t n_tokens;
    void *token;
    void *embd;
    void *pos;
    void *n_seq_id;
    void *seq_id;
    void *logits;
} batch_t;

typedef int32_t (*decode_fn)(void *ctx, batch_t batch);
typedef void (*sync_fn)(void *ctx);
typedef void (*abort_cb)(const char *message);
typedef abort_cb (*set_abort_fn)(abort_cb cb);
typedef int (*in_parallel_fn)(void);

#define GUARD_JUMPED (-1000)  /* the return code of a decode the guard ended */

static sigjmp_buf jump_env;
static pthread_t engine_thread;
static atomic_int armed;          /* 1 while a guarded decode runs */
static atomic_int jumped;         /* set by the engine thread right before it jumps */
static in_parallel_fn in_parallel;
static int guard_signal;
static char last_message[1024];
static atomic_int have_message;

static void remember(const char *message) {
    int expected = 0;
    if (atomic_compare_exchange_strong(&have_message, &expected, 1)) {
        strncpy(last_message, message ? message : "", sizeof last_message - 1);
        last_message[sizeof last_message - 1] = '\0';
    }
}

static void jump_back(void) {
    atomic_store(&armed, 0);
    atomic_store(&jumped, 1);
    siglongjmp(jump_env, 1);
}

static void on_guard_signal(int sig) {
    (void)sig;
    if (!atomic_load(&armed) || !pthread_equal(pthread_self(), engine_thread)) {
        return;
    }
    if (in_parallel != NULL && in_parallel()) {
        return;  /* inside the CPU backend's parallel region: the next signal retries */
    }
    if (PyGILState_Check()) {
        return;  /* inside a Python callback (the abort callback): the next signal retries */
    }
    jump_back();
}

static void on_abort(const char *message) {
    if (!atomic_load(&armed) || message == NULL || strstr(message, "ggml-rpc") == NULL) {
        return;  /* not the RPC client inside a guarded decode: ggml aborts as it did */
    }
    remember(message);
    if (pthread_equal(pthread_self(), engine_thread)) {
        if (in_parallel == NULL || !in_parallel()) {
            jump_back();
        }
        return;  /* cannot leave a parallel region from here: ggml aborts */
    }
    /* Another thread (the RPC dispatcher, or a CPU worker): wake the engine thread until
     * it has jumped, then park this thread for good. */
    struct timespec pause_for = {0, 20 * 1000 * 1000};
    while (!atomic_load(&jumped) && atomic_load(&armed)) {
        pthread_kill(engine_thread, guard_signal);
        nanosleep(&pause_for, NULL);
    }
    for (;;) {
        pause();
    }
}

static int installed;

/* bmoe_rpcguard_install(set_abort_callback, omp_in_parallel or NULL, signal number) */
int bmoe_rpcguard_install(void *set_abort, void *omp_in_parallel, int sig) {
    if (installed) {
        return 0;
    }
    if (set_abort == NULL || sig <= 0) {
        return -1;
    }
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_guard_signal;
    sigemptyset(&sa.sa_mask);
    sa.sa_flags = SA_RESTART;
    if (sigaction(sig, &sa, NULL) != 0) {
        return -2;
    }
    guard_signal = sig;
    in_parallel = (in_parallel_fn)omp_in_parallel;
    ((set_abort_fn)set_abort)(on_abort);
    installed = 1;
    return 0;
}

/* llama_model_params and llama_context_params, passed by value: more than 16 bytes, so
 * the SysV x86-64 ABI passes them in memory, as it does an array of the same size and
 * alignment (Python checks both sizes against its ctypes structures). */
#define MODEL_PARAMS_WORDS 10
#define CONTEXT_PARAMS_WORDS 20
typedef struct { uint64_t w[MODEL_PARAMS_WORDS]; } model_params_t;
typedef struct { uint64_t w[CONTEXT_PARAMS_WORDS]; } context_params_t;
typedef void *(*load_fn)(const char *path, model_params_t params);
typedef void *(*init_fn)(void *model, context_params_t params);

int bmoe_rpcguard_params_words(int which) {
    return which == 0 ? MODEL_PARAMS_WORDS : CONTEXT_PARAMS_WORDS;
}

/* llama_model_load_from_file(path, *params) under the guard; *ended set if it ended. */
void *bmoe_rpcguard_load(void *load, const char *path, const model_params_t *params,
                         int *ended) {
    engine_thread = pthread_self();
    atomic_store(&jumped, 0);
    *ended = 0;
    if (sigsetjmp(jump_env, 1) != 0) {
        *ended = 1;
        return NULL;
    }
    atomic_store(&armed, 1);
    void *model = ((load_fn)load)(path, *params);
    atomic_store(&armed, 0);
    return model;
}

/* llama_init_from_model(model, *params) under the guard; *ended set if it ended. */
void *bmoe_rpcguard_init(void *init, void *model, const context_params_t *params,
                         int *ended) {
    engine_thread = pthread_self();
    atomic_store(&jumped, 0);
    *ended = 0;
    if (sigsetjmp(jump_env, 1) != 0) {
        *ended = 1;
        return NULL;
    }
    atomic_store(&armed, 1);
    void *ctx = ((init_fn)init)(model, *params);
    atomic_store(&armed, 0);
    return ctx;
}

/* llama_decode(ctx, batch) then llama_synchronize(ctx) under the guard: the decode's
 * return code, or GUARD_JUMPED. The synchronize is part of it because llama_decode
 * returns with the helpers' work still queued: the engine thread would otherwise wait for
 * it later, unguarded, in llama_get_logits. */
int32_t bmoe_rpcguard_decode(void *decode, void *sync, void *ctx, batch_t batch) {
    engine_thread = pthread_self();
    atomic_store(&jumped, 0);
    if (sigsetjmp(jump_env, 1) != 0) {
        return GUARD_JUMPED;
    }
    atomic_store(&armed, 1);
    int32_t rc = ((decode_fn)decode)(ctx, batch);
    ((sync_fn)sync)(ctx);
    atomic_store(&armed, 0);
    return rc;
}

/* The message of the first abort the guard caught ("" if none); reading it clears it. */
int bmoe_rpcguard_message(char *out, int size) {
    if (size <= 0) {
        return -1;
    }
    out[0] = '\0';
    if (atomic_load(&have_message)) {
        strncpy(out, last_message, (size_t)size - 1);
        out[size - 1] = '\0';
        atomic_store(&have_message, 0);
    }
    return 0;
}

int bmoe_rpcguard_jumped_code(void) {
    return GUARD_JUMPED;
}

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "rpcguard",
    "A guard around llama_decode for models split over RPC helpers (see rpcguard.c).",
    -1, NULL, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit_rpcguard(void) {
    return PyModule_Create(&module);
}
