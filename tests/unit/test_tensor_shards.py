"""How GPT parameters split over tensor-parallel ranks (rtxmpi.parallel.tensor), one process."""
import numpy as np
import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.nn import GPTConfig, param_layout
from rtxmpi.parallel import tensor as tpl

CFG = GPTConfig(vocab_size=256, seq_len=16, n_layer=2, n_head=4, n_embd=32, tie_embeddings=False)


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_shards_of_every_parameter_reassemble_the_full_parameter(tp):
    rng = np.random.default_rng(0)
    local = {name: shape for name, shape, _ in tpl.local_layout(param_layout(CFG), tp)}
    for spec in param_layout(CFG):
        full = rng.standard_normal(spec.shape)
        pieces = [tpl.shard_param(spec.name, full, r, tp) for r in range(tp)]
        assert all(p.shape == local[spec.name] for p in pieces)
        np.testing.assert_array_equal(tpl.unshard_param(spec.name, pieces), full)


def test_qkv_shard_holds_whole_heads_of_q_k_and_v():
    C, H, hs, tp = 32, 4, 8, 2
    full = np.arange(C * 3 * C, dtype=np.float64).reshape(C, 3 * C)
    for r in range(tp):
        local = tpl.shard_param("h0.attn.w_qkv", full, r, tp).reshape(C, 3, H // tp, hs)
        heads = full.reshape(C, 3, H, hs)[:, :, r * H // tp:(r + 1) * H // tp]
        np.testing.assert_array_equal(local, heads)


def test_split_kinds_follow_megatron():
    kinds = {s.name: tpl.split_kind(s.name) for s in param_layout(CFG)}
    assert kinds["wte"] == kinds["lm_head"] == "vocab"
    assert kinds["h1.attn.w_qkv"] == "qkv" and kinds["h1.mlp.w_fc"] == "cols"
    assert kinds["h1.attn.w_proj"] == kinds["h1.mlp.w_proj"] == "rows"
    for name in ("wpe", "h0.ln1.g", "h0.ln2.b", "h0.attn.b_proj", "h0.mlp.b_proj", "ln_f.g"):
        assert kinds[name] is None and tpl.is_replicated(name)


def test_vocab_not_divisible_by_tp_raises():
    with pytest.raises(ConfigError, match=r"vocab_size \(255\) is not divisible by 2"):
        tpl.vocab_range(255, 0, 2)


@pytest.mark.parametrize("tp", [2, 4])
def test_norm_ranges_count_every_element_of_the_model_once_over_tp(tp):
    """Summed over the tp ranks, the gradient-norm ranges cover each element of the one-process
    model once: split parameters on every rank, replicated ones on tp rank 0 only; a shard
    [start, stop) keeps the parts inside it, relative to start."""
    specs = param_layout(CFG)
    local = tpl.local_layout(specs, tp)
    offsets = np.cumsum([0] + [int(np.prod(shape)) for _, shape, _ in local])
    params = [type("P", (), {"name": n, "offset": int(o), "size": int(np.prod(s))})
              for (n, s, _), o in zip(local, offsets)]
    counted = sum(hi - lo for r in range(tp) for lo, hi in tpl.norm_ranges(params, r))
    assert counted == specs[-1].stop
    start, stop = 5, int(offsets[-1]) - 7
    inside = tpl.norm_ranges(params, 1, start, stop)
    assert inside[0] == (0, params[0].size - start)  # wte (vocab-split), from `start` on
    assert inside[1][0] != params[1].offset - start  # wpe (replicated) is tp rank 0's
    assert all(0 <= lo < hi <= stop - start for lo, hi in inside)
    assert inside == [(lo - start, hi - start) for lo, hi in
                      ((max(lo, start), min(hi, stop)) for lo, hi in tpl.norm_ranges(params, 1))
                      if hi > lo] and sum(hi - lo for lo, hi in inside) < counted
