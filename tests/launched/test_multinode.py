"""Two network-namespace "nodes" (tests/launched/test_observe_run.py's `two_nodes`: a veth pair,
named hosts, an ssh-free launch agent; /work/shared/ops/README.md): examples/train.py with one
rank on each node, the second node's rank SIGKILLed in backward, and the job recovers.

ULFM works across the nodes (the TCP BTL over the veth): the rank on the first node sees the
failure, shrinks the world 2 -> 1 in the same process and trains on; every step is logged once
and the last checkpoint is saved by the 1-rank world. Without ULFM the kill ends the job and
`rtxmpi run --hostfile` relaunches it on both nodes from the last committed checkpoint. The veth
byte counters show that rank 1's traffic really crossed between the namespaces.
"""
import json
import subprocess
import sys

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
    shell = f"hostname {nodes[0]}; exec " + " ".join(str(a) for a in command)
    before = veth_bytes(nodes[1])
    proc = run_command(["ip", "netns", "exec", nodes[0], "unshare", "--uts", "sh", "-c", shell],
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
    launcher = " ".join(str(a) for a in mpiexec(nodes, agent, hostfile, "-x", "RTXMPI_FAULT")
                        if str(a) not in ("-n", "2"))
    launcher = launcher.replace(f" --hostfile {hostfile}", "")  # rtxmpi run adds it
    command = [sys.executable, "-m", "rtxmpi.cli", "run", "-n", 2, "--min-ranks", 2,
               "--max-restarts", 2, "--hostfile", hostfile, "--mpiexec", f"'{launcher}'", "--",
               sys.executable, TRAIN, *ARGS, "--steps", STEPS, "--ckpt-dir", ckpt,
               "--ckpt-every", 4, "--metrics-jsonl", metrics, "--elastic", "restart",
               "--timeout-s", "30"]
    shell = f"hostname {nodes[0]}; exec " + " ".join(str(a) for a in command)
    before = veth_bytes(nodes[1])
    proc = run_command(["ip", "netns", "exec", nodes[0], "unshare", "--uts", "sh", "-c", shell],
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
