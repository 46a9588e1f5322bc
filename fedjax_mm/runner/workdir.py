"""The experiment workdir: one folder per run, its config, and the resume decision.

A run owns one *workdir*. Everything it produces lives there: ``config.json``
(the exact configuration, written once at the start), ``metrics.jsonl`` and
``tb/`` (:mod:`fedjax_mm.runner.writers`), Orbax checkpoints and the final
report. :func:`prepare_workdir` is called once, before anything else is
written, and decides between three outcomes:

==========================================  ==========================================
state of ``<workdir>``                      outcome
==========================================  ==========================================
missing, or an empty folder                 create it, write ``config.json``; fresh run
holds a ``config.json`` equal to ``config``  resume (nothing is written)
holds a different ``config.json``            :class:`WorkdirError`; with ``overwrite``:
                                            move it aside, fresh run
non-empty folder without ``config.json``     :class:`WorkdirError`; with ``overwrite``:
                                            move it aside, fresh run
a file, not a folder                        :class:`WorkdirError` (even with ``overwrite``)
==========================================  ==========================================

Design choices:

* **Resume is decided by the config, not by the command line.** Relaunching the
  same command after a crash or a preemption continues the run (big_vision's
  order: resume first when the workdir already holds state); this holds even
  when ``overwrite=True``, so a preemptible job launched with ``--overwrite``
  does not restart from scratch at every relaunch. To restart a run with an
  unchanged config, move or delete its workdir, or choose another.
* **Configs are compared canonically.** Both sides go through JSON with sorted
  keys, so key order and tuple-versus-list (``(1, 2)`` and ``[1, 2]``) do not
  matter, while ``1`` versus ``1.0`` and ``"1"`` versus ``1`` do.
* **Nothing is ever deleted.** ``overwrite=True`` renames the old workdir to
  ``<workdir>.old-<YYYYmmdd-HHMMSS>`` (with a ``-2``, ``-3`` ... suffix if that
  name is taken) and starts a fresh one; the caller can delete the old folder
  when it is sure. Errors are one line and say which flag to pass.
* **Atomic config write.** ``config.json`` is written to a temporary file and
  renamed, so a crash never leaves a half-written config that would block the
  next launch.

This module is host-side bookkeeping and imports neither jax nor numpy. In a
multi-process job only process 0 should call :func:`prepare_workdir`; the
others may wait on a barrier and then read the result from the file system.

Typical use::

  config_dict = config.to_dict()            # ml_collections.ConfigDict -> dict
  resumed = prepare_workdir(workdir, config_dict, overwrite=FLAGS.overwrite)
  if resumed:
    ...  # restore the latest checkpoint, if any (a crash may precede the first one)
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CONFIG_FILE", "WorkdirError", "config_diff", "prepare_workdir"]

#: Name of the config file inside a workdir.
CONFIG_FILE = "config.json"

# How many differing keys a WorkdirError names before "... and N more".
_MAX_KEYS_IN_MESSAGE = 3
# Longest rendering of one value in a diff line; longer values are cut.
_MAX_VALUE_CHARS = 60

_MISSING = object()


class WorkdirError(ValueError):
  """The workdir cannot be used as asked; the message says why and what to do."""


def _canonical(config: Any) -> str:
  """Returns the canonical JSON text of ``config`` (sorted keys, compact).

  Raises:
    TypeError: if ``config`` is not JSON-serialisable.
  """
  try:
    return json.dumps(config, sort_keys=True, separators=(",", ":"))
  except (TypeError, ValueError) as e:
    raise TypeError(
      f"config must be a JSON-serialisable mapping (pass ConfigDict.to_dict()): {e}"
    ) from e


def _render(value: Any) -> str:
  """Renders one config value for a diff line (JSON, cut to a readable length)."""
  if value is _MISSING:
    return "<missing>"
  text = json.dumps(value, sort_keys=True)
  if len(text) > _MAX_VALUE_CHARS:
    text = text[: _MAX_VALUE_CHARS - 3] + "..."
  return text


def config_diff(a: Any, b: Any) -> list[str]:
  """Lists the differences between two configs as ``"dotted.key: a != b"`` lines.

  Nested mappings are walked key by key; any other value (lists included) is
  compared whole, after both sides go through JSON, so tuples equal lists. A
  key present on one side only shows ``<missing>`` on the other. Values are
  printed as JSON (strings quoted), long ones cut to about 60 characters.

  Example:
    >>> config_diff({"muscle": {"tau_full": 0.2}, "seed": 0},
    ...             {"muscle": {"tau_full": 0.3}, "seed": 0})
    ['muscle.tau_full: 0.2 != 0.3']

  Args:
    a: a JSON-serialisable config, usually a nested dict (the one on disk).
    b: another one (the one of this run).

  Returns:
    One line per differing leaf, sorted by key; empty when the configs are
    canonically equal. Differing non-mapping roots give one line keyed
    ``<root>``.
  """
  a = json.loads(_canonical(a))
  b = json.loads(_canonical(b))
  lines: list[str] = []

  def walk(x: Any, y: Any, prefix: str) -> None:
    if isinstance(x, dict) and isinstance(y, dict):
      for key in sorted(set(x) | set(y)):
        path = f"{prefix}.{key}" if prefix else str(key)
        walk(x.get(key, _MISSING), y.get(key, _MISSING), path)
    elif x is _MISSING or y is _MISSING or _canonical(x) != _canonical(y):
      lines.append(f"{prefix or '<root>'}: {_render(x)} != {_render(y)}")

  walk(a, b, "")
  return lines


def _aside_name(workdir: Path) -> Path:
  """Returns a free sibling path ``<workdir>.old-<timestamp>[-n]``."""
  stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
  candidate = workdir.with_name(f"{workdir.name}.old-{stamp}")
  n = 2
  while candidate.exists() or candidate.is_symlink():
    candidate = workdir.with_name(f"{workdir.name}.old-{stamp}-{n}")
    n += 1
  return candidate


def _write_config(workdir: Path, text: str) -> None:
  """Writes ``config.json`` atomically (temporary file, then rename)."""
  target = workdir / CONFIG_FILE
  tmp = workdir / f".{CONFIG_FILE}.tmp"
  tmp.write_text(text + "\n", encoding="utf-8")
  os.replace(tmp, target)


def prepare_workdir(
  workdir: str | os.PathLike[str], config: Mapping[str, Any], *, overwrite: bool = False
) -> bool:
  """Creates or checks a run's workdir and tells whether the run resumes.

  See the module docstring for the full table. In short: a missing or empty
  folder starts a fresh run; a folder whose ``config.json`` equals ``config``
  (canonically: key order and tuple-versus-list ignored) resumes, whatever
  ``overwrite`` says; anything else is refused, unless ``overwrite=True``, in
  which case the old folder is **moved aside** to
  ``<workdir>.old-<YYYYmmdd-HHMMSS>`` (never deleted) and a fresh run starts.

  Args:
    workdir: the run's folder; parents are created as needed.
    config: the run's config as a plain JSON-serialisable mapping (for an
      ``ml_collections.ConfigDict``, pass ``config.to_dict()``).
    overwrite: move a conflicting workdir aside instead of refusing it.

  Returns:
    True when this is a resume (``config.json`` already there and equal), in
    which case nothing was written; False for a fresh run, in which case
    ``<workdir>/config.json`` now holds ``config`` (sorted keys, indent 2).

  Raises:
    WorkdirError: ``workdir`` is a file; or it holds a different config (the
      message names the first differing dotted keys); or it is a non-empty
      folder without ``config.json``, or with an unreadable one. The last two
      are lifted by ``overwrite=True``; a file never is.
    TypeError: ``config`` is not JSON-serialisable.
  """
  workdir = Path(workdir).expanduser()
  canonical = _canonical(config)
  pretty = json.dumps(json.loads(canonical), sort_keys=True, indent=2)

  if workdir.exists() and not workdir.is_dir():
    raise WorkdirError(f"--workdir {workdir} is a file, not a folder; choose another --workdir.")

  if workdir.is_dir() and any(workdir.iterdir()):
    config_path = workdir / CONFIG_FILE
    problem: str
    if config_path.is_file():
      try:
        stored = json.loads(config_path.read_text(encoding="utf-8"))
      except (OSError, ValueError) as e:
        problem = f"holds an unreadable {CONFIG_FILE} ({type(e).__name__}: {e})"
      else:
        if _canonical(stored) == canonical:
          return True
        diff = config_diff(stored, config)
        shown = "; ".join(diff[:_MAX_KEYS_IN_MESSAGE])
        more = len(diff) - _MAX_KEYS_IN_MESSAGE
        if more > 0:
          shown += f"; ... and {more} more"
        problem = f"holds a run with a different config (stored != this run: {shown})"
    else:
      problem = f"is not empty and has no {CONFIG_FILE}, so it is not a run of this library"
    if not overwrite:
      raise WorkdirError(
        f"--workdir {workdir} {problem}; pass --overwrite to move it aside and start "
        "afresh, or choose another --workdir."
      )
    workdir.rename(_aside_name(workdir))

  workdir.mkdir(parents=True, exist_ok=True)
  _write_config(workdir, pretty)
  return False
