"""Markdown tables of benchmark results, their cells formatted one way."""

from __future__ import annotations


def cell(v: object) -> str:
    """A value as a table shows it: n/a for None, floats to two places below 10, else whole."""
    if v is None:
        return "n/a"
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) < 10 else f"{v:.0f}"
    return str(v)


def markdown_table(header: list[str], rows: list[list[object]]) -> list[str]:
    """The lines of a Markdown table: the header, its rule, one line a row."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell(c) for c in row) + " |" for row in rows]
    return lines


__all__ = ["cell", "markdown_table"]
