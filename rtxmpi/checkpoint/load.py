"""Loading: `load_checkpoint` and `latest_valid` (collective), and single-process
`list_checkpoints`, `verify_checkpoint`, `latest_step`. Only directories with metadata.json are
trusted, and their files only as far as they pass the checks of metadata.py and format.RankFile:
this is the one reader, used by resume and by `rtxmpi ckpt verify` alike."""
import os
import stat
from dataclasses import dataclass

import numpy as np

from rtxmpi.checkpoint import format as fmt
from rtxmpi.checkpoint.agree import raise_if_any_failed
from rtxmpi.checkpoint.metadata import read_metadata
from rtxmpi.errors import CheckpointError

# What parsing an untrusted HDF5 file may raise besides CheckpointError (h5py maps HDF5's errors
# to these); each is reported as a CheckpointError naming the file.
READ_ERRORS = (CheckpointError, OSError, KeyError, TypeError, ValueError, RuntimeError)


def _as_checkpoint_error(exc, where):
    if isinstance(exc, CheckpointError):
        return exc
    return CheckpointError(f"{where}: {type(exc).__name__}: {exc}")


class Checkpoint:
    """A committed checkpoint opened for reading; data is read lazily, range by range.

    Attributes: path (step dir), step, world_size_saved, meta (the saved meta dict), tensors
    ({name: {"dtype", "global_size", "pieces": [{"file", "offset", "length", "checksum"}]}}),
    metadata (the whole metadata.json, checked), ignored (paths of uncommitted step dirs newer
    than this one, which a load skipped), warnings (messages for rank 0 to print: an old format
    without a metadata checksum). With a group every method is collective (errors are raised on
    every rank); with group None it is a single-process reader.
    """

    def __init__(self, group, path, metadata, ignored=(), warnings=()):
        self.group, self.path, self.metadata = group, path, metadata
        self.warnings = list(warnings)
        self.step = int(metadata["step"])
        self.world_size_saved = int(metadata["world_size"])
        self.meta = metadata.get("meta", {})
        self.tensors = metadata["tensors"]
        self.ignored = list(ignored)

    def __repr__(self):
        return f"<Checkpoint {self.path} step={self.step} world_size_saved={self.world_size_saved}>"

    def _read_local(self, name, offset, length, out, files=None):
        """files: optional {path: open h5py.File} reused across calls (read_many); None: each
        piece's file is opened and closed here."""
        if name not in self.tensors:
            raise CheckpointError(f"{self.path}: no tensor {name!r}; it holds {sorted(self.tensors)}")
        info = self.tensors[name]
        size, dtype = int(info["global_size"]), np.dtype(info["dtype"])
        length = size - offset if length is None else int(length)
        if offset < 0 or length < 0 or offset + length > size:
            raise CheckpointError(f"{self.path}: range [{offset}, {offset + length}) of tensor "
                                  f"{name!r} lies outside its {size} elements")
        if out is None:
            out = np.empty(length, dtype)
        elif out.shape != (length,) or out.dtype != dtype or not out.flags.c_contiguous:
            raise CheckpointError(f"out must be a contiguous ({length},) {dtype} array, got "
                                  f"{out.shape} {out.dtype}")
        stop = offset + length
        for piece in info["pieces"]:  # sorted by offset; only overlapping files are opened
            lo, hi = max(offset, piece["offset"]), min(stop, piece["offset"] + piece["length"])
            if lo < hi:
                name_file = piece["file"]
                if files is not None and name_file in files:
                    rank_file = files[name_file]
                else:
                    rank_file = self._open_file(name_file)
                    if files is not None:
                        files[name_file] = rank_file
                try:
                    fmt.read_piece(rank_file, name, {**piece, "dtype": info["dtype"]},
                                   lo - piece["offset"], hi - piece["offset"],
                                   out[lo - offset:hi - offset])
                finally:
                    if files is None:
                        rank_file.close()
        return out

    def _open_file(self, name):
        return _open_rank_file(self.path, self.metadata, name)

    def read(self, name, offset=0, length=None, out=None):
        """Elements [offset, offset + length) of tensor `name` as a 1-D numpy array.

        length None: to the end. out: optional contiguous numpy array of that length and the
        tensor's dtype to fill (e.g. a model's flat buffer). Opens only the rank files whose pieces
        overlap the range; each piece it touches is checksummed whole, streaming. Collective when
        the checkpoint has a group (ranks may ask for different ranges); raises CheckpointError
        on every rank, naming the file and dataset, when any rank's read fails.
        """
        error, result = None, None
        try:
            result = self._read_local(name, int(offset), length, out)
        except READ_ERRORS as exc:  # must reach every rank
            error = _as_checkpoint_error(exc, self.path)
        raise_if_any_failed(self.group, error, f"reading {name!r} from {self.path}")
        return result

    def read_many(self, requests):
        """Several reads with one agreement: {name: (offset, length, out)} -> {name: array}.

        Each value is as `read`'s arguments (length None: to the end; out None: a new array).
        Ranks run their reads without waiting for each other between tensors, then agree once;
        use it to load all of a rank's tensors (the sum of each rank's own read times, not the sum
        over tensors of the slowest rank's). Collective like `read`; raises CheckpointError on
        every rank, naming the file and dataset, when any rank's read fails.
        """
        error, result, files = None, {}, {}  # each rank file opened once for all the requests
        try:
            for name, (offset, length, out) in requests.items():
                result[name] = self._read_local(name, int(offset), length, out, files)
        except READ_ERRORS as exc:  # must reach every rank
            error = _as_checkpoint_error(exc, self.path)
        finally:
            for f in files.values():
                f.close()
        raise_if_any_failed(self.group, error, f"reading {sorted(requests)} from {self.path}")
        return result

    def rank_state(self, rank):
        """The rank_state saved by rank `rank % world_size_saved` (the rule at any world size:
        a new rank r gets saved rank r % N's state). Collective when the checkpoint has a group."""
        error, state = None, None
        try:
            with self._open_file(fmt.rank_file_name(int(rank) % self.world_size_saved)) as rank_file:
                state = fmt.read_rank_state(rank_file)
        except READ_ERRORS as exc:
            error = _as_checkpoint_error(exc, self.path)
        raise_if_any_failed(self.group, error, f"reading rank state from {self.path}")
        return state


def _check_files(step_dir, metadata):
    """Every rank file listed in metadata is a regular file (not a symlink, FIFO or device) of
    exactly the recorded size; lstat only, nothing is opened."""
    for name, info in metadata["files"].items():
        path = os.path.join(step_dir, name)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            raise CheckpointError(f"{path}: rank file is missing") from None
        if not stat.S_ISREG(st.st_mode):
            raise CheckpointError(f"{path}: not a regular file (a symlink, FIFO, device or "
                                  f"directory); a checkpoint holds only regular files")
        if st.st_size != info["bytes"]:
            raise CheckpointError(f"{path}: {st.st_size} bytes on disk, metadata says {info['bytes']} "
                                  f"(truncated or replaced)")


def _step_dir(ckpt_dir, step):
    return os.path.join(os.path.abspath(ckpt_dir), fmt.step_dir_name(step))


def _open_local(ckpt_dir, step):
    step_dir = _step_dir(ckpt_dir, step)
    metadata, warnings = read_metadata(step_dir)
    _check_files(step_dir, metadata)
    ignored = [p for s, p in fmt.step_dirs(ckpt_dir).items() if s > step and not fmt.is_committed(p)]
    return step_dir, metadata, ignored, warnings


def _open_rank_file(step_dir, metadata, name):
    """RankFile `name` of a step dir, its /tensors checked against the (validated) metadata."""
    rank_file = fmt.RankFile(step_dir, name, metadata["files"][name]["bytes"])
    try:
        rank_file.check_listed({t for t, info in metadata["tensors"].items()
                                if any(p["file"] == name for p in info["pieces"])})
    except BaseException:
        rank_file.close()
        raise
    return rank_file


def _verify_files(step_dir, metadata, names):
    """Check rank files `names` of a step dir whose metadata was read: structure, every piece's
    checksum, the rank state. Returns (the "file: dataset" entries checked, problems found)."""
    checked, problems = [], []
    for file in names:
        try:
            rank_file = _open_rank_file(step_dir, metadata, file)
        except READ_ERRORS as exc:
            problems.append(str(_as_checkpoint_error(exc, os.path.join(step_dir, file))))
            continue
        with rank_file:
            for name, info in metadata["tensors"].items():
                for piece in info["pieces"]:
                    if piece["file"] != file:
                        continue
                    checked.append(f"{file}: /tensors/{name}")
                    try:
                        fmt.read_piece(rank_file, name, {**piece, "dtype": info["dtype"]}, 0, 0)
                    except READ_ERRORS as exc:
                        problems.append(str(_as_checkpoint_error(exc, rank_file.path)))
            checked.append(f"{file}: rank_state")
            try:
                fmt.read_rank_state(rank_file)
            except READ_ERRORS as exc:
                problems.append(str(_as_checkpoint_error(exc, rank_file.path)))
    return checked, problems


def _broadcast_step(group, step):
    if group is None:
        return step
    buf = np.array([step], np.int64)
    group.broadcast(buf, src=0)
    return int(buf[0])


def load_checkpoint(group, ckpt_dir, step=None):
    """Open committed checkpoint `step` (None: the latest committed) of `ckpt_dir`.

    Rank 0 chooses the step and broadcasts it, so every rank opens the same one; every rank then
    reads and checks metadata.json (size, checksum, schema) and checks that every rank file is a
    regular file of its recorded size. Data is read later with `Checkpoint.read`, each dataset
    checked before it is read. Uncommitted step dirs are ignored (listed in `.ignored`).
    group: a ProcessGroup (collective: every rank must call), or None for one process.
    Raises CheckpointError on every rank: no committed checkpoint, bad metadata, missing,
    truncated or irregular files.
    """
    error = None
    chosen = -1
    if group is None or group.rank == 0:
        try:
            chosen = fmt.latest_step(ckpt_dir) if step is None else int(step)
            if chosen is None:
                raise CheckpointError(f"{ckpt_dir}: no committed checkpoint")
        except (CheckpointError, OSError) as exc:
            error, chosen = exc, -1
    raise_if_any_failed(group, error, "opening a checkpoint")
    chosen = _broadcast_step(group, chosen)
    opened = None
    try:
        opened = _open_local(ckpt_dir, chosen)
    except (CheckpointError, OSError) as exc:
        error = _as_checkpoint_error(exc, _step_dir(ckpt_dir, chosen))
    raise_if_any_failed(group, error, "opening a checkpoint")
    return Checkpoint(group, *opened)


def _committed_below(ckpt_dir, below):
    """The newest committed step (latest_step) when `below` is None, else the highest committed
    step < below; -1 when there is none."""
    if below is None:
        step = fmt.latest_step(ckpt_dir)
        return -1 if step is None else step
    older = [s for s, path in fmt.step_dirs(ckpt_dir).items() if s < below and fmt.is_committed(path)]
    return max(older, default=-1)


def latest_valid(group, ckpt_dir, *, fallback=True):
    """The newest committed checkpoint of `ckpt_dir` that verifies, as (step or None, skipped).

    Verifies as `verify_checkpoint` does (metadata, every file's structure, every checksum), the
    rank files shared round-robin among the ranks of `group` (one read of the checkpoint in all).
    fallback: when a checkpoint fails, try the next older committed one; skipped lists the
    (step dir, reason) of each that failed, newest first. fallback False: raise at the first.
    Rank 0 picks each candidate and broadcasts it, so every rank returns the same step.
    Collective (group None: one process). Raises CheckpointError on every rank (fallback False
    and a bad checkpoint, or the directory unreadable).
    """
    rank, size = (0, 1) if group is None else (group.rank, group.world_size)
    skipped, below = [], None
    while True:
        error, chosen = None, -1
        if rank == 0:
            try:
                chosen = _committed_below(ckpt_dir, below)
            except OSError as exc:
                error = exc
        raise_if_any_failed(group, error, f"listing the checkpoints in {ckpt_dir}")
        chosen = _broadcast_step(group, chosen)
        if chosen < 0:
            return None, skipped
        step_dir, error = _step_dir(ckpt_dir, chosen), None
        try:
            metadata, _ = read_metadata(step_dir)
            _check_files(step_dir, metadata)
            _, problems = _verify_files(step_dir, metadata, sorted(metadata["files"])[rank::size])
            if problems:
                error = CheckpointError("; ".join(problems))
        except (CheckpointError, OSError) as exc:
            error = _as_checkpoint_error(exc, step_dir)
        try:
            raise_if_any_failed(group, error, f"verifying {step_dir}")
            return chosen, skipped
        except CheckpointError as exc:
            if not fallback:
                raise
            skipped.append((step_dir, str(exc)))
        below = chosen


@dataclass
class CheckpointInfo:
    """One step dir as `list_checkpoints` sees it."""

    step: int
    path: str
    committed: bool
    world_size: int  # saved world size (committed) or rank files found (uncommitted)
    bytes: int  # size on disk of every file in the dir
    latest: bool  # the step latest_step() returns
    problem: str = None  # committed, but metadata.json does not pass its checks: why


def list_checkpoints(ckpt_dir):
    """Every step dir in `ckpt_dir`, committed or not, oldest first (single process).
    committed: metadata.json is there; problem: why it does not pass its checks, or None (the
    rank files are not read: verify_checkpoint does that)."""
    latest = fmt.latest_step(ckpt_dir)
    found = []
    for step, path in fmt.step_dirs(ckpt_dir).items():
        names = os.listdir(path)
        total = sum(os.path.getsize(os.path.join(path, n)) for n in names
                    if os.path.isfile(os.path.join(path, n)))
        committed = fmt.is_committed(path)
        world_size = sum(1 for n in names if n.startswith("rank_") and n.endswith(".h5"))
        problem = None
        if committed:
            try:
                world_size = read_metadata(path)[0]["world_size"]
            except CheckpointError as exc:
                problem = str(exc)
        found.append(CheckpointInfo(step, path, committed, world_size, total, step == latest,
                                    problem))
    return found


def verify_checkpoint(ckpt_dir, step=None, warnings=None):
    """Check every file and dataset of a committed checkpoint: metadata.json (checksum, schema),
    each rank file (a regular file of its recorded size, its HDF5 structure), every dataset's
    layout, dtype, shape and checksum, and the rank state.

    step None: the latest committed. Single process. warnings: optional list that gets the
    messages a load would print (an old format without a metadata checksum). Returns a list of
    the "file: dataset" entries checked. Raises CheckpointError listing every problem found
    (file and dataset named).
    """
    chosen = fmt.latest_step(ckpt_dir) if step is None else int(step)
    if chosen is None:
        raise CheckpointError(f"{ckpt_dir}: no committed checkpoint")
    step_dir = _step_dir(ckpt_dir, chosen)
    metadata, found = read_metadata(step_dir)
    if warnings is not None:
        warnings.extend(found)
    checked, problems = _verify_files(step_dir, metadata, sorted(metadata["files"]))
    if problems:
        raise CheckpointError(f"{step_dir}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return checked
