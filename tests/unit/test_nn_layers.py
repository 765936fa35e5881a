"""Layer forward/backward pairs: float64 finite-difference gradient checks, accumulation into
given gradient arrays, dtype preservation, causal and bidirectional attention, patches, pooling,
numerical stability."""
import numpy as np
import pytest

from rtxmpi.nn import layers as L

B, T, C, H, V = 2, 5, 8, 2, 7
FD_EPS = 1e-6
TOL = 1e-6  # relative error of the checked elements, float64


def numeric_grad(f, x, dout, rng, max_elems=24):
    """Central finite differences of sum(f() * dout) w.r.t. a random subset of x's elements.
    Returns (indices, numeric values)."""
    n = min(x.size, max_elems)
    picks = rng.choice(x.size, size=n, replace=False)
    num = np.empty(n)
    for k, j in enumerate(picks):
        old = x.flat[j]
        x.flat[j] = old + FD_EPS
        plus = np.sum(f() * dout)
        x.flat[j] = old - FD_EPS
        minus = np.sum(f() * dout)
        x.flat[j] = old
        num[k] = (plus - minus) / (2 * FD_EPS)
    return picks, num


def assert_grads_match(f, inputs, analytic, dout, rng):
    """Compare analytic gradients with finite differences, input by input."""
    for i, (x, grad) in enumerate(zip(inputs, analytic)):
        picks, num = numeric_grad(f, x, dout, rng)
        ana = grad.reshape(-1)[picks]
        err = np.linalg.norm(ana - num) / max(np.linalg.norm(ana) + np.linalg.norm(num), 1e-12)
        assert err < TOL, f"input {i}: relative error {err:.2e}"


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


def randn(rng, *shape, scale=1.0):
    return rng.standard_normal(shape) * scale


def block_params(rng, dtype=np.float64):
    return [(randn(rng, *shape, scale=0.5) + (1.0 if name.endswith(".g") else 0.0)).astype(dtype)
            for name, shape, _ in L.block_param_shapes(C)]


# ------------------------------------------------------------------------- gradient checks
def test_linear_gradients_match_finite_differences(rng):
    x, w, b = randn(rng, B, T, C), randn(rng, C, 6), randn(rng, 6)
    y, cache = L.linear_forward(x, w, b)
    dy = randn(rng, *y.shape)
    dx, dw, db = L.linear_backward(dy, cache)
    assert_grads_match(lambda: L.linear_forward(x, w, b)[0], [x, w, b], [dx, dw, db], dy, rng)


def test_linear_without_bias_returns_no_bias_gradient(rng):
    x, w = randn(rng, B, T, C), randn(rng, C, 6)
    y, cache = L.linear_forward(x, w)
    dy = randn(rng, *y.shape)
    dx, dw, db = L.linear_backward(dy, cache)
    assert db is None
    assert_grads_match(lambda: L.linear_forward(x, w)[0], [x, w], [dx, dw], dy, rng)


def test_embedding_gradients_match_finite_differences(rng):
    idx = np.array([[0, 3, 3, 6, 1], [3, 0, 2, 2, 5]])  # repeated ids must accumulate
    wte, wpe = randn(rng, V, C), randn(rng, T + 3, C)
    x, cache = L.embedding_forward(idx, wte, wpe)
    dx = randn(rng, *x.shape)
    dwte, dwpe = L.embedding_backward(dx, cache)
    assert np.all(dwpe[T:] == 0)
    assert_grads_match(lambda: L.embedding_forward(idx, wte, wpe)[0], [wte, wpe], [dwte, dwpe],
                       dx, rng)


def test_layernorm_gradients_match_finite_differences(rng):
    x, g, b = randn(rng, B, T, C, scale=3.0) + 1.0, randn(rng, C), randn(rng, C)
    y, cache = L.layernorm_forward(x, g, b)
    dy = randn(rng, *y.shape)
    dx, dg, db = L.layernorm_backward(dy, cache)
    assert_grads_match(lambda: L.layernorm_forward(x, g, b)[0], [x, g, b], [dx, dg, db], dy, rng)


def test_layernorm_output_is_normalized(rng):
    x = randn(rng, B, T, C, scale=5.0) + 3.0
    y, _ = L.layernorm_forward(x, np.ones(C), np.zeros(C))
    np.testing.assert_allclose(y.mean(-1), 0, atol=1e-12)
    np.testing.assert_allclose(y.var(-1), 1, rtol=1e-4)


def test_gelu_gradients_match_finite_differences(rng):
    x = randn(rng, B, T, C, scale=2.0)
    y, cache = L.gelu_forward(x)
    dy = randn(rng, *y.shape)
    dx = L.gelu_backward(dy, cache)
    assert_grads_match(lambda: L.gelu_forward(x)[0], [x], [dx], dy, rng)


def test_gelu_matches_tanh_formula():
    x = np.linspace(-6, 6, 101)
    expected = 0.5 * x * (1 + np.tanh(np.sqrt(2 / np.pi) * (x + 0.044715 * x ** 3)))
    np.testing.assert_allclose(L.gelu_forward(x)[0], expected, rtol=1e-13, atol=1e-15)


def test_attention_gradients_match_finite_differences(rng):
    x = randn(rng, B, T, C)
    params = [randn(rng, C, 3 * C, scale=0.5), randn(rng, 3 * C, scale=0.5),
              randn(rng, C, C, scale=0.5), randn(rng, C, scale=0.5)]
    y, cache = L.attention_forward(x, *params, H)
    dy = randn(rng, *y.shape)
    dx, grads = L.attention_backward(dy, cache)
    assert_grads_match(lambda: L.attention_forward(x, *params, H)[0], [x] + params,
                       [dx, *grads], dy, rng)


def test_attention_is_causal(rng):
    x = randn(rng, B, T, C)
    params = [randn(rng, C, 3 * C), randn(rng, 3 * C), randn(rng, C, C), randn(rng, C)]
    y, _ = L.attention_forward(x, *params, H)
    x2 = x.copy()
    x2[:, 3:] += 10.0  # change only positions >= 3
    y2, _ = L.attention_forward(x2, *params, H)
    np.testing.assert_array_equal(y[:, :3], y2[:, :3])
    assert not np.allclose(y[:, 3:], y2[:, 3:])


def test_bidirectional_attention_gradients_match_finite_differences(rng):
    x = randn(rng, B, T, C)
    params = [randn(rng, C, 3 * C, scale=0.5), randn(rng, 3 * C, scale=0.5),
              randn(rng, C, C, scale=0.5), randn(rng, C, scale=0.5)]
    y, cache = L.attention_forward(x, *params, H, causal=False)
    dy = randn(rng, *y.shape)
    dx, grads = L.attention_backward(dy, cache)
    assert_grads_match(lambda: L.attention_forward(x, *params, H, causal=False)[0], [x] + params,
                       [dx, *grads], dy, rng)


def test_bidirectional_attention_sees_every_position(rng):
    x = randn(rng, B, T, C)
    params = [randn(rng, C, 3 * C), randn(rng, 3 * C), randn(rng, C, C), randn(rng, C)]
    y, _ = L.attention_forward(x, *params, H, causal=False)
    x2 = x.copy()
    x2[:, -1] += 10.0  # change only the last position
    y2, _ = L.attention_forward(x2, *params, H, causal=False)
    assert not np.allclose(y[:, 0], y2[:, 0])
    causal, _ = L.attention_forward(x, *params, H)
    np.testing.assert_array_equal(y[:, -1], causal[:, -1])  # the last row sees all in both


def test_attention_matches_per_head_reference(rng):
    x = randn(rng, B, T, C)
    w_qkv, b_qkv, w_proj, b_proj = (randn(rng, C, 3 * C), randn(rng, 3 * C), randn(rng, C, C),
                                    randn(rng, C))
    y, _ = L.attention_forward(x, w_qkv, b_qkv, w_proj, b_proj, H)
    hs = C // H
    qkv = x @ w_qkv + b_qkv
    heads = []
    for h in range(H):
        q = qkv[..., h * hs:(h + 1) * hs]
        k = qkv[..., C + h * hs:C + (h + 1) * hs]
        v = qkv[..., 2 * C + h * hs:2 * C + (h + 1) * hs]
        s = q @ k.transpose(0, 2, 1) / np.sqrt(hs)
        s = np.where(np.tril(np.ones((T, T), bool)), s, -np.inf)
        p = np.exp(s - s.max(-1, keepdims=True))
        heads.append((p / p.sum(-1, keepdims=True)) @ v)
    expected = np.concatenate(heads, axis=-1) @ w_proj + b_proj
    np.testing.assert_allclose(y, expected, rtol=1e-10, atol=1e-12)


def test_mlp_gradients_match_finite_differences(rng):
    x = randn(rng, B, T, C)
    params = [randn(rng, C, 4 * C, scale=0.5), randn(rng, 4 * C, scale=0.5),
              randn(rng, 4 * C, C, scale=0.5), randn(rng, C, scale=0.5)]
    y, cache = L.mlp_forward(x, *params)
    dy = randn(rng, *y.shape)
    dx, grads = L.mlp_backward(dy, cache)
    assert_grads_match(lambda: L.mlp_forward(x, *params)[0], [x] + params, [dx, *grads], dy, rng)


def test_block_gradients_match_finite_differences(rng):
    x = randn(rng, B, T, C)
    params = block_params(rng)
    y, cache = L.block_forward(x, params, H)
    dy = randn(rng, *y.shape)
    dx, grads = L.block_backward(dy, cache)
    assert len(grads) == len(L.BLOCK_PARAM_NAMES) == 12
    assert_grads_match(lambda: L.block_forward(x, params, H)[0], [x] + params, [dx, *grads], dy,
                       rng)


def test_crossentropy_gradient_matches_finite_differences(rng):
    logits = randn(rng, B, T, V, scale=3.0)
    targets = rng.integers(0, V, (B, T))
    loss, cache = L.crossentropy_forward(logits, targets)
    dlogits = L.crossentropy_backward(0.7, cache)
    assert_grads_match(lambda: L.crossentropy_forward(logits, targets)[0], [logits], [dlogits],
                       0.7, rng)


def test_crossentropy_is_mean_nll_over_all_positions(rng):
    logits = randn(rng, B, T, V)
    targets = rng.integers(0, V, (B, T))
    loss, _ = L.crossentropy_forward(logits, targets)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    expected = -np.take_along_axis(logp, targets[..., None], -1).mean()
    assert float(loss) == pytest.approx(expected, rel=1e-12)


def test_crossentropy_is_stable_for_huge_logits(rng):
    logits = randn(rng, B, T, V).astype(np.float32) * 1e4
    targets = rng.integers(0, V, (B, T))
    loss, cache = L.crossentropy_forward(logits, targets)
    assert np.isfinite(float(loss))
    assert np.all(np.isfinite(L.crossentropy_backward(1.0, cache)))


def test_softmax_is_stable_and_normalized(rng):
    x = randn(rng, 3, 9).astype(np.float32) * 1e4
    p = L.softmax_forward(x)
    assert np.all(np.isfinite(p))
    np.testing.assert_allclose(p.sum(-1), 1, rtol=1e-6)


# ------------------------------------------------------------------------- accumulation
def test_linear_backward_adds_into_given_arrays(rng):
    x, w, b = randn(rng, B, T, C), randn(rng, C, 6), randn(rng, 6)
    dy = randn(rng, B, T, 6)
    _, cache = L.linear_forward(x, w, b)
    _, dw, db = L.linear_backward(dy, cache)
    dw_out, db_out = np.full_like(w, 2.0), np.full_like(b, -1.0)
    _, dw2, db2 = L.linear_backward(dy, cache, dw_out, db_out)
    assert dw2 is dw_out and db2 is db_out
    np.testing.assert_allclose(dw_out, dw + 2.0, rtol=1e-14)
    np.testing.assert_allclose(db_out, db - 1.0, rtol=1e-14)


def test_block_backward_twice_accumulates_twice_and_keeps_cache(rng):
    x = randn(rng, B, T, C)
    params = block_params(rng)
    y, cache = L.block_forward(x, params, H)
    dy = randn(rng, *y.shape)
    dy_before = dy.copy()
    dx1, once = L.block_backward(dy, cache)
    out = [np.zeros_like(p) for p in params]
    L.block_backward(dy, cache, out)
    dx2, returned = L.block_backward(dy, cache, out)
    np.testing.assert_array_equal(dx1, dx2)
    np.testing.assert_array_equal(dy, dy_before)
    for g1, acc, ret in zip(once, out, returned):
        assert ret is acc
        np.testing.assert_allclose(acc, 2 * g1, rtol=1e-12, atol=1e-15)


def test_embedding_backward_adds_into_given_arrays(rng):
    idx = rng.integers(0, V, (B, T))
    wte, wpe = randn(rng, V, C), randn(rng, T, C)
    x, cache = L.embedding_forward(idx, wte, wpe)
    dx = randn(rng, *x.shape)
    dwte, dwpe = L.embedding_backward(dx, cache)
    dwte_out, dwpe_out = np.ones_like(wte), np.ones_like(wpe)
    L.embedding_backward(dx, cache, dwte_out, dwpe_out)
    np.testing.assert_allclose(dwte_out, dwte + 1, rtol=1e-14)
    np.testing.assert_allclose(dwpe_out, dwpe + 1, rtol=1e-14)


def test_token_and_position_embeddings_compose_to_the_embedding(rng):
    idx = rng.integers(0, V, (B, T))
    wte, wpe = randn(rng, V, C), randn(rng, T + 2, C)
    x, cache = L.embedding_forward(idx, wte, wpe)
    tok, tok_cache = L.token_embedding_forward(idx, wte)
    y, pos_cache = L.position_embedding_forward(tok, wpe)
    np.testing.assert_array_equal(y, x)
    dx = randn(rng, *x.shape)
    dwte, dwpe = L.embedding_backward(dx, cache)
    dtok, dwpe2 = L.position_embedding_backward(dx, pos_cache)
    assert dtok is dx and not dwpe2[T:].any()
    np.testing.assert_array_equal(dwpe2, dwpe)
    np.testing.assert_array_equal(L.token_embedding_backward(dtok, tok_cache), dwte)


def test_patchify_orders_patches_row_major_and_unpatchify_inverts_it(rng):
    images = randn(rng, B, 4, 6, 3)  # a 2 x 3 grid of 2 x 2 patches
    patches = L.patchify(images, 2)
    assert patches.shape == (B, 6, 2 * 2 * 3)
    np.testing.assert_array_equal(patches[:, 4], images[:, 2:4, 2:4, :].reshape(B, -1))
    np.testing.assert_array_equal(L.unpatchify(patches, images.shape, 2), images)


def test_patch_embedding_gradients_match_finite_differences(rng):
    images, w, b = randn(rng, B, 4, 4, 2), randn(rng, 2 * 2 * 2, C), randn(rng, C)
    y, cache = L.patch_embedding_forward(images, w, b, 2)
    assert y.shape == (B, 4, C)
    dy = randn(rng, *y.shape)
    dimages, dw, db = L.patch_embedding_backward(dy, cache)
    assert_grads_match(lambda: L.patch_embedding_forward(images, w, b, 2)[0], [images, w, b],
                       [dimages, dw, db], dy, rng)


def test_mean_pool_gradient_matches_finite_differences(rng):
    x = randn(rng, B, T, C)
    y, cache = L.mean_pool_forward(x)
    np.testing.assert_allclose(y, x.mean(axis=1), rtol=1e-15)
    dy = randn(rng, *y.shape)
    assert_grads_match(lambda: L.mean_pool_forward(x)[0], [x], [L.mean_pool_backward(dy, cache)],
                       dy, rng)


def test_crossentropy_takes_one_label_per_sample(rng):
    logits, labels = randn(rng, B, V), rng.integers(0, V, B)
    loss, cache = L.crossentropy_forward(logits, labels)
    p = np.exp(logits - logits.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    assert float(loss) == pytest.approx(-np.log(p[np.arange(B), labels]).mean(), rel=1e-12)
    assert L.crossentropy_backward(1.0, cache).shape == (B, V)


def test_block_backward_reports_each_parameter_ready_once_in_reverse(rng):
    x = randn(rng, B, T, C)
    y, cache = L.block_forward(x, block_params(rng), H)
    calls = []
    L.block_backward(randn(rng, *y.shape), cache, ready=calls.append)
    assert calls == list(range(11, -1, -1))


# ------------------------------------------------------------------------- dtypes
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_block_keeps_the_input_dtype(rng, dtype):
    x = randn(rng, B, T, C).astype(dtype)
    y, cache = L.block_forward(x, block_params(rng, dtype), H)
    dx, grads = L.block_backward(y, cache)
    assert y.dtype == dtype and dx.dtype == dtype
    assert all(g.dtype == dtype for g in grads)


def test_float32_block_matches_float64(rng):
    x = randn(rng, B, T, C)
    params = block_params(rng)
    y64, _ = L.block_forward(x, params, H)
    y32, _ = L.block_forward(x.astype(np.float32), [p.astype(np.float32) for p in params], H)
    np.testing.assert_allclose(y32, y64, rtol=1e-4, atol=1e-4)
