"""rtxmpi.fused (the CPU kernels of rtxmpi/_fused.c) against the numpy references they replace.

Each operation runs twice through its public caller (rtxmpi.nn.layers, rtxmpi.kernels): fused, with
every array the kernels allocate filled with NaN first (an element not written shows), then with
the fused path off (the numpy reference). A spy on the extension checks the fused run used it.
Tolerances: float32 rtol 2e-5 (atol 2e-6 of the largest magnitude), float64 rtol 1e-12 (atol 1e-13);
AdamW and the gradient scale bit for bit.
"""
import contextlib

import numpy as np
import pytest

from rtxmpi import fused, kernels
from rtxmpi.errors import ConfigError
from rtxmpi.nn import grad_norm_sq, layers

built = pytest.mark.skipif(not fused.available(), reason="rtxmpi._fused was not built")

DTYPES = (np.float32, np.float64)
TOL = {np.float32: (2e-5, 2e-6), np.float64: (1e-12, 1e-13)}
# (rows..., last dim): odd sizes, a last dim below and above the 8 lanes, a single row
SHAPES = ((3, 5, 7), (1, 1), (2, 33), (4, 8, 64), (1, 130))


def test_the_extension_is_built():
    assert fused.available(), ("rtxmpi._fused was not built (a C compiler and Python's headers are "
                               "needed; pip install -e . rebuilds it): the layers run the numpy "
                               "references")


def test_without_the_extension_the_layers_run_the_reference(monkeypatch):
    monkeypatch.setattr(fused, "_ext", None)
    assert not fused.enabled() and not fused.usable(np.zeros(3))
    assert "not built" in fused.describe()
    h, b = np.ones((2, 3)), np.ones(3)
    y, cache = layers.bias_gelu_forward(h, b)
    assert cache[1] is not None  # the reference's cache (x, gate)
    assert layers.bias_gelu_backward(np.ones((2, 3)), cache)[1].shape == (3,)


class _Spy:
    """Stands in for the extension and records the functions called through it."""

    def __init__(self, ext):
        self.ext, self.called = ext, []

    def __getattr__(self, name):
        self.called.append(name)
        return getattr(self.ext, name)


@pytest.fixture
def spy(monkeypatch):
    """The extension spied on, and every array rtxmpi.fused allocates pre-filled with NaN."""
    if not fused.available():
        pytest.skip("rtxmpi._fused was not built (test_the_extension_is_built fails)")
    s = _Spy(fused._ext)
    monkeypatch.setattr(fused, "_ext", s)
    monkeypatch.setattr(fused, "_empty", lambda shape, dtype: np.full(shape, np.nan, dtype))
    previous = fused.set_enabled(True)
    yield s
    fused.set_enabled(previous)


@contextlib.contextmanager
def reference():
    previous = fused.set_enabled(False)
    try:
        yield
    finally:
        fused.set_enabled(previous)


def both(fn, *args):
    """fn(*copies of args) fused, then with the fused path off: (fused result, reference result)."""
    got = fn(*[np.copy(a) if isinstance(a, np.ndarray) else a for a in args])
    with reference():
        want = fn(*[np.copy(a) if isinstance(a, np.ndarray) else a for a in args])
    return got, want


def close(got, want, dtype):
    rtol, atol = TOL[dtype]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        g, w = np.asarray(g), np.asarray(w)
        assert g.dtype == w.dtype and g.shape == w.shape
        scale = max(1.0, float(np.abs(w).max())) if w.size else 1.0
        np.testing.assert_allclose(g, w, rtol=rtol, atol=atol * scale)


def rand(rng, shape, dtype, scale=1.0):
    return (rng.standard_normal(shape) * scale).astype(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_bias_gelu_matches_reference(spy, dtype, shape):
    rng = np.random.default_rng(1)
    h, b, dy = rand(rng, shape, dtype, 3.0), rand(rng, shape[-1:], dtype), rand(rng, shape, dtype)

    def run(h, b, dy):
        y, cache = layers.bias_gelu_forward(h, b)
        dh, db = layers.bias_gelu_backward(dy, cache, db_out=np.ones(b.shape, dtype))
        return y, h, dh, db

    close(*both(run, h, b, dy), dtype)
    assert spy.called == ["bias_gelu_forward", "bias_gelu_backward"]


def test_bias_gelu_saturates_like_the_reference(spy):
    h = np.array([[-60.0, -12.0, -1e-3, 0.0, 1e-3, 12.0, 60.0]], np.float32)
    (y, *_), (y_ref, *_) = both(lambda h: layers.bias_gelu_forward(h, np.zeros(7, np.float32)), h)
    np.testing.assert_allclose(y, y_ref, rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (True, False))
@pytest.mark.parametrize("T", (1, 7, 9, 40))
def test_softmax_matches_reference(spy, dtype, causal, T):
    rng = np.random.default_rng(2)
    att, datt = rand(rng, (2, 3, T, T), dtype, 4.0), rand(rng, (2, 3, T, T), dtype)

    def run(att, datt):
        p = layers.masked_softmax_forward(att, causal)
        return p.copy(), layers.softmax_backward(datt, p)

    got, want = both(run, att, datt)
    close(got, want, dtype)
    if causal:  # the masked keys are exactly zero, as exp(-inf)
        assert not np.triu(got[0][0, 0], 1).any()
    assert spy.called == ["softmax_forward", "softmax_backward"]


def test_softmax_of_a_nan_row_is_nan_as_the_reference(spy):
    att = np.zeros((1, 1, 3, 3), np.float32)
    att[0, 0, 2, 1] = np.nan
    got, want = both(lambda a: layers.masked_softmax_forward(a, True), att)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_layernorm_matches_reference(spy, dtype, shape):
    rng = np.random.default_rng(3)
    C = shape[-1]
    x, dy = rand(rng, shape, dtype, 2.0) + dtype(0.5), rand(rng, shape, dtype)
    g, b = rand(rng, (C,), dtype) + dtype(1), rand(rng, (C,), dtype)

    def run(x, dy):
        y, cache = layers.layernorm_forward(x, g, b)
        dx, dg, db = layers.layernorm_backward(dy, cache, np.ones(C, dtype), np.ones(C, dtype))
        return y, cache[0], cache[1], dx, dg, db

    close(*both(run, x, dy), dtype)
    assert spy.called == ["layernorm_forward", "layernorm_backward"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_residual_layernorm_matches_reference(spy, dtype, shape):
    rng = np.random.default_rng(4)
    C = shape[-1]
    a, x = rand(rng, shape, dtype), rand(rng, shape, dtype)
    g, b = rand(rng, (C,), dtype), rand(rng, (C,), dtype)

    def run(a, x):
        x1, h, (xhat, rstd, _) = layers.residual_layernorm_forward(a, x, g, b)
        assert x1 is a  # the residual stream is updated in place on numpy, as documented
        return x1, h, xhat, rstd

    close(*both(run, a, x), dtype)
    assert spy.called == ["layernorm_forward"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", ((2, 5, 11), (3, 1), (4, 257)))
def test_crossentropy_matches_reference(spy, dtype, shape):
    rng = np.random.default_rng(5)
    logits = rand(rng, shape, dtype, 5.0)
    targets = rng.integers(0, shape[-1], shape[:-1]).astype(np.int32)

    def run(logits):
        loss, cache = layers.crossentropy_forward(logits, targets)
        return loss, cache[0], layers.crossentropy_backward(0.25, cache)

    close(*both(run, logits), dtype)
    assert spy.called == ["crossentropy_forward", "crossentropy_backward"]


@pytest.mark.parametrize("bad", (-1, 11))
def test_crossentropy_target_outside_vocabulary_raises(spy, bad):
    logits = np.zeros((2, 3, 11), np.float32)
    targets = np.zeros((2, 3), np.int64)
    targets[1, 2] = bad
    with pytest.raises(IndexError, match="position 5"):
        layers.crossentropy_forward(logits, targets)
    probs = np.zeros((6, 11), np.float32)
    with pytest.raises(IndexError):
        layers.crossentropy_backward(1.0, (probs, targets.reshape(-1), (2, 3, 11)))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("masked", (False, True))
@pytest.mark.parametrize("n", (1, 13, 1000))
def test_adamw_is_bit_for_bit_the_reference(spy, dtype, masked, n):
    rng = np.random.default_rng(6)
    p, g = rand(rng, n, dtype), rand(rng, n, dtype)
    m, v = rand(rng, n, dtype, 0.1), np.abs(rand(rng, n, dtype, 0.1))
    mask = (rng.random(n) < 0.5).astype(dtype) if masked else None

    def run(p, g, m, v):
        kernels.adamw_step(p, g, m, v, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                           weight_decay=0.1, step=7, decay_mask=mask)
        return p, m, v

    got, want = both(run, p, g, m, v)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    assert spy.called == ["adamw"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("poison", (None, np.inf, -np.inf, np.nan, "overflow"))
def test_grad_epilogue_scale_and_flag_match_reference(spy, dtype, poison):
    rng = np.random.default_rng(7)
    grad = rand(rng, (5, 37), dtype)
    scale = 0.5
    if poison == "overflow":  # finite before, infinite after the scale
        grad[3, 4], scale = np.finfo(dtype).max, 4.0
    elif poison is not None:
        grad[4, 36] = poison
    with np.errstate(over="ignore"):  # the reference's overflow is what the flag reports
        got, want = both(lambda g: kernels.grad_epilogue(g, scale), grad)
    np.testing.assert_array_equal(got[0], want[0])
    assert bool(got[1]) == bool(want[1]) == (poison is not None)
    assert spy.called == ["grad_scale"]


def test_strided_or_mixed_dtype_arrays_run_the_reference(spy):
    x = np.ones((4, 6), np.float32)[:, ::2]  # not contiguous
    layers.layernorm_forward(x, np.ones(3, np.float32), np.zeros(3, np.float32))
    layers.masked_softmax_forward(np.zeros((3, 3), np.float16), False)
    layers.bias_gelu_forward(np.ones((2, 3), np.float32), np.ones(3, np.float64))
    assert spy.called == []


def test_turned_off_runs_the_reference(spy):
    with reference():
        assert not fused.usable(np.zeros(3))
        layers.bias_gelu_forward(np.ones((2, 3)), np.ones(3))
    assert spy.called == []
    assert fused.usable(np.zeros(3))


@built
@pytest.mark.parametrize("value, on", (("0", False), ("1", True), (" 1 ", True), ("off", False), ("", True)))
def test_environment_variable_turns_the_path_off(monkeypatch, value, on):
    monkeypatch.setenv("RTXMPI_FUSED", value)
    monkeypatch.setattr(fused, "_enabled", None)
    assert fused.enabled() is on
    assert ("fused (" in fused.describe()) is on


def test_bad_environment_variable_raises_config_error(monkeypatch):
    monkeypatch.setenv("RTXMPI_FUSED", "2")
    monkeypatch.setattr(fused, "_enabled", None)
    with pytest.raises(ConfigError, match="RTXMPI_FUSED='2': use 1"):
        fused.usable(np.zeros(3))


@built
def test_read_only_residual_stream_is_refused():
    x = np.zeros((2, 4), np.float32)
    x.flags.writeable = False
    ones = np.ones(4, np.float32)
    with pytest.raises(ValueError, match="writable"):
        fused.layernorm_forward(x, ones, ones, 1e-5, residual=np.ones((2, 4), np.float32))
    assert not x.any()


@built
def test_short_buffer_raises_instead_of_reading_past_it():
    with pytest.raises(ValueError, match="buffer 1"):
        fused._ext.bias_gelu_forward(np.zeros(6, np.float32), np.zeros(2, np.float32),
                                     np.zeros(6, np.float32), 2, 3, False)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("causal", (True, False))
def test_block_forward_and_backward_match_reference(spy, dtype, causal):
    rng = np.random.default_rng(8)
    B, T, C, H = 2, 5, 16, 4
    params = [(rng.standard_normal(s) * 0.3).astype(dtype) + (1 if name.endswith(".g") else 0)
              for name, s, _ in layers.block_param_shapes(C)]
    x, dy = rand(rng, (B, T, C), dtype), rand(rng, (B, T, C), dtype)

    def run(x, dy):
        y, cache = layers.block_forward(x, params, H, causal)
        dx, grads = layers.block_backward(dy, cache)
        return (y, dx) + tuple(grads)

    close(*both(run, x, dy), dtype)
    assert {"bias_gelu_forward", "softmax_forward", "layernorm_forward"} <= set(spy.called)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", (1, 7, 1001))
def test_grad_norm_sq_matches_reference(spy, dtype, n):
    grad = rand(np.random.default_rng(9), (n,), dtype)
    got, want = both(grad_norm_sq, grad)
    assert got == pytest.approx(want, rel=1e-13)
    assert spy.called == ["sum_squares"]
