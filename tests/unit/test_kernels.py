"""rtxmpi.kernels: the numpy references against straightforward formulas and against the layers
and optimizer they stand in for (bit for bit where the docstrings promise it); the cupy kernels
against the references on a GPU (skipped without one)."""
import importlib.util
import math
import os

import numpy as np
import pytest

from rtxmpi import fused, kernels
from rtxmpi.backend import bfloat16
from rtxmpi.nn import layers

RNG = np.random.default_rng(1234)


def _normal(*shape, dtype=np.float32):
    return RNG.standard_normal(shape).astype(dtype)


# ------------------------------------------------------------------------------- epilogue
def test_grad_epilogue_scales_in_place_and_flags_nothing_when_finite():
    g = _normal(1000)
    expected = g * np.float32(0.25)
    out, nonfinite = kernels.grad_epilogue(g, 0.25)
    assert out is g and g.tobytes() == expected.tobytes()
    assert nonfinite.shape == () and not bool(nonfinite)


@pytest.mark.parametrize("bad", [np.inf, -np.inf, np.nan])
def test_grad_epilogue_flags_a_single_non_finite_value(bad):
    g = _normal(4097)
    g[4000] = bad
    _, nonfinite = kernels.grad_epilogue(g, 0.5)
    assert bool(nonfinite)


def test_grad_epilogue_flags_nothing_when_only_the_sum_overflows():
    g = np.full(16, 3e38, np.float32)  # every value finite, their sum is not
    _, nonfinite = kernels.grad_epilogue(g, 1.0)
    assert not bool(nonfinite)


def test_grad_epilogue_float16_cast_rounds_and_flags_overflow():
    g = _normal(999) * 100
    out, nonfinite = kernels.grad_epilogue(g, 0.5, cast="float16")
    assert out.dtype == np.float16 and out.tobytes() == g.astype(np.float16).tobytes()
    assert not bool(nonfinite)
    big = np.array([1.0, 70000.0], np.float32)  # finite in float32, inf in float16
    _, nonfinite = kernels.grad_epilogue(big, 1.0, cast="float16")
    assert bool(nonfinite)


@pytest.mark.skipif(bfloat16 is None, reason="ml_dtypes not installed")
def test_grad_epilogue_bfloat16_cast_is_round_to_nearest_even():
    # 1 + 2^-8 lies exactly between two bfloat16 values: ties go to the even mantissa (1.0);
    # 1 + 3 * 2^-8 ties between 1 + 2^-7 and 1 + 2^-6: even is 1 + 2^-6
    g = np.array([1 + 2 ** -8, 1 + 3 * 2 ** -8, -2.5, 0.0], np.float32)
    out, nonfinite = kernels.grad_epilogue(g, 1.0, cast="bfloat16")
    assert out.dtype == bfloat16 and not bool(nonfinite)
    assert out.astype(np.float32).tolist() == [1.0, 1 + 2 ** -6, -2.5, 0.0]


def test_grad_epilogue_empty_array_and_bad_arguments():
    out, nonfinite = kernels.grad_epilogue(np.zeros(0, np.float32), 0.5)
    assert out.size == 0 and not bool(nonfinite)
    with pytest.raises(ValueError, match="cast"):
        kernels.grad_epilogue(np.zeros(3, np.float32), 1.0, cast="int8")
    with pytest.raises(TypeError, match="floating"):
        kernels.grad_epilogue(np.zeros(3, np.int32), 1.0)


# ---------------------------------------------------------------------------------- AdamW
@pytest.mark.parametrize("masked", [False, True])
def test_adamw_step_matches_the_textbook_update(masked):
    n, lr, b1, b2, eps, wd = 257, 1e-2, 0.9, 0.95, 1e-8, 0.1
    p = _normal(n, dtype=np.float64)
    mask = (RNG.random(n) > 0.5).astype(np.float64) if masked else None
    ref_p, m, v = p.copy(), np.zeros(n), np.zeros(n)
    rm, rv = np.zeros(n), np.zeros(n)
    for t in range(1, 4):
        g = _normal(n, dtype=np.float64)
        kernels.adamw_step(p, g, m, v, lr=lr, beta1=b1, beta2=b2, eps=eps, weight_decay=wd,
                           step=t, decay_mask=mask)
        rm = b1 * rm + (1 - b1) * g
        rv = b2 * rv + (1 - b2) * g * g
        ref_p = ref_p - lr * wd * (mask if masked else 1.0) * ref_p
        ref_p = ref_p - lr * (rm / (1 - b1 ** t)) / (np.sqrt(rv / (1 - b2 ** t)) + eps)
    np.testing.assert_allclose(p, ref_p, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(m, rm, rtol=1e-12)
    np.testing.assert_allclose(v, rv, rtol=1e-12)


def test_adamw_optimizer_is_the_kernel_reference_bit_for_bit():
    from rtxmpi.nn import AdamW
    p = _normal(513)
    mask = (RNG.random(513) > 0.3).astype(np.float32)
    opt = AdamW(p.copy(), lr=3e-3, weight_decay=0.1, decay_mask=mask)
    q, m, v = p.copy(), np.zeros_like(p), np.zeros_like(p)
    for t in range(1, 4):
        g = _normal(513)
        opt.step(g)
        kernels.adamw_step(q, g, m, v, lr=3e-3, beta1=0.9, beta2=0.95, eps=1e-8,
                           weight_decay=0.1, step=t, decay_mask=mask)
    assert opt.params.tobytes() == q.tobytes()
    assert opt.m.tobytes() == m.tobytes() and opt.v.tobytes() == v.tobytes()


# ------------------------------------------------------------------------------ bias+GELU
def test_bias_gelu_forward_equals_the_layer_bit_for_bit_and_the_formula():
    h, b = _normal(4, 6, 32), _normal(32)
    u, y = kernels.bias_gelu_forward(h, b)
    assert u.tobytes() == (h + b).tobytes()
    assert y.tobytes() == layers.gelu_forward(h + b)[0].tobytes()
    x = (h + b).astype(np.float64)
    formula = 0.5 * x * (1 + np.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(y, formula, rtol=1e-5, atol=1e-6)
    assert kernels.GELU_K == layers._GELU_K and kernels.GELU_C == layers._GELU_C


def test_bias_gelu_backward_equals_the_layer_and_finite_differences():
    h, b, dy = _normal(3, 5, 16), _normal(16), _normal(3, 5, 16)
    u, _ = kernels.bias_gelu_forward(h, b)
    du, db = kernels.bias_gelu_backward(dy, u)
    _, cache = layers.gelu_forward(u)
    assert du.tobytes() == layers.gelu_backward(dy, cache).tobytes()
    np.testing.assert_allclose(db, du.reshape(-1, 16).sum(axis=0), rtol=1e-6)
    x, step = u.astype(np.float64), 1e-6
    def gelu(z):
        return 0.5 * z * (1 + np.tanh(math.sqrt(2 / math.pi) * (z + 0.044715 * z ** 3)))
    numeric = (gelu(x + step) - gelu(x - step)) / (2 * step) * dy
    np.testing.assert_allclose(du, numeric, rtol=1e-4, atol=1e-5)


def test_bias_gelu_rejects_a_bias_of_the_wrong_length():
    with pytest.raises(ValueError, match="does not match"):
        kernels.bias_gelu_forward(np.zeros((2, 4), np.float32), np.zeros(3, np.float32))
    with pytest.raises(ValueError, match="same shape"):
        kernels.bias_gelu_backward(np.zeros((2, 4), np.float32), np.zeros((2, 5), np.float32))


# --------------------------------------------------------------------- residual+LayerNorm
def test_residual_layernorm_equals_the_layer_bit_for_bit_and_the_formula():
    x, r, g, b = _normal(2, 7, 48), _normal(2, 7, 48), _normal(48), _normal(48)
    s, y, mean, rstd = kernels.residual_layernorm_forward(x, r, g, b)
    assert s.tobytes() == (x + r).tobytes()
    previous = fused.set_enabled(False)  # the layer's numpy reference (rtxmpi.fused: test_fused)
    try:
        y_layer, (xhat, rstd_layer, _) = layers.layernorm_forward(x + r, g, b)
    finally:
        fused.set_enabled(previous)
    assert y.tobytes() == y_layer.tobytes()
    assert rstd.shape == (2, 7) and rstd.tobytes() == rstd_layer[..., 0].tobytes()
    s64 = s.astype(np.float64)
    var = s64.var(axis=-1)
    np.testing.assert_allclose(mean, s64.mean(axis=-1), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rstd, 1 / np.sqrt(var + kernels.LN_EPS), rtol=1e-5)
    ref = (s64 - s64.mean(axis=-1, keepdims=True)) / np.sqrt(var[..., None] + 1e-5) * g + b
    np.testing.assert_allclose(y, ref, rtol=1e-4, atol=1e-5)


def test_residual_layernorm_rejects_mismatched_shapes():
    with pytest.raises(ValueError, match="same shape"):
        kernels.residual_layernorm_forward(np.zeros((2, 4)), np.zeros((2, 5)), np.ones(4),
                                           np.zeros(4))
    with pytest.raises(ValueError, match="does not match"):
        kernels.residual_layernorm_forward(np.zeros((2, 4)), np.zeros((2, 4)), np.ones(5),
                                           np.zeros(4))


# -------------------------------------------------------------------- on a GPU (skipped)
def _cupy_with_gpu():
    cp = pytest.importorskip("cupy")
    if not kernels.gpu_available():
        pytest.skip("no CUDA device")
    return cp


@pytest.mark.gpu
def test_gpu_kernels_match_the_numpy_references():
    """Each kernel on fresh random data, outputs poisoned with NaN first, against its reference:
    bit for bit where promised (epilogue, AdamW), within float32 rounding elsewhere."""
    cp = _cupy_with_gpu()
    spec = importlib.util.spec_from_file_location("gpu_check", os.path.join(
        os.path.dirname(__file__), "..", "..", "bench", "gpu_check.py"))
    gpu_check = importlib.util.module_from_spec(spec)  # the same checks bench/gpu_check.py runs
    spec.loader.exec_module(gpu_check)
    failures = gpu_check.check_all_kernels(cp, seed=int(RNG.integers(1 << 30)))
    assert not failures, "\n".join(failures)


def test_host_buffers_fall_back_to_pageable_memory_without_a_gpu():
    from rtxmpi.backend import copy_to_host, host_empty
    buf = host_empty((2, 3), np.float32, pinned=True)
    assert isinstance(buf, np.ndarray) and buf.shape == (2, 3) and buf.dtype == np.float32
    copy_to_host(np.arange(6, dtype=np.float64).reshape(2, 3), buf)
    assert buf.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert host_empty(4, np.int64).shape == (4,)
