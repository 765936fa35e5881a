"""Join requests: the file protocol between `rtxmpi join` and a running job (docs/elastic.md, "Join").

    rtxmpi join --job CKPT -n 2          # CKPT: the job's --ckpt-dir

The job's checkpoint directory identifies it (its lock names the running job). The client writes
CKPT/join.request (a temp file renamed into place) and waits for CKPT/join.answer with its id:

    request  {"version": 1, "id": ID, "ranks": K, "deadline_unix": T, "host": H, "pid": P}
    answer   {"version": 1, "id": ID, "admitted": true, "step": S, "old_world_size": M,
              "world_size": N}
             {"version": 1, "id": ID or null, "admitted": false, "reason": "..."}

Rank 0 of the job looks for the request at every step boundary (one stat), takes it (reads at
most REQUEST_BYTES and removes it) and validates it as untrusted input (`parse_request`); a bad
or expired request, or K over the job's limit, is answered at once (refused) and the job goes
on. A valid one rides the step boundary's agreement (rtxmpi.elastic.loop) and is answered after
the growth ("admitted": the new ranks continue from step S's state, the first step at N ranks is
S + 1), or refused when the spawn fails (no free slot) or the job ends first.
"""
import json
import os
import secrets
import socket
import sys
import time

from ..checkpoint.lock import running_holder as job_holder
from ..errors import ConfigError

REQUEST, ANSWER = "join.request", "join.answer"
VERSION = 1
MAX_RANKS = 4096  # the most ranks one request may ask for (the job's own limit is usually lower)
REQUEST_BYTES = 4096  # a request file longer than this is refused unread
MAX_ID = 2**62


def _write_atomically(path, data):
    """Write bytes `data` to `path` via a temp file in the same directory and os.replace."""
    tmp = f"{path}.tmp.{os.getpid()}.{secrets.token_hex(4)}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def check_ranks(ranks):
    """Raise ConfigError unless `ranks` is an int in [1, MAX_RANKS]."""
    if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
        raise ConfigError(f"-n must be a number of ranks in [1, {MAX_RANKS}], got {ranks!r}")


def check_timeout(timeout_s):
    """Raise ConfigError unless `timeout_s` is a number of seconds in (0, 1e6)."""
    if isinstance(timeout_s, bool) or not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < 1e6):
        raise ConfigError(f"--timeout-s must be > 0 seconds (and < 1e6), got {timeout_s!r}")


def write_request(job_dir, ranks, timeout_s):
    """Write a join request for `ranks` new ranks into `job_dir`, valid for `timeout_s` seconds.
    Returns its id (int). Raises ConfigError: bad ranks or timeout, a request already pending, or
    the directory cannot be written."""
    check_ranks(ranks)
    check_timeout(timeout_s)
    path = os.path.join(job_dir, REQUEST)
    if os.path.lexists(path):
        raise ConfigError(f"a join request is already pending in {job_dir} ({REQUEST}); wait for "
                          f"its answer, or remove the file if its client is gone")
    ident = secrets.randbelow(MAX_ID - 1) + 1
    body = {"version": VERSION, "id": ident, "ranks": ranks,
            "deadline_unix": round(time.time() + timeout_s, 3), "host": socket.gethostname(),
            "pid": os.getpid()}
    try:
        _write_atomically(path, json.dumps(body).encode())
    except OSError as exc:
        raise ConfigError(f"cannot write the join request in {job_dir}: {exc.strerror}") from None
    return ident


_stuck = set()  # identities of entries taken once that could not be removed (a directory)


def take_request(job_dir):
    """Rank 0 of the job: the pending request's bytes, removed from `job_dir`, or None (one stat
    when there is none). At most REQUEST_BYTES + 1 bytes are read; a link is not followed. An
    entry that cannot be removed (a directory) is returned once, then ignored."""
    path = os.path.join(job_dir, REQUEST)
    try:
        st = os.stat(path, follow_symlinks=False)
    except OSError:
        return None
    identity = (st.st_dev, st.st_ino, st.st_mtime_ns)
    if identity in _stuck:
        return None
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0))
        try:
            raw = os.read(fd, REQUEST_BYTES + 1)
        finally:
            os.close(fd)
    except OSError as exc:
        raw = f"unreadable: {exc.strerror}".encode()
    try:
        os.unlink(path)
    except OSError:
        _stuck.add(identity)
    return raw


def parse_request(raw, world_size, limit, now=None):
    """Validate a request's bytes (untrusted). Returns (id, ranks). Raises ConfigError with the
    reason (the answer's text); its `request_id` attribute is the id when one could be read.
    limit: the most ranks the world may grow to."""
    ident = None
    try:
        if len(raw) > REQUEST_BYTES:
            raise ConfigError(f"the request is longer than {REQUEST_BYTES} bytes")
        try:
            body = json.loads(raw.decode("utf-8"))
        except (UnicodeDecodeError, ValueError):
            raise ConfigError("the request is not a JSON object (write it with `rtxmpi join`)") from None
        if not isinstance(body, dict):
            raise ConfigError("the request is not a JSON object (write it with `rtxmpi join`)")
        value = body.get("id")
        if not isinstance(value, bool) and isinstance(value, int) and 1 <= value < MAX_ID:
            ident = value
        else:
            raise ConfigError(f"the request's id {repr(value)[:40]} is not an int in [1, 2**62)")
        if body.get("version") != VERSION:
            raise ConfigError(f"request version {repr(body.get('version'))[:20]}; this job reads "
                              f"version {VERSION}")
        ranks = body.get("ranks")
        if isinstance(ranks, bool) or not isinstance(ranks, int) or not 1 <= ranks <= MAX_RANKS:
            raise ConfigError(f"ranks {repr(ranks)[:40]} is not a number of ranks in [1, {MAX_RANKS}]")
        deadline = body.get("deadline_unix")
        if isinstance(deadline, bool) or not isinstance(deadline, (int, float)):
            raise ConfigError("the request has no deadline_unix")
        now = time.time() if now is None else now
        if deadline < now:
            raise ConfigError(f"the request expired {now - deadline:.0f} s ago (its client gave up)")
        if world_size + ranks > limit:
            raise ConfigError(f"{world_size} + {ranks} ranks is over this job's limit of {limit} "
                              "(--max-ranks)")
        return ident, ranks
    except ConfigError as exc:
        exc.request_id = ident
        raise


def write_answer(job_dir, ident, admitted, **fields):
    """Rank 0 of the job: answer request `ident` (None: unreadable) in `job_dir`. A failure to
    write is reported on stderr, not raised (the job goes on)."""
    body = {"version": VERSION, "id": ident, "admitted": bool(admitted), **fields}
    try:
        _write_atomically(os.path.join(job_dir, ANSWER), json.dumps(body).encode())
    except OSError as exc:
        print(f"elastic: cannot write the join answer in {job_dir}: {exc.strerror}",
              file=sys.stderr, flush=True)


def read_answer(job_dir, ident):
    """The answer to request `ident` (a dict) when `job_dir` holds it, else None."""
    try:
        with open(os.path.join(job_dir, ANSWER), "rb") as f:
            body = json.loads(f.read(REQUEST_BYTES).decode("utf-8", "replace"))
    except (OSError, ValueError):
        return None
    return body if isinstance(body, dict) and body.get("id") == ident else None


def client(job_dir, ranks, timeout_s=300.0, progress_s=5.0, out=None):
    """`rtxmpi join`: ask the job at `job_dir` to admit `ranks` ranks and wait for its answer.
    Prints progress every `progress_s` seconds on `out` (default stderr). Returns the exit
    status: 0 admitted, 1 refused or no answer within `timeout_s`. Raises ConfigError (exit 2):
    bad arguments, no running job at `job_dir`. Local (no MPI)."""
    check_ranks(ranks)
    check_timeout(timeout_s)
    holder = job_holder(job_dir)
    ident = write_request(job_dir, ranks, timeout_s)
    request = os.path.join(job_dir, REQUEST)
    say = lambda text: print(f"rtxmpi join: {text}", file=out or sys.stderr, flush=True)  # noqa: E731
    say(f"asked {holder} at {job_dir} for {ranks} more rank{'s' * (ranks > 1)}; waiting up to "
        f"{timeout_s:g} s (the job answers at its next step boundary)")
    start = time.monotonic()
    deadline, next_note = start + timeout_s, start + progress_s
    while True:
        answer = read_answer(job_dir, ident)
        if answer is not None:
            break
        now = time.monotonic()
        if now >= deadline:
            try:
                os.unlink(request)
                taken = False
            except FileNotFoundError:
                taken = True
            except OSError:
                taken = False
            say(f"error: the job took the request but did not answer within {timeout_s:g} s"
                if taken else
                f"error: the job did not take the request within {timeout_s:g} s (withdrawn); is it "
                "running with --elastic grow, and is a step that long?")
            return 1
        if now >= next_note:
            taken = not os.path.lexists(request)
            say(f"{now - start:.0f} s: " + ("taken; the job is starting the new ranks" if taken
                                           else "waiting for the job's next step boundary"))
            next_note = now + progress_s
        time.sleep(0.05)
    try:
        os.unlink(os.path.join(job_dir, ANSWER))
    except OSError:
        pass
    if answer.get("admitted"):
        say(f"admitted {ranks} rank{'s' * (ranks > 1)}: the world grew {answer.get('old_world_size')} "
            f"-> {answer.get('world_size')} ranks, continuing from step {answer.get('step')}")
        return 0
    say(f"refused: {str(answer.get('reason'))[:500]}")
    return 1


__all__ = ["REQUEST", "ANSWER", "MAX_RANKS", "check_ranks", "job_holder", "write_request",
           "take_request", "parse_request", "write_answer", "read_answer", "client"]
