"""rtxmpi.observe.memory: exact model-state bytes, activation bytes of a forward cache, RSS."""
import numpy as np
import pytest

from rtxmpi.nn import GPT, AdamW, GPTConfig, layers
from rtxmpi.observe.memory import (MemoryReport, cache_bytes, gather_reports, optimizer_state_bytes,
                                   peak_rss_bytes, report, rss_bytes)

CFG = GPTConfig.named("tiny", seq_len=16)


def _batch(batch_size, seq_len=16, seed=0):
    rng = np.random.default_rng(seed)
    x = rng.integers(0, CFG.vocab_size, (batch_size, seq_len))
    return x, np.roll(x, -1, axis=1)


class _Engine:
    """A wrapper with its own accounting (the ZeroDataParallel interface)."""

    def __init__(self, model):
        self.model = model

    def memory_bytes(self):
        return {"params": 10, "grads": 20, "optimizer": 30, "total": 60}


def test_params_grads_optimizer_counted_exactly_for_a_known_model():
    model = GPT(CFG)
    opt = AdamW(model.flat_data, decay_mask=np.ones(model.num_params, np.float32))
    r = report(model=model, optimizer=opt)
    n = model.num_params
    assert r.params_bytes == 4 * n
    assert r.grads_bytes == 4 * n
    assert r.optimizer_bytes == 4 * 4 * n  # m, v, decay mask, scratch
    assert r.model_state_bytes == 24 * n
    assert r.activations_bytes == 0


def test_optimizer_without_mask_is_m_v_and_scratch():
    model = GPT(CFG)
    assert optimizer_state_bytes(AdamW(model.flat_data)) == 3 * 4 * model.num_params
    assert optimizer_state_bytes(None) == 0


def test_engine_memory_bytes_is_used_when_present():
    model = GPT(CFG)
    r = report(_Engine(model))
    assert (r.params_bytes, r.grads_bytes, r.optimizer_bytes) == (10, 20, 30)


def test_transient_peak_from_a_provider_else_zero():
    model = GPT(CFG)
    engine = _Engine(model)
    assert report(engine).transient_peak_bytes == 0
    engine.provider = type("Provider", (), {"peak_bytes": {"params": 100, "grads": 28}})()
    assert report(engine).transient_peak_bytes == 128


def test_report_without_engine_or_model_raises():
    with pytest.raises(ValueError):
        report()


def test_activations_positive_and_grow_with_batch():
    model = GPT(CFG)
    _, small = model.forward(*_batch(2))
    _, large = model.forward(*_batch(8))
    a_small = report(model=model, cache=small).activations_bytes
    a_large = report(model=model, cache=large).activations_bytes
    assert a_small > 0
    # everything but the tiny fixed part scales with B: 4x the batch is close to 4x the bytes
    assert 3.5 * a_small < a_large <= 4 * a_small


def test_activations_exclude_parameter_buffers():
    model = GPT(CFG)
    _, cache = model.forward(*_batch(2))
    # the model's cache holds no parameter (its backward takes them again) ...
    assert cache_bytes(cache) == cache_bytes(cache, exclude=(model.flat_data, model.flat_grad))
    # ... a layer's own cache does: a view of the weights, whose buffer is excluded
    h = np.ones((2, 16, CFG.n_embd), np.float32)
    _, layer_cache = layers.linear_forward(h, model.param("h0.attn.w_qkv").data)
    without = cache_bytes(layer_cache, exclude=(model.flat_data, model.flat_grad))
    assert cache_bytes(layer_cache) - without == model.flat_data.nbytes
    assert without == h.nbytes


def test_views_of_one_buffer_counted_once():
    a = np.zeros((64, 32), np.float32)
    cache = (a, a[1:], a.T, [a.reshape(-1)[::2]], {"k": a[3]})
    assert cache_bytes(cache) == a.nbytes
    b = np.ones(10, np.float64)
    assert cache_bytes((cache, b, b[:5])) == a.nbytes + b.nbytes


def test_slots_and_attribute_objects_are_walked():
    class Slotted:
        __slots__ = ("x", "y")

        def __init__(self, x, y):
            self.x, self.y = x, y

    class Plain:
        def __init__(self, z):
            self.z = z

    a, b = np.zeros(100, np.float32), np.zeros(7, np.int64)
    assert cache_bytes(Slotted(a, Plain(b))) == a.nbytes + b.nbytes


def test_self_referencing_cache_terminates():
    a = np.zeros(16, np.float32)
    nest = [a]
    nest.append(nest)
    assert cache_bytes(nest) == a.nbytes


def test_rss_positive_and_peak_at_least_current():
    assert peak_rss_bytes() > 0
    now = rss_bytes()
    assert now > 0
    assert peak_rss_bytes() >= now * 0.9  # same pages, sampled a moment apart


def test_peak_rss_grows_after_touching_memory():
    block = np.ones(64 << 20, np.uint8)  # 64 MiB, every page written
    assert rss_bytes() >= block.nbytes
    assert peak_rss_bytes() >= block.nbytes


def test_gather_reports_single_process_and_dict():
    r = MemoryReport(0, 1, 2, 3, 4, 5, 6, 7)
    assert gather_reports(None, r) == [r]
    assert r.as_dict()["model_state_bytes"] == 6
