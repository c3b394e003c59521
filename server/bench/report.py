"""Plain-text tables for the terminal and the benchmark README."""


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, readable as is in a terminal."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])
