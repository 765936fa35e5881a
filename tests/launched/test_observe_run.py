"""Observability end to end: examples/train.py with --run-dir, --timeline and the metrics flags,
`rtxmpi report`, and the bottleneck classifier on injected causes (a slow loader, one slow rank,
a checkpoint every step, a plain run, and a throttled link between two network-namespace "nodes")."""
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
import uuid

import numpy as np
import pytest
from conftest import BIN, MPIEXEC, REPO, launch_env, mpiexec_argv, run_command

TRAIN = REPO / "examples" / "train.py"
QUIET = ["--no-progress", "--sample-tokens", "0", "--eval-every", "0"]
PROM_NAMES = ("step_time_ms", "tokens_per_s", "allreduce_pct", "overlap_pct", "net_bw_gbps",
              "alloc_frag_pct", "oom_count")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def free_port_pair():
    """A port P with P and P + 1 free on 127.0.0.1 (ranks serve P + local rank)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port < 65535:
            with socket.socket() as s2:
                try:
                    s2.bind(("127.0.0.1", port + 1))
                    return port
                except OSError:
                    continue
    pytest.skip("no two adjacent free ports")


def scrape(port):
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=1).read().decode()
    except OSError:
        return None


def test_run_dir_timeline_metrics_and_report(tmp_path):
    run_dir, port = tmp_path / "run", free_port_pair()
    argv = mpiexec_argv(2) + [sys.executable, TRAIN, "--model", "tiny", "--steps", "25",
                              "--global-batch", "8", "--seq-len", "32", *QUIET,
                              "--bucket-mb", "0.05",  # ~10 buckets: async all_reduces in backward
                              "--run-dir", run_dir, "--timeline", tmp_path / "t.json",
                              "--metrics-port", port, "--metrics-textfile", tmp_path / "m.prom"]
    process = subprocess.Popen(["timeout", "-k", "5", "120"] + [str(a) for a in argv],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache"))
    seen = {}
    while process.poll() is None:  # scrape both ranks' servers while the job runs
        for p in (port, port + 1):
            body = scrape(p)
            if body and "step_time_ms{" in body:
                seen[p] = body
        time.sleep(0.05)
    out = process.communicate()[0]
    assert process.returncode == 0, out[-3000:]
    assert sorted(seen) == [port, port + 1], out[-2000:]
    assert 'rank="1"' in seen[port + 1] and 'step_time_ms_cross{job="train-tiny",stat="max"}' in seen[port]
    assert "bottleneck: compute-bound" in out or "bottleneck: " in out

    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, 26))
    for r in records:
        assert set(PROM_NAMES) <= set(r) and 0 <= r["overlap_pct"] <= 100
        assert 0 < r["allreduce_pct"] < 100 and r["net_bw_gbps"] > 0 and r["oom_count"] == 0
    # the live overlap_pct is the post-run breakdown's (the observer's own cross-rank all_gather
    # must count as hidden communication in neither);
    # the last step differs legitimately: its evaluation runs after end_step, inside the step span
    rank0 = {b["step"]: b for b in json.loads((run_dir / "breakdown.json").read_text()) if b["rank"] == 0}
    for r in records[:-1]:
        assert r["overlap_pct"] == pytest.approx(rank0[r["step"]]["overlap_pct"], abs=1e-6), r["step"]
        assert r["comm_ms"] == pytest.approx(rank0[r["step"]]["comm_ms"], abs=1e-6), r["step"]
    assert sum(r["overlap_pct"] > 0 for r in records) > len(records) // 2, records
    # activations are measured, not 0.0: one forward's cache, 4 x 32 tokens per rank
    from rtxmpi.nn import GPT, GPTConfig
    from rtxmpi.observe.memory import cache_bytes

    model = GPT(GPTConfig.named("tiny", seq_len=32))
    x, y = np.zeros((4, 32), np.int64), np.ones((4, 32), np.int64)  # inputs and targets
    expected = cache_bytes(model.forward(x, y)[1], exclude=[model.flat_data, model.flat_grad])
    memory = json.loads((run_dir / "memory.json").read_text())
    assert [m["activations_bytes"] for m in memory] == [expected, expected] and expected > 0
    for rank in (0, 1):
        text = (tmp_path / f"m.rank{rank}.prom").read_text()
        assert all(f'{name}{{job="train-tiny",rank="{rank}"}}' in text for name in PROM_NAMES)

    doc = json.loads((tmp_path / "t.json").read_text())
    processes = {e["pid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "process_name"}
    assert sorted(processes) == [0, 1] and processes[1].startswith("rank 1 (")
    spans = [e for e in doc["traceEvents"] if e["ph"] == "X"]
    roles = {"step", "data", "forward", "backward", "optimizer", "comm", "compute"}
    assert roles <= {e["cat"] for e in spans}
    steps = [e for e in spans if e["cat"] == "step" and e["pid"] == 1]
    assert [e["args"]["step"] for e in steps] == list(range(1, 26))
    comm = [e for e in spans if e["cat"] == "comm" and e["name"] == "all_reduce"]
    assert all(e["args"]["group"] == "world" and e["args"]["bytes"] > 0 for e in comm)
    assert abs(doc["otherData"]["rtxmpi_ranks"][1]["offset_us"]) < 5e4  # one host: one clock

    report = run_command([BIN / "rtxmpi", "report", run_dir, "--out", tmp_path / "png", "--last", "10"],
                         outer_timeout_s=60, env=launch_env())
    assert report.returncode == 0, str(report)
    for line in (", the median of the last 10 steps, mean over 2 ranks)", "per rank (ms, the median step)",
                 "memory per rank (MiB)", "bottleneck: "):
        assert line in report.stdout, report.stdout
    import matplotlib.image

    for name in ("loss.png", "step_breakdown.png", "bandwidth.png"):
        path = tmp_path / "png" / name
        assert path.read_bytes()[:8] == PNG_MAGIC
        assert matplotlib.image.imread(path).ndim == 3


def test_report_of_a_missing_run_dir_exits_2(tmp_path):
    proc = run_command([BIN / "rtxmpi", "report", tmp_path / "nope"], outer_timeout_s=30, env=launch_env())
    assert proc.returncode == 2 and "not a directory" in proc.stderr


def test_bad_metrics_flags_fail_on_every_rank(tmp_path):
    proc = run_command(mpiexec_argv(2) + [sys.executable, TRAIN, "--steps", "2", *QUIET,
                                          "--metrics-textfile", "/nonexistent/x.prom"],
                       outer_timeout_s=60, env=launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache"))
    assert proc.returncode == 2 and not proc.outer_timeout, str(proc)
    assert proc.stderr.count("not a writable file path") == 1


CAUSES = {
    "input-bound": (["--model", "tiny", "--global-batch", "8", "--seq-len", "32"],
                    {"RTXMPI_INJECT": "loader_sleep_ms=100"}),
    "straggler-bound": (["--model", "tiny", "--global-batch", "8", "--seq-len", "32"],
                        {"RTXMPI_INJECT": "slow_rank=1,slow_ms=100"}),
    "checkpoint-bound": (["--model", "tiny", "--global-batch", "2", "--seq-len", "16",
                          "--ckpt-every", "1"], {}),
    "compute-bound": (["--model", "tiny", "--global-batch", "32", "--seq-len", "64"], {}),
}


@pytest.mark.parametrize("label", sorted(CAUSES))
def test_classifier_names_the_injected_cause(tmp_path, label):
    args, env = CAUSES[label]
    if "--ckpt-every" in args:
        args = args + ["--ckpt-dir", str(tmp_path / "ckpt")]
    run_dir = tmp_path / "run"
    proc = run_command(mpiexec_argv(2) + [sys.executable, TRAIN, "--steps", "6", *QUIET, *args,
                                          "--run-dir", run_dir],
                       outer_timeout_s=120, env=launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache", **env))
    assert proc.returncode == 0, str(proc)
    verdict = json.loads((run_dir / "bottleneck.json").read_text())
    assert verdict["label"] == label, (verdict, proc.stdout[-1500:])
    assert f"bottleneck: {label}" in proc.stdout
    if label == "straggler-bound":
        assert verdict["slowest_rank"] == 1


# -- a throttled link between two network namespaces ---------------------------------------------
def _sh(*argv):
    subprocess.run([str(a) for a in argv], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_nodes(tmp_path):
    """Two network namespaces joined by a veth pair throttled to 40 Mbit/s with `tc ... tbf`,
    named hosts, and an ssh-free launch agent (docs/operations.md). Torn down after."""
    tools = [shutil.which(t) for t in ("ip", "tc", "unshare")]
    if os.geteuid() != 0 or None in tools or MPIEXEC is None:
        pytest.skip("needs root, ip, tc, unshare and mpiexec")
    tag = uuid.uuid4().hex[:6]
    nodes, links = [f"rtxA{tag}", f"rtxB{tag}"], [f"rva{tag}", f"rvb{tag}"]
    made = []
    try:
        for ns in nodes:
            _sh("ip", "netns", "add", ns)
            made.append(ns)
        _sh("ip", "link", "add", links[0], "type", "veth", "peer", "name", links[1])
        for i, (ns, dev) in enumerate(zip(nodes, links)):
            _sh("ip", "link", "set", dev, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"10.77.0.{i + 1}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
            _sh("tc", "-n", ns, "qdisc", "add", "dev", dev, "root", "tbf", "rate", "40mbit",
                "burst", "32kb", "latency", "100ms")
            os.makedirs(f"/etc/netns/{ns}", exist_ok=True)
            with open(f"/etc/netns/{ns}/hosts", "w") as f:
                f.write(f"127.0.0.1 localhost\n10.77.0.1 {nodes[0]}\n10.77.0.2 {nodes[1]}\n")
        agent = tmp_path / "agent.sh"
        agent.write_text('#!/bin/sh\nhost=$1; shift\n'
                         'exec ip netns exec "$host" unshare --uts sh -c "hostname $host; $*"\n')
        agent.chmod(0o755)
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("".join(f"{ns} slots=1\n" for ns in nodes))
        yield nodes, agent, hostfile
    finally:
        for ns in made:
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
            shutil.rmtree(f"/etc/netns/{ns}", ignore_errors=True)


@pytest.mark.netns
def test_classifier_names_a_throttled_link_communication_bound(tmp_path, two_nodes):
    nodes, agent, hostfile = two_nodes
    run_dir = tmp_path / "run"
    mpi = (f"{MPIEXEC} --prtemca plm_ssh_agent {agent} --hostfile {hostfile} "
           f"--map-by ppr:1:node:OVERSUBSCRIBE --bind-to none --mca btl tcp,self "
           f"--mca btl_tcp_if_include 10.77.0.0/24 --prtemca oob_tcp_if_include 10.77.0.0/24 -n 2 "
           f"{sys.executable} {TRAIN} --model tiny --global-batch 8 --seq-len 32 --steps 6 "
           f"{' '.join(QUIET)} --run-dir {run_dir}")
    proc = run_command(["ip", "netns", "exec", nodes[0], "unshare", "--uts", "sh", "-c",
                        f"hostname {nodes[0]}; {mpi}"], outer_timeout_s=120,
                       env=launch_env(RTXMPI_CACHE_DIR=tmp_path / "cache"))
    assert proc.returncode == 0, str(proc)
    run = json.loads((run_dir / "run.json").read_text())
    verdict = json.loads((run_dir / "bottleneck.json").read_text())
    assert verdict["label"] == "communication-bound", (verdict, proc.stdout[-1500:])
    doc = json.loads((run_dir / "timeline.json").read_text())
    hosts = {r["host"] for r in doc["otherData"]["rtxmpi_ranks"]}
    assert hosts == set(nodes) and run["world_size"] == 2
