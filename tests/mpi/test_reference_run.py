"""calibrate.ReferenceRun over the real job: the k-rank reference runs are the mean over the
balanced subsets of local ranks (not one fixed subset, whose time depends on where the scheduler
put those ranks), the same numbers on every rank (holds at any world size)."""
import time

import numpy as np
from mpi4py import MPI

from rtxmpi.nn.gpt import GPTConfig
from rtxmpi.parallel.calibrate import ReferenceRun, balanced_subsets


def test_each_round_is_the_mean_over_the_balanced_subsets(world, assert_same_on_every_rank):
    comm = MPI.COMM_WORLD
    ref = ReferenceRun(world, GPTConfig.named("tiny", seq_len=16), 1)
    R = ref.ranks_per_node
    calls = []

    def step():  # a rank-dependent wall time: local rank i "computes" 50 (i + 1) ms
        calls.append(1)
        time.sleep(0.05 * (ref.local_rank + 1))
    ref._step = step
    samples = ref.sample(1)
    assert sorted(samples) == ref.ks == sorted({1, (R + 1) // 2, R})
    nodes = comm.Get_size() // R
    for k in ref.ks:
        subsets = balanced_subsets(R, k)
        want = np.mean([np.mean([0.05 * (i + 1) for i in s]) for s in subsets])
        # a sleep never undershoots (the subset (0, 1) alone would be 25 ms low at R = 4, k = 2);
        # it overshoots by a few ms, more on a loaded machine
        assert len(samples[k]) == 1 and want - 1e-3 <= samples[k][0] <= want + 0.04, \
            (k, subsets, samples[k])
        assert len(ref.cpu[k]) == 1 and 0 <= ref.cpu[k][0] < samples[k][0]
    # local rank 0 computes in every subset, the others in the subsets that name them
    mine = sum(1 for k in ref.ks for s in balanced_subsets(R, k) if ref.local_rank in s)
    assert len(calls) == mine
    assert_same_on_every_rank(world, np.array([samples[k][0] for k in ref.ks]))
    assert nodes >= 1
    if R == 4:
        assert balanced_subsets(4, 2) == [(0, 1), (0, 2), (0, 3)]
