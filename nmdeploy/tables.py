"""Report tables drawn by rich: a plain ASCII box that reads the same in a terminal, a log file and CI output.

Cells are plain text (never rich markup, so a tensor named ``w[0]`` prints as is), there is no colour, and a table
is at most ``MAX_WIDTH`` characters wide: columns are as wide as their widest cell while that fits, and past it the
long cells (layer names, notes) fold onto more lines, at spaces where they have them. Nothing is ever cut or
ellipsised, and right-aligned columns (numbers) keep their full width whenever they alone fit. rich is imported only
when a table is drawn, so ``--help`` and ``--version`` stay light.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Sequence

MAX_WIDTH = 120
"""The widest a table is drawn: it reads in a terminal, a CI log and a review comment without scrolling."""


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
    texts = []
    for row in rows:
        cells = list(row)
        if len(cells) != len(columns):
            raise ValueError(f"a row has {len(cells)} cells for {len(columns)} columns: {cells}")
        texts.append(["-" if cell is None else str(cell) for cell in cells])
    widths = [max([len(name), *(len(cells[index]) for cells in texts)]) for index, name in enumerate(columns)]
    # Numbers stay whole on one line when they fit beside the borders (3 characters per column, 1 more at the end).
    numbers_fit = sum(w + 3 for w, name in zip(widths, columns, strict=True) if name in right) + 1 <= MAX_WIDTH
    table = Table(box=ASCII, highlight=False)
    for name, width in zip(columns, widths, strict=True):
        table.add_column(
            Text(name),
            justify="right" if name in right else "left",
            overflow="fold",
            min_width=width if name in right and numbers_fit else None,
        )
    for cells in texts:
        table.add_row(*(Text(cell) for cell in cells))
    console = Console(
        width=MAX_WIDTH,
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
