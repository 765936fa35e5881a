"""rtxmpi.topology.discover over the real job: the same Topology on every rank, hosts and local
ranks as MPI sees them, and a measured bandwidth/latency matrix (holds at any world size)."""
import socket

import numpy as np
import pytest
from mpi4py import MPI

from rtxmpi import topology


def test_discover_agrees_with_mpi_on_every_rank(world, assert_same_on_every_rank):
    topo = topology.discover(world)
    assert topo.world_size == world.world_size
    assert topo.hosts[topo.host_of_rank[world.rank]].hostname == socket.gethostname()
    node = MPI.COMM_WORLD.Split_type(MPI.COMM_TYPE_SHARED, key=world.rank)
    assert topo.local_rank[world.rank] == node.Get_rank()
    node.Free()
    assert_same_on_every_rank(world, np.asarray(topo.host_of_rank + topo.local_rank, np.int64))
    assert_same_on_every_rank(world, np.nan_to_num(topo.bandwidth_gbps, posinf=-1))


def test_calibrated_matrix_is_measured_positive_and_shared(world, assert_same_on_every_rank):
    topo = topology.discover(world, calibrate=True, calibrate_bytes=1 << 16)
    n = world.world_size
    off = ~np.eye(n, dtype=bool)
    assert topo.measured
    assert (topo.bandwidth_gbps[off] > 0).all() and np.isfinite(topo.bandwidth_gbps[off]).all()
    assert (topo.latency_us[off] > 0).all()
    assert np.isinf(np.diag(topo.bandwidth_gbps)).all()
    assert_same_on_every_rank(world, np.nan_to_num(topo.latency_us))


def test_mesh_reports_tp_blocks_outside_an_nvlink_island(world):
    from rtxmpi.mesh import DeviceMesh
    n = world.world_size
    mesh = DeviceMesh(tp=n, group=world, topology=topology.discover(world))
    assert mesh.placement == []  # CPU ranks on one host: one island
    pcie = topology.HostTopology("pcie", gpus=[topology.GPU(i) for i in range(n)],
                                 links=[["X" if i == j else "SYS" for j in range(n)]
                                        for i in range(n)])
    fake = topology.build([pcie], [0] * n, list(range(n)), list(range(n)))
    if n > 1:
        with pytest.warns(RuntimeWarning, match="not in rank 0's NVLink island"):
            mesh = DeviceMesh(tp=n, group=world, topology=fake)
        assert len(mesh.placement) == 1
