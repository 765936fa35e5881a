"""rtxmpi.wal: append, read back, durability every k rows, a crashed writer, a cut file, bad files."""
import os
import shutil
import subprocess
import sys
import textwrap

import h5py
import numpy as np
import pytest

from rtxmpi.errors import CheckpointError, ConfigError
from rtxmpi.wal import (NO_DIGEST, RECORD_DTYPE, ResumeParity, WriteAheadLog, check_checkpoint_record,
                        params_digest, read_wal)


def append(wal, step, **extra):
    fields = dict(step=step, samples_consumed=8 * step, loss=4.0 - step / 7, lr=1e-3 * step,
                  grad_norm=0.5 + step, world_size=2)
    fields.update(extra)
    wal.append(**fields)


def test_appended_records_read_back_exactly(tmp_path):
    path = tmp_path / "wal.h5"
    with WriteAheadLog(path, every=3) as wal:
        for step in range(1, 6):
            append(wal, step, params_digest=params_digest(np.arange(step, dtype=np.float32)))
    records = read_wal(path)
    assert records.dtype == RECORD_DTYPE and list(records["step"]) == [1, 2, 3, 4, 5]
    assert records["loss"][2] == 4.0 - 3 / 7 and records["samples_consumed"][4] == 40
    assert records["params_digest"][1] == params_digest(np.arange(2, dtype=np.float32))
    assert (records["world_size"] == 2).all() and (records["wall_time"] > 0).all()


def test_rows_become_durable_every_k_appends(tmp_path):
    wal = WriteAheadLog(tmp_path / "wal.h5", every=4)
    for step in range(1, 7):
        append(wal, step)
    assert (wal.rows, wal.durable_rows) == (6, 4)
    wal.sync()
    assert wal.durable_rows == 6 and len(read_wal(tmp_path / "wal.h5")) == 6  # writer still open
    wal.close()


def test_crashed_writer_keeps_the_rows_synced_before_the_crash(tmp_path):
    path = tmp_path / "wal.h5"
    script = textwrap.dedent(f"""
        import os
        from rtxmpi.wal import WriteAheadLog
        wal = WriteAheadLog({str(path)!r}, every=5)
        for step in range(1, 13):
            wal.append(step=step, samples_consumed=step, loss=1.0, lr=0.1, grad_norm=1.0)
        os._exit(9)  # rows 11 and 12 were never synced
    """)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 9, proc.stderr
    assert list(read_wal(path)["step"]) == list(range(1, 11))


def test_log_cut_short_returns_the_rows_before_the_cut(tmp_path):
    path = tmp_path / "wal.h5"
    with WriteAheadLog(path, every=1000) as wal:
        for step in range(1, 601):  # three chunks of rows
            append(wal, step)
    with h5py.File(path, "r") as f:
        last_chunk = f["records"].id.get_chunk_info(2).byte_offset
    os.truncate(path, last_chunk + 10)
    steps = read_wal(path)["step"]
    assert 0 < len(steps) < 600 and list(steps) == list(range(1, len(steps) + 1))


def test_new_log_starts_with_the_kept_records_and_replaces_the_old_file(tmp_path):
    path = tmp_path / "wal.h5"
    with WriteAheadLog(path) as wal:
        for step in range(1, 9):
            append(wal, step)
    kept = read_wal(path)
    kept = kept[kept["step"] <= 5]
    with WriteAheadLog(path, records=kept) as wal:
        append(wal, 6, loss=9.0)
    records = read_wal(path)
    assert list(records["step"]) == [1, 2, 3, 4, 5, 6] and records["loss"][5] == 9.0
    assert not os.path.exists(str(path) + ".tmp")


def test_missing_or_foreign_files_raise_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="no write-ahead log"):
        read_wal(tmp_path / "none.h5")
    (tmp_path / "text.h5").write_text("not hdf5")
    with pytest.raises(CheckpointError, match="not an rtxmpi write-ahead log"):
        read_wal(tmp_path / "text.h5")
    with h5py.File(tmp_path / "other.h5", "w") as f:
        f["records"] = np.arange(3)
    with pytest.raises(CheckpointError, match="not an rtxmpi write-ahead log"):
        read_wal(tmp_path / "other.h5")
    with pytest.raises(ConfigError):
        WriteAheadLog(tmp_path / "w.h5", every=0)


def test_no_pickle_in_the_file(tmp_path):
    path = tmp_path / "wal.h5"
    with WriteAheadLog(path) as wal:
        append(wal, 1)
    with h5py.File(path, "r") as f:
        assert f["records"].dtype == RECORD_DTYPE and f.attrs["rtxmpi_wal_version"] == 1
    assert b"pickle" not in path.read_bytes()


def test_params_digest_sees_one_flipped_bit():
    flat = np.linspace(-1, 1, 1000, dtype=np.float32)
    before = params_digest(flat)
    flat.view(np.uint32)[123] ^= 1
    assert params_digest(flat) != before and 0 <= before < 2**32


def test_resume_parity_is_bitwise_and_names_the_step(tmp_path):
    records = np.zeros(3, RECORD_DTYPE)
    records["step"], records["loss"], records["lr"] = [11, 12, 13], [2.5, 2.4, 2.3], 1e-3
    records["params_digest"] = [NO_DIGEST, 77, NO_DIGEST]
    parity = ResumeParity("CKPT/wal.h5", records)
    assert (parity.first_step, parity.last_step) == (11, 13) and parity.wants_digest(12) and not parity.wants_digest(11)
    assert parity.check(11, 2.5, 1e-3) is None and parity.check(12, 2.4, 1e-3, digest=77) is None
    assert parity.digests_checked == 1
    message = parity.check(13, np.nextafter(2.3, 3.0), 1e-3)
    assert message.startswith("CKPT/wal.h5 step 13: recomputed loss") and "\n" not in message
    assert "parameter digest" in parity.check(12, 2.4, 1e-3, digest=78)
    assert "learning rate" in parity.check(11, 2.5, 2e-3)
    assert "gradient norm" in parity.check(11, 2.5, 1e-3, 1.0)  # logged 0.0
    assert parity.check(14, 0.0, 0.0) is None  # not logged: nothing to compare


@pytest.mark.parametrize("tool", [["h5dump", "-d", "/records"], ["h5ls", "-r", "-d"]])
def test_wal_reads_with_the_hdf5_command_line_tools(tmp_path, tool):
    """h5dump/h5ls of HDF5 1.10 (Debian's hdf5-tools) read the log: its records, not an error."""
    if shutil.which(tool[0]) is None:
        pytest.skip(f"{tool[0]} not installed (apt-get install hdf5-tools)")
    path = tmp_path / "wal.h5"
    with WriteAheadLog(path, every=2) as wal:
        for step in range(1, 6):
            wal.append(step=step, samples_consumed=8 * step, loss=3.25, lr=0.5, grad_norm=1.0)
    proc = subprocess.run([*tool, str(path)], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "error" not in (proc.stdout + proc.stderr).lower(), proc
    assert "3.25" in proc.stdout and "40" in proc.stdout, proc.stdout


def test_a_log_written_in_the_latest_hdf5_format_still_reads(tmp_path):
    path = tmp_path / "wal.h5"
    rows = np.array([(s, 8 * s, 1.5, 0.1, 1.0, 0.0, 2, NO_DIGEST) for s in (1, 2, 3)], RECORD_DTYPE)
    with h5py.File(path, "w", libver="latest") as f:  # what rtxmpi wrote before the 1.10 format
        f.attrs["rtxmpi_wal_version"] = 1
        f.create_dataset("records", data=rows, maxshape=(None,), chunks=(256,))
    assert np.array_equal(read_wal(path), rows)


def test_checkpoint_record_must_agree_with_the_checkpoints_samples_consumed(tmp_path):
    records = np.array([(s, 8 * s, 1.5, 0.1, 1.0, 0.0, 2, NO_DIGEST) for s in (5, 6, 7)], RECORD_DTYPE)
    assert check_checkpoint_record("wal.h5", records, 6, 48) is None
    assert check_checkpoint_record("wal.h5", records, 9, 123) is None  # not logged: nothing to compare
    message = check_checkpoint_record("wal.h5", records, 6, 56)
    assert message == ("wal.h5 step 6: the checkpoint says 56 samples consumed, the log recorded 48: "
                       "checkpoint and log disagree (an edited metadata.json, or the log of another run)")


def test_checkpoint_record_must_agree_with_the_checkpoints_loss_bit_for_bit():
    records = np.array([(s, 8 * s, 1.5, 0.1, 1.0, 0.0, 2, NO_DIGEST) for s in (5, 6)], RECORD_DTYPE)
    assert check_checkpoint_record("wal.h5", records, 6, 48, loss=1.5) is None
    assert check_checkpoint_record("wal.h5", records, 6, 48, loss=None) is None  # not recorded
    message = check_checkpoint_record("wal.h5", records, 6, 48, loss=np.nextafter(1.5, 2))
    assert message.startswith("wal.h5 step 6: the checkpoint says loss 1.5000000000000002, the log "
                              "recorded 1.5: checkpoint and log disagree")
