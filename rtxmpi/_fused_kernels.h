/* The kernels of _fused.c for one float type, included once per type with
 *   T      the element type (float or double)
 *   F(n)   the function name for this type (n ## _f32 or n ## _f64)
 *   EXP    a vectorizable exp for T;  LOG, SQRT  libm's log and sqrt for T
 *   NBITS / EXP_MASK  the bit pattern's unsigned integer type and exponent mask (finite check)
 * Shape legend as rtxmpi.nn.layers: rows = product of the leading dims, C (or T, V) the last dim.
 * Every reduction over a row keeps LANES partial sums (vectorizable without reassociating
 * floats); reductions over rows add one row at a time, as numpy's sum(axis=0) does.
 */

/* y = GELU(u), u = h + b written back into h; the gate a = 0.5 (1 + tanh(z)) as 1 / (1 + exp(-2z)) */
KERNEL void F(bias_gelu_forward)(T *h, const T *b, T *y, Py_ssize_t rows, Py_ssize_t C)
{
    const T kc = (T)(GELU_K * GELU_C), k = (T)GELU_K;
    for (Py_ssize_t r = 0; r < rows; r++) {
        T *hr = h + r * C, *yr = y + r * C;
        for (Py_ssize_t j = 0; j < C; j++) {
            T u = hr[j] + b[j];
            T z = (u * u * kc + k) * u;
            T a = (T)1 / ((T)1 + EXP((T)-2 * z));
            hr[j] = u;
            yr[j] = u * a;
        }
    }
}

/* du = dy * a * (1 + 2k u (1 + 3c u^2) (1 - a)); db = sum over rows of du (zeroed here first) */
KERNEL void F(bias_gelu_backward)(const T *dy, const T *u, T *du, T *db, Py_ssize_t rows,
                                  Py_ssize_t C)
{
    const T kc = (T)(GELU_K * GELU_C), k = (T)GELU_K;
    const T kc6 = (T)(6.0 * GELU_K * GELU_C), k2 = (T)(2.0 * GELU_K);
    for (Py_ssize_t j = 0; j < C; j++)
        db[j] = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const T *dyr = dy + r * C, *ur = u + r * C;
        T *dur = du + r * C;
        for (Py_ssize_t j = 0; j < C; j++) {
            T x = ur[j];
            T z = (x * x * kc + k) * x;
            T a = (T)1 / ((T)1 + EXP((T)-2 * z));
            T d = ((x * x * kc6 + k2) * x * ((T)1 - a) + (T)1) * a * dyr[j];
            dur[j] = d;
            db[j] += d;
        }
    }
}

static inline T F(row_sum)(const T *x, Py_ssize_t n)
{
    T acc[LANES] = {0};
    Py_ssize_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += x[j + l];
    T s = 0;
    for (int l = 0; l < LANES; l++)
        s += acc[l];
    for (; j < n; j++)
        s += x[j];
    return s;
}

static inline T F(row_dot)(const T *x, const T *y, Py_ssize_t n)
{
    T acc[LANES] = {0};
    Py_ssize_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += x[j + l] * y[j + l];
    T s = 0;
    for (int l = 0; l < LANES; l++)
        s += acc[l];
    for (; j < n; j++)
        s += x[j] * y[j];
    return s;
}

/* The row's max; a NaN is skipped here but makes every output of the row NaN through exp, as
 * numpy's NaN max does */
static inline T F(row_max)(const T *x, Py_ssize_t n)
{
    T acc[LANES];
    for (int l = 0; l < LANES; l++)
        acc[l] = -INFINITY;
    Py_ssize_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] = x[j + l] > acc[l] ? x[j + l] : acc[l];
    T m = -INFINITY;
    for (int l = 0; l < LANES; l++)
        m = acc[l] > m ? acc[l] : m;
    for (; j < n; j++)
        m = x[j] > m ? x[j] : m;
    return m;
}

/* x[j] <- exp(x[j] - m) for j < n; returns their sum */
static inline T F(row_exp)(T *x, Py_ssize_t n, T m)
{
    T acc[LANES] = {0};
    Py_ssize_t j = 0;
    for (; j + LANES <= n; j += LANES)
        for (int l = 0; l < LANES; l++) {
            T e = EXP(x[j + l] - m);
            x[j + l] = e;
            acc[l] += e;
        }
    T s = 0;
    for (int l = 0; l < LANES; l++)
        s += acc[l];
    for (; j < n; j++) {
        x[j] = EXP(x[j] - m);
        s += x[j];
    }
    return s;
}

/* att <- softmax over rows of length T, in place; causal: row r is query r % T, keys after it get 0 */
KERNEL void F(softmax_forward)(T *att, Py_ssize_t rows, Py_ssize_t n_col, int causal)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        T *x = att + r * n_col;
        Py_ssize_t n = causal ? r % n_col + 1 : n_col;
        T inv = (T)1 / F(row_exp)(x, n, F(row_max)(x, n));
        for (Py_ssize_t j = 0; j < n; j++)
            x[j] *= inv;
        for (Py_ssize_t j = n; j < n_col; j++)
            x[j] = 0;
    }
}

/* datt <- att * (datt - sum(datt * att)) per row, in place */
KERNEL void F(softmax_backward)(T *datt, const T *att, Py_ssize_t rows, Py_ssize_t n_col)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        T *d = datt + r * n_col;
        const T *a = att + r * n_col;
        T s = F(row_dot)(d, a, n_col);
        for (Py_ssize_t j = 0; j < n_col; j++)
            d[j] = d[j] * a[j] - a[j] * s;
    }
}

/* x (+= res when res) then y = (x - mean) * rstd * g + b, xhat = (x - mean) * rstd, rstd per row */
KERNEL void F(layernorm_forward)(T *x, const T *res, const T *g, const T *b, T *y, T *xhat,
                                 T *rstd, Py_ssize_t rows, Py_ssize_t C, double eps)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        T *xr = x + r * C, *yr = y + r * C, *hr = xhat + r * C;
        if (res) {
            const T *rr = res + r * C;
            for (Py_ssize_t j = 0; j < C; j++)
                xr[j] += rr[j];
        }
        T mean = F(row_sum)(xr, C) / (T)C;
        for (Py_ssize_t j = 0; j < C; j++)
            hr[j] = xr[j] - mean;
        T var = F(row_dot)(hr, hr, C) / (T)C + (T)eps;
        T rs = (T)1 / SQRT(var);
        rstd[r] = rs;
        for (Py_ssize_t j = 0; j < C; j++) {
            T h = hr[j] * rs;
            hr[j] = h;
            yr[j] = h * g[j] + b[j];
        }
    }
}

/* dx = rstd (dy g - mean(dy g) - xhat mean(dy g xhat)); dg = sum_rows dy xhat; db = sum_rows dy
 * (dg and db zeroed here first) */
KERNEL void F(layernorm_backward)(const T *restrict dy, const T *restrict xhat, const T *rstd,
                                  const T *restrict g, T *restrict dx, T *restrict dg,
                                  T *restrict db, Py_ssize_t rows, Py_ssize_t C)
{
    for (Py_ssize_t j = 0; j < C; j++)
        dg[j] = db[j] = 0;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const T *dyr = dy + r * C, *hr = xhat + r * C;
        T *dxr = dx + r * C;
        for (Py_ssize_t j = 0; j < C; j++) {
            T t = dyr[j] * hr[j];
            dg[j] += t;
            db[j] += dyr[j];
            dxr[j] = dyr[j] * g[j];  /* dxhat */
        }
        T m1 = F(row_sum)(dxr, C) / (T)C;
        T m2 = F(row_dot)(dxr, hr, C) / (T)C;
        T rs = rstd[r];
        for (Py_ssize_t j = 0; j < C; j++)
            dxr[j] = (dxr[j] - m1 - hr[j] * m2) * rs;
    }
}

/* probs = softmax(logits) per row; nll[r] = log(sum exp(l - max)) - (l[t] - max). Returns the
 * first row whose target is outside [0, V), or -1 */
KERNEL Py_ssize_t F(crossentropy_forward)(const T *logits, const int64_t *targets, T *probs,
                                          T *nll, Py_ssize_t rows, Py_ssize_t V)
{
    for (Py_ssize_t r = 0; r < rows; r++) {
        int64_t t = targets[r];
        if (t < 0 || t >= V)
            return r;
        const T *l = logits + r * V;
        T *p = probs + r * V;
        T m = F(row_max)(l, V);
        for (Py_ssize_t j = 0; j < V; j++)
            p[j] = l[j];
        T s = F(row_exp)(p, V, m);
        for (Py_ssize_t j = 0; j < V; j++)
            p[j] /= s;
        nll[r] = LOG(s) - (l[t] - m);
    }
    return -1;
}

/* dlogits = c (probs - onehot(targets)); targets already checked by the forward */
KERNEL void F(crossentropy_backward)(const T *probs, const int64_t *targets, T *out,
                                     Py_ssize_t rows, Py_ssize_t V, double c)
{
    const T cc = (T)c;
    for (Py_ssize_t r = 0; r < rows; r++) {
        const T *p = probs + r * V;
        T *o = out + r * V;
        for (Py_ssize_t j = 0; j < V; j++)
            o[j] = p[j] * cc;
        o[targets[r]] -= cc;
    }
}

/* rtxmpi.kernels.adamw_step's reference, element by element in its operation order (bit for bit
 * when compiled without contraction); mode 0 no decay, 1 p *= decay, 2 p -= (mask p) lrwd */
KERNEL void F(adamw)(T *p, const T *g, T *m, T *v, const T *mask, Py_ssize_t n, double beta1,
                     double beta2, double decay, double lrwd, double eps_term, double step_size,
                     int mode)
{
    const T b1 = (T)beta1, b2 = (T)beta2, dec = (T)decay, lw = (T)lrwd;
    const T et = (T)eps_term, ss = (T)step_size;
    for (Py_ssize_t i = 0; i < n; i++) {
        T gi = g[i];
        T mi = (m[i] - gi) * b1 + gi;
        T g2 = gi * gi;
        T vi = (v[i] - g2) * b2 + g2;
        T pi = p[i];
        if (mode == 1)
            pi = pi * dec;
        else if (mode == 2)
            pi = pi - mask[i] * pi * lw;
        T upd = mi / (SQRT(vi) + et) * ss;
        m[i] = mi;
        v[i] = vi;
        p[i] = pi - upd;
    }
}

/* g *= scale; returns 1 when any scaled value is inf or NaN */
KERNEL int F(grad_scale)(T *g, Py_ssize_t n, double scale)
{
    const T s = (T)scale;
    NBITS bad = 0;
    for (Py_ssize_t i = 0; i < n; i++) {
        T x = g[i] * s;
        g[i] = x;
        NBITS bits;
        memcpy(&bits, &x, sizeof bits);
        bad |= (NBITS)((bits & EXP_MASK) == EXP_MASK);
    }
    return bad != 0;
}

/* sum of g^2, accumulated in double (rtxmpi.nn.optim.grad_norm_sq) */
KERNEL double F(sum_squares)(const T *g, Py_ssize_t n)
{
    double acc[LANES] = {0};
    Py_ssize_t i = 0;
    for (; i + LANES <= n; i += LANES)
        for (int l = 0; l < LANES; l++)
            acc[l] += (double)g[i + l] * (double)g[i + l];
    double s = 0;
    for (int l = 0; l < LANES; l++)
        s += acc[l];
    for (; i < n; i++)
        s += (double)g[i] * (double)g[i];
    return s;
}
