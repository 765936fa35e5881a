"""bench/gpu_check.py on a machine without a GPU: a clear SKIP, exit 0 (2 with --require-gpu); its
in-process steps on the device stand-in."""
import json
import os
import subprocess
import sys

import pytest

from rtxmpi.kernels import gpu_available

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu_check.py")


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: gpu_check runs for real")
@pytest.mark.parametrize("flags, code", [([], 0), (["--require-gpu"], 2)])
def test_gpu_check_skips_cleanly_without_a_gpu(flags, code, tmp_path):
    out = tmp_path / "gpu_check.json"
    result = subprocess.run([sys.executable, SCRIPT, *flags, "--json", str(out)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == code, result.stderr
    assert "gpu_check: SKIP:" in result.stdout and "nothing to check" in result.stdout
    assert "skipped" in json.loads(out.read_text())


def _load_gpu_check():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_gpu_check_in_process_steps_run_on_the_device_stand_in(monkeypatch, tmp_path):
    """The device run's in-process steps (kernels, bandwidth, nccl, model) on tests/devicesim.py:
    its kernels are the numpy references, so every correctness check must pass; NCCL is absent,
    so that step is a SKIP line; the JSON holds every step and the exit status follows it."""
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import devicesim

    devicesim.install(monkeypatch)
    gpu_check = _load_gpu_check()
    out = tmp_path / "gpu_check.json"
    code = gpu_check.main(["--skip", "pytest,train,train_zero,layouts", "--bandwidth-mb", "4", "--small",
                           "--json", str(out)])
    report = json.loads(out.read_text())
    steps = report["steps"]
    assert steps["kernels"]["pass"] is True, steps["kernels"]
    assert steps["model"]["pass"] is True, steps["model"]
    assert steps["nccl"]["pass"] is None and "NCCL binding is missing" in steps["nccl"]["detail"]
    assert steps["pytest"]["detail"] == "--skip"
    assert set(report["kernels"]) == {"grad_epilogue", "adamw", "bias_gelu_forward",
                                      "bias_gelu_backward", "residual_layernorm",
                                      "layernorm_backward", "softmax_forward", "softmax_backward"}
    assert code == (0 if steps["bandwidth"]["pass"] else 1) and report["pass"] == (code == 0)


def test_gpu_check_refuses_an_unknown_step_to_skip(capsys):
    with pytest.raises(SystemExit) as exc:
        _load_gpu_check().main(["--skip", "kernel"])
    assert exc.value.code == 2 and "unknown step" in capsys.readouterr().err


def test_gpu_check_fails_steps_it_has_no_time_left_for(monkeypatch, tmp_path):
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import devicesim

    devicesim.install(monkeypatch)
    out = tmp_path / "gpu_check.json"
    code = _load_gpu_check().main(["--skip", "kernels,bandwidth,nccl,model,pytest,train,layouts",
                                   "--budget-s", "0", "--json", str(out)])
    step = json.loads(out.read_text())["steps"]["train_zero"]
    assert code == 1 and step["pass"] is False and "budget" in step["detail"]
