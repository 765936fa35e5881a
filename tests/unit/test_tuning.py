"""rtxmpi.comm.tuning.OnlineChoice: explore both algorithms, use the faster, recheck the other."""
import pytest

from rtxmpi.comm import tuning


def run(choice, nbytes, seconds, calls):
    """`calls` calls of `nbytes`, algorithm a taking seconds[a]; returns the algorithms run."""
    ran = []
    for _ in range(calls):
        a = choice.pick(nbytes)
        choice.record(nbytes, a, seconds[a])
        ran.append(a)
    return ran


@pytest.mark.parametrize("faster", [0, 1])
def test_explores_both_then_uses_the_faster(faster):
    choice = tuning.OnlineChoice()
    seconds = {faster: 1e-3, 1 - faster: 3e-3}
    ran = run(choice, 1 << 20, seconds, 2 * tuning.TRIALS)
    assert ran.count(0) == ran.count(1) == tuning.TRIALS  # alternating while exploring
    assert choice.chosen(1 << 20) == faster
    ran = run(choice, 1 << 20, seconds, tuning.RECHECK)
    assert ran == [faster] * tuning.RECHECK


def test_size_classes_choose_separately():
    """Byte counts of the same bit length share a class; 1 MiB and 16 MiB do not."""
    choice = tuning.OnlineChoice()
    run(choice, 1 << 20, {0: 1.0, 1: 2.0}, 2 * tuning.TRIALS)
    run(choice, (1 << 21) - 1, {0: 1.0, 1: 2.0}, 0)
    assert choice.chosen((1 << 21) - 1) == 0  # [1 MiB, 2 MiB): the same class
    assert choice.chosen(16 << 20) is None
    run(choice, 16 << 20, {0: 2.0, 1: 1.0}, 2 * tuning.TRIALS)
    assert (choice.chosen(1 << 20), choice.chosen(16 << 20)) == (0, 1)


def test_a_losing_recheck_doubles_the_interval():
    choice = tuning.OnlineChoice()
    seconds = {0: 1.0, 1: 2.0}
    run(choice, 4096, seconds, 2 * tuning.TRIALS)
    ran = run(choice, 4096, seconds, tuning.RECHECK + 1)
    assert ran == [0] * tuning.RECHECK + [1]  # the check of the other, after RECHECK calls
    ran = run(choice, 4096, seconds, 2 * tuning.RECHECK + 1)
    assert ran == [0] * (2 * tuning.RECHECK) + [1]
    run(choice, 4096, seconds, 100_000)
    ran = run(choice, 4096, seconds, tuning.MAX_RECHECK + 1)
    assert ran.count(1) == 1  # the interval stops at MAX_RECHECK


def test_a_regime_change_is_found_at_the_next_check():
    """The chosen algorithm becomes 3x slower (say, the host moved two vCPUs onto one core): the
    next check of the other beats it, the class explores again and switches."""
    choice = tuning.OnlineChoice()
    run(choice, 1 << 16, {0: 1.0, 1: 2.0}, 2 * tuning.TRIALS)
    assert choice.chosen(1 << 16) == 0
    run(choice, 1 << 16, {0: 6.0, 1: 2.0}, tuning.RECHECK + 1 + 2 * tuning.TRIALS)
    assert choice.chosen(1 << 16) == 1


def test_equal_algorithms_do_not_trade_places_on_noise():
    """A check within MARGIN of the chosen median keeps the choice (no exploration: the
    interval doubles)."""
    choice = tuning.OnlineChoice()
    run(choice, 1 << 16, {0: 1.0, 1: 1.01}, 2 * tuning.TRIALS)
    run(choice, 1 << 16, {0: 1.0, 1: 0.95}, 10 * tuning.RECHECK)
    assert choice.chosen(1 << 16) == 0
