r"""Mean ± standard deviation over seeds of finished runs.

  python -m experiments.summarize runs/creamfl_s*       # the system's own tables
  python -m experiments.summarize runs/fedmuscle_* [--keys=delta] [--scale=100]
  python -m experiments.summarize --format=generic --keys=r1_sum.CreamFL --scale=1 runs/creamfl_*

Every ``results.json`` names the system that wrote it (``"system": "creamfl"``,
:class:`fedjax_mm.runner.loop.System`), and the command picks the table by it:
a system with a summary of its own (:attr:`~fedjax_mm.runner.loop.System.summarize`:
FedSCMR's ranking and paper-style Tables 1-4, CreamFL's Table 1 with one
Recall@K table per test size and its chance rows, FedRGB's retrieval table with
FedRGB - FedAvg paired by seed, RCSR's table with RCSR minus every other row
paired by seed) prints it, each cell the mean ± std over the runs, and those runs
must differ in nothing but the seed (:func:`fedjax_mm.runner.report.load_seed_runs`).
FedMuscle's runs, and ``--format=generic``, get the generic table: the runs are
grouped by their config with ``seed`` left out (runs that differ only in the seed
are one group; the group's label is the config keys that set it apart from the
other groups), one markdown row per group: the number of seeds and, for each key
of ``results.json`` asked for, the mean ± sample standard deviation. A key may
index into a list (``fedmuscle.0``: user 1's metric). Values are multiplied by
``--scale`` (100 turns fractions into percentages). A CreamFL sweep (runs that
differ in one config key, e.g. ``creamfl.lcr_weight``) reads well in it:
``--format=generic --keys=r1_sum.CreamFL --scale=1 --digits=2``.

Runs written before ``results.json`` named its system take ``--format=<system>``
for a system's table (the generic table otherwise), and are told apart by their
top-level keys (:data:`FORMAT_KEYS`).

A workdir that is not a finished run (no ``config.json``, or no ``results.json``:
still running, stopped or preempted) is refused before anything is read, all of
them in one ``error:`` line with how far each got, exit status 2: a mean over
fewer seeds than were asked for would pass unnoticed. So are, in one line each, runs
of different systems, runs of another system than ``--format``'s, a ``--keys`` entry
that is not a number in every run's ``results.json`` (with what the run is and the
numbers it holds), and a system's runs whose configs differ in more than the seed.
"""

from __future__ import annotations

import json
import pathlib
import sys
from collections.abc import Sequence

from absl import app, flags

from fedjax_mm.runner import format_table, mean_std
from fedjax_mm.runner.errors import SummaryError
from fedjax_mm.runner.workdir import config_diff

_KEYS = flags.DEFINE_list("keys", ["delta"], "results.json keys to summarise (dotted paths).")
_SCALE = flags.DEFINE_float("scale", 100.0, "Factor applied to every value before printing.")
_DIGITS = flags.DEFINE_integer("digits", 1, "Decimals to print.")
#: The systems whose tables ``--format`` names for runs that do not name their system.
SYSTEM_FORMATS = ("fedscmr", "creamfl", "fedrgb", "rcsr")

_FORMAT = flags.DEFINE_enum(
  "format",
  None,
  ["generic", *SYSTEM_FORMATS],
  "generic table, or the table of a system (FedSCMR's Tables 1-4, CreamFL's Recall@K table,"
  " FedRGB's or RCSR's retrieval table). Default: the system results.json names.",
)


#: What marks a run of each system from before results.json named it: its top-level keys.
FORMAT_KEYS = {
  "fedscmr": ("ns", "methods_global"),
  "creamfl": ("r1_sum", "recall"),
  "fedrgb": ("methods", "distortion_steps"),
  "rcsr": ("methods", "modality"),
}


def _results(workdir: pathlib.Path) -> dict:
  return json.loads((pathlib.Path(workdir) / "results.json").read_text())


def _kind(results: dict) -> str:
  """Which experiment wrote ``results``, as the command reads it: a system's table,
  FedMuscle's generic table, or neither."""
  if "system" in results:
    return f"a {results['system']} run"
  for name, keys in FORMAT_KEYS.items():
    if all(k in results for k in keys):
      return f"a {name} run: --format={name}"
  if "delta" in results:
    return "a fedmuscle run: the generic table"
  if "pairs" in results and "trivial" in results:
    return "a pretraining run: its report.md holds its table"
  return "no run this command has a table for"


def _system_of(results: dict) -> str | None:
  """The system that wrote ``results``: its ``"system"``, else (an older run) the
  system whose :data:`FORMAT_KEYS` it holds; None for neither."""
  if "system" in results:
    return results["system"]
  return next((n for n, keys in FORMAT_KEYS.items() if all(k in results for k in keys)), None)


def wrong_format(workdirs: Sequence[str | pathlib.Path], fmt: str) -> list[str]:
  """Each of ``workdirs`` whose ``results.json`` is not a run of ``fmt``, with what it is."""
  problems = []
  for workdir in map(pathlib.Path, workdirs):
    results = _results(workdir)
    if _system_of(results) != fmt:
      problems.append(f"{workdir} ({_kind(results)})")
  return problems


def table_of(workdirs: Sequence[str | pathlib.Path], fmt: str | None = None) -> str:
  """The table to print for ``workdirs``: ``"generic"`` or the system whose summary it is.

  ``fmt`` is ``--format`` (None: the runs' own ``"system"``). Runs that name their
  system must all name the same one; a system whose
  :attr:`~fedjax_mm.runner.loop.System.summarize` is None (FedMuscle) gets the
  generic table, and so do older runs that name none.

  Raises:
    SummaryError: runs of different systems, or not of ``fmt``'s.
  """
  named = {pathlib.Path(w): _results(w).get("system") for w in workdirs}
  systems = sorted({s for s in named.values() if s is not None})
  if len(systems) > 1 or (systems and None in named.values()):
    listed = "; ".join(f"{w} ({s or 'names no system'})" for w, s in named.items())
    raise SummaryError(f"the runs are of different systems: {listed}; summarise them separately.")
  if fmt is None:
    if not systems:
      return "generic"
    from fedjax_mm import runner  # The runners import jax: only when a run names one.

    try:
      found = runner.system(systems[0])
    except KeyError:
      raise SummaryError(f"the runs are of {systems[0]!r}, no system this command knows.") from None
    return systems[0] if found is not None and found.summarize is not None else "generic"
  if fmt != "generic":
    problems = wrong_format(workdirs, fmt)
    if problems:
      raise SummaryError(f"not {fmt} runs: {'; '.join(problems)}.")
  return fmt


def _numeric_keys(value, prefix="") -> list[str]:
  """Dotted paths of the numbers in a results document (list items by index)."""
  if isinstance(value, (int, float)) and not isinstance(value, bool):
    return [prefix]
  if isinstance(value, dict):
    items = value.items()
  elif isinstance(value, list):
    items = enumerate(value)
  else:  # A string, a bool, None.
    return []
  return [p for k, v in items for p in _numeric_keys(v, f"{prefix}.{k}" if prefix else str(k))]


def _lookup(results: dict, key: str) -> float:
  value = results
  for part in key.split("."):
    value = value[int(part)] if isinstance(value, list) else value[part]
  return float(value)


def _get(config: dict, dotted: str):
  value = config
  for part in dotted.split("."):
    value = value.get(part) if isinstance(value, dict) else None
  return value


def _without_seed(config: dict) -> dict:
  return {k: v for k, v in config.items() if k != "seed"}


def summarize(
  workdirs: Sequence[str | pathlib.Path], keys: Sequence[str], *, scale: float, digits: int
) -> str:
  """The summary table of ``workdirs`` (see the module docstring)."""
  runs = []
  for workdir in map(pathlib.Path, workdirs):
    results_path = workdir / "results.json"
    if not results_path.exists():
      raise FileNotFoundError(f"{workdir} has no results.json: the run has not finished.")
    config = json.loads((workdir / "config.json").read_text())
    runs.append((workdir, config, json.loads(results_path.read_text())))
  if not runs:
    raise ValueError("no workdirs given.")
  for workdir, _, results in runs:
    numbers = _numeric_keys(results)
    missing = [k for k in keys if k not in numbers]
    if missing:
      shown = ", ".join(numbers[:12]) + (
        f" and {len(numbers) - 12} more" if len(numbers) > 12 else ""
      )
      raise SummaryError(
        f"{workdir}/results.json has no number at {', '.join(map(repr, missing))} (--keys); "
        f"it is {_kind(results)}; its numbers: {shown or 'none'}."
      )

  groups: dict[str, list] = {}
  for workdir, config, results in runs:
    key = json.dumps(_without_seed(config), sort_keys=True)
    groups.setdefault(key, []).append((workdir, config, results))
  reference = _without_seed(runs[0][1])
  varying = sorted(
    {
      line.split(":")[0]
      for members in groups.values()
      for line in config_diff(reference, _without_seed(members[0][1]))
    }
  )
  rows = []
  for members in groups.values():
    config = members[0][1]
    label = ", ".join(f"{k}={json.dumps(_get(config, k))}" for k in varying)
    seeds = sorted(c.get("seed") for _, c, _ in members)
    cells = [
      mean_std([_lookup(results, k) for _, _, results in members], scale=scale, digits=digits)
      for k in keys
    ]
    rows.append([label or "all runs", ",".join(map(str, seeds)), *cells])
  return format_table(["config", "seeds", *keys], rows)


def _progress(workdir: pathlib.Path, rounds) -> str:
  """How far an unfinished run got: its newest finalised checkpoint, of its rounds."""
  # Orbax writes a step under a temporary name and renames it to the bare number when
  # it is finalised; a damaged step set aside is renamed too (core.checkpoint).
  folder = workdir / "checkpoints"
  steps = [int(p.name) for p in folder.iterdir() if p.name.isdigit()] if folder.is_dir() else []
  of = f" of {rounds}" if isinstance(rounds, int) else ""
  return f"checkpointed at round {max(steps)}{of}" if steps else "no round checkpointed"


def unfinished(workdirs: Sequence[str | pathlib.Path]) -> list[str]:
  """What keeps each of ``workdirs`` from being summarised, one phrase each; empty if none.

  A folder that is no run's workdir (no ``config.json``), or a run without
  ``results.json`` (still running, stopped, or preempted), with how far it got.
  """
  problems = []
  for workdir in map(pathlib.Path, workdirs):
    if not (workdir / "config.json").is_file():
      what = "no such folder" if not workdir.exists() else "no config.json: not a run's workdir"
      problems.append(f"{workdir} ({what})")
    elif not (workdir / "results.json").is_file():
      try:
        rounds = json.loads((workdir / "config.json").read_text()).get("rounds")
      except (OSError, ValueError):
        rounds = None
      problems.append(f"{workdir} (unfinished: {_progress(workdir, rounds)})")
  return problems


def main(argv):
  if len(argv) < 2:
    raise app.UsageError("give one or more workdirs.")
  problems = unfinished(argv[1:])
  if problems:  # Never a mean over fewer seeds than asked for.
    print(
      f"error: cannot summarise {'; '.join(problems)}. Finish a run with the command that "
      "started it (it resumes), or leave it out.",
      file=sys.stderr,
    )
    sys.exit(2)
  try:
    table = table_of(argv[1:], _FORMAT.value)
    if table == "generic":
      print(summarize(argv[1:], _KEYS.value, scale=_SCALE.value, digits=_DIGITS.value))
      return
    from fedjax_mm import runner  # The runners import jax: only when asked for.

    print(runner.system(table).summarize(argv[1:]))
  except SummaryError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main)
