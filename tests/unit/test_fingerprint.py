"""The (count, code) fingerprint of a collective call (rtxmpi/comm/fingerprint.py), in one process."""
import numpy as np
import pytest

from rtxmpi.comm import fingerprint


def test_fingerprints_differ_for_every_kind_of_mismatch():
    x32, x64 = np.ones(4, np.float32), np.ones(4, np.float64)
    calls = [fingerprint.of("all_reduce", x32, fingerprint.REDUCE_CODES["sum"]),
             fingerprint.of("all_reduce", x32, fingerprint.REDUCE_CODES["avg"]),
             fingerprint.of("all_reduce", x64, fingerprint.REDUCE_CODES["sum"]),
             fingerprint.of("all_reduce", np.ones(5, np.float32), fingerprint.REDUCE_CODES["sum"]),
             fingerprint.of("broadcast", x32, 0), fingerprint.of("broadcast", x32, 1),
             fingerprint.of("all_gather", x32), fingerprint.of("barrier")]
    assert len(set(calls)) == len(calls)
    assert fingerprint.of("all_gather", x32) == fingerprint.of("all_gather", np.zeros((2, 2), np.float32))


def test_describe_names_each_rank_call_without_the_poison_mark():
    table = [fingerprint.of("all_reduce", np.ones(4, np.float32), fingerprint.REDUCE_CODES["max"]),
             fingerprint.of("broadcast", np.ones(5, np.float64), 3)]
    table[1] = (table[1][0], table[1][1] | fingerprint.POISON)
    text = fingerprint.describe("all_reduce", 7, "world", table)
    assert text == ("CollectiveMismatch in all_reduce #7 on group 'world': ranks called it "
                    "differently: rank 0: all_reduce(count=4, dtype=float32, op=max); "
                    "rank 1: broadcast(count=5, dtype=float64, src=3)")


@pytest.mark.parametrize("counts", [None, [2, 2], [3, 1]])
def test_reduce_scatter_counts_are_part_of_the_code(counts):
    arg = fingerprint.REDUCE_CODES["sum"] + fingerprint.ARG_SHIFT * fingerprint.counts_crc(counts)
    row = fingerprint.describe_row(*fingerprint.of("reduce_scatter", np.ones(4, np.int32), arg))
    assert row.startswith("reduce_scatter(count=4, dtype=int32, op=sum, counts")
    assert ("counts=None" in row) == (counts is None)


def test_send_and_recv_agree_on_count_and_dtype_only():
    x = np.ones(3, np.int64)
    assert fingerprint.same_data(fingerprint.of("send", x), fingerprint.of("recv", x))
    assert not fingerprint.same_data(fingerprint.of("send", x), fingerprint.of("recv", x[:2]))
    assert not fingerprint.same_data(fingerprint.of("send", x),
                                     fingerprint.of("recv", x.astype(np.float64)))
