"""The cluster hardware profile file: the shipped ones load, and a malformed one is a typed error
naming the field (rtxmpi.parallel.cluster_profile)."""
import copy
import json

import pytest

from rtxmpi.errors import ConfigError, ProfileError
from rtxmpi.parallel.cluster_profile import (is_cluster_profile, load_cluster_profile,
                                             parse_cluster_profile, shipped_profiles)


def _good():
    with open(load_cluster_profile("dgx-a100").path) as f:
        return json.load(f)


def test_shipped_profiles_load_and_cite_their_sources():
    assert set(shipped_profiles()) >= {"dgx-a100", "dgx-h100", "dgx-h200", "ci-cpu"}
    for name in shipped_profiles():
        p = load_cluster_profile(name)
        assert p.source and p.devices_per_node >= 1
        assert p.flops(p.default_dtype) <= p.peak_tflops[p.default_dtype] * 1e12
    a100, h200 = load_cluster_profile("dgx-a100"), load_cluster_profile("dgx-h200")
    assert a100.peak_tflops["bf16"] == 312 and a100.memory_gib == 80 and a100.hbm_gbps == 2039
    assert h200.memory_gib == 141 and h200.hbm_gbps == 4800 and h200.nic_gbps == 50


@pytest.mark.parametrize("edit, field", [
    (lambda d: d["device"].pop("hbm_gbps"), "device.hbm_gbps"),
    (lambda d: d["device"].__setitem__("hbm_gpbs", 1), "device.hbm_gpbs"),
    (lambda d: d["device"].__setitem__("memory_gib", "80"), "device.memory_gib"),
    (lambda d: d["device"].__setitem__("memory_gib", -1), "device.memory_gib"),
    (lambda d: d["device"].__setitem__("memory_gib", True), "device.memory_gib"),
    (lambda d: d["node"].__setitem__("devices_per_node", 8.5), "node.devices_per_node"),
    (lambda d: d["device"].pop("achievable_tflops_bf16"), "device.achievable_tflops_bf16"),
    (lambda d: d["device"].__setitem__("achievable_tflops_bf16", 400), "device.achievable_tflops_bf16"),
    (lambda d: d["device"].__setitem__("default_dtype", "fp8"), "device.default_dtype"),
    (lambda d: d["device"].__setitem__("reserved_gib", 80), "device.reserved_gib"),
    (lambda d: d["collectives"].__setitem__("intra_efficiency", [[2, 0.5], [1, 0.9]]),
     "collectives.intra_efficiency"),
    (lambda d: d["collectives"].__setitem__("inter_efficiency", [[1, 1.5]]),
     "collectives.inter_efficiency"),
    (lambda d: d.__setitem__("network", []), "network"),
    (lambda d: d.__setitem__("version", 2), "version"),
    (lambda d: d.pop("format"), "format"),
])
def test_a_bad_field_is_a_profile_error_naming_it(edit, field):
    data = copy.deepcopy(_good())
    edit(data)
    with pytest.raises(ProfileError) as info:
        parse_cluster_profile(data, "x.json")
    assert info.value.field == field and field in str(info.value)
    assert isinstance(info.value, ConfigError)


def test_unreadable_and_non_json_files_are_profile_errors(tmp_path):
    with pytest.raises(ProfileError, match="dgx-a100"):
        load_cluster_profile(str(tmp_path / "missing.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(ProfileError, match="not JSON"):
        load_cluster_profile(str(bad))
    assert not is_cluster_profile(str(bad))


def test_a_cpu_profile_is_not_a_cluster_profile(tmp_path):
    cpu = tmp_path / "cpu.json"
    cpu.write_text(json.dumps({"dense_flops": 1e11}))
    assert not is_cluster_profile(str(cpu))
    assert is_cluster_profile("dgx-h100")


def test_a_cluster_profile_without_its_format_field_is_told_so(tmp_path):
    data = {k: v for k, v in _good().items() if k != "format"}
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(data))
    assert is_cluster_profile(str(path))
    with pytest.raises(ProfileError, match="format: must be 'rtxmpi-cluster-profile'"):
        load_cluster_profile(str(path))


def test_efficiency_curve_interpolates_log_linearly_and_holds_beyond_its_ends():
    p = parse_cluster_profile({**_good(), "collectives": {
        "intra_efficiency": [[1024, 0.2], [1024 * 1024, 0.8]]}})
    assert p.efficiency(1, False) == 0.2 and p.efficiency(2**30, False) == 0.8
    assert p.efficiency(32 * 1024, False) == pytest.approx(0.5)  # halfway in log(bytes)
    assert p.efficiency(32 * 1024, True) == 1.0  # no inter-node curve: full bandwidth
