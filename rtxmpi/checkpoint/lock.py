"""One job per checkpoint directory: a lock taken before the first write and held for the run.

    lock = lock_dir(group, "CKPT")     # collective; DirectoryLocked on every rank if another job holds it
    ...                                # train, save checkpoints
    lock.release()                     # also at interpreter exit

Rank 0 holds the lock for the whole group, in one of two modes:

flock (default): an exclusive `flock` on CKPT/rtxmpi.lock. The kernel (NFSv4: the server) drops it
when the holding process dies, so a dead job never blocks the next one. The file names the holder
(JSON: job_id, host, pid, start_unix, attempt) for the message a refused job prints; release
empties it, so content found by the next holder means a job that ended without releasing, which
that holder reports in a warning.

lease (where flock fails with ENOLCK, EOPNOTSUPP or ENOSYS, e.g. Lustre without `-o flock`, or
RTXMPI_CKPT_LOCK=lease): CKPT/rtxmpi.lease, created with O_CREAT|O_EXCL and holding the same
JSON; a thread of rank 0 refreshes its mtime every stale_s / 4; release removes it. A lease is
stale, and taken over with a warning, when its holder ran on this host and its pid is gone, or
its mtime is more than stale_s old (RTXMPI_CKPT_LEASE_S, default LEASE_STALE_S; the hosts' clocks
must agree with the file server's to well within it). Takeovers are serialized by an O_EXCL
CKPT/rtxmpi.lease.takeover file, so two jobs never both take over one stale lease.

Either mode: a holder writes its record just after taking the lock; a job refused in between
waits up to RECORD_WAIT_S for it, so the refusal names the holder.

Either mode: a lock held by an earlier attempt of the same job (same job id, lower attempt: a
relaunch by `rtxmpi run`, a Slurm requeue) is taken over; in flock mode after waiting up to
RELAUNCH_WAIT_S for that attempt's processes to exit. The job id is $RTXMPI_JOB_ID (`rtxmpi
run` sets one for all its attempts), else $SLURM_JOB_ID, else none (every launch is its own
job); the attempt is ($SLURM_RESTART_COUNT, $RTXMPI_RESTART). A group that re-locks a directory
it locked before (after an elastic shrink that lost rank 0) takes over its own job's lock.
"""
import atexit
import errno
import fcntl
import json
import os
import socket
import sys
import threading
import time

import numpy as np

from rtxmpi.errors import ConfigError, DirectoryLocked

LOCK_FILE = "rtxmpi.lock"
LEASE_FILE = "rtxmpi.lease"
TAKEOVER_SUFFIX = ".takeover"
MODE_ENV = "RTXMPI_CKPT_LOCK"  # auto (flock, else lease) or lease
LEASE_ENV = "RTXMPI_CKPT_LEASE_S"
LEASE_STALE_S = 120.0  # a lease not refreshed for this long belongs to a dead job
RELAUNCH_WAIT_S = 30.0  # flock: how long a relaunch waits for its earlier attempt's processes
TAKEOVER_STALE_S = 30.0  # a takeover file this old was left by a taker that died
NO_FLOCK = (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS)
RECORD_BYTES = 4096  # the agreed outcome, broadcast from rank 0
RECORD_WAIT_S = 1.0  # how long a refused job waits for a new holder to write its record

_held = {}  # abs ckpt dir -> DirLock of this process (kept across elastic re-entries)


def _env_attempt(name):
    text = os.environ.get(name, "0") or "0"
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise ConfigError(f"{name}={text!r}: must be an integer >= 0")
    return value


def lease_stale_s():
    """The lease staleness bound in seconds: $RTXMPI_CKPT_LEASE_S or LEASE_STALE_S.
    Raises ConfigError for a value that is not a number > 0."""
    text = os.environ.get(LEASE_ENV)
    if text is None:
        return LEASE_STALE_S
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0 or value == float("inf"):
        raise ConfigError(f"{LEASE_ENV}={text!r}: must be a number of seconds > 0")
    return value


def lock_mode():
    """$RTXMPI_CKPT_LOCK: "auto" (default: flock, a lease where flock is not supported) or
    "lease". Raises ConfigError for anything else."""
    mode = os.environ.get(MODE_ENV, "auto") or "auto"
    if mode not in ("auto", "lease"):
        raise ConfigError(f"{MODE_ENV}={mode!r}: use auto (flock, else a lease file) or lease")
    return mode


def this_holder():
    """This process as a lock holder: {job_id, host, pid, start_unix, attempt}. Raises ConfigError
    for a bad $RTXMPI_RESTART / $SLURM_RESTART_COUNT."""
    return {"job_id": os.environ.get("RTXMPI_JOB_ID") or os.environ.get("SLURM_JOB_ID") or "",
            "host": socket.gethostname(), "pid": os.getpid(), "start_unix": round(time.time(), 3),
            "attempt": [_env_attempt("SLURM_RESTART_COUNT"), _env_attempt("RTXMPI_RESTART")]}


def describe(holder):
    """One phrase naming a holder read from a lock file (untrusted: every field may be off)."""
    if not isinstance(holder, dict):
        return "a job that left no readable record"
    text = lambda key: str(holder.get(key, "?"))[:80]  # noqa: E731
    job = f"job {text('job_id')} " if holder.get("job_id") else "a job "
    try:
        since = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(float(holder["start_unix"])))
    except (KeyError, TypeError, ValueError, OverflowError, OSError):
        since = "an unknown time"
    return f"{job}(host {text('host')}, pid {text('pid')}, since {since})"


def _read_text(path):
    with open(path, "rb") as f:
        return f.read(RECORD_BYTES).decode("utf-8", "replace")


def _parse(raw):
    try:
        holder = json.loads(raw)
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _until_readable(read, done):
    """read() again until done(its result) or RECORD_WAIT_S passed; the last result. A holder
    writes its record just after taking the lock: a job refused in between should name it."""
    deadline = time.monotonic() + RECORD_WAIT_S
    seen = read()
    while not done(seen) and time.monotonic() < deadline:
        time.sleep(0.02)
        seen = read()
    return seen


def _earlier_attempt(holder, me):
    """The holder is an earlier attempt of this very job (relaunch, requeue)."""
    try:
        return bool(me["job_id"]) and holder.get("job_id") == me["job_id"] and \
            [int(a) for a in holder["attempt"]] < me["attempt"]
    except (KeyError, TypeError, ValueError):
        return False


def _same_holder(holder, record):
    keys = ("job_id", "host", "pid", "start_unix")
    return record is not None and holder is not None and all(holder.get(k) == record.get(k) for k in keys)


def _pid_gone(holder):
    """The holder ran on this host and its process no longer exists."""
    if holder.get("host") != socket.gethostname():
        return False
    try:
        pid = int(holder["pid"])
    except (KeyError, TypeError, ValueError):
        return False
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:  # EPERM: it exists, under another user
        return False
    return False


def running_holder(job_dir):
    """The running job that holds `job_dir`'s checkpoint lock (flock or lease file), described in
    one phrase (`describe`), as `rtxmpi join` names the job it asks. Local. Raises ConfigError
    when there is none: no such directory, no lock file, a lock released (empty),
    or held by a process of this host that is gone."""
    if not os.path.isdir(job_dir):
        raise ConfigError(f"no job at {job_dir}: not a directory (give the job's --ckpt-dir)")
    for name in (LOCK_FILE, LEASE_FILE):
        try:
            raw = _read_text(os.path.join(job_dir, name)).strip()
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise ConfigError(f"{job_dir}/{name}: {exc.strerror}") from None
        if not raw:
            continue  # released by a job that ended
        holder = _parse(raw)
        if holder is None:
            raise ConfigError(f"no job at {job_dir}: its lock {name} is unreadable")
        if _pid_gone(holder):
            raise ConfigError(f"no job at {job_dir}: the last one, {describe(holder)}, is gone")
        return describe(holder)
    raise ConfigError(f"no job running at {job_dir}: its checkpoint lock is not held (is this the "
                      "job's --ckpt-dir, and is the job running?)")


class DirLock:
    """The lock of one checkpoint directory, held by rank 0 of the group that took it.

    Attributes (every rank): path (the lock or lease file), mode ("flock" or "lease"), holder
    (the agreed holder record), taken_over (a warning line, or None); rank 0, lease mode: lost
    (why the lease was lost, or None). release() is local and idempotent: rank 0 frees the lock,
    other ranks only forget it; it also runs at exit.
    """

    def __init__(self, ckpt_dir, path, mode, holder, taken_over=None):
        self.ckpt_dir, self.path, self.mode, self.holder = ckpt_dir, path, mode, holder
        self.taken_over = taken_over
        self.fd = None  # rank 0, flock mode: the open file holding the flock
        self.owner = False  # this process holds the lock
        self.lost = None
        self._stop = threading.Event()
        self._thread = None

    def _start_refresh(self, stale_s):
        def refresh():
            warned = False
            while not self._stop.wait(stale_s / 4):
                try:
                    found = _parse(_read_text(self.path))
                    if _same_holder(found, self.holder):
                        os.utime(self.path)
                        continue
                    self.lost = f"now held by {describe(found)}"
                except FileNotFoundError:
                    self.lost = "removed by someone else"
                except OSError as exc:  # e.g. a file server hiccup: try again next period
                    if not warned:
                        print(f"warning: cannot refresh checkpoint lease {self.path}: {exc}",
                              file=sys.stderr, flush=True)
                    warned = True
                    continue
                if not self._stop.is_set():
                    print(f"warning: checkpoint lease {self.path} lost ({self.lost}); this job no "
                          f"longer keeps others out of {self.ckpt_dir}", file=sys.stderr, flush=True)
                return

        self._thread = threading.Thread(target=refresh, name="rtxmpi-ckpt-lease", daemon=True)
        self._thread.start()

    def release(self):
        _held.pop(self.ckpt_dir, None)
        if not self.owner:
            return
        self.owner = False
        self._stop.set()
        try:
            if self.mode == "flock":
                os.ftruncate(self.fd, 0)  # a holder that ends cleanly leaves no record
                os.fsync(self.fd)
                os.close(self.fd)  # drops the flock
            elif _same_holder(_parse(_read_text(self.path)), self.holder):
                os.unlink(self.path)
        except OSError as exc:
            print(f"warning: releasing checkpoint lock {self.path}: {exc}", file=sys.stderr, flush=True)
        self.fd = None


def _flock(path, me, previous_record):
    """Rank 0, flock mode. Returns (fd, None, warning) when taken, (None, holder, None) when
    another job holds it; raises OSError with errno in NO_FLOCK when flock is unsupported."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = None
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                holder = _until_readable(
                    lambda: _parse(os.pread(fd, RECORD_BYTES, 0).decode("utf-8", "replace")),
                    lambda holder: holder is not None)
                ours = holder is not None and (_earlier_attempt(holder, me)
                                               or _same_holder(holder, previous_record))
                deadline = deadline or time.monotonic() + RELAUNCH_WAIT_S
                if not ours or time.monotonic() >= deadline:
                    os.close(fd)
                    return None, holder, None
                time.sleep(0.1)  # an earlier attempt of this job: its processes are exiting
        left = os.pread(fd, RECORD_BYTES, 0).decode("utf-8", "replace").strip()
        warning = None
        if left:
            holder = _parse(left)
            if not (_earlier_attempt(holder or {}, me) or _same_holder(holder, previous_record)):
                warning = (f"took over checkpoint lock {path} left by {describe(holder)}, which ended "
                           f"without releasing it")
        data = json.dumps(me).encode()
        os.ftruncate(fd, 0)
        os.pwrite(fd, data, 0)
        os.fsync(fd)
        return fd, None, warning
    except BaseException:
        try:
            os.close(fd)
        except OSError:
            pass
        raise


def _read_lease(path):
    """(raw text, parsed holder or None, age in seconds, inode), or None when it is gone."""
    try:
        with open(path, "rb") as f:
            st = os.fstat(f.fileno())
            raw = f.read(RECORD_BYTES).decode("utf-8", "replace")
    except FileNotFoundError:
        return None
    return raw, _parse(raw), time.time() - st.st_mtime, st.st_ino


def _stale(holder, age, me, previous_record, stale_s):
    """Why the lease may be taken over (a phrase), or None while its holder may be alive."""
    if holder is not None and _earlier_attempt(holder, me):
        return "an earlier attempt of this job"
    if holder is not None and _same_holder(holder, previous_record):
        return "this job's previous rank 0"
    if holder is not None and _pid_gone(holder):
        return "its process is gone"
    if age > stale_s:
        return f"not refreshed for {age:.0f} s > {stale_s:g} s"
    return None


def _break_lease(path, seen):
    """Remove the lease `seen` (raw, holder, age, inode) under the takeover file. True when it
    was removed (or is already gone), False when another job is taking it over right now."""
    takeover = path + TAKEOVER_SUFFIX
    try:
        fd = os.open(takeover, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        try:
            if time.time() - os.stat(takeover).st_mtime > TAKEOVER_STALE_S:
                os.unlink(takeover)  # its taker died mid-way; the next try may go ahead
        except FileNotFoundError:
            pass
        return False
    try:
        now = _read_lease(path)
        if now is not None and (now[0], now[3]) == (seen[0], seen[3]):
            os.unlink(path)
        return True
    finally:
        os.close(fd)
        os.unlink(takeover)


def _lease(path, me, previous_record, stale_s):
    """Rank 0, lease mode. Returns (True, None, warning) when taken, (False, holder, None) when
    another job holds it."""
    warning = None
    for _ in range(5):
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            seen = _until_readable(lambda: _read_lease(path),
                                   lambda seen: seen is None or seen[1] is not None)
            if seen is None:
                continue
            why = _stale(seen[1], seen[2], me, previous_record, stale_s)
            if why is None or not _break_lease(path, seen):
                return False, seen[1], None
            if "this job" not in why:
                warning = f"took over stale checkpoint lease {path} of {describe(seen[1])}: {why}"
            continue
        try:
            os.write(fd, json.dumps(me).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        return True, None, warning
    return False, None, None


def _acquire(ckpt_dir, me, previous_record):
    """Rank 0: take the lock. Returns an outcome dict (JSON) for the other ranks."""
    os.makedirs(ckpt_dir, exist_ok=True)
    stale_s = lease_stale_s()
    mode, fd, note = lock_mode(), None, None
    if mode == "auto":
        path = os.path.join(ckpt_dir, LOCK_FILE)
        try:
            fd, holder, warning = _flock(path, me, previous_record)
            if fd is None:
                return {"ok": False, "path": path, "mode": "flock", "holder": holder}, None
            return {"ok": True, "path": path, "mode": "flock", "holder": me, "warning": warning}, fd
        except OSError as exc:
            if exc.errno not in NO_FLOCK:
                raise
            note = f"flock not supported on {ckpt_dir} ({exc.strerror}); using a lease file"
    path = os.path.join(ckpt_dir, LEASE_FILE)
    ok, holder, warning = _lease(path, me, previous_record, stale_s)
    warning = "; ".join(w for w in (note, warning) if w) or None
    return {"ok": ok, "path": path, "mode": "lease", "holder": me if ok else holder,
            "warning": warning, "stale_s": stale_s}, None


def _share(group, outcome):
    """Broadcast rank 0's outcome (JSON) to every rank of `group`."""
    if group is None or group.world_size == 1:
        return outcome
    buf = np.zeros(RECORD_BYTES, np.uint8)
    if group.rank == 0:
        raw = json.dumps(outcome).encode()
        if len(raw) > RECORD_BYTES:  # an oversized record read from a file: keep the verdict
            raw = json.dumps({k: outcome.get(k) for k in ("ok", "path", "mode", "error")}).encode()
        buf[:len(raw)] = np.frombuffer(raw, np.uint8)
    group.broadcast(buf, src=0)
    return json.loads(bytes(buf).rstrip(b"\0").decode())


def lock_dir(group, ckpt_dir):
    """Take the lock of checkpoint directory `ckpt_dir` (created if missing) for this job.

    group: the ProcessGroup of the job (None: one process). Rank 0 takes the lock and holds it
    until release() or exit; the outcome is broadcast, so every rank returns or raises alike.
    Collective: every rank of `group` must call. Calling it again for the same directory in the
    same process returns the lock held (after an elastic shrink: the new rank 0 takes it over).
    Returns a DirLock. Raises DirectoryLocked (a ConfigError; attribute holder: the record read,
    or None) on every rank when another job holds the lock, ConfigError for a bad
    $RTXMPI_CKPT_LOCK / $RTXMPI_CKPT_LEASE_S / attempt variable or a directory that cannot be
    made or locked.
    """
    rank = 0 if group is None else group.rank
    ckpt_dir = os.path.abspath(ckpt_dir)
    previous = _held.get(ckpt_dir)
    if previous is not None and previous.owner and rank == 0:
        outcome, fd = {"ok": True, "path": previous.path, "mode": previous.mode, "kept": True,
                       "holder": previous.holder}, None
    else:
        outcome, fd = {}, None
        if rank == 0:
            try:
                outcome, fd = _acquire(ckpt_dir, this_holder(), previous and previous.holder)
            except (ConfigError, OSError, ValueError) as exc:
                outcome = {"ok": False, "error": f"{type(exc).__name__}: {exc}"}
    outcome = _share(group, outcome)
    if outcome.get("kept") and previous is not None:
        return previous  # (a rank new to the job, spawned after a shrink, has none: made below)
    if not outcome["ok"]:
        if "error" in outcome:
            raise ConfigError(f"cannot lock checkpoint directory {ckpt_dir}: {outcome['error']}")
        holder = outcome.get("holder")
        raise DirectoryLocked(f"checkpoint directory {ckpt_dir} is in use by {describe(holder)}, "
                              f"lock file {outcome['path']}: wait for that job to end or use "
                              f"another directory", holder=holder)
    lock = DirLock(ckpt_dir, outcome["path"], outcome["mode"], outcome["holder"], outcome.get("warning"))
    if rank == 0:
        lock.owner, lock.fd = True, fd
        if lock.mode == "lease":
            lock._start_refresh(outcome["stale_s"])
        if lock.taken_over:
            print(f"warning: {lock.taken_over}", file=sys.stderr, flush=True)
    if previous is not None and previous is not lock:
        previous.owner = False  # the old rank 0's lock is gone; nothing of it to release here
    _held[ckpt_dir] = lock
    return lock


@atexit.register
def release_all():
    """Release every checkpoint lock this process holds (local; also runs at interpreter exit)."""
    for lock in list(_held.values()):
        lock.release()
