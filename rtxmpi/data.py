"""Corpora, byte tokenization and caching, the global-batch sampler and its resumable position.

Tokens are bytes: token = byte value 0..255 (`VOCAB_SIZE` = 256). A corpus is a text file or a
directory tree; its files are read in sorted order, each followed by one `SEPARATOR` (0) byte, and
split into train and validation *by file*. The result is cached on disk once and memory-mapped by
every later load, so several ranks on one node may call `load_corpus` at the same time.

The sampler picks global sample `i` from `(seed, i)` alone, so the same global batch is read at any
data-parallel world size, and the position (`samples_consumed`) is one integer to checkpoint.
Nothing here needs MPI: callers pass `dp_rank` and `dp_size` as ints. The full rules, the cache
format and the sampling scheme are in docs/data.md.
"""
import hashlib
import json
import os
import secrets
import sysconfig
from dataclasses import dataclass, field
from functools import lru_cache

import numpy as np
from tqdm import tqdm

from rtxmpi.errors import ConfigError

VOCAB_SIZE = 256
SEPARATOR = 0  # follows every document; files holding a 0 byte are skipped, so it only marks ends

# Bump when the file rules, the split rule or the cache layout change; it is in every cache key.
CACHE_FORMAT = 1

# Default corpus (the standard library): directories never entered, by name.
STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__",
                              "test", "tests", "idle_test"})
# ... and files never read: the build configuration, which differs from machine to machine.
STDLIB_SKIP_PREFIXES = ("_sysconfigdata_",)

_PROGRESS_MIN_FILES = 64  # fewer files than this: no progress bar even when asked


# ------------------------------------------------------------------------------------------------
# Corpus
# ------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Corpus:
    """A tokenized corpus, split by file.

    train, val: 1-D uint8 arrays of tokens (bytes; usually read-only memory maps of the cache).
    source: absolute path of the file or directory read. files_train, files_val: number of files
    with bytes in each split. files_skipped: files left out because they hold a 0 byte (binary).
    split: "file" (the hash-of-path rule) or "bytes" (the fallback for one file, see docs/data.md).
    cache_path: the `.bin` file the arrays map. from_cache: True when this load did not re-read the
    source. fingerprint: hex digest of the cache key.
    """

    train: np.ndarray = field(repr=False)
    val: np.ndarray = field(repr=False)
    source: str
    files_train: int
    files_val: int
    files_skipped: int
    split: str
    cache_path: str
    from_cache: bool
    fingerprint: str

    @property
    def num_bytes(self):
        """Tokens in both splits together (bytes, separators included)."""
        return int(self.train.size + self.val.size)


def load_corpus(path=None, *, cache_dir=None, val_fraction=0.05, extensions=None, seq_len=None,
                progress=True):
    """Tokenize a text file or directory tree into bytes, cached; return a `Corpus`.

    path: a file or directory (`~` expanded). None: the Python standard library's source tree,
      `*.py` files only (docs/data.md lists what is skipped).
    cache_dir: where the cache lives. None: `$RTXMPI_CACHE_DIR`, else `~/.cache/rtxmpi`.
    val_fraction: in [0, 1); files whose path hashes below it go to validation.
    extensions: file name endings to keep in a directory, e.g. (".py", ".md"). None: all regular
      files for a user directory, (".py",) for the default corpus. Ignored when `path` is a file.
    seq_len: when given, both splits must hold at least one sample (seq_len + 1 tokens; the
      validation split only when val_fraction > 0).
    progress: show a tqdm bar while reading many files (pass `rank == 0` under MPI).

    Any rank may call, any number at once: each that misses the cache builds it in a unique temp
    file and renames it into place, and the JSON sidecar is renamed last as the commit marker.
    Raises ConfigError naming the path: missing, unreadable, no usable text, shorter than one
    sample, or a cache directory that cannot be written.
    """
    if not (isinstance(val_fraction, (int, float)) and 0.0 <= val_fraction < 1.0):
        raise ConfigError(f"val_fraction {val_fraction!r} is outside [0, 1); use e.g. 0.05")
    default = path is None
    if default:
        root = sysconfig.get_paths()["stdlib"]
        extensions = (".py",) if extensions is None else extensions
    else:
        root = os.path.expanduser(os.fspath(path))
    extensions = _normalize_extensions(extensions)
    source = os.path.realpath(root)
    cache_dir = os.path.realpath(os.path.expanduser(
        cache_dir or os.environ.get("RTXMPI_CACHE_DIR") or "~/.cache/rtxmpi"))

    files = _list_files(source, root, extensions=extensions, default=default, skip_dir=cache_dir)
    if not files:
        what = f"no files ending in {', '.join(extensions)}" if extensions else "no regular files"
        raise ConfigError(f"corpus {root}: {what}; point --data at a text file or a directory "
                          f"of text files")
    fingerprint = _fingerprint(source, files, extensions, val_fraction, default)
    label = "stdlib" if default else _safe_label(os.path.basename(source))
    stem = os.path.join(cache_dir, f"{label}-{fingerprint[:20]}")

    corpus = _load_cache(stem, source, fingerprint)
    if corpus is None:
        _build_cache(stem, root, files, val_fraction, fingerprint, progress=progress, label=label)
        corpus = _load_cache(stem, source, fingerprint, from_cache=False)
        if corpus is None:
            raise ConfigError(f"cache {stem}.bin could not be read back after writing; check the "
                              f"file system or set RTXMPI_CACHE_DIR to another directory")
    _check_not_empty(corpus, root, extensions)
    if seq_len is not None:
        _check_holds_a_sample(corpus, root, seq_len, val_fraction)
    return corpus


def encode(text):
    """Text -> 1-D uint8 token array (its UTF-8 bytes)."""
    return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).copy()


def decode(tokens):
    """Token array or list (values 0..255) -> text; invalid UTF-8 becomes U+FFFD."""
    return bytes(np.asarray(tokens, dtype=np.uint8).tolist()).decode("utf-8", errors="replace")


def _normalize_extensions(extensions):
    if extensions is None:
        return None
    if isinstance(extensions, str):
        extensions = (extensions,)
    return tuple(sorted({e if e.startswith(".") else "." + e for e in extensions}))


def _safe_label(name):
    label = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)[:40]
    return label or "corpus"


def _list_files(source, shown, *, extensions, default, skip_dir):
    """Sorted [(relpath with '/', abspath, size_bytes, mtime_ns)] of the files the corpus reads."""
    try:
        st = os.stat(source)
    except FileNotFoundError:
        raise ConfigError(f"corpus {shown}: no such file or directory; pass an existing file or "
                          f"directory to --data (or leave it out for the default corpus)") from None
    except OSError as e:
        raise ConfigError(f"corpus {shown}: cannot stat ({e.strerror}); check its "
                          f"permissions") from None
    if os.path.isfile(source):
        return [(os.path.basename(source), source, st.st_size, st.st_mtime_ns)]
    if not os.path.isdir(source):
        raise ConfigError(f"corpus {shown}: not a regular file or directory; pass a text file or "
                          f"a directory of text files")

    found = []
    stack = [("", source)]
    while stack:
        rel_dir, abs_dir = stack.pop()
        try:
            entries = list(os.scandir(abs_dir))
        except OSError as e:
            raise ConfigError(f"corpus {shown}: cannot list {abs_dir} ({e.strerror}); fix its "
                              f"permissions or point --data elsewhere") from None
        for entry in entries:
            name = entry.name
            rel = f"{rel_dir}/{name}" if rel_dir else name
            if name.startswith("."):
                continue
            if entry.is_dir(follow_symlinks=False):
                if name == "__pycache__" or (default and name in STDLIB_SKIP_DIRS):
                    continue
                if os.path.realpath(entry.path) != skip_dir:
                    stack.append((rel, entry.path))
                continue
            if not entry.is_file():  # sockets, fifos, broken links, links to directories
                continue
            if extensions is not None and not name.endswith(extensions):
                continue
            if default and name.startswith(STDLIB_SKIP_PREFIXES):
                continue
            try:
                fst = entry.stat()
            except OSError:
                continue  # vanished since listing
            found.append((rel, entry.path, fst.st_size, fst.st_mtime_ns))
    found.sort(key=lambda f: f[0])
    return found


def _fingerprint(source, files, extensions, val_fraction, default):
    key = {"format": CACHE_FORMAT, "source": source, "default": default,
           "extensions": list(extensions) if extensions else None,
           "val_fraction": float(val_fraction),
           "files": [[rel, size, mtime_ns] for rel, _, size, mtime_ns in files]}
    text = json.dumps(key, sort_keys=True)
    return hashlib.sha256(text.encode("utf-8", "surrogateescape")).hexdigest()


def _is_val_file(rel, val_fraction):
    """The split rule: a stable hash of the relative path, so adding a file moves no other."""
    digest = hashlib.blake2b(rel.encode("utf-8", "surrogateescape"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64 < val_fraction


# ------------------------------------------------------------------------------------------------
# Cache: STEM.bin holds train tokens then val tokens (raw uint8); STEM.json says where they split.
# ------------------------------------------------------------------------------------------------

def _load_cache(stem, source, fingerprint, *, from_cache=True):
    """The cached Corpus, or None when there is no complete cache for this fingerprint."""
    try:
        with open(stem + ".json", encoding="utf-8") as f:
            meta = json.load(f)
        if meta.get("format") != CACHE_FORMAT or meta.get("fingerprint") != fingerprint:
            return None
        n_train, n_val = int(meta["n_train"]), int(meta["n_val"])
        if os.path.getsize(stem + ".bin") != n_train + n_val:
            return None
        tokens = (np.memmap(stem + ".bin", dtype=np.uint8, mode="r") if n_train + n_val
                  else np.zeros(0, np.uint8))
        return Corpus(train=tokens[:n_train], val=tokens[n_train:], source=source,
                      files_train=int(meta["files_train"]), files_val=int(meta["files_val"]),
                      files_skipped=int(meta["files_skipped"]), split=meta["split"],
                      cache_path=stem + ".bin", from_cache=from_cache, fingerprint=fingerprint)
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _build_cache(stem, shown, files, val_fraction, fingerprint, *, progress, label):
    """Read every file once and write STEM.bin, then STEM.json, each via a unique temp + rename."""
    cache_dir = os.path.dirname(stem)
    try:
        os.makedirs(cache_dir, exist_ok=True)
    except OSError as e:
        raise ConfigError(f"cache directory {cache_dir}: cannot create ({e.strerror}); set "
                          f"RTXMPI_CACHE_DIR to a writable directory") from None
    suffix = f".tmp-{os.getpid()}-{secrets.token_hex(4)}"
    tmp_train, tmp_val, tmp_json = (stem + ext + suffix for ext in (".bin", ".val", ".json"))
    try:
        with _create(tmp_train, "wb") as out_train, _create(tmp_val, "w+b") as out_val:
            doc_sizes = []  # (split, size incl. separator), in file order
            skipped = 0
            show = progress and len(files) >= _PROGRESS_MIN_FILES
            for rel, abs_path, _, _ in tqdm(files, desc=f"tokenizing {label}", unit="file",
                                            disable=not show, leave=False):
                document = _read_file(abs_path, shown)
                if not document:
                    continue
                if b"\0" in document:
                    skipped += 1
                    continue
                is_val = _is_val_file(rel, val_fraction)
                out = out_val if is_val else out_train
                out.write(document)
                out.write(bytes([SEPARATOR]))
                doc_sizes.append((is_val, len(document) + 1))
            n_train, n_val = out_train.tell(), out_val.tell()
            out_val.seek(0)
            while chunk := out_val.read(1 << 24):
                out_train.write(chunk)
            out_train.flush()
            os.fsync(out_train.fileno())

        split = "file"
        files_val = sum(1 for is_val, _ in doc_sizes if is_val)
        files_train = len(doc_sizes) - files_val
        if (n_val == 0 and val_fraction > 0) or n_train == 0:
            # One file, or too few for the hash to put any in one split: the whole stream is in one
            # of the two temp files in file order, so split it by bytes instead.
            split = "bytes"
            total = n_train + n_val
            n_val = int(total * val_fraction)
            n_train = total - n_val
            files_train, files_val = _files_either_side(doc_sizes, n_train)

        meta = {"format": CACHE_FORMAT, "fingerprint": fingerprint, "source": os.fspath(shown),
                "n_train": n_train, "n_val": n_val, "files_train": files_train,
                "files_val": files_val, "files_skipped": skipped, "split": split,
                "val_fraction": float(val_fraction), "separator": SEPARATOR, "dtype": "uint8"}
        with open(tmp_json, "w", encoding="utf-8") as f:
            json.dump(meta, f, indent=1)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp_train, stem + ".bin")   # content first ...
        os.replace(tmp_json, stem + ".json")   # ... commit marker last
        _fsync_dir(cache_dir)
    finally:
        for tmp in (tmp_train, tmp_val, tmp_json):
            try:
                os.unlink(tmp)
            except FileNotFoundError:
                pass


def _create(tmp_path, mode):
    try:
        return open(tmp_path, mode)
    except OSError as e:
        raise ConfigError(f"cache directory {os.path.dirname(tmp_path)}: cannot write "
                          f"({e.strerror}); set RTXMPI_CACHE_DIR to a writable directory") from None


def _read_file(abs_path, shown):
    try:
        with open(abs_path, "rb") as f:
            return f.read()
    except OSError as e:
        raise ConfigError(f"corpus {shown}: cannot read {abs_path} ({e.strerror}); fix its "
                          f"permissions, remove it, or narrow the corpus with extensions") from None


def _files_either_side(doc_sizes, cut):
    """(files with bytes before `cut`, files with bytes at or after it) in a stream of documents."""
    before = after = offset = 0
    for _, size in doc_sizes:
        before += offset < cut
        after += offset + size > cut
        offset += size
    return before, after


def _fsync_dir(path):
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # not supported on every platform / file system
    finally:
        os.close(fd)


def _check_not_empty(corpus, shown, extensions):
    if corpus.train.size == 0:
        filt = f" ending in {', '.join(extensions)}" if extensions else ""
        raise ConfigError(f"corpus {shown}: no usable text (files{filt} are empty, or "
                          f"{corpus.files_skipped} skipped as binary); point --data at text files")


def _check_holds_a_sample(corpus, shown, seq_len, val_fraction):
    need = int(seq_len) + 1
    if corpus.train.size < need:
        raise ConfigError(f"corpus {shown}: {corpus.train.size} training tokens, fewer than one "
                          f"sample (seq_len + 1 = {need}); use a larger corpus or a smaller "
                          f"--seq-len")
    if val_fraction > 0 and corpus.val.size < need:
        raise ConfigError(f"corpus {shown}: {corpus.val.size} validation tokens, fewer than one "
                          f"sample (seq_len + 1 = {need}); raise val_fraction, use a larger corpus "
                          f"or a smaller --seq-len")


# ------------------------------------------------------------------------------------------------
# Sampling: global sample i -> window start, from (seed, i) alone
# ------------------------------------------------------------------------------------------------
# T = seq_len. Each epoch tiles the tokens with samples_per_epoch windows of T + 1 tokens, stride T
# (neighbours share one token: the last target of one is the first input of the next), shifted by
# an offset drawn per (seed, epoch), and visits them in an order given by a keyed permutation
# (a Feistel network with cycle walking), so each window is read once per epoch, in O(1) per sample.

_FEISTEL_ROUNDS = 4
_MIX1 = np.uint64(0xBF58476D1CE4E5B9)
_MIX2 = np.uint64(0x94D049BB133111EB)
_S30, _S27, _S31 = np.uint64(30), np.uint64(27), np.uint64(31)


def samples_per_epoch(num_tokens, seq_len):
    """Windows of seq_len + 1 tokens in one pass over `num_tokens` tokens (at least 1)."""
    return max(1, (int(num_tokens) - int(seq_len)) // int(seq_len))


def window_starts(num_tokens, seq_len, seed, sample_indices):
    """Start offsets (int64, same shape as `sample_indices`) of global samples in a token array.

    The window of sample i is tokens[start : start + seq_len + 1]. A pure function of
    (num_tokens, seq_len, seed, i): every rank, at every world size, computes the same starts.
    Requires num_tokens >= seq_len + 1 (checked by BatchSampler).
    """
    idx = np.asarray(sample_indices, dtype=np.int64)
    n = samples_per_epoch(num_tokens, seq_len)
    slack = int(num_tokens) - 1 - n * int(seq_len)  # >= 0: room to shift the tiling
    epochs, pos = np.divmod(idx, n)
    starts = np.empty(idx.shape, dtype=np.int64)
    for epoch in np.unique(epochs).tolist():
        sel = epochs == epoch
        keys, offset = _epoch_keys(int(seed), epoch)
        window = _permute(pos[sel], n, keys)
        starts[sel] = offset % (slack + 1) + window * int(seq_len)
    return starts


@lru_cache(maxsize=256)
def _epoch_keys(seed, epoch):
    """Round keys of the permutation and the tiling offset for one (seed, epoch)."""
    digest = hashlib.blake2b(f"rtxmpi.data:{seed}:{epoch}".encode(),
                             digest_size=8 * (_FEISTEL_ROUNDS + 1)).digest()
    words = [int.from_bytes(digest[8 * k:8 * k + 8], "little") for k in range(_FEISTEL_ROUNDS + 1)]
    return tuple(np.uint64(w) for w in words[:-1]), words[-1]


def _mix(v, key):
    """splitmix64's finalizer of (v + key): uint64 array -> uint64 array, wrapping."""
    z = v + key
    z = (z ^ (z >> _S30)) * _MIX1
    z = (z ^ (z >> _S27)) * _MIX2
    return z ^ (z >> _S31)


def _permute(pos, n, keys):
    """A keyed bijection of [0, n), applied elementwise to int64 array `pos`."""
    half_bits = max(1, ((n - 1).bit_length() + 1) // 2)
    half, mask = np.uint64(half_bits), np.uint64((1 << half_bits) - 1)

    def feistel(x):
        left, right = x >> half, x & mask
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & mask)
        return (left << half) | right

    y = feistel(pos.astype(np.uint64))
    outside = y >= np.uint64(n)
    while outside.any():  # cycle walking: the domain is < 4n, so this ends after a few rounds
        y[outside] = feistel(y[outside])
        outside = y >= np.uint64(n)
    return y.astype(np.int64)


def _gather(tokens, starts, seq_len):
    """(B,) starts -> x, y: (B, T) int64, y = x shifted left by one token."""
    window = np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)], dtype=np.int64)
    return np.ascontiguousarray(window[:, :-1]), np.ascontiguousarray(window[:, 1:])


def _check_int(name, value, minimum):
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def _check_rank(dp_rank, dp_size):
    if _check_int("dp_rank", dp_rank, 0) >= dp_size:
        raise ConfigError(f"dp_rank {dp_rank} is outside [0, {dp_size}); pass this rank's index "
                          f"in the data-parallel group")
    return int(dp_rank)


def even_split(n, parts):
    """n items in `parts` contiguous parts, as even as possible, the first n % parts one larger
    (8 in 3 -> [3, 3, 2]; the sizes np.array_split gives). The one split rule of a global batch:
    over data-parallel ranks (batch_split) and of a rank's batch into micro-batches
    (micro_batch_split). Returns a list of `parts` ints. Pure; no checks (parts >= 1)."""
    base, extra = divmod(n, parts)
    return [base + (i < extra) for i in range(parts)]


def batch_split(global_batch, dp_size, what="global batch", *, equal=False):
    """Samples of each data-parallel rank in one global batch: as even as possible, the first
    global_batch % dp_size ranks one more (8 over 3 ranks -> [3, 3, 2]; 8 over 4 -> [2, 2, 2, 2]).

    Rank r reads the samples [sum(sizes[:r]), sum(sizes[:r + 1])) of the batch, so the ranks'
    slices in rank order are the global batch in its one-process order at any dp_size. With an
    uneven split each rank's gradient must be weighted by its samples
    (rtxmpi.parallel.data.grad_scale). equal=True: the pipeline's rule (its stages exchange
    fixed-shape activations, rtxmpi.parallel.pipeline): every rank the same batch. Returns a list
    of dp_size ints, each >= 1. Raises ConfigError when global_batch < dp_size (a rank would get
    no sample), and with equal when dp_size does not divide global_batch. Local (pure); the
    planner (rtxmpi.parallel.planner) and the elastic re-plan ask this rule, never restate it.
    """
    global_batch, dp_size = _check_int(what, global_batch, 1), _check_int("dp_size", dp_size, 1)
    if global_batch < dp_size:
        raise ConfigError(f"{what} {global_batch} is smaller than the data-parallel size "
                          f"{dp_size}: a rank would get no sample; use a {what} of at least "
                          f"{dp_size}")
    sizes = even_split(global_batch, dp_size)
    if equal and global_batch % dp_size:
        raise ConfigError(f"{what} {global_batch} over dp {dp_size} gives per-rank batches of "
                          f"{', '.join(map(str, sizes))}: a pipeline needs them equal; use a "
                          f"{what} divisible by {dp_size}")
    return sizes


def micro_batch_split(global_batch, dp_size, micro_batches, what="global batch", *, equal=False):
    """Samples in each micro-batch of each data-parallel rank for one global batch: rank r's
    batch_split(global_batch, dp_size)[r] samples cut into `micro_batches` contiguous micro-batches
    by even_split (the first ones one larger; rtxmpi.parallel.data.weighted_micro_batches cuts a
    rank's batch so and weights each by its samples). equal=True: the pipeline's rule, every rank
    and every micro-batch the same size (batch_split's equal, and micro_batches divides the
    per-rank batch). Returns a list of dp_size lists of micro_batches ints, each >= 1; [0][0] is
    the largest micro-batch. Raises ConfigError for what batch_split refuses, when the smallest
    rank's batch (global_batch // dp_size) holds fewer than micro_batches samples, and with equal
    when micro_batches does not divide the per-rank batch. Local (pure).
    """
    sizes = batch_split(global_batch, dp_size, what, equal=equal)
    m = _check_int("micro_batches", micro_batches, 1)
    if sizes[-1] < m:
        raise ConfigError(f"a {what} of {global_batch} over {dp_size} data-parallel ranks "
                          f"leaves {sizes[-1]} samples on the smallest rank, fewer than {m} "
                          f"micro-batches; use fewer --micro-batches or a larger {what}")
    if equal and sizes[0] % m:
        raise ConfigError(f"the per-rank batch {sizes[0]} ({what} {global_batch} over dp "
                          f"{dp_size}) is not divisible by {m} micro-batches: a pipeline needs "
                          f"them equal; use a {what} that is a multiple of {dp_size * m}")
    return [even_split(b, m) for b in sizes]


def _check_tokens(tokens, seq_len, what):
    if getattr(tokens, "ndim", None) != 1 or not np.issubdtype(tokens.dtype, np.integer):
        raise ConfigError(f"{what} tokens must be a 1-D integer array, got "
                          f"{getattr(tokens, 'shape', type(tokens).__name__)}")
    if seq_len + 1 > tokens.size:
        raise ConfigError(f"{what} tokens ({tokens.size}) are fewer than one sample "
                          f"(seq_len + 1 = {seq_len + 1}); use a larger corpus or a smaller "
                          f"--seq-len")


class SamplerPosition:
    """What every sampler whose global batch is a function of (seed, sample index) shares: its
    position (`samples_consumed`, `seed`) as a JSON-able state that loads at any world size or
    batch, and iteration by `next_batch()`."""

    def __iter__(self):
        return self

    def __next__(self):
        return self.next_batch()

    def state_dict(self):
        """{"samples_consumed": int, "seed": int}: JSON-able, identical on every rank."""
        return {"samples_consumed": self.samples_consumed, "seed": self.seed}

    def load_state_dict(self, state):
        """Restore the position and seed written by `state_dict` (at any world size or batch).
        Raises ConfigError for a state without them or with values that are not ints >= 0."""
        try:
            samples, seed = state["samples_consumed"], state["seed"]
        except (KeyError, TypeError):
            raise ConfigError(f"sampler state {state!r} lacks 'samples_consumed' and 'seed'; pass "
                              f"the dict written by {type(self).__name__}.state_dict()") from None
        self.samples_consumed = _check_int("samples_consumed", samples, 0)
        self.seed = _check_int("seed", seed, 0)


class BatchSampler(SamplerPosition):
    """This rank's slice of each global batch, drawn from (seed, global sample index) alone.

    tokens: 1-D integer array (e.g. `Corpus.train`). seq_len: T, tokens per sample.
    global_batch: samples per step over all data-parallel ranks, at least dp_size.
    dp_rank, dp_size: this rank's place in the data-parallel group (ints; no MPI needed).
    start_sample: global samples already consumed (the resume position).
    num_samples: None for an endless stream; else the stream ends after this many samples
      (e.g. `epochs * samples_per_epoch(len(tokens), seq_len)`), and its last global batch may be
      short: ranks are filled in order, so trailing ranks get fewer samples or none.

    Step k reads global samples [s, s + global_batch) with s = samples_consumed; rank r gets
    [s + o, s + o + b): b = local_batch = batch_split(global_batch, dp_size)[r] and o =
    local_offset, the samples of the ranks before it. With dp_size dividing global_batch,
    b = global_batch // dp_size and o = r * b; otherwise the first global_batch % dp_size ranks
    read one sample more (8 over 3: 3, 3, 2), and the caller weights gradients by samples
    (rtxmpi.parallel.data.grad_scale). Either way concatenating the slices of all ranks in rank
    order gives the dp_size=1 batch bit for bit. Local: no rank talks to another, and
    `samples_consumed` advances identically on every rank.
    Raises ConfigError: global_batch smaller than dp_size, tokens shorter than seq_len + 1,
    a rank outside [0, dp_size), non-integer or negative sizes.
    """

    def __init__(self, tokens, seq_len, global_batch, *, seed=0, dp_rank=0, dp_size=1,
                 start_sample=0, num_samples=None):
        self.seq_len = _check_int("seq_len", seq_len, 1)
        self.global_batch = _check_int("global_batch", global_batch, 1)
        self.dp_size = _check_int("dp_size", dp_size, 1)
        self.dp_rank = _check_rank(dp_rank, self.dp_size)
        sizes = batch_split(self.global_batch, self.dp_size)
        _check_tokens(tokens, self.seq_len, "training")
        self.tokens = tokens
        self.seed = _check_int("seed", seed, 0)
        self.samples_consumed = _check_int("start_sample", start_sample, 0)
        self.num_samples = (None if num_samples is None
                            else _check_int("num_samples", num_samples, 0))
        self.local_batch = sizes[self.dp_rank]
        self.local_offset = sum(sizes[:self.dp_rank])
        self.samples_per_epoch = samples_per_epoch(tokens.size, self.seq_len)

    @property
    def epoch(self):
        """0-based epoch of the next sample (samples_consumed // samples_per_epoch)."""
        return self.samples_consumed // self.samples_per_epoch

    @property
    def exhausted(self):
        """True once a finite stream has no samples left; the same on every rank."""
        return self.num_samples is not None and self.samples_consumed >= self.num_samples

    def next_batch(self):
        """-> x, y: (b, T) int64 token ids; y is x shifted left by one token (next-token targets).

        b = local_batch, or fewer (possibly 0) in a finite stream's last batch.
        Raises StopIteration when a finite stream is exhausted.
        """
        if self.exhausted:
            raise StopIteration
        base = self.samples_consumed
        end = base + self.global_batch
        if self.num_samples is not None:
            end = min(end, self.num_samples)
        lo = min(base + self.local_offset, end)
        hi = min(lo + self.local_batch, end)
        starts = window_starts(self.tokens.size, self.seq_len, self.seed, np.arange(lo, hi))
        self.samples_consumed = end
        return _gather(self.tokens, starts, self.seq_len)



def eval_batches(tokens, seq_len, batch, n_batches, *, dp_rank=0, dp_size=1):
    """Fixed validation windows: yields this rank's x, y of each of `n_batches` global batches.

    The batch * n_batches windows are spread evenly over `tokens` (first at 0, last ending at the
    end; they overlap when tokens are short), independent of any seed, so every run and every world
    size evaluates the same windows. Rank r gets its `batch_split(batch, dp_size)[r]` samples of
    each batch (batch // dp_size when it divides), in rank order. x, y: (b, T) int64, y = x shifted
    by one token. Average the loss over all ranks' samples (sum of loss * b, then all-reduce) to
    get a val_loss comparable across world sizes.
    Raises ConfigError: batch smaller than dp_size, tokens shorter than seq_len + 1.
    """
    seq_len = _check_int("seq_len", seq_len, 1)
    batch = _check_int("batch", batch, 1)
    n_batches = _check_int("n_batches", n_batches, 0)
    dp_size = _check_int("dp_size", dp_size, 1)
    dp_rank = _check_rank(dp_rank, dp_size)
    sizes = batch_split(batch, dp_size, "eval batch")
    _check_tokens(tokens, seq_len, "validation")
    total = batch * n_batches
    last_start = tokens.size - seq_len - 1
    starts = np.arange(total, dtype=np.int64) * last_start // max(total - 1, 1)
    local, offset = sizes[dp_rank], sum(sizes[:dp_rank])
    for k in range(n_batches):
        lo = k * batch + offset
        yield _gather(tokens, starts[lo:lo + local], seq_len)
