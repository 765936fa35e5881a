"""calibrate times all_reduce, all_gather and reduce_scatter through rtxmpi sub-groups (the
paths training runs), without checking mode's fingerprint exchange: a profile calibrated under
RTXMPI_CHECK=1 (the test suite, a debugging run) must not carry that exchange's latency."""
import numpy as np

from rtxmpi.comm import mpi as mpi_backend
from rtxmpi.parallel.calibrate import _measure_op, _subgroup


def test_calibration_groups_time_the_transport_not_the_checks(world, monkeypatch):
    assert world.check
    comm = world.backend.comm.Dup()
    try:
        sub, group = _subgroup(world, comm, 0, world.rank)
        calls = []
        real = mpi_backend.MPIBackend.exchange_fingerprints

        def counted(self, *args, **kwargs):
            calls.append(args[1] if len(args) > 1 else kwargs.get("op"))
            return real(self, *args, **kwargs)
        monkeypatch.setattr(mpi_backend.MPIBackend, "exchange_fingerprints", counted)
        for op in ("all_reduce", "all_gather", "reduce_scatter"):
            points = _measure_op(sub, op, [4096], 1, group)
            assert len(points) == 1 and points[0][1] > 0
        assert calls == []
        assert group.world_size == world.world_size and sub is group.backend.comm
        x = np.full(8, world.rank + 1.0, np.float32)
        group.all_reduce(x)  # the sub-group still reduces over every rank
        assert np.all(x == world.world_size * (world.world_size + 1) / 2)
    finally:
        comm.Free()
