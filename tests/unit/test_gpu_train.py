"""bench/gpu_train.py without a GPU: it says it skipped (rtxmpi bench all then keeps the table
measured on one), and its rtxmpi rows and --breakdown run on the device stand-in."""
import importlib.util
import os
import subprocess
import sys
import types

import pytest

from rtxmpi.nn import GPTConfig
from rtxmpi.nn.gpt import param_layout

HERE = os.path.dirname(os.path.abspath(__file__))
BENCH = os.path.join(HERE, "..", "..", "bench")
sys.path.insert(0, os.path.dirname(HERE))
import devicesim  # noqa: E402


def _load():
    sys.path.insert(0, BENCH)
    spec = importlib.util.spec_from_file_location("gpu_train", os.path.join(BENCH, "gpu_train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_without_a_gpu_it_says_skipped():
    if _gpu():
        pytest.skip("a GPU is present: gpu_train measures for real")
    out = subprocess.run([sys.executable, os.path.join(BENCH, "gpu_train.py")], capture_output=True,
                         text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("skipped:"), out.stdout + out.stderr


def _gpu():
    from rtxmpi.backend import gpu_count
    return gpu_count() > 0


def test_rtxmpi_rows_and_the_breakdown_run_on_the_stand_in(monkeypatch, capsys):
    sim = devicesim.install(monkeypatch)
    monkeypatch.setattr(sim, "get_default_memory_pool", lambda: types.SimpleNamespace(
        total_bytes=lambda: 123), raising=False)
    monkeypatch.setitem(sys.modules, "cupy", sim)
    gpu_train = _load()
    monkeypatch.setattr(gpu_train, "gemm_table", lambda args, cfg: None)  # needs torch on a GPU
    args = types.SimpleNamespace(batch=2, warmup=1, steps=2)
    cfg = GPTConfig.named("tiny", seq_len=16)
    seconds, peak = gpu_train.worker_rtxmpi(args, cfg)
    assert seconds > 0 and peak == 123
    gpu_train.breakdown(args, cfg)
    out = capsys.readouterr().out
    assert "self time per step" in out and "(outside the timed functions)" in out, out
    assert "layers.linear_backward" in out and "kernels.column_sums" in out, out
    # 6 N + 12 L C T, N without the position embeddings
    n = sum(spec.size for spec in param_layout(cfg) if spec.name != "wpe")
    assert gpu_train.flops_per_token(cfg) == 6 * n + 12 * cfg.n_layer * cfg.n_embd * cfg.seq_len
