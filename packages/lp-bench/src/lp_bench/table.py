"""Tables that read the same on a terminal, in a CI log, through a pipe and in 80 columns.

:func:`print_table` draws a rich table only when stdout is a terminal wide enough for the
whole table, so that rich never has to cut a cell to "…"; anywhere else (a pipe, a file, a
narrow terminal) it prints a plain aligned text table in which every cell is whole. rich
is a dependency of lp-bench; where the package runs from source without it (a GPU host's
own environment), every table is plain.
"""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Sequence
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table


def plain_table(
    head: Sequence[str], cells: Sequence[Sequence[str]], *, left: int = 1, title: str | None = None
) -> str:
    """The table as aligned text: the first ``left`` columns left-aligned, the others right-
    aligned, the last column left-aligned when it is free text (a ``note``); cells are never
    cut, so a long cell widens its column."""
    rows = [list(head), *(list(r) for r in cells)]
    width = len(head)
    for r in rows:
        if len(r) != width:
            raise ValueError(f"plain_table: a row has {len(r)} cells, the header {width}")
    widths = [max(len(r[i]) for r in rows) for i in range(width)]
    lines = [title] if title else []

    def line(r: list[str]) -> str:
        out = []
        for i, (c, w) in enumerate(zip(r, widths, strict=True)):
            last = i == width - 1
            if i < left or (last and head[i] == "note"):
                out.append(c if last else c.ljust(w))
            else:
                out.append(c.rjust(w))
        return "  ".join(out).rstrip()

    lines.append(line(rows[0]))
    lines.append("-" * (sum(widths) + 2 * (width - 1)))
    lines += [line(r) for r in rows[1:]]
    return "\n".join(lines)


def rich_table(
    head: Sequence[str], cells: Sequence[Sequence[str]], *, left: int = 1, title: str | None = None
) -> Table:
    """The same table as a rich :class:`~rich.table.Table` whose cells never wrap or cut."""
    from rich.table import Table

    table = Table(title=title)
    for i, col in enumerate(head):
        justify = "left" if i < left or col == "note" else "right"
        table.add_column(col, justify=justify, no_wrap=True, overflow="fold")
    for r in cells:
        table.add_row(*r)
    return table


def print_table(
    head: Sequence[str],
    cells: Sequence[Sequence[str]],
    *,
    left: int = 1,
    title: str | None = None,
    file: IO[str] | None = None,
    console: Console | None = None,
) -> None:
    """Print the table: rich when the output is a terminal that fits it, else plain text.

    Args:
        head: column names.
        cells: rows of strings, one per column.
        left: how many leading columns are labels (left-aligned).
        title: a line above the table.
        file: where to print (default: ``sys.stdout`` at call time).
        console: a rich console to decide with and print on (tests force a width with it).
    """
    if console is None:
        if importlib.util.find_spec("rich") is None:
            out = file or sys.stdout
            out.write(plain_table(head, cells, left=left, title=title) + "\n")
            out.flush()
            return
        from rich.console import Console

        console = Console(file=file, highlight=False)
    from rich.measure import Measurement

    table = rich_table(head, cells, left=left, title=title)
    # The table's natural width (console.measure would clamp it to the console's).
    natural = Measurement.get(console, console.options.update_width(1 << 20), table).maximum
    if console.is_terminal and natural <= console.width:
        console.print(table)
        return
    # Written past rich: on a narrow terminal it would wrap the plain lines too.
    console.file.write(plain_table(head, cells, left=left, title=title) + "\n")
    console.file.flush()
