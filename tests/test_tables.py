"""The report-table helper: ASCII box, plain text cells, stable alignment, at most 120 wide with nothing cut; and a
parser for other tests."""

from __future__ import annotations

import subprocess
import sys

import pytest

from nmdeploy.tables import render_table


def table_cells(text: str) -> list[list[str]]:
    """The cells of every header or data row of the tables in ``text`` (lines between ``|`` borders), stripped."""
    return [
        [cell.strip() for cell in line.strip()[1:-1].split("|")]
        for line in text.splitlines()
        if line.startswith("|") and line.rstrip().endswith("|") and not set(line.strip()) <= set("|-+")
    ]


def test_ascii_box_with_header_rule_and_no_escape_codes():
    text = render_table(["model", "p50 ms"], [["a", "1.250"], ["bb", "12.500"]], right=["p50 ms"])
    lines = text.splitlines()
    assert lines[0] == lines[-1] == "+" + "-" * (len(lines[0]) - 2) + "+"
    assert lines[2].startswith("|-") and "+" in lines[2]
    assert "\x1b" not in text and text.isascii() and not text.endswith("\n")
    assert table_cells(text) == [["model", "p50 ms"], ["a", "1.250"], ["bb", "12.500"]]


def test_right_aligned_numbers_end_in_one_column_and_left_names_start_in_one():
    text = render_table(["name", "value"], [["x", "1.5"], ["longer name", "123.25"], ["y", None]], right=["value"])
    rows = text.splitlines()[3:-1]
    values = ["1.5", "123.25", "-"]
    assert len({row.rindex(value) + len(value) for row, value in zip(rows, values, strict=True)}) == 1
    assert len({row.index(name) for row, name in zip(rows, ["x", "longer", "y"], strict=True)}) == 1
    assert len({len(line) for line in text.splitlines()}) == 1


def folded_column(text: str, index: int) -> str:
    """The pieces of column ``index`` on every data line of a table, joined: a folded cell reads whole again."""
    lines = [line for line in text.splitlines() if line.startswith("|") and not set(line) <= set("|-+")]
    return "".join(line[1:-1].split("|")[index].strip() for line in lines[1:])


def test_tables_fit_120_columns_folding_long_names_never_cutting_them():
    name = "/encoder/layer.0/attention/self/" + "/".join(f"block{i}" for i in range(14)) + "/query/key/MatMul"
    assert len(name) == 150
    text = render_table(["node", "saliency kept", "note"], [[name, "0.512", "converted"]], right=["saliency kept"])
    assert max(len(line) for line in text.splitlines()) <= 120 < len(name)
    assert folded_column(text, 0) == name and "…" not in text and "..." not in text
    assert "0.512" in text  # numbers keep their width: never folded while they fit


def test_many_wide_number_columns_fold_rather_than_overflow():
    number = "123456789012345.123456789"
    columns = [f"column {i}" for i in range(10)]
    text = render_table(columns, [[number] * 10], right=columns)
    assert max(len(line) for line in text.splitlines()) <= 120
    assert all(folded_column(text, index) == number for index in range(10))


def test_narrow_tables_keep_one_line_per_row():
    name = "encoder.layer.0.attention.self.query.weight"
    text = render_table(["weight", "axis"], [[name, "1"]], right=["axis"])
    assert len(text.splitlines()) == 5 and name in text


def test_cells_are_plain_text_not_markup_or_emoji():
    cells = ["w[0]", "[bold]x[/bold]", ":smile:", "[/]"]
    text = render_table(["a", "b", "c", "d"], [cells])
    assert table_cells(text)[1] == cells


def test_bad_calls_are_errors():
    with pytest.raises(ValueError, match="2 cells for 3 columns"):
        render_table(["a", "b", "c"], [["1", "2"]])
    with pytest.raises(ValueError, match="right-aligned columns \\['z'\\]"):
        render_table(["a"], [], right=["z"])


def test_rich_is_imported_only_when_a_table_is_drawn():
    script = (
        "import sys\n"
        "import nmdeploy.tables as t\n"
        "before = 'rich' in sys.modules\n"
        "t.render_table(['a'], [['1']])\n"
        "print(before, 'rich' in sys.modules)\n"
    )
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert result.stdout.split() == ["False", "True"]
