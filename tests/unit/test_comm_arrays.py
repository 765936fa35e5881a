"""rtxmpi.comm.arrays in one process: what is viewed through DLPack, and that rtxmpi imports no
framework (the collectives themselves: tests/mpi/test_dlpack.py)."""
import subprocess
import sys

import numpy as np
import pytest

from rtxmpi.comm.arrays import as_array, is_foreign, to_kind


class OnDevice:
    """A DLPack object on a device the collectives do not take (DLPack type 4: OpenCL)."""

    def __dlpack__(self, **kwargs):
        raise AssertionError("never exported")

    def __dlpack_device__(self):
        return (4, 0)


def test_rtxmpi_imports_no_framework():
    code = "import sys, rtxmpi, rtxmpi.comm.arrays; print(sorted({'torch', 'jax'} & set(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_numpy_arrays_and_plain_objects_are_not_foreign():
    assert not is_foreign(np.zeros(2)) and not is_foreign([1, 2]) and not is_foreign(3.0)
    assert is_foreign(OnDevice())


def test_a_device_the_collectives_do_not_take_is_a_type_error():
    with pytest.raises(TypeError, match="all_gather: a .*OnDevice on DLPack device type 4 cannot be used"):
        as_array(OnDevice(), "all_gather")


def test_results_go_back_to_the_framework_of_the_input():
    torch = pytest.importorskip("torch")
    t = torch.arange(3.0)
    view = as_array(t, "all_reduce")
    view += 1
    assert to_kind(view, t, view) is t and t.tolist() == [1.0, 2.0, 3.0]  # the same memory
    out = to_kind(np.arange(2), t, view)
    assert isinstance(out, torch.Tensor) and out.tolist() == [0, 1]
    assert to_kind(None, t, view) is None


class Exported:
    """A CPU DLPack object over a numpy buffer (another framework's array, without torch)."""

    def __init__(self, array):
        self.array = array

    def __dlpack__(self, **kwargs):
        return self.array.__dlpack__(**kwargs)

    def __dlpack_device__(self):
        return self.array.__dlpack_device__()


def test_a_checkpoint_shard_takes_a_dlpack_array_without_a_copy(tmp_path):
    from rtxmpi.checkpoint import Shard, load_checkpoint, save_checkpoint

    buf = np.arange(6.0)
    shard = Shard(Exported(buf), 0, 6)
    assert type(shard.data) is np.ndarray and np.shares_memory(shard.data, buf)
    save_checkpoint(None, tmp_path, 1, {"w": shard})
    assert load_checkpoint(None, tmp_path).read("w").tolist() == buf.tolist()
