"""Errors every experiment runner raises; ``experiments/main.py`` turns them into one line.

A runner validates its whole config before anything is compiled and raises
:class:`ConfigError` with a message that names the offending key; a run that
produces NaN or Inf raises :class:`NonFiniteError` naming the round and the
user, leaving the last good checkpoint intact (its message ends with
:func:`checkpoint_note`). ``main.py`` prints either (and
:class:`~fedjax_mm.runner.workdir.WorkdirError`,
:class:`~fedjax_mm.core.checkpoint.CheckpointError`) as ``error: ...`` on
stderr and exits with status 2. :class:`Preempted` is no error: a job of several
processes stopped together on a preemption notice, its last round checkpointed;
``main.py`` says so and exits with status 143 (128 + SIGTERM), as one process does.
"""


class ConfigError(ValueError):
  """An impossible configuration, reported in one line before any work."""


class NonFiniteError(RuntimeError):
  """A client update produced NaN or Inf."""


class Preempted(Exception):  # noqa: N818 - a stop, like KeyboardInterrupt, not an error
  """Every process of the job stopped after round ``round`` on a preemption notice.

  Raised by the loop once :func:`fedjax_mm.core.processes.preempted` agrees, with
  that round checkpointed (its save finished on the way out); by pretraining after
  an epoch. ``where`` names the point for the user: ``"round 12"`` (the default),
  ``"epoch 3 of cnn_m+transformer_t"``.
  """

  def __init__(self, round_: int, where: str | None = None):
    super().__init__(round_)
    self.round = round_
    self.where = where or f"round {round_}"


class SummaryError(ValueError):
  """Workdirs that cannot be summarised (together, or in the format asked for), in one line.

  ``python -m experiments.summarize`` prints it as ``error: ...`` with exit status 2.
  """


def checkpoint_note(latest_round: int | None) -> str:
  """How a :class:`NonFiniteError` message ends: what a relaunch would resume from.

  Args:
    latest_round: the newest finalised checkpoint's round, or None before the
      first one is written (a relaunch then starts from round 0).
  """
  if latest_round is None:
    return "no checkpoint yet"
  return f"the last good checkpoint (round {latest_round}) is intact"
