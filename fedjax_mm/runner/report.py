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
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from fedjax_mm.runner.errors import SummaryError
from fedjax_mm.runner.workdir import config_diff

__all__ = [
  "Column",
  "Table",
  "flatten",
  "format_table",
  "load_seed_runs",
  "mean_std",
  "percent",
  "plot_curves",
  "render_tables",
  "summarize",
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
  headers: Sequence[str],
  rows: Sequence[Sequence[Any]],
  *,
  floatfmt: str = ".2f",
  numeric: Sequence[bool] | None = None,
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
    numeric: per column, whether to right-align it (pre-formatted numbers);
      None: the columns whose cells are all numbers.

  Returns:
    The table, lines joined by ``"\\n"``, without a trailing newline.

  Raises:
    ValueError: a row's length differs from the number of headers.
  """
  ncols = len(headers)
  for i, row in enumerate(rows):
    if len(row) != ncols:
      raise ValueError(f"row {i} has {len(row)} cells, expected {ncols} (one per header)")
  if numeric is None:
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


def flatten(tree: Any, prefix: str = "") -> dict[str, float]:
  """The numbers of a nested mapping (lists by index) as ``{"a.b": value}``, the keys a
  :class:`Column` names; text, None and bools are left out."""
  if _is_number(tree):
    return {prefix: float(tree)}
  if isinstance(tree, np.ndarray):
    tree = tree.tolist()
  if isinstance(tree, Mapping):
    items = tree.items()
  elif isinstance(tree, list | tuple):
    items = enumerate(tree)
  else:
    return {}
  out = {}
  for k, v in items:
    out |= flatten(v, f"{prefix}.{k}" if prefix else str(k))
  return out


class Column(NamedTuple):
  """One column of a :class:`Table`.

  Attributes:
    header: the column's heading.
    key: its value's key in a row's flat metrics (:func:`flatten`: ``"global.R@1"``).
    digits: decimals printed.
    higher: True when a higher value is better (recall, accuracy); the verdict of a
      paired difference (:func:`fedjax_mm.metrics.seeds.verdict`) reads it.
    signed: print an explicit sign (a difference: ``+13.33``).
    format: ``value -> text`` instead of ``digits`` (bytes: ``format_bytes``).
  """

  header: str
  key: str
  digits: int = 1
  higher: bool = True
  signed: bool = False
  format: Callable[[float], str] | None = None

  def text(self, value: float | None) -> str:
    if value is None:
      return ""
    if self.format is not None:
      return self.format(value)
    return format(value, f"{'+' if self.signed else ''}.{self.digits}f")


class Table(NamedTuple):
  """A system's result table, declared: one row per method, then its baseline rows.

  The loop renders it from a run's ``results.json`` ``"report"`` section
  (:meth:`render`: ``final`` is method -> flat metrics, ``baselines`` name -> flat
  metrics, both keyed by the columns' keys), and the summary over seeds renders it
  from several runs' (:meth:`render_seeds`): each cell the mean ± the half-width of
  its 95% interval, and the paired difference ``reference - other`` seed by seed
  with its interval and a verdict (:mod:`fedjax_mm.metrics.seeds`).

  Attributes:
    title: its section heading in ``report.md``.
    columns: the value columns, in order.
    headline: key of the table's headline metric (the one number a method is known
      by; the paired rows' verdict and ``sort`` read it); None: the first column's.
    label: heading of the first column (the method names).
    baselines: the rows after the methods, by name (``"chance"``, a trivial
      predictor's ``"majority class"``, ``"initial model"``); a name no run gives,
      or a key its values lack, leaves the row or the cell out.
    reference: the method the summary compares, seed by seed, against ``against``
      (None: against every other row); no paired rows when it did not run.
    against: the methods ``reference`` is compared with.
    methods: the rows this table shows, in order (None: every method of ``final``);
      a method holding none of its keys is left out, and so is the table when fewer
      than ``min_rows`` methods are left.
    groups: blocks of rows, ``(leading cells, key prefix)``: each block shows every
      method with the columns' keys prefixed (FedSCMR's rows per metric and task).
    group_headers: headings of the leading cells.
    sort: rows by the headline, best first.
    min_rows: fewest method rows to show the table.

  Example:
    >>> table = Table("Results", [Column("R@1", "R@1")])
    >>> print(table.render({"a": {"R@1": 12.34}}, {"chance": {"R@1": 1.0}}))
    | Method |  R@1 |
    | :----- | ---: |
    | a      | 12.3 |
    | chance |  1.0 |
  """

  title: str
  columns: Sequence[Column]
  headline: str | None = None
  label: str = "Method"
  baselines: Sequence[str] = ("chance",)
  reference: str | None = None
  against: Sequence[str] | None = None
  methods: Sequence[str] | None = None
  groups: Sequence[tuple[Sequence[str], str]] = ()
  group_headers: Sequence[str] = ()
  sort: bool = False
  min_rows: int = 1

  def _headline(self) -> Column:
    key = self.headline or self.columns[0].key
    return next(c for c in self.columns if c.key == key)

  def _rows(self, finals: Sequence[Mapping[str, Mapping[str, float]]]) -> list[str]:
    """The methods shown: in every run, holding one of the table's keys."""
    keys = {p + c.key for _, p in self.groups or [((), "")] for c in self.columns}
    names = self.methods if self.methods is not None else list(finals[0])
    rows = [m for m in names if all(m in f for f in finals) and keys & set(finals[0][m])]
    if self.sort:
      head = self._headline()
      mean = lambda m: np.mean([f[m].get(head.key, np.nan) for f in finals])
      rows.sort(key=lambda m: -mean(m) if head.higher else mean(m))
    return rows

  def render(
    self, final: Mapping[str, Mapping[str, float]], baselines: Mapping[str, Mapping[str, float]]
  ) -> str | None:
    """The table of one run; None when it has too few rows."""
    return self.render_seeds([final], [baselines])

  def render_seeds(
    self,
    finals: Sequence[Mapping[str, Mapping[str, float]]],
    baselines: Sequence[Mapping[str, Mapping[str, float]]],
  ) -> str | None:
    """The table over runs (seeds, in order); one run prints its values as they are."""
    from fedjax_mm.metrics import seeds  # scipy: only when a table is rendered

    methods = self._rows(finals)
    if len(methods) < self.min_rows:
      return None
    several = len(finals) > 1
    reference = self.reference if several and self.reference in methods else None
    against = [m for m in (self.against or methods) if m in methods and m != reference]
    head = self._headline()

    def values(runs, name, key):
      got = [r.get(name, {}).get(key) for r in runs]
      return None if any(v is None for v in got) else got

    def cell(column, got):
      if got is None:
        return ""
      if not several:
        return column.text(got[0])
      if not np.all(np.isfinite(got)):
        return "nan"
      i = seeds.interval(got)
      if column.format is not None or i.n == 1:
        return column.text(i.mean)
      return f"{column.text(i.mean)} ± {i.half_width:.{column.digits}f}"

    def paired(a, b):  # the seeds' paired difference; None when a side is missing or NaN
      if a is None or b is None or not np.all(np.isfinite([*a, *b])):
        return None
      return seeds.paired_difference(a, b)

    def diff(column, a, b):
      d = paired(a, b)
      if d is None:
        return "" if a is None or b is None else "nan"
      return d.format(column.digits, count=False)

    rows = []
    for lead, prefix in self.groups or [((), "")]:
      for m in methods:
        rows.append([*lead, m] + [cell(c, values(finals, m, prefix + c.key)) for c in self.columns])
      for other in against if reference else ():
        cells = []
        for c in self.columns:
          a, b = (values(finals, x, prefix + c.key) for x in (reference, other))
          cells.append(diff(c, a, b))
        d = paired(*(values(finals, x, prefix + head.key) for x in (reference, other)))
        verdict = "" if d is None else seeds.verdict(d, 1 if head.higher else -1)
        rows.append([*lead, f"{reference} - {other} (paired)", *cells, verdict])
      for name in self.baselines:
        got = [values(baselines, name, prefix + c.key) for c in self.columns]
        if any(g is not None for g in got):
          rows.append([*lead, name] + [cell(c, g) for c, g in zip(self.columns, got, strict=True)])
    headers = [*self.group_headers, self.label, *(c.header for c in self.columns)]
    if reference:
      headers.append(f"verdict ({head.header})")
      rows = [r + [""] * (len(headers) - len(r)) for r in rows]
    lead = len(self.group_headers) + 1
    align = (
      [False] * lead
      + [True] * len(self.columns)
      + [False] * (len(headers) - lead - len(self.columns))
    )
    return format_table(headers, rows, numeric=align)


def render_tables(
  tables: Sequence[Table],
  finals: Sequence[Mapping[str, Mapping[str, float]]],
  baselines: Sequence[Mapping[str, Mapping[str, float]]],
) -> list[tuple[str, str]]:
  """``(title, markdown)`` of each table that has rows, over one run or several."""
  out = []
  for table in tables:
    body = table.render_seeds(finals, baselines)
    if body is not None:
      out.append((table.title, body))
  return out


def summarize(
  workdirs: Sequence[str | os.PathLike[str]], tables: Callable[[Any], Sequence[Table]]
) -> str:
  """A system's result tables over finished runs that differ only in their seed.

  ``tables`` is the system's :attr:`~fedjax_mm.runner.loop.System.tables`, given the
  runs' config (``config.json``); the values come from each ``results.json``'s
  ``"report"`` section. Cells are the mean ± the half-width of the 95% Student-t
  interval over the seeds; each table's reference comparison is paired by seed.

  Raises:
    SummaryError: the runs differ in more than the seed, or a run has no ``"report"``
      section (it was written before results.json held one).
  """
  import ml_collections  # noqa: PLC0415 - the configs only when summarising

  runs, configs = load_seed_runs(workdirs)
  for w, r in zip(workdirs, runs, strict=True):
    if "report" not in r:
      raise SummaryError(
        f'{w}/results.json has no "report" section: it was written before runs recorded '
        "their result tables; run it again (it resumes and rewrites the report)."
      )
  specs = tables(ml_collections.ConfigDict(configs[0]))
  parts = render_tables(
    specs, [r["report"]["final"] for r in runs], [r["report"]["baselines"] for r in runs]
  )
  seeds = ", ".join(str(c.get("seed")) for c in configs)
  lead = (
    f"{runs[0].get('system', 'runs')}: {len(runs)} runs (seeds {seeds}); each cell the mean "
    "± the half-width of its 95% t interval over the seeds; a paired row: the difference seed "
    "by seed, its mean [95% interval], and whether it shows the reference better in the "
    "verdict's column (reproduced / undecided / reversed)."
  )
  return "\n\n".join([lead] + [f"{title}:\n\n{body}" for title, body in parts])


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
