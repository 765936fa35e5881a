"""The `rtxmpi` command in this process (rtxmpi.cli.main): bad integer flags, a closed stdout,
the --help summary, counts worded in the singular, and examples/train.py's printable sample."""
import importlib.util
import io
import os
import sys
from pathlib import Path

import pytest

from rtxmpi import cli

REPO = Path(__file__).resolve().parents[2]


def run(capsys, *argv):
    """(exit status, stdout, stderr) of `rtxmpi ARGV`."""
    try:
        code = cli.main(list(argv))
    except SystemExit as exc:  # argparse's own errors
        code = exc.code
    out = capsys.readouterr()
    return code, out.out, out.err


@pytest.mark.parametrize("value", ["0", "-2"])
def test_plan_world_size_below_one_is_a_bad_flag(capsys, value):
    code, out, err = run(capsys, "plan", "--model", "tiny", "--world-size", value)
    assert code == 2 and out == ""
    assert f"error: --world-size must be >= 1, got {value}" in err


@pytest.mark.parametrize("argv, message", [
    (["info", "--timeout-s", "0"], "--timeout-s must be > 0 seconds, got 0.0"),
    (["ckpt", "verify", "DIR", "--step", "-1"], "--step must be >= 0, got -1"),
    (["ckpt", "inspect", "DIR", "--step", "-3"], "--step must be >= 0, got -3"),
])
def test_other_bad_integer_flags_exit_2(capsys, tmp_path, argv, message):
    code, out, err = run(capsys, *[str(tmp_path) if a == "DIR" else a for a in argv])
    assert code == 2 and out == "" and f"error: {message}" in err


def test_plan_words_counts_and_drops_the_hint_when_rejections_are_shown(capsys):
    code, out, _ = run(capsys, "plan", "--model", "tiny", "--world-size", "1",
                       "--global-batch", "4")
    assert code == 0
    assert "world size 1, 1 rank per node," in out
    assert "candidates rejected (" in out and "; --show-rejected lists them)." in out
    code, out, _ = run(capsys, "plan", "--model", "tiny", "--world-size", "4", "--show-rejected")
    assert code == 0 and "4 ranks per node" in out
    assert "candidates rejected (" in out and "--show-rejected lists them" not in out


class _ClosedPipe(io.TextIOBase):
    """A stdout whose reader has gone (`| head`): every write raises BrokenPipeError."""

    def __init__(self, fd):
        self.fd = fd

    def write(self, text):
        raise BrokenPipeError(32, "Broken pipe")

    def fileno(self):
        return self.fd


def test_a_closed_stdout_ends_quietly_with_141(tmp_path, monkeypatch, capsys):
    fd = os.open(tmp_path / "stdout", os.O_WRONLY | os.O_CREAT)
    try:
        monkeypatch.setattr(sys, "stdout", _ClosedPipe(fd))
        assert cli.main(["plan", "--model", "tiny", "--world-size", "2"]) == cli.EXIT_BROKEN_PIPE
    finally:
        os.close(fd)
    assert capsys.readouterr().err == ""  # no traceback


def test_help_summary_lists_every_subcommand(capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    sub = next(a for a in cli.build_parser()._actions if a.dest == "command")
    assert set(sub.choices) == {"info", "ckpt", "run", "join", "plan", "report", "bench"}
    for name in sub.choices:
        assert f"rtxmpi {name} " in out, name


def _train_module():
    spec = importlib.util.spec_from_file_location("train_for_cli", REPO / "examples" / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_train_counts_and_printable_sample():
    from rtxmpi.data import decode
    from rtxmpi.train.metrics import count

    train = _train_module()
    assert count(1, "step") == "1 step" and count(3, "step") == "3 steps"
    assert count(1, "loss") == "1 loss" and count(0, "loss") == "0 losses"
    assert count(1, "parameter digest") == "1 parameter digest"

    raw = [ord(c) for c in "ab\n\t"] + [0x1B, ord("["), 0x00, 0xC3, 0xA9, 0xFF, ord("z")]
    text = train.printable(decode(raw))
    assert text == "ab\n\t\ufffd[\ufffd\u00e9\ufffdz"
    text.encode("utf-8")  # valid text: encodes without error
