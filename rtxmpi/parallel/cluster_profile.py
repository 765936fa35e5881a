"""A cluster hardware profile: what the cluster planner (rtxmpi.parallel.cluster) knows of the
devices, the node and the network. A small JSON file a user writes or copies; shipped ones for
DGX A100 80GB, DGX H100, DGX H200 and the CPU machine of the CI live in
rtxmpi/parallel/profiles/ and load by name (`load_cluster_profile("dgx-a100")`).

    {"format": "rtxmpi-cluster-profile", "version": 1,
     "name": "DGX A100 80GB", "source": "where the figures come from", "notes": "...",
     "device":  {"name": "A100-SXM4-80GB", "memory_gib": 80, "reserved_gib": 3,
                 "hbm_gbps": 2039, "achievable_hbm_gbps": 1700, "default_dtype": "bf16",
                 "peak_tflops_bf16": 312, "achievable_tflops_bf16": 250, ...},
     "node":    {"devices_per_node": 8, "intra_link": "NVSwitch", "intra_gbps": 300,
                 "intra_latency_us": 8, "host_link_gbps": 25, "host_memory_gbps": 400},
     "network": {"inter_link": "8x HDR IB", "nics_per_node": 8, "nic_gbps": 25,
                 "inter_latency_us": 12},
     "collectives": {"intra_efficiency": [[1048576, 0.3], [268435456, 0.8]],
                     "inter_efficiency": [[1048576, 0.2], [268435456, 0.9]]}}

Units are in the field names: GB/s = 1e9 bytes/s per direction (per device for the node's
link, per NIC for the network), TFLOP/s = 1e12 FLOP/s dense (no sparsity), GiB = 2**30 bytes,
microseconds. Peak and achievable FLOP/s come in pairs per dtype (fp32, tf32, bf16, fp16, fp8);
"achievable" is what large matrix multiplications reach, the rate the planner divides FLOPs by.
reserved_gib: memory the planner never plans for (CUDA context, communication buffers,
allocator fragmentation). host_link_gbps (device to host, per device, each way) and
host_memory_gbps (the node's DRAM, shared by its devices) are optional: without them ZeRO
offload is not planned. An efficiency curve gives the fraction of the link's bandwidth a
ring collective reaches at a message size (bytes per rank), interpolated log-linearly and held
beyond its ends; without one the full bandwidth is assumed. Unknown fields are errors, so a typo
is not silently ignored. Pure and local.
"""
import json
import math
import os
from dataclasses import dataclass, field

from ..errors import ProfileError

FORMAT = "rtxmpi-cluster-profile"
VERSION = 1
DTYPES = ("fp32", "tf32", "bf16", "fp16", "fp8")
PROFILE_DIR = os.path.join(os.path.dirname(__file__), "profiles")

_DEVICE = {"name": str, "memory_gib": float, "reserved_gib": float, "hbm_gbps": float,
           "achievable_hbm_gbps": float, "default_dtype": str}
_DEVICE.update({f"{kind}_tflops_{d}": float for d in DTYPES for kind in ("peak", "achievable")})
_NODE = {"devices_per_node": int, "intra_link": str, "intra_gbps": float, "intra_latency_us": float,
         "host_link_gbps": float, "host_memory_gbps": float}
_NETWORK = {"inter_link": str, "nics_per_node": int, "nic_gbps": float, "inter_latency_us": float}
_COLLECTIVES = {"intra_efficiency": list, "inter_efficiency": list}
_OPTIONAL = {"device.reserved_gib", "collectives", "notes", "collectives.intra_efficiency",
             "collectives.inter_efficiency", "node.host_link_gbps", "node.host_memory_gbps"}
_OPTIONAL |= {f"device.{k}" for k in _DEVICE if "tflops" in k}


@dataclass(frozen=True)
class ClusterProfile:
    """A validated cluster hardware profile (see the module docstring for the fields and units).

    peak_tflops / achievable_tflops: {dtype: TFLOP/s} for the dtypes the file gives; the other
    fields as in the file, efficiency curves as tuples of (bytes, fraction) sorted by bytes."""

    name: str
    source: str
    device_name: str
    memory_gib: float
    reserved_gib: float
    hbm_gbps: float
    achievable_hbm_gbps: float
    default_dtype: str
    peak_tflops: dict
    achievable_tflops: dict
    devices_per_node: int
    intra_link: str
    intra_gbps: float
    intra_latency_us: float
    inter_link: str
    nics_per_node: int
    nic_gbps: float
    inter_latency_us: float
    host_link_gbps: float = None
    host_memory_gbps: float = None
    intra_efficiency: tuple = ()
    inter_efficiency: tuple = ()
    notes: str = ""
    path: str = field(default=None, compare=False)

    @property
    def usable_bytes(self):
        """Device memory the planner may fill, bytes: memory_gib - reserved_gib."""
        return (self.memory_gib - self.reserved_gib) * 2**30

    def flops(self, dtype):
        """Achievable FLOP/s of large matrix multiplications in `dtype`. ConfigError (a
        ProfileError) when the profile has no figure for it."""
        if dtype not in self.achievable_tflops:
            raise ProfileError(f"the profile {self.name!r} has no achievable_tflops_{dtype}; it "
                               f"gives {', '.join(sorted(self.achievable_tflops))}",
                               field=f"device.achievable_tflops_{dtype}", path=self.path)
        return self.achievable_tflops[dtype] * 1e12

    def efficiency(self, nbytes, inter):
        """Fraction of the link bandwidth a ring collective of `nbytes` per rank reaches (the
        profile's curve; 1.0 without one)."""
        curve = self.inter_efficiency if inter else self.intra_efficiency
        if not curve:
            return 1.0
        if nbytes <= curve[0][0]:
            return curve[0][1]
        for (x0, y0), (x1, y1) in zip(curve, curve[1:]):
            if nbytes <= x1:
                t = math.log(nbytes / x0) / math.log(x1 / x0)
                return y0 + t * (y1 - y0)
        return curve[-1][1]


def _fail(msg, fld, path):
    where = f"{path}: " if path else ""
    raise ProfileError(f"{where}{fld}: {msg}", field=fld, path=path)


def _section(data, name, spec, path):
    if not isinstance(data, dict):
        _fail(f"must be an object, got {type(data).__name__}", name or "(top)", path)
    unknown = sorted(set(data) - set(spec))
    if unknown:
        _fail(f"unknown field(s) {', '.join(unknown)}; known: {', '.join(sorted(spec))}",
              f"{name}.{unknown[0]}" if name else unknown[0], path)
    out = {}
    for key, kind in spec.items():
        fld = f"{name}.{key}" if name else key
        if key not in data:
            if fld not in _OPTIONAL:
                _fail("missing", fld, path)
            continue
        value = data[key]
        if kind is str:
            if not isinstance(value, str) or not value.strip():
                _fail(f"must be a non-empty string, got {value!r}", fld, path)
        elif kind is list:
            value = _curve(value, fld, path)
        elif kind is dict:
            if not isinstance(value, dict):
                _fail(f"must be an object, got {type(value).__name__}", fld, path)
        else:
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                _fail(f"must be a number, got {value!r}", fld, path)
            if kind is int and value != int(value):
                _fail(f"must be an integer, got {value!r}", fld, path)
            if value < 0 or (value == 0 and key != "reserved_gib" and not key.endswith("latency_us")):
                _fail(f"must be > 0, got {value!r}", fld, path)
            value = kind(value)
        out[key] = value
    return out


def _curve(value, fld, path):
    if not isinstance(value, list) or not value:
        _fail("must be a non-empty list of [bytes, fraction] pairs", fld, path)
    points = []
    for p in value:
        ok = (isinstance(p, list) and len(p) == 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in p))
        if not ok or not p[0] > 0 or not 0 < p[1] <= 1:
            _fail(f"each point must be [bytes > 0, 0 < fraction <= 1], got {p!r}", fld, path)
        points.append((float(p[0]), float(p[1])))
    xs = [x for x, _ in points]
    if xs != sorted(xs) or len(set(xs)) != len(xs):
        _fail("points must be in increasing bytes", fld, path)
    return tuple(points)


def parse_cluster_profile(data, path=None):
    """ClusterProfile of a parsed JSON object. Raises ProfileError (a ConfigError) naming the
    first bad field: missing, unknown, of the wrong type or range, a peak without its achievable
    figure (or achievable above peak), reserved memory not below the memory, a default dtype
    without figures."""
    if not isinstance(data, dict):
        _fail("a cluster profile is a JSON object", "(top)", path)
    if data.get("format") != FORMAT:
        _fail(f"must be {FORMAT!r} (a CPU profile from --save-profile has no such field)",
              "format", path)
    if data.get("version") != VERSION:
        _fail(f"must be {VERSION}, got {data.get('version')!r}", "version", path)
    top = _section({k: v for k, v in data.items() if k not in ("format", "version")}, "",
                   {"name": str, "source": str, "notes": str, "device": dict, "node": dict,
                    "network": dict, "collectives": dict}, path)
    dev = _section(data["device"], "device", _DEVICE, path)
    node = _section(data["node"], "node", _NODE, path)
    net = _section(data["network"], "network", _NETWORK, path)
    coll = _section(data.get("collectives", {}), "collectives", _COLLECTIVES, path)
    peak = {d: dev[f"peak_tflops_{d}"] for d in DTYPES if f"peak_tflops_{d}" in dev}
    ach = {d: dev[f"achievable_tflops_{d}"] for d in DTYPES if f"achievable_tflops_{d}" in dev}
    for d in sorted(set(peak) | set(ach)):
        if d not in peak or d not in ach:
            missing = "peak" if d not in peak else "achievable"
            _fail("peak and achievable FLOP/s come in pairs", f"device.{missing}_tflops_{d}", path)
        if ach[d] > peak[d]:
            _fail(f"{ach[d]} exceeds peak_tflops_{d} {peak[d]}", f"device.achievable_tflops_{d}", path)
    if not peak:
        _fail("at least one peak_tflops_<dtype> / achievable_tflops_<dtype> pair", "device", path)
    if dev["default_dtype"] not in peak:
        _fail(f"{dev['default_dtype']!r} has no FLOP/s figures (given: {', '.join(peak)})",
              "device.default_dtype", path)
    reserved = dev.get("reserved_gib", 0.0)
    if reserved >= dev["memory_gib"]:
        _fail(f"{reserved} leaves no memory of memory_gib {dev['memory_gib']}",
              "device.reserved_gib", path)
    if dev["achievable_hbm_gbps"] > dev["hbm_gbps"]:
        _fail(f"{dev['achievable_hbm_gbps']} exceeds hbm_gbps {dev['hbm_gbps']}",
              "device.achievable_hbm_gbps", path)
    return ClusterProfile(
        name=top["name"], source=top["source"], notes=top.get("notes", ""),
        device_name=dev["name"], memory_gib=dev["memory_gib"], reserved_gib=reserved,
        hbm_gbps=dev["hbm_gbps"], achievable_hbm_gbps=dev["achievable_hbm_gbps"],
        default_dtype=dev["default_dtype"], peak_tflops=peak, achievable_tflops=ach,
        intra_efficiency=coll.get("intra_efficiency", ()),
        inter_efficiency=coll.get("inter_efficiency", ()), path=path, **node, **net)


def shipped_profiles():
    """Names of the shipped profiles (files in PROFILE_DIR without .json)."""
    return sorted(f[:-5] for f in os.listdir(PROFILE_DIR) if f.endswith(".json"))


def is_cluster_profile(path):
    """True when `path` names a shipped profile or a JSON file whose "format" is FORMAT, or that
    has no "format" but a cluster profile's "device" or "network" section (its loader then names
    the missing field). An unreadable file is not: the CPU profile loader reports it."""
    if not os.path.exists(path):
        return path in shipped_profiles()
    try:
        with open(path) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and (data.get("format") == FORMAT or (
        "format" not in data and bool({"device", "network"} & set(data))))


def load_cluster_profile(name_or_path):
    """ClusterProfile from a file, or a shipped one by name ("dgx-a100", "dgx-h100", "dgx-h200",
    "ci-cpu"). Raises ProfileError (a ConfigError) for a missing or unreadable file, bad JSON
    or a bad field."""
    path = name_or_path
    if not os.path.exists(path) and name_or_path in shipped_profiles():
        path = os.path.join(PROFILE_DIR, name_or_path + ".json")
    try:
        with open(path) as f:
            text = f.read(1 << 20)
    except OSError as exc:
        raise ProfileError(f"cannot read the profile {path!r}: {exc.strerror or exc}; shipped "
                           f"profiles: {', '.join(shipped_profiles())}", path=path) from None
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ProfileError(f"{path}: not JSON ({exc})", path=path) from None
    return parse_cluster_profile(data, path)
