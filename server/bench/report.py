"""Plain-text tables for the terminal and the benchmark README, and the JSON result files."""

import json
from pathlib import Path


def table(headers: list[str], rows: list[list[str]]) -> str:
    """A Markdown table, readable as is in a terminal."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths, strict=True)) + " |"

    rule = "|" + "|".join("-" * (w + 2) for w in widths) + "|"
    return "\n".join([line(headers), rule, *(line(r) for r in rows)])


def save_json(result: dict, result_dir: Path, filename: str) -> Path:
    """Write result under result_dir (made if missing) and say where."""
    result_dir.mkdir(parents=True, exist_ok=True)
    path = result_dir / filename
    # json writes inf as Infinity; vLLM's files do the same for an unlimited request rate.
    path.write_text(json.dumps(result, indent=2))
    print(f"results: {path}")
    return path
