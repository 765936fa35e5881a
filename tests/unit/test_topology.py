"""rtxmpi.topology on recorded samples: `nvidia-smi topo -m` of an 8-GPU NVSwitch DGX H100, a
4-GPU PCIe host and a 4-GPU host with NVLink bridges; /sys/class/infiniband and NUMA trees; an
NVML stand-in; multi-node jobs built from them; and this CPU machine ("no GPU")."""
import os
import types

import numpy as np
import pytest

from rtxmpi import topology
from rtxmpi.errors import ConfigError

DATA = os.path.join(os.path.dirname(__file__), "..", "data", "topology")


def _read(name):
    with open(os.path.join(DATA, name)) as f:
        return f.read()


def _host(topo_file, sys_dir, name):
    host = topology.host_topology(sysfs_root=os.path.join(DATA, sys_dir),
                                  topo_text=_read(topo_file), use_nvml=False)
    host.hostname = name
    return host


def test_dgx_h100_matrix_is_one_nvswitch_island_with_numa_affinity():
    gpus, links = topology.parse_nvidia_smi_topo(_read("dgx_h100_topo_m.txt"))
    assert [g.index for g in gpus] == list(range(8))
    assert all(links[i][j] == ("X" if i == j else "NV18") for i in range(8) for j in range(8))
    assert topology.is_nvswitch(links)
    assert gpus[0].cpu_affinity == "0-55,112-167" and gpus[0].numa_node == 0
    assert gpus[5].cpu_affinity == "56-111,168-223" and gpus[5].numa_node == 1
    host = _host("dgx_h100_topo_m.txt", "dgx_h100_sys", "dgx-a")
    assert host.nvswitch and host.gpu_source == "nvidia-smi"
    assert host.nvlink_islands() == [list(range(8))]


def test_pcie_host_has_no_nvlink_islands():
    gpus, links = topology.parse_nvidia_smi_topo(_read("pcie_4gpu_topo_m.txt"))
    assert links[0][1] == "PIX" and links[0][2] == "SYS" and links[3][2] == "PIX"
    assert not topology.is_nvswitch(links)
    host = _host("pcie_4gpu_topo_m.txt", "pcie_4gpu_sys", "pcie-a")
    assert host.nvlink_islands() == [[0], [1], [2], [3]]
    assert [g.numa_node for g in host.gpus] == [0, 0, 1, 1]


def test_bridged_pairs_form_two_islands():
    host = _host("bridged_4gpu_topo_m.txt", "pcie_4gpu_sys", "bridged")
    assert host.nvlink_islands() == [[0, 1], [2, 3]]
    assert host.nvlink_count(0, 1) == 4 and host.nvlink_count(1, 2) == 0
    assert not host.nvswitch


def test_space_separated_copy_parses_the_same():
    text = _read("dgx_h100_topo_m.txt")
    assert topology.parse_nvidia_smi_topo(text.replace("\t", "   ")) == \
        topology.parse_nvidia_smi_topo(text)


def test_no_devices_and_malformed_matrices():
    assert topology.parse_nvidia_smi_topo("No devices were found\n") == ([], [])
    with pytest.raises(ConfigError, match="no 'GPU0' header"):
        topology.parse_nvidia_smi_topo("garbage\n")
    broken = _read("pcie_4gpu_topo_m.txt").replace("GPU1\tPIX\t X \tSYS", "GPU1\tPIX\t X \tQQQ")
    with pytest.raises(ConfigError, match="unknown link 'QQQ'"):
        topology.parse_nvidia_smi_topo(broken)


def test_infiniband_ports_rates_states_and_link_layers():
    ports = topology.ib_ports(os.path.join(DATA, "dgx_h100_sys"))
    assert len(ports) == 12 and ports[0].device == "mlx5_0" and ports[0].port == 1
    compute = [p for p in ports if p.link_layer == "InfiniBand"]
    assert len(compute) == 8 and all(p.rate_gbps == 400 and p.active for p in compute)
    assert [p.device for p in ports if not p.active] == ["mlx5_8"]
    assert {p.numa_node for p in ports} == {0, 1}
    pcie = topology.ib_ports(os.path.join(DATA, "pcie_4gpu_sys"))
    assert [(p.port, p.state, p.rate_gbps) for p in pcie] == [(1, "ACTIVE", 200.0),
                                                              (2, "DOWN", 10.0)]
    host = _host("pcie_4gpu_topo_m.txt", "pcie_4gpu_sys", "p")
    assert host.best_ib_gbps() == 200.0  # the DOWN port does not count


def test_numa_nodes_from_sysfs():
    assert topology.numa_nodes(os.path.join(DATA, "dgx_h100_sys")) == {0: "0-55,112-167",
                                                                       1: "56-111,168-223"}
    assert topology.numa_nodes(os.path.join(DATA, "missing")) == {}


def test_two_dgx_nodes_bandwidth_and_tp_advice():
    hosts = [_host("dgx_h100_topo_m.txt", "dgx_h100_sys", n) for n in ("dgx-a", "dgx-b")]
    ranks = range(16)
    topo = topology.build(hosts, [r // 8 for r in ranks], [r % 8 for r in ranks],
                          [r % 8 for r in ranks])
    assert topo.bandwidth_gbps[0, 7] == 18 * topology.NVLINK_GBPS_PER_LINK  # 450 GB/s
    assert topo.bandwidth_gbps[0, 8] == 400 / 8  # NDR: 50 GB/s
    assert topo.latency_us[0, 8] > topo.latency_us[0, 1]
    assert topology.advise_tp(topo, 8) == []
    problems = topology.advise_tp(topo, 16)
    assert len(problems) == 1 and "the largest tp that fits is 8" in problems[0]
    assert topology.max_tp_in_island(topo) == 8
    text = topo.describe()
    assert "host dgx-a: ranks 0-7" in text and "NVSwitch" in text and "400 Gb/s" in text


def test_pcie_and_bridged_hosts_limit_tp():
    pcie = _host("pcie_4gpu_topo_m.txt", "pcie_4gpu_sys", "pcie")
    topo = topology.build([pcie], [0] * 4, list(range(4)), list(range(4)))
    assert topology.max_tp_in_island(topo) == 1
    assert "PCIe" in topology.advise_tp(topo, 2)[0]
    assert topo.bandwidth_gbps[0, 1] == topology.PCIE_GBPS["PIX"]
    assert topo.bandwidth_gbps[0, 2] == topology.PCIE_GBPS["SYS"]
    bridged = _host("bridged_4gpu_topo_m.txt", "pcie_4gpu_sys", "bridged")
    topo = topology.build([bridged], [0] * 4, list(range(4)), list(range(4)))
    assert topology.advise_tp(topo, 2) == [] and topology.max_tp_in_island(topo) == 2
    with pytest.raises(ConfigError, match="must divide"):
        topology.advise_tp(topo, 3)


def test_cpu_machine_reports_no_gpu_and_islands_are_hosts(tmp_path):
    host = topology.host_topology(sysfs_root=str(tmp_path), topo_text="", use_nvml=False)
    assert host.gpus == [] and host.gpu_source == "none" and host.ib_ports == []
    other = topology.HostTopology(hostname="other")
    topo = topology.build([host, other], [0, 0, 1, 1], [0, 1, 0, 1], [-1] * 4)
    assert not topo.has_gpu and "no GPU" in topo.describe()
    assert topology.advise_tp(topo, 2) == [] and topology.max_tp_in_island(topo) == 2
    assert "host" in topology.advise_tp(topo, 4)[0]
    assert topo.bandwidth_gbps[0, 1] == topology.SHM_GBPS
    assert topo.bandwidth_gbps[0, 2] == topology.ETHERNET_GBPS  # no InfiniBand


def test_this_machine_without_nvml_or_nvidia_smi_is_clean():
    host = topology.host_topology(use_nvml=True)  # real probes: must not raise here
    assert isinstance(host.gpus, list)


def test_host_roundtrips_through_its_dict_form():
    from dataclasses import asdict
    host = _host("dgx_h100_topo_m.txt", "dgx_h100_sys", "dgx-a")
    assert topology.host_from_dict(asdict(host)) == host


def _fake_nvml(count, nvlink_peer=None, switch=False):
    """An NVML stand-in with the pynvml functions topology uses: `count` GPUs; NVLink links
    (4 per GPU) to nvlink_peer(i) or to an NVSwitch; PCIe common ancestors by pairs."""
    bus = [f"00000000:{0x18 + 0x10 * i:02X}:00.0" for i in range(count)]

    def remote_pci(h, link):
        return types.SimpleNamespace(busId=bus[nvlink_peer(h)].encode())

    return types.SimpleNamespace(
        nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: count,
        nvmlDeviceGetHandleByIndex=lambda i: i,
        nvmlDeviceGetName=lambda h: b"NVIDIA H100 80GB HBM3",
        nvmlDeviceGetPciInfo=lambda h: types.SimpleNamespace(busId=bus[h].encode()),
        NVML_NVLINK_MAX_LINKS=4, NVML_NVLINK_DEVICE_TYPE_SWITCH=2,
        nvmlDeviceGetNvLinkState=lambda h, link: int(switch or nvlink_peer is not None),
        nvmlDeviceGetNvLinkRemoteDeviceType=lambda h, link: 2 if switch else 0,
        nvmlDeviceGetNvLinkRemotePciInfo=remote_pci,
        nvmlDeviceGetTopologyCommonAncestor=lambda a, b: 10 if a // 2 == b // 2 else 50)


def test_nvml_links_pairs_switches_and_pcie():
    gpus, links, switch = topology.gpus_from_nvml(_fake_nvml(4, nvlink_peer=lambda i: i ^ 1))
    assert [g.name for g in gpus] == ["NVIDIA H100 80GB HBM3"] * 4
    assert links[0] == ["X", "NV4", "SYS", "SYS"] and links[2][3] == "NV4" and not switch
    gpus, links, switch = topology.gpus_from_nvml(_fake_nvml(4))
    assert links[0] == ["X", "PIX", "SYS", "SYS"] and not switch
    gpus, links, switch = topology.gpus_from_nvml(_fake_nvml(8, switch=True))
    assert switch and links[0][7] == "NV4"
    host = topology.host_topology(sysfs_root=os.path.join(DATA, "dgx_h100_sys"),
                                  nvml=_fake_nvml(8, switch=True))
    assert host.gpu_source == "nvml" and host.nvswitch and len(host.gpus) == 8


def test_nvml_without_a_driver_returns_none():
    def fail():
        raise RuntimeError("NVML Shared Library Not Found")
    assert topology.gpus_from_nvml(types.SimpleNamespace(nvmlInit=fail)) is None


def test_estimates_are_symmetric_with_infinite_self_bandwidth():
    hosts = [_host("pcie_4gpu_topo_m.txt", "pcie_4gpu_sys", n) for n in ("a", "b")]
    topo = topology.build(hosts, [0, 0, 1, 1], [0, 1, 0, 1], [0, 2, 1, 3])
    assert np.array_equal(topo.bandwidth_gbps, topo.bandwidth_gbps.T)
    assert np.isinf(np.diag(topo.bandwidth_gbps)).all()
    assert topo.bandwidth_gbps[0, 2] == 200 / 8


def test_planner_filter_rejects_tp_outside_an_nvlink_island_on_gpu_hosts_only():
    layout = types.SimpleNamespace
    hosts = [_host("dgx_h100_topo_m.txt", "dgx_h100_sys", n) for n in ("a", "b")]
    gpu = topology.build(hosts, [r // 8 for r in range(16)], [r % 8 for r in range(16)],
                         [r % 8 for r in range(16)])
    supported = topology.placement_filter(gpu)
    assert supported(layout(tp=8)) is None
    assert "largest tp that fits is 8" in supported(layout(tp=16))
    base = topology.placement_filter(gpu, base=lambda L: "base says no")
    assert base(layout(tp=2)) == "base says no"
    cpu = topology.build([topology.HostTopology("a"), topology.HostTopology("b")],
                         [0, 0, 1, 1], [0, 1, 0, 1], [-1] * 4)
    assert topology.placement_filter(cpu)(layout(tp=4)) is None
