"""GPT on flat buffers: whole-model gradient check, accumulation, grad_ready order, layout,
initialization, dtype agreement, generation, errors, a short overfit run, and the parameter-provider
hooks (units, fetch/release/grads/grads_ready order, transient providers)."""
import math

import numpy as np
import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.nn import (GPT, MODEL_SIZES, AdamW, GPTConfig, clip_grad_norm, decay_mask,
                       param_layout)


def micro_cfg(tie=True):
    return GPTConfig(vocab_size=13, seq_len=6, n_layer=2, n_head=2, n_embd=8, tie_embeddings=tie)


def batch(rng, cfg, B=2, T=5):
    return (rng.integers(0, cfg.vocab_size, (B, T)), rng.integers(0, cfg.vocab_size, (B, T)))


@pytest.fixture
def rng():
    return np.random.default_rng(7)


# ------------------------------------------------------------------------- gradients
@pytest.mark.parametrize("tie", [True, False])
def test_gpt_gradient_matches_finite_differences(rng, tie):
    cfg = micro_cfg(tie)
    model = GPT(cfg, seed=0, dtype=np.float64)
    # move away from the near-linear init so every nonlinearity is exercised
    model.load_flat(model.flat_data + rng.normal(0, 0.3, model.num_params))
    idx, targets = batch(rng, cfg)
    _, cache = model.forward(idx, targets)
    model.backward(cache)
    picks = np.concatenate([p.offset + rng.choice(p.size, min(p.size, 3), replace=False)
                            for p in model.params])  # a few elements of every parameter
    numeric = np.empty(len(picks))
    for k, j in enumerate(picks):
        old = model.flat_data[j]
        model.flat_data[j] = old + 1e-6
        plus = model.forward(idx, targets)[0]
        model.flat_data[j] = old - 1e-6
        minus = model.forward(idx, targets)[0]
        model.flat_data[j] = old
        numeric[k] = (plus - minus) / 2e-6
    analytic = model.flat_grad[picks]
    err = np.linalg.norm(analytic - numeric) / np.linalg.norm(numeric)
    assert err < 1e-6, f"relative error {err:.2e}"


def test_backward_twice_adds_twice(rng):
    cfg = micro_cfg()
    model = GPT(cfg, seed=0, dtype=np.float64)
    _, cache = model.forward(*batch(rng, cfg))
    model.backward(cache)
    once = model.flat_grad.copy()
    model.backward(cache)
    np.testing.assert_allclose(model.flat_grad, 2 * once, rtol=1e-12, atol=1e-16)


def test_backward_scale_scales_the_gradient(rng):
    cfg = micro_cfg(tie=False)
    model = GPT(cfg, seed=0, dtype=np.float64)
    _, cache = model.forward(*batch(rng, cfg))
    model.backward(cache)
    full = model.flat_grad.copy()
    model.zero_grad()
    assert not model.flat_grad.any()
    model.backward(cache, scale=0.25)
    np.testing.assert_allclose(model.flat_grad, 0.25 * full, rtol=1e-12, atol=1e-16)


def test_micro_batches_accumulate_to_the_full_batch_gradient(rng):
    cfg = micro_cfg()
    model = GPT(cfg, seed=0, dtype=np.float64)
    idx, targets = batch(rng, cfg, B=4)
    _, cache = model.forward(idx, targets)
    model.backward(cache)
    full = model.flat_grad.copy()
    model.zero_grad()
    for half in (slice(0, 2), slice(2, 4)):
        _, cache = model.forward(idx[half], targets[half])
        model.backward(cache, scale=0.5)
    np.testing.assert_allclose(model.flat_grad, full, rtol=1e-10, atol=1e-14)


@pytest.mark.parametrize("tie", [True, False])
def test_grad_ready_fires_once_per_param_when_final(rng, tie):
    cfg = micro_cfg(tie)
    model = GPT(cfg, seed=0, dtype=np.float64)
    _, cache = model.forward(*batch(rng, cfg))
    calls, snapshots = [], {}

    def ready(i):
        calls.append(i)
        snapshots[i] = model.params[i].grad.copy()

    model.backward(cache, grad_ready=ready)
    n = len(model.params)
    assert sorted(calls) == list(range(n))
    assert calls[-1] == 0  # wte last (tied: only after the embedding backward)
    for i, snap in snapshots.items():  # nothing changed after it was reported
        np.testing.assert_array_equal(snap, model.params[i].grad)
    first_block1 = [p.index for p in model.params if p.name.startswith("h1.")]
    first_block0 = [p.index for p in model.params if p.name.startswith("h0.")]
    assert max(calls.index(i) for i in first_block1) < min(calls.index(i) for i in first_block0)


# ------------------------------------------------------------------------- layout
@pytest.mark.parametrize("tie", [True, False])
def test_params_are_contiguous_views_in_index_order(tie):
    cfg = GPTConfig.named("tiny", tie_embeddings=tie)
    model = GPT(cfg, seed=0)
    offset = 0
    for i, p in enumerate(model.params):
        assert p.index == i and p.offset == offset and p.size == math.prod(p.shape)
        assert np.shares_memory(p.data, model.flat_data) and np.shares_memory(p.grad,
                                                                              model.flat_grad)
        offset += p.size
    assert offset == model.num_params == model.flat_data.size == model.flat_grad.size
    names = [p.name for p in model.params]
    assert names[:3] == ["wte", "wpe", "h0.ln1.g"]
    assert names[-1] == ("ln_f.b" if tie else "lm_head")
    assert [s.name for s in param_layout(cfg)] == names
    model.params[2].data[0] = 42.0
    assert model.flat_data[model.params[2].offset] == 42.0


def test_decay_applies_to_matrices_and_embeddings_only():
    model = GPT(GPTConfig.named("tiny", tie_embeddings=False), seed=0)
    for p in model.params:
        assert p.decay == (len(p.shape) == 2), p.name
    mask = decay_mask(model.params)
    assert mask.shape == (model.num_params,) and mask.dtype == np.float32
    for p in model.params:
        assert np.all(mask[p.offset:p.offset + p.size] == (1.0 if p.decay else 0.0))


def test_tiny_parameter_count():
    cfg = GPTConfig.named("tiny")
    C, V, L = cfg.n_embd, cfg.vocab_size, cfg.n_layer
    expected = V * C + cfg.seq_len * C + L * (12 * C * C + 13 * C) + 2 * C
    assert GPT(cfg).num_params == expected
    assert GPT(GPTConfig.named("tiny", tie_embeddings=False)).num_params == expected + V * C


# ------------------------------------------------------------------------- init and dtype
def test_init_is_deterministic_from_seed():
    cfg = GPTConfig.named("tiny")
    a, b, c = GPT(cfg, seed=3), GPT(cfg, seed=3), GPT(cfg, seed=4)
    np.testing.assert_array_equal(a.flat_data, b.flat_data)
    assert not np.array_equal(a.flat_data, c.flat_data)


def test_init_follows_gpt2_scheme():
    cfg = GPTConfig.named("small")
    model = GPT(cfg, seed=0, dtype=np.float64)
    p = {q.name: q.data for q in model.params}
    assert p["wte"].std() == pytest.approx(0.02, rel=0.02)
    assert p["h0.attn.w_qkv"].std() == pytest.approx(0.02, rel=0.05)
    resid = 0.02 / math.sqrt(2 * cfg.n_layer)
    assert p["h0.mlp.w_proj"].std() == pytest.approx(resid, rel=0.05)
    assert p["h1.attn.w_proj"].std() == pytest.approx(resid, rel=0.05)
    assert np.all(p["h0.attn.b_qkv"] == 0) and np.all(p["ln_f.b"] == 0)
    assert np.all(p["h0.ln1.g"] == 1) and np.all(p["ln_f.g"] == 1)


def test_float32_model_is_a_cast_of_float64_and_agrees(rng):
    cfg = GPTConfig.named("tiny")
    m32, m64 = GPT(cfg, seed=0, dtype=np.float32), GPT(cfg, seed=0, dtype=np.float64)
    assert m32.flat_data.dtype == np.float32 and m32.flat_grad.dtype == np.float32
    np.testing.assert_array_equal(m32.flat_data, m64.flat_data.astype(np.float32))
    idx, targets = batch(rng, cfg, B=2, T=16)
    l32, c32 = m32.forward(idx, targets)
    l64, c64 = m64.forward(idx, targets)
    assert l32 == pytest.approx(l64, rel=1e-6)
    assert m32.logits(idx).dtype == np.float32
    np.testing.assert_allclose(m32.logits(idx), m64.logits(idx), rtol=1e-4, atol=1e-5)
    m32.backward(c32)
    m64.backward(c64)
    rel = np.linalg.norm(m32.flat_grad - m64.flat_grad) / np.linalg.norm(m64.flat_grad)
    assert rel < 1e-4


def test_loss_at_init_is_about_ln_vocab(rng):
    cfg = GPTConfig.named("tiny")
    loss, _ = GPT(cfg, seed=0).forward(*batch(rng, cfg, B=4, T=64))
    assert isinstance(loss, float)
    assert abs(loss - math.log(256)) < 0.1


def test_logits_agree_with_forward_loss(rng):
    cfg = micro_cfg()
    model = GPT(cfg, seed=0, dtype=np.float64)
    idx, targets = batch(rng, cfg)
    logits = model.logits(idx)
    assert logits.shape == (2, 5, cfg.vocab_size)
    logp = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    nll = -np.take_along_axis(logp, targets[..., None], -1).mean()
    assert model.forward(idx, targets)[0] == pytest.approx(nll, rel=1e-12)


# ------------------------------------------------------------------------- generation
def test_generate_appends_tokens_and_crops_context(rng):
    cfg = micro_cfg()
    model = GPT(cfg, seed=0)
    idx = rng.integers(0, cfg.vocab_size, (3, 4))
    out = model.generate(idx, 7, rng=np.random.default_rng(0))  # 4 + 7 > seq_len = 6
    assert out.shape == (3, 11) and out.dtype == idx.dtype
    np.testing.assert_array_equal(out[:, :4], idx)
    assert out.min() >= 0 and out.max() < cfg.vocab_size
    again = model.generate(idx, 7, rng=np.random.default_rng(0))
    np.testing.assert_array_equal(out, again)


def test_generate_top_k_1_is_greedy(rng):
    cfg = micro_cfg()
    model = GPT(cfg, seed=0)
    model.load_flat(model.flat_data + rng.normal(0, 0.5, model.num_params))
    idx = rng.integers(0, cfg.vocab_size, (2, 3))
    greedy = model.generate(idx, 5, temperature=0)
    top1 = model.generate(idx, 5, top_k=1, rng=np.random.default_rng(1))
    np.testing.assert_array_equal(greedy, top1)


# ------------------------------------------------------------------------- errors
def test_heads_must_divide_channels():
    with pytest.raises(ConfigError, match=r"n_embd \(66\) must be divisible by n_head \(4\)"):
        GPTConfig(n_embd=66, n_head=4)


@pytest.mark.parametrize("field", ["vocab_size", "seq_len", "n_layer", "n_head", "n_embd"])
def test_sizes_must_be_positive(field):
    with pytest.raises(ConfigError, match=field):
        GPTConfig(**{field: 0})


def test_unknown_model_name_lists_the_names():
    with pytest.raises(ConfigError, match="tiny, small, base"):
        GPTConfig.named("huge")


def test_named_config_defaults_and_overrides():
    assert set(MODEL_SIZES) >= {"tiny", "small", "base"}
    cfg = GPTConfig.named("small")
    assert cfg.seq_len == 128 and cfg.vocab_size == 256
    assert GPTConfig.named("small", seq_len=256).seq_len == 256
    with pytest.raises(ConfigError, match="seqlen"):
        GPTConfig.named("small", seqlen=256)


def test_sequence_longer_than_seq_len_is_refused(rng):
    cfg = micro_cfg()
    idx = rng.integers(0, cfg.vocab_size, (1, cfg.seq_len + 1))
    with pytest.raises(ConfigError, match="seq_len is 6"):
        GPT(cfg).forward(idx, idx)


@pytest.mark.parametrize("bad", [-1, 13])
def test_token_ids_out_of_range_are_refused(rng, bad):
    cfg = micro_cfg()
    idx, targets = batch(rng, cfg)
    targets[0, 1] = bad
    with pytest.raises(ConfigError, match=r"ids must be in \[0, 13\)"):
        GPT(cfg).forward(idx, targets)


def test_non_integer_tokens_and_shape_mismatch_are_refused(rng):
    cfg = micro_cfg()
    model = GPT(cfg)
    idx, targets = batch(rng, cfg)
    with pytest.raises(ConfigError, match="integer"):
        model.forward(idx.astype(np.float32), targets)
    with pytest.raises(ConfigError, match="must equal idx shape"):
        model.forward(idx, targets[:, :3])
    with pytest.raises(ConfigError, match=r"\(B, T\)"):
        model.logits(idx[0])


def test_load_flat_checks_the_size():
    model = GPT(micro_cfg())
    with pytest.raises(ConfigError, match=f"{model.num_params} elements"):
        model.load_flat(np.zeros(model.num_params + 1))
    model.load_flat(np.arange(model.num_params, dtype=np.float64))
    assert model.flat_data.dtype == np.float32 and model.flat_data[5] == 5.0


# ------------------------------------------------------------------------- training
def test_tiny_gpt_overfits_one_batch(rng):
    cfg = GPTConfig.named("tiny", seq_len=32)
    model = GPT(cfg, seed=0)
    idx = rng.integers(0, 256, (4, 33))
    x, y = idx[:, :-1], idx[:, 1:]
    opt = AdamW(model.flat_data, lr=1e-2, weight_decay=0.0)
    first, _ = model.forward(x, y)
    for _ in range(50):
        model.zero_grad()
        loss, cache = model.forward(x, y)
        model.backward(cache)
        clip_grad_norm(model.flat_grad, 1.0)
        opt.step(model.flat_grad)
    assert first > 5.0 and loss < 0.5, (first, loss)


# ------------------------------------------------------------------------- provider hooks
class CopyingProvider:
    """A transient provider: hands out copies, poisons them (NaN) on release, keeps each unit's
    gradient in its own buffer until grads_ready, and records every call."""

    transient = True

    def __init__(self, model):
        self.model, self.calls, self.live = model, [], {}
        self.flat = model.flat_data.copy()
        self.grad = np.zeros_like(self.flat)
        self.buffers = {}

    def _span(self, unit):
        first, stop = self.model.units[unit]
        return self.model.params[first:stop]

    def fetch(self, unit, then=None):
        self.calls.append(("fetch", unit, then))
        arrays = [self.flat[p.offset:p.offset + p.size].reshape(p.shape).copy()
                  for p in self._span(unit)]
        self.live[unit] = arrays
        return arrays

    def release(self, unit):
        self.calls.append(("release", unit))
        for array in self.live.pop(unit):
            array.fill(np.nan)  # any later use shows up as NaN in the loss or gradients

    def grads(self, unit):
        if unit not in self.buffers:
            self.buffers[unit] = [np.zeros(p.shape) for p in self._span(unit)]
        return self.buffers[unit]

    def grads_ready(self, unit):
        self.calls.append(("grads_ready", unit))
        for p, g in zip(self._span(unit), self.buffers.pop(unit)):
            self.grad[p.offset:p.offset + p.size] += g.reshape(-1)


@pytest.mark.parametrize("tie", [True, False])
def test_units_are_contiguous_parameter_ranges_in_forward_order(tie):
    model = GPT(micro_cfg(tie), seed=0)
    L = model.cfg.n_layer
    assert len(model.units) == L + 2
    assert model.units[0] == (0, 2) and model.units[-1][1] == len(model.params)
    assert all(prev[1] == cur[0] for prev, cur in zip(model.units, model.units[1:]))
    assert [model.params[a].name for a, _ in model.units[1:-1]] == [f"h{l}.ln1.g"
                                                                     for l in range(L)]
    assert model.params[model.units[-1][0]].name == "ln_f.g"


def test_default_provider_hands_out_the_flat_buffer_views():
    model = GPT(micro_cfg(), seed=0)
    for u, (first, stop) in enumerate(model.units):
        for array, grad, p in zip(model.provider.fetch(u), model.provider.grads(u),
                                  model.params[first:stop]):
            assert array is p.data and grad is p.grad


@pytest.mark.parametrize("tie", [True, False])
def test_transient_provider_gives_the_same_loss_gradients_and_logits(rng, tie):
    cfg = micro_cfg(tie)
    reference, model = GPT(cfg, seed=0, dtype=np.float64), GPT(cfg, seed=0, dtype=np.float64)
    idx, targets = batch(rng, cfg)
    ref_loss, cache = reference.forward(idx, targets)
    reference.backward(cache)
    provider = CopyingProvider(model)
    model.use_provider(provider)
    loss, cache = model.forward(idx, targets)
    ready = []
    model.backward(cache, grad_ready=ready.append)
    assert loss == ref_loss
    np.testing.assert_array_equal(provider.grad, reference.flat_grad)  # no NaN: nothing stale
    assert sorted(ready) == list(range(len(model.params)))
    assert not model.flat_grad.any()  # every gradient went to the provider
    np.testing.assert_array_equal(model.logits(idx), reference.logits(idx))


@pytest.mark.parametrize("tie", [True, False])
def test_provider_calls_follow_the_documented_order(rng, tie):
    cfg = micro_cfg(tie)  # 2 blocks: units 0 (embeddings), 1, 2 (blocks), 3 (head)
    model = GPT(cfg, seed=0, dtype=np.float64)
    provider = CopyingProvider(model)
    model.use_provider(provider)
    _, cache = model.forward(*batch(rng, cfg))
    head_forward = ([("fetch", 3, 0), ("fetch", 0, None), ("release", 0), ("release", 3)] if tie
                    else [("fetch", 3, None), ("release", 3)])
    assert provider.calls == [("fetch", 0, 1), ("release", 0), ("fetch", 1, 2), ("release", 1),
                              ("fetch", 2, 3), ("release", 2)] + head_forward
    provider.calls.clear()
    model.backward(cache)
    head_backward = ([("fetch", 3, 0), ("fetch", 0, 2), ("release", 0)] if tie
                     else [("fetch", 3, 2)])
    assert provider.calls == head_backward + [
        ("release", 3), ("grads_ready", 3), ("fetch", 2, 1), ("release", 2), ("grads_ready", 2),
        ("fetch", 1, None), ("release", 1), ("grads_ready", 1), ("grads_ready", 0)]
    assert not provider.live and not provider.buffers


def test_dropping_the_flat_buffers_leaves_the_provider_in_charge():
    model = GPT(micro_cfg(), seed=0)
    model.use_provider(CopyingProvider(model), drop_flat=True)
    assert model.flat_data is None and model.flat_grad is None
    assert all(p.data is None and p.grad is None for p in model.params)
    model.zero_grad()  # nothing to zero
    with pytest.raises(ConfigError, match="provider"):
        model.load_flat(np.zeros(model.num_params))


# ------------------------------------------------------------------------- frozen reference
# The GPT as written by hand before it became a Model of modules (2026-12), kept here verbatim in
# substance: the re-expressed GPT must reproduce its init, loss, logits and gradients bit for bit.
def frozen_init(cfg, seed):
    rng = np.random.default_rng(seed)
    flat = np.zeros(param_layout(cfg)[-1].stop, dtype=np.float64)
    resid_std = 0.02 / math.sqrt(2 * cfg.n_layer)
    for spec in param_layout(cfg):
        view = flat[spec.offset:spec.stop]
        if spec.name.endswith(".g"):
            view[:] = 1.0
        elif len(spec.shape) == 2:
            view[:] = rng.standard_normal(spec.size) * (
                resid_std if spec.name.endswith("w_proj") else 0.02)
    return flat


def frozen_passes(cfg, flat, idx, targets, scale, dtype):
    """(loss, logits, flat_grad, grad_ready order) of the hand-written GPT."""
    from rtxmpi.nn import layers
    from rtxmpi.nn.params import bind
    flat = flat.astype(dtype)
    grad = np.zeros_like(flat)
    ps = bind(param_layout(cfg), flat, grad)
    L = cfg.n_layer
    blocks = [ps[2 + 12 * l:14 + 12 * l] for l in range(L)]
    g, b = ps[2 + 12 * L:4 + 12 * L]
    head = ps[0] if cfg.tie_embeddings else ps[-1]
    x = ps[0].data[idx]
    x += ps[1].data[:idx.shape[1]]
    caches = []
    for block in blocks:
        x, c = layers.block_forward(x, [p.data for p in block], cfg.n_head)
        caches.append(c)
    h, ln_cache = layers.layernorm_forward(x, g.data, b.data)
    logits, head_cache = layers.linear_forward(h, head.data.T)
    loss, ce = layers.crossentropy_forward(logits, targets)
    order = []
    dh, _, _ = layers.linear_backward(layers.crossentropy_backward(scale, ce), head_cache,
                                      dw_out=head.grad.T)
    if not cfg.tie_embeddings:
        order.append(head.index)
    dx, _, _ = layers.layernorm_backward(dh, ln_cache, g.grad, b.grad)
    order += [b.index, g.index]
    for block, c in zip(reversed(blocks), reversed(caches)):
        dx, _ = layers.block_backward(dx, c, [p.grad for p in block],
                                      ready=lambda j, base=block[0].index: order.append(base + j))
    ids = idx.reshape(-1)
    order_ = np.argsort(ids, kind="stable")
    starts = np.concatenate([[0], np.flatnonzero(ids[order_][1:] != ids[order_][:-1]) + 1])
    ps[0].grad[ids[order_][starts]] += np.add.reduceat(dx.reshape(-1, cfg.n_embd)[order_], starts,
                                                       axis=0)
    ps[1].grad[:idx.shape[1]] += dx.sum(axis=0)
    return float(loss), logits, grad, order + [1, 0]


@pytest.mark.parametrize("tie", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_gpt_is_bitwise_the_hand_written_model(rng, tie, dtype):
    cfg = GPTConfig(vocab_size=29, seq_len=12, n_layer=3, n_head=2, n_embd=16,
                    tie_embeddings=tie)
    model = GPT(cfg, seed=5, dtype=dtype)
    flat = frozen_init(cfg, 5)
    np.testing.assert_array_equal(model.flat_data, flat.astype(dtype))
    idx, targets = batch(rng, cfg, B=3, T=10)
    loss, cache = model.forward(idx, targets)
    order = []
    model.backward(cache, scale=0.5, grad_ready=order.append)
    ref_loss, ref_logits, ref_grad, ref_order = frozen_passes(cfg, flat, idx, targets, 0.5, dtype)
    assert loss == ref_loss
    assert model.flat_grad.tobytes() == ref_grad.tobytes()
    assert model.logits(idx).tobytes() == ref_logits.tobytes()
    assert order == ref_order
