"""The command line starts light, has a docs page per verb (linked from the README), and every verb loads on demand."""

from __future__ import annotations

import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

from nmdeploy.cli import VERBS, build_parser, chosen_verb

README = Path(__file__).resolve().parent.parent / "README.md"
HEAVY = ("torch", "onnxruntime", "onnx", "tensorrt", "transformers", "numpy", "rich", "polygraphy")


@pytest.mark.parametrize("flag", ["--help", "--version"])
def test_help_and_version_import_nothing_heavy(flag: str) -> None:
    # A fresh interpreter: the test process itself has torch loaded already.
    script = (
        "import sys\n"
        "from nmdeploy.cli import main\n"
        "try:\n"
        f"    main([{flag!r}])\n"
        "except SystemExit as exit:\n"
        "    assert exit.code == 0, exit.code\n"
        f"print(sorted(name for name in {HEAVY!r} if name in sys.modules))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.strip().splitlines()[-1] == "[]"


def test_top_level_help_lists_every_verb_without_importing_them() -> None:
    before = {name for name in sys.modules if name.startswith("nmdeploy.cli.")}
    text = build_parser().format_help()
    after = {name for name in sys.modules if name.startswith("nmdeploy.cli.")}
    assert after == before
    for verb in VERBS:
        assert re.search(rf"^\s+{verb}\s", text, re.M), verb


@pytest.mark.parametrize("verb", sorted(VERBS))
def test_every_verb_module_gives_its_flags_and_runner(verb: str) -> None:
    module = importlib.import_module(VERBS[verb].module)
    assert callable(module.add_arguments) and callable(module.run)
    sub = build_parser(verb)._subparsers._group_actions[0].choices[verb]
    assert any("--verbose" in action.option_strings for action in sub._actions)
    assert sub.get_default("run") is module.run


def test_chosen_verb_is_the_first_word() -> None:
    assert chosen_verb(["prune", "m.onnx", "-o", "x.onnx"]) == "prune"
    assert chosen_verb(["--version"]) is None
    assert chosen_verb(["unknown-verb", "x"]) is None


def test_every_verb_of_help_has_its_page_linked_from_the_readme() -> None:
    text = README.read_text(encoding="utf-8")
    documented = re.findall(r"\[([a-z-]+)\]\(docs/([a-z-]+)\.md\)", text)
    verbs = {name for name, page in documented if name == page}
    listed = re.findall(r"^    ([a-z-]+)\s{2,}", build_parser().format_help(), re.M)
    assert verbs == set(listed) == set(VERBS)
    for verb in verbs:
        page = README.parent / "docs" / f"{verb}.md"
        assert page.read_text(encoding="utf-8").startswith(f"# nmdeploy {verb}\n"), page


def test_the_installed_command_imports_users_modules_from_the_current_folder(tmp_path: Path) -> None:
    """An installed console script, unlike ``python -m``, has no current folder on sys.path: --metric mymetric:f (a
    module beside the user) must still import."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "W"], ["y"])],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [None, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [None, 2])],
        [numpy_helper.from_array(np.ones((4, 2), np.float32), "W")],
    )
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)]), tmp_path / "m.onnx")
    np.savez(tmp_path / "d.npz", x=np.ones((3, 4), np.float32))
    (tmp_path / "mymetric.py").write_text("def agreement(reference, candidate, feeds):\n    return 1.0\n")
    script = (
        "import sys\n"
        "sys.path[:] = [p for p in sys.path if p not in ('', '.')]\n"  # as a console script starts
        "from nmdeploy.cli import console_main\n"
        "sys.argv = ['nmdeploy', 'compare', 'm.onnx', 'm.onnx', '--data', 'd.npz', '--metric', 'mymetric:agreement']\n"
        "sys.exit(console_main())\n"
    )
    package = str(README.parent)
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path, env={"PYTHONPATH": package}
    )
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip().splitlines()[-1].startswith("measured | mymetric:agreement 1 ")
