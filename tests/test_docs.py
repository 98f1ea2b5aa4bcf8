"""The README and docs cannot rot: every `aiayn` command they show parses with the CLI's own parser, every
relative link and image resolves, the README's quality and speed tables are what the results files hold,
and nothing speaks of how the project was made (its work periods, tracker numbers or commits)."""

import argparse
import importlib.util
import re
import shlex
from pathlib import Path

import pytest

from aiayn.cli.main import DESCRIPTION, EXAMPLES, parser

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]


def fenced(text: str) -> list[str]:
    """The shell lines of the page's code blocks (not python or output), continuations joined."""
    lines = []
    for language, body in re.findall(r"^```(\w*)\n(.*?)^```", text, re.M | re.S):
        if language not in ("", "sh", "bash", "shell", "console"):
            continue
        lines += re.sub(r"\\\n\s*", " ", body).splitlines()
    return lines


def inline(text: str) -> list[str]:
    """Inline code that is a command: `aiayn ...`."""
    return [span for span in re.findall(r"(?<!`)`([^`\n]+)`(?!`)", text) if span.startswith("aiayn ")]


def commands(line: str) -> list[list[str]]:
    """The aiayn invocations of a shell line: after `aiayn`, `python -m aiayn` or `torchrun ... -m aiayn`,
    in each part of a pipeline or list, without redirections; a process substitution is one FILE."""
    line = re.sub(r"<\([^)]*\)", "FILE", line.strip().removeprefix("$ "))
    lexer = shlex.shlex(line, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    found, part = [], []
    for token in [*lexer, ";"]:
        if token in (";", "&&", "||", "|", "&"):
            words = [
                w for i, w in enumerate(part) if not (w in "<>" or (i and part[i - 1] in ("<", ">", ">>")))
            ]
            words = [w for w in words if w not in (">>",)]
            for i, word in enumerate(words):
                if word == "aiayn" and (i == 0 or words[i - 1] == "-m" or all("=" in w for w in words[:i])):
                    found.append(words[i + 1 :])
                    break
            part = []
        else:
            part.append(token)
    return found


def commands_of(line: str) -> list[list[str]]:
    """commands(line) of a line that runs aiayn (not a comment, not prose that names it)."""
    line = line.strip().removeprefix("$ ")
    if line.startswith("#") or not re.match(r"(\S+=\S*\s+)*(aiayn|python3? -m aiayn|torchrun) ", line):
        return []
    return commands(line)


class Refused(Exception):
    pass


def check_parses(argv: list[str], monkeypatch) -> None:
    """argv parses, but for arguments it leaves out (a page may show a command without every one)."""

    def error(self, message):
        raise Refused(message)

    monkeypatch.setattr(argparse.ArgumentParser, "error", error)
    cli = parser()
    for command in [cli, *cli._subparsers._group_actions[0].choices.values()]:
        command.allow_abbrev = False  # a flag in full: a renamed --beam-size must not pass as --beam
    try:
        cli.parse_args(argv)
    except Refused as e:
        if not str(e).startswith("the following arguments are required"):
            raise AssertionError(f"aiayn {shlex.join(argv)}: {e}") from None
    except SystemExit as e:  # --help, --version
        assert e.code == 0, argv


def shown() -> list[tuple[str, list[str]]]:
    """(where, argv) of every aiayn command the README, the docs and the CLI's own help show."""
    found = []
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        found += [(page.name, argv) for line in fenced(text) + inline(text) for argv in commands_of(line)]
    for line in [*EXAMPLES.values(), *DESCRIPTION.splitlines()]:
        found += [("aiayn --help", argv) for argv in commands_of(line)]
    return found


def test_every_command_shown_parses(monkeypatch):
    found = shown()
    assert len(found) > 40  # the README, the docs and the examples of every command
    for where, argv in found:
        try:
            check_parses(argv, monkeypatch)
        except AssertionError as e:
            raise AssertionError(f"{where}: {e}") from None


@pytest.mark.parametrize(
    ("line", "refused"),
    [
        ("aiayn translate runs/m --beam 4", "unrecognized arguments: --beam"),
        ("aiayn export runs/m --format onnx2 --out x", "invalid choice: 'onnx2'"),
        ("aiayn trian --train data/x", "invalid choice: 'trian'"),
    ],
)
def test_a_renamed_flag_or_choice_fails_the_check(monkeypatch, line, refused):
    (argv,) = commands(line)
    with pytest.raises(AssertionError, match=re.escape(refused)):
        check_parses(argv, monkeypatch)


def test_the_lines_are_found_as_a_shell_reads_them():
    line = "AIAYN_X=1 aiayn evaluate m --src <(head -3 a.de) --ref b.en > out.json && aiayn score a b | head"
    assert commands(line) == [["evaluate", "m", "--src", "FILE", "--ref", "b.en"], ["score", "a", "b"]]
    assert commands("torchrun --standalone --nproc-per-node 2 -m aiayn train --data d  # a comment") == [
        ["train", "--data", "d"]
    ]
    assert commands("pip install aiayn") == []


def links(text: str) -> list[str]:
    return re.findall(r"!?\[[^\]]*\]\(([^)\s]+)[^)]*\)", text) + re.findall(r'<img[^>]* src="([^"]+)"', text)


def test_every_relative_link_and_image_resolves():
    checked = 0
    for page in PAGES:
        for target in links(page.read_text(encoding="utf-8")):
            if re.match(r"[a-z]+:", target) or target.startswith("#"):
                continue
            path = (page.parent / target.split("#")[0]).resolve()
            assert path.exists(), f"{page.relative_to(ROOT)}: {target} does not exist"
            checked += 1
    assert checked > 10


def test_the_tables_of_figures_are_the_results_files():
    """The README's quality, speed and cold-start tables, performance.md's and results.md's are what
    benchmarks/tables.py renders from the results files: a figure changed by hand, or a results file
    re-measured without rendering, fails here."""
    spec = importlib.util.spec_from_file_location("tables", ROOT / "benchmarks" / "tables.py")
    tables = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tables)
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert tables.rendered(readme) == readme, "README.md's tables differ: python benchmarks/tables.py"
    edited = readme.replace("| de → en | ", "| de → en | 1", 1)
    assert tables.rendered(edited) == readme
    for page in (ROOT / "docs" / "performance.md", ROOT / "docs" / "results.md"):
        text = page.read_text(encoding="utf-8")
        assert tables.rendered(text, page) == text, (
            f"{page.name}'s tables differ: python benchmarks/tables.py"
        )


# How the project was made is for git log, not for its files.
FORBIDDEN = re.compile(
    r"\b(?:this|that|a|the|previous|next|earlier|later|last|each|every|work)\s+(?:session|work period)s?\b"
    r"|(?<![\w/])issues?\b|(?<![\w/&])#\d{1,4}\b|\bcommit\s+`?[0-9a-f]{7,40}\b",  # (an issues/ URL is fine)
    re.I,
)


def test_nothing_names_a_session_an_issue_or_a_commit():
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md"] + [
        path
        for folder in ("docs", "aiayn", "benchmarks", "tests")
        for path in sorted((ROOT / folder).rglob("*"))
        if path.suffix in (".md", ".py", ".sh", ".json", ".html", ".js") and ".venv" not in path.parts
    ]
    found = [
        f"{path.relative_to(ROOT)}:{n}: {line.strip()}"
        for path in files
        if path.is_file()
        for n, line in enumerate(path.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
        if FORBIDDEN.search(line) and path.name != "test_docs.py"
    ]
    assert not found, "\n".join(found)


def test_the_readme_reads_in_five_minutes():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) <= 250
