"""The experiment runner: the loop every system plugs into, and its host-side plumbing.

:mod:`fedjax_mm.runner.loop` is the one experiment loop (workdir, resume, NaN
guard, ledger, checkpoints, report files); ``fedmuscle``, ``creamfl``,
``fedrgb``, ``fedscmr`` and ``rcsr`` each declare their system as a
:class:`~fedjax_mm.runner.loop.System` named ``SYSTEM`` (:func:`system` finds it
by config name), and ``pretrain`` has a loop of its own. :func:`experiment_runner`
gives the ``run(config, workdir, *, overwrite, progress)`` of any of them
(:data:`EXPERIMENTS`). None of
them is imported here: they import jax.

==========================  ================================================
workdir.prepare_workdir     create / check ``<workdir>``, write ``config.json``,
                            decide fresh run vs resume (``WorkdirError``
                            otherwise; ``overwrite`` moves the old one aside)
workdir.claim_workdir       lock + prepare on process 0 of a job, the outcome
                            (resume / fresh / refused) told to every process
workdir.config_diff         dotted-key differences between two configs
writers.MetricWriter        per-round scalars to ``metrics.jsonl`` and
                            TensorBoard ``tb/<run>/``, resume-safe
writers.read_metrics        load ``metrics.jsonl`` back (``null`` -> NaN)
writers.metric_series       one scalar's ``[(round, value)]`` for a plot
errors.ConfigError          bad config, one line, before any work (exit 2)
errors.NonFiniteError       NaN/Inf in a client update (exit 2)
report.format_table         aligned GitHub-markdown table
report.percent, mean_std    ``+16.9%``, ``+16.9 ± 2.1`` (fractions in)
report.write_report         ``report.md`` from (heading, body) sections
report.write_text           replace a text file atomically (``results.json``)
report.plot_curves          PNG grid of learning curves (Agg, lazy import)
EXPERIMENTS                 config stem -> module of its ``SYSTEM`` / ``run``
system                      the ``System`` of a config stem (None: no system)
==========================  ================================================

Nothing here imports jax; matplotlib and tensorboardX are imported only when
used.
"""

import importlib
from collections.abc import Callable
from typing import Any

from fedjax_mm.runner.errors import ConfigError, NonFiniteError
from fedjax_mm.runner.report import (
  format_table,
  mean_std,
  percent,
  plot_curves,
  write_report,
  write_text,
)
from fedjax_mm.runner.workdir import WorkdirError, config_diff, prepare_workdir
from fedjax_mm.runner.writers import MetricWriter, metric_series, read_metrics

__all__ = [
  "EXPERIMENTS",
  "ConfigError",
  "MetricWriter",
  "NonFiniteError",
  "WorkdirError",
  "config_diff",
  "experiment_runner",
  "format_table",
  "mean_std",
  "metric_series",
  "percent",
  "plot_curves",
  "prepare_workdir",
  "read_metrics",
  "system",
  "write_report",
  "write_text",
]

#: Config file stem (``experiments/<stem>.py``) -> the module whose ``run`` runs it. A new
#: system adds its line here; modules are imported only when asked for (they import jax).
EXPERIMENTS = {
  "creamfl": "fedjax_mm.runner.creamfl",
  "fedmuscle": "fedjax_mm.runner.fedmuscle",
  "fedrgb": "fedjax_mm.runner.fedrgb",
  "fedscmr": "fedjax_mm.runner.fedscmr",
  "pretrain": "fedjax_mm.zoo.pretrain",
  "rcsr": "fedjax_mm.runner.rcsr",
}


def system(name: str) -> Any:
  """The :class:`~fedjax_mm.runner.loop.System` of the experiment ``name``; None for one
  with a loop of its own (``pretrain``).

  Raises:
    KeyError: ``name`` is not in :data:`EXPERIMENTS`.
  """
  return getattr(importlib.import_module(EXPERIMENTS[name]), "SYSTEM", None)


def experiment_runner(name: str) -> Callable[..., Any]:
  """``run(config, workdir, *, overwrite, progress)`` of the experiment ``name``: its
  system's :meth:`~fedjax_mm.runner.loop.System.run`, or the module's own ``run``.

  Raises:
    KeyError: ``name`` is not in :data:`EXPERIMENTS`.
  """
  found = system(name)
  return found.run if found is not None else importlib.import_module(EXPERIMENTS[name]).run
