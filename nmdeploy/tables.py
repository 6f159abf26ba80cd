"""Report tables drawn by rich: a plain ASCII box that reads the same in a terminal, a log file and CI output.

Cells are plain text (never rich markup, so a tensor named ``w[0]`` prints as is), there is no colour, and columns
are as wide as their widest cell: numbers and names are never cut, wrapped or ellipsised. rich is imported only when
a table is drawn, so ``--help`` and ``--version`` stay light.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

# Wide enough that rich never has to shrink a column; a table is only as wide as its cells.
_UNLIMITED_WIDTH = 1 << 20


def render_table(
    columns: Sequence[str],
    rows: Iterable[Sequence[object]],
    *,
    right: Collection[str] = (),
) -> str:
    """The table of ``rows`` under ``columns`` as text, without a trailing newline. Columns named in ``right``
    (numbers) are right-aligned, the others left-aligned; ``None`` cells print as ``-``; other values print as
    ``str(value)``, so callers format numbers to the precision each column wants."""
    from rich.box import ASCII
    from rich.console import Console
    from rich.table import Table
    from rich.text import Text

    unknown = sorted(set(right) - set(columns))
    if unknown:
        raise ValueError(f"right-aligned columns {unknown} are not among the columns {list(columns)}")
    table = Table(box=ASCII, highlight=False)
    for name in columns:
        table.add_column(Text(name), justify="right" if name in right else "left", no_wrap=True)
    for row in rows:
        cells = list(row)
        if len(cells) != len(columns):
            raise ValueError(f"a row has {len(cells)} cells for {len(columns)} columns: {cells}")
        table.add_row(*(Text("-" if cell is None else str(cell)) for cell in cells))
    console = Console(
        width=_UNLIMITED_WIDTH,
        color_system=None,
        force_terminal=False,
        highlight=False,
        markup=False,
        emoji=False,
        soft_wrap=False,
    )
    with console.capture() as captured:
        console.print(table)
    return captured.get().rstrip("\n")
