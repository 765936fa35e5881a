"""metadata.json read as untrusted input: size, checksum and schema checked before anything uses it.

`read_metadata(step_dir)` returns the parsed dict only when it is a regular file of at most
METADATA_MAX_BYTES, parses as JSON, carries a `metadata_checksum` equal to `metadata_checksum()`
of the rest (format_version 3; versions 1-2 predate it and load with a warning), and passes
`validate_metadata`: required fields of the right types and bounds, rank file names that are
plain names, allowlisted dtypes, pieces that cover each tensor exactly and fit in their files.
"""
import json
import os
import re

from rtxmpi.checkpoint import format as fmt
from rtxmpi.errors import CheckpointError

METADATA_MAX_BYTES = 64 << 20
MAX_WORLD_SIZE = 1 << 24
MAX_COUNT = 1 << 62  # element and byte counts: far above any real file, still an int64
CHECKSUM_RE = re.compile(r"^(crc32c|crc32):[0-9a-f]{8}$")
OLD_FORMAT_WARNING = ("written before metadata.json carried its own checksum (format_version {v}): "
                      "its fields are checked for types and bounds only")


def _field(value, where, kind, lo=0, hi=MAX_COUNT):
    """`value` when it is a `kind` ("int" within [lo, hi], "str", "dict", "list", "number")."""
    ok = {"int": isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi,
          "str": isinstance(value, str), "dict": isinstance(value, dict),
          "list": isinstance(value, list),
          "number": isinstance(value, (int, float)) and not isinstance(value, bool)}[kind]
    if not ok:
        bounds = f" in [{lo}, {hi}]" if kind == "int" else ""
        raise CheckpointError(f"{where}: expected {kind}{bounds}, got {type(value).__name__} "
                              f"{str(value)[:80]!r}")
    return value


def _get(obj, key, where, kind, **bounds):
    if key not in obj:
        raise CheckpointError(f"{where}: required field {key!r} is missing")
    return _field(obj[key], f"{where}.{key}", kind, **bounds)


def validate_metadata(metadata, where):
    """Raise CheckpointError naming the first field of `metadata` (parsed metadata.json) that is
    missing, of the wrong type, out of bounds or inconsistent; return None when it is usable."""
    _field(metadata, where, "dict")
    _get(metadata, "format_version", where, "int", lo=min(fmt.READABLE_FORMAT_VERSIONS),
         hi=max(fmt.READABLE_FORMAT_VERSIONS))
    _get(metadata, "step", where, "int")
    world_size = _get(metadata, "world_size", where, "int", lo=1, hi=MAX_WORLD_SIZE)
    _get(metadata, "meta", where, "dict")
    if "created_unix" in metadata:
        _get(metadata, "created_unix", where, "number")
    if metadata.get("run_id") is not None:
        _get(metadata, "run_id", where, "str")
    files = _get(metadata, "files", where, "dict")
    expected = {fmt.rank_file_name(r): r for r in range(world_size)}
    if set(files) != set(expected):
        odd = sorted(set(files) ^ set(expected))[:3]
        raise CheckpointError(f"{where}.files: expected exactly the rank files of world_size "
                              f"{world_size} (rank_00000.h5 ...); differs at {odd}")
    for name, rank in expected.items():
        info = _field(files[name], f"{where}.files[{name!r}]", "dict")
        _get(info, "rank", f"{where}.files[{name!r}]", "int", lo=rank, hi=rank)
        _get(info, "bytes", f"{where}.files[{name!r}]", "int")
    in_file = dict.fromkeys(files, 0)  # bytes of the pieces each file must hold
    for name, info in _get(metadata, "tensors", where, "dict").items():
        here = f"{where}.tensors[{name!r}]"
        fmt.check_tensor_name(name)
        _field(info, here, "dict")
        dtype = fmt.check_dtype(_get(info, "dtype", here, "str"), here)
        size = _get(info, "global_size", here, "int")
        covered = 0
        for i, piece in enumerate(_get(info, "pieces", here, "list")):
            at = f"{here}.pieces[{i}]"
            _field(piece, at, "dict")
            file = _get(piece, "file", at, "str")
            if file not in files:
                raise CheckpointError(f"{at}.file: {file[:80]!r} is not one of the checkpoint's "
                                      f"rank files")
            _get(piece, "offset", at, "int", lo=covered, hi=covered)  # sorted, no gap or overlap
            covered += _get(piece, "length", at, "int", lo=1)
            if not CHECKSUM_RE.match(_get(piece, "checksum", at, "str")):
                raise CheckpointError(f"{at}.checksum: {piece['checksum'][:80]!r} is not "
                                      f"'crc32c:' or 'crc32:' and 8 hex digits")
            in_file[file] += piece["length"] * dtype.itemsize
        if covered != size:
            raise CheckpointError(f"{here}: pieces cover {covered} of its {size} elements")
    for name, nbytes in in_file.items():
        if nbytes > files[name]["bytes"]:
            raise CheckpointError(f"{where}.files[{name!r}]: its pieces need {nbytes} bytes, "
                                  f"the file has {files[name]['bytes']}")


def read_metadata(step_dir):
    """(metadata, warnings) of a step dir's metadata.json, checked as the module says.

    warnings: a list of strings for rank 0 to print (an old format without a checksum).
    Raises CheckpointError: missing (never committed), not a regular file, too large, not JSON,
    checksum mismatch (edited or corrupt), or a schema error naming the field.
    """
    path = os.path.join(step_dir, fmt.METADATA)
    if not os.path.lexists(path):
        if not os.path.isdir(step_dir):
            raise CheckpointError(f"{step_dir}: no such checkpoint")
        raise CheckpointError(f"{step_dir}: no {fmt.METADATA}: the checkpoint was never committed")
    try:
        fd, size = fmt.open_regular(path)
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    try:
        if size > METADATA_MAX_BYTES:
            raise CheckpointError(f"{path}: {size} bytes; metadata.json is at most "
                                  f"{METADATA_MAX_BYTES} bytes")
        with os.fdopen(os.dup(fd), "rb") as f:
            raw = f.read(METADATA_MAX_BYTES + 1)
    except OSError as exc:
        raise CheckpointError(f"{path}: unreadable: {exc}") from None
    finally:
        os.close(fd)
    try:
        metadata = json.loads(raw)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise CheckpointError(f"{path}: not JSON: {str(exc)[:200]}") from None
    version = metadata.get("format_version") if isinstance(metadata, dict) else None
    if isinstance(metadata, dict) and version not in fmt.READABLE_FORMAT_VERSIONS:
        raise CheckpointError(f"{path}: format_version {version!r}; this rtxmpi reads versions "
                              f"{', '.join(map(str, fmt.READABLE_FORMAT_VERSIONS))} (a newer "
                              f"rtxmpi wrote it?)")
    warnings = []
    if isinstance(metadata, dict):
        stored = metadata.get(fmt.METADATA_CHECKSUM)
        if stored is None and version < 3:
            warnings.append(f"{path}: " + OLD_FORMAT_WARNING.format(v=version))
        elif stored is None:
            raise CheckpointError(f"{path}: no {fmt.METADATA_CHECKSUM}, which format_version "
                                  f"{version} carries (edited or corrupt)")
        elif stored != fmt.metadata_checksum(metadata):
            raise CheckpointError(f"{path}: {fmt.METADATA_CHECKSUM} {str(stored)[:80]!r} does not "
                                  f"match its content (edited or corrupt)")
    validate_metadata(metadata, path)
    named = fmt.parse_step(os.path.basename(os.path.normpath(step_dir)))
    if named is not None and metadata["step"] != named:
        raise CheckpointError(f"{path}: step {metadata['step']} in a directory of step {named}")
    return metadata, warnings
