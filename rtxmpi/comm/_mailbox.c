/* The shared-memory mailbox all_reduce of rtxmpi/comm/shm.py, compiled: one synchronization per
 * call, no MPI call, a few hundred nanoseconds of work for a small message.
 *
 * Layout of the mailbox mapping (owned and described by shm.py): per local rank j, a region of
 * `region` bytes at j * region: a 64-byte flag line whose first int64 is the mailbox call number,
 * then two slots of `slot_bytes` (call parity 0 and 1).
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
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <errno.h>
#include <stdint.h>
#include <string.h>
#include <sys/uio.h>
#include <time.h>

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
} Mailbox;

static inline int64_t *flag_of(Mailbox *b, int j) {
    return (int64_t *)(b->base + (Py_ssize_t)j * b->region);
}

static inline char *slot_of(Mailbox *b, int j, int64_t call) {
    return b->base + (Py_ssize_t)j * b->region + 64 + (call & 1) * b->slot_bytes;
}

static int all_arrived(Mailbox *b, int64_t call) {
    for (int j = 0; j < b->local_size; j++)
        if (j != b->local_rank && __atomic_load_n(flag_of(b, j), __ATOMIC_ACQUIRE) < call)
            return 0;
    return 1;
}

static int64_t now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
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

static int get_arg(Mailbox *b, PyObject *x, int op, Arg *a) {
    if (!b->open) {
        PyErr_SetString(PyExc_ValueError, "mailbox is closed");
        return -1;
    }
    if (op < 0) return -1;
    if (PyObject_GetBuffer(x, &a->view, PyBUF_WRITABLE | PyBUF_FORMAT | PyBUF_C_CONTIGUOUS) < 0)
        return -1;
    a->type = type_code(a->view.format, a->view.itemsize);
    if (a->type < 0 || a->view.len > b->slot_bytes) {
        PyErr_Format(PyExc_ValueError,
                     "mailbox: array of format '%s' and %zd bytes does not fit (largest %zd bytes, "
                     "numeric dtypes only)", a->view.format ? a->view.format : "B", a->view.len,
                     b->slot_bytes);
        PyBuffer_Release(&a->view);
        return -1;
    }
    a->count = a->view.itemsize ? a->view.len / a->view.itemsize : 0;
    return 0;
}

static PyObject *Mailbox_all_reduce(Mailbox *b, PyObject *const *args, Py_ssize_t nargs) {
    if (nargs != 3) {
        PyErr_SetString(PyExc_TypeError, "all_reduce(x, op, spin_ns)");
        return NULL;
    }
    int64_t spin_ns = PyLong_AsLongLong(args[2]);
    if (spin_ns == -1 && PyErr_Occurred()) return NULL;
    int op = op_of(b, args[1]);
    Arg a;
    if (get_arg(b, args[0], op, &a) < 0) return NULL;
    int64_t call = ++b->calls;
    memcpy(slot_of(b, b->local_rank, call), a.view.buf, a.view.len);
    __atomic_store_n(flag_of(b, b->local_rank), call, __ATOMIC_RELEASE);
    int done = all_arrived(b, call);
    if (!done && spin_ns > 0) {
        int64_t end = now_ns() + spin_ns;
        unsigned polls = 0;
        while (!(done = all_arrived(b, call))) {
            CPU_RELAX();
            if ((++polls & 63) == 0 && now_ns() > end) break;
        }
    }
    if (done) reduce_into(b, a.view.buf, a.view.len, a.count, a.type, op, call);
    PyBuffer_Release(&a.view);
    return PyLong_FromLongLong(done ? 0 : call);
}

static PyObject *Mailbox_arrived(Mailbox *b, PyObject *arg) {
    int64_t call = PyLong_AsLongLong(arg);
    if (call == -1 && PyErr_Occurred()) return NULL;
    if (!b->open) {
        PyErr_SetString(PyExc_ValueError, "mailbox is closed");
        return NULL;
    }
    return PyBool_FromLong(all_arrived(b, call));
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
    if (get_arg(b, args[0], op, &a) < 0) return NULL;
    if (!all_arrived(b, call)) {
        PyBuffer_Release(&a.view);
        PyErr_Format(PyExc_RuntimeError, "mailbox: finish(call %lld) before every peer arrived",
                     (long long)call);
        return NULL;
    }
    reduce_into(b, a.view.buf, a.view.len, a.count, a.type, op, call);
    PyBuffer_Release(&a.view);
    Py_RETURN_NONE;
}

static PyObject *Mailbox_close(Mailbox *b, PyObject *unused) {
    (void)unused;
    if (b->open) {
        b->open = 0;
        PyBuffer_Release(&b->map);
    }
    Py_RETURN_NONE;
}

static int Mailbox_init(Mailbox *b, PyObject *args, PyObject *kwds) {
    static char *names[] = {"mapping", "local_size", "local_rank", "slot_bytes", "ops", NULL};
    PyObject *mapping;
    int local_size, local_rank;
    Py_ssize_t slot_bytes;
    PyObject *ops[4];
    if (!PyArg_ParseTupleAndKeywords(args, kwds, "Oiin(OOOO)", names, &mapping, &local_size,
                                     &local_rank, &slot_bytes, &ops[0], &ops[1], &ops[2], &ops[3]))
        return -1;
    if (b->open) {
        PyErr_SetString(PyExc_ValueError, "mailbox already initialized");
        return -1;
    }
    if (local_size < 2 || local_rank < 0 || local_rank >= local_size || slot_bytes < 0
            || slot_bytes % 8 || slot_bytes > (PY_SSIZE_T_MAX / local_size - 64) / 2) {
        PyErr_SetString(PyExc_ValueError, "mailbox: bad layout (local_size >= 2, 0 <= local_rank "
                                          "< local_size, slot_bytes a non-negative multiple of 8, "
                                          "the mailbox's size a Py_ssize_t)");
        return -1;
    }
    if (PyObject_GetBuffer(mapping, &b->map, PyBUF_WRITABLE) < 0) return -1;
    Py_ssize_t region = 64 + 2 * slot_bytes;
    if (b->map.len < region * local_size || ((uintptr_t)b->map.buf) % 64) {
        PyBuffer_Release(&b->map);
        PyErr_Format(PyExc_ValueError, "mailbox: mapping of %zd bytes is smaller than %d x %zd "
                     "or not 64-byte aligned", b->map.len, local_size, region);
        return -1;
    }
    b->open = 1;
    b->calls = 0;
    for (int i = 0; i < 4; i++) {  /* __init__ again after close(): drop the previous ops */
        Py_INCREF(ops[i]);
        Py_XSETREF(b->ops[i], ops[i]);
    }
    b->base = b->map.buf;
    b->region = region;
    b->slot_bytes = slot_bytes;
    b->local_size = local_size;
    b->local_rank = local_rank;
    return 0;
}

static void Mailbox_dealloc(Mailbox *b) {
    if (b->open) PyBuffer_Release(&b->map);
    for (int i = 0; i < 4; i++) Py_XDECREF(b->ops[i]);
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
    char *base = x.buf, *scratch = tmp.buf;
    int err = 0, failed_read = 0;
    pid_t failed = 0;
    Py_BEGIN_ALLOW_THREADS
    for (Py_ssize_t start = lo; start < hi && !err; start += step) {
        Py_ssize_t stop = start + step < hi ? start + step : hi;
        Py_ssize_t off = start * itemsize, nbytes = (stop - start) * itemsize;
        for (Py_ssize_t j = 0; j < npeers && !err; j++) {
            if ((err = move(pids[j], 1, scratch, addrs[j] + (uintptr_t)off, nbytes))) {
                failed = pids[j];
                failed_read = 1;
                break;
            }
            fold(type, base + off, base + off, scratch, stop - start, op);
        }
        for (Py_ssize_t j = 0; push && j < npeers && !err; j++)
            if ((err = move(pids[j], 0, base + off, addrs[j] + (uintptr_t)off, nbytes)))
                failed = pids[j];
    }
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&x);
    PyBuffer_Release(&tmp);
    if (err)
        return Py_BuildValue("(ils)", err, (long)failed,
                             failed_read ? "process_vm_readv from" : "process_vm_writev to");
    Py_RETURN_NONE;
}

static PyMethodDef module_methods[] = {
    {"fold_peers", (PyCFunction)(void (*)(void))fold_peers, METH_FASTCALL,
     "fold_peers(x, lo, hi, peers, tmp, op, push) -> None or (errno, pid, what): the piece loop "
     "of the cross-memory all_reduce (op: 0 sum, 1 max, 2 min, 3 prod)."},
    {NULL, NULL, 0, NULL}};

static PyMethodDef Mailbox_methods[] = {
    {"all_reduce", (PyCFunction)(void (*)(void))Mailbox_all_reduce, METH_FASTCALL,
     "all_reduce(x, op, spin_ns) -> int: post x, wait up to spin_ns for the peers, reduce in "
     "place when they arrived (0); else the call number: wait on arrived(call), then finish()."},
    {"arrived", (PyCFunction)Mailbox_arrived, METH_O,
     "arrived(call) -> bool: every local rank has posted call number `call`."},
    {"finish", (PyCFunction)(void (*)(void))Mailbox_finish, METH_FASTCALL,
     "finish(x, op, call): reduce the posted terms of `call` into x (after arrived(call))."},
    {"close", (PyCFunction)Mailbox_close, METH_NOARGS,
     "close(): release the mapping (every later call raises ValueError)."},
    {NULL, NULL, 0, NULL}};

static PyTypeObject MailboxType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "rtxmpi.comm._mailbox.Mailbox",
    .tp_basicsize = sizeof(Mailbox),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_doc = "Mailbox(mapping, local_size, local_rank, slot_bytes, ops): this rank's view of "
              "the shared mailbox (see rtxmpi/comm/shm.py); ops: the (sum, max, min, prod) op "
              "objects.",
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
