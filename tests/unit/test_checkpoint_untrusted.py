"""Checkpoint files as untrusted input: each crafted directory is refused with a CheckpointError
(never a crash, a hang, a huge allocation or a read outside the step directory)."""
import json
import os
import threading

import h5py
import numpy as np
import pytest

from rtxmpi.checkpoint import (Shard, latest_valid, load_checkpoint, save_checkpoint,
                               verify_checkpoint)
from rtxmpi.checkpoint import format as fmt
from rtxmpi.errors import CheckpointError

STEP = "step_00000001"


def save(ckpt_dir, step=1, rank_state=None):
    rng = np.random.default_rng(step)
    arrays = {"params": rng.standard_normal(300).astype(np.float32), "adam.v": rng.random(300)}
    shards = {name: Shard(a, 0, a.size) for name, a in arrays.items()}
    save_checkpoint(None, ckpt_dir, step, shards, meta={"samples_consumed": 8 * step},
                    rank_state=rank_state)
    return arrays


def edit_metadata(ckpt_dir, edit, resign=True, step_name=STEP):
    """Apply `edit(metadata)` to metadata.json; resign: with a matching checksum, so the
    schema and file checks (not the checksum) must catch it."""
    path = ckpt_dir / step_name / "metadata.json"
    metadata = json.loads(path.read_text())
    edit(metadata)
    if resign:
        metadata[fmt.METADATA_CHECKSUM] = fmt.metadata_checksum(metadata)
    path.write_text(json.dumps(metadata))


def rewrite_rank_file(ckpt_dir, build):
    """Change rank_00000.h5 in place with `build(h5file)` (which replaces /tensors/params, say),
    and record its new size."""
    path = ckpt_dir / STEP / "rank_00000.h5"
    with h5py.File(path, "a") as f:
        del f["tensors/params"]
        build(f)
    edit_metadata(ckpt_dir, lambda m: m["files"]["rank_00000.h5"].update(bytes=path.stat().st_size))


def refused(ckpt_dir, match):
    """Both readers (load + read everything, and verify) raise CheckpointError matching `match`."""
    with pytest.raises(CheckpointError, match=match):
        verify_checkpoint(ckpt_dir)
    with pytest.raises(CheckpointError, match=match):
        ckpt = load_checkpoint(None, ckpt_dir)
        ckpt.read_many({name: (0, None, None) for name in ckpt.tensors})
        ckpt.rank_state(0)


def test_intact_checkpoint_verifies_and_its_metadata_carries_its_checksum(tmp_path):
    arrays = save(tmp_path)
    metadata = json.loads((tmp_path / STEP / "metadata.json").read_text())
    assert metadata["format_version"] == 3
    assert metadata[fmt.METADATA_CHECKSUM] == fmt.metadata_checksum(metadata)
    assert verify_checkpoint(tmp_path)
    assert np.array_equal(load_checkpoint(None, tmp_path).read("params"), arrays["params"])


def test_edited_metadata_fails_its_checksum(tmp_path):
    save(tmp_path)
    edit_metadata(tmp_path, lambda m: m["meta"].update(samples_consumed=56), resign=False)
    refused(tmp_path, "metadata_checksum .* does not match its content")


def test_old_format_without_metadata_checksum_loads_with_a_warning(tmp_path):
    arrays = save(tmp_path)
    edit_metadata(tmp_path, lambda m: (m.pop(fmt.METADATA_CHECKSUM), m.update(format_version=2)),
                  resign=False)
    warnings = []
    verify_checkpoint(tmp_path, warnings=warnings)
    assert len(warnings) == 1 and "format_version 2" in warnings[0]
    ckpt = load_checkpoint(None, tmp_path)
    assert np.array_equal(ckpt.read("params"), arrays["params"]) and ckpt.warnings == warnings
    edit_metadata(tmp_path, lambda m: m.update(format_version=3), resign=False)
    refused(tmp_path, "no metadata_checksum, which format_version 3 carries")


@pytest.mark.parametrize("edit, match", [
    (lambda m: m.pop("files"), "required field 'files' is missing"),
    (lambda m: m.pop("tensors"), "required field 'tensors' is missing"),
    (lambda m: m.update(tensors=[]), r"\.tensors: expected dict, got list"),
    (lambda m: m.update(world_size="2"), r"\.world_size: expected int"),
    (lambda m: m.update(step=True), r"\.step: expected int"),
    (lambda m: m["tensors"]["params"].update(global_size=301), "pieces cover 300 of its 301"),
    (lambda m: m["tensors"]["params"]["pieces"][0].update(length=2**40),
     r"pieces cover 1099511627776 of its 300"),
    (lambda m: m["files"]["rank_00000.h5"].update(bytes=-1), r"bytes: expected int in \[0"),
    (lambda m: m["meta"].clear() or m.update(meta=[1]), r"\.meta: expected dict"),
])
def test_metadata_schema_errors_name_the_field(tmp_path, edit, match):
    save(tmp_path)
    edit_metadata(tmp_path, edit)
    refused(tmp_path, match)


@pytest.mark.parametrize("dtype", ["|O", "<U8", "V2000000000", "[('a', '<f4')]", 7])
def test_dtypes_outside_the_allowlist_are_refused(tmp_path, dtype):
    save(tmp_path)
    edit_metadata(tmp_path, lambda m: m["tensors"]["params"].update(dtype=dtype))
    refused(tmp_path, r"\['params'\](: |\.)dtype")


@pytest.mark.parametrize("file", ["/etc/passwd", "../../x.h5", "rank_00000.h5/../../x.h5",
                                  "sub/rank_00000.h5"])
def test_piece_files_outside_the_step_directory_are_refused(tmp_path, file):
    save(tmp_path)
    edit_metadata(tmp_path, lambda m: m["tensors"]["params"]["pieces"][0].update(file=file))
    refused(tmp_path, "is not one of the checkpoint's rank files")


def test_rank_file_names_must_be_the_ranks_own(tmp_path):
    save(tmp_path)
    edit_metadata(tmp_path, lambda m: m["files"].update({"../x.h5": m["files"].pop("rank_00000.h5")}))
    refused(tmp_path, r"expected exactly the rank files of world_size 1 .* differs at \['../x.h5'")


def test_symlinked_rank_file_is_refused_even_to_an_intact_copy(tmp_path):
    save(tmp_path)
    step_dir = tmp_path / STEP
    os.rename(step_dir / "rank_00000.h5", tmp_path / "elsewhere.h5")
    os.symlink(tmp_path / "elsewhere.h5", step_dir / "rank_00000.h5")
    refused(tmp_path, "not a regular file")


def test_fifo_as_rank_file_is_refused_without_blocking(tmp_path):
    save(tmp_path)
    path = tmp_path / STEP / "rank_00000.h5"
    size = path.stat().st_size
    path.unlink()
    os.mkfifo(path)
    edit_metadata(tmp_path, lambda m: m["files"]["rank_00000.h5"].update(bytes=size))
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(_raised(verify_checkpoint, tmp_path)),
                              daemon=True)
    worker.start()
    worker.join(30)
    assert outcome and "not a regular file" in outcome[0], "verify blocked on the FIFO"
    assert "not a regular file" in _raised(load_checkpoint, None, tmp_path)


def test_fifo_as_metadata_is_refused_without_blocking(tmp_path):
    save(tmp_path)
    path = tmp_path / STEP / "metadata.json"
    path.unlink()
    os.mkfifo(path)
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(_raised(load_checkpoint, None, tmp_path, 1)),
                              daemon=True)
    worker.start()
    worker.join(30)
    assert outcome and "not a regular file" in outcome[0], "load blocked on the FIFO"


def _raised(func, *args):
    try:
        func(*args)
    except CheckpointError as exc:
        return str(exc)
    return "no error"


def test_external_link_is_not_followed(tmp_path):
    arrays = save(tmp_path)
    outside = tmp_path / "outside.h5"
    with h5py.File(outside, "w") as f:
        f["params"] = arrays["params"]

    rewrite_rank_file(tmp_path, lambda f: f["tensors"].__setitem__(
        "params", h5py.ExternalLink(str(outside), "params")))
    refused(tmp_path, "/tensors/params is a ExternalLink")


def test_external_raw_storage_is_not_read(tmp_path):
    save(tmp_path)
    raw = tmp_path / "raw.bin"
    raw.write_bytes(np.zeros(300, np.float32).tobytes())

    rewrite_rank_file(tmp_path, lambda f: f.create_dataset("tensors/params", shape=(300,), dtype="<f4",
                                                           external=[(str(raw), 0, 1200)]))
    refused(tmp_path, "/tensors/params: stored as layout .* 1 external file")


def test_virtual_dataset_is_not_read(tmp_path):
    save(tmp_path)
    source = tmp_path / "source.h5"
    with h5py.File(source, "w") as f:
        f["x"] = np.zeros(300, np.float32)
    layout = h5py.VirtualLayout(shape=(300,), dtype="<f4")
    layout[:] = h5py.VirtualSource(str(source), "x", shape=(300,))
    rewrite_rank_file(tmp_path, lambda f: f.create_virtual_dataset("tensors/params", layout))
    refused(tmp_path, "/tensors/params: stored as layout")


def test_huge_declared_rank_state_is_refused_before_any_allocation(tmp_path):
    save(tmp_path)

    # 2^31 float64 (16 GiB) declared in a file of a few KB: never written
    rewrite_rank_file(tmp_path, lambda f: f.create_dataset("rank_state/rng", shape=(2**31,), dtype="<f8"))
    edit_metadata(tmp_path, lambda m: m["tensors"].pop("params"))
    refused(tmp_path, r"/rank_state/rng: its 17179869184 bytes at offset None do not lie in the file")


def test_object_dtype_dataset_is_refused_before_its_bytes_are_read(tmp_path):
    save(tmp_path)
    rewrite_rank_file(tmp_path, lambda f: f.create_dataset(
        "tensors/params", data=np.array(["x" * 9] * 300, dtype=h5py.string_dtype())))
    refused(tmp_path, "/tensors/params: dtype '\\|O' is not one a checkpoint holds")


def test_dataset_larger_than_its_file_is_refused_at_once(tmp_path):
    save(tmp_path)

    rewrite_rank_file(tmp_path, lambda f: f.create_dataset("tensors/params", shape=(2**40,), dtype="<f4"))
    edit_metadata(tmp_path, lambda m: m["tensors"].update(params={
        "dtype": "<f4", "global_size": 2**40,
        "pieces": [{"file": "rank_00000.h5", "offset": 0, "length": 2**40, "checksum": "crc32c:00000000"}]}))
    refused(tmp_path, r"its pieces need 43980465\d+ bytes, the file has \d+$")


def test_latest_valid_falls_back_past_a_corrupt_newest_checkpoint(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    save(tmp_path, 3)
    edit_metadata(tmp_path, lambda m: m["meta"].update(samples_consumed=0), resign=False,
                  step_name="step_00000003")
    os.truncate(tmp_path / "step_00000002" / "rank_00000.h5", 100)
    step, skipped = latest_valid(None, tmp_path)
    assert step == 1 and [os.path.basename(p) for p, _ in skipped] == ["step_00000003", "step_00000002"]
    assert "metadata_checksum" in skipped[0][1] and "truncated" in skipped[1][1]
    with pytest.raises(CheckpointError, match="step_00000003.*metadata_checksum"):
        latest_valid(None, tmp_path, fallback=False)
    os.truncate(tmp_path / "step_00000001" / "rank_00000.h5", 100)
    step, skipped = latest_valid(None, tmp_path)
    assert step is None and len(skipped) == 3


def test_variable_length_string_attributes_are_refused_in_format_3(tmp_path):
    """Their text lives in HDF5's global heap, which has no checksum: a damaged reference there
    made HDF5 loop forever; rtxmpi writes fixed-length strings since format 3."""
    save(tmp_path)
    path = tmp_path / STEP / "rank_00000.h5"
    with h5py.File(path, "a") as f:
        f.attrs["rank_state_json"] = "{}"  # h5py stores a str as a variable-length string
    edit_metadata(tmp_path, lambda m: m["files"]["rank_00000.h5"].update(bytes=path.stat().st_size))
    refused(tmp_path, "attribute rank_state_json is .* not a str")


def test_tensor_missing_from_metadata_is_an_error_not_a_smaller_checkpoint(tmp_path):
    save(tmp_path)
    edit_metadata(tmp_path, lambda m: m["tensors"].pop("adam.v"))
    refused(tmp_path, "holds dataset /tensors/adam.v of shape \\(300,\\), which metadata.json does not list")


def test_fifo_as_latest_is_ignored_without_blocking(tmp_path):
    save(tmp_path, 1)
    save(tmp_path, 2)
    (tmp_path / "latest").unlink()
    os.mkfifo(tmp_path / "latest")
    outcome = []
    worker = threading.Thread(target=lambda: outcome.append(latest_valid(None, tmp_path)), daemon=True)
    worker.start()
    worker.join(30)
    assert outcome == [(2, [])], "latest_valid blocked on the FIFO"  # the highest committed step
