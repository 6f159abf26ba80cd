"""The report-table helper: ASCII box, plain text cells, stable alignment, nothing cut; and a parser for other tests."""

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


def test_long_cells_and_many_columns_are_never_cut_or_wrapped():
    name = "encoder.layer." + ".".join(str(i) for i in range(60)) + ".weight"
    number = "123456789012345.123456789"
    columns = [f"column {i}" for i in range(30)]
    text = render_table(columns, [[name, *([number] * 29)]], right=columns[1:])
    assert len(text.splitlines()) == 5  # one line per row: nothing wrapped
    assert name in text and text.count(number) == 29 and "…" not in text and "..." not in text


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
