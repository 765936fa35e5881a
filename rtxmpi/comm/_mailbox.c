/* The shared-memory mailbox all_reduce of rtxmpi/comm/shm.py, compiled: one synchronization per
 * call, no MPI call, a few hundred nanoseconds of work for a small message.
 *
 * Layout of the mailbox mapping (owned and described by shm.py): per local rank j, a region of
 * `region` bytes at j * region: a 128-byte flag line (int64 [0] the mailbox call number; for the
 * cross-memory all_reduce, [1] its arrival call, [2] this call's array address, [3] its done
 * call, [4]-[6] its shared region, [7] its bytes, type and op, [8] and [9] the bounce's
 * copy-in and fold round counters, [10] its CPU + 1 when it may bounce, else 0; [11]-[14] the
 * mailbox calls' element counts and fingerprint codes, [15] the cross-memory call's code), then two slots
 * of `slot_bytes` (call parity 0 and 1), then the bounce slot of `bounce_bytes` (two round
 * parities x local_size pieces of piece_bytes).
 *
 * all_reduce(x, op, spin_ns): number this call (1, 2, ...), copy x into this rank's slot of the
 * call's parity, store the flag with release order, and spin (acquire loads) until every local
 * rank's flag has reached the call or spin_ns have passed. Then reduce every rank's term in
 * local-rank order into x, so every rank computes bitwise the same result, the same as numpy's
 * left fold ufunc(ufunc(t0, t1), t2)... Returns 0 when done, else the call number: the peers have
 * not arrived yet, and the caller waits (deadline-aware, in Python) on arrived(call), then calls
 * finish(x, op, call). op: one of the `ops` given at construction (mpi4py's MPI.SUM, MPI.MAX,
 * MPI.MIN, MPI.PROD: compared by identity, then by ==), so no Python code maps it first.
 *
 * Each call also publishes, next to its flag, its element count and the caller's fingerprint code
 * (int64 [11] and [12] for even calls, [13] and [14] for odd ones: a rank one call ahead must
 * not overwrite what a peer still compares); when every rank has posted, the terms are reduced
 * only if every rank's pair is the same, else all_reduce returns -call on every rank and nothing
 * is reduced (box_keys(call) says what each rank posted).
 *
 * Slots alternate between calls, so a rank one call ahead never overwrites a slot a peer still
 * reads; it cannot get two calls ahead (its next call needs every peer's flag of this one, raised
 * only after that peer's own reduction of the previous call).
 *
 * fold_peers(x, lo, hi, peers, tmp, op, push): the piece loop of the cross-memory all_reduce
 * (shm.py, mode "cma") in one call, without the GIL: for each piece of elements [lo, hi) of x
 * (tmp's size at most), read that piece of every peer's array (process_vm_readv) into tmp and
 * fold it into x (x op peer, peers in the given order); with push, write the reduced piece into
 * every peer's array (process_vm_writev) while it is in cache. peers: ((pid, address), ...).
 * Returns None, or (errno, pid, what) for the first transfer that failed.
 *
 * Mailbox.cross(x, op, call, tmp, spin_ns, resume): that all_reduce on one node, whole: the
 * address exchange and arrival, the piece loop, and the closing barrier on the flag lines, in one
 * call (see Mailbox_cross).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <sched.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define CPU_RELAX() _mm_pause()
#elif defined(__aarch64__)
#define CPU_RELAX() __asm__ __volatile__("yield")
#else
#define CPU_RELAX() do { } while (0)
#endif

enum { OP_SUM = 0, OP_MAX = 1, OP_MIN = 2, OP_PROD = 3 };
enum { T_F32, T_F64, T_I8, T_U8, T_I16, T_U16, T_I32, T_U32, T_I64, T_U64 };

typedef struct {
    PyObject_HEAD
    Py_buffer map;          /* the mailbox mapping; released by close() */
    int open;
    char *base;
    Py_ssize_t region, slot_bytes;
    int local_size, local_rank;
    int64_t calls;          /* calls numbered so far */
    PyObject *ops[4];       /* sum, max, min, prod (mpi4py Op objects) */
    pid_t *peer_pids;       /* the other local ranks' pids, in local-rank order (for cross()) */
    uintptr_t *peer_addrs;  /* cross(): their arrays' addresses in the current call */
    struct PeerMap *maps;   /* cross(): peers' shared regions mapped here, MAPS_PER_PEER each */
    char **peer_ptrs;       /* cross(): their arrays in those mappings, in the current call */
    int64_t *seen_keys;     /* cross(): every local rank's key ([7]) when a call found them
                             * differ, then every local rank's fingerprint code ([15]) */
    uint64_t map_clock;     /* least-recently-used eviction of `maps` */
    int64_t direct_calls;   /* cross() calls that took the shared-region path */
    int64_t bounce_calls;   /* cross() calls that bounced */
    int64_t arrived_ns;     /* cross(): when the call in flight found every peer arrived */
    int64_t last_ns;        /* cross(): the last finished call, arrival to done (-1: none) */
    int algorithm;          /* cross(): the call in flight's: 0 system calls, 1 bounce, 2 direct */
    int last_algorithm;     /* cross(): the last finished call's */
    Py_ssize_t bounce_bytes;  /* cross(): this rank's bounce slot (0: no bounce) */
    Py_ssize_t piece_bytes;   /* cross(): one piece of the slot (bounce_bytes / (2 local_size)) */
    Py_ssize_t bounce_max;    /* cross(): largest array that may bounce */
    int bounce_any_cpu;       /* cross(): bounce even when two local ranks share a CPU */
    int64_t bounce_call;    /* cross(): the call in flight bounces (its number), else 0 */
    int64_t bounce_seq;     /* cross(): bounce rounds completed before the call in flight */
    Py_ssize_t bounce_t, bounce_rounds, bounce_step;  /* its next round, rounds, piece elements */
    int bounce_phase;       /* 0: round bounce_t's fold is next; 1: its copy-out */
    int wait_column;        /* the flag column and value the last unfinished spin waited for */
    int64_t wait_value;
    int64_t mismatch_call;  /* cross(): the call whose ranks' keys differ (its number), else 0 */
} Mailbox;

#define LINE 128  /* a local rank's flag line: two cache lines of int64 columns */

#define MAPS_PER_PEER 8

struct PeerMap {  /* one peer region mapped here */
    int64_t fd, ino;
    char *base;      /* NULL: free entry */
    size_t size;
    uint64_t used;   /* b->map_clock when last used */
};

static void unmap_peers(Mailbox *b);

static inline int64_t *flag_of(Mailbox *b, int j) {
    return (int64_t *)(b->base + (Py_ssize_t)j * b->region);
}

static inline char *slot_of(Mailbox *b, int j, int64_t call) {
    return b->base + (Py_ssize_t)j * b->region + LINE + (call & 1) * b->slot_bytes;
}

/* Local rank j's bounce piece for rank d's segment in bounce round g (its bounce slot, after
 * its two mailbox slots, holds two round parities of local_size pieces). */
static inline char *piece_of(Mailbox *b, int j, int64_t g, int d) {
    return b->base + (Py_ssize_t)j * b->region + LINE + 2 * b->slot_bytes
           + ((Py_ssize_t)(g & 1) * b->local_size + d) * b->piece_bytes;
}

/* Every other local rank's flag line has reached `call` in int64 `column` (0: mailbox posted,
 * 1: cross-memory arrival, 3: cross-memory done, 8 and 9: bounce rounds copied in, folded). */
static int all_reached(Mailbox *b, int column, int64_t call) {
    for (int j = 0; j < b->local_size; j++)
        if (j != b->local_rank
                && __atomic_load_n(flag_of(b, j) + column, __ATOMIC_ACQUIRE) < call)
            return 0;
    return 1;
}

/* The mailbox call's fingerprint columns: [11], [12] for even calls, [13], [14] for odd. */
static inline int box_column(int64_t call) { return 11 + 2 * (int)(call & 1); }

/* Every local rank posted the same element count and code for `call` (after all_reached). */
static int box_same(Mailbox *b, int64_t call) {
    int c = box_column(call);
    int64_t *mine = flag_of(b, b->local_rank);
    int64_t count = __atomic_load_n(mine + c, __ATOMIC_RELAXED);
    int64_t code = __atomic_load_n(mine + c + 1, __ATOMIC_RELAXED);
    for (int j = 0; j < b->local_size; j++) {
        int64_t *line = flag_of(b, j);
        if (__atomic_load_n(line + c, __ATOMIC_RELAXED) != count
                || __atomic_load_n(line + c + 1, __ATOMIC_RELAXED) != code)
            return 0;
    }
    return 1;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

/* all_reached, polled for up to spin_ns; when it was not, a cross() wait is recorded
 * (cross_ready).
 * After the first CALM_NS the poll gives the core away between checks (sched_yield, as Open MPI's
 * mpi_yield_when_idle does): a peer that shares this core, or waits for it behind another
 * process, runs at once instead of after the spin. Alone on the core, sched_yield returns at
 * once. With one busy process beside 2 ranks on 2 cores, an 8-byte all_reduce took 29-30 us
 * (raw MPI 6-7) with a pure spin and 9-10 us this way; idle, no change (bench/RESULTS.md). */
#define CALM_NS 500
static int spin_until(Mailbox *b, int column, int64_t call, int64_t spin_ns) {
    int done = all_reached(b, column, call);
    if (!done && spin_ns > 0) {
        int64_t start = now_ns(), end = start + spin_ns, calm = start + CALM_NS;
        unsigned polls = 0;
        int yielding = 0;
        while (!(done = all_reached(b, column, call))) {
            if (yielding) sched_yield(); else CPU_RELAX();
            if (yielding || (++polls & 63) == 0) {
                int64_t t = now_ns();
                if (t > end) break;
                yielding = t > calm;
            }
        }
    }
    if (!done && column != 0) {  /* a mailbox call's waiter polls arrived(); a cross() call in
                                  * flight keeps its wait for cross_ready() */
        b->wait_column = column;
        b->wait_value = call;
    }
    return done;
}

static int type_code(const char *fmt, Py_ssize_t itemsize) {
    if (fmt == NULL) return T_U8;
    if (*fmt == '@' || *fmt == '=' || *fmt == '<') fmt++;
    if (fmt[0] == '\0' || fmt[1] != '\0') return -1;
    switch (fmt[0]) {
    case 'f': return T_F32;
    case 'd': return T_F64;
    case 'b': return T_I8;
    case 'B': return T_U8;
    }
    int is_signed = fmt[0] == 'h' || fmt[0] == 'i' || fmt[0] == 'l' || fmt[0] == 'q';
    int is_unsigned = fmt[0] == 'H' || fmt[0] == 'I' || fmt[0] == 'L' || fmt[0] == 'Q';
    if (!is_signed && !is_unsigned) return -1;
    switch (itemsize) {
    case 2: return is_signed ? T_I16 : T_U16;
    case 4: return is_signed ? T_I32 : T_U32;
    case 8: return is_signed ? T_I64 : T_U64;
    }
    return -1;
}

/* out[i] = a[i] op b[i]; out may alias a or b. Integers add and multiply in the unsigned type U
 * (wrapping like numpy; signed overflow, and int promotion of 16-bit products, would be undefined
 * in C). max/min as numpy: NaN propagates (the first NaN), and on a tie (0.0 vs -0.0) b. */
#define FOLD(T, U, NAME)                                                                       \
    static void NAME(T *out, const T *a, const T *b, Py_ssize_t n, int op) {                 \
        Py_ssize_t i;                                                                          \
        switch (op) {                                                                          \
        case OP_SUM: for (i = 0; i < n; i++) out[i] = (T)((U)a[i] + (U)b[i]); break;          \
        case OP_PROD: for (i = 0; i < n; i++) out[i] = (T)((U)a[i] * (U)b[i]); break;         \
        case OP_MAX: for (i = 0; i < n; i++) out[i] = (a[i] > b[i] || a[i] != a[i]) ? a[i] : b[i]; break; \
        case OP_MIN: for (i = 0; i < n; i++) out[i] = (a[i] < b[i] || a[i] != a[i]) ? a[i] : b[i]; break; \
        }                                                                                      \
    }
FOLD(float, float, fold_f32)
FOLD(double, double, fold_f64)
FOLD(int8_t, unsigned, fold_i8)
FOLD(uint8_t, unsigned, fold_u8)
FOLD(int16_t, unsigned, fold_i16)
FOLD(uint16_t, unsigned, fold_u16)
FOLD(int32_t, uint32_t, fold_i32)
FOLD(uint32_t, uint32_t, fold_u32)
FOLD(int64_t, uint64_t, fold_i64)
FOLD(uint64_t, uint64_t, fold_u64)

static void fold(int type, void *out, const void *a, const void *b, Py_ssize_t n, int op) {
    switch (type) {
    case T_F32: fold_f32(out, a, b, n, op); break;
    case T_F64: fold_f64(out, a, b, n, op); break;
    case T_I8: fold_i8(out, a, b, n, op); break;
    case T_U8: fold_u8(out, a, b, n, op); break;
    case T_I16: fold_i16(out, a, b, n, op); break;
    case T_U16: fold_u16(out, a, b, n, op); break;
    case T_I32: fold_i32(out, a, b, n, op); break;
    case T_U32: fold_u32(out, a, b, n, op); break;
    case T_I64: fold_i64(out, a, b, n, op); break;
    case T_U64: fold_u64(out, a, b, n, op); break;
    }
}

/* x = t0 op t1 op ... in local-rank order, t_j the slot of rank j (x for t_me when me < 2). */
static void reduce_into(Mailbox *b, char *x, Py_ssize_t nbytes, Py_ssize_t n, int type, int op,
                        int64_t call) {
    int me = b->local_rank;
    const char *t0 = me == 0 ? x : slot_of(b, 0, call);
    const char *t1 = me == 1 ? x : slot_of(b, 1, call);
    (void)nbytes;
    fold(type, x, t0, t1, n, op);
    for (int j = 2; j < b->local_size; j++)  /* x no longer holds t_me here: read its slot */
        fold(type, x, x, slot_of(b, j, call), n, op);
}

typedef struct {
    Py_buffer view;
    int type;
    Py_ssize_t count;
} Arg;

/* The op code of `op` (one of b->ops), or -1 with ValueError set. */
static int op_of(Mailbox *b, PyObject *op) {
    for (int i = 0; i < 4; i++)
        if (op == b->ops[i]) return i;
    for (int i = 0; i < 4; i++) {
        int eq = PyObject_RichCompareBool(op, b->ops[i], Py_EQ);
        if (eq < 0) return -1;
        if (eq) return i;
    }
    PyErr_SetString(PyExc_ValueError, "mailbox: the op is none of sum, max, min, prod");
    return -1;
}

/* x as a writable C-contiguous numeric buffer of at most max_bytes, for op (-1: an error is
 * set already); 0, or -1 with an exception set. */
static int get_arg(Mailbox *b, PyObject *x, int op, Arg *a, Py_ssize_t max_bytes) {
    if (!b->open) {
        PyErr_SetString(PyExc_ValueError, "mailbox is closed");
        return -1;
    }
    if (op < 0) return -1;
    if (PyObject_GetBuffer(x, &a->view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    a->type = type_code(a->view.format, a->view.itemsize);
    if (a->type < 0 || a->view.len > max_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "mailbox: array of format '%s' and %zd bytes does not fit (largest %zd bytes, "
                     "numeric dtypes only)", a->view.format ? a->view.format : "B", a->view.len,
                     max_bytes);
        PyBuffer_Release(&a->view);
        return -1;
    }
    a->count = a->view.itemsize ? a->view.len / a->view.itemsize : 0;
    return 0;
}

static PyObject *Mailbox_all_reduce(Mailbox *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs < 3 || nargs > 5) {
        PyErr_SetString(PyExc_TypeError, "all_reduce(x, op, spin_ns, code=0, count=len(x))");
        return NULL;
    }
    int64_t spin_ns = PyLong_AsLongLong(args[2]);
    if (spin_ns == -1 && PyErr_Occurred()) return NULL;
    int64_t code = nargs >= 4 ? PyLong_AsLongLong(args[3]) : 0;
    if (code == -1 && PyErr_Occurred()) return NULL;
    int64_t count = nargs == 5 ? PyLong_AsLongLong(args[4]) : 0;
    if (count == -1 && PyErr_Occurred()) return NULL;
    int op = op_of(b, args[1]);
    Arg a;
    if (get_arg(b, args[0], op, &a, b->slot_bytes) < 0) return NULL;
    int64_t call = ++b->calls, *mine = flag_of(b, b->local_rank);
    int c = box_column(call);
    memcpy(slot_of(b, b->local_rank, call), a.view.buf, a.view.len);
    __atomic_store_n(mine + c, nargs == 5 ? count : (int64_t)a.count, __ATOMIC_RELAXED);
    __atomic_store_n(mine + c + 1, code, __ATOMIC_RELAXED);
    __atomic_store_n(mine, call, __ATOMIC_RELEASE);
    int done = spin_until(b, 0, call, spin_ns), same = done && box_same(b, call);
    if (same) reduce_into(b, a.view.buf, a.view.len, a.count, a.type, op, call);
    PyBuffer_Release(&a.view);
    return PyLong_FromLongLong(!done ? call : same ? 0 : -call);
}

static PyObject *Mailbox_arrived(Mailbox *b, PyObject *arg) {
    int64_t call = PyLong_AsLongLong(arg);
    if (call == -1 && PyErr_Occurred()) return NULL;
    if (!b->open) {
        PyErr_SetString(PyExc_ValueError, "mailbox is closed");
        return NULL;
    }
    return PyBool_FromLong(all_reached(b, 0, call));
}

static PyObject *Mailbox_finish(Mailbox *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "finish(x, op, call)");
        return NULL;
    }
    int64_t call = PyLong_AsLongLong(args[2]);
    if (call == -1 && PyErr_Occurred()) return NULL;
    int op = op_of(b, args[1]);
    Arg a;
    if (get_arg(b, args[0], op, &a, b->slot_bytes) < 0) return NULL;
    if (!all_reached(b, 0, call)) {
        PyBuffer_Release(&a.view);
        PyErr_Format(PyExc_RuntimeError, "mailbox: finish(call %lld) before every peer arrived",
                     (long long)call);
        return NULL;
    }
    int same = box_same(b, call);
    if (same) reduce_into(b, a.view.buf, a.view.len, a.count, a.type, op, call);
    PyBuffer_Release(&a.view);
    return PyBool_FromLong(same);
}

static PyObject *Mailbox_calls(Mailbox *b, PyObject *unused) {
    (void)unused;
    return PyLong_FromLongLong(b->calls);
}

static PyObject *Mailbox_box_keys(Mailbox *b, PyObject *arg) {
    int64_t call = PyLong_AsLongLong(arg);
    if (call == -1 && PyErr_Occurred()) return NULL;
    if (!b->open) {
        PyErr_SetString(PyExc_ValueError, "mailbox is closed");
        return NULL;
    }
    int c = box_column(call);
    PyObject *out = PyTuple_New(b->local_size);
    for (int j = 0; out != NULL && j < b->local_size; j++) {
        int64_t *line = flag_of(b, j);
        PyObject *item = Py_BuildValue("(LL)", (long long)__atomic_load_n(line + c, __ATOMIC_RELAXED),
                                       (long long)__atomic_load_n(line + c + 1, __ATOMIC_RELAXED));
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, j, item);
    }
    return out;
}

static PyObject *Mailbox_close(Mailbox *b, PyObject *unused) {
    (void)unused;
    if (b->open) {
        b->open = 0;
        PyBuffer_Release(&b->map);
    }
    unmap_peers(b);  /* the peers' regions it mapped: their memory is freed with them */
    Py_RETURN_NONE;
}

static PyObject *Mailbox_direct_calls(Mailbox *b, PyObject *unused) {
    (void)unused;
    return PyLong_FromLongLong(b->direct_calls);
}

/* *out = the pids of `pids` (local_size ints) but local_rank's, and *addrs room for as many
 * addresses, both PyMem-allocated; 0 or -1. */
static PyObject *Mailbox_bounce_calls(Mailbox *b, PyObject *unused) {
    (void)unused;
    return PyLong_FromLongLong(b->bounce_calls);
}

static PyObject *Mailbox_last_call(Mailbox *b, PyObject *unused) {
    (void)unused;
    if (b->last_ns < 0) Py_RETURN_NONE;
    return Py_BuildValue("(iL)", b->last_algorithm, (long long)b->last_ns);
}

static int set_peer_pids(pid_t **out, uintptr_t **addrs, PyObject *pids, int local_size,
                         int local_rank) {
    PyObject *seq = PySequence_Fast(pids, "mailbox: pids must be a sequence");
    if (seq == NULL) return -1;
    if (PySequence_Fast_GET_SIZE(seq) != local_size) {
        Py_DECREF(seq);
        PyErr_Format(PyExc_ValueError, "mailbox: %d pids expected (one per local rank)",
                     local_size);
        return -1;
    }
    pid_t *p = PyMem_Calloc(local_size, sizeof(pid_t));
    *addrs = PyMem_Calloc(local_size, sizeof(uintptr_t));
    if (p == NULL || *addrs == NULL) {
        Py_DECREF(seq);
        PyMem_Free(p);
        PyMem_Free(*addrs);
        PyErr_NoMemory();
        return -1;
    }
    for (int j = 0, k = 0; j < local_size; j++) {
        long pid = PyLong_AsLong(PySequence_Fast_GET_ITEM(seq, j));
        if (pid == -1 && PyErr_Occurred()) {
            Py_DECREF(seq);
            PyMem_Free(p);
            PyMem_Free(*addrs);
            return -1;
        }
        if (j != local_rank) p[k++] = (pid_t)pid;
    }
    Py_DECREF(seq);
    *out = p;
    return 0;
}

static int Mailbox_init(Mailbox *b, PyObject *args, PyObject *kwds) {
    static char *names[] = {"mapping", "local_size", "local_rank", "slot_bytes", "ops", "pids",
                            "bounce_bytes", "bounce_max", "bounce_any_cpu", NULL};
    PyObject *mapping, *pids = Py_None;
    int local_size, local_rank, bounce_any_cpu = 0;
    Py_ssize_t slot_bytes, bounce_bytes = 0, bounce_max = PY_SSIZE_T_MAX;
    PyObject *ops[4];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oiin(OOOO)|On$np", names, &mapping, &local_size,
                                     &local_rank, &slot_bytes, &ops[0], &ops[1], &ops[2], &ops[3],
                                     &pids, &bounce_bytes, &bounce_max, &bounce_any_cpu))
        return -1;
    if (b->open) {
        PyErr_SetString(PyExc_ValueError, "mailbox already initialized");
        return -1;
    }
    if (local_size < 2 || local_rank < 0 || local_rank >= local_size || slot_bytes < 0
            || slot_bytes % 8 || bounce_bytes < 0 || bounce_bytes % 8
            || slot_bytes > (PY_SSIZE_T_MAX / local_size - LINE) / 4
            || bounce_bytes > (PY_SSIZE_T_MAX / local_size - LINE) / 2) {
        PyErr_SetString(PyExc_ValueError, "mailbox: bad layout (local_size >= 2, 0 <= local_rank "
                                          "< local_size, slot_bytes and bounce_bytes non-negative "
                                          "multiples of 8, the mailbox's size a Py_ssize_t)");
        return -1;
    }
    pid_t *peer_pids = NULL;
    uintptr_t *peer_addrs = NULL;
    if (pids != Py_None
            && set_peer_pids(&peer_pids, &peer_addrs, pids, local_size, local_rank) < 0)
        return -1;
    if (PyObject_GetBuffer(mapping, &b->map, PyBUF_WRITABLE) < 0) {
        PyMem_Free(peer_pids);
        PyMem_Free(peer_addrs);
        return -1;
    }
    Py_ssize_t region = LINE + 2 * slot_bytes + bounce_bytes;
    if (b->map.len < region * local_size || ((uintptr_t)b->map.buf) % 64) {
        PyBuffer_Release(&b->map);
        PyErr_Format(PyExc_ValueError, "mailbox: mapping of %zd bytes is smaller than %d x %zd "
                     "or not 64-byte aligned", b->map.len, local_size, region);
        PyMem_Free(peer_pids);
        PyMem_Free(peer_addrs);
        return -1;
    }
    PyMem_Free(b->peer_pids);  /* __init__ again after close() */
    PyMem_Free(b->peer_addrs);
    PyMem_Free(b->peer_ptrs);
    PyMem_Free(b->seen_keys);
    unmap_peers(b);
    b->peer_pids = peer_pids;
    b->peer_addrs = peer_addrs;
    b->peer_ptrs = NULL;
    b->seen_keys = NULL;
    if (peer_pids) {
        b->peer_ptrs = PyMem_Calloc(local_size, sizeof(char *));
        b->seen_keys = PyMem_Calloc(2 * (size_t)local_size, sizeof(int64_t));
        b->maps = PyMem_Calloc((size_t)local_size * MAPS_PER_PEER, sizeof(struct PeerMap));
        if (b->peer_ptrs == NULL || b->seen_keys == NULL || b->maps == NULL) {
            PyBuffer_Release(&b->map);
            PyMem_Free(b->maps);  /* nothing mapped in it yet; b->local_size is still the old */
            PyMem_Free(b->peer_ptrs);
            PyMem_Free(b->seen_keys);
            b->maps = NULL;
            b->peer_ptrs = NULL;
            b->seen_keys = NULL;
            PyErr_NoMemory();
            return -1;
        }
    }
    b->open = 1;
    b->calls = b->direct_calls = b->bounce_calls = 0;
    for (int i = 0; i < 4; i++) {  /* __init__ again after close(): drop the previous ops */
        Py_INCREF(ops[i]);
        Py_XSETREF(b->ops[i], ops[i]);
    }
    b->base = b->map.buf;
    b->region = region;
    b->slot_bytes = slot_bytes;
    b->bounce_bytes = bounce_bytes;
    /* whole cache-line pairs, so no two ranks' pieces share a line; too small a slot: no bounce */
    b->piece_bytes = bounce_bytes / (2 * (Py_ssize_t)local_size) / LINE * LINE;
    b->bounce_max = b->piece_bytes ? bounce_max : 0;
    b->bounce_any_cpu = bounce_any_cpu;
    b->bounce_call = b->bounce_seq = 0;
    b->wait_column = -1;
    b->wait_value = 0;
    b->last_ns = -1;
    b->algorithm = b->last_algorithm = 0;
    b->mismatch_call = 0;
    b->local_size = local_size;
    b->local_rank = local_rank;
    return 0;
}

static void Mailbox_dealloc(Mailbox *b) {
    if (b->open) PyBuffer_Release(&b->map);
    for (int i = 0; i < 4; i++) Py_XDECREF(b->ops[i]);
    PyMem_Free(b->peer_pids);
    PyMem_Free(b->peer_addrs);
    PyMem_Free(b->peer_ptrs);
    PyMem_Free(b->seen_keys);
    unmap_peers(b);
    Py_TYPE(b)->tp_free((PyObject *)b);
}

/* Move nbytes between here and process pid (read: from remote to local); 0 or errno. */
static int move(pid_t pid, int read, char *local, uintptr_t remote, Py_ssize_t nbytes) {
    while (nbytes > 0) {
        struct iovec l = {local, (size_t)nbytes}, r = {(void *)remote, (size_t)nbytes};
        ssize_t got = read ? process_vm_readv(pid, &l, 1, &r, 1, 0)
                           : process_vm_writev(pid, &l, 1, &r, 1, 0);
        if (got < 0) return errno ? errno : EIO;
        if (got == 0) return EIO;  /* nothing moved and no error: not a live mapping */
        local += got;
        remote += (uintptr_t)got;
        nbytes -= got;
    }
    return 0;
}

#define MAX_PEERS 1024

typedef struct {
    int err, read;  /* errno (0: none); the failed transfer was a read */
    pid_t pid;
} Failure;

/* The cross-memory piece loop (see the header): elements [lo, hi) of base, pieces of `step`
 * elements through scratch. Runs without the GIL. */
static Failure fold_loop(char *base, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t itemsize, int type,
                         int op, const pid_t *pids, const uintptr_t *addrs, Py_ssize_t npeers,
                         char *scratch, Py_ssize_t step, int push) {
    Failure f = {0, 0, 0};
    for (Py_ssize_t start = lo; start < hi; start += step) {
        Py_ssize_t stop = start + step < hi ? start + step : hi;
        Py_ssize_t off = start * itemsize, nbytes = (stop - start) * itemsize;
        for (Py_ssize_t j = 0; j < npeers; j++) {
            if ((f.err = move(pids[j], 1, scratch, addrs[j] + (uintptr_t)off, nbytes))) {
                f.pid = pids[j];
                f.read = 1;
                return f;
            }
            fold(type, base + off, base + off, scratch, stop - start, op);
        }
        for (Py_ssize_t j = 0; push && j < npeers; j++)
            if ((f.err = move(pids[j], 0, base + off, addrs[j] + (uintptr_t)off, nbytes))) {
                f.pid = pids[j];
                return f;
            }
    }
    return f;
}

/* None, or the (errno, pid, what) tuple of a failed transfer. */
static PyObject *failure_value(Failure f) {
    if (f.err)
        return Py_BuildValue("(ils)", f.err, (long)f.pid,
                             f.read ? "process_vm_readv from" : "process_vm_writev to");
    Py_RETURN_NONE;
}

static PyObject *fold_peers(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    if (nargs != 7) {
        PyErr_SetString(PyExc_TypeError, "fold_peers(x, lo, hi, peers, tmp, op, push)");
        return NULL;
    }
    Py_ssize_t lo = PyLong_AsSsize_t(args[1]), hi = PyLong_AsSsize_t(args[2]);
    int op = (int)PyLong_AsLong(args[5]);
    int push = PyObject_IsTrue(args[6]);
    if (PyErr_Occurred() || push < 0) return NULL;
    if (op < OP_SUM || op > OP_PROD) {
        PyErr_Format(PyExc_ValueError, "fold_peers: op code %d is none of 0-3", op);
        return NULL;
    }
    PyObject *seq = PySequence_Fast(args[3], "fold_peers: peers must be a sequence");
    if (seq == NULL) return NULL;
    Py_ssize_t npeers = PySequence_Fast_GET_SIZE(seq);
    pid_t pids[MAX_PEERS];
    uintptr_t addrs[MAX_PEERS];
    if (npeers > MAX_PEERS) {
        Py_DECREF(seq);
        PyErr_SetString(PyExc_ValueError, "fold_peers: more than 1024 peers");
        return NULL;
    }
    for (Py_ssize_t j = 0; j < npeers; j++) {
        long pid;
        unsigned long long addr;
        if (!PyArg_ParseTuple(PySequence_Fast_GET_ITEM(seq, j), "lK", &pid, &addr)) {
            Py_DECREF(seq);
            return NULL;
        }
        pids[j] = (pid_t)pid;
        addrs[j] = (uintptr_t)addr;
    }
    Py_DECREF(seq);
    Py_buffer x, tmp;
    if (PyObject_GetBuffer(args[0], &x, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return NULL;
    if (PyObject_GetBuffer(args[4], &tmp, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&x);
        return NULL;
    }
    int type = type_code(x.format, x.itemsize);
    Py_ssize_t itemsize = x.itemsize, count = itemsize ? x.len / itemsize : 0;
    Py_ssize_t step = itemsize ? tmp.len / itemsize : 0;
    if (type < 0 || lo < 0 || hi > count || lo > hi || step < 1) {
        PyErr_Format(PyExc_ValueError, "fold_peers: bad arguments (format '%s', range [%zd, %zd) "
                     "of %zd elements, scratch of %zd bytes)", x.format ? x.format : "B", lo, hi,
                     count, tmp.len);  /* before the release: x.format belongs to the exporter */
        PyBuffer_Release(&x);
        PyBuffer_Release(&tmp);
        return NULL;
    }
    Failure f;
    Py_BEGIN_ALLOW_THREADS
    f = fold_loop(x.buf, lo, hi, itemsize, type, op, pids, addrs, npeers, tmp.buf, step, push);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    PyBuffer_Release(&tmp);
    return failure_value(f);
}

/* -- shared regions (shm.shared_zeros): arrays whose memory local peers can map ----------------
 * Each is a whole memfd mapping of this process, registered here by its start address with the
 * memfd's descriptor number and inode. cross() looks its array up: when every local rank's array
 * lies in such a region, each rank maps its peers' regions (/proc/PID/fd/FD, checked by inode,
 * cached) and folds straight from their memory, and writes the result straight into it: no
 * system call and no scratch copy per piece. Touched only with the GIL held. */
typedef struct {
    uintptr_t start;
    Py_ssize_t size;
    int64_t fd, ino;
} Region;

static Region *regions;
static Py_ssize_t nregions, cap_regions;

/* The index of the last region starting at or below addr, or -1. */
static Py_ssize_t region_below(uintptr_t addr) {
    Py_ssize_t lo = 0, hi = nregions;
    while (lo < hi) {
        Py_ssize_t mid = (lo + hi) / 2;
        if (regions[mid].start <= addr) lo = mid + 1; else hi = mid;
    }
    return lo - 1;
}

/* The region holding [addr, addr + len), or NULL. */
static const Region *region_of(uintptr_t addr, Py_ssize_t len) {
    Py_ssize_t i = region_below(addr);
    if (i < 0 || addr + (uintptr_t)len > regions[i].start + (uintptr_t)regions[i].size)
        return NULL;
    return &regions[i];
}

static PyObject *register_region(PyObject *module, PyObject *const *args, Py_ssize_t nargs) {
    (void)module;
    unsigned long long start;
    Py_ssize_t size;
    long long fd, ino;
    if (nargs != 4) {
        PyErr_SetString(PyExc_TypeError, "register_region(start, size, fd, inode)");
        return NULL;
    }
    start = PyLong_AsUnsignedLongLong(args[0]);
    size = PyLong_AsSsize_t(args[1]);
    fd = PyLong_AsLongLong(args[2]);
    ino = PyLong_AsLongLong(args[3]);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t i = region_below((uintptr_t)start);
    if (size <= 0 || fd < 0
            || (i >= 0 && regions[i].start + (uintptr_t)regions[i].size > (uintptr_t)start)
            || (i + 1 < nregions && (uintptr_t)start + (uintptr_t)size > regions[i + 1].start)) {
        PyErr_SetString(PyExc_ValueError, "register_region: empty, or overlapping a registered "
                                          "region");
        return NULL;
    }
    if (nregions == cap_regions) {
        Py_ssize_t cap = cap_regions ? 2 * cap_regions : 16;
        Region *grown = PyMem_Realloc(regions, cap * sizeof(Region));
        if (grown == NULL) return PyErr_NoMemory();
        regions = grown;
        cap_regions = cap;
    }
    memmove(regions + i + 2, regions + i + 1, (nregions - i - 1) * sizeof(Region));
    regions[i + 1] = (Region){(uintptr_t)start, size, fd, ino};
    nregions++;
    Py_RETURN_NONE;
}

static PyObject *unregister_region(PyObject *module, PyObject *arg) {
    (void)module;
    unsigned long long start = PyLong_AsUnsignedLongLong(arg);
    if (PyErr_Occurred()) return NULL;
    Py_ssize_t i = region_below((uintptr_t)start);
    if (i < 0 || regions[i].start != (uintptr_t)start) {
        PyErr_SetString(PyExc_KeyError, "unregister_region: no region starts there");
        return NULL;
    }
    memmove(regions + i, regions + i + 1, (nregions - i - 1) * sizeof(Region));
    nregions--;
    Py_RETURN_NONE;
}

static PyObject *regions_registered(PyObject *module, PyObject *unused) {
    (void)module;
    (void)unused;
    return PyLong_FromSsize_t(nregions);
}

static void unmap_peers(Mailbox *b) {
    if (b->maps == NULL) return;
    for (Py_ssize_t i = 0; i < (Py_ssize_t)(b->local_size - 1) * MAPS_PER_PEER; i++)
        if (b->maps[i].base) munmap(b->maps[i].base, b->maps[i].size);
    PyMem_Free(b->maps);
    b->maps = NULL;
}

/* Peer k's region (fd, ino) of process pid mapped here, at least `need` bytes: from the cache,
 * or opened through /proc/PID/fd/FD (its inode must match: the descriptor is the peer's live
 * memfd) and mapped, evicting the least recently used entry. NULL with errno on failure. */
static char *map_peer(Mailbox *b, int k, pid_t pid, int64_t fd, int64_t ino, size_t need) {
    struct PeerMap *maps = b->maps + (Py_ssize_t)k * MAPS_PER_PEER, *victim = maps;
    b->map_clock++;
    for (int i = 0; i < MAPS_PER_PEER; i++) {
        if (maps[i].base && maps[i].fd == fd && maps[i].ino == ino && maps[i].size >= need) {
            maps[i].used = b->map_clock;
            return maps[i].base;
        }
        if (maps[i].used < victim->used) victim = &maps[i];
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/%ld/fd/%lld", (long)pid, (long long)fd);
    int f = open(path, O_RDWR | O_CLOEXEC);
    if (f < 0) return NULL;
    struct stat st;
    int err = 0;
    if (fstat(f, &st) < 0)
        err = errno;
    else if ((int64_t)st.st_ino != ino)
        err = ESTALE;  /* the descriptor names another file now */
    else if ((size_t)st.st_size < need)
        err = EINVAL;
    if (err) {
        close(f);
        errno = err;
        return NULL;
    }
    char *base = mmap(NULL, (size_t)st.st_size, PROT_READ | PROT_WRITE, MAP_SHARED, f, 0);
    close(f);
    if (base == MAP_FAILED) return NULL;
    if (victim->base) munmap(victim->base, victim->size);
    *victim = (struct PeerMap){fd, ino, base, (size_t)st.st_size, b->map_clock};
    return base;
}

/* fold_loop on shared regions: each piece of [lo, hi) folded straight from the peers' arrays
 * (peers[j], mapped here) into base, own value first, then the peers in order (the same order
 * as fold_loop, so the same bits), then written into every peer's array while in cache. */
static void fold_direct(char *base, Py_ssize_t lo, Py_ssize_t hi, Py_ssize_t itemsize, int type,
                        int op, char *const *peers, Py_ssize_t npeers, Py_ssize_t step) {
    for (Py_ssize_t start = lo; start < hi; start += step) {
        Py_ssize_t stop = start + step < hi ? start + step : hi;
        Py_ssize_t off = start * itemsize, nbytes = (stop - start) * itemsize;
        for (Py_ssize_t j = 0; j < npeers; j++)
            fold(type, base + off, base + off, peers[j] + off, stop - start, op);
        for (Py_ssize_t j = 0; j < npeers; j++)
            memcpy(peers[j] + off, base + off, (size_t)nbytes);
    }
}

/* Flag line int64 [7] of a cross-memory call: its array's bytes, type and op, which every local
 * rank must share; arrays of different sizes would send a transfer past the end of one. */
#define CALL_KEY(len, type, op) (((int64_t)(len) << 6) | ((int64_t)(type) << 2) | (int64_t)(op))

/* Every local rank published the same key and fingerprint code ([15], the caller's: the dtype
 * and reduce op it was called with, which the buffer's may not show) (after every peer's
 * arrival flag was read). */
static int same_call(Mailbox *b) {
    int64_t *mine = flag_of(b, b->local_rank);
    int64_t key = __atomic_load_n(mine + 7, __ATOMIC_RELAXED);
    int64_t code = __atomic_load_n(mine + 15, __ATOMIC_RELAXED);
    for (int j = 0; j < b->local_size; j++)
        if (__atomic_load_n(flag_of(b, j) + 7, __ATOMIC_RELAXED) != key
                || __atomic_load_n(flag_of(b, j) + 15, __ATOMIC_RELAXED) != code) return 0;
    return 1;
}

/* Elements [lo, hi) of rank j's segment of count elements over n ranks: floor(count * j / n). */
static void segment(Py_ssize_t count, int n, int j, Py_ssize_t *lo, Py_ssize_t *hi) {
    Py_ssize_t q = count / n, r = count % n;
    *lo = q * j + r * j / n;
    *hi = q * (j + 1) + r * (j + 1) / n;
}

/* Elements [*lo, *lo + *len) of x: piece t (of b->bounce_step elements) of rank d's segment. */
static void piece_range(Mailbox *b, Py_ssize_t count, int d, Py_ssize_t t, Py_ssize_t *lo,
                        Py_ssize_t *len) {
    Py_ssize_t hi;
    segment(count, b->local_size, d, lo, &hi);
    *lo += t * b->bounce_step;
    *len = hi - *lo < b->bounce_step ? hi - *lo : b->bounce_step;
    if (*len < 0) *len = 0;
}

/* The bounce's copy-in of round t (counter g): piece t of every other rank's segment of x into
 * this rank's slot. Without the GIL. */
static void bounce_in(Mailbox *b, const char *x, Py_ssize_t count, Py_ssize_t itemsize,
                      Py_ssize_t t, int64_t g) {
    for (int d = 0; d < b->local_size; d++) {
        Py_ssize_t lo, len;
        piece_range(b, count, d, t, &lo, &len);
        if (d != b->local_rank)
            memcpy(piece_of(b, b->local_rank, g, d), x + lo * itemsize, len * itemsize);
    }
}

/* The bounce's fold of round t: piece t of this rank's segment, own value first, then every
 * peer's copy in rank order (the order of fold_loop and fold_direct: the same bits), copied into
 * this rank's slot while in cache. Without the GIL. */
static void bounce_fold(Mailbox *b, char *x, Py_ssize_t count, Py_ssize_t itemsize, int type,
                        int op, Py_ssize_t t, int64_t g) {
    int me = b->local_rank;
    Py_ssize_t lo, len;
    piece_range(b, count, me, t, &lo, &len);
    char *own = x + lo * itemsize;
    for (int j = 0; j < b->local_size; j++)
        if (j != me) fold(type, own, own, piece_of(b, j, g, me), len, op);
    memcpy(piece_of(b, me, g, me), own, (size_t)(len * itemsize));
}

/* The bounce's copy-out of round t: every other rank's reduced piece t from its slot into x. */
static void bounce_out(Mailbox *b, char *x, Py_ssize_t count, Py_ssize_t itemsize, Py_ssize_t t,
                       int64_t g) {
    for (int d = 0; d < b->local_size; d++) {
        Py_ssize_t lo, len;
        piece_range(b, count, d, t, &lo, &len);
        if (d != b->local_rank) memcpy(x + lo * itemsize, piece_of(b, d, g, d), len * itemsize);
    }
}

/* Whether this call bounces (after the arrival and the key check, the same answer on every
 * rank): every rank published [10] (it may bounce: a stage-0 `bounce` argument, an array of
 * bounce_max at most, a slot) and, unless bounce_any_cpu, on a CPU no other local rank was on
 * at its arrival. The bounce's rounds need every rank running at once: ranks that share a CPU
 * hand it over at every round, where the system calls let each rank fold its segment alone. */
static int bounces(Mailbox *b) {
    int n = b->local_size;
    for (int j = 0; j < n; j++) {
        int64_t cpu = __atomic_load_n(flag_of(b, j) + 10, __ATOMIC_RELAXED);
        if (cpu <= 0) return 0;
        for (int k = 0; k < j && !b->bounce_any_cpu; k++)
            if (__atomic_load_n(flag_of(b, k) + 10, __ATOMIC_RELAXED) == cpu) return 0;
    }
    return 1;
}

/* Start the bounce of x (this call's rounds, the copy-in of round 0). */
static void bounce_start(Mailbox *b, int64_t call, const char *x, Py_ssize_t count,
                         Py_ssize_t itemsize) {
    Py_ssize_t longest = (count + b->local_size - 1) / b->local_size;
    b->bounce_call = call;
    b->bounce_calls++;
    b->bounce_step = b->piece_bytes / itemsize;
    b->bounce_rounds = (longest + b->bounce_step - 1) / b->bounce_step;
    b->bounce_t = 0;
    b->bounce_phase = 0;
    Py_BEGIN_ALLOW_THREADS
    bounce_in(b, x, count, itemsize, 0, b->bounce_seq + 1);
    Py_END_ALLOW_THREADS
    __atomic_store_n(flag_of(b, b->local_rank) + 8, b->bounce_seq + 1, __ATOMIC_RELEASE);
}

/* Run the bounce's rounds from where it stopped: round t (counter g = bounce_seq + 1 + t) folds
 * once every peer copied it in ([8] >= g), raises [9] to g, copies round t + 1 in (raising [8])
 * and copies round t out once every peer folded it ([9] >= g). With two round parities no rank
 * writes a piece a peer may still read: both writes of round t's parity (the copy-in of round
 * t + 1 into the others' pieces, the fold of round t into its own) come after the wait for every
 * peer's [8] >= g, which each raised after folding round t - 1 (the last read of the others'
 * pieces of that parity) and after copying round t - 2 out (the last read of its own). Returns 1
 * when every round is done, 0 when a flag was not reached within spin_ns (recorded for
 * cross_ready; call again). */
static int bounce_run(Mailbox *b, char *x, Py_ssize_t count, Py_ssize_t itemsize, int type,
                      int op, int64_t spin_ns) {
    int64_t *mine = flag_of(b, b->local_rank);
    while (b->bounce_t < b->bounce_rounds) {
        Py_ssize_t t = b->bounce_t;
        int64_t g = b->bounce_seq + 1 + t;
        if (b->bounce_phase == 0) {
            if (!spin_until(b, 8, g, spin_ns)) return 0;
            Py_BEGIN_ALLOW_THREADS
            bounce_fold(b, x, count, itemsize, type, op, t, g);
            __atomic_store_n(mine + 9, g, __ATOMIC_RELEASE);
            if (t + 1 < b->bounce_rounds) {
                bounce_in(b, x, count, itemsize, t + 1, g + 1);
                __atomic_store_n(mine + 8, g + 1, __ATOMIC_RELEASE);
            }
            Py_END_ALLOW_THREADS
            b->bounce_phase = 1;
        }
        if (!spin_until(b, 9, g, spin_ns)) return 0;
        Py_BEGIN_ALLOW_THREADS
        bounce_out(b, x, count, itemsize, t, g);
        Py_END_ALLOW_THREADS
        b->bounce_phase = 0;
        b->bounce_t++;
    }
    b->bounce_seq += b->bounce_rounds;
    b->bounce_call = 0;
    return 1;
}

/* cross(x, op, call, tmp, spin_ns, stage, bounce): the whole cross-memory all_reduce of shm.py
 * (one node, every local rank's pid given at construction) in one call. Stage 0: publish x's
 * address, shared region, key and (bounce true, x of bounce_max at most) its CPU in the flag
 * line and raise [1] to `call`; then spin up to spin_ns until every peer has. After the arrival,
 * this rank's segment [count * r / n, count * (r + 1) / n) of x is reduced by one of three
 * algorithms, the same on every rank:
 * - every rank's x in a registered shared region: folded straight from the peers' mappings,
 *   written back into them ("direct");
 * - else, when bounces() ("bounce": user-space copies through shared slots, pipelined in
 *   rounds of one piece per segment; bounce_run);
 * - else each piece read from every peer into tmp (process_vm_readv), folded into x, written
 *   back into every peer's x (process_vm_writev).
 * Then [3] is raised to `call`, and (but after a bounce, whose last round every peer folded:
 * no peer reads or writes this rank's memory for this call any more) the call spins up to
 * spin_ns until every peer has (no rank returns while a peer still reads or writes its array).
 * Returns 0 (done); 1: a peer has not arrived (wait on cross_ready(), call again with stage 1);
 * 4: bouncing, a peer's round is not ready (cross_ready(), stage 2); 2: this rank's segment is
 * done, a peer's is not (cross_ready(), stage 3); 3: the ranks' arrays differ in bytes, dtype or
 * op (nothing moved, on every rank; keys() says how; returned once every rank raised [3] for
 * it, 2 until then); or the (errno, pid, what) tuple of a failed transfer. */
static PyObject *Mailbox_cross(Mailbox *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 7 && nargs != 8) {
        PyErr_SetString(PyExc_TypeError, "cross(x, op, call, tmp, spin_ns, stage, bounce, code=0)");
        return NULL;
    }
    int64_t code = nargs == 8 ? PyLong_AsLongLong(args[7]) : 0;
    int64_t call = PyLong_AsLongLong(args[2]), spin_ns = PyLong_AsLongLong(args[4]);
    long stage = PyLong_AsLong(args[5]);
    int may_bounce = PyObject_IsTrue(args[6]);
    if (may_bounce < 0) return NULL;
    if (PyErr_Occurred()) return NULL;
    if (stage < 0 || stage > 3) {
        PyErr_Format(PyExc_ValueError, "mailbox: cross() stage %ld is none of 0-3", stage);
        return NULL;
    }
    if (b->peer_pids == NULL) {
        PyErr_SetString(PyExc_ValueError, "mailbox: cross() needs the local ranks' pids");
        return NULL;
    }
    if (stage == 2 && b->bounce_call != call) {
        PyErr_Format(PyExc_ValueError, "mailbox: cross() stage 2, but call %lld does not bounce",
                     (long long)call);
        return NULL;
    }
    if (stage != 2 && b->bounce_call) {  /* a restart would rewrite pieces peers still read;
                                          * after a wait that raised mid-bounce, the rounds
                                          * of this rank and its peers no longer match */
        PyErr_Format(PyExc_ValueError, "mailbox: cross() stage %ld while call %lld is bouncing "
                     "(an earlier wait in it raised)", stage, (long long)b->bounce_call);
        return NULL;
    }
    int op = op_of(b, args[1]);
    Arg a;
    if (get_arg(b, args[0], op, &a, PY_SSIZE_T_MAX) < 0) return NULL;
    Py_buffer tmp;
    if (PyObject_GetBuffer(args[3], &tmp, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS) < 0) {
        PyBuffer_Release(&a.view);
        return NULL;
    }
    Py_ssize_t itemsize = a.view.itemsize, step = itemsize ? tmp.len / itemsize : 0;
    if (step < 1) {
        PyErr_Format(PyExc_ValueError, "mailbox: scratch of %zd bytes holds no element", tmp.len);
        PyBuffer_Release(&a.view);
        PyBuffer_Release(&tmp);
        return NULL;
    }
    int me = b->local_rank, n = b->local_size;
    int64_t *mine = flag_of(b, me);
    if (stage == 0) {  /* [4] region fd (-1: none), [5] offset in it, [6] its inode, [7] the call */
        const Region *reg = region_of((uintptr_t)a.view.buf, a.view.len);
        __atomic_store_n(mine + 7, CALL_KEY(a.view.len, a.type, op), __ATOMIC_RELAXED);
        __atomic_store_n(mine + 15, code, __ATOMIC_RELAXED);
        __atomic_store_n(mine + 2, (int64_t)(uintptr_t)a.view.buf, __ATOMIC_RELAXED);
        __atomic_store_n(mine + 4, reg ? reg->fd : -1, __ATOMIC_RELAXED);
        __atomic_store_n(mine + 5, reg ? (int64_t)((uintptr_t)a.view.buf - reg->start) : 0,
                         __ATOMIC_RELAXED);
        __atomic_store_n(mine + 6, reg ? reg->ino : 0, __ATOMIC_RELAXED);
        int cpu = may_bounce && a.view.len <= b->bounce_max ? sched_getcpu() : -1;
        __atomic_store_n(mine + 10, (int64_t)cpu + 1, __ATOMIC_RELAXED);
        __atomic_store_n(mine + 1, call, __ATOMIC_RELEASE);
    }
    long status = 0;
    Failure f = {0, 0, 0};
    if (stage <= 1) {
        if (!spin_until(b, 1, call, spin_ns)) {
            status = 1;
        } else if (!same_call(b)) {
            /* every rank sees every key and returns 3, nothing moved; but only after the done
             * flags: a rank that returned at once could publish its next call's key while a
             * peer still compares this call's, and that peer would take it for a match */
            b->mismatch_call = call;
            for (int j = 0; j < n; j++) {  /* for keys(): a peer may publish its next one soon */
                b->seen_keys[j] = __atomic_load_n(flag_of(b, j) + 7, __ATOMIC_RELAXED);
                b->seen_keys[n + j] = __atomic_load_n(flag_of(b, j) + 15, __ATOMIC_RELAXED);
            }
            stage = 3;
            __atomic_store_n(mine + 3, call, __ATOMIC_RELEASE);
        } else {
            b->arrived_ns = now_ns();
            /* the same choice on every rank: every rank's published region, or not */
            int direct = 1;
            for (int j = 0; j < n && direct; j++)
                direct = __atomic_load_n(flag_of(b, j) + 4, __ATOMIC_RELAXED) >= 0;
            if (!direct && a.count > 0 && bounces(b)) {
                b->algorithm = 1;
                bounce_start(b, call, a.view.buf, a.count, itemsize);
                stage = 2;
            } else {
                /* A region this rank cannot map (no descriptor left, no address space, a stale
                 * descriptor): it folds its segment through the system calls instead, the same
                 * bits, and the peers, which cannot see that failure, are not left waiting for
                 * its done flag until their deadline. */
                for (int j = 0, k = 0; j < n; j++) {
                    if (j == me) continue;
                    int64_t *line = flag_of(b, j);
                    b->peer_addrs[k] = (uintptr_t)__atomic_load_n(line + 2, __ATOMIC_RELAXED);
                    if (direct) {
                        int64_t off = __atomic_load_n(line + 5, __ATOMIC_RELAXED);
                        char *mapped = map_peer(b, k, b->peer_pids[k],
                                                __atomic_load_n(line + 4, __ATOMIC_RELAXED),
                                                __atomic_load_n(line + 6, __ATOMIC_RELAXED),
                                                (size_t)off + (size_t)a.view.len);
                        if (mapped == NULL)
                            direct = 0;
                        else
                            b->peer_ptrs[k] = mapped + off;
                    }
                    k++;
                }
                Py_ssize_t lo, hi;
                segment(a.count, n, me, &lo, &hi);
                b->direct_calls += direct;
                b->algorithm = direct ? 2 : 0;
                Py_BEGIN_ALLOW_THREADS
                if (direct)
                    fold_direct(a.view.buf, lo, hi, itemsize, a.type, op, b->peer_ptrs, n - 1,
                                step);
                else
                    f = fold_loop(a.view.buf, lo, hi, itemsize, a.type, op, b->peer_pids,
                                  b->peer_addrs, n - 1, tmp.buf, step, 1);
                Py_END_ALLOW_THREADS
                stage = 3;
                if (!f.err) __atomic_store_n(mine + 3, call, __ATOMIC_RELEASE);
            }
        }
    }
    if (status == 0 && stage == 2) {  /* bouncing */
        if (!bounce_run(b, a.view.buf, a.count, itemsize, a.type, op, spin_ns))
            status = 4;
        else
            __atomic_store_n(mine + 3, call, __ATOMIC_RELEASE);
    } else if (status == 0 && !f.err) {  /* stage 3: this rank's segment is done */
        if (!spin_until(b, 3, call, spin_ns))
            status = 2;
        else if (b->mismatch_call == call)
            status = 3;
    }
    if (status == 0 && !f.err && b->mismatch_call != call) {
        b->last_ns = now_ns() - b->arrived_ns;
        b->last_algorithm = b->algorithm;
    }
    PyBuffer_Release(&a.view);
    PyBuffer_Release(&tmp);
    if (f.err) return failure_value(f);
    return PyLong_FromLong(status);
}

static PyObject *Mailbox_keys(Mailbox *b, PyObject *unused) {
    (void)unused;
    if (!b->open) {
        PyErr_SetString(PyExc_ValueError, "mailbox is closed");
        return NULL;
    }
    if (b->seen_keys == NULL) {
        PyErr_SetString(PyExc_ValueError, "mailbox: keys() needs the local ranks' pids");
        return NULL;
    }
    PyObject *out = PyTuple_New(b->local_size);
    for (int j = 0; out != NULL && j < b->local_size; j++) {
        int64_t key = b->seen_keys[j];
        PyObject *item = Py_BuildValue("(Lii)", (long long)(key >> 6), (int)((key >> 2) & 15),
                                       (int)(key & 3));
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, j, item);
    }
    return out;
}

static PyObject *Mailbox_codes(Mailbox *b, PyObject *unused) {
    (void)unused;
    if (!b->open || b->seen_keys == NULL) {
        PyErr_SetString(PyExc_ValueError, b->open ? "mailbox: codes() needs the local ranks' pids"
                                                  : "mailbox is closed");
        return NULL;
    }
    PyObject *out = PyTuple_New(b->local_size);
    for (int j = 0; out != NULL && j < b->local_size; j++) {
        PyObject *item = PyLong_FromLongLong(b->seen_keys[b->local_size + j]);
        if (item == NULL) {
            Py_CLEAR(out);
            break;
        }
        PyTuple_SET_ITEM(out, j, item);
    }
    return out;
}

static PyObject *Mailbox_cross_reached(Mailbox *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 2) {
        PyErr_SetString(PyExc_TypeError, "cross_reached(column, call)");
        return NULL;
    }
    long column = PyLong_AsLong(args[0]);
    int64_t call = PyLong_AsLongLong(args[1]);
    if (PyErr_Occurred()) return NULL;
    if (!b->open || (column != 1 && column != 3)) {
        PyErr_SetString(PyExc_ValueError, b->open ? "mailbox: cross_reached column is 1 or 3"
                                                  : "mailbox is closed");
        return NULL;
    }
    return PyBool_FromLong(all_reached(b, (int)column, call));
}

static PyObject *Mailbox_cross_ready(Mailbox *b, PyObject *unused) {
    (void)unused;
    if (!b->open) {
        PyErr_SetString(PyExc_ValueError, "mailbox is closed");
        return NULL;
    }
    return PyBool_FromLong(b->wait_column < 0 || all_reached(b, b->wait_column, b->wait_value));
}

static PyMethodDef module_methods[] = {
    {"register_region", (PyCFunction)(void (*)(void))register_region, METH_FASTCALL,
     "register_region(start, size, fd, inode): a memfd mapping of this process that local peers "
     "may map (shm.shared_zeros)."},
    {"unregister_region", (PyCFunction)unregister_region, METH_O,
     "unregister_region(start): forget the region that starts there (before it is unmapped)."},
    {"regions_registered", (PyCFunction)regions_registered, METH_NOARGS,
     "regions_registered() -> int: how many regions are registered."},
    {"fold_peers", (PyCFunction)(void (*)(void))fold_peers, METH_FASTCALL,
     "fold_peers(x, lo, hi, peers, tmp, op, push) -> None or (errno, pid, what): the piece loop "
     "of the cross-memory all_reduce (op: 0 sum, 1 max, 2 min, 3 prod)."},
    {NULL, NULL, 0, NULL}};

static PyMethodDef Mailbox_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))Mailbox_all_reduce, METH_FASTCALL,
     "all_reduce(x, op, spin_ns, code=0, count=len(x)) -> int: post x (with the count and the "
     "fingerprint code), wait up to spin_ns for the peers, reduce in place when they arrived (0); -call: "
     "they arrived, but the counts or codes differ (nothing reduced; box_keys(call)); else the "
     "call number: wait on arrived(call), then finish()."},
    {"arrived", (PyCFunction)Mailbox_arrived, METH_O,
     "arrived(call) -> bool: every local rank has posted call number `call`."},
    {"finish", (PyCFunction)(void (*)(void))Mailbox_finish, METH_FASTCALL,
     "finish(x, op, call) -> bool: reduce the posted terms of `call` into x (after "
     "arrived(call)); False: the counts or codes differ, nothing reduced."},
    {"cross", (PyCFunction)(void (*)(void))Mailbox_cross, METH_FASTCALL,
     "cross(x, op, call, tmp, spin_ns, stage, bounce, code=0) -> int or (errno, pid, what): the "
     "one-node cross-memory all_reduce of x in place (0 done; 1, 4, 2: wait on cross_ready(), "
     "then call again at stage 1, 2, 3; 3: the ranks' arrays or codes differ); bounce: this "
     "rank may bounce it; code: the caller's fingerprint code, which every rank must share."},
    {"codes", (PyCFunction)Mailbox_codes, METH_NOARGS,
     "codes() -> (code, ...): each local rank's fingerprint code when a cross() call last found "
     "the ranks' calls differ (status 3)."},
    {"calls", (PyCFunction)Mailbox_calls, METH_NOARGS,
     "calls() -> int: the mailbox calls numbered so far."},
    {"box_keys", (PyCFunction)Mailbox_box_keys, METH_O,
     "box_keys(call) -> ((count, code), ...): what each local rank posted with mailbox call "
     "`call` (before this rank posts call + 1)."},
    {"cross_ready", (PyCFunction)Mailbox_cross_ready, METH_NOARGS,
     "cross_ready() -> bool: the flags the last unfinished cross() waited for are reached."},
    {"cross_reached", (PyCFunction)(void (*)(void))Mailbox_cross_reached, METH_FASTCALL,
     "cross_reached(column, call) -> bool: every local rank's cross-memory arrival (column 1) "
     "or done (3) flag has reached `call`."},
    {"keys", (PyCFunction)Mailbox_keys, METH_NOARGS,
     "keys() -> ((bytes, type, op), ...): what each local rank had published when a cross() "
     "call last found them differ (status 3)."},
    {"direct_calls", (PyCFunction)Mailbox_direct_calls, METH_NOARGS,
     "direct_calls() -> int: cross() calls that folded straight from the peers' shared regions."},
    {"bounce_calls", (PyCFunction)Mailbox_bounce_calls, METH_NOARGS,
     "bounce_calls() -> int: cross() calls that bounced through the shared slots."},
    {"last_call", (PyCFunction)Mailbox_last_call, METH_NOARGS,
     "last_call() -> (algorithm, ns) or None: the last cross() call that finished: its "
     "algorithm (0 system calls, 1 bounce, 2 direct) and its nanoseconds from every peer's "
     "arrival to its end on this rank."},
    {"close", (PyCFunction)Mailbox_close, METH_NOARGS,
     "close(): release the mapping (every later call raises ValueError)."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject MailboxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rtxmpi.comm._mailbox.Mailbox",
    .tp_basicsize = sizeof(Mailbox),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Mailbox(mapping, local_size, local_rank, slot_bytes, ops, pids=None): this "
              "rank's view of the shared mailbox (see rtxmpi/comm/shm.py); ops: the (sum, max, "
              "min, prod) op objects; pids: every local rank's pid, by local rank (for cross()).",
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)Mailbox_init,
    .tp_dealloc = (destructor)Mailbox_dealloc,
    .tp_methods = Mailbox_methods,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_mailbox",
    "Compiled mailbox all_reduce for rtxmpi.comm.shm (see _mailbox.c).", -1, module_methods,
    NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__mailbox(void) {
    if (PyType_Ready(&MailboxType) < 0) return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL) return NULL;
    Py_INCREF(&MailboxType);
    if (PyModule_AddObject(m, "Mailbox", (PyObject *)&MailboxType) < 0) {
        Py_DECREF(&MailboxType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
