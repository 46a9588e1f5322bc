"""The experiment loop: one for every system, which plugs in as an :class:`Experiment`.

``python -m experiments.main --config=experiments/<system>.py`` ends in
:func:`run`. A system (FedMuscle, CreamFL, FedSCMR, ...) says what it trains
and how it reads its results; the loop does everything a run of any system
needs, in one place:

* **Validation first.** ``build(config)`` is called before the workdir is
  touched: a bad config raises :class:`~fedjax_mm.runner.errors.ConfigError`
  and nothing is written or compiled.
* **Workdir.** :func:`~fedjax_mm.runner.workdir.claim_workdir`:
  :func:`~fedjax_mm.runner.workdir.lock_workdir` (one run per workdir), then
  :func:`~fedjax_mm.runner.workdir.prepare_workdir`: a fresh run, a resume
  (same config), or a refusal (another config; ``overwrite`` moves it aside).
* **Resume, bit for bit.** Every method's state is checkpointed after every
  ``config.checkpoint_every`` rounds and after the last one, with the
  communication ledgers in the step's metadata. A rerun restores the newest
  intact checkpoint (:meth:`~fedjax_mm.core.checkpoint.Checkpointer.restore_latest_good`
  sets damaged ones aside), drops the metric lines of rounds after it, and
  continues: the rounds that follow see exactly the arrays, keys and byte counts
  they saw the first time, so ``metrics.jsonl`` and ``results.json`` equal an
  uninterrupted run's (wall time aside), whenever the process was killed
  (tested with SIGKILL inside a round, a checkpoint write and the report).
  The metadata also records the packed states' sizes: checkpoints of a job on
  another number of processes, whose groups were padded to another multiple of
  its devices, are refused in one line (``WorkdirError``) before any restore.
* **Checkpoints packed per dtype.** Orbax spends milliseconds per leaf and a
  run holds one state per method with hundreds of leaves each, so each state
  is stored as one flat vector per dtype (typed PRNG keys as their key data)
  and unpacked onto the shardings of the freshly built states.
* **A resume compiles nothing new.** A restored state has the fresh state's
  types and placements: the loop gives a fresh state's weakly typed leaves
  (``jnp.full(n, 0.5)``) their dtype before the first round, as a restored
  checkpoint has them, and :func:`_unpack` leaves uncommitted leaves
  uncommitted. So a rerun's rounds and evaluations are the programs the first
  run compiled, found in the compilation cache (``--compilation_cache``); the
  end-to-end tests check that a resume adds no program to it but the
  unpacking's slices.
* **NaN/Inf guard.** After each method's round, :attr:`Experiment.nonfinite`
  names whoever produced a non-finite update; the run stops with
  :class:`~fedjax_mm.runner.errors.NonFiniteError` before that state is
  evaluated, logged or saved, and the message says what a relaunch resumes from.
* **Ledger.** :attr:`Experiment.traffic` gives the bytes each user sent and
  received in a method's round; the loop keeps one
  :class:`~fedjax_mm.core.ledger.Ledger` per method that sends anything, and
  the checkpoint carries them, so a resumed run continues the same counts.
* **Several processes, one writer.** In a job started with
  ``jax.distributed.initialize()`` every process runs the whole loop (the
  rounds, evaluations and Orbax checkpoints are collective; a system's clients
  may be split over every process's devices, so each round's output is read
  through :func:`fedjax_mm.core.processes.gather`), and only process 0
  (:func:`fedjax_mm.core.processes.is_primary`) writes: it takes the lock and
  prepares the workdir (:func:`~fedjax_mm.runner.workdir.claim_workdir`, which
  tells the others whether to resume), writes the metric lines, shows the
  progress bar, and writes and prints the report. The others are quiet.
* **Metrics, progress, report.** Rows of :attr:`Experiment.scalars` go to
  ``metrics.jsonl`` and TensorBoard (one :class:`MetricWriter` per run name);
  a progress bar shows :attr:`Experiment.postfix`. At the end
  :attr:`Experiment.report` turns the last evaluation and the history read
  back from ``metrics.jsonl`` (the same lines whether or not the run was
  resumed) into a :class:`Report`, which the loop writes as ``report.md``, PNG
  plots and ``results.json`` (atomically, its first key ``"system"``: the
  :attr:`System.name`), and prints.

Order within a round: every method in turn runs its round, is checked, is
counted in the ledger, and is evaluated when the round is an evaluation round
(every ``eval_every`` rounds and the last); then the round's metric rows are
written, then the checkpoint is started (Orbax writes it in the background). A
kill leaves at most rows of rounds newer than the newest finalised
checkpoint, which the rerun drops and writes again.

**Preemption.** In a job of several processes, JAX takes SIGTERM in each (its
preemption notifier) and shares the notice; after each round the processes ask
:func:`fedjax_mm.core.processes.preempted`, agree on one round, checkpoint it
whatever ``checkpoint_every`` says, and raise
:class:`~fedjax_mm.runner.errors.Preempted` together (``experiments/main.py``
exits 143). With one process, SIGTERM is ``main.py``'s own handler.

The interface follows fedjax's ``FederatedAlgorithm`` and optax's
``GradientTransformation``: a tuple of functions with no hidden state. A system
is a :class:`System` (big_vision's one trainer, each project its model and
evaluators): its name, the methods its ``config.methods`` may name, its
``validate`` (the shared :func:`~fedjax_mm.runner.validation.check_methods`
first, then its checks between fields), its ``experiment(config) ->
Experiment`` (data, models, algorithms; evaluation and traffic as functions),
optionally the declarative spec of its result table
(:class:`~fedjax_mm.runner.report.Table`), a hook for report sections beyond
the table, and its summary over seeds. A module defines one as ``SYSTEM``;
``SYSTEM.run`` is the entry point, and its config stem joins
:data:`fedjax_mm.runner.EXPERIMENTS`, through which ``experiments/main.py``
finds it. :func:`run` still takes a bare ``experiment`` function too (a toy, a
system not yet declared).
"""

from __future__ import annotations

import contextlib
import json
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mm.core import processes
from fedjax_mm.core.checkpoint import Checkpointer
from fedjax_mm.core.ledger import Ledger, format_bytes, tree_bytes
from fedjax_mm.runner import report as report_lib
from fedjax_mm.runner.errors import (
  ConfigError,
  NonFiniteError,
  Preempted,
  SummaryError,
  checkpoint_note,
)
from fedjax_mm.runner.workdir import WorkdirError, claim_workdir
from fedjax_mm.runner.writers import MetricWriter, read_metrics

__all__ = ["Curves", "Experiment", "Outcome", "Report", "System", "run"]

#: A method's jitted round: its state (donated) -> (next state, round output).
RoundFn = Callable[[Any], tuple[Any, Any]]
#: One line of ``metrics.jsonl``: (run name, scalars).
Row = tuple[str, Mapping[str, Any]]


class Curves(NamedTuple):
  """One PNG of learning curves: the arguments of :func:`~fedjax_mm.runner.report.plot_curves`."""

  series: Mapping[str, Mapping[str, Sequence[tuple[int, float]]]]
  title: str
  ylabel: str


class Report(NamedTuple):
  """What a run leaves behind, as the loop writes it.

  Attributes:
    title: ``# title`` of ``report.md``.
    sections: ``(heading, markdown body)`` pairs of ``report.md``.
    plots: PNG file name in the workdir -> its curves.
    results: written to ``results.json`` (indent 2) and returned by :func:`run`.
    text: printed at the end, after a blank line, the result tables and the
      system's extra sections (:attr:`System.sections`).
    final: method -> its metrics as the system's result tables
      (:attr:`System.tables`) read them, nested (flattened to their column keys by
      :func:`~fedjax_mm.runner.report.flatten`).
    baselines: baseline row name (``"chance"``, ``"majority class"``) -> its
      metrics, nested the same way.
    tail: ``report.md`` sections after the result tables and :attr:`System.sections`
      (the curves).
  """

  title: str
  sections: Sequence[tuple[str, str]]
  plots: Mapping[str, Curves]
  results: Mapping[str, Any]
  text: str
  final: Mapping[str, Any] = {}
  baselines: Mapping[str, Any] = {}
  tail: Sequence[tuple[str, str]] = ()


class Outcome(NamedTuple):
  """What :attr:`Experiment.report` is given.

  Attributes:
    final: method -> :attr:`Experiment.evaluate` of its state after the last
      round (evaluated anew when a rerun finds the last round checkpointed).
    history: every line of ``metrics.jsonl``
      (:func:`~fedjax_mm.runner.writers.read_metrics`: ``null`` read as NaN),
      the rounds before a resume included.
    ledgers: method -> bytes per user and round, for the methods that sent any.
    wall_time_s: seconds since the workdir was prepared (this process only).
    resumed_at: the round the run resumed from; 0 for a run from scratch.
  """

  final: Mapping[str, Any]
  history: Sequence[Mapping[str, Any]]
  ledgers: Mapping[str, Ledger]
  wall_time_s: float
  resumed_at: int


def fault_scalars(out: Mapping[str, Any], prefix: str = "") -> dict[str, float]:
  """A round's simulated-fault counts as metrics (none when it simulated no faults).

  ``<prefix>faults/dropped``, ``.../stragglers`` and ``.../byzantine`` from
  ``out["fault_counts"]`` (:meth:`fedjax_mm.core.faults.FaultMasks.counts`); every
  runner logs them in each round's ``metrics.jsonl`` line.
  """
  counts = out.get("fault_counts") or {}
  return {f"{prefix}faults/{k}": float(v) for k, v in counts.items()}


def _no_traffic(method: str, out: Any) -> None:
  del method, out


def _no_postfix(evals: Mapping[str, Any]) -> Mapping[str, str]:
  del evals
  return {}


class Experiment(NamedTuple):
  """One system as :func:`run` drives it; built per config by the system's ``experiment(config)``.

  Every function closes over what the system built (models, data, jitted
  steps); none keeps state between calls. ``method`` below is a key of
  :attr:`methods`; the loop runs methods in that order.

  Attributes:
    init: ``() -> {method: state}``, the initial states, placed where the
      rounds expect them. Each method's state must own its buffers, since its
      round donates them (copy a state shared by several methods). Called once
      per run; on resume the states only give the checkpoint its structure and
      shardings.
    methods: method -> its jitted round, ``state -> (state, out)``, with the
      state donated. ``out`` is whatever the functions below read.
    evaluate: ``state -> metrics`` (host values, JSON-ready): a method's
      evaluation, after evaluation rounds and for :attr:`Outcome.final`.
    nonfinite: ``out -> names``: who produced NaN/Inf in this round (empty
      when all is finite). The loop raises ``NonFiniteError`` naming them.
    scalars: ``(round, {method: out}, {method: metrics}) -> [(run, scalars)]``,
      the round's lines of ``metrics.jsonl`` in order. ``metrics`` holds the
      methods evaluated this round (none outside evaluation rounds).
    runs: the run names :attr:`scalars` writes under (one MetricWriter each).
    report: ``Outcome -> Report``.
    traffic: ``(method, out) -> (up, down) | None``: bytes each user sent and
      received in the round (``[num_users]`` each), None when the method sent
      nothing. The default counts nothing.
    eval_every: evaluate every this many rounds (and after the last one).
    postfix: ``{method: metrics} -> {label: text}`` shown beside the progress
      bar after a round; nothing when empty.
  """

  init: Callable[[], Mapping[str, Any]]
  methods: Mapping[str, RoundFn]
  evaluate: Callable[[Any], Any]
  nonfinite: Callable[[Any], Sequence[str]]
  scalars: Callable[[int, Mapping[str, Any], Mapping[str, Any]], Sequence[Row]]
  runs: Sequence[str]
  report: Callable[[Outcome], Report]
  traffic: Callable[[str, Any], tuple[Any, Any] | None] = _no_traffic
  eval_every: int = 1
  postfix: Callable[[Mapping[str, Any]], Mapping[str, str]] = _no_postfix


class System(NamedTuple):
  """One federated system as the loop runs it: what it is, and how it builds a run.

  Attributes:
    name: the system's name (``"creamfl"``): its config stem in
      :data:`fedjax_mm.runner.EXPERIMENTS`, and ``results.json``'s ``"system"``.
    methods: every method ``config.methods`` may name, in report order.
    validate: ``config -> None``, raising a one-line
      :class:`~fedjax_mm.runner.errors.ConfigError`: the shared checks
      (:func:`~fedjax_mm.runner.validation.check_numbers`,
      :func:`~fedjax_mm.runner.validation.check_methods` against
      :attr:`methods`), then the system's checks between fields. Called again by
      :attr:`experiment` before it builds anything.
    experiment: ``config -> Experiment``: data, models and algorithms built,
      with the system's evaluation (``state -> metrics``), traffic and report.
    tables: ``config -> [Table]``, the declarative specs of its result tables
      (:class:`~fedjax_mm.runner.report.Table`: columns, headline, baseline rows,
      reference comparison). The loop renders them after :attr:`Report.sections`
      from :attr:`Report.final` and :attr:`Report.baselines`, which it also writes
      to ``results.json`` ``"report"``; :meth:`summarize` renders them over seeds.
    sections: ``(config, Outcome) -> [(heading, body)]``, report sections that
      are no result table (FedRGB's distortion matrices, FedSCMR's aggregation
      weights), after the result tables; None for none.
  """

  name: str
  methods: Sequence[str]
  validate: Callable[[Any], None]
  experiment: Callable[[Any], Experiment]
  tables: Callable[[Any], Sequence[report_lib.Table]] | None = None
  sections: Callable[[Any, Outcome], Sequence[tuple[str, str]]] | None = None

  def summarize(self, workdirs: Sequence[Any]) -> str:
    """Its result tables over seeds of finished runs (``experiments/summarize.py``):
    :func:`fedjax_mm.runner.report.summarize` of :attr:`tables`."""
    if self.tables is None:
      raise SummaryError(f"{self.name} declares no result table to summarise; use --keys.")
    return report_lib.summarize(workdirs, self.tables)

  def run(
    self,
    config,
    workdir: str | pathlib.Path,
    *,
    overwrite: bool = False,
    progress: bool = True,
  ) -> Mapping[str, Any]:
    """Trains every method of ``config.methods`` in ``workdir``; resumes a run killed there.

    :func:`fedjax_mm.runner.loop.run` of this system (see there).
    """
    return run(self, config, workdir, overwrite=overwrite, progress=progress)


def run(
  build: System | Callable[[Any], Experiment],
  config,
  workdir: str | pathlib.Path,
  *,
  overwrite: bool = False,
  progress: bool = True,
) -> Mapping[str, Any]:
  """Runs ``build(config)`` for ``config.rounds`` rounds in ``workdir``; see the module docstring.

  Args:
    build: the :class:`System`, or a bare ``experiment(config)``; either
      validates the config (raising ``ConfigError``) before anything else
      happens.
    config: an ``ml_collections.ConfigDict`` with ``rounds`` and
      ``checkpoint_every``; stored as ``config.json``.
    workdir: the run's folder.
    overwrite: move a workdir holding another config aside instead of refusing.
    progress: show a progress bar over rounds (on process 0).

  Returns:
    :attr:`Report.results`, after ``"system"``: the :attr:`System.name` when
    ``build`` is a System; also written to ``results.json``. On processes
    other than 0 of a multi-process job, which write no report, ``{}``.

  Raises:
    ConfigError: from ``build``. WorkdirError: the workdir is in use or holds
      another config. CheckpointError: every checkpoint is damaged.
    NonFiniteError: a round produced NaN/Inf. Preempted: in a job of several
      processes, all stopped after the same round on a preemption notice
      (SIGTERM to any of them), that round checkpointed.
  """
  system = build if isinstance(build, System) else None
  experiment = system.experiment(config) if system else build(config)
  _check_memory(experiment)
  workdir = pathlib.Path(workdir)
  writes = processes.is_primary()
  # One run per workdir, taken before anything is written.
  with claim_workdir(workdir, config.to_dict(), overwrite=overwrite) as resumed:
    started = time.time()
    state = {m: strongly_typed(s) for m, s in experiment.init().items()}
    ledgers: dict[str, Ledger] = {}
    with Checkpointer(workdir / "checkpoints", max_to_keep=2) as checkpointer:
      start = 0
      abstract = _abstract(state)
      layout = {m: {d: int(x.size) for d, x in packed.items()} for m, packed in abstract.items()}
      if resumed:
        _check_layout(checkpointer, layout, workdir)
      restored = checkpointer.restore_latest_good(abstract) if resumed else None
      if restored is not None:
        start, packed = restored
        state = {m: _unpack(packed[m], s) for m, s in state.items()}
        stored = checkpointer.restore_metadata(start)["ledgers"]
        ledgers = {m: Ledger.from_dict(d) for m, d in stored.items()}
      # A rerun drops the lines of rounds after the checkpoint, to write them again.
      writers = {
        name: MetricWriter(workdir, name, resume_round=start if resumed else None)
        for name in (experiment.runs if writes else ())
      }
      try:
        final = _rounds(
          experiment,
          config,
          state,
          ledgers,
          start,
          checkpointer,
          writers,
          progress and writes,
          layout,
        )
      finally:
        for writer in writers.values():
          writer.close()
    if not final:  # No round left (a rerun of a finished or report-killed run): evaluate anew.
      final = {m: experiment.evaluate(s) for m, s in state.items()}
    if not writes:
      return {}
    outcome = Outcome(final, read_metrics(workdir), ledgers, time.time() - started, start)
    report = experiment.report(outcome)
    tables = system.tables(config) if system is not None and system.tables else ()
    final = {m: report_lib.flatten(f) for m, f in report.final.items()}
    baselines = {b: report_lib.flatten(v) for b, v in report.baselines.items()}
    rendered = report_lib.render_tables(tables, [final], [baselines])
    extra = system.sections(config, outcome) if system is not None and system.sections else ()
    sections = [*report.sections, *rendered, *extra, *report.tail]
    report_lib.write_report(workdir / "report.md", title=report.title, sections=sections)
    for name, curves in report.plots.items():
      report_lib.plot_curves(
        workdir / name, curves.series, title=curves.title, ylabel=curves.ylabel
      )
    results = dict(report.results)
    if tables:  # What the summary over seeds renders the tables from.
      results["report"] = {"final": final, "baselines": baselines}
    if system is not None:  # Named first, so a reader (experiments/summarize.py) needs no guess.
      results = {"system": system.name, **results}
    report_lib.write_text(workdir / "results.json", json.dumps(results, indent=2))
    shown = [*rendered, *extra]  # the result tables and the system's extra sections
    print("\n" + "\n\n".join([*(f"{t}:\n{b}" for t, b in shown), report.text]))
    return results


def memory_available() -> int | None:
  """Bytes of host memory this process may still take: Linux's ``MemAvailable``, lowered to
  what is left under a cgroup v2 limit (a container's); None where neither can be read."""
  try:
    with open("/proc/meminfo") as f:
      fields = dict(line.split(":", 1) for line in f)
    available = int(fields["MemAvailable"].split()[0]) * 1024
  except (OSError, KeyError, ValueError):
    return None
  try:
    limit = pathlib.Path("/sys/fs/cgroup/memory.max").read_text().strip()
    used = int(pathlib.Path("/sys/fs/cgroup/memory.current").read_text())
    if limit != "max":
      available = min(available, int(limit) - used)
  except (OSError, ValueError):
    pass
  return available


def _check_memory(experiment: Experiment) -> None:
  """Refuses, before anything is made, a run whose states alone exceed the host's memory.

  On a CPU the states of every method live in host memory together, and a run that
  takes more is killed by the system with no word (``Killed``, exit status 137) while
  it builds them: ``experiments/creamfl.py:minilm``, whose 14 rows each hold seven
  MiniLM text towers with their AdamW moments, needs 24.7 GiB for its states on a
  machine with 23. Their sizes come from ``jax.eval_shape(experiment.init)``, which
  allocates nothing. What the rounds need on top (activations, compiled programs) is
  not counted, so a run that passes may still not fit; one that fails cannot. On
  accelerators XLA reports a lack of device memory itself; in a job of several
  processes each holds only its share of the clients, so the whole is no bound.
  """
  if jax.default_backend() != "cpu" or jax.process_count() > 1:
    return
  available = memory_available()
  if available is None:
    return
  sizes = {m: tree_bytes(s) for m, s in jax.eval_shape(experiment.init).items()}
  need = sum(sizes.values())
  if need <= available:
    return
  largest = sorted(sizes, key=sizes.get, reverse=True)[:3]
  raise ConfigError(
    f"the states of the {len(sizes)} methods take {format_bytes(need)} (the largest: "
    + ", ".join(f"{m} {format_bytes(sizes[m])}" for m in largest)
    + f"), more than the {format_bytes(available)} of memory available here, before any activation "
    "or compiled program: the system would kill the run. Run fewer methods "
    "(--config.methods) or smaller models."
  )


def _rounds(experiment, config, state, ledgers, start, checkpointer, writers, progress, layout):
  """Rounds ``start + 1 .. config.rounds``, updating ``state`` and ``ledgers`` in place.

  ``writers`` is empty on the processes that do not write (no metric lines);
  ``layout`` (``{method: {dtype: values}}``, the packed states' sizes) goes into
  every checkpoint's metadata.

  Returns:
    method -> metrics of the last evaluation round run; empty if none ran.
  """
  total = config.rounds
  pack = jax.jit(lambda states: {m: _pack(s) for m, s in states.items()})
  # A resumed job passes rounds 1 .. start first, as processes.preempted requires; a
  # notice taken while it started stops it here, at the round it resumed from.
  for step in range(1, start + 1):
    if processes.preempted(step):
      raise Preempted(start)
  final = {}
  with _progress(start, total, progress) as bar:
    for done in range(start + 1, total + 1):
      evaluating = done % experiment.eval_every == 0 or done == total
      outs, evals = {}, {}
      for m, round_fn in experiment.methods.items():
        _phase(bar, f"{m}: training")
        state[m], out = round_fn(state[m])
        outs[m] = processes.gather(out)  # Clients on other processes' devices: read whole here.
        bad = experiment.nonfinite(outs[m])
        if bad:
          # The note names the step a relaunch resumes from, saves in flight included.
          checkpointer.wait()
          raise NonFiniteError(
            f"{m} round {done}: an update produced NaN/Inf for {', '.join(bad)}; "
            f"{checkpoint_note(checkpointer.latest_step())}."
          )
        sent = experiment.traffic(m, outs[m])
        if sent is not None:
          up, down = sent
          ledger = ledgers.get(m) or Ledger.zeros(len(up))
          ledgers[m] = ledger.add(up=up, down=down, round=done)
        if evaluating:
          _phase(bar, f"{m}: evaluation")
          evals[m] = experiment.evaluate(state[m])
      final.update(evals)
      if writers:
        for name, scalars in experiment.scalars(done, outs, evals):
          writers[name].write(done, scalars)
      # Every process of a job agrees when to stop on a preemption notice (SIGTERM);
      # never with one process. A stop after the last round is no stop.
      stop = processes.preempted(done) and done < total
      if stop or done % config.checkpoint_every == 0 or done == total:
        metadata = {"round": done, "ledgers": ledgers, "layout": layout}
        checkpointer.save(done, pack(state), metadata=metadata)
      postfix = experiment.postfix(evals)
      if bar is not None:
        bar.set_description_str(_BAR, refresh=False)
        if postfix:
          bar.set_postfix(postfix, refresh=False)
        bar.update(1)  # Round `done` is finished: a stop below leaves the bar at it.
      if stop:
        raise Preempted(done)  # The checkpointer finishes the save on the way out.
  return final


#: The rounds' bar's label; within a round it also names the method and its phase, as
#: one round of every method may take minutes (``rounds (fedavg: evaluation)``).
_BAR = "rounds"


def _phase(bar, what: str) -> None:
  """Shows on the bar, at once, what the round is doing now (no-op without a bar)."""
  if bar is not None:
    bar.set_description_str(f"{_BAR} ({what})", refresh=True)


def _progress(start: int, total: int, enabled: bool):
  """A context holding the rounds' bar (None without one), closed however the rounds end.

  The bar counts finished rounds: the loop updates it at the end of each, so a run
  stopped after round R (a preemption) shows R, and one stopped inside round R (a
  NaN) shows R - 1. (tqdm's own iterator counts an item only when the next is asked
  for, so a stop by exception left every bar one round short.)
  """
  if not enabled:
    return contextlib.nullcontext()
  from tqdm.auto import tqdm  # Lazy: only runs with a bar need it.

  return tqdm(initial=start, total=total, desc=_BAR, unit="round", dynamic_ncols=True)


def _key_data(leaf):
  """A typed PRNG key array as its key data; any other leaf as it is."""
  if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.prng_key):
    return jax.random.key_data(leaf)
  return leaf


def _pack(tree: Any) -> dict[str, jax.Array]:
  """The leaves of ``tree`` as one flat array per dtype (typed keys as their key data)."""
  groups: dict[str, list[jax.Array]] = {}
  for leaf in jax.tree.leaves(tree):
    leaf = _key_data(leaf)
    groups.setdefault(str(leaf.dtype), []).append(jnp.ravel(leaf))
  return {dtype: jnp.concatenate(parts) for dtype, parts in groups.items()}


def _check_layout(checkpointer: Checkpointer, layout: Mapping[str, Any], workdir) -> None:
  """Refuses to resume from checkpoints of states packed to other sizes than ``layout``.

  ``layout`` is ``{method: {dtype: values}}``. The sizes depend on the config and,
  for runners that pad their groups to a multiple of the devices (FedSCMR,
  CreamFL), on the devices of every process (:func:`fedjax_mm.core.job_mesh`).
  The config is the same (the workdir checked it), so the job that wrote them ran
  on another number of processes, and its padded groups do not fit this one's. Said
  in one line, before any restore (which would fail on every step and report them
  all as unreadable). Checkpoints written before the layout was recorded, and a
  newest step whose metadata cannot be read (left to
  :meth:`~fedjax_mm.core.checkpoint.Checkpointer.restore_latest_good`), pass.
  """
  step = checkpointer.latest_step()
  if step is None:
    return
  try:
    stored = checkpointer.restore_metadata(step).get("layout")
  except Exception:  # noqa: BLE001 - a damaged step: restore_latest_good sets it aside.
    return
  if stored is None or stored == layout:
    return
  raise WorkdirError(
    f"the checkpoints in {workdir} hold states of other sizes than this run's (round "
    f"{step}: {_sizes(stored)}; this run: {_sizes(layout)}): they were written by a job "
    "on another number of processes (config.devices is per process), whose groups are "
    "padded to another multiple. Resume with the processes that wrote them, or pass "
    "--overwrite to set the workdir aside and start afresh."
  )


def _sizes(layout: Mapping[str, Mapping[str, int]]) -> str:
  return ", ".join(
    f"{m} " + " + ".join(f"{n} {d}" for d, n in sorted(sizes.items()))
    for m, sizes in sorted(layout.items())
  )


def strongly_typed(tree: Any) -> Any:
  """``tree`` with each weakly typed leaf given its dtype (values, placement unchanged).

  A checkpoint restores every leaf with its dtype and no weak type, so a fresh state
  with a weakly typed leaf (``jnp.full(n, 1 / n)``) would have its rounds compiled
  for other argument types than a resumed one: the rerun would compile every round
  again instead of finding them in the compilation cache.
  """
  weak = lambda x: isinstance(x, jax.Array) and jax.typeof(x).weak_type
  return jax.tree.map(lambda x: jax.lax.convert_element_type(x, x.dtype) if weak(x) else x, tree)


def _abstract(state: Mapping[str, Any]) -> dict[str, dict[str, jax.ShapeDtypeStruct]]:
  """The restore target of a checkpoint of ``state``: shapes and dtypes of its packed form."""
  return jax.eval_shape(lambda s: {m: _pack(x) for m, x in s.items()}, state)


def _unpack(packed: Mapping[str, Any], template: Any) -> Any:
  """Inverse of :func:`_pack`: ``packed`` in the structure, and on the shardings, of ``template``.

  Bit-exact: slices of the stored vectors, reshaped, placed where the
  template's leaves live, typed keys rewrapped with the template's key
  implementation. A template leaf that is not committed to a device (what
  ``init`` gives on one device) gives an uncommitted leaf too: a committed one
  would change the argument shardings jit sees, so the resumed run's round would
  miss the compilation cache and compile again.
  """
  leaves, treedef = jax.tree.flatten(template)
  offsets = dict.fromkeys(packed, 0)
  out = []
  for leaf in leaves:
    data = _key_data(leaf)
    dtype, size = str(data.dtype), int(np.prod(data.shape))
    value = jnp.asarray(packed[dtype][offsets[dtype] : offsets[dtype] + size]).reshape(data.shape)
    offsets[dtype] += size
    if data.committed:  # an uncommitted leaf (a fresh state's) stays so, as jit saw it
      value = jax.device_put(value, data.sharding)
    if data is not leaf:
      value = jax.random.wrap_key_data(value, impl=jax.random.key_impl(leaf))
    out.append(value)
  return jax.tree.unflatten(treedef, out)
