"""Checkpoint files in one process (group None): format, commit marker, latest, corruption."""
import json
import os

import h5py
import numpy as np
import pytest

from rtxmpi.checkpoint import (Shard, latest_step, list_checkpoints, load_checkpoint,
                               save_checkpoint, verify_checkpoint)
from rtxmpi.checkpoint import format as fmt
from rtxmpi.errors import CheckpointError


def tensors(seed=0):
    rng = np.random.default_rng(seed)
    return {"params": rng.standard_normal(1001).astype(np.float32),
            "adam.v": rng.random(1001),  # float64
            "counts": np.arange(7, dtype=np.int64)}


def save(ckpt_dir, step, arrays=None, **kwargs):
    arrays = tensors(step) if arrays is None else arrays
    shards = {name: Shard(a, 0, a.size) for name, a in arrays.items()}
    return save_checkpoint(None, ckpt_dir, step, shards, meta={"samples_consumed": 8 * step},
                           **kwargs)


def flip_byte(path, dataset, index=3):
    """Flip one byte inside `dataset`'s stored data (its file offset from h5py)."""
    with h5py.File(path, "r") as f:
        offset = f[dataset].id.get_offset()
    with open(path, "r+b") as f:
        f.seek(offset + index)
        byte = f.read(1)
        f.seek(offset + index)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_round_trip_is_exact_for_every_dtype(tmp_path):
    arrays = tensors()
    path = save(tmp_path, 5, arrays, rank_state={"rank": 0, "rng": np.arange(4, dtype=np.uint64)})
    assert path == str(tmp_path / "step_00000005")
    ckpt = load_checkpoint(None, tmp_path)
    assert (ckpt.step, ckpt.world_size_saved, ckpt.meta) == (5, 1, {"samples_consumed": 40})
    for name, a in arrays.items():
        got = ckpt.read(name)
        assert got.dtype == a.dtype and np.array_equal(got, a)
        assert np.array_equal(ckpt.read(name, 2, 4), a[2:6])
    state = ckpt.rank_state(3)  # any rank maps to saved rank 3 % 1 == 0
    assert state["rank"] == 0 and np.array_equal(state["rng"], np.arange(4, dtype=np.uint64))


def test_read_into_out_fills_the_given_buffer(tmp_path):
    arrays = tensors()
    save(tmp_path, 1, arrays)
    out = np.zeros(1001, np.float32)
    assert load_checkpoint(None, tmp_path).read("params", out=out) is out
    assert np.array_equal(out, arrays["params"])


def test_datasets_carry_global_shape_offset_and_checksum(tmp_path):
    save(tmp_path, 1)
    with h5py.File(tmp_path / "step_00000001" / "rank_00000.h5", "r") as f:
        ds = f["tensors/params"]
        assert list(ds.attrs["global_shape"]) == [1001] and int(ds.attrs["global_offset"]) == 0
        assert ds.attrs["checksum"] == fmt.checksum(ds[()]).encode()
        # fixed-length, stored inline: no string in HDF5's global heap, which has no checksum
        assert h5py.check_string_dtype(ds.attrs.get_id("checksum").dtype).length == 15
        assert ds.dtype == np.float32 and ds.chunks is None  # contiguous: one offset on disk


def test_files_hold_no_pickle_only_numbers_strings_and_json(tmp_path):
    save(tmp_path, 1, rank_state={"seed": 3, "rng": np.arange(3)})
    step_dir = tmp_path / "step_00000001"
    json.loads((step_dir / "metadata.json").read_text())
    seen = []

    def check(name, obj):
        for value in obj.attrs.values():
            assert isinstance(value, (np.bytes_, np.ndarray, np.integer, np.floating)), (name, value)
            if isinstance(value, np.ndarray):
                assert value.dtype.kind in "biuf", (name, value.dtype)
        if isinstance(obj, h5py.Dataset):
            assert obj.dtype.kind in "biuf", (name, obj.dtype)
            seen.append(name)

    with h5py.File(step_dir / "rank_00000.h5", "r") as f:
        check("/", f)
        f.visititems(check)
    assert "tensors/params" in seen and "rank_state/rng" in seen
    assert sorted(os.listdir(step_dir)) == ["metadata.json", "rank_00000.h5"]  # no tmp files left


def test_flipped_byte_raises_naming_file_and_dataset(tmp_path):
    save(tmp_path, 1)
    path = tmp_path / "step_00000001" / "rank_00000.h5"
    flip_byte(path, "tensors/params")
    ckpt = load_checkpoint(None, tmp_path)  # sizes still match: the open succeeds
    assert np.array_equal(ckpt.read("counts"), np.arange(7))  # untouched dataset still reads
    with pytest.raises(CheckpointError, match="checksum mismatch") as info:
        ckpt.read("params", 500, 1)  # far from the flipped byte: the whole dataset is checked
    assert str(path) in str(info.value) and "/tensors/params" in str(info.value)
    with pytest.raises(CheckpointError, match="rank_00000.h5: dataset /tensors/params"):
        verify_checkpoint(tmp_path)


def test_truncated_file_raises_naming_it(tmp_path):
    save(tmp_path, 1)
    path = tmp_path / "step_00000001" / "rank_00000.h5"
    os.truncate(path, os.path.getsize(path) - 100)
    with pytest.raises(CheckpointError, match="rank_00000.h5.*truncated"):
        load_checkpoint(None, tmp_path)
    with pytest.raises(CheckpointError, match="rank_00000.h5"):
        verify_checkpoint(tmp_path)


def test_missing_rank_file_raises_naming_it(tmp_path):
    save(tmp_path, 1)
    os.remove(tmp_path / "step_00000001" / "rank_00000.h5")
    with pytest.raises(CheckpointError, match="rank_00000.h5: rank file is missing"):
        load_checkpoint(None, tmp_path)


def test_directory_without_metadata_is_uncommitted_and_ignored(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    os.remove(tmp_path / "step_00000002" / "metadata.json")  # as if the coordinator died first
    assert latest_step(tmp_path) == 1  # latest names step 2, which is not committed
    info = {c.step: c for c in list_checkpoints(tmp_path)}
    assert not info[2].committed and info[1].committed and info[1].latest
    ckpt = load_checkpoint(None, tmp_path)
    assert ckpt.step == 1 and ckpt.ignored == [str(tmp_path / "step_00000002")]
    with pytest.raises(CheckpointError, match="never committed"):
        load_checkpoint(None, tmp_path, step=2)


def test_a_step_that_does_not_exist_is_named_so_with_the_committed_ones(tmp_path, capsys):
    from rtxmpi.cli import main
    save(tmp_path, 1)
    save(tmp_path, 3)
    with pytest.raises(CheckpointError, match="step_00000002: no such checkpoint"):
        load_checkpoint(None, tmp_path, step=2)
    for command in (["ckpt", "verify", str(tmp_path), "--step", "2"],
                    ["ckpt", "inspect", str(tmp_path), "--step", "2"]):
        assert main(command) == 1
        err = capsys.readouterr().err
        assert "no such checkpoint" in err and f"(committed steps in {tmp_path}: 1, 3)" in err, err
    assert main(["ckpt", "verify", str(tmp_path)]) == 0
    assert capsys.readouterr().out.startswith("ok: step 3 (latest): ")


def test_ckpt_ls_marks_a_committed_step_whose_metadata_fails_its_checks(tmp_path, capsys):
    from rtxmpi.cli import main
    save(tmp_path, 1)
    save(tmp_path, 2)
    meta = tmp_path / "step_00000002" / "metadata.json"
    meta.write_text(meta.read_text().replace('"world_size": 1', '"world_size": 2'))  # edited
    info = {c.step: c for c in list_checkpoints(tmp_path)}
    assert info[2].committed and "metadata_checksum" in info[2].problem and info[1].problem is None
    assert main(["ckpt", "ls", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "CORRUPT" in out and "UNCOMMITTED" not in out and "step 2: " in out
    assert "--resume skips a checkpoint that does not verify" in out


def test_ckpt_inspect_prints_a_summary_and_everything_with_all(tmp_path, capsys):
    shards = {f"t{i:02d}": Shard(np.arange(4, dtype=np.float32), 0, 4) for i in range(25)}
    from rtxmpi.cli import main as cli_main
    save_checkpoint(None, tmp_path, 3, shards, meta={"layout": [[f"p{i}", [4, 4], 16 * i]
                                                                for i in range(40)], "seed": 7})
    assert cli_main(["ckpt", "inspect", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].endswith("step 3, saved by 1 rank, 25 tensors, 400 B")
    assert lines[2].split() == ["t00", "float32", "(4,)", "1"]  # name, dtype, shape, pieces
    assert "... 5 more tensors (--all lists every one)" in lines
    assert "  layout: list of 40 items" in lines and "  seed: 7" in lines
    assert len(lines) == 27  # 2 header lines, 20 tensors, 1 more, meta: 2 values and a hint
    assert cli_main(["ckpt", "inspect", str(tmp_path), "--all"]) == 0
    out = capsys.readouterr().out
    assert "t24 " in out and "rank_00000.h5 [0, 4)" in out and '"p39",' in out


def test_next_save_of_an_uncommitted_step_replaces_it(tmp_path):
    step_dir = tmp_path / "step_00000003"
    step_dir.mkdir(parents=True)
    (step_dir / "rank_00007.h5.tmp").write_bytes(b"stale")
    save(tmp_path, 3)
    assert sorted(os.listdir(step_dir)) == ["metadata.json", "rank_00000.h5"]
    assert latest_step(tmp_path) == 3


def test_committed_step_is_not_overwritten_unless_asked(tmp_path):
    save(tmp_path, 4, tensors(0))
    with pytest.raises(CheckpointError, match="already a committed checkpoint"):
        save(tmp_path, 4, tensors(1))
    save(tmp_path, 4, tensors(1), overwrite=True)
    assert np.array_equal(load_checkpoint(None, tmp_path).read("params"), tensors(1)["params"])


def test_latest_is_replaced_atomically(tmp_path, monkeypatch):
    save(tmp_path, 1)
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"
    real_replace = os.replace

    def failing_replace(src, dst):
        if os.path.basename(dst) == "latest":
            raise OSError("disk full")
        return real_replace(src, dst)

    monkeypatch.setattr(fmt.os, "replace", failing_replace)
    with pytest.raises(CheckpointError, match="disk full"):
        save(tmp_path, 2)
    assert (tmp_path / "latest").read_text().strip() == "step_00000001"  # never half-written
    monkeypatch.setattr(fmt.os, "replace", real_replace)
    save(tmp_path, 3)
    assert (tmp_path / "latest").read_text().strip() == "step_00000003"
    assert not (tmp_path / "latest.tmp").exists()


def test_latest_prefers_the_named_step_over_a_higher_one(tmp_path):
    save(tmp_path, 9)
    save(tmp_path, 2)  # a later run in the same directory
    assert latest_step(tmp_path) == 2
    os.remove(tmp_path / "latest")
    assert latest_step(tmp_path) == 9  # no latest file: the highest committed step


def test_no_checkpoint_raises(tmp_path):
    assert latest_step(tmp_path / "nothing") is None and list_checkpoints(tmp_path) == []
    with pytest.raises(CheckpointError, match="no committed checkpoint"):
        load_checkpoint(None, tmp_path)


def test_bad_reads_raise(tmp_path):
    save(tmp_path, 1)
    ckpt = load_checkpoint(None, tmp_path)
    with pytest.raises(CheckpointError, match="no tensor 'nope'"):
        ckpt.read("nope")
    with pytest.raises(CheckpointError, match="outside its 1001 elements"):
        ckpt.read("params", 1000, 2)
    with pytest.raises(CheckpointError, match="contiguous"):
        ckpt.read("params", out=np.zeros(1001, np.float64))


def test_pieces_must_cover_each_tensor(tmp_path):
    with pytest.raises(CheckpointError, match="cover 10 of 20 elements"):
        save_checkpoint(None, tmp_path, 1, {"params": Shard(np.zeros(10), 0, 20)})
    assert latest_step(tmp_path) is None  # nothing committed


def test_shard_checks_and_even_split():
    with pytest.raises(CheckpointError, match="1-D"):
        Shard(np.zeros((2, 2)), 0, 4)
    with pytest.raises(CheckpointError, match="outside"):
        Shard(np.zeros(3), 2, 4)
    full = np.arange(10)
    pieces = [Shard.even(full, r, 3) for r in range(3)]
    assert [(p.global_offset, p.data.size) for p in pieces] == [(0, 3), (3, 3), (6, 4)]
    assert np.array_equal(np.concatenate([p.data for p in pieces]), full)


def test_bad_tensor_name_and_meta_raise(tmp_path):
    with pytest.raises(CheckpointError, match="dataset name"):
        save_checkpoint(None, tmp_path, 1, {"a/b": Shard(np.zeros(2), 0, 2)})
    with pytest.raises(CheckpointError, match="not JSON serializable"):
        save_checkpoint(None, tmp_path, 1, {"a": Shard(np.zeros(2), 0, 2)}, meta={"x": object()})


def test_reads_spanning_many_chunks_are_exact_and_verified(tmp_path, monkeypatch):
    monkeypatch.setattr(fmt, "READ_CHUNK_BYTES", 64)  # 16 float32 per chunk: ~63 chunks
    arrays = tensors(5)
    path = save(tmp_path, 5, arrays)
    ckpt = load_checkpoint(None, tmp_path)
    full = arrays["params"]
    for start, length in ((0, full.size), (0, 0), (3, 40), (17, 500), (999, 2), (32, 16)):
        assert np.array_equal(ckpt.read("params", start, length), full[start:start + length])
    out = np.empty(full.size, np.float32)
    ckpt.read("params", out=out)  # every chunk straight into out
    assert np.array_equal(out, full)
    flip_byte(os.path.join(path, fmt.rank_file_name(0)), "tensors/params", index=4 * 900)
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        ckpt.read("params", 0, 10)  # the flipped byte lies in a chunk not wanted: still caught


def test_written_checksum_equals_the_checksum_of_the_bytes(tmp_path):
    arrays = tensors(6)
    written = fmt.write_rank_file(str(tmp_path / "r.h5"), {n: Shard(a, 0, a.size)
                                                           for n, a in arrays.items()})
    for name, a in arrays.items():
        assert written[name]["checksum"] == fmt.checksum(a), name


def test_checksums_are_crc32c_of_the_bytes():
    assert fmt.checksum(np.frombuffer(b"123456789", np.uint8)) == "crc32c:e3069283"  # RFC 3720 check value
    assert fmt.checksum(np.frombuffer(b"123456789", np.uint8), "crc32") == "crc32:cbf43926"


def test_format_version_1_with_zlib_crc32_still_loads_and_verifies(tmp_path, monkeypatch):
    arrays = tensors(7)
    with monkeypatch.context() as m:  # what rtxmpi wrote before crc32c
        m.setattr(fmt, "FORMAT_VERSION", 1)
        m.setattr(fmt, "CHECKSUM_ALGORITHM", "crc32")
        m.setattr(fmt, "fixed_string", str)  # variable-length strings, as then
        save(tmp_path, 1, arrays, rank_state={"rng": np.arange(3)})
    step_dir = tmp_path / "step_00000001"
    assert json.loads((step_dir / "metadata.json").read_text())["format_version"] == 1
    with h5py.File(step_dir / "rank_00000.h5", "r") as f:
        assert f["tensors/params"].attrs["checksum"].startswith("crc32:")
    ckpt = load_checkpoint(None, tmp_path)
    for name, a in arrays.items():
        assert np.array_equal(ckpt.read(name), a)
    assert np.array_equal(ckpt.rank_state(0)["rng"], np.arange(3))
    verify_checkpoint(tmp_path)
    flip_byte(step_dir / "rank_00000.h5", "tensors/params")
    with pytest.raises(CheckpointError, match="checksum mismatch: data has crc32:"):
        load_checkpoint(None, tmp_path).read("params")


def resign(meta_path, metadata):
    """Write `metadata` with a matching metadata_checksum (an edit the checksum cannot see)."""
    metadata[fmt.METADATA_CHECKSUM] = fmt.metadata_checksum(metadata)
    meta_path.write_text(json.dumps(metadata))


def test_unknown_format_version_or_checksum_algorithm_raises_clearly(tmp_path):
    save(tmp_path, 1)
    step_dir = tmp_path / "step_00000001"
    meta_path = step_dir / "metadata.json"
    metadata = json.loads(meta_path.read_text())
    metadata["tensors"]["params"]["pieces"][0]["checksum"] = "sha0:00"
    resign(meta_path, metadata)
    with pytest.raises(CheckpointError, match=r"pieces\[0\].checksum: 'sha0:00' is not 'crc32c:'"):
        load_checkpoint(None, tmp_path)
    metadata["format_version"] = 99
    resign(meta_path, metadata)
    with pytest.raises(CheckpointError, match="format_version 99; this rtxmpi reads versions 1, 2, 3"):
        load_checkpoint(None, tmp_path)


def test_chunked_compressed_dataset_is_refused_before_it_is_read(tmp_path):
    """rtxmpi writes contiguous datasets; a chunked or filtered one would hand HDF5's filter
    pipeline bytes from the file, so it is refused."""
    a = np.random.default_rng(3).standard_normal(5000).astype(np.float32)
    with h5py.File(tmp_path / "rank_00000.h5", "w") as f:
        f.create_dataset("tensors/w", data=a, chunks=(700,), compression="gzip")
        f["tensors/w"].attrs["checksum"] = fmt.checksum(a)
    expected = {"length": a.size, "checksum": fmt.checksum(a), "dtype": "<f4"}
    with fmt.RankFile(str(tmp_path), "rank_00000.h5") as rank_file, \
            pytest.raises(CheckpointError, match="stored as layout 2 .* 1 filter"):
        fmt.read_piece(rank_file, "w", expected, 123, 4567)
