"""A real single-node Slurm cluster for tests: munged, slurmctld and slurmd under a temp dir.

    python tests/launched/slurm_cluster.py install     # apt-get the Debian packages (root, once)
    python tests/launched/slurm_cluster.py check        # start a cluster, run one job, tear down

Packages (Debian 12): slurmctld slurmd slurm-client munge libpmix2 (Slurm 22.05). Everything the
cluster writes (slurm.conf, cgroup.conf, munge key and socket, state, spool, logs) lives in one
temp dir; the daemons run in the foreground as children of this process and are ended by pid in
`Cluster.stop()` (and by `start()` itself when the cluster does not come up). Clients find the
cluster through SLURM_CONF (see `Cluster.env`). Several clusters can run at once on one machine
(two checkouts' test runs): each picks free TCP ports for slurmctld and slurmd (and picks again
when another process takes one between the pick and the bind), has its own munge socket and key,
state and spool dirs, and its own range of job ids (so that proctrack/cgroup's per-job cgroups
never collide). Facts used here were measured on this kind of machine:
docs/operations.md (Slurm section).
"""
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

PACKAGES = ["slurmctld", "slurmd", "slurm-client", "munge", "libpmix2"]
PMIX_LIB = Path("/usr/lib/x86_64-linux-gnu/pmix2/lib")
PORT_TRIES = 4  # start attempts, each on freshly picked ports, when a port was taken meanwhile
PORT_TAKEN = "Address already in use"


def missing():
    """Why a cluster cannot start here (a one-line reason), or None when it can."""
    if os.geteuid() != 0:
        return "Slurm test cluster needs root (munged runs as user munge, slurmd as root)"
    for tool in ("munged", "slurmctld", "slurmd", "sbatch", "scontrol"):
        if shutil.which(tool) is None and not Path("/usr/sbin", tool).exists():
            return (f"{tool} not installed: run `python tests/launched/slurm_cluster.py install` "
                    f"(apt-get install {' '.join(PACKAGES)})")
    return None


def install(timeout_s=300):
    """apt-get install the packages (after apt-get update) and link libpmix.so for slurm's
    mpi_pmix plugin. Returns (ok, message); never raises."""
    if missing() is None and (PMIX_LIB / "libpmix.so").exists():
        return True, "slurm packages already installed"
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        return False, "cannot install Slurm: needs root and apt-get"
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    for argv in (["apt-get", "update", "-q"],
                 ["apt-get", "install", "-y", "-q", "--no-install-recommends", *PACKAGES]):
        try:
            done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s)
        except (OSError, subprocess.TimeoutExpired) as exc:
            return False, f"{' '.join(argv[:2])} failed: {exc}"
        if done.returncode:
            return False, f"{' '.join(argv[:3])} failed: {done.stderr.strip()[-500:]}"
    link = PMIX_LIB / "libpmix.so"
    if PMIX_LIB.is_dir() and not link.exists():
        link.symlink_to("libpmix.so.2")
    why = missing()
    return why is None, why or "slurm packages installed"


def _sbin(tool):
    return shutil.which(tool) or str(Path("/usr/sbin", tool))


def free_ports(n):
    """`n` distinct TCP ports free right now (the kernel's picks for port 0). Another process may
    still take one before the daemon binds it: `Cluster.start()` then picks again."""
    socks = []
    try:
        for _ in range(n):
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("", 0))
            socks.append(sock)
        return [sock.getsockname()[1] for sock in socks]
    finally:
        for sock in socks:
            sock.close()


class PortTaken(RuntimeError):
    """slurmctld or slurmd could not bind its port (taken after free_ports() picked it)."""


def _node_line():
    """This machine's node line from `slurmd -C` (CPUs, sockets, cores, memory)."""
    out = subprocess.run([_sbin("slurmd"), "-C"], capture_output=True, text=True,
                         timeout=30).stdout
    return out.splitlines()[0].strip()


class Cluster:
    """munged + slurmctld + slurmd with a `debug` partition of this one node.

    kill_wait_s: seconds between the TERM and the SIGKILL of a job at its end (time limit,
    scancel). Use as a context manager, or start() / stop().
    """

    def __init__(self, root=None, kill_wait_s=20):
        self.root = Path(root or tempfile.mkdtemp(prefix="rtxmpi-slurm-"))
        self.kill_wait_s = kill_wait_s
        self.procs = []
        self.conf = self.root / "slurm.conf"
        self.node = None
        self.ports = None  # (slurmctld, slurmd), picked by start()

    @property
    def env(self):
        """Variables a client (sbatch, squeue, scontrol, the job itself) needs."""
        return {"SLURM_CONF": str(self.conf)}

    def _write_config(self):
        r = self.root
        for d in ("state", "spool", "log", "munge"):
            (r / d).mkdir(parents=True, exist_ok=True)
        node_line = _node_line()
        self.node = node_line.split()[0].split("=", 1)[1]
        (r / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\nConstrainCores=no\n"
                                       "ConstrainRAMSpace=no\n")
        self.conf.write_text("\n".join([
            "ClusterName=rtxmpitest",
            f"SlurmctldHost={self.node}(127.0.0.1)",
            "SlurmUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={r / 'munge' / 'munge.socket'}",
            f"SlurmctldPort={self.ports[0]}",
            f"SlurmdPort={self.ports[1]}",
            # job ids disjoint from any other cluster's (ports differ): cgroup paths use the id
            f"FirstJobId={self.ports[0] * 1000}",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "ProctrackType=proctrack/cgroup",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "MpiDefault=none",
            "ReturnToService=2",
            f"KillWait={self.kill_wait_s}",
            "JobRequeue=1",
            "SchedulerType=sched/builtin",
            "SlurmctldTimeout=30",
            "SlurmdTimeout=30",
            "InactiveLimit=0",
            "MinJobAge=600",
            f"{node_line} NodeAddr=127.0.0.1 State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP "
            "OverSubscribe=FORCE:4",
            ""]))

    def _spawn(self, argv, log, **kw):
        out = open(self.root / "log" / log, "w")
        proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True, **kw)
        self.procs.append(proc)
        return proc

    def start(self, timeout_s=30):
        """Start munged, slurmctld and slurmd and wait until the node is idle. Returns self.
        Raises RuntimeError (with the daemons' logs) when the cluster does not come up; whatever
        it had spawned is stopped and its temp dir removed first."""
        why = missing()
        if why:
            raise RuntimeError(why)
        try:
            for attempt in range(1, PORT_TRIES + 1):
                try:
                    return self._start_once(timeout_s)
                except PortTaken:
                    self._end_procs()
                    if attempt == PORT_TRIES:
                        raise
        except BaseException:
            self.stop()
            raise

    def _start_once(self, timeout_s):
        self.ports = tuple(free_ports(2))
        for d in ("state", "spool", "log"):  # a fresh start after a port race
            shutil.rmtree(self.root / d, ignore_errors=True)
        self._write_config()
        munge = self.root / "munge"
        key = munge / "munge.key"
        key.unlink(missing_ok=True)
        key.write_bytes(os.urandom(1024))
        shutil.chown(munge, "munge", "munge")
        shutil.chown(key, "munge", "munge")
        os.chmod(munge, 0o700)
        os.chmod(key, 0o400)
        os.chmod(self.root, 0o755)
        (munge / "munge.socket").unlink(missing_ok=True)
        self._spawn([_sbin("munged"), "--foreground", "--force", f"--socket={munge / 'munge.socket'}",
                     f"--key-file={key}", f"--pid-file={munge / 'munged.pid'}",
                     f"--log-file={munge / 'munged.log'}", f"--seed-file={munge / 'munged.seed'}"],
                    "munged.out", user="munge", group="munge")
        self._wait(lambda: (munge / "munge.socket").exists(), timeout_s, "munged socket")
        env = dict(os.environ, **self.env)
        self._spawn([_sbin("slurmctld"), "-D", "-i", "-f", str(self.conf)], "slurmctld.out", env=env)
        self._spawn([_sbin("slurmd"), "-D", "-f", str(self.conf)], "slurmd.out", env=env)
        self._wait(self._idle, timeout_s, f"node {self.node} idle")
        return self

    def _idle(self):
        for proc in self.procs:
            if proc.poll() is not None:
                logs = self.logs()
                error = PortTaken if PORT_TAKEN in logs else RuntimeError
                raise error(f"{proc.args[0]} exited {proc.returncode} (ports {self.ports}):\n"
                            f"{logs}")
        out = self.run(["sinfo", "-h", "-t", "idle", "-o", "%D"], check=False).stdout.strip()
        return out == "1"

    def _wait(self, ready, timeout_s, what):
        deadline = time.monotonic() + timeout_s
        while not ready():
            if time.monotonic() > deadline:
                logs = self.logs()
                error = PortTaken if PORT_TAKEN in logs else RuntimeError
                raise error(f"Slurm test cluster: {what} not reached in {timeout_s} s "
                            f"(ports {self.ports})\n{logs}")
            time.sleep(0.2)

    def run(self, argv, check=True, timeout_s=30, env=None):
        """A client command against this cluster (sinfo, sbatch, scancel, scontrol, sacct...)."""
        full = dict(os.environ if env is None else env, **self.env)
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout_s, env=full)
        if check and done.returncode:
            raise RuntimeError(f"{' '.join(map(str, argv))}: exit {done.returncode}: "
                               f"{done.stderr.strip()}")
        return done

    def job(self, job_id):
        """`scontrol show job` as a dict (JobState, Restarts, ExitCode, RunTime, ...)."""
        out = self.run(["scontrol", "-o", "show", "job", str(job_id)]).stdout
        fields = {}
        for item in out.split():
            key, _, value = item.partition("=")
            fields.setdefault(key, value)
        return fields

    def wait_job(self, job_id, states, timeout_s, poll_s=0.5):
        """Poll until the job's JobState is one of `states`; returns the job dict."""
        deadline = time.monotonic() + timeout_s
        while True:
            info = self.job(job_id)
            if info.get("JobState") in states:
                return info
            if time.monotonic() > deadline:
                raise TimeoutError(f"job {job_id} still {info.get('JobState')} after {timeout_s} s "
                                   f"(wanted {states})")
            time.sleep(poll_s)

    def logs(self, tail=3000):
        text = []
        for path in sorted((self.root / "log").glob("*")) + [self.root / "munge" / "munged.log"]:
            if path.exists():
                text.append(f"--- {path.name}\n{path.read_text(errors='replace')[-tail:]}")
        return "\n".join(text)

    def stop(self):
        """End the daemons (TERM, then KILL by pid) and remove the temp dir."""
        self._end_procs()
        shutil.rmtree(self.root, ignore_errors=True)

    def _end_procs(self):
        for proc in reversed(self.procs):
            if proc.poll() is None:
                proc.terminate()
        deadline = time.monotonic() + 10
        for proc in reversed(self.procs):
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self.procs = []

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


def main(argv):
    what = argv[1] if len(argv) > 1 else "check"
    if what == "install":
        ok, message = install()
        print(message)
        return 0 if ok else 1
    if what == "check":
        with Cluster() as cluster:
            print(cluster.run(["sinfo"]).stdout)
            job = cluster.run(["sbatch", "--parsable", "-o", str(cluster.root / "j.out"),
                               "--wrap", "echo hello from $SLURM_JOB_ID"]).stdout.strip()
            print(cluster.wait_job(job, {"COMPLETED", "FAILED"}, 30)["JobState"],
                  (cluster.root / "j.out").read_text().strip())
        return 0
    print(__doc__)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv))
