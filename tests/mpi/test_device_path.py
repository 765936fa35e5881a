"""examples/train.py with --device cuda on the device stand-in (tests/devicesim.py: "cupy" arrays
that numpy refuses, kernels emulated by their numpy references, host-staged collectives) against
the same run with --device cpu: DP buckets, ZeRO 1-3, CPU and NVMe offload, checkpoints
(device-to-host streaming) and resume, tensor / Megatron-sequence / Ulysses / pipeline
parallelism. The stand-in computes with numpy underneath (the model is bit for bit the numpy
model, tests/unit/test_device_stand_in.py), so a run must equal the CPU run on the same numpy
references (rtxmpi.fused off on both sides): bit for bit for data
parallelism (loss, validation loss, checkpoint checksums), and within 1e-6 relative elsewhere,
since host staging runs an async reduce_scatter synchronously, which may sum in another order
(seen at 4 ranks with ZeRO-3). The CPU runs are held to the one-process reference by the other
parity tests. Holds at any world size (the tp/pp/sp layouts need 2 ranks).
"""
import importlib.util
import json
import os
import shutil
import signal
import sys
import tempfile

import numpy as np
import pytest
from mpi4py import MPI

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import devicesim  # noqa: E402

from rtxmpi import fused  # noqa: E402
from rtxmpi.elastic import loop as elastic_loop  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="module")
def train_example():
    spec = importlib.util.spec_from_file_location("train_example",
                                                  os.path.join(ROOT, "examples", "train.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def workdir(world):
    """One directory for every rank (rank 0's), holding a small corpus; removed at the end."""
    path = tempfile.mkdtemp(prefix="rtxmpi-devpath-") if world.rank == 0 else None
    path = MPI.COMM_WORLD.bcast(path)
    if world.rank == 0:
        with open(os.path.join(ROOT, "rtxmpi", "nn", "layers.py")) as f:
            text = f.read()
        with open(os.path.join(path, "corpus.txt"), "w") as f:
            f.write(text * 3)
    MPI.COMM_WORLD.Barrier()
    yield path
    MPI.COMM_WORLD.Barrier()
    if world.rank == 0:
        shutil.rmtree(path, ignore_errors=True)


def base_flags(workdir, device):
    return ["--data", os.path.join(workdir, "corpus.txt"), "--cache-dir",
            os.path.join(workdir, "cache"), "--model", "tiny", "--seq-len", "32",
            "--global-batch", "8", "--steps", "3", "--no-progress", "--sample-tokens", "0",
            "--eval-batches", "1", "--device", device]


def run(train_example, workdir, device, flags):
    """train.py's train() in this process; returns (final record, kernel launches)."""
    base = base_flags(workdir, device)
    flags = [f.replace("{dir}", os.path.join(workdir, device)) for f in flags]
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fused, "_enabled", False)  # the stand-in's kernels are the numpy references
        mp.setattr(elastic_loop._config, "stop", None)  # train() installs SIGTERM handlers...
        if device == "cuda":
            devicesim.install(mp)
        try:
            record = train_example.train(train_example.parse_args(base + flags))
        finally:
            for signum, handler in handlers.items():  # ...which this test process gives back
                signal.signal(signum, handler)
        return record, dict(devicesim.launches) if device == "cuda" else {}


def same_run(train_example, workdir, flags, exact=False):
    cpu, _ = run(train_example, workdir, "cpu", flags)
    dev, launches = run(train_example, workdir, "cuda", flags)
    if exact:
        assert (dev["loss"], dev["val_loss"]) == (cpu["loss"], cpu["val_loss"])
    else:
        np.testing.assert_allclose([dev["loss"], dev["val_loss"]],
                                   [cpu["loss"], cpu["val_loss"]], rtol=1e-6)
    return launches


def checksums(directory):
    with open(os.path.join(directory, "latest")) as f:
        step_dir = os.path.join(directory, f.read().strip())
    with open(os.path.join(step_dir, "metadata.json")) as f:
        meta = json.load(f)
    return json.dumps(meta["tensors"], sort_keys=True)


def test_dp_checkpoint_and_resume_on_device_match_cpu(world, train_example, workdir):
    launches = same_run(train_example, workdir, ["--ckpt-dir", "{dir}", "--ckpt-every", "2"],
                        exact=True)
    # every block: residual+LayerNorm and bias+GELU fused; AdamW fused; the epilogue when dp > 1
    assert launches["residual_layernorm_forward_f32"] and launches["bias_gelu_backward_f32"]
    assert launches.get("adamw_f32x4", 0) + launches.get("adamw_f32", 0) == 3
    if world.world_size > 1:
        assert launches.get("grad_epilogue_f32x4", 0) + launches.get("grad_epilogue_f32", 0) == 3
    assert checksums(os.path.join(workdir, "cuda")) == checksums(os.path.join(workdir, "cpu"))
    same_run(train_example, workdir, ["--ckpt-dir", "{dir}", "--resume", "--steps", "4",
                                      "--sample-tokens", "8"], exact=True)  # + generation


@pytest.mark.parametrize("flags", [
    ["--zero-stage", "3", "--micro-batches", "2"],
    ["--zero-stage", "2", "--offload", "cpu"],
    ["--zero-stage", "1", "--offload", "nvme", "--offload-dir", "{dir}"],
], ids=["zero3-accumulate", "zero2-offload-cpu", "zero1-offload-nvme"])
def test_zero_on_device_matches_cpu(world, train_example, workdir, flags):
    same_run(train_example, workdir, flags)


@pytest.mark.mpi(min_size=2)
@pytest.mark.parametrize("flags", [
    ["--tp", "2", "--sequence-parallel", "--zero-stage", "3"],
    ["--pp", "2", "--micro-batches", "2"],
    ["--sp", "2", "--zero-stage", "2", "--offload", "cpu"],
], ids=["tp2-megatron-sp-zero3", "pp2-1f1b", "sp2-ulysses-zero2-offload"])
def test_model_parallel_on_device_matches_cpu(world, train_example, workdir, flags):
    launches = same_run(train_example, workdir, flags + ["--dp", str(world.world_size // 2)])
    # tensor-parallel blocks fuse residual+LayerNorm and bias+GELU too
    assert launches["residual_layernorm_forward_f32"] and launches["bias_gelu_backward_f32"]


def test_elastic_replica_handover_takes_device_tensors(world, monkeypatch):
    """After a shrink the newest replica's full tensors (cupy under --device cuda) are broadcast
    from the host; the receiving engine's load_shards moves them back to its device."""
    from rtxmpi.elastic.shrink import exchange_replica

    sim = devicesim.install(monkeypatch)
    last = world.world_size - 1
    values = np.arange(10, dtype=np.float32)
    state = exchange_replica(world, 7 if world.rank == last else 6,
                             lambda: {"params": sim.asarray(values + world.rank)},
                             lambda: {"step": 7}, world.world_size)
    assert (state.step, state.source_rank, state.meta) == (7, last, {"step": 7})
    np.testing.assert_array_equal(state.read("params", 0, 10), values + last)


def test_device_cuda_without_cupy_is_a_config_error_on_every_rank(world, train_example, workdir,
                                                                  monkeypatch, capsys):
    from rtxmpi import backend

    monkeypatch.setattr(backend, "_cupy", None)
    monkeypatch.setattr(backend, "_cupy_checked", True)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    try:
        with pytest.raises(SystemExit) as exc:
            train_example.main(base_flags(workdir, "cuda"))
    finally:
        for signum, handler in handlers.items():
            signal.signal(signum, handler)
    assert exc.value.code == train_example.EXIT_CONFIG
    if world.rank == 0:
        assert "device 'cuda' needs cupy" in capsys.readouterr().err
