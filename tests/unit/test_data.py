"""rtxmpi.data: byte corpora, the on-disk cache, the global-batch sampler and validation windows."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from rtxmpi import data
from rtxmpi.errors import ConfigError


@pytest.fixture(autouse=True)
def cache_dir(tmp_path, monkeypatch):
    """Every test gets its own cache; nothing is written to ~/.cache."""
    path = tmp_path / "cache"
    monkeypatch.setenv("RTXMPI_CACHE_DIR", str(path))
    return path


@pytest.fixture(scope="module")
def stdlib_corpus(tmp_path_factory):
    return data.load_corpus(cache_dir=str(tmp_path_factory.mktemp("stdlib-cache")), progress=False)


def make_tree(root, n_files=60):
    """A directory of n small text files, each with unique content."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_files):
        sub = root / f"pkg{i % 3}"
        sub.mkdir(exist_ok=True)
        (sub / f"mod{i:03d}.txt").write_text(f"document {i}\n" + "x = 1\n" * (i % 7 + 1))
    return root


def documents(tokens):
    """Split a token stream at the separator into its documents (bytes)."""
    return [d for d in bytes(np.asarray(tokens)).split(bytes([data.SEPARATOR])) if d]


def cache_files(cache_dir):
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.exists() else []


# ---------------------------------------------------------------------------- corpus


def test_default_corpus_is_the_stdlib_as_bytes(stdlib_corpus):
    c = stdlib_corpus
    assert c.train.dtype == np.uint8 and c.train.ndim == 1 and c.val.dtype == np.uint8
    assert c.train.size > 1_000_000 and c.val.size > 10_000
    assert c.num_bytes == c.train.size + c.val.size
    assert c.split == "file" and c.files_train > 100 and c.files_val > 0
    assert b"def " in bytes(c.train[:200_000])
    assert os.path.isfile(os.path.join(c.source, "os.py"))


def test_second_load_is_a_cache_hit(tmp_path, cache_dir):
    tree = make_tree(tmp_path / "corpus")
    first = data.load_corpus(tree)
    second = data.load_corpus(tree)
    assert not first.from_cache and second.from_cache
    assert second.cache_path == first.cache_path and isinstance(second.train, np.memmap)
    np.testing.assert_array_equal(first.train, second.train)
    np.testing.assert_array_equal(first.val, second.val)


def test_cache_hit_reads_no_source_file(tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "corpus")
    data.load_corpus(tree)

    def no_reading(*args):
        raise AssertionError("source file read despite a valid cache")

    monkeypatch.setattr(data, "_read_file", no_reading)
    assert data.load_corpus(tree).from_cache


def test_changed_file_invalidates_the_cache(tmp_path):
    tree = make_tree(tmp_path / "corpus")
    first = data.load_corpus(tree, val_fraction=0.0)
    (tree / "pkg0" / "mod000.txt").write_text("a new first document\n")
    second = data.load_corpus(tree, val_fraction=0.0)
    assert not second.from_cache and second.fingerprint != first.fingerprint
    assert documents(second.train)[0] == b"a new first document\n"


def test_cache_content_is_renamed_into_place_before_its_marker(tmp_path, monkeypatch):
    tree = make_tree(tmp_path / "corpus")
    seen = []
    real_replace = os.replace

    def watching_replace(src, dst):
        stem = dst.rsplit(".", 1)[0]
        seen.append((os.path.basename(dst), os.path.exists(stem + ".bin"),
                     os.path.exists(stem + ".json")))
        real_replace(src, dst)

    monkeypatch.setattr(data.os, "replace", watching_replace)
    corpus = data.load_corpus(tree)
    names = [name for name, _, _ in seen]
    assert [n.rsplit(".", 1)[1] for n in names] == ["bin", "json"]
    assert seen[0][1:] == (False, False)   # .bin appears whole, before any marker
    assert seen[1][1:] == (True, False)    # marker appears after the content is in place
    meta = json.loads(open(corpus.cache_path[:-4] + ".json").read())
    assert os.path.getsize(corpus.cache_path) == meta["n_train"] + meta["n_val"]


def test_failed_build_leaves_no_cache_or_temp_files(tmp_path, cache_dir, monkeypatch):
    tree = make_tree(tmp_path / "corpus")
    real_read, calls = data._read_file, []

    def failing_read(path, shown):
        calls.append(path)
        if len(calls) == 5:
            raise ConfigError("simulated read failure")
        return real_read(path, shown)

    monkeypatch.setattr(data, "_read_file", failing_read)
    with pytest.raises(ConfigError, match="simulated"):
        data.load_corpus(tree)
    assert cache_files(cache_dir) == []
    monkeypatch.setattr(data, "_read_file", real_read)
    assert not data.load_corpus(tree).from_cache


def test_concurrent_loads_agree_and_leave_one_cache(tmp_path, cache_dir):
    tree = make_tree(tmp_path / "corpus", n_files=120)
    with ThreadPoolExecutor(8) as pool:
        corpora = list(pool.map(lambda _: data.load_corpus(tree, progress=False), range(8)))
    for c in corpora[1:]:
        np.testing.assert_array_equal(c.train, corpora[0].train)
        np.testing.assert_array_equal(c.val, corpora[0].val)
    assert [n.rsplit(".", 1)[1] for n in cache_files(cache_dir)] == ["bin", "json"]


def test_concurrent_processes_agree_on_one_cache(tmp_path, cache_dir):
    """Like several MPI ranks on one node: separate processes racing to build the same cache."""
    tree = make_tree(tmp_path / "corpus", n_files=120)
    code = ("import sys, hashlib; from rtxmpi import data; c = data.load_corpus(sys.argv[1], "
            "progress=False); print(hashlib.sha256(bytes(c.train) + bytes(c.val)).hexdigest())")
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tree)], stdout=subprocess.PIPE,
                              text=True) for _ in range(4)]
    digests = {p.communicate(timeout=60)[0] for p in procs}
    assert all(p.returncode == 0 for p in procs) and len(digests) == 1
    assert [n.rsplit(".", 1)[1] for n in cache_files(cache_dir)] == ["bin", "json"]


def test_split_by_file_is_disjoint_and_complete(tmp_path):
    tree = make_tree(tmp_path / "corpus", n_files=200)
    c = data.load_corpus(tree, val_fraction=0.2)
    train, val = documents(c.train), documents(c.val)
    assert c.split == "file" and (len(train), len(val)) == (c.files_train, c.files_val)
    assert not set(train) & set(val)
    expected = {p.read_bytes() for p in tree.rglob("*.txt")}
    assert set(train) | set(val) == expected
    assert 20 <= len(val) <= 60


def test_split_is_the_same_from_another_cache_and_stable_when_files_are_added(tmp_path):
    tree = make_tree(tmp_path / "corpus", n_files=200)
    before = data.load_corpus(tree, val_fraction=0.2)
    again = data.load_corpus(tree, val_fraction=0.2, cache_dir=str(tmp_path / "other-cache"))
    np.testing.assert_array_equal(before.val, again.val)
    (tree / "pkg1" / "zz_new.txt").write_text("a document added later\n")
    after = data.load_corpus(tree, val_fraction=0.2)
    assert set(documents(before.val)) <= set(documents(after.val))
    assert set(documents(before.train)) <= set(documents(after.train))


def test_single_file_is_split_by_bytes(tmp_path):
    path = tmp_path / "book.txt"
    text = ("It was a dark and stormy night. " * 400).encode()
    path.write_bytes(text)
    c = data.load_corpus(path, val_fraction=0.1)
    assert c.split == "bytes" and (c.files_train, c.files_val) == (1, 1)
    assert bytes(c.train) + bytes(c.val) == text + bytes([data.SEPARATOR])
    assert c.val.size == int((len(text) + 1) * 0.1)


def test_user_dir_skips_hidden_binary_and_filtered_files(tmp_path):
    tree = tmp_path / "corpus"
    (tree / ".git").mkdir(parents=True)
    (tree / ".git" / "config").write_text("hidden\n")
    (tree / "a.py").write_text("print('a')\n")
    (tree / "b.md").write_text("# b\n")
    (tree / "blob.bin").write_bytes(b"\x00\x01\x02binary")
    everything = data.load_corpus(tree, val_fraction=0.0)
    assert documents(everything.train) == [b"print('a')\n", b"# b\n"]
    assert everything.files_skipped == 1
    only_py = data.load_corpus(tree, val_fraction=0.0, extensions=("py",))
    assert documents(only_py.train) == [b"print('a')\n"]


def test_files_are_read_in_sorted_path_order(tmp_path):
    tree = tmp_path / "corpus"
    for rel in ["b/z.txt", "a.txt", "b/a.txt", "c.txt"]:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_text(rel)
    c = data.load_corpus(tree, val_fraction=0.0)
    assert documents(c.train) == [b"a.txt", b"b/a.txt", b"b/z.txt", b"c.txt"]


def test_missing_path_raises_config_error_naming_it(tmp_path):
    missing = tmp_path / "no-such-corpus"
    with pytest.raises(ConfigError, match="no-such-corpus: no such file or directory"):
        data.load_corpus(missing)


@pytest.mark.parametrize("contents", [{}, {"empty.txt": b""}, {"blob.bin": b"\x00\x00"}],
                         ids=["no-files", "empty-files", "binary-only"])
def test_corpus_without_text_raises_config_error_naming_it(tmp_path, contents):
    tree = tmp_path / "hollow"
    tree.mkdir()
    for name, body in contents.items():
        (tree / name).write_bytes(body)
    with pytest.raises(ConfigError, match="hollow"):
        data.load_corpus(tree)


def test_corpus_shorter_than_one_sample_raises(tmp_path):
    path = tmp_path / "tiny.txt"
    path.write_text("short")
    with pytest.raises(ConfigError, match="tiny.txt.*--seq-len"):
        data.load_corpus(path, val_fraction=0.0, seq_len=64)


def test_unusable_cache_dir_raises_config_error(tmp_path):
    tree = make_tree(tmp_path / "corpus")
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    with pytest.raises(ConfigError, match="RTXMPI_CACHE_DIR"):
        data.load_corpus(tree, cache_dir=str(blocker / "cache"))


@pytest.mark.parametrize("fraction", [-0.1, 1.0])
def test_val_fraction_outside_unit_interval_raises(tmp_path, fraction):
    with pytest.raises(ConfigError, match="val_fraction"):
        data.load_corpus(make_tree(tmp_path / "corpus"), val_fraction=fraction)


def test_encode_decode_round_trip():
    tokens = data.encode("héllo\n")
    assert tokens.dtype == np.uint8 and data.decode(tokens) == "héllo\n"


# ---------------------------------------------------------------------------- sampler

TOKENS = np.frombuffer(bytes(range(256)) * 40, dtype=np.uint8)  # 10240 tokens


def global_batches(dp_size, steps, seq_len=16, global_batch=8, seed=0, start_sample=0):
    """The global batches of `steps` steps, rebuilt by concatenating every rank's slice."""
    samplers = [data.BatchSampler(TOKENS, seq_len, global_batch, seed=seed, dp_rank=r,
                                  dp_size=dp_size, start_sample=start_sample)
                for r in range(dp_size)]
    out = []
    for _ in range(steps):
        slices = [s.next_batch() for s in samplers]
        out.append((np.concatenate([x for x, _ in slices]), np.concatenate([y for _, y in slices])))
        assert len({s.samples_consumed for s in samplers}) == 1
    return out


def test_same_global_batch_at_dp_sizes_1_to_5_even_or_uneven():
    reference = global_batches(1, steps=5)
    for dp_size in (2, 3, 4, 5):  # 8 over 3: 3, 3, 2; over 5: 2, 2, 2, 1, 1
        for (x, y), (x_ref, y_ref) in zip(global_batches(dp_size, steps=5), reference):
            assert x.dtype == np.int64 and x.shape == (8, 16)
            np.testing.assert_array_equal(x, x_ref)
            np.testing.assert_array_equal(y, y_ref)


def test_rank_slice_shape_is_global_batch_over_dp_size():
    x, y = data.BatchSampler(TOKENS, 32, 12, dp_rank=1, dp_size=4).next_batch()
    assert x.shape == y.shape == (3, 32) and x.flags.c_contiguous and y.flags.c_contiguous


def test_y_is_x_shifted_by_one_token_from_a_real_window():
    x, y = data.BatchSampler(TOKENS, 16, 8, seed=3).next_batch()
    np.testing.assert_array_equal(y[:, :-1], x[:, 1:])
    # TOKENS counts up mod 256, so a contiguous window is an arithmetic run
    np.testing.assert_array_equal(y, (x + 1) % 256)


def test_resume_from_start_sample_continues_the_uninterrupted_stream():
    uninterrupted = global_batches(1, steps=6)
    resumed = global_batches(1, steps=3, start_sample=3 * 8)
    for (x, y), (x_ref, y_ref) in zip(resumed, uninterrupted[3:]):
        np.testing.assert_array_equal(x, x_ref)
        np.testing.assert_array_equal(y, y_ref)


def test_resume_from_state_dict_at_another_world_size():
    before = data.BatchSampler(TOKENS, 16, 8, seed=7, dp_rank=0, dp_size=2)
    for _ in range(3):
        before.next_batch()
    state = json.loads(json.dumps(before.state_dict()))
    assert state == {"samples_consumed": 24, "seed": 7}
    after = [data.BatchSampler(TOKENS, 16, 8, dp_rank=r, dp_size=4) for r in range(4)]
    for s in after:
        s.load_state_dict(state)
    x = np.concatenate([s.next_batch()[0] for s in after])
    reference = data.BatchSampler(TOKENS, 16, 8, seed=7)
    for _ in range(3):
        reference.next_batch()
    np.testing.assert_array_equal(x, reference.next_batch()[0])


def test_different_seeds_give_different_batches():
    x0, _ = data.BatchSampler(TOKENS, 16, 8, seed=0).next_batch()
    x1, _ = data.BatchSampler(TOKENS, 16, 8, seed=1).next_batch()
    assert not np.array_equal(x0, x1)


def test_each_window_is_read_once_per_epoch():
    seq_len = 16
    n = data.samples_per_epoch(TOKENS.size, seq_len)
    for epoch in range(3):
        starts = data.window_starts(TOKENS.size, seq_len, 5, np.arange(epoch * n, (epoch + 1) * n))
        offsets = np.sort(starts)
        assert np.unique(offsets).size == n
        assert np.all(np.diff(offsets) == seq_len)
        assert offsets[0] >= 0 and offsets[-1] + seq_len + 1 <= TOKENS.size


def test_finite_stream_ends_with_an_uneven_last_batch():
    n = 10  # 2 full global batches of 4, then 2 samples for 4 ranks
    samplers = [data.BatchSampler(TOKENS, 16, 4, dp_rank=r, dp_size=4, num_samples=n)
                for r in range(4)]
    sizes = []
    while not samplers[0].exhausted:
        sizes.append([s.next_batch()[0].shape[0] for s in samplers])
    assert sizes == [[1, 1, 1, 1], [1, 1, 1, 1], [1, 1, 0, 0]]
    assert all(s.samples_consumed == n for s in samplers)
    with pytest.raises(StopIteration):
        samplers[3].next_batch()


def test_batch_split_is_as_even_as_possible_first_ranks_one_more():
    assert data.batch_split(8, 3) == [3, 3, 2]
    assert data.batch_split(8, 4) == [2, 2, 2, 2]
    assert data.batch_split(7, 7) == [1] * 7 and data.batch_split(5, 1) == [5]
    sizes = [data.BatchSampler(TOKENS, 16, 8, dp_rank=r, dp_size=3).next_batch()[0].shape[0]
             for r in range(3)]
    assert sizes == [3, 3, 2]


def test_global_batch_smaller_than_dp_size_raises_with_the_fix():
    with pytest.raises(ConfigError) as err:
        data.BatchSampler(TOKENS, 16, 3, dp_rank=0, dp_size=4)
    assert str(err.value) == ("global batch 3 is smaller than the data-parallel size 4: a rank "
                              "would get no sample; use a global batch of at least 4")
    with pytest.raises(ConfigError, match="eval batch 2 is smaller"):
        list(data.eval_batches(TOKENS, 16, 2, 1, dp_size=3))


def test_tokens_shorter_than_one_sample_raise():
    with pytest.raises(ConfigError, match="fewer than one sample"):
        data.BatchSampler(TOKENS[:16], 16, 4)


@pytest.mark.parametrize("kwargs", [{"dp_rank": 2, "dp_size": 2}, {"seq_len": 0},
                                    {"seed": -1}, {"start_sample": 1.5}])
def test_bad_sampler_arguments_raise_config_error(kwargs):
    args = {"seq_len": 16, "global_batch": 4} | kwargs
    with pytest.raises(ConfigError):
        data.BatchSampler(TOKENS, **args)


def test_sampler_is_cheap_per_batch_on_a_large_corpus():
    """O(batch) work: a 2**31-token stream costs no more to sample than a small one."""
    huge = np.broadcast_to(np.uint8(7), (2**31,))
    x, _ = data.BatchSampler(huge, 64, 4, start_sample=10**12).next_batch()
    assert x.shape == (4, 64) and np.all(x == 7)


# ---------------------------------------------------------------------------- validation windows


def test_eval_batches_are_the_same_at_dp_sizes_1_to_4_even_or_uneven():
    def batches(dp_size):
        per_rank = [list(data.eval_batches(TOKENS, 16, 8, 3, dp_rank=r, dp_size=dp_size))
                    for r in range(dp_size)]
        return [np.concatenate([per_rank[r][k][0] for r in range(dp_size)]) for k in range(3)]

    reference = batches(1)
    assert reference[0].shape == (8, 16)
    for dp_size in (2, 3, 4):
        for x, x_ref in zip(batches(dp_size), reference):
            np.testing.assert_array_equal(x, x_ref)


def test_eval_windows_span_the_whole_split():
    (x0, _), *_, (x_last, y_last) = data.eval_batches(TOKENS, 16, 4, 2)
    assert x0[0, 0] == TOKENS[0]
    assert y_last[-1, -1] == TOKENS[-1]


def test_eval_on_too_short_validation_split_raises():
    with pytest.raises(ConfigError, match="validation tokens"):
        list(data.eval_batches(np.zeros(3, np.uint8), 16, 4, 1))
