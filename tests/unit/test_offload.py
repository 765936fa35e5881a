"""The NVMe offload store: files, chunked streaming with a bounded prefetch, errors (no MPI)."""
import threading

import numpy as np
import pytest

from rtxmpi.errors import ConfigError
from rtxmpi.parallel.offload import NvmeStore

NAMES = ("params", "adam.m")


def store(tmp_path, length=10, chunk_elems=3, max_chunks=2, rank=1):
    return NvmeStore(tmp_path, rank, NAMES, length, np.float32, chunk_elems, max_chunks)


def test_files_are_zero_filled_under_rank_dir(tmp_path):
    s = store(tmp_path)
    assert sorted(p.name for p in (tmp_path / "rank_00001").iterdir()) == ["adam.m.bin",
                                                                           "params.bin"]
    np.testing.assert_array_equal(s.array("params"), np.zeros(10, np.float32))
    assert s.disk_bytes() == 2 * 10 * 4
    s.close()
    assert not (tmp_path / "rank_00001").exists()


def test_stream_updates_every_chunk_in_order_with_padded_last_chunk(tmp_path):
    s = store(tmp_path)
    s.write_chunks(lambda lo, hi: {"params": np.arange(lo, hi), "adam.m": np.zeros(hi - lo)})
    seen = []

    def update(i, lo, hi, arrays):
        seen.append((i, lo, hi))
        assert len(arrays["params"]) == 3
        assert not arrays["params"][hi - lo:].any()
        arrays["params"] *= 2
        arrays["adam.m"] += 1

    s.stream(update)
    assert seen == [(0, 0, 3), (1, 3, 6), (2, 6, 9), (3, 9, 10)]
    np.testing.assert_array_equal(s.array("params"), 2 * np.arange(10))
    np.testing.assert_array_equal(s.array("adam.m"), np.ones(10))
    assert s.chunks_read == s.chunks_written == 4
    s.close()


@pytest.mark.parametrize("max_chunks", [1, 2, 4])
def test_prefetch_never_holds_more_than_max_chunks_even_with_a_slow_update(tmp_path, max_chunks):
    s = store(tmp_path, length=40, chunk_elems=2, max_chunks=max_chunks)
    seen_resident = []

    def update(i, lo, hi, arrays):
        threading.Event().wait(0.002)  # let the reader run ahead as far as it may
        seen_resident.append(s.resident)

    s.stream(update)
    assert s.max_resident == max_chunks
    assert max(seen_resident) <= max_chunks and s.resident == 0
    s.close()


def test_an_update_error_is_raised_and_leaves_no_resident_chunks(tmp_path):
    s = store(tmp_path)

    def update(i, lo, hi, arrays):
        if i == 1:
            raise ValueError("boom")
        arrays["params"] += 1

    with pytest.raises(ValueError, match="boom"):
        s.stream(update)
    assert s.resident == 0
    np.testing.assert_array_equal(s.array("params")[:3], np.ones(3))
    s.close()


def test_empty_tensor_streams_nothing(tmp_path):
    s = store(tmp_path, length=0)
    s.stream(lambda *a: pytest.fail("no chunk expected"))
    assert s.array("params").shape == (0,) and s.num_chunks == 0
    s.close()


def test_unwritable_directory_raises_config_error_naming_it(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ConfigError, match="offload directory .*file"):
        store(blocker)


def test_bad_chunk_settings_raise_config_error(tmp_path):
    with pytest.raises(ConfigError, match="max_chunks >= 1"):
        store(tmp_path, max_chunks=0)
