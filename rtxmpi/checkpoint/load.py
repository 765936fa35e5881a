"""Loading: `load_checkpoint` (collective), and single-process `list_checkpoints`,
`verify_checkpoint`, `latest_step`. Only directories with metadata.json are trusted."""
import os
from dataclasses import dataclass

import numpy as np

from rtxmpi.checkpoint import format as fmt
from rtxmpi.checkpoint.agree import raise_if_any_failed
from rtxmpi.errors import CheckpointError


class Checkpoint:
    """A committed checkpoint opened for reading; data is read lazily, range by range.

    Attributes: path (step dir), step, world_size_saved, meta (the saved meta dict), tensors
    ({name: {"dtype", "global_size", "pieces": [{"file", "offset", "length", "checksum"}]}}),
    metadata (the whole metadata.json), ignored (paths of uncommitted step dirs newer than this
    one, which a load skipped). With a group every method is collective (errors are raised on
    every rank); with group None it is a single-process reader.
    """

    def __init__(self, group, path, metadata, ignored=()):
        self.group, self.path, self.metadata = group, path, metadata
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
                path = os.path.join(self.path, piece["file"])
                h5file = None
                if files is not None:
                    if path not in files:
                        files[path] = fmt.open_rank_file(path)
                    h5file = files[path]
                fmt.read_piece(path, name, {**piece, "dtype": info["dtype"]}, lo - piece["offset"],
                               hi - piece["offset"], out[lo - offset:hi - offset], h5file=h5file)
        return out

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
        except (CheckpointError, OSError, TypeError, ValueError) as exc:  # must reach every rank
            error = exc
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
        except (CheckpointError, OSError, TypeError, ValueError) as exc:  # must reach every rank
            error = exc
        finally:
            for f in files.values():
                f.close()
        raise_if_any_failed(self.group, error, f"reading {sorted(requests)} from {self.path}")
        return result

    def rank_state(self, rank):
        """The rank_state saved by rank `rank % world_size_saved` (the rule at any world size:
        a new rank r gets saved rank r % N's state). Collective when the checkpoint has a group."""
        path = os.path.join(self.path, fmt.rank_file_name(int(rank) % self.world_size_saved))
        error, state = None, None
        try:
            state = fmt.read_rank_state(path)
        except (CheckpointError, OSError, TypeError, ValueError) as exc:
            error = exc
        raise_if_any_failed(self.group, error, f"reading rank state from {self.path}")
        return state


def _check_files(step_dir, metadata):
    """Every rank file listed in metadata exists with exactly the recorded size."""
    for name, info in metadata["files"].items():
        path = os.path.join(step_dir, name)
        try:
            size = os.path.getsize(path)
        except OSError:
            raise CheckpointError(f"{path}: rank file is missing") from None
        if size != info["bytes"]:
            raise CheckpointError(f"{path}: {size} bytes on disk, metadata says {info['bytes']} "
                                  f"(truncated or replaced)")


def _open_local(ckpt_dir, step):
    ckpt_dir = os.path.abspath(ckpt_dir)
    step_dir = os.path.join(ckpt_dir, fmt.step_dir_name(step))
    metadata = fmt.read_metadata(step_dir)
    _check_files(step_dir, metadata)
    ignored = [p for s, p in fmt.step_dirs(ckpt_dir).items() if s > step and not fmt.is_committed(p)]
    return step_dir, metadata, ignored


def load_checkpoint(group, ckpt_dir, step=None):
    """Open committed checkpoint `step` (None: the latest committed) of `ckpt_dir`.

    Rank 0 chooses the step and broadcasts it, so every rank opens the same one; every rank then
    reads metadata.json and checks that every rank file exists with its recorded size. Data is
    read later with `Checkpoint.read`. Uncommitted step dirs are ignored (listed in `.ignored`).
    group: a ProcessGroup (collective: every rank must call), or None for one process.
    Raises CheckpointError on every rank: no committed checkpoint, missing/truncated files.
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
    if group is not None:
        buf = np.array([chosen], np.int64)
        group.broadcast(buf, src=0)
        chosen = int(buf[0])
    opened = None
    try:
        opened = _open_local(ckpt_dir, chosen)
    except (CheckpointError, OSError, KeyError, ValueError) as exc:
        error = exc if isinstance(exc, CheckpointError) else CheckpointError(
            f"{ckpt_dir}: step {chosen}: bad metadata: {type(exc).__name__}: {exc}")
    raise_if_any_failed(group, error, "opening a checkpoint")
    return Checkpoint(group, *opened)


@dataclass
class CheckpointInfo:
    """One step dir as `list_checkpoints` sees it."""

    step: int
    path: str
    committed: bool
    world_size: int  # saved world size (committed) or rank files found (uncommitted)
    bytes: int  # size on disk of every file in the dir
    latest: bool  # the step latest_step() returns


def list_checkpoints(ckpt_dir):
    """Every step dir in `ckpt_dir`, committed or not, oldest first (single process)."""
    latest = fmt.latest_step(ckpt_dir)
    found = []
    for step, path in fmt.step_dirs(ckpt_dir).items():
        names = os.listdir(path)
        total = sum(os.path.getsize(os.path.join(path, n)) for n in names
                    if os.path.isfile(os.path.join(path, n)))
        committed = fmt.is_committed(path)
        world_size = sum(1 for n in names if n.startswith("rank_") and n.endswith(".h5"))
        if committed:
            try:
                world_size = int(fmt.read_metadata(path)["world_size"])
            except (CheckpointError, KeyError, ValueError):
                committed = False
        found.append(CheckpointInfo(step, path, committed, world_size, total, step == latest))
    return found


def verify_checkpoint(ckpt_dir, step=None):
    """Check every file and dataset of a committed checkpoint: sizes, attributes, checksums.

    step None: the latest committed. Single process. Returns a list of the "file: dataset"
    entries checked. Raises CheckpointError listing every problem found (file and dataset named).
    """
    chosen = fmt.latest_step(ckpt_dir) if step is None else int(step)
    if chosen is None:
        raise CheckpointError(f"{ckpt_dir}: no committed checkpoint")
    step_dir = os.path.join(os.path.abspath(ckpt_dir), fmt.step_dir_name(chosen))
    metadata = fmt.read_metadata(step_dir)
    problems, checked = [], []
    for name, info in metadata["files"].items():
        path = os.path.join(step_dir, name)
        size = os.path.getsize(path) if os.path.exists(path) else None
        if size != info["bytes"]:
            problems.append(f"{path}: {'missing' if size is None else f'{size} bytes'}, "
                            f"metadata says {info['bytes']} bytes")
    for name, info in metadata["tensors"].items():
        for piece in info["pieces"]:
            path = os.path.join(step_dir, piece["file"])
            checked.append(f"{piece['file']}: /tensors/{name}")
            try:
                fmt.read_piece(path, name, {**piece, "dtype": info["dtype"]}, 0, 0)
            except CheckpointError as exc:
                problems.append(str(exc))
    for name in metadata["files"]:
        path = os.path.join(step_dir, name)
        checked.append(f"{name}: rank_state")
        try:
            fmt.read_rank_state(path)
        except CheckpointError as exc:
            problems.append(str(exc))
    if problems:
        raise CheckpointError(f"{step_dir}: {len(problems)} problem(s):\n  " + "\n  ".join(problems))
    return checked
