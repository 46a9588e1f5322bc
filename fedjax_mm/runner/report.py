"""The end of a run: a results table, a markdown report and PNG learning curves.

Small, dependency-light helpers that turn numbers into something a person
reads, on a terminal, on GitHub and in a paper draft:

* :func:`format_table` renders a GitHub-flavoured markdown table whose columns
  are padded to equal width, so the same string reads well printed to a
  terminal and rendered on GitHub. Numeric columns are right-aligned (and
  marked ``---:``), text columns left-aligned.
* :func:`percent` and :func:`mean_std` print fractions the way the FedMuscle
  tables do: signed percentages with one decimal (``+16.9%``, ``+16.9 ± 2.1``).
  Delta (:func:`fedjax_mm.metrics.delta`) and the metrics are fractions, so
  both scale by 100 by default.
* :func:`write_report` writes ``# title`` and one ``## heading`` + body per
  section to a markdown file; :func:`write_text` replaces any text file (say
  ``results.json``) the same atomic way.
* :func:`plot_curves` draws one PNG with a grid of panels (one per user, say)
  and one line per method, x = round. Matplotlib is imported inside the
  function and drives an explicit Agg canvas (``matplotlib.figure.Figure`` +
  ``FigureCanvasAgg``), never ``pyplot``: no global backend switch, no window,
  no figure left open, and it works on headless machines and inside notebooks
  alike.

Typical use at the end of a run::

  rows = [[name, acc, percent(d)] for name, acc, d in results]
  table = format_table(["method", "accuracy", "Delta"], rows, floatfmt=".3f")
  print(table)
  plot_curves(workdir / "curves.png", {"Delta": {"FedMuscle": points}},
              title="Delta over rounds", ylabel="Delta")
  write_report(workdir / "report.md", title="FedMuscle, 8 users",
               sections=[("Results", table), ("Curves", "![curves](curves.png)")])

Nothing here imports jax; numpy scalars and 0-d arrays are accepted wherever a
number is.
"""

from __future__ import annotations

import json
import math
import numbers
import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fedjax_mm.runner.errors import SummaryError
from fedjax_mm.runner.workdir import config_diff

__all__ = [
  "Column",
  "Table",
  "format_table",
  "load_seed_runs",
  "mean_std",
  "percent",
  "plot_curves",
  "seed_cell",
  "write_report",
  "write_text",
]

# Subplot grid: at most this many columns; rows grow as needed.
_MAX_COLUMNS = 4
# Size of one panel in inches (at dpi 100: 420 x 320 pixels).
_PANEL_SIZE = (4.2, 3.2)
# Series with at most this many points also get markers, so single points show.
_MARKER_MAX_POINTS = 30


def _is_number(value: Any) -> bool:
  """True for real numbers (Python, numpy, 0-d arrays), False for bools and text."""
  if isinstance(value, bool | np.bool_):
    return False
  if isinstance(value, numbers.Real):
    return True
  return isinstance(value, np.ndarray) and value.ndim == 0 and value.dtype.kind in "iuf"


def _cell(value: Any, floatfmt: str) -> str:
  """Renders one table cell; floats with ``floatfmt``, None as empty, ``|`` escaped."""
  if value is None:
    return ""
  if isinstance(value, np.ndarray) and value.ndim == 0:
    value = value.item()
  if isinstance(value, numbers.Integral) and not isinstance(value, bool | np.bool_):
    text = str(int(value))
  elif isinstance(value, numbers.Real) and not isinstance(value, bool | np.bool_):
    value = float(value)
    text = format(value, floatfmt) if math.isfinite(value) else str(value)
  else:
    text = str(value)
  # A literal "|" would end the cell in markdown; newlines would end the row.
  return text.replace("|", "\\|").replace("\n", " ")


def format_table(
  headers: Sequence[str], rows: Sequence[Sequence[Any]], *, floatfmt: str = ".2f"
) -> str:
  """Formats rows as an aligned GitHub-flavoured markdown table.

  Columns are padded to their widest cell so the raw text lines up on a
  terminal. A column whose cells are all numbers (``None`` cells ignored) is
  right-aligned and its separator is ``---:``; any other column is
  left-aligned (``:---``). Floats use ``floatfmt``, NaN and infinities print
  as ``nan`` / ``inf``, integers print exactly, ``None`` prints empty,
  anything else goes through ``str`` (pre-format with :func:`percent` for
  percentages). ``|`` inside a cell is escaped.

  Example:
    >>> print(format_table(["method", "acc"], [["FedMuscle", 0.8123], ["local", 0.7]]))
    | method    |  acc |
    | :-------- | ---: |
    | FedMuscle | 0.81 |
    | local     | 0.70 |

  Args:
    headers: the column names.
    rows: one sequence per row, each as long as ``headers``.
    floatfmt: ``format`` spec for float cells, e.g. ``".3f"`` or ``".2e"``.

  Returns:
    The table, lines joined by ``"\\n"``, without a trailing newline.

  Raises:
    ValueError: a row's length differs from the number of headers.
  """
  ncols = len(headers)
  for i, row in enumerate(rows):
    if len(row) != ncols:
      raise ValueError(f"row {i} has {len(row)} cells, expected {ncols} (one per header)")
  numeric = [
    any(row[j] is not None for row in rows)
    and all(row[j] is None or _is_number(row[j]) for row in rows)
    for j in range(ncols)
  ]
  header_cells = [_cell(h, floatfmt) for h in headers]
  body = [[_cell(v, floatfmt) for v in row] for row in rows]
  # Separator cells at least three characters wide (":--"), as markdown linters expect.
  widths = [max([3, len(header_cells[j])] + [len(row[j]) for row in body]) for j in range(ncols)]

  def line(cells: Sequence[str]) -> str:
    padded = [
      c.rjust(w) if num else c.ljust(w) for c, w, num in zip(cells, widths, numeric, strict=True)
    ]
    return "| " + " | ".join(padded) + " |"

  separator = [
    ("-" * (w - 1) + ":") if num else (":" + "-" * (w - 1))
    for w, num in zip(widths, numeric, strict=True)
  ]
  return "\n".join([line(header_cells), line(separator)] + [line(row) for row in body])


def _signed(value: float, digits: int) -> str:
  """Formats with an explicit sign, printing a value that rounds to zero as ``+0.0``."""
  if math.isnan(value):
    return "nan"
  if math.isfinite(value) and round(value, digits) == 0:
    value = 0.0  # Avoid "-0.0" for tiny negatives.
  return format(value, f"+.{digits}f")


def percent(x: Any, *, digits: int = 1) -> str:
  """Formats a fraction as a signed percentage: ``0.169`` -> ``"+16.9%"``.

  Args:
    x: a real number (Python or numpy scalar, 0-d array), a fraction.
    digits: decimals to print.

  Returns:
    ``"+16.9%"``, ``"-3.0%"``, ``"+0.0%"`` (never ``"-0.0%"``); ``"nan%"``
    for NaN.
  """
  return _signed(float(x) * 100.0, digits) + "%"


def mean_std(values: Iterable[Any], *, scale: float = 100.0, digits: int = 1) -> str:
  """Formats the mean and standard deviation of several values: ``"+16.9 ± 2.1"``.

  The standard deviation is the **sample** one (``ddof=1``), the usual choice
  when reporting spread over a few seeds. With a single value there is no
  spread to report and only the mean is printed (``"+16.9"``), rather than a
  misleading ``± 0.0``. Like :func:`percent`, values are taken as fractions
  and multiplied by ``scale`` (100) before printing; pass ``scale=1`` for
  values already in the unit to print. The mean is signed, the deviation not.

  Example:
    >>> mean_std([0.15, 0.169, 0.19])
    '+17.0 ± 2.0'

  Args:
    values: one or more real numbers (e.g. Delta of each seed).
    scale: factor applied before formatting.
    digits: decimals to print.

  Returns:
    ``"<mean> ± <std>"``, or ``"<mean>"`` for a single value. NaN inputs give
    ``nan``.

  Raises:
    ValueError: ``values`` is empty.
  """
  array = np.asarray([float(v) for v in values], dtype=np.float64) * scale
  if array.size == 0:
    raise ValueError("mean_std needs at least one value")
  mean = _signed(float(array.mean()), digits)
  if array.size == 1:
    return mean
  std = float(array.std(ddof=1))
  return f"{mean} ± {std:.{digits}f}"


def load_seed_runs(workdirs: Iterable[str | os.PathLike[str]]) -> tuple[list[dict], list[dict]]:
  """``(results, configs)`` of finished runs that differ only in their seed.

  The runner summaries over seeds start here: every workdir must hold a
  ``results.json`` (else the run has not finished) and the configs must agree on
  every key but ``seed``; both failures raise with one line.
  """
  workdirs = [Path(w) for w in workdirs]
  runs, configs = [], []
  for w in workdirs:
    if not (w / "results.json").exists():
      raise FileNotFoundError(f"{w} has no results.json: the run has not finished.")
    runs.append(json.loads((w / "results.json").read_text()))
    configs.append(json.loads((w / "config.json").read_text()))
  if not runs:
    raise ValueError("no workdirs given.")
  strip = lambda c: {k: v for k, v in c.items() if k != "seed"}
  for w, c in zip(workdirs, configs, strict=True):
    if strip(c) != strip(configs[0]):
      differ = "; ".join(config_diff(strip(configs[0]), strip(c)))
      raise SummaryError(
        f"the runs differ in more than the seed ({workdirs[0]} and {w}: {differ}); "
        "summarise them separately."
      )
  return runs, configs


def seed_cell(values: Iterable[Any], *, digits: int = 1) -> str:
  """``"mean ± sample std"`` of values already in the unit to print (``± 0.0`` for one).

  Example:
    >>> seed_cell([10.0, 12.0])
    '11.0 ± 1.4'
  """
  values = np.asarray(list(values), np.float64)
  std = values.std(ddof=1) if len(values) > 1 else 0.0
  return f"{values.mean():.{digits}f} ± {std:.{digits}f}"


def lookup(tree: Mapping[str, Any], dotted: str) -> Any:
  """``tree["a"]["b"]`` for ``"a.b"``; a path with no dot is one key (``"R@1"``)."""
  for part in dotted.split("."):
    tree = tree[part]
  return tree


class Column(NamedTuple):
  """One column of a :class:`Table`.

  Attributes:
    header: the column's heading.
    key: dotted path of its value in a method's final metrics (``"global.R@1"``).
    digits: decimals printed.
    chance: dotted path of its value in the run's chance levels; None leaves
      the chance row's cell empty.
  """

  header: str
  key: str
  digits: int = 1
  chance: str | None = None


class Table(NamedTuple):
  """A system's result table, declared: one row per method, then the chance row.

  The report renders one run's final metrics (:meth:`render`); the summary over
  seeds the same columns as mean ± sample std, with differences paired by seed
  (:meth:`render_seeds`). Both read the metrics by the columns' dotted keys, so a
  system states its table once instead of formatting it twice.

  Attributes:
    columns: the value columns, in order.
    headline: dotted key of the run's headline metric (the one number it is
      known by), a key of one of :attr:`columns`.
    label: heading of the first column (the method names).
    chance_label: first cell of the chance row.

  Example:
    >>> table = Table([Column("R@1", "R@1", chance="R@1")], headline="R@1")
    >>> print(table.render({"a": {"R@1": 12.34}}, {"R@1": 1.0}))
    | Method | R@1  |
    | :----- | :--- |
    | a      | 12.3 |
    | chance | 1.0  |
  """

  columns: Sequence[Column]
  headline: str
  label: str = "Method"
  chance_label: str = "chance"

  def headers(self) -> list[str]:
    return [self.label, *(c.header for c in self.columns)]

  def headline_values(self, final: Mapping[str, Mapping[str, Any]]) -> dict[str, float]:
    """Method -> its headline metric."""
    return {m: float(lookup(f, self.headline)) for m, f in final.items()}

  def chance_row(self, chance: Mapping[str, Any]) -> list[str]:
    return [self.chance_label] + [
      "" if c.chance is None else f"{float(lookup(chance, c.chance)):.{c.digits}f}"
      for c in self.columns
    ]

  def render(
    self, final: Mapping[str, Mapping[str, Any]], chance: Mapping[str, Any] | None = None
  ) -> str:
    """The table of one run: ``final`` is method -> its metrics, in row order."""
    rows = [
      [m] + [f"{float(lookup(f, c.key)):.{c.digits}f}" for c in self.columns]
      for m, f in final.items()
    ]
    if chance is not None:
      rows.append(self.chance_row(chance))
    return format_table(self.headers(), rows)

  def render_seeds(
    self,
    runs: Sequence[Mapping[str, Mapping[str, Any]]],
    chance: Mapping[str, Any] | None = None,
    *,
    paired: str | None = None,
  ) -> str:
    """The table over seeds: each run's method -> metrics; cells :func:`seed_cell`.

    With ``paired``, one more row per other method: ``paired`` minus it, run by
    run (the same seed), then summarised.
    """
    methods = [m for m in runs[0] if all(m in r for r in runs)]
    value = lambda r, m, c: float(lookup(r[m], c.key))
    cell = lambda values, c: seed_cell(values, digits=c.digits)
    rows = [[m] + [cell([value(r, m, c) for r in runs], c) for c in self.columns] for m in methods]
    if paired in methods:
      for other in (m for m in methods if m != paired):
        rows.append(
          [f"{paired} - {other} (paired)"]
          + [
            cell([value(r, paired, c) - value(r, other, c) for r in runs], c) for c in self.columns
          ]
        )
    if chance is not None:
      rows.append(self.chance_row(chance))
    return format_table(self.headers(), rows)


def write_text(path: str | os.PathLike[str], text: str) -> None:
  """Writes a text file atomically (temporary file, then rename), creating parents.

  A run killed while writing its report leaves the previous file or none, never half of one.
  """
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)
  tmp = path.with_name(f".{path.name}.tmp")
  tmp.write_text(text, encoding="utf-8")
  os.replace(tmp, path)


def write_report(
  path: str | os.PathLike[str], *, title: str, sections: Sequence[tuple[str, str]]
) -> Path:
  """Writes a markdown report: ``# title``, then ``## heading`` and body per section.

  Bodies are written verbatim (a table from :func:`format_table`, prose, an
  image link such as ``![curves](curves.png)`` relative to the report). The
  file is replaced atomically, so a reader never sees half a report.

  Args:
    path: the ``.md`` file to write; parent folders are created.
    title: the document title.
    sections: ``(heading, markdown body)`` pairs, in order.

  Returns:
    The path written.
  """
  path = Path(path)
  parts = [f"# {title}\n"]
  for heading, body in sections:
    parts.append(f"## {heading}\n\n{body.strip()}\n")
  write_text(path, "\n".join(parts))
  return path


def plot_curves(
  path: str | os.PathLike[str],
  series: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]],
  *,
  title: str,
  ylabel: str,
  xlabel: str = "round",
  dpi: int = 100,
) -> Path:
  """Plots learning curves to one PNG: one panel per outer key, one line per inner key.

  Panels are laid out in a grid of at most four columns, in the order of
  ``series``. A line keeps the same colour in every panel (colours are
  assigned by first appearance of its inner key), so "FedMuscle" is one
  colour throughout. Points are sorted by round; NaN values leave gaps;
  series of up to 30 points get markers so that single points show. A
  panel whose lines are all empty says "no data".

  Example:
    >>> plot_curves("curves.png",
    ...             {"user 1 (vit_b/multilabel)": {"FedMuscle": [(0, .2), (1, .4)],
    ...                                            "local": [(0, .2), (1, .3)]},
    ...              "user 2 (bert/classification)": {"FedMuscle": [(0, .5)]}},
    ...             title="micro-F1 / accuracy", ylabel="metric")  # doctest: +SKIP

  Args:
    path: the PNG to write; parent folders are created.
    series: panel title -> line label -> ``[(round, value), ...]``; e.g. the
      output of :func:`fedjax_mm.runner.writers.metric_series` per line.
    title: the figure's title.
    ylabel: the y-axis label of every panel.
    xlabel: the x-axis label of every panel.
    dpi: resolution of the PNG.

  Returns:
    The path written.

  Raises:
    ValueError: ``series`` is empty.
  """
  # Lazy: matplotlib is slow to import and only needed here. Agg is explicit,
  # through its canvas, so pyplot's global backend is neither used nor changed.
  from matplotlib.backends.backend_agg import FigureCanvasAgg
  from matplotlib.figure import Figure

  if not series:
    raise ValueError("plot_curves needs at least one panel in series")
  path = Path(path)
  path.parent.mkdir(parents=True, exist_ok=True)

  npanels = len(series)
  ncols = min(_MAX_COLUMNS, npanels)
  nrows = math.ceil(npanels / ncols)
  fig = Figure(
    figsize=(_PANEL_SIZE[0] * ncols, _PANEL_SIZE[1] * nrows + 0.4), dpi=dpi, layout="tight"
  )
  FigureCanvasAgg(fig)
  axes = fig.subplots(nrows, ncols, squeeze=False)
  fig.suptitle(title, fontsize=13)

  colors: dict[str, str] = {}
  palette = [f"C{i}" for i in range(10)]
  for ax, (panel, lines) in zip(axes.flat, series.items(), strict=False):
    drawn = False
    for label, points in lines.items():
      color = colors.setdefault(label, palette[len(colors) % len(palette)])
      pts = sorted((int(x), float(y)) for x, y in points)
      if not pts:
        continue
      xs, ys = zip(*pts, strict=True)
      marker = "o" if len(pts) <= _MARKER_MAX_POINTS else None
      ax.plot(xs, ys, label=label, color=color, marker=marker, markersize=3, linewidth=1.5)
      drawn = True
    ax.set_title(panel, fontsize=10)
    ax.set_xlabel(xlabel, fontsize=9)
    ax.set_ylabel(ylabel, fontsize=9)
    ax.tick_params(labelsize=8)
    ax.grid(True, alpha=0.3)
    if drawn:
      ax.legend(fontsize=8, loc="best")
    else:
      ax.text(0.5, 0.5, "no data", ha="center", va="center", transform=ax.transAxes)
  for ax in list(axes.flat)[npanels:]:
    ax.set_visible(False)  # Unused cells of the last row.

  fig.savefig(path, dpi=dpi, format="png")
  return path
