"""Errors every experiment runner raises; ``experiments/main.py`` turns them into one line.

A runner validates its whole config before anything is compiled and raises
:class:`ConfigError` with a message that names the offending key; a run that
produces NaN or Inf raises :class:`NonFiniteError` naming the round and the
user, leaving the last good checkpoint intact. ``main.py`` prints either (and
:class:`~fedjax_mm.runner.workdir.WorkdirError`) as ``error: ...`` on stderr
and exits with status 2.
"""


class ConfigError(ValueError):
  """An impossible configuration, reported in one line before any work."""


class NonFiniteError(RuntimeError):
  """A client update produced NaN or Inf."""
