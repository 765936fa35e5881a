/* CPU twins of the fused CUDA kernels (the .cu files of kernels/) and of the numpy references
 * they replace on the host: bias + GELU, softmax, residual + LayerNorm, cross-entropy, AdamW, the
 * gradient epilogue's scale-and-check and the clipping norm's sum of squares, each one pass over
 * memory, float32 and float64. rtxmpi/fused.py is the only caller: it checks dtypes, shapes and
 * contiguity, so the functions here trust the sizes they are given beyond a check that every
 * buffer is long enough. Every function releases the GIL and runs on the calling thread (one
 * thread per rank, as the BLAS).
 *
 * Portability: built with the compiler's baseline (-O3, no -march); on x86-64 each kernel also
 * has AVX-512 and AVX2 clones, one picked at load time (GCC/clang target_clones).
 * -ffp-contract=off keeps every clone's rounding the reference's (AdamW and the epilogue are bit
 * for bit); exp is Cephes' range reduction and polynomial (float: ~1 ulp, double: ~1 ulp),
 * written so it vectorizes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <math.h>
#include <stdint.h>
#include <string.h>

#if defined(__x86_64__) && defined(__has_attribute)
#if __has_attribute(target_clones)
#define KERNEL static __attribute__((target_clones("avx512f", "avx2", "default")))
#endif
#endif
#ifndef KERNEL
#define KERNEL static
#endif

#define LANES 8
#define GELU_K 0.7978845608028654 /* sqrt(2 / pi), as rtxmpi.kernels.GELU_K */
#define GELU_C 0.044715

static inline float exp_f32(float x)
{
    x = x < -87.0f ? -87.0f : x; /* keeps 2^n normal; a NaN passes through */
    x = x > 88.0f ? 88.0f : x;
    float t = x * 1.44269504088896341f + 12582912.0f; /* 1.5 * 2^23: round to nearest */
    float n = t - 12582912.0f;
    int32_t ti, si;
    memcpy(&ti, &t, 4);
    float r = x - n * 0.693359375f;
    r = r + n * 2.12194440e-4f;
    float p = 1.9875691500e-4f;
    p = p * r + 1.3981999507e-3f;
    p = p * r + 8.3334519073e-3f;
    p = p * r + 4.1665795894e-2f;
    p = p * r + 1.6666665459e-1f;
    p = p * r + 5.0000001201e-1f;
    p = p * r * r + r + 1.0f;
    si = (ti - 0x4B400000 + 127) * (1 << 23); /* 2^n from n's bits in t */
    float s;
    memcpy(&s, &si, 4);
    return p * s;
}

static inline double exp_f64(double x)
{
    x = x < -708.0 ? -708.0 : x;
    x = x > 709.0 ? 709.0 : x;
    double t = x * 1.4426950408889634 + 6755399441055744.0; /* 1.5 * 2^52 */
    double n = t - 6755399441055744.0;
    int64_t ti, si;
    memcpy(&ti, &t, 8);
    double r = x - n * 6.93145751953125e-1;
    r = r - n * 1.42860682030941723212e-6;
    double rr = r * r;
    double px = r * ((1.26177193074810590878e-4 * rr + 3.02994407707441961300e-2) * rr
                     + 9.99999999999999999910e-1);
    double qx = ((3.00198505138664455042e-6 * rr + 2.52448340349684104192e-3) * rr
                 + 2.27265548208155028766e-1) * rr + 2.00000000000000000009e0;
    r = 1.0 + 2.0 * (px / (qx - px));
    si = (ti - 0x4338000000000000LL + 1023) * ((int64_t)1 << 52);
    double s;
    memcpy(&s, &si, 8);
    return r * s;
}

#define T float
#define F(name) name##_f32
#define EXP exp_f32
#define LOG logf
#define SQRT sqrtf
#define NBITS uint32_t
#define EXP_MASK 0x7F800000u
#include "_fused_kernels.h"
#undef T
#undef F
#undef EXP
#undef LOG
#undef SQRT
#undef NBITS
#undef EXP_MASK

#define T double
#define F(name) name##_f64
#define EXP exp_f64
#define LOG log
#define SQRT sqrt
#define NBITS uint64_t
#define EXP_MASK 0x7FF0000000000000ull
#include "_fused_kernels.h"

/* ------------------------------------------------------------------------- the Python side */
#define MAX_BUFS 8

/* Buffers of one call: filled by PyArg_ParseTuple's y* / w*, released together */
typedef struct {
    Py_buffer b[MAX_BUFS];
    int n;
} Bufs;

static void release(Bufs *bufs)
{
    for (int i = 0; i < bufs->n; i++)
        PyBuffer_Release(&bufs->b[i]);
}

/* 0 when every buffer holds at least `elems[i] * itemsize` bytes, else -1 with ValueError */
static int check_sizes(Bufs *bufs, const Py_ssize_t *elems, Py_ssize_t itemsize)
{
    for (int i = 0; i < bufs->n; i++) {
        if (elems[i] < 0 || bufs->b[i].len < elems[i] * itemsize) {
            PyErr_Format(PyExc_ValueError, "_fused: buffer %d holds %zd bytes, needs %zd", i,
                         bufs->b[i].len, elems[i] * itemsize);
            return -1;
        }
    }
    return 0;
}

/* An optional buffer argument (None or a contiguous buffer) into bufs->b[bufs->n] */
static int optional_buffer(PyObject *obj, Bufs *bufs, int writable, const void **ptr)
{
    *ptr = NULL;
    if (obj == Py_None)
        return 0;
    if (PyObject_GetBuffer(obj, &bufs->b[bufs->n], writable ? PyBUF_WRITABLE : PyBUF_SIMPLE) < 0)
        return -1;
    *ptr = bufs->b[bufs->n++].buf;
    return 0;
}

#define ITEM(dbl) ((dbl) ? (Py_ssize_t)sizeof(double) : (Py_ssize_t)sizeof(float))

static PyObject *py_bias_gelu_forward(PyObject *self, PyObject *args)
{
    Bufs B = {.n = 3};
    Py_ssize_t rows, C;
    int dbl;
    if (!PyArg_ParseTuple(args, "w*y*w*nnp", &B.b[0], &B.b[1], &B.b[2], &rows, &C, &dbl))
        return NULL;
    Py_ssize_t need[] = {rows * C, C, rows * C};
    if (check_sizes(&B, need, ITEM(dbl)) < 0) {
        release(&B);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (dbl)
        bias_gelu_forward_f64(B.b[0].buf, B.b[1].buf, B.b[2].buf, rows, C);
    else
        bias_gelu_forward_f32(B.b[0].buf, B.b[1].buf, B.b[2].buf, rows, C);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_bias_gelu_backward(PyObject *self, PyObject *args)
{
    Bufs B = {.n = 4};
    Py_ssize_t rows, C;
    int dbl;
    if (!PyArg_ParseTuple(args, "y*y*w*w*nnp", &B.b[0], &B.b[1], &B.b[2], &B.b[3], &rows, &C,
                          &dbl))
        return NULL;
    Py_ssize_t need[] = {rows * C, rows * C, rows * C, C};
    if (check_sizes(&B, need, ITEM(dbl)) < 0) {
        release(&B);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (dbl)
        bias_gelu_backward_f64(B.b[0].buf, B.b[1].buf, B.b[2].buf, B.b[3].buf, rows, C);
    else
        bias_gelu_backward_f32(B.b[0].buf, B.b[1].buf, B.b[2].buf, B.b[3].buf, rows, C);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_softmax_forward(PyObject *self, PyObject *args)
{
    Bufs B = {.n = 1};
    Py_ssize_t rows, n_col;
    int causal, dbl;
    if (!PyArg_ParseTuple(args, "w*nnpp", &B.b[0], &rows, &n_col, &causal, &dbl))
        return NULL;
    Py_ssize_t need[] = {rows * n_col};
    if (check_sizes(&B, need, ITEM(dbl)) < 0) {
        release(&B);
        return NULL;
    }
    if (n_col > 0) {
        Py_BEGIN_ALLOW_THREADS
        if (dbl)
            softmax_forward_f64(B.b[0].buf, rows, n_col, causal);
        else
            softmax_forward_f32(B.b[0].buf, rows, n_col, causal);
        Py_END_ALLOW_THREADS
    }
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_softmax_backward(PyObject *self, PyObject *args)
{
    Bufs B = {.n = 2};
    Py_ssize_t rows, n_col;
    int dbl;
    if (!PyArg_ParseTuple(args, "w*y*nnp", &B.b[0], &B.b[1], &rows, &n_col, &dbl))
        return NULL;
    Py_ssize_t need[] = {rows * n_col, rows * n_col};
    if (check_sizes(&B, need, ITEM(dbl)) < 0) {
        release(&B);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (dbl)
        softmax_backward_f64(B.b[0].buf, B.b[1].buf, rows, n_col);
    else
        softmax_backward_f32(B.b[0].buf, B.b[1].buf, rows, n_col);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_layernorm_forward(PyObject *self, PyObject *args)
{
    Bufs B = {.n = 6};
    PyObject *res_obj;
    Py_ssize_t rows, C;
    double eps;
    int dbl;
    const void *res;
    if (!PyArg_ParseTuple(args, "y*y*y*w*w*w*Onndp", &B.b[0], &B.b[1], &B.b[2], &B.b[3], &B.b[4],
                          &B.b[5], &res_obj, &rows, &C, &eps, &dbl))
        return NULL;
    if (optional_buffer(res_obj, &B, 0, &res) < 0) {
        release(&B);
        return NULL;
    }
    Py_ssize_t need[] = {rows * C, C, C, rows * C, rows * C, rows, rows * C};
    if (check_sizes(&B, need, ITEM(dbl)) < 0) {
        release(&B);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (dbl)
        layernorm_forward_f64(B.b[0].buf, res, B.b[1].buf, B.b[2].buf, B.b[3].buf, B.b[4].buf,
                              B.b[5].buf, rows, C, eps);
    else
        layernorm_forward_f32(B.b[0].buf, res, B.b[1].buf, B.b[2].buf, B.b[3].buf, B.b[4].buf,
                              B.b[5].buf, rows, C, eps);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_layernorm_backward(PyObject *self, PyObject *args)
{
    Bufs B = {.n = 7};
    Py_ssize_t rows, C;
    int dbl;
    if (!PyArg_ParseTuple(args, "y*y*y*y*w*w*w*nnp", &B.b[0], &B.b[1], &B.b[2], &B.b[3], &B.b[4],
                          &B.b[5], &B.b[6], &rows, &C, &dbl))
        return NULL;
    Py_ssize_t need[] = {rows * C, rows * C, rows, C, rows * C, C, C};
    if (check_sizes(&B, need, ITEM(dbl)) < 0) {
        release(&B);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (dbl)
        layernorm_backward_f64(B.b[0].buf, B.b[1].buf, B.b[2].buf, B.b[3].buf, B.b[4].buf,
                               B.b[5].buf, B.b[6].buf, rows, C);
    else
        layernorm_backward_f32(B.b[0].buf, B.b[1].buf, B.b[2].buf, B.b[3].buf, B.b[4].buf,
                               B.b[5].buf, B.b[6].buf, rows, C);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

/* targets are int64; returns None, or raises IndexError naming the first bad row */
static PyObject *py_crossentropy_forward(PyObject *self, PyObject *args)
{
    Bufs B = {.n = 4};
    Py_ssize_t rows, V, bad = -1;
    int dbl;
    if (!PyArg_ParseTuple(args, "y*y*w*w*nnp", &B.b[0], &B.b[1], &B.b[2], &B.b[3], &rows, &V, &dbl))
        return NULL;
    Py_ssize_t item = ITEM(dbl);
    Py_ssize_t need[] = {rows * V, rows * (Py_ssize_t)sizeof(int64_t) / item, rows * V, rows};
    if (check_sizes(&B, need, item) < 0) {
        release(&B);
        return NULL;
    }
    if (V > 0) {
        Py_BEGIN_ALLOW_THREADS
        if (dbl)
            bad = crossentropy_forward_f64(B.b[0].buf, B.b[1].buf, B.b[2].buf, B.b[3].buf, rows, V);
        else
            bad = crossentropy_forward_f32(B.b[0].buf, B.b[1].buf, B.b[2].buf, B.b[3].buf, rows, V);
        Py_END_ALLOW_THREADS
    } else if (rows > 0) {
        bad = 0;
    }
    if (bad >= 0) {
        PyErr_Format(PyExc_IndexError, "target %lld of position %zd is outside [0, %zd)",
                     (long long)((int64_t *)B.b[1].buf)[bad], bad, V);
        release(&B);
        return NULL;
    }
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_crossentropy_backward(PyObject *self, PyObject *args)
{
    Bufs B = {.n = 3};
    Py_ssize_t rows, V;
    double c;
    int dbl;
    if (!PyArg_ParseTuple(args, "y*y*w*nndp", &B.b[0], &B.b[1], &B.b[2], &rows, &V, &c, &dbl))
        return NULL;
    Py_ssize_t item = ITEM(dbl);
    Py_ssize_t need[] = {rows * V, rows * (Py_ssize_t)sizeof(int64_t) / item, rows * V};
    if (check_sizes(&B, need, item) < 0) {
        release(&B);
        return NULL;
    }
    const int64_t *tgt = B.b[1].buf;
    for (Py_ssize_t r = 0; r < rows; r++) {  /* the forward checked them; an out-of-bounds write costs more */
        if (tgt[r] < 0 || tgt[r] >= V) {
            PyErr_Format(PyExc_IndexError, "target %lld of position %zd is outside [0, %zd)",
                         (long long)tgt[r], r, V);
            release(&B);
            return NULL;
        }
    }
    Py_BEGIN_ALLOW_THREADS
    if (dbl)
        crossentropy_backward_f64(B.b[0].buf, tgt, B.b[2].buf, rows, V, c);
    else
        crossentropy_backward_f32(B.b[0].buf, tgt, B.b[2].buf, rows, V, c);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_adamw(PyObject *self, PyObject *args)
{
    Bufs B = {.n = 4};
    PyObject *mask_obj;
    Py_ssize_t n;
    double b1, b2, decay, lrwd, eps_term, step_size;
    int mode, dbl;
    const void *mask;
    if (!PyArg_ParseTuple(args, "w*y*w*w*Onddddddip", &B.b[0], &B.b[1], &B.b[2], &B.b[3],
                          &mask_obj, &n, &b1, &b2, &decay, &lrwd, &eps_term, &step_size, &mode,
                          &dbl))
        return NULL;
    if (optional_buffer(mask_obj, &B, 0, &mask) < 0) {
        release(&B);
        return NULL;
    }
    Py_ssize_t need[] = {n, n, n, n, n};
    if (check_sizes(&B, need, ITEM(dbl)) < 0 || (mode == 2 && mask == NULL)) {
        if (!PyErr_Occurred())
            PyErr_SetString(PyExc_ValueError, "_fused.adamw: mode 2 needs a mask");
        release(&B);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    if (dbl)
        adamw_f64(B.b[0].buf, B.b[1].buf, B.b[2].buf, B.b[3].buf, mask, n, b1, b2, decay, lrwd,
                  eps_term, step_size, mode);
    else
        adamw_f32(B.b[0].buf, B.b[1].buf, B.b[2].buf, B.b[3].buf, mask, n, b1, b2, decay, lrwd,
                  eps_term, step_size, mode);
    Py_END_ALLOW_THREADS
    release(&B);
    Py_RETURN_NONE;
}

static PyObject *py_grad_scale(PyObject *self, PyObject *args)
{
    Bufs B = {.n = 1};
    Py_ssize_t n;
    double scale;
    int dbl, bad;
    if (!PyArg_ParseTuple(args, "w*ndp", &B.b[0], &n, &scale, &dbl))
        return NULL;
    Py_ssize_t need[] = {n};
    if (check_sizes(&B, need, ITEM(dbl)) < 0) {
        release(&B);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    bad = dbl ? grad_scale_f64(B.b[0].buf, n, scale) : grad_scale_f32(B.b[0].buf, n, scale);
    Py_END_ALLOW_THREADS
    release(&B);
    return PyBool_FromLong(bad);
}

static PyObject *py_sum_squares(PyObject *self, PyObject *args)
{
    Bufs B = {.n = 1};
    Py_ssize_t n;
    int dbl;
    double total;
    if (!PyArg_ParseTuple(args, "y*np", &B.b[0], &n, &dbl))
        return NULL;
    Py_ssize_t need[] = {n};
    if (check_sizes(&B, need, ITEM(dbl)) < 0) {
        release(&B);
        return NULL;
    }
    Py_BEGIN_ALLOW_THREADS
    total = dbl ? sum_squares_f64(B.b[0].buf, n) : sum_squares_f32(B.b[0].buf, n);
    Py_END_ALLOW_THREADS
    release(&B);
    return PyFloat_FromDouble(total);
}

static PyMethodDef methods[] = {
    {"bias_gelu_forward", py_bias_gelu_forward, METH_VARARGS,
     "bias_gelu_forward(h, b, y, rows, C, dbl): h <- h + b, y <- GELU(h)"},
    {"bias_gelu_backward", py_bias_gelu_backward, METH_VARARGS,
     "bias_gelu_backward(dy, u, du, db, rows, C, dbl)"},
    {"softmax_forward", py_softmax_forward, METH_VARARGS,
     "softmax_forward(att, rows, T, causal, dbl): in place"},
    {"softmax_backward", py_softmax_backward, METH_VARARGS,
     "softmax_backward(datt, att, rows, T, dbl): datt <- the scores' gradient"},
    {"layernorm_forward", py_layernorm_forward, METH_VARARGS,
     "layernorm_forward(x, g, b, y, xhat, rstd, res_or_None, rows, C, eps, dbl)"},
    {"layernorm_backward", py_layernorm_backward, METH_VARARGS,
     "layernorm_backward(dy, xhat, rstd, g, dx, dg, db, rows, C, dbl)"},
    {"crossentropy_forward", py_crossentropy_forward, METH_VARARGS,
     "crossentropy_forward(logits, targets_int64, probs, nll, rows, V, dbl)"},
    {"crossentropy_backward", py_crossentropy_backward, METH_VARARGS,
     "crossentropy_backward(probs, targets_int64, out, rows, V, c, dbl)"},
    {"adamw", py_adamw, METH_VARARGS,
     "adamw(p, g, m, v, mask_or_None, n, b1, b2, decay, lrwd, eps_term, step_size, mode, dbl)"},
    {"grad_scale", py_grad_scale, METH_VARARGS,
     "grad_scale(g, n, scale, dbl) -> True when a scaled value is not finite"},
    {"sum_squares", py_sum_squares, METH_VARARGS,
     "sum_squares(g, n, dbl) -> the sum of g^2 in double"},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT, "_fused", "CPU fused kernels of rtxmpi (see rtxmpi/fused.py).", -1,
    methods, NULL, NULL, NULL, NULL,
};

PyMODINIT_FUNC PyInit__fused(void)
{
    return PyModule_Create(&module);
}
