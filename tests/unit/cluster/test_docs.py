"""The README and docs/ against the code: every `splitserve ...` command they show parses
with the CLI's own parser, every flag they name on a command exists, their links stay
inside the repository, and the generated results (docs/benchmarks.md, the README's
headline table) match the JSON results they are rendered from."""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
from pathlib import Path

import pytest

from bench import results_page, results_rows
from cluster.cli import build_parser

ROOT = Path(__file__).resolve().parents[3]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
ENV_ASSIGNMENT = re.compile(r"^[A-Z_][A-Z0-9_]*=\S*$")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def code_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, argv after `splitserve`) for each command line in a fenced code
    block: continuation lines joined, comments, leading environment assignments and a
    trailing `&` dropped."""
    out: list[tuple[int, list[str]]] = []
    in_code, pending, start = False, "", 0
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code, pending = not in_code, ""
            continue
        if not in_code:
            continue
        if not pending:
            start = n
        if line.rstrip().endswith("\\"):
            pending += line.rstrip()[:-1] + " "
            continue
        text, pending = pending + line, ""
        try:
            words = shlex.split(text, comments=True)
        except ValueError:
            continue
        while words and ENV_ASSIGNMENT.match(words[0]):
            words = words[1:]
        if words[-1:] == ["&"]:
            words = words[:-1]
        if words[:1] == ["splitserve"]:
            out.append((start, words[1:]))
    return out


def inline_commands(path: Path) -> list[tuple[int, list[str]]]:
    """(line number, words after `splitserve`) for each `splitserve ...` code span in
    prose (`|` alternatives and placeholders allowed: only its flags are checked)."""
    out: list[tuple[int, list[str]]] = []
    in_code = False
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if line.lstrip().startswith("```"):
            in_code = not in_code
            continue
        if in_code:
            continue
        for span in re.findall(r"`(splitserve [^`]+)`", line):
            out.append((n, span.split()[1:]))
    return out


def _subparser(argv: list[str]) -> tuple[argparse.ArgumentParser, list[str]]:
    """The deepest subcommand's parser `argv` names, and the words after its path."""
    parser = build_parser(argv)
    words = list(argv)
    while words:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not subs or words[0] not in subs[0].choices:
            break
        parser = subs[0].choices[words.pop(0)]
    return parser, words


def _ids(cases: list[tuple[Path, int, list[str]]]) -> list[str]:
    return [f"{_rel(p)}:{n}" for p, n, _ in cases]


CODE = [(p, n, argv) for p in DOCS for n, argv in code_commands(p)]
INLINE = [(p, n, words) for p in DOCS for n, words in inline_commands(p)]


def test_the_docs_show_commands() -> None:
    # the README's own: a cluster on GPUs and a model over several; operations.md's: a
    # worker and the gateway by hand
    readme = {tuple(argv[:1]) for _, argv in code_commands(ROOT / "README.md")}
    assert {("up",), ("generate",)} <= readme, readme
    ops = {tuple(argv[:1]) for _, argv in code_commands(ROOT / "docs" / "operations.md")}
    assert {("worker",), ("gateway",)} <= ops, ops
    assert len(CODE) >= 20 and len(INLINE) >= 10, (len(CODE), len(INLINE))


@pytest.mark.parametrize(("path", "line", "argv"), CODE, ids=_ids(CODE))
def test_a_command_in_a_code_block_parses(path: Path, line: int, argv: list[str]) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            build_parser(argv).parse_args(argv)
        except SystemExit as e:
            pytest.fail(f"{_rel(path)}:{line}: `splitserve {' '.join(argv)}` does not "
                        f"parse (exit {e.code}): {err.getvalue().strip()}")


@pytest.mark.parametrize(("path", "line", "words"), INLINE, ids=_ids(INLINE))
def test_a_command_in_prose_names_flags_that_exist(path: Path, line: int,
                                                   words: list[str]) -> None:
    parser, rest = _subparser(words)
    if parser.prog == "splitserve":
        # a bare `splitserve` (or `splitserve <command>`) names no command's flags
        assert not rest or rest[0].startswith("<") or rest[0] in ("...",), (
            f"{_rel(path)}:{line}: no command `splitserve {' '.join(words)}`")
        return
    known = {s for a in parser._actions for s in a.option_strings}
    flags = [w.split("=")[0] for w in rest if w.startswith("--")]
    unknown = [f for f in flags if f not in known]
    assert not unknown, (f"{_rel(path)}:{line}: `{parser.prog}` has no {unknown}")


def test_links_stay_inside_the_repository() -> None:
    for path in DOCS:
        text = path.read_text()
        assert "../shared" not in text and "/work/" not in text, _rel(path)
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            assert not re.match(r"[a-z]+://", target), f"{_rel(path)}: links out: {target}"
            resolved = (path.parent / target.split("#")[0]).resolve()
            assert resolved.is_relative_to(ROOT), f"{_rel(path)}: {target} leaves the repo"
            assert resolved.exists(), f"{_rel(path)}: {target} does not exist"


def test_no_chronicle_in_the_docs() -> None:
    """Documentation states what is; the history of how it came to be is in git."""
    pattern = re.compile(r"\b(\w+(st|nd|rd|th) (session|round)|session \d+|round \d+)\b", re.I)
    for path in DOCS:
        found = pattern.findall(path.read_text())
        assert not found, f"{_rel(path)}: {[f[0] for f in found]}"


def test_the_readme_is_short_and_has_one_results_table() -> None:
    text = (ROOT / "README.md").read_text()
    assert len(text.encode()) <= 12 * 1024
    assert "make run" in text and "make test" in text
    assert text.count(results_rows.HEADLINE_BEGIN) == 1


def test_the_generated_results_are_up_to_date(capsys: pytest.CaptureFixture[str]) -> None:
    rc = results_page.main(["--docs", str(ROOT / "docs"), "--check"])
    assert rc == 0, capsys.readouterr().err
