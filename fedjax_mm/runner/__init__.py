"""Host-side plumbing of an experiment: workdir, metric writers, final report.

==========================  ================================================
workdir.prepare_workdir     create / check ``<workdir>``, write ``config.json``,
                            decide fresh run vs resume (``WorkdirError``
                            otherwise; ``overwrite`` moves the old one aside)
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
report.plot_curves          PNG grid of learning curves (Agg, lazy import)
==========================  ================================================

Nothing here imports jax; matplotlib and tensorboardX are imported only when
used.
"""

from fedjax_mm.runner.errors import ConfigError, NonFiniteError
from fedjax_mm.runner.report import format_table, mean_std, percent, plot_curves, write_report
from fedjax_mm.runner.workdir import WorkdirError, config_diff, prepare_workdir
from fedjax_mm.runner.writers import MetricWriter, metric_series, read_metrics

__all__ = [
  "ConfigError",
  "MetricWriter",
  "NonFiniteError",
  "WorkdirError",
  "config_diff",
  "format_table",
  "mean_std",
  "metric_series",
  "percent",
  "plot_curves",
  "prepare_workdir",
  "read_metrics",
  "write_report",
]
