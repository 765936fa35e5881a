"""Seeded fuzzing of the checkpoint reader: every file of a real 2-rank checkpoint is damaged or
crafted (byte flips, truncations, deleted and retyped metadata fields, swapped dtypes and shapes,
symlinks, FIFOs, HDF5 links and foreign storage), and each case must end in a correct load
(the very arrays saved) or a CheckpointError, from both `load_checkpoint` + reads and
`verify_checkpoint`, within CASE_TIMEOUT_S: never another exception, a crash, a hang or a load
of other data. Each case runs in a forked child, so a crash or a hang is reported, not fatal.

Case i applies MUTATIONS[i % len(MUTATIONS)] (so every mutation kind runs, in the list's
proportions, whatever the number of cases) with random choices seeded by seed + i.
RTXMPI_FUZZ_CASES (default 280) sets the number of cases, RTXMPI_FUZZ_SEED (default 0) the
first seed (a failure names it; a longer hunt: RTXMPI_FUZZ_CASES=10000 and other seeds),
RTXMPI_FUZZ_TIMEOUT_S the bound per case (default 20 s).
"""
import json
import os
import random
import select
import shutil
import signal
import time
import traceback

import h5py
import numpy as np
import pytest

from rtxmpi.checkpoint import Shard, load_checkpoint, verify_checkpoint
from rtxmpi.checkpoint import format as fmt
from rtxmpi.errors import CheckpointError

CASES = int(os.environ.get("RTXMPI_FUZZ_CASES", "280"))
SEED = int(os.environ.get("RTXMPI_FUZZ_SEED", "0"))
# a case takes milliseconds; the margin is for a loaded machine
CASE_TIMEOUT_S = float(os.environ.get("RTXMPI_FUZZ_TIMEOUT_S", "20"))
STEP_DIR = "step_00000007"
FILES = ["metadata.json", "rank_00000.h5", "rank_00001.h5"]


def build(ckpt_dir):
    """A checkpoint as 2 ranks write it (pieces of 3 tensors in 2 files, rank state arrays);
    returns what a correct load must read back: {tensor: array}, [rank state per rank]."""
    rng = np.random.default_rng(11)
    tensors = {"params": rng.standard_normal(257).astype(np.float32), "adam.v": rng.random(257),
               "adam.step": np.array([7], np.int64)}
    step_dir = os.path.join(ckpt_dir, STEP_DIR)
    os.makedirs(step_dir)
    entries, files, states = {n: [] for n in tensors}, {}, []
    for rank in range(2):
        shards = {}
        for name, a in tensors.items():
            lo, hi = a.size * rank // 2, a.size * (rank + 1) // 2
            shards[name] = Shard(a[lo:hi], lo, a.size)
        state = {"rank": rank, "rng": np.arange(4, dtype=np.uint64) + rank}
        states.append(state)
        written = fmt.write_rank_file(os.path.join(step_dir, fmt.rank_file_name(rank)), shards, state)
        for name, w in written.items():
            if w["length"]:
                entries[name].append({"file": fmt.rank_file_name(rank), "offset": w["offset"],
                                      "length": w["length"], "checksum": w["checksum"]})
        files[fmt.rank_file_name(rank)] = {
            "rank": rank, "bytes": os.path.getsize(os.path.join(step_dir, fmt.rank_file_name(rank)))}
    metadata = {"format_version": fmt.FORMAT_VERSION, "step": 7, "world_size": 2, "created_unix": 1.5,
                "files": files, "meta": {"samples_consumed": 56, "model_config": {"n_layer": 2}},
                "tensors": {n: {"dtype": a.dtype.str, "global_size": a.size, "pieces": entries[n]}
                            for n, a in tensors.items()}}
    fmt.write_metadata(step_dir, metadata)
    fmt.write_latest(ckpt_dir, 7)
    return tensors, states


# ---------------------------------------------------------------- mutations
def _json_paths(value, path=()):
    """Every (path, value) inside a parsed JSON value."""
    yield path, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, child in items:
        yield from _json_paths(child, path + (key,))


def _edit_json(r, step_dir, change):
    path = os.path.join(step_dir, "metadata.json")
    with open(path) as f:
        metadata = json.load(f)
    change(metadata)
    if r.random() < 0.8:  # mostly re-signed, so the schema and file checks must catch it
        metadata[fmt.METADATA_CHECKSUM] = fmt.metadata_checksum(metadata)
    with open(path, "w") as f:
        json.dump(metadata, f)


def _pick_field(r, metadata):
    paths = [p for p, _ in _json_paths(metadata) if p]
    return r.choice(paths)


def _parent(metadata, path):
    for key in path[:-1]:
        metadata = metadata[key]
    return metadata


ODD_VALUES = [None, True, -1, 0, 2**63, 2**40, 1.5, float("nan"), "", "x", "../../x.h5",
              "/etc/passwd", "rank_00001.h5", "|O", "V2000000000", "<f8", "<i4", [], {}, [1, 2],
              {"a": 1}, "crc32c:00000000"]


def m_flip(r, step_dir, rank_files):
    path = os.path.join(step_dir, r.choice(FILES))
    data = bytearray(open(path, "rb").read())
    for _ in range(r.choice([1, 1, 2, 8])):
        i = r.randrange(len(data))
        data[i] ^= 1 << r.randrange(8) if r.random() < 0.7 else r.randrange(1, 256)
    open(path, "wb").write(bytes(data))


def m_truncate(r, step_dir, rank_files):
    path = os.path.join(step_dir, r.choice(FILES))
    os.truncate(path, r.randrange(os.path.getsize(path)))


def m_delete_field(r, step_dir, rank_files):
    def change(metadata):
        path = _pick_field(r, metadata)
        parent = _parent(metadata, path)
        parent.pop(path[-1]) if isinstance(parent, dict) else parent.pop(path[-1])
    _edit_json(r, step_dir, change)


def m_retype_field(r, step_dir, rank_files):
    def change(metadata):
        path = _pick_field(r, metadata)
        _parent(metadata, path)[path[-1]] = r.choice(ODD_VALUES)
    _edit_json(r, step_dir, change)


def m_swap_dtype_or_shape(r, step_dir, rank_files):
    name = r.choice(["params", "adam.v", "adam.step"])
    kind = r.randrange(4)
    if kind == 0:  # metadata says another dtype
        dtype = r.choice(["<f4", "<f8", "<i8", "<f2", "|u1", ">f4", "|O", "<U4", "V8"])
        _edit_json(r, step_dir, lambda m: m["tensors"][name].update(dtype=dtype))
    elif kind == 1:  # metadata says another length, pieces kept consistent
        delta = r.choice([-3, -1, 1, 5, 2**30])

        def change(m):
            info = m["tensors"][name]
            info["pieces"][-1]["length"] += delta
            info["global_size"] += delta
        _edit_json(r, step_dir, change)
    elif kind == 2:  # the file's dataset rewritten with another dtype or shape
        rank_file = r.choice(rank_files)
        with h5py.File(os.path.join(step_dir, rank_file), "a") as f:
            ds = f["tensors"][name]
            attrs, data = dict(ds.attrs), ds[()]
            del f["tensors"][name]
            new = (data.astype(r.choice([np.float64, np.float32, np.int32, np.uint8]))
                   if r.random() < 0.5 else np.concatenate([data, data[:1]]))
            ds = f["tensors"].create_dataset(name, data=new)
            ds.attrs.update(attrs)
    else:  # two tensors' entries swapped
        other = r.choice([n for n in ("params", "adam.v", "adam.step") if n != name])

        def change(m):
            m["tensors"][name], m["tensors"][other] = m["tensors"][other], m["tensors"][name]
        _edit_json(r, step_dir, change)


def m_fs_link(r, step_dir, rank_files):
    victim = os.path.join(step_dir, r.choice(FILES))
    outside = os.path.join(os.path.dirname(os.path.dirname(step_dir)), "outside")
    os.makedirs(outside, exist_ok=True)
    kind = r.randrange(4)
    if kind == 0:  # symlink to an intact copy outside the step dir
        copy = os.path.join(outside, os.path.basename(victim))
        shutil.move(victim, copy)
        os.symlink(copy, victim)
    elif kind == 1:
        os.remove(victim)
        os.symlink(r.choice(["/dev/zero", "/dev/null", "/etc/passwd", "../" + STEP_DIR]), victim)
    elif kind == 2:  # a hard link to the other rank file (a regular file, but the wrong one)
        os.remove(victim)
        others = [f for f in FILES if os.path.join(step_dir, f) != victim]
        os.link(os.path.join(step_dir, r.choice(others)), victim)
    else:
        os.remove(victim)
        os.mkdir(victim)


def m_fifo(r, step_dir, rank_files):
    victim = os.path.join(step_dir, r.choice(FILES))
    os.remove(victim)
    os.mkfifo(victim)


def m_hdf5_link_or_storage(r, step_dir, rank_files):
    """A dataset replaced by what HDF5 would follow or fetch: links, foreign or huge storage."""
    rank_file = os.path.join(step_dir, r.choice(rank_files))
    group, name = r.choice([("tensors", "params"), ("tensors", "adam.v"), ("rank_state", "rng")])
    outside = os.path.join(os.path.dirname(os.path.dirname(step_dir)), "outside.h5")
    with h5py.File(outside, "a") as f:
        if "x" not in f:
            f["x"] = np.zeros(300, np.float32)
    with h5py.File(rank_file, "a") as f:
        g = f[group]
        attrs = dict(g[name].attrs)
        shape, dtype = g[name].shape, g[name].dtype
        del g[name]
        kind = r.randrange(7)
        if kind == 0:
            g[name] = h5py.ExternalLink(outside, "x")
        elif kind == 1:
            g[name] = h5py.SoftLink("/" + group + "/" + r.choice(list(g) or ["nothing"]))
        elif kind == 2:
            g.create_dataset(name, shape=shape, dtype=dtype, external=[(outside, 0, h5py.h5f.UNLIMITED)])
        elif kind == 3:
            layout = h5py.VirtualLayout(shape=shape, dtype=dtype)
            layout[:] = h5py.VirtualSource(outside, "x", shape=(300,))[:shape[0]] if shape else 0
            g.create_virtual_dataset(name, layout)
        elif kind == 4:
            g.create_dataset(name, shape=(r.choice([2**31, 2**40]),), dtype=dtype)
        elif kind == 5:
            g.create_dataset(name, data=np.array(["x"] * max(1, shape[0] if shape else 1), dtype=object),
                             dtype=h5py.string_dtype())
        else:
            g.create_dataset(name, data=np.ones(shape, dtype), chunks=True, compression="gzip")
        if name in g and not isinstance(g.get(name, getlink=True), (h5py.ExternalLink, h5py.SoftLink)):
            g[name].attrs.update(attrs)
    if r.random() < 0.7:  # the new size recorded too, so the HDF5 checks must catch it
        _edit_json(r, step_dir, lambda m: m["files"][os.path.basename(rank_file)].update(
            bytes=os.path.getsize(rank_file)))


MUTATIONS = [m_flip, m_flip, m_flip, m_truncate, m_truncate, m_delete_field, m_retype_field,
             m_retype_field, m_swap_dtype_or_shape, m_swap_dtype_or_shape, m_fs_link, m_fifo,
             m_hdf5_link_or_storage, m_hdf5_link_or_storage]


# ---------------------------------------------------------------- one case, in a child
def load_everything(ckpt_dir):
    ckpt = load_checkpoint(None, ckpt_dir)
    arrays = ckpt.read_many({name: (0, None, None) for name in ckpt.tensors})
    return ckpt.step, arrays, [ckpt.rank_state(r) for r in range(ckpt.world_size_saved)]


def outcome(ckpt_dir, tensors, states):
    """'ok', 'error', or a description of what must not happen."""
    results = []
    for reader in ("load", "verify"):
        try:
            if reader == "verify":
                verify_checkpoint(ckpt_dir)
                results.append("ok")
                continue
            step, arrays, got_states = load_everything(ckpt_dir)
            same = step == 7 and arrays.keys() == tensors.keys() and all(
                arrays[n].dtype == a.dtype and np.array_equal(arrays[n], a) for n, a in tensors.items())
            same = same and len(got_states) == len(states) and all(
                g.keys() == s.keys() and all(np.array_equal(g[k], s[k]) for k in s)
                for g, s in zip(got_states, states))
            results.append("ok" if same else "LOADED OTHER DATA")
        except CheckpointError:
            results.append("error")
        except BaseException:  # noqa: BLE001 - exactly what the fuzz looks for
            return f"{reader}: {traceback.format_exc(limit=4)}"
    if results[0] != results[1] and "LOADED OTHER DATA" not in results:
        return f"the readers disagree: load {results[0]}, verify {results[1]}"
    return results[0] if results[0] == results[1] else " / ".join(results)


def run_case(ckpt_dir, tensors, states):
    """outcome() in a forked child, bounded by CASE_TIMEOUT_S; a crash or hang is a result."""
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child
        os.close(read_end)
        try:
            text = outcome(ckpt_dir, tensors, states)
        except BaseException:  # noqa: BLE001
            text = traceback.format_exc()
        os.write(write_end, text.encode()[:60000])
        os._exit(0)
    os.close(write_end)
    deadline, chunks = time.monotonic() + CASE_TIMEOUT_S, []
    try:
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([read_end], [], [], left)[0]:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)
                return f"HANG: no result after {CASE_TIMEOUT_S} s"
            chunk = os.read(read_end, 65536)
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(read_end)
    _, status = os.waitpid(pid, 0)
    if os.WIFSIGNALED(status):
        return f"CRASH: killed by signal {os.WTERMSIG(status)}"
    return b"".join(chunks).decode() or "CRASH: no result"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    root = tmp_path_factory.mktemp("pristine")
    tensors, states = build(str(root / "ckpt"))
    return root / "ckpt", tensors, states


def test_pristine_checkpoint_loads_in_the_harness(pristine):
    ckpt_dir, tensors, states = pristine
    assert run_case(str(ckpt_dir), tensors, states) == "ok"


def test_fuzzed_checkpoints_load_correctly_or_raise_checkpoint_error(pristine, tmp_path):
    ckpt_dir, tensors, states = pristine
    bad, seen, start = [], {}, time.monotonic()
    for case in range(SEED, SEED + CASES):
        r = random.Random(case)
        work = tmp_path / "case"
        shutil.copytree(ckpt_dir, work / "ckpt")
        mutation = MUTATIONS[case % len(MUTATIONS)]
        try:
            mutation(r, str(work / "ckpt" / STEP_DIR), ["rank_00000.h5", "rank_00001.h5"])
        except (OSError, ValueError, KeyError, TypeError, IndexError):
            pass  # the mutation itself could not apply (e.g. a field already gone): load as it is
        result = run_case(str(work / "ckpt"), tensors, states)
        seen[(mutation.__name__, result if result in ("ok", "error") else "BAD")] = \
            seen.get((mutation.__name__, result if result in ("ok", "error") else "BAD"), 0) + 1
        if result not in ("ok", "error"):
            bad.append(f"seed {case} ({mutation.__name__}): {result}")
            print(bad[-1], flush=True)
        shutil.rmtree(work)
    print(f"{CASES} cases in {time.monotonic() - start:.1f} s: {sorted(seen.items())}")
    assert not bad, f"{len(bad)} of {CASES} cases:\n" + "\n".join(bad[:20])
    assert sum(n for (_, result), n in seen.items() if result == "error") > CASES // 2  # it bites
    if CASES >= len(MUTATIONS):
        assert {name for name, _ in seen} == {m.__name__ for m in MUTATIONS}
