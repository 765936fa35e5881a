"""elastic.exitreport: a 0 from mpiexec is done only when a rank process reported exit code 0."""
from rtxmpi.elastic import exitreport


def report(folder, pid, *codes):
    (folder / f"start.{pid}").write_text("")
    for code in codes:
        (folder / f"exit.{pid}").write_text(str(code))


def test_mark_writes_start_and_exit_reports(tmp_path):
    env = {exitreport.ENV: str(tmp_path)}
    exitreport.mark("start", environ=env)
    exitreport.mark("exit", 0, environ=env)
    names = sorted(p.name.split(".")[0] for p in tmp_path.iterdir())
    assert names == ["exit", "start"] and exitreport.reconcile(0, tmp_path) == (0, None)


def test_mark_without_the_variable_or_with_a_missing_folder_does_nothing(tmp_path):
    exitreport.mark("start", environ={})
    exitreport.mark("start", environ={exitreport.ENV: str(tmp_path / "gone")})
    assert list(tmp_path.iterdir()) == []


def test_zero_with_no_reports_stands(tmp_path):  # not an rtxmpi program
    assert exitreport.reconcile(0, tmp_path) == (0, None)
    assert exitreport.reconcile(0, tmp_path / "missing") == (0, None)


def test_zero_with_started_ranks_that_never_finished_is_a_failure(tmp_path):
    report(tmp_path, 11)
    report(tmp_path, 12)
    status, note = exitreport.reconcile(0, tmp_path)
    assert status == 1 and "none of the 2 rank process(es)" in note and "lost" in note


def test_zero_with_a_rank_killed_by_the_teardown_after_a_stop_is_a_failure(tmp_path):
    report(tmp_path, 11, 75)
    status, note = exitreport.reconcile(0, tmp_path)
    assert status == 1 and "['75']" in note


def test_one_survivor_that_finished_is_done(tmp_path):  # after an ULFM shrink
    report(tmp_path, 11, 0)
    report(tmp_path, 12)  # the killed rank
    assert exitreport.reconcile(0, tmp_path) == (0, None)


def test_non_zero_statuses_are_unchanged(tmp_path):
    report(tmp_path, 11, 0)
    assert exitreport.reconcile(75, tmp_path) == (75, None)
    assert exitreport.reconcile(137, tmp_path) == (137, None)


def test_finished_when_every_started_process_exited_or_was_evicted_and_one_exited_0(tmp_path):
    env = {exitreport.ENV: str(tmp_path)}
    report(tmp_path, 11, 0)
    report(tmp_path, 12)
    assert not exitreport.finished(tmp_path)  # 12 may still be running
    exitreport.mark("evicted", environ=env, pid=12)
    assert (tmp_path / "evicted.12").exists() and exitreport.finished(tmp_path)
    (tmp_path / "exit.11").write_text("1")
    assert not exitreport.finished(tmp_path)  # nobody finished the work
    assert not exitreport.finished(tmp_path / "missing")
