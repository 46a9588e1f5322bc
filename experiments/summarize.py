r"""A system's result tables over seeds of finished runs, or a generic table of any keys.

  python -m experiments.summarize runs/creamfl_s*       # the system's own tables
  python -m experiments.summarize --keys=delta --scale=100 runs/fedmuscle_*

Every ``results.json`` names the system that wrote it (``"system": "creamfl"``,
:class:`fedjax_mm.runner.loop.System`), and without ``--keys`` the command prints
that system's result tables over the runs, from the declarative specs the system
states (:attr:`~fedjax_mm.runner.loop.System.tables`) and each run's
``results.json`` ``"report"`` section (:func:`fedjax_mm.runner.report.summarize`):
each cell the mean ± the half-width of its 95% Student-t interval over the seeds,
and for each table's reference comparison (RCSR minus every other method, FedRGB
minus every other, CreamFL minus local and FedAvg, FedSCMR minus FedAvg and DSCMR,
FedMuscle minus every other) the difference paired seed by seed with its mean
[95% interval] and a verdict (:func:`fedjax_mm.metrics.seeds.verdict`: reproduced,
undecided, reversed; "one seed" for one run). Those runs must differ in nothing
but the seed (:func:`fedjax_mm.runner.report.load_seed_runs`).

``--keys`` gives the generic table of any ``results.json`` keys instead: the runs
are grouped by their config with ``seed`` left out (runs that differ only in the
seed are one group; the group's label is the config keys that set it apart from
the other groups), one markdown row per group: the number of seeds and, for each
key asked for, the mean ± sample standard deviation. A key may index into a list
(``fedmuscle.0``: user 1's metric). Values are multiplied by ``--scale`` (100 turns
fractions into percentages). A CreamFL sweep (runs that differ in one config key,
e.g. ``creamfl.lcr_weight``) reads well in it:
``--keys=r1_sum.CreamFL --scale=1 --digits=2``.

A workdir that is not a finished run (no ``config.json``, or no ``results.json``:
still running, stopped or preempted) is refused before anything is read, all of
them in one ``error:`` line with how far each got, exit status 2: a mean over
fewer seeds than were asked for would pass unnoticed. So are, in one line each, a
``results.json`` without ``"system"`` (written before runs named their system),
runs of different systems, a ``--keys`` entry that is not a number in every run's
``results.json`` (with the numbers it holds), and a system's runs whose configs
differ in more than the seed.
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

_KEYS = flags.DEFINE_list(
  "keys", None, "results.json keys (dotted paths) for the generic table; default: the system's."
)
_SCALE = flags.DEFINE_float("scale", 100.0, "--keys: factor applied to every value.")
_DIGITS = flags.DEFINE_integer("digits", 1, "--keys: decimals to print.")


def _results(workdir: pathlib.Path) -> dict:
  return json.loads((pathlib.Path(workdir) / "results.json").read_text())


def system_of(workdirs: Sequence[str | pathlib.Path]) -> str:
  """The system every run of ``workdirs`` names in its ``results.json``.

  Raises:
    SummaryError: a run names none (written before runs named their system), or the
      runs name different systems.
  """
  named = {pathlib.Path(w): _results(w).get("system") for w in workdirs}
  for w, s in named.items():
    if s is None:
      raise SummaryError(
        f"{w}/results.json names no system: it was written before runs named their system; "
        "run it again (it resumes and rewrites results.json), or use --keys."
      )
  if len(set(named.values())) > 1:
    listed = "; ".join(f"{w} ({s})" for w, s in named.items())
    raise SummaryError(f"the runs are of different systems: {listed}; summarise them separately.")
  return next(iter(named.values()))


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
        f"it is a {results.get('system', 'nameless')} run; its numbers: {shown or 'none'}."
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
    if _KEYS.value:
      print(summarize(argv[1:], _KEYS.value, scale=_SCALE.value, digits=_DIGITS.value))
      return
    name = system_of(argv[1:])
    from fedjax_mm import runner  # The runners import jax: only when a run names one.

    try:
      system = runner.system(name)
    except KeyError:
      system = None
    if system is None:
      raise SummaryError(f"the runs are of {name!r}, which has no result tables; use --keys.")
    print(system.summarize(argv[1:]))
  except SummaryError as e:
    print(f"error: {e}", file=sys.stderr)
    sys.exit(2)


if __name__ == "__main__":
  app.run(main)
