"""bench/gpu_check.py on a machine without a GPU: a clear SKIP, exit 0 (2 with --require-gpu)."""
import os
import subprocess
import sys

import pytest

from rtxmpi.kernels import gpu_available

SCRIPT = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "gpu_check.py")


@pytest.mark.skipif(gpu_available(), reason="a GPU is present: gpu_check runs for real")
@pytest.mark.parametrize("flags, code", [([], 0), (["--require-gpu"], 2)])
def test_gpu_check_skips_cleanly_without_a_gpu(flags, code):
    result = subprocess.run([sys.executable, SCRIPT, *flags], capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == code, result.stderr
    assert "gpu_check: SKIP:" in result.stdout and "nothing to check" in result.stdout
