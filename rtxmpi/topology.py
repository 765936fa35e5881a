"""Where the ranks run: hosts and local ranks, GPUs and their links, InfiniBand, NUMA; a
bandwidth/latency matrix between ranks; placement advice for the mesh and the planner.

    topo = discover(world)                     # collective: every rank of `world` calls
    topo.describe()                            # text for `rtxmpi info`
    topo.bandwidth_gbps[i, j]                  # estimate (or measured, with calibrate=True)
    advise_tp(topo, tp=8)                      # [] when every tp block sits in one NVLink island

Sources of each fact, in order of preference:
- hosts and local ranks: MPI (hostnames gathered over the group; local rank = rank among the
  ranks on the same host, as MPI's shared-memory split gives it);
- GPUs and links: NVML through nvidia-ml-py (pynvml), else the matrix printed by
  `nvidia-smi topo -m`, else "no GPU";
- InfiniBand ports and rates: /sys/class/infiniband/<dev>/ports/<n>/{state,rate,link_layer};
- NUMA nodes: /sys/devices/system/node/node<i>/cpulist; CPU affinity: os.sched_getaffinity.

Link names are those of `nvidia-smi topo -m`: X (self), NV<n> (n bonded NVLinks), PIX, PXB, PHB,
NODE, SYS (PCIe paths, nearest to farthest). A host whose GPUs are all pairwise NVLink-connected
with the same link count (4 or more GPUs) is reported as an NVSwitch fabric: that is how
`nvidia-smi topo -m` shows DGX/HGX boards (NV12 on A100, NV18 on H100); NVML names the switch
directly (remote device type).

Bandwidth estimates (GB/s, one direction) when not measured: NVLink 25 per link (NVLink 3 and 4
both run 25 GB/s per link and direction), PCIe 25 (PIX/PXB), 20 (PHB), 15 (NODE), 10 (SYS); across
hosts the fastest active InfiniBand port's rate (400 Gb/s NDR -> 50 GB/s), else 1.25 (10 GbE); CPU
ranks on one host 10 (shared memory). `calibrate=True` replaces them by a measured ping-pong.
Sources: NVIDIA nvidia-smi and NVML documentation; DGX H100 / A100 system guides.
"""
import json
import os
import re
import shutil
import socket
import subprocess
import time
from dataclasses import asdict, dataclass, field

import numpy as np

from .errors import ConfigError

NVLINK_GBPS_PER_LINK = 25.0
PCIE_GBPS = {"PIX": 25.0, "PXB": 25.0, "PHB": 20.0, "NODE": 15.0, "SYS": 10.0}
PCIE_LATENCY_US = {"PIX": 2.0, "PXB": 2.5, "PHB": 3.0, "NODE": 4.0, "SYS": 6.0}
NVLINK_LATENCY_US = 1.5
SHM_GBPS, SHM_LATENCY_US = 10.0, 0.5
ETHERNET_GBPS, ETHERNET_LATENCY_US = 1.25, 20.0
IB_LATENCY_US = 3.0
LINK_KINDS = ("X", "PIX", "PXB", "PHB", "NODE", "SYS")
_HOSTNAME_BYTES = 256


@dataclass
class GPU:
    """One GPU of this host: index (CUDA ordinal), name, PCI bus id, NUMA node (-1 unknown), CPU
    affinity (a cpulist string such as "0-55,112-167", "" unknown)."""
    index: int
    name: str = ""
    pci_bus_id: str = ""
    numa_node: int = -1
    cpu_affinity: str = ""


@dataclass
class IBPort:
    """An InfiniBand (or RoCE) port: device (mlx5_0), port number, state (ACTIVE, DOWN, ...),
    rate_gbps (Gb/s, as /sys reports: 400 for NDR), link_layer (InfiniBand or Ethernet), NUMA node
    of the adapter (-1 unknown)."""
    device: str
    port: int
    state: str
    rate_gbps: float
    link_layer: str
    numa_node: int = -1

    @property
    def active(self):
        return self.state.upper() == "ACTIVE"


@dataclass
class HostTopology:
    """What one host has: GPUs, the link matrix between them (links[i][j], topo -m names), whether
    they form an NVSwitch fabric, InfiniBand ports, NUMA nodes {node: cpulist}, and where the GPU
    facts came from ("nvml", "nvidia-smi", or "none" = no GPU)."""
    hostname: str
    gpus: list = field(default_factory=list)
    links: list = field(default_factory=list)
    nvswitch: bool = False
    ib_ports: list = field(default_factory=list)
    numa_nodes: dict = field(default_factory=dict)
    gpu_source: str = "none"

    def nvlink_count(self, i, j):
        """Bonded NVLinks between GPUs i and j (0 when the path is PCIe)."""
        match = re.fullmatch(r"NV(\d+)", self.links[i][j]) if self.links else None
        return int(match.group(1)) if match else 0

    def nvlink_islands(self):
        """Groups of GPU indices joined pairwise by NVLink (each a sorted list; singletons for
        PCIe-only GPUs). Every GPU of an NVSwitch host is in one island."""
        islands = []
        for i in range(len(self.gpus)):
            for island in islands:
                if all(self.nvlink_count(i, j) for j in island):
                    island.append(i)
                    break
            else:
                islands.append([i])
        return islands

    def best_ib_gbps(self):
        """Rate in Gb/s of the fastest ACTIVE InfiniBand-layer port (0 when none)."""
        rates = [p.rate_gbps for p in self.ib_ports if p.active and p.link_layer == "InfiniBand"]
        return max(rates, default=0.0)


@dataclass
class Topology:
    """The job's placement: per rank (index = group rank) its host index, local rank and GPU
    (-1: none); the hosts' topologies; bandwidth_gbps and latency_us matrices between ranks
    (GB/s one direction; microseconds), estimated or `measured`."""
    hosts: list
    host_of_rank: list
    local_rank: list
    gpu_of_rank: list
    bandwidth_gbps: np.ndarray
    latency_us: np.ndarray
    measured: bool = False

    @property
    def world_size(self):
        return len(self.host_of_rank)

    @property
    def has_gpu(self):
        return any(h.gpus for h in self.hosts)

    def same_island(self, a, b):
        """True when ranks a and b sit on one host and their GPUs share an NVLink island (CPU
        ranks: on one host)."""
        if self.host_of_rank[a] != self.host_of_rank[b]:
            return False
        host = self.hosts[self.host_of_rank[a]]
        ga, gb = self.gpu_of_rank[a], self.gpu_of_rank[b]
        if ga < 0 or gb < 0 or not host.gpus:
            return ga < 0 and gb < 0
        return ga == gb or bool(host.nvlink_count(ga, gb))

    def describe(self):
        """Multi-line text: hosts, ranks per host, GPUs and their links, InfiniBand, NUMA."""
        lines = []
        for h, host in enumerate(self.hosts):
            ranks = [r for r, hr in enumerate(self.host_of_rank) if hr == h]
            lines.append(f"host {host.hostname}: ranks {_ranges(ranks)}")
            if not host.gpus:
                lines.append("  GPUs: no GPU")
            else:
                fabric = ("NVSwitch" if host.nvswitch else
                          "NVLink" if any(len(i) > 1 for i in host.nvlink_islands()) else "PCIe")
                lines.append(f"  GPUs: {len(host.gpus)} x {host.gpus[0].name or 'GPU'} "
                             f"({fabric}; from {host.gpu_source}); NVLink islands "
                             f"{host.nvlink_islands()}")
                for g in host.gpus:
                    row = " ".join(f"{v:>5}" for v in host.links[g.index]) if host.links else ""
                    lines.append(f"    GPU{g.index} {row}  NUMA {g.numa_node if g.numa_node >= 0 else '?'}"
                                 f"  CPUs {g.cpu_affinity or '?'}")
            ports = [f"{p.device}/{p.port} {p.state} {p.rate_gbps:g} Gb/s {p.link_layer}"
                     for p in host.ib_ports]
            lines.append("  InfiniBand: " + ("; ".join(ports) if ports else "none"))
            if host.numa_nodes:
                lines.append("  NUMA: " + "; ".join(f"node{n} CPUs {c}"
                                                    for n, c in sorted(host.numa_nodes.items())))
        kind = "measured" if self.measured else "estimated"
        bw = self.bandwidth_gbps[~np.eye(self.world_size, dtype=bool)]
        if bw.size:
            lines.append(f"bandwidth between ranks ({kind}): min {bw.min():.3g}, max "
                         f"{bw.max():.3g} GB/s")
        return "\n".join(lines)


# ------------------------------------------------------------------------- nvidia-smi topo -m
def parse_nvidia_smi_topo(text):
    """Parse the matrix of `nvidia-smi topo -m` (tab- or space-separated).

    Returns (gpus, links): gpus a list of GPU (index, CPU affinity and NUMA node from the
    "CPU Affinity" / "NUMA Affinity" columns), links the GPU x GPU matrix of link names (X, NV<n>,
    PIX, PXB, PHB, NODE, SYS). NIC rows and columns are dropped. ([], []) for "No devices were
    found" or empty text. Raises ConfigError when a row is malformed or the matrix is not square.
    """
    lines = text.splitlines()
    header_index = next((i for i, line in enumerate(lines) if re.match(r"^\s+GPU0\b", line)), None)
    if header_index is None:
        if "No devices were found" in text or not text.strip():
            return [], []
        raise ConfigError("nvidia-smi topo -m: no 'GPU0' header line found")
    header = lines[header_index].split()
    n = sum(1 for c in header if re.fullmatch(r"GPU\d+", c))
    nics = sum(1 for c in header if re.fullmatch(r"NIC\d+|mlx\d+_\d+", c))
    gpus, links = [], []
    for line in lines[header_index + 1:]:
        cells = line.split()
        if not cells or cells[0].startswith("Legend"):
            if cells:
                break
            continue
        if not re.fullmatch(r"GPU\d+", cells[0]):
            continue  # NIC rows
        row, tail = cells[1:1 + n], cells[1 + n + nics:]
        if len(row) != n:
            raise ConfigError(f"nvidia-smi topo -m: row {cells[0]} has {len(row)} GPU cells, "
                              f"expected {n}")
        for value in row:
            if value not in LINK_KINDS and not re.fullmatch(r"NV\d+", value):
                raise ConfigError(f"nvidia-smi topo -m: unknown link {value!r} in row {cells[0]}")
        numa = tail[1] if len(tail) > 1 else ""
        gpus.append(GPU(index=int(cells[0][3:]), cpu_affinity=tail[0] if tail else "",
                        numa_node=int(numa) if numa.isdigit() else -1))
        links.append(row)
    if len(gpus) != n or any(links[i][i] != "X" for i in range(n)):
        raise ConfigError(f"nvidia-smi topo -m: {n} GPU columns but {len(gpus)} GPU rows, or a "
                          "diagonal entry that is not X")
    return gpus, links


def is_nvswitch(links):
    """True when 4 or more GPUs are all pairwise NVLink-connected with one link count (how
    nvidia-smi shows an NVSwitch board)."""
    n = len(links)
    counts = {links[i][j] for i in range(n) for j in range(n) if i != j}
    return n >= 4 and len(counts) == 1 and re.fullmatch(r"NV\d+", next(iter(counts))) is not None


# ---------------------------------------------------------------------------------- NVML
_NVML_ANCESTOR = {0: "X", 10: "PIX", 20: "PXB", 30: "PHB", 40: "NODE", 50: "SYS"}


def gpus_from_nvml(nvml=None):
    """(gpus, links, nvswitch) from NVML (nvidia-ml-py's pynvml module, or a stand-in with the
    same functions). Returns None when NVML is missing or finds no driver; ([], [], False) when
    it finds no GPU."""
    if nvml is None:
        try:
            import pynvml as nvml
        except ImportError:
            return None
    try:
        nvml.nvmlInit()
    except Exception:
        return None
    try:
        count = nvml.nvmlDeviceGetCount()
        handles = [nvml.nvmlDeviceGetHandleByIndex(i) for i in range(count)]
        bus = []
        gpus = []
        for i, h in enumerate(handles):
            name = nvml.nvmlDeviceGetName(h)
            pci = nvml.nvmlDeviceGetPciInfo(h).busId
            bus.append(_norm_bus(pci))
            gpus.append(GPU(index=i, name=name.decode() if isinstance(name, bytes) else name,
                            pci_bus_id=bus[-1]))
        nvlinks = [[0] * count for _ in range(count)]
        switch = False
        max_links = getattr(nvml, "NVML_NVLINK_MAX_LINKS", 18)
        switch_type = getattr(nvml, "NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
        for i, h in enumerate(handles):
            for link in range(max_links):
                try:
                    if not nvml.nvmlDeviceGetNvLinkState(h, link):
                        continue
                except Exception:  # link index past this GPU's links, or NVLink unsupported
                    break
                try:
                    if nvml.nvmlDeviceGetNvLinkRemoteDeviceType(h, link) == switch_type:
                        switch = True
                        for j in range(count):  # a switch port reaches every GPU of the fabric
                            if j != i:
                                nvlinks[i][j] += 1
                        continue
                except Exception:
                    pass
                remote = _norm_bus(nvml.nvmlDeviceGetNvLinkRemotePciInfo(h, link).busId)
                if remote in bus:
                    nvlinks[i][bus.index(remote)] += 1
        links = []
        for i in range(count):
            row = []
            for j in range(count):
                if i == j:
                    row.append("X")
                elif nvlinks[i][j]:
                    row.append(f"NV{nvlinks[i][j]}")
                else:
                    level = nvml.nvmlDeviceGetTopologyCommonAncestor(handles[i], handles[j])
                    row.append(_NVML_ANCESTOR.get(int(level), "SYS"))
            links.append(row)
        return gpus, links, switch or is_nvswitch(links)
    finally:
        try:
            nvml.nvmlShutdown()
        except Exception:
            pass


def _norm_bus(bus_id):
    text = bus_id.decode() if isinstance(bus_id, bytes) else str(bus_id)
    return text.lower()[-12:]  # "00000000:1B:00.0" and "0000:1b:00.0" compare equal


# --------------------------------------------------------------------------------- sysfs
def _read(path, default=""):
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return default


def ib_ports(sysfs_root="/sys"):
    """InfiniBand / RoCE ports from <sysfs_root>/class/infiniband (empty list when absent)."""
    base = os.path.join(sysfs_root, "class", "infiniband")
    ports = []
    for device in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        numa = _read(os.path.join(base, device, "device", "numa_node"), "-1")
        for port in sorted(os.listdir(os.path.join(base, device, "ports")), key=_int_or_zero):
            root = os.path.join(base, device, "ports", port)
            state = _read(os.path.join(root, "state"), "UNKNOWN")  # "4: ACTIVE"
            rate = _read(os.path.join(root, "rate"), "0")  # "400 Gb/sec (4X NDR)"
            match = re.match(r"\s*([0-9.]+)", rate)
            ports.append(IBPort(device=device, port=_int_or_zero(port),
                                state=state.split(":")[-1].strip(),
                                rate_gbps=float(match.group(1)) if match else 0.0,
                                link_layer=_read(os.path.join(root, "link_layer"), "InfiniBand"),
                                numa_node=int(numa) if numa.lstrip("-").isdigit() else -1))
    return ports


def numa_nodes(sysfs_root="/sys"):
    """{node: cpulist} from <sysfs_root>/devices/system/node (empty when absent)."""
    base = os.path.join(sysfs_root, "devices", "system", "node")
    nodes = {}
    for name in sorted(os.listdir(base)) if os.path.isdir(base) else []:
        match = re.fullmatch(r"node(\d+)", name)
        if match:
            nodes[int(match.group(1))] = _read(os.path.join(base, name, "cpulist"))
    return nodes


def _int_or_zero(text):
    return int(text) if str(text).isdigit() else 0


# ------------------------------------------------------------------------------ this host
def host_topology(sysfs_root="/sys", nvml=None, topo_text=None, use_nvml=True):
    """This host's HostTopology. GPU facts from NVML (`nvml` module or pynvml), else from
    `topo_text` (recorded `nvidia-smi topo -m` output) or from running nvidia-smi, else none.
    Never raises for a missing tool; a malformed recorded matrix raises ConfigError."""
    host = HostTopology(hostname=socket.gethostname(), ib_ports=ib_ports(sysfs_root),
                        numa_nodes=numa_nodes(sysfs_root))
    found = gpus_from_nvml(nvml) if use_nvml and topo_text is None else None
    if found is not None and found[0]:
        host.gpus, host.links, host.nvswitch = found
        host.gpu_source = "nvml"
        return host
    if topo_text is None and shutil.which("nvidia-smi"):
        try:
            topo_text = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True,
                                       text=True, timeout=20).stdout
        except (OSError, subprocess.SubprocessError):
            topo_text = None
    if topo_text:
        try:
            gpus, links = parse_nvidia_smi_topo(topo_text)
        except ConfigError:
            if found is None:
                raise
            gpus, links = [], []
        if gpus:
            host.gpus, host.links, host.nvswitch = gpus, links, is_nvswitch(links)
            host.gpu_source = "nvidia-smi"
    return host


# ------------------------------------------------------------------------------- the job
def host_from_dict(d):
    """A HostTopology from its `dataclasses.asdict` form (how discover() exchanges hosts)."""
    d = dict(d)
    d["gpus"] = [GPU(**g) for g in d["gpus"]]
    d["ib_ports"] = [IBPort(**p) for p in d["ib_ports"]]
    d["numa_nodes"] = {int(k): v for k, v in d["numa_nodes"].items()}
    return HostTopology(**d)


def build(hosts, host_of_rank, local_rank, gpu_of_rank):
    """A Topology from per-rank placement, with the estimated bandwidth/latency matrices (pure).

    hosts: list of HostTopology; host_of_rank, local_rank, gpu_of_rank: one int per rank."""
    n = len(host_of_rank)
    bw = np.zeros((n, n))
    lat = np.zeros((n, n))
    for a in range(n):
        for b in range(n):
            bw[a, b], lat[a, b] = _estimate(hosts, host_of_rank, gpu_of_rank, a, b)
    return Topology(hosts=hosts, host_of_rank=list(host_of_rank), local_rank=list(local_rank),
                    gpu_of_rank=list(gpu_of_rank), bandwidth_gbps=bw, latency_us=lat)


def _estimate(hosts, host_of_rank, gpu_of_rank, a, b):
    if a == b:
        return np.inf, 0.0
    ha, hb = host_of_rank[a], host_of_rank[b]
    if ha != hb:
        rate = min(hosts[ha].best_ib_gbps(), hosts[hb].best_ib_gbps())
        return (rate / 8, IB_LATENCY_US) if rate else (ETHERNET_GBPS, ETHERNET_LATENCY_US)
    host, ga, gb = hosts[ha], gpu_of_rank[a], gpu_of_rank[b]
    if ga < 0 or gb < 0 or not host.links or ga == gb:
        return SHM_GBPS, SHM_LATENCY_US
    link = host.links[ga][gb]
    if link.startswith("NV"):
        return NVLINK_GBPS_PER_LINK * int(link[2:]), NVLINK_LATENCY_US
    return PCIE_GBPS[link], PCIE_LATENCY_US[link]


def discover(group, calibrate=False, sysfs_root="/sys", calibrate_bytes=1 << 20):
    """The job's Topology, the same on every rank of `group`.

    Each rank describes its host (host_topology) and its GPU (the CUDA ordinal of group.device,
    -1 on CPU); hostnames and GPUs are gathered over the group, each host's description taken
    from its lowest rank. calibrate: replace the estimates by a measured ping-pong between every
    pair of ranks (`calibrate_pairs`). Collective: every rank of `group` must call.
    """
    name = socket.gethostname().encode()[:_HOSTNAME_BYTES]
    raw = np.zeros(_HOSTNAME_BYTES + 1, np.uint8)
    raw[:len(name)] = np.frombuffer(name, np.uint8)
    device = str(getattr(group, "device", "cpu"))
    raw[-1] = int(device.split(":")[1]) + 1 if device.startswith("cuda:") else 0
    table = group.all_gather(raw[None, :])
    names = [bytes(row[:_HOSTNAME_BYTES]).rstrip(b"\0").decode(errors="replace") for row in table]
    gpu_of_rank = [int(row[-1]) - 1 for row in table]
    order = list(dict.fromkeys(names))
    host_of_rank = [order.index(h) for h in names]
    local_rank = [names[:r].count(names[r]) for r in range(len(names))]
    mine = (json.dumps(asdict(host_topology(sysfs_root))).encode()
            if local_rank[group.rank] == 0 else b"")
    sizes = group.all_gather(np.array([len(mine)], np.int64))
    width = int(sizes.max())
    padded = np.zeros(width, np.uint8)
    padded[:len(mine)] = np.frombuffer(mine, np.uint8)
    blobs = group.all_gather(padded[None, :]) if width else np.zeros((len(names), 0), np.uint8)
    hosts = [None] * len(order)
    for r in range(len(names)):
        if local_rank[r] == 0:
            hosts[host_of_rank[r]] = host_from_dict(json.loads(bytes(blobs[r][:int(sizes[r])])))
    topo = build(hosts, host_of_rank, local_rank, gpu_of_rank)
    if calibrate:
        topo.bandwidth_gbps, topo.latency_us = calibrate_pairs(group, calibrate_bytes)
        topo.measured = True
    return topo


def calibrate_pairs(group, nbytes=1 << 20, repeats=3):
    """Measure (bandwidth_gbps, latency_us) between every pair of ranks of `group`.

    Round-robin tournament (the circle method): world_size - 1 rounds (world_size when odd), each
    rank paired with one other per round; a pair does `repeats` ping-pongs of 8 bytes (latency =
    half the best round trip) and of `nbytes` (bandwidth = nbytes / half the best round trip).
    Rows are all-gathered so every rank returns the same matrices. Arrays live where the group's
    device is (numpy on CPU). Collective: every rank of `group` must call.
    """
    n, me = group.world_size, group.rank
    bw = np.full((n, n), np.inf)
    lat = np.zeros((n, n))
    small, big = np.zeros(1, np.float64), np.zeros(max(1, nbytes // 4), np.float32)
    slots = list(range(n)) + ([None] if n % 2 else [])
    m = len(slots)
    for round_ in range(m - 1):
        ring = [slots[0]] + [slots[1 + (k + round_) % (m - 1)] for k in range(m - 1)]
        pairs = [(ring[k], ring[m - 1 - k]) for k in range(m // 2)]
        peer = next((b if a == me else a for a, b in pairs if me in (a, b)), None)
        if peer is None:
            continue
        first = me < peer
        for payload, out in ((small, lat), (big, bw)):
            best = np.inf
            for _ in range(repeats):
                t0 = time.perf_counter()
                if first:
                    group.send(payload, peer)
                    group.recv(payload, peer)
                else:
                    group.recv(payload, peer)
                    group.send(payload, peer)
                best = min(best, time.perf_counter() - t0)
            half = best / 2
            out[me, peer] = half * 1e6 if out is lat else payload.nbytes / half / 1e9
    rows = group.all_gather(np.stack([bw[me], lat[me]])[None])
    return rows[:, 0, :], rows[:, 1, :]


# ------------------------------------------------------------------------------ advice
def _tp_blocks_outside(topo, tp):
    """[(block, ranks outside its first rank's island)] for the consecutive-rank tp blocks."""
    n = topo.world_size
    if tp < 1 or n % tp:
        raise ConfigError(f"tp({tp}) must divide world_size({n})")
    bad = []
    for start in range(0, n, tp):
        block = list(range(start, start + tp))
        outside = [r for r in block[1:] if not topo.same_island(block[0], r)]
        if outside:
            bad.append((block, outside))
    return bad


def advise_tp(topo, tp):
    """Check the mesh's tensor-parallel blocks (consecutive ranks [k*tp, (k+1)*tp), the order of
    rtxmpi.mesh) against the topology: returns a list of human-readable problems, empty when
    every block sits inside one NVLink island (GPU) or one host (CPU). Raises ConfigError when tp
    does not divide the world size."""
    bad = _tp_blocks_outside(topo, tp)
    where = "NVLink island" if topo.has_gpu else "host"
    path = "PCIe or the network" if topo.has_gpu else "the network"
    best = max_tp_in_island(topo) if bad else tp
    return [f"tp block ranks {block[0]}-{block[-1]}: ranks {outside} are not in rank "
            f"{block[0]}'s {where}, so every layer's tp collectives would cross {path}; "
            f"the largest tp that fits is {best}" for block, outside in bad]


def max_tp_in_island(topo):
    """The largest tp (a divisor of world_size) whose consecutive-rank blocks all sit in one
    NVLink island (GPU) or one host (CPU): the planner's upper bound for tp."""
    n = topo.world_size
    for tp in sorted((d for d in range(1, n + 1) if n % d == 0), reverse=True):
        if not _tp_blocks_outside(topo, tp):
            return tp
    return 1


def placement_filter(topo, base=None):
    """A `supported(layout)` predicate for the planner (rtxmpi.parallel.planner.make_plan):
    `base(layout)`'s reason when it rejects, else — on GPU hosts — a reason when the layout's
    tensor-parallel blocks (consecutive ranks) leave an NVLink island; None when supported.
    CPU-only jobs are not filtered (the planner's per-node cost model covers them). Local."""
    def supported(layout):
        why = base(layout) if base is not None else None
        if why or not topo.has_gpu or layout.tp <= 1 or topo.world_size % layout.tp:
            return why
        if _tp_blocks_outside(topo, layout.tp):
            return (f"placement: tp {layout.tp} blocks leave an NVLink island (the largest tp "
                    f"that fits is {max_tp_in_island(topo)})")
        return None

    return supported


def _ranges(values):
    """[0, 1, 2, 5] -> "0-2,5"."""
    out, start = [], None
    for i, v in enumerate(values):
        if start is None:
            start = v
        if i + 1 == len(values) or values[i + 1] != v + 1:
            out.append(f"{start}-{v}" if v != start else f"{v}")
            start = None
    return ",".join(out)
