"""Activation recomputation per unit (Model.recompute): the same bits as keeping every cache, the
activations of one unit at a time, and provider traffic in a valid order."""
import numpy as np
import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.nn import GPT, GPTConfig, Module
from rtxmpi.nn.module import FlatParams
from rtxmpi.observe.memory import cache_bytes

B, T = 3, 16


def batch(cfg, seed=0):
    idx = np.random.default_rng(seed).integers(0, cfg.vocab_size, (B, T + 1))
    return idx[:, :-1], idx[:, 1:]


def run(model, x, y, scale=1.0):
    """(loss, flat_grad copy, grad_ready order) of one forward and backward."""
    order = []
    loss, cache = model.forward(x, y)
    model.backward(cache, scale=scale, grad_ready=order.append)
    return loss, model.flat_grad.copy(), order


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("tied", [True, False])
@pytest.mark.parametrize("policy", ["blocks", [0, 2], [1]])
def test_recompute_gives_bitwise_the_loss_gradients_and_ready_order_of_none(dtype, tied, policy):
    cfg = GPTConfig(vocab_size=64, seq_len=T, n_layer=3, n_head=2, n_embd=16, tie_embeddings=tied)
    x, y = batch(cfg)
    want = run(GPT(cfg, seed=1, dtype=dtype), x, y, scale=0.5)
    got = run(GPT(cfg, seed=1, dtype=dtype, recompute=policy), x, y, scale=0.5)
    assert got[0] == want[0]
    assert got[1].dtype == dtype and np.array_equal(got[1], want[1])
    assert got[2] == want[2] and sorted(got[2]) == list(range(len(want[2])))


def test_a_recomputed_cache_is_not_consumed_two_backwards_add_twice():
    cfg = GPTConfig(vocab_size=64, seq_len=T, n_layer=2, n_head=2, n_embd=16)
    x, y = batch(cfg)
    grads = []
    for policy in ("none", "blocks"):
        model = GPT(cfg, dtype=np.float64, recompute=policy)
        _, cache = model.forward(x, y)
        model.backward(cache)
        model.backward(cache)
        grads.append(model.flat_grad)
    assert np.array_equal(grads[0], grads[1])


def test_backward_follows_the_policy_of_its_forward():
    cfg = GPTConfig(vocab_size=64, seq_len=T, n_layer=2, n_head=2, n_embd=16)
    x, y = batch(cfg)
    want = run(GPT(cfg, dtype=np.float64), x, y)[1]
    for first, then in (("blocks", "none"), ([0], "none"), ("none", [0, 1, 2])):
        model = GPT(cfg, dtype=np.float64, recompute=first)
        _, cache = model.forward(x, y)
        model.recompute = then
        model.backward(cache)
        assert np.array_equal(model.flat_grad, want), (first, then)


def test_blocks_keep_each_block_input_instead_of_its_cache():
    """The forward cache loses every block's cache and keeps its (B, T, C) input instead; at its
    peak in backward (those inputs plus the one block cache rebuilt at a time) the blocks'
    activations are smaller than without recompute by about the number of blocks."""
    L = 8
    cfg = GPTConfig(vocab_size=64, seq_len=T, n_layer=L, n_head=2, n_embd=32)
    x, y = batch(cfg)
    none, blocks = GPT(cfg), GPT(cfg, recompute="blocks")
    _, full = none.forward(x, y)
    _, kept = blocks.forward(x, y)
    per_block = [cache_bytes(c) for c in full.units[1:L + 1]]
    block_input = B * T * cfg.n_embd * 4
    exclude = [none.flat_data, none.flat_grad, blocks.flat_data, blocks.flat_grad]
    full_bytes, kept_bytes = cache_bytes(full, exclude), cache_bytes(kept, exclude)
    assert kept_bytes == full_bytes - sum(per_block) + L * block_input
    assert kept.units[1:L + 1] == [None] * L and kept.units[0] is not None
    peak = L * block_input + max(per_block)
    assert sum(per_block) / peak > L / 2


class Counted(Module):
    """A unit whose caches count themselves while alive."""

    live = peak = 0

    def __init__(self, inner):
        self.inner = inner
        self.backward_needs_params = inner.backward_needs_params

    def param_specs(self):
        return self.inner.param_specs()

    def forward(self, params, x):
        y, cache = self.inner.forward(params, x)
        return y, Box(cache)

    def backward(self, params, grads, cache, dy):
        return self.inner.backward(params, grads, cache.cache, dy)


class Box:
    def __init__(self, cache):
        self.cache = cache
        Counted.live += 1
        Counted.peak = max(Counted.peak, Counted.live)

    def __del__(self):
        Counted.live -= 1


def test_backward_holds_one_recomputed_unit_cache_at_a_time():
    from rtxmpi.nn.gpt import gpt_units
    from rtxmpi.nn.module import Model

    cfg = GPTConfig(vocab_size=64, seq_len=T, n_layer=4, n_head=2, n_embd=16)
    units = gpt_units(cfg)
    units[1:5] = [(name, Counted(block)) for name, block in units[1:5]]
    model = Model(units, recompute="blocks")
    x, y = batch(cfg)
    _, cache = model.forward(x, y)
    assert Counted.live == 0
    Counted.peak = 0
    model.backward(cache)
    assert Counted.peak == 1 and Counted.live == 0


class Recording(FlatParams):
    """FlatParams that logs every provider call."""

    def __init__(self, model):
        super().__init__(model)
        self.log = []

    def fetch(self, unit, then=None):
        self.log.append(("fetch", unit, then))
        return super().fetch(unit, then)

    def release(self, unit):
        self.log.append(("release", unit))

    def grads(self, unit):
        self.log.append(("grads", unit))
        return super().grads(unit)

    def grads_ready(self, unit):
        self.log.append(("grads_ready", unit))


def backward_log(cfg, policy):
    model = GPT(cfg, dtype=np.float64, recompute=policy)
    provider = Recording(model)
    model.use_provider(provider)
    _, cache = model.forward(*batch(cfg))
    provider.log.clear()
    model.backward(cache)
    return provider.log


def test_blocks_leave_the_provider_calls_of_backward_unchanged():
    """A block's backward fetches its parameters anyway: the recompute uses that one fetch."""
    cfg = GPTConfig(vocab_size=64, seq_len=T, n_layer=3, n_head=2, n_embd=16)
    assert backward_log(cfg, "blocks") == backward_log(cfg, "none")


def test_a_recomputed_embedding_unit_is_fetched_in_backward_and_hinted():
    """Unit 0's backward reads no parameter: recomputing it adds its fetch, hinted by unit 1,
    released before grads_ready(0) (tied: the head fetches unit 0 too, released first)."""
    cfg = GPTConfig(vocab_size=64, seq_len=T, n_layer=2, n_head=2, n_embd=16)
    log = backward_log(cfg, [0])
    fetches = [e for e in log if e[0] == "fetch"]
    assert fetches == [("fetch", 3, 0), ("fetch", 0, 2), ("fetch", 2, 1), ("fetch", 1, 0),
                       ("fetch", 0, None)]
    assert [e[1] for e in log if e[0] == "grads_ready"] == [3, 2, 1, 0]
    tail = log[log.index(("fetch", 0, None)):]
    assert tail.index(("release", 0)) < tail.index(("grads_ready", 0))
    assert backward_log(cfg, "none").count(("fetch", 0, None)) == 0


@pytest.mark.parametrize("policy", ["all", "block", [4], [-1], [True], [0.5], 3, None])
def test_bad_policy_raises_config_error(policy):
    cfg = GPTConfig(vocab_size=64, seq_len=T, n_layer=3, n_head=2, n_embd=16)
    with pytest.raises(ConfigError, match="recompute"):
        GPT(cfg, recompute=policy)
    model = GPT(cfg)
    with pytest.raises(ConfigError, match="recompute"):
        model.recompute = policy
    assert model.recompute == "none"


def test_policy_reads_back():
    cfg = GPTConfig(vocab_size=64, seq_len=T, n_layer=3, n_head=2, n_embd=16)
    model = GPT(cfg, recompute="blocks")
    assert model.recompute == "blocks"
    model.recompute = (3, 1, 1)
    assert model.recompute == [1, 3]
