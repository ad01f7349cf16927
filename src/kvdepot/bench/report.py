"""How every bench shows what it measures: rows printed as they are measured, a progress bar,
the CPU caveat, and ``--json`` / ``--plot`` files.

    add_output_arguments(parser)            --json PATH, --plot PATH (every bench with a table)
    report = Report(args, steps=N, device=d)
    report.table("title")                   a new table (its header is printed with its first row)
    report.add(row)                         print one row now, keep it for the files
    with report.step("store"): ...          advance the bar (tqdm on a terminal; silent in logs)
    report.finish(extra=None)               write --json and --plot; returns every row

A bench that ran silently for 30 s and then printed 18 rows at once read as hung; printing each row
as soon as it exists, and a bar for what is in between, says it is not. The bar goes to stderr
and only on a terminal (tqdm's ``disable=None``), so logs and ``--json`` runs stay clean.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import sys
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

CPU_CAVEAT = ("note: running on CPU. Copies here are host memcpy of this machine, not PCIe DMA to a GPU, and "
              "model forwards are CPU matmuls: ratios within a row are meaningful, absolute figures say little "
              "about a GPU server (the GPU figures are in docs/benchmarks.md).")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", default=None, metavar="PATH", help="also write every row (and the table titles) as JSON to PATH")
    parser.add_argument("--plot", default=None, metavar="PATH",
                        help="also write a PNG chart of the rows to PATH (needs matplotlib: pip install 'kvdepot[bench]')")


@dataclass(frozen=True)
class Bars:
    """What ``--plot`` draws for a table: one group of horizontal bars per row, labelled by
    ``label`` columns, one bar per ``values`` column (same unit, e.g. GB/s next to memcpy GB/s)."""

    label: tuple[str, ...]
    values: tuple[str, ...]
    unit: str
    log: bool = False


@dataclass
class _Table:
    title: str
    min_widths: dict[str, int] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    widths: list[int] = field(default_factory=list)


class Report:
    def __init__(self, args: Any, *, steps: int, device: Any = None, bars: Bars | None = None, name: str = "bench") -> None:
        from tqdm import tqdm

        self.args, self.bars = args, bars
        self.tables: list[_Table] = []
        self._bar = tqdm(total=steps, desc=name, unit="step", file=sys.stderr, leave=False, dynamic_ncols=True, disable=None)
        if device is not None and getattr(device, "type", device) == "cpu":
            self._print(CPU_CAVEAT)

    def _print(self, line: str) -> None:
        from tqdm import tqdm

        tqdm.write(line, file=sys.stdout)
        sys.stdout.flush()

    def note(self, line: str) -> None:
        self._print(line)

    def table(self, title: str, **min_widths: int) -> None:
        """Start a table; ``min_widths``: columns whose later values are longer than the first
        row's (the header is printed before the other rows exist)."""
        self.tables.append(_Table(title, min_widths))

    @contextlib.contextmanager
    def step(self, what: str) -> Iterator[None]:
        self._bar.set_postfix_str(what, refresh=True)
        try:
            yield
        finally:
            self._bar.update(1)

    def add(self, row: dict[str, Any]) -> dict[str, Any]:
        if not self.tables:
            self.table("")
        table = self.tables[-1]
        cells = [fmt(v) for v in row.values()]
        if not table.rows:
            table.widths = [max(len(str(c)), len(v), table.min_widths.get(str(c).replace(" ", "_"), 0))
                            for c, v in zip(row, cells, strict=True)]
            if table.title:
                self._print(table.title)
            self._print("  ".join(str(c).ljust(w) for c, w in zip(row, table.widths, strict=True)))
            self._print("  ".join("-" * w for w in table.widths))
        table.rows.append(row)
        self._print("  ".join(v.ljust(w) for v, w in zip(cells, table.widths, strict=False)))
        return row

    def rows(self) -> list[dict[str, Any]]:
        return [row for table in self.tables for row in table.rows]

    def finish(self, extra: dict[str, Any] | None = None) -> list[dict[str, Any]]:
        self._bar.close()
        path = getattr(self.args, "json", None)
        if path:
            doc = {"tables": [{"title": t.title, "rows": t.rows} for t in self.tables], **(extra or {})}
            Path(path).write_text(json.dumps(doc, indent=1, default=_jsonable))
            self._print(f"rows written to {path}")
        plot = getattr(self.args, "plot", None)
        if plot and self.bars is not None:
            plot_bars(self.rows(), self.bars, plot, " / ".join(t.title for t in self.tables if t.title)[:200])
        return self.rows()


def fmt(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.3f}" if abs(value) < 100 else f"{value:.1f}"
    return "" if value is None else str(value)


def _jsonable(value: Any) -> Any:
    return str(value)


def plot_bars(rows: Sequence[dict[str, Any]], bars: Bars, path: str, title: str) -> bool:
    """A PNG of grouped horizontal bars; False (and a note) without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print(f"(no plot: matplotlib is not installed — pip install 'kvdepot[bench]'; {path} not written)")
        return False
    drawn = [r for r in rows if any(_number(r.get(v)) for v in bars.values)]
    labels = [" ".join(fmt(r.get(k)) for k in bars.label) for r in drawn]
    height = 0.8 / len(bars.values)
    fig, ax = plt.subplots(figsize=(8, 1.2 + 0.45 * len(drawn) * max(1, len(bars.values)) / 1.5))
    for j, key in enumerate(bars.values):
        ys = [i + (j - (len(bars.values) - 1) / 2) * height for i in range(len(drawn))]
        xs = [_number(r.get(key)) or 0.0 for r in drawn]
        ax.barh(ys, xs, height=height, label=key)
    ax.set_yticks(range(len(drawn)), labels, fontsize=8)
    ax.invert_yaxis()
    ax.set_xlabel(bars.unit)
    if bars.log:
        ax.set_xscale("log")
    ax.set_title(title, fontsize=8, wrap=True)
    ax.grid(True, axis="x", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    print(f"plot written to {path}")
    return True


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value) or value <= 0:
        return None
    return float(value)
