"""The join request protocol (rtxmpi.elastic.admit): what `rtxmpi join` writes, what a job accepts
as untrusted input, and the client's answers, exit codes and messages."""
import json
import os
import re
import socket
import threading
import time

import pytest

from rtxmpi import cli
from rtxmpi.elastic import admit
from rtxmpi.errors import ConfigError


def request(**fields):
    # made when the tests are collected: a deadline far enough ahead for a long test session
    body = {"version": 1, "id": 7, "ranks": 2, "deadline_unix": time.time() + 3600, **fields}
    return json.dumps(body).encode()


def running_job(folder, pid=None):
    """A checkpoint directory whose lock names a live process of this host, as a job's does."""
    holder = {"job_id": "", "host": socket.gethostname(), "pid": pid or os.getpid(),
              "start_unix": time.time(), "attempt": [0, 0]}
    (folder / "rtxmpi.lock").write_text(json.dumps(holder))
    return folder


def test_a_valid_request_is_its_id_and_ranks():
    assert admit.parse_request(request(), world_size=2, limit=8) == (7, 2)


@pytest.mark.parametrize("raw, why", [
    (b"\xff\x00garbage", "not a JSON object"),
    (b"[1, 2]", "not a JSON object"),
    (request(id="x"), "id"),
    (request(id=True), "id"),
    (request(version=2), "version"),
    (request(ranks=0), "ranks 0"),
    (request(ranks=-3), "ranks -3"),
    (request(ranks=True), "ranks True"),
    (request(ranks="2"), "ranks '2'"),
    (request(ranks=2.0), "ranks 2.0"),
    (request(ranks=10**9), "ranks 1000000000"),
    (request(deadline_unix=None), "deadline"),
    (request(deadline_unix=time.time() - 30), "expired"),
    (request(ranks=7), "2 + 7 ranks is over this job's limit of 8"),
    (b"{" + b" " * admit.REQUEST_BYTES + b"}", "longer than"),
])
def test_a_bad_request_is_refused_with_its_reason(raw, why):
    with pytest.raises(ConfigError, match=re.escape(why)) as exc:
        admit.parse_request(raw, world_size=2, limit=8)
    # the answer names the request when its id could be read
    unnamed = why in ("not a JSON object", "id", "longer than")
    assert exc.value.request_id == (None if unnamed else 7)


def test_write_and_take_a_request(tmp_path):
    ident = admit.write_request(tmp_path, 3, timeout_s=60)
    with pytest.raises(ConfigError, match="already pending"):
        admit.write_request(tmp_path, 1, timeout_s=60)
    assert [p.name for p in tmp_path.iterdir()] == [admit.REQUEST]  # no temp file left
    raw = admit.take_request(tmp_path)
    assert admit.parse_request(raw, world_size=2, limit=8) == (ident, 3)
    assert admit.take_request(tmp_path) is None  # taken: removed


@pytest.mark.parametrize("ranks", [0, -1, admit.MAX_RANKS + 1, True, 2.5])
def test_the_client_refuses_bad_ranks_before_writing(tmp_path, ranks):
    with pytest.raises(ConfigError, match="-n must be a number of ranks"):
        admit.write_request(tmp_path, ranks, timeout_s=60)
    assert not (tmp_path / admit.REQUEST).exists()


def test_a_link_in_place_of_the_request_is_not_followed(tmp_path):
    secret = tmp_path / "secret"
    secret.write_text(request().decode())
    os.symlink(secret, tmp_path / admit.REQUEST)
    raw = admit.take_request(tmp_path)
    with pytest.raises(ConfigError, match="not a JSON object"):
        admit.parse_request(raw, world_size=2, limit=8)
    assert secret.exists() and not os.path.lexists(tmp_path / admit.REQUEST)


def test_a_directory_or_a_fifo_in_place_of_the_request_is_refused_once(tmp_path):
    os.mkfifo(tmp_path / admit.REQUEST)
    with pytest.raises(ConfigError, match="not a JSON object"):
        admit.parse_request(admit.take_request(tmp_path), world_size=2, limit=8)
    assert not os.path.lexists(tmp_path / admit.REQUEST)
    (tmp_path / admit.REQUEST).mkdir()
    with pytest.raises(ConfigError, match="not a JSON object"):
        admit.parse_request(admit.take_request(tmp_path), world_size=2, limit=8)
    assert admit.take_request(tmp_path) is None  # not answered again at every step


def test_no_job_at_the_directory(tmp_path):
    with pytest.raises(ConfigError, match="not a directory"):
        admit.job_holder(tmp_path / "missing")
    with pytest.raises(ConfigError, match="checkpoint lock is not held"):
        admit.job_holder(tmp_path)
    (tmp_path / "rtxmpi.lock").write_text("")  # released by a job that ended
    with pytest.raises(ConfigError, match="checkpoint lock is not held"):
        admit.job_holder(tmp_path)
    gone = os.fork()
    if gone == 0:
        os._exit(0)
    os.waitpid(gone, 0)
    running_job(tmp_path, pid=gone)
    with pytest.raises(ConfigError, match="is gone"):
        admit.job_holder(tmp_path)
    running_job(tmp_path)
    assert f"pid {os.getpid()}" in admit.job_holder(tmp_path)


def fake_job(folder, answer, delay_s=0.2):
    """A thread that takes the request like rank 0 and answers `answer(id, ranks)`."""
    def serve():
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            raw = admit.take_request(folder)
            if raw is not None:
                ident, ranks = admit.parse_request(raw, world_size=2, limit=8)
                time.sleep(delay_s)
                admit.write_answer(folder, ident, **answer(ranks))
                return
            time.sleep(0.01)
    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    return thread


def test_the_client_reports_an_admission(tmp_path, capsys):
    running_job(tmp_path)
    job = fake_job(tmp_path, lambda k: dict(admitted=True, step=5, old_world_size=2, world_size=2 + k))
    assert cli.main(["join", "--job", str(tmp_path), "-n", "2"]) == 0
    job.join()
    err = capsys.readouterr().err
    assert "admitted 2 ranks: the world grew 2 -> 4 ranks, continuing from step 5" in err
    assert not (tmp_path / admit.ANSWER).exists()  # consumed


def test_the_client_reports_a_refusal(tmp_path, capsys):
    running_job(tmp_path)
    job = fake_job(tmp_path, lambda k: dict(admitted=False, reason="no free slot (spawn failed)"))
    assert cli.main(["join", "--job", str(tmp_path), "-n", "2"]) == 1
    job.join()
    assert "refused: no free slot (spawn failed)" in capsys.readouterr().err


def test_a_job_that_does_not_answer_ends_the_client_with_an_error(tmp_path, capsys):
    running_job(tmp_path)
    assert cli.main(["join", "--job", str(tmp_path), "-n", "1", "--timeout-s", "0.3"]) == 1
    err = capsys.readouterr().err
    assert "did not take the request within 0.3 s (withdrawn)" in err and "Traceback" not in err
    assert not (tmp_path / admit.REQUEST).exists()


@pytest.mark.parametrize("argv, why", [
    (["-n", "2"], "no job running at"),
    (["-n", "0"], "-n must be a number of ranks"),
    (["-n", "2", "--timeout-s", "0"], "--timeout-s must be > 0"),
])
def test_bad_arguments_or_no_job_exit_2_without_a_traceback(tmp_path, capsys, argv, why):
    assert cli.main(["join", "--job", str(tmp_path), *argv]) == 2
    err = capsys.readouterr().err
    assert why in err and "Traceback" not in err
    assert not (tmp_path / admit.REQUEST).exists()


@pytest.mark.parametrize("policy, ranks, why", [
    ("shrink", 1, "this job runs with --elastic shrink; joining needs --elastic grow"),
    ("grow", 3, "1 + 3 ranks is over this job's limit of 2"),
])
def test_a_one_process_job_refuses_at_its_step_boundary_and_goes_on(tmp_path, capsys, policy, ranks, why):
    """fit() in one process: rank 0 takes the request at step 1's boundary, answers it (refused:
    the policy, or over max_ranks) and trains on; TrainConfig checks max_ranks."""
    pytest.importorskip("sklearn")
    from test_train_loop import Digits

    from rtxmpi.train import TrainConfig, fit

    ckpt = tmp_path / "ck"
    ckpt.mkdir()
    ident = admit.write_request(ckpt, ranks, timeout_s=60)
    record = fit(Digits(), TrainConfig(steps=2, global_batch=16, ckpt_dir=str(ckpt), progress=False,
                                       elastic=policy, max_ranks=2))
    assert record["step"] == 2
    answer = admit.read_answer(ckpt, ident)
    assert answer is not None and not answer["admitted"] and why in answer["reason"], answer
    assert f"elastic: join request refused: {why}" in capsys.readouterr().err
    assert not (ckpt / admit.REQUEST).exists()
    with pytest.raises(ConfigError, match="max_ranks 1 must be an int >= world_size 2"):
        TrainConfig(max_ranks=1).validate(2)
