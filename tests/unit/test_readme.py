"""The README stays short and true: its diff is the examples' diff, its links resolve, its
commands start on two cores, and each headline number is in the RESULTS.md section it links to."""
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text()


def section(text, title):
    start = text.index("\n## " + title)
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def github_anchor(title):
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", title.strip().lower()).replace(" ", "-")


def test_readme_is_short():
    assert len(README.splitlines()) < 200


def test_one_process_to_many_diff_is_the_examples_diff():
    block = re.search(r"```diff\n(.*?)```", section(README, "From one process to many"), re.S).group(1)
    single, dp = [], []
    for line in block.splitlines():
        mark, body = line[:1], line[1:]
        if mark in (" ", ""):
            single.append(body)
            dp.append(body)
        elif mark == "-":
            single.append(body)
        elif mark == "+":
            dp.append(body)
    assert single == (REPO / "examples/loop_single.py").read_text().splitlines()
    assert dp == (REPO / "examples/loop_dp.py").read_text().splitlines()


def test_links_resolve():
    for target in re.findall(r"\]\(([^)\s]+)\)", README):
        if "://" in target:
            continue
        path, _, anchor = target.partition("#")
        assert (REPO / path).is_file(), target
        if anchor:
            titles = re.findall(r"^#+ (.+)$", (REPO / path).read_text(), re.M)
            assert anchor in [github_anchor(t) for t in titles], target


def test_commands_start_on_two_cores():
    """More ranks than two cores needs --oversubscribe (else Open MPI: "not enough slots")."""
    blocks = "\n".join(re.findall(r"```bash\n(.*?)```", README, re.S))
    commands = re.sub(r"\\\n\s*", " ", blocks).splitlines()
    for command in commands:
        found = re.search(r"mpiexec\b.*?-n (\d+)", command)
        if found and int(found.group(1)) > 2:
            assert "--oversubscribe" in command, command


def test_headline_numbers_are_in_results():
    """Every number in a headline row appears in the RESULTS.md section the row links to."""
    rows = re.search(r"<!-- headline begin -->\n(.*?)<!-- headline end -->", README, re.S).group(1)
    rows = [r for r in rows.splitlines() if "](bench/RESULTS.md#" in r]
    assert len(rows) >= 5
    results = (REPO / "bench/RESULTS.md").read_text()
    sections = {github_anchor(t): body for t, body in
                re.findall(r"^## ([^\n]+)\n(.*?)(?=^## |\Z)", results, re.M | re.S)}
    for row in rows:
        anchor = re.search(r"\]\(bench/RESULTS\.md#([^)]+)\)", row).group(1)
        text = re.sub(r"\[[^\]]*\]\([^)]*\)", "", row)
        numbers = re.findall(r"\d+(?:\.\d+)?", text)
        assert numbers, row
        for number in numbers:
            assert re.search(r"(?<![\d.])" + re.escape(number) + r"(?![\d])", sections[anchor]), \
                (number, anchor)


def test_results_is_short():
    assert len((REPO / "bench/RESULTS.md").read_text().splitlines()) < 500
