"""Every fenced block of README.md and docs/*.md runs as a reader would run it.

Each page runs in a copy of one prepared folder (docs_fixtures.py: a small sentence encoder, its calibration and
held-out text and shards, a tiny image detector with images, a tiny language model with its token shards). Blocks run
in page order, sharing the folder and one Python namespace, so a page's later block may use what an earlier one
wrote. What the comment line just above a fence says decides how it runs:

- none: ``bash`` blocks are ``nmdeploy ...`` commands called in-process through ``nmdeploy.cli.main`` and must exit
  0 (``<!-- exits 1 -->``: 1); a ``# ends WORD`` comment on a command line must match the start of its last output
  line; ``python`` blocks are exec'd; ``toml`` blocks are parsed;
- ``<!-- file: PATH -->``: the block is written to PATH (a module, a config) for later blocks to use;
- ``<!-- not run: REASON -->``: the block needs what this machine lacks (TensorRT and a GPU, torchrun, a network);
  its ``nmdeploy`` commands are parsed by the real parser, its ``python -m`` modules must exist, and nothing runs.

The synopses in prose (`nmdeploy VERB ... [--flag]`) are checked too: every flag they name is one the verb takes.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import shlex
import shutil
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path

import pytest
from docs_fixtures import prepare_folder

from nmdeploy.cli import main

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SLOW_PAGES = {"pipeline.md", "guide-training.md", "python-training.md", "train.md", "export.md"}
SHELL = {"bash", "sh", "shell", "console"}
FENCE = re.compile(r"^```([\w+-]*)\n(.*?)^```\n", re.M | re.S)
MARKER = re.compile(r"<!--\s*(not run|file|exits)\s*:?\s*(.*?)\s*-->\s*\Z")

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@dataclass(frozen=True)
class Block:
    page: Path
    line: int
    language: str
    code: str
    marker: str = ""  # "not run", "file", "exits" or ""
    argument: str = ""

    def where(self) -> str:
        return f"{self.page.relative_to(ROOT)}:{self.line}"


def blocks(page: Path) -> list[Block]:
    text = page.read_text(encoding="utf-8")
    found = []
    for match in FENCE.finditer(text):
        before = text[: match.start()].rstrip("\n").rsplit("\n", 1)[-1]
        marker = MARKER.search(before)
        line = text.count("\n", 0, match.start()) + 1
        kind, argument = (marker.group(1), marker.group(2)) if marker else ("", "")
        found.append(Block(page, line, match.group(1), match.group(2), kind, argument))
    return found


def command_lines(code: str) -> list[tuple[list[str], str]]:
    """(argv, the comment) per command, backslash continuations joined; ``a && b`` is two commands."""
    commands = []
    for line in code.replace("\\\n", " ").splitlines():
        body, _, comment = line.partition(" #")
        if not body.strip() or body.lstrip().startswith("#"):
            continue
        for part in body.split("&&"):
            commands.append((shlex.split(part), comment))
    return commands


def nmdeploy_argv(argv: list[str]) -> list[str] | None:
    if argv and Path(argv[0]).name == "nmdeploy":
        return argv[1:]
    return None


def check_parses(block: Block) -> None:
    assert block.argument, f"{block.where()}: say why the block is not run"
    from nmdeploy.cli import build_parser, chosen_verb

    for argv, _ in command_lines(block.code) if block.language in SHELL else []:
        arguments = nmdeploy_argv(argv)
        if arguments is None and "-m" in argv[:-1]:  # python -m MODULE ..., torchrun ... -m MODULE ...
            module = argv[argv.index("-m") + 1]
            assert importlib.util.find_spec(module), f"{block.where()}: no module {module}"
            arguments = argv[argv.index("-m") + 2 :] if module == "nmdeploy" else None
        if arguments is not None:
            try:
                build_parser(chosen_verb(arguments)).parse_args(arguments)
            except SystemExit as exit:
                pytest.fail(f"{block.where()}: `{shlex.join(argv)}` does not parse (exit {exit.code})")
    if block.language == "python":
        compile(block.code, block.where(), "exec")


def run_commands(block: Block, capsys) -> None:
    expected = int(block.argument) if block.marker == "exits" else 0
    for argv, comment in command_lines(block.code):
        arguments = nmdeploy_argv(argv)
        assert arguments is not None, f"{block.where()}: `{shlex.join(argv)}` is no nmdeploy command; mark it not run"
        try:
            code = main(arguments)
        except SystemExit as exit:  # --help exits from argparse
            code = exit.code or 0
        output = capsys.readouterr()
        assert code == expected, f"{block.where()}: `{shlex.join(argv)}` exited {code}\n{output.out}\n{output.err}"
        ends = re.search(r"ends (\w+)", comment)
        if ends:
            last = output.out.strip().splitlines()[-1]
            assert last.startswith(ends.group(1)), f"{block.where()}: `{shlex.join(argv)}` ended {last!r}"


def run_block(block: Block, folder: Path, namespace: dict, capsys) -> None:
    if block.marker == "not run":
        check_parses(block)
    elif block.marker == "file":
        target = folder / block.argument
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(block.code, encoding="utf-8")
    elif block.language in SHELL:
        run_commands(block, capsys)
    elif block.language == "python":
        exec(compile(block.code, block.where(), "exec"), namespace)
    elif block.language == "toml":
        tomllib.loads(block.code)
    else:
        pytest.fail(f"{block.where()}: a ```{block.language} block the docs test cannot run; mark it or fence it")


@pytest.fixture(scope="session")
def prepared(tmp_path_factory) -> Path:
    return prepare_folder(tmp_path_factory.mktemp("docs-fixtures"))


def page_params():
    for page in PAGES:
        marks = [pytest.mark.slow] if page.name in SLOW_PAGES else []
        yield pytest.param(page, id=page.name, marks=marks)


@pytest.mark.parametrize("page", list(page_params()))
def test_every_block_of_the_page_runs(page, prepared, tmp_path, monkeypatch, capsys):
    page_blocks = blocks(page)
    if not page_blocks:
        pytest.skip(f"{page.name} has no code blocks")
    folder = tmp_path / "work"
    shutil.copytree(prepared, folder, symlinks=True)
    monkeypatch.chdir(folder)
    monkeypatch.syspath_prepend(str(folder))
    modules_before = set(sys.modules)
    try:
        namespace: dict = {"__name__": "__docs__"}
        for block in page_blocks:
            run_block(block, folder, namespace, capsys)
    finally:
        for name in set(sys.modules) - modules_before:  # a page's own modules (mypkg, my_metrics) go with its folder
            module = sys.modules[name]
            places = [getattr(module, "__file__", None) or "", *(getattr(module, "__path__", None) or [])]
            if any(str(place).startswith(str(folder)) for place in places):
                del sys.modules[name]


def test_every_page_is_reachable_from_the_readme():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    linked = set(re.findall(r"\]\((docs/[\w./-]+\.md)", readme))
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8") if (ROOT / "docs" / "README.md").exists() else ""
    linked |= {f"docs/{name}" for name in re.findall(r"\]\(([\w.-]+\.md)", index)}
    pages = {str(page.relative_to(ROOT)) for page in PAGES[1:]}
    assert pages <= linked, f"pages no reader finds: {sorted(pages - linked)}"


def test_the_marker_grammar_is_what_the_pages_use():
    """A misspelt marker would silently run (or skip) a block: every HTML comment just above a fence is one we read."""
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for match in re.finditer(r"^(<!--.*?-->)\n```", text, re.M):
            if "this snippet runs in" in match.group(1):
                continue
            assert MARKER.search(match.group(1)), f"{page.name}: unknown marker {match.group(1)}"


def test_the_readme_stays_short():
    assert len((ROOT / "README.md").read_text(encoding="utf-8").splitlines()) < 200


def option_strings(parser: argparse.ArgumentParser) -> set[str]:
    found = set()
    for action in parser._actions:
        found.update(action.option_strings)
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found |= option_strings(sub)
    return found


def test_every_flag_of_a_synopsis_is_one_the_verb_takes():
    """The synopses in prose (`nmdeploy VERB ... [--flag]`) are not run, so their flags are checked against the parser:
    a renamed or removed flag fails here instead of misleading a reader."""
    from nmdeploy.cli import VERBS, build_parser

    checked = 0
    for page in PAGES:
        text = page.read_text(encoding="utf-8")
        for synopsis in re.findall(r"`(nmdeploy [a-z]+ [^`]*)`", text):
            verb = synopsis.split()[1]
            if verb not in VERBS:
                continue
            parser = build_parser(verb)
            verbs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
            known = option_strings(verbs.choices[verb])
            for flag in re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", synopsis):
                assert flag in known, f"{page.name}: `nmdeploy {verb}` takes no {flag}"
                checked += 1
    assert checked > 100
