"""Per-round scalar metrics, written to JSON Lines and to TensorBoard at once.

A run logs a few scalars per round (losses, per-user metrics, Delta, bytes
sent). :class:`MetricWriter` writes each call to two places, in the spirit of
clu's ``metric_writers`` and big_vision's ``BigVisionMetricWriter``:

* ``<workdir>/metrics.jsonl``, one JSON object per line,
  ``{"round": r, "run": "<run>", "<name>": value, ...}``: greppable, diffable,
  loaded back by :func:`read_metrics` for reports and tests. Several runs of
  one experiment (``"fedmuscle"``, ``"local"``) share the file and are told
  apart by ``"run"``.
* TensorBoard event files under ``<workdir>/tb/<run>/`` (``tensorboardX``),
  one scalar tag per name, step = round, one new event file per writer. ``tensorboardX`` is imported lazily;
  when it is missing the writer warns once per process and writes JSON Lines
  only.

Values and their encoding:

* A value is a Python ``int``/``float``/``bool``, a numpy scalar, or a 0-d
  array (numpy or jax; a jax array is fetched to the host). Anything else
  (vectors, strings, ``None``) raises ``TypeError`` naming the key. Integers
  stay integers in JSON (byte counts are exact), booleans become 0/1, floats
  become Python floats.
* **Non-finite floats.** JSON has no NaN or infinity, so NaN, ``inf`` and
  ``-inf`` are all written as ``null`` (strict JSON that any reader accepts);
  :func:`read_metrics` turns ``null`` back into ``float("nan")``. The sign of
  an infinity is therefore lost in the JSON Lines file (TensorBoard receives
  the exact value). A diverged run stays visible as NaN gaps.

Crash safety and resume:

* Every :meth:`MetricWriter.write` appends one whole line through a handle
  opened and closed for it, so a crash loses at most the line being written,
  and several writers of one file (one per run) stay correct when another
  writer's resume rewrites the file. A
  torn (unterminated, unparsable) last line left by such a crash is dropped
  when a writer opens the file, and skipped by :func:`read_metrics`.
* A crashed run may have logged rounds past its last checkpoint. Open the
  writer with ``resume_round=r`` (the round of the restored checkpoint): lines
  of *this run* with ``round > r`` are dropped from ``metrics.jsonl`` (atomic
  rewrite; other runs' lines are kept), and TensorBoard is told to purge steps
  ``> r`` from older event files (``purge_step=r + 1``), so neither shows the
  rounds twice. ``resume_round=-1`` drops every line of the run.

This module is host-side: it imports numpy but not jax. In a multi-process job
only process 0 should write.

Typical use::

  with MetricWriter(workdir, "fedmuscle", resume_round=start_round - 1) as writer:
    for r in range(start_round, num_rounds):
      ...
      writer.write(r, {"loss": loss, "delta": delta, "user_3/micro_f1": f1})
  rows = read_metrics(workdir, run="fedmuscle")
"""

from __future__ import annotations

import json
import math
import os
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

__all__ = ["METRICS_FILE", "MetricWriter", "metric_series", "read_metrics"]

#: Name of the JSON Lines file inside a workdir.
METRICS_FILE = "metrics.jsonl"
#: Folder of the TensorBoard event files inside a workdir (one subfolder per run).
TB_DIR = "tb"

_RESERVED = ("round", "run")
_warned_no_tensorboard = False


def _to_scalar(key: str, value: Any) -> int | float:
  """Converts one metric value to a Python int or float, or raises TypeError."""
  if isinstance(value, bool | np.bool_):
    return int(value)
  if isinstance(value, int):
    return int(value)
  if isinstance(value, float):
    return float(value)
  try:
    array = np.asarray(value)
  except Exception as e:  # Any failure means "not a scalar".
    raise TypeError(f"metric {key!r}: cannot convert {type(value).__name__} to a scalar") from e
  if array.ndim != 0 or array.dtype.kind not in "biuf":
    raise TypeError(
      f"metric {key!r} must be a real scalar (int, float, numpy scalar or 0-d array), "
      f"got {type(value).__name__} with shape {array.shape} and dtype {array.dtype}"
    )
  scalar = array.item()
  return int(scalar) if isinstance(scalar, bool) else scalar


def _json_value(value: int | float) -> int | float | None:
  """Returns the JSON form of a scalar: non-finite floats become ``None`` (null)."""
  if isinstance(value, float) and not math.isfinite(value):
    return None
  return value


def _parse_lines(path: Path) -> tuple[list[dict[str, Any]], list[str], bool]:
  """Parses a JSON Lines file, tolerating a torn last line.

  Returns:
    (records, their raw lines without newline, whether the file needs repair:
    a torn last line was skipped, or the last record lacks its newline).

  Raises:
    ValueError: a line other than the last is not a JSON object.
  """
  text = path.read_text(encoding="utf-8")
  lines = text.split("\n")
  # A file that ends with "\n" splits into [..., ""]; anything else ends torn.
  terminated = lines[-1] == ""
  if terminated:
    lines.pop()
  records, raw, torn = [], [], False
  for i, line in enumerate(lines):
    if not line.strip():
      continue
    try:
      record = json.loads(line)
      if not isinstance(record, dict):
        raise ValueError("not a JSON object")
    except ValueError as e:
      if i == len(lines) - 1 and not terminated:
        torn = True
        continue
      raise ValueError(f"{path}:{i + 1}: not a metrics record ({e}): {line[:80]!r}") from e
    records.append(record)
    raw.append(line)
  if not terminated and not torn and lines:
    torn = True  # A complete record without its newline: keep it, but the file needs one.
  return records, raw, torn


def read_metrics(
  workdir: str | os.PathLike[str], *, run: str | None = None
) -> list[dict[str, Any]]:
  """Loads ``<workdir>/metrics.jsonl`` as a list of dicts, in file order.

  ``null`` values (non-finite floats, see the module docstring) come back as
  ``float("nan")``. A torn last line (crash mid-write) is skipped.

  Args:
    workdir: the run's folder.
    run: keep only the records of this run; all runs when None.

  Returns:
    One dict per line: ``{"round": int, "run": str, <name>: int | float}``.
    Empty when the file does not exist.

  Raises:
    ValueError: a line other than the last is not a JSON object.
  """
  path = Path(workdir) / METRICS_FILE
  if not path.exists():
    return []
  records, _, _ = _parse_lines(path)
  out = []
  for record in records:
    if run is not None and record.get("run") != run:
      continue
    out.append({k: (math.nan if v is None else v) for k, v in record.items()})
  return out


def metric_series(
  records: Sequence[Mapping[str, Any]], name: str, *, run: str | None = None
) -> list[tuple[int, float]]:
  """Extracts one scalar's ``(round, value)`` points, sorted by round.

  The shape :func:`fedjax_mm.runner.report.plot_curves` takes for one line.

  Args:
    records: the output of :func:`read_metrics`.
    name: the scalar's key, e.g. ``"delta"``.
    run: keep only the records of this run; all runs when None.

  Returns:
    ``[(round, value), ...]`` over the records that hold ``name``.
  """
  points = [
    (int(r["round"]), float(r[name]))
    for r in records
    if name in r and (run is None or r.get("run") == run)
  ]
  return sorted(points, key=lambda p: p[0])


class MetricWriter:
  """Writes per-round scalars of one run to ``metrics.jsonl`` and TensorBoard.

  See the module docstring for the file layout, value encoding (non-finite
  floats become JSON ``null``) and resume semantics. Usable as a context
  manager, which closes it.

  Attributes:
    workdir: the run's folder.
    run: the run's name, the ``"run"`` field of its lines and its ``tb/``
      subfolder.
    path: the JSON Lines file.
  """

  def __init__(
    self,
    workdir: str | os.PathLike[str],
    run: str,
    *,
    resume_round: int | None = None,
    tensorboard: bool = True,
  ):
    """Opens the writer, creating ``workdir`` if needed.

    Args:
      workdir: the run's folder (usually prepared by
        :func:`fedjax_mm.runner.workdir.prepare_workdir`).
      run: the run's name; a non-empty string usable as a folder name.
      resume_round: when resuming from a checkpoint taken after round ``r``,
        pass ``r``: this run's lines with ``round > r`` are dropped and
        TensorBoard purges those steps. ``-1`` drops all of the run's lines.
        None (a fresh run) keeps the file as it is.
      tensorboard: also write TensorBoard event files (if ``tensorboardX`` is
        installed).

    Raises:
      ValueError: ``run`` is empty or contains a path separator.
    """
    if not run or "/" in run or "\\" in run or run in (".", ".."):
      raise ValueError(f"run must be a non-empty name without path separators, got {run!r}")
    self.workdir = Path(workdir)
    self.run = run
    self.path = self.workdir / METRICS_FILE
    self.workdir.mkdir(parents=True, exist_ok=True)
    self._repair(resume_round)
    # No handle is kept open: write() appends through a fresh one, so a writer
    # made before another writer's repair (an atomic rename) still writes to
    # the file on disk, not to the replaced inode.
    self._tb = self._open_tensorboard(resume_round) if tensorboard else None
    self._closed = False

  def _repair(self, resume_round: int | None) -> None:
    """Drops a torn last line and, on resume, this run's rounds past ``resume_round``."""
    if not self.path.exists():
      return
    records, raw, torn = _parse_lines(self.path)
    keep = [
      line
      for record, line in zip(records, raw, strict=True)
      if resume_round is None
      or record.get("run") != self.run
      or int(record.get("round", -1)) <= resume_round
    ]
    if len(keep) == len(raw) and not torn:
      return
    tmp = self.path.with_name(f".{METRICS_FILE}.tmp")
    tmp.write_text("".join(line + "\n" for line in keep), encoding="utf-8")
    os.replace(tmp, self.path)

  def _open_tensorboard(self, resume_round: int | None) -> Any:
    """Returns a ``tensorboardX.SummaryWriter``, or None (with one warning) without it."""
    global _warned_no_tensorboard
    try:
      import tensorboardX  # Lazy: optional, and slow to import.
    except ImportError:
      if not _warned_no_tensorboard:
        _warned_no_tensorboard = True
        warnings.warn(
          "tensorboardX is not installed: metrics go to metrics.jsonl only "
          "(pip install tensorboardX for TensorBoard event files).",
          RuntimeWarning,
          stacklevel=3,
        )
      return None
    purge_step = None if resume_round is None else resume_round + 1
    # tensorboardX names event files by the second and opens them with "wb": a
    # writer reopened within the same second would truncate the previous file.
    # A nanosecond suffix keeps names distinct and in creation order, the order
    # in which TensorBoard reads them (which the purge relies on).
    return tensorboardX.SummaryWriter(
      logdir=str(self.workdir / TB_DIR / self.run),
      purge_step=purge_step,
      filename_suffix=f".{time.time_ns()}",
    )

  def write(self, round: int, scalars: Mapping[str, Any]) -> None:
    """Writes one round's scalars as one JSON line and one TensorBoard step.

    Args:
      round: the round (TensorBoard step); a non-negative integer.
      scalars: name -> real scalar (Python or numpy scalar, 0-d numpy or jax
        array). Names are strings other than ``"round"`` and ``"run"``; ``/``
        groups tags in TensorBoard (``"user_3/f1"``).

    Raises:
      TypeError: a value is not a real scalar, or a name is not a string, or
        ``round`` is not an integer.
      ValueError: a reserved name, a negative round, or a closed writer.
    """
    if self._closed:
      raise ValueError(f"MetricWriter for run {self.run!r} is closed")
    if isinstance(round, bool) or not isinstance(round, int | np.integer):
      raise TypeError(f"round must be an integer, got {type(round).__name__}")
    round = int(round)
    if round < 0:
      raise ValueError(f"round must be non-negative, got {round}")
    values: dict[str, int | float] = {}
    for key, value in scalars.items():
      if not isinstance(key, str):
        raise TypeError(f"metric names must be strings, got {key!r}")
      if key in _RESERVED:
        raise ValueError(f"metric name {key!r} is reserved (the JSON line carries it)")
      values[key] = _to_scalar(key, value)
    record = {"round": round, "run": self.run}
    record.update({k: _json_value(v) for k, v in values.items()})
    # allow_nan=False: a non-finite value reaching here would be a bug, not a NaN token.
    with open(self.path, "a", encoding="utf-8") as file:
      file.write(json.dumps(record, allow_nan=False) + "\n")
    if self._tb is not None:
      for key, value in values.items():
        self._tb.add_scalar(key, value, global_step=round)

  def flush(self) -> None:
    """Pushes buffered data to disk (JSON Lines to the OS, TensorBoard events to files)."""
    if self._closed:
      return
    if self._tb is not None:
      self._tb.flush()

  def close(self) -> None:
    """Flushes and closes both outputs; further writes raise, closing again is a no-op."""
    if self._closed:
      return
    self._closed = True
    if self._tb is not None:
      self._tb.close()

  def __enter__(self) -> MetricWriter:
    return self

  def __exit__(self, *exc_info: object) -> None:
    self.close()
