"""Two network-namespace "nodes" (tests/launched/test_observe_run.py's `two_nodes`: a veth pair,
named hosts, an ssh-free launch agent; docs/operations.md): examples/train.py with one
rank on each node, the second node's rank SIGKILLed in backward, and the job recovers.

ULFM works across the nodes (the TCP BTL over the veth): the rank on the first node sees the
failure, shrinks the world 2 -> 1 in the same process and trains on; every step is logged once
and the last checkpoint is saved by the 1-rank world. Without ULFM the kill ends the job and
`rtxmpi run --hostfile` relaunches it on both nodes from the last committed checkpoint. The veth
byte counters show that rank 1's traffic really crossed between the namespaces.
"""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import test_observe_run
from conftest import MPIEXEC, REPO, launch_env, run_command

from rtxmpi.checkpoint import latest_step, load_checkpoint

TRAIN = REPO / "examples" / "train.py"
ARGS = ["--model", "tiny", "--global-batch", "12", "--seq-len", "32", "--eval-every", "0",
        "--sample-tokens", "0", "--no-progress"]
STEPS = 12
two_nodes = test_observe_run.two_nodes  # the fixture (namespaces, veth, agent, hostfile)


def veth_bytes(ns):
    """Bytes received + sent by the namespace's veth (every interface but lo)."""
    lines = subprocess.run(["ip", "netns", "exec", ns, "cat", "/proc/net/dev"], check=True,
                           capture_output=True, text=True, timeout=30).stdout.splitlines()[2:]
    total = 0
    for line in lines:
        name, data = line.split(":", 1)
        if name.strip() != "lo":
            fields = data.split()
            total += int(fields[0]) + int(fields[8])
    return total


def mpiexec(nodes, agent, hostfile, *extra):
    return [MPIEXEC, "--prtemca", "plm_ssh_agent", agent, "--hostfile", hostfile,
            "--map-by", "ppr:1:node:OVERSUBSCRIBE", "--bind-to", "none",
            "--mca", "btl", "tcp,self", "--mca", "btl_tcp_if_include", "10.77.0.0/24",
            "--prtemca", "oob_tcp_if_include", "10.77.0.0/24", *extra, "-n", "2"]


def supervisor_launcher(nodes, agent, hostfile, *extra):
    """mpiexec() as one string for `rtxmpi run --mpiexec`, less -n and --hostfile (it adds both)."""
    launcher = " ".join(str(a) for a in mpiexec(nodes, agent, hostfile, *extra)
                        if str(a) not in ("-n", "2"))
    return launcher.replace(f" --hostfile {hostfile}", "")


def on_first_node(nodes, command):
    """argv running `command` in the first node's namespace, under that node's hostname."""
    shell = f"hostname {nodes[0]}; exec " + " ".join(str(a) for a in command)
    return ["ip", "netns", "exec", nodes[0], "unshare", "--uts", "sh", "-c", shell]


@pytest.mark.netns
def test_kill_the_second_nodes_rank_and_shrink_across_nodes(tmp_path, two_nodes):
    nodes, agent, hostfile = two_nodes
    ulfm = ["--with-ft", "ulfm", "--mca", "mpi_ft_detector", "true",
            "--mca", "mpi_ft_detector_period", "1", "--mca", "mpi_ft_detector_timeout", "10",
            "-x", "RTXMPI_FAULT"]
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    command = [*mpiexec(nodes, agent, hostfile, *ulfm), sys.executable, TRAIN, *ARGS,
               "--steps", STEPS, "--ckpt-dir", ckpt, "--ckpt-every", 4, "--metrics-jsonl",
               metrics, "--elastic", "shrink", "--min-ranks", "1", "--timeout-s", "30"]
    before = veth_bytes(nodes[1])
    proc = run_command(on_first_node(nodes, command),
                       outer_timeout_s=120,
                       env=launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache", RTXMPI_TIMEOUT_S=30,
                                      RTXMPI_FAULT="kill:1:5:backward:0.002"))
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    assert "shrank the world 2 -> 1 ranks" in proc.stderr, str(proc)
    assert "kill launch rank 1 step 5" in proc.stderr
    # rank 1 really ran on the second node: its gradients (0.5 MB a step) crossed the veth
    assert veth_bytes(nodes[1]) - before > 1_000_000
    got = [json.loads(line) for line in metrics.read_text().splitlines()]
    assert [r["step"] for r in got] == list(range(1, STEPS + 1)), str(proc)
    assert got[0]["world_size"] == 2 and got[-1]["world_size"] == 1
    assert latest_step(ckpt) == STEPS and load_checkpoint(None, ckpt, STEPS).world_size_saved == 1


@pytest.mark.netns
def test_kill_the_second_nodes_rank_without_ulfm_and_rtxmpi_run_restarts_on_both(tmp_path,
                                                                                   two_nodes):
    """The other recovery: no ULFM, so the kill ends the mpiexec job; `rtxmpi run` relaunches it
    across both nodes (the hostfile) with --resume from the last committed checkpoint."""
    nodes, agent, hostfile = two_nodes
    metrics, ckpt = tmp_path / "m.jsonl", tmp_path / "ckpt"
    launcher = supervisor_launcher(nodes, agent, hostfile, "-x", "RTXMPI_FAULT")
    command = [sys.executable, "-m", "rtxmpi.cli", "run", "-n", 2, "--min-ranks", 2,
               "--max-restarts", 2, "--hostfile", hostfile, "--mpiexec", f"'{launcher}'", "--",
               sys.executable, TRAIN, *ARGS, "--steps", STEPS, "--ckpt-dir", ckpt,
               "--ckpt-every", 4, "--metrics-jsonl", metrics, "--elastic", "restart",
               "--timeout-s", "30"]
    before = veth_bytes(nodes[1])
    proc = run_command(on_first_node(nodes, command),
                       outer_timeout_s=150,
                       env=launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache", RTXMPI_TIMEOUT_S=30,
                                      RTXMPI_FAULT="kill:1:6:backward:0.002"))
    assert not proc.outer_timeout and proc.returncode == 0, str(proc)
    assert "kill launch rank 1 step 6" in proc.stderr, str(proc)
    assert "relaunching from the latest committed checkpoint" in proc.stderr + proc.stdout
    assert "continuing at step 5" in proc.stdout, str(proc)
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    # the killed attempt may have logged steps after its last checkpoint (4); the relaunch
    # re-runs them from that checkpoint: every step present, the relaunch from 5 to the end
    assert sorted(set(steps)) == list(range(1, STEPS + 1)), steps
    assert steps[-(STEPS - 4):] == list(range(5, STEPS + 1)), steps
    assert load_checkpoint(None, ckpt, STEPS).world_size_saved == 2
    assert veth_bytes(nodes[1]) - before > 1_000_000


def _descendants(root):
    """pids of every process below `root` (walks /proc parent links)."""
    parent = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    parent[int(entry)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
    found, frontier = set(), {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier} - found
        found |= frontier
    return found


def _in_netns(pid, ns):
    try:
        return os.stat(f"/proc/{pid}/ns/net").st_ino == os.stat(f"/run/netns/{ns}").st_ino
    except OSError:
        return False


@pytest.mark.netns
def test_losing_the_whole_second_node_rtxmpi_run_restarts_on_the_first(tmp_path, two_nodes):
    """Node loss: the second node's Open MPI daemon (prted) and its rank are SIGKILLed together
    while the job trains, and the node is taken out of the hostfile (as a scheduler would).
    prterun cannot survive a lost daemon, even under ULFM (measured here: the job ends), so the
    recovery is a restart: `rtxmpi run` re-reads the hostfile and relaunches 1 rank on the first
    node from the last committed checkpoint (resharded from 2 ranks)."""
    nodes, agent, hostfile = two_nodes
    metrics, ckpt, steps = tmp_path / "m.jsonl", tmp_path / "ckpt", 100  # 2-node steps: >= 0.1 s (40 Mbit/s)
    launcher = supervisor_launcher(nodes, agent, hostfile)
    command = [sys.executable, "-m", "rtxmpi.cli", "run", "-n", 2, "--min-ranks", 1,
               "--max-restarts", 2, "--hostfile", hostfile, "--mpiexec", f"'{launcher}'", "--",
               sys.executable, TRAIN, *ARGS, "--steps", steps, "--ckpt-dir", ckpt,
               "--ckpt-every", 10, "--metrics-jsonl", metrics, "--elastic", "restart",
               "--timeout-s", "30"]
    out = open(tmp_path / "out", "w+")
    proc = subprocess.Popen(["timeout", "--kill-after=5", "150", *on_first_node(nodes, command)],
                            stdout=out, stderr=out,
                            env=launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache",
                                           RTXMPI_TIMEOUT_S=30), start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 15):
            assert proc.poll() is None and time.monotonic() < deadline, out.seek(0) or out.read()
            time.sleep(0.1)
        victims = [pid for pid in _descendants(proc.pid) if _in_netns(pid, nodes[1])]
        assert victims, "no process of the job in the second node"
        hostfile.write_text(f"{nodes[0]} slots=1\n")  # the node is gone for the next launch
        for pid in victims:  # the daemon and the rank
            os.kill(pid, signal.SIGKILL)
        rc = proc.wait(timeout=150)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    out.seek(0)
    text = out.read()
    assert rc == 0, text[-4000:]
    assert "attempt 2: 1 ranks" in text or "attempt 2: 1 rank" in text, text[-4000:]
    logged = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert sorted(set(logged)) == list(range(1, steps + 1)), text[-3000:]
    assert load_checkpoint(None, ckpt, steps).world_size_saved == 1
