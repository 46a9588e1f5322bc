"""One job, several processes: who writes the files, and how the others wait.

A job started with ``jax.distributed.initialize()`` (``experiments/main.py
--distributed``) runs the same program in every process, one per host. The
arrays are computed everywhere; the host-side files of a run (lock,
``config.json``, metrics, reports, ``results.json``, printed tables, progress
bars) are written by **process 0 alone**, the *primary*. Orbax checkpoints stay
collective: every process calls save and restore, and Orbax itself writes each
array once (:mod:`fedjax_mm.core.checkpoint`).

Three helpers carry that rule, so that no other module asks for a process index:

* :func:`is_primary`: whether this process writes.
* :func:`broadcast`: the primary's answer (an int), on every process; used where
  only the primary can decide (is the workdir free? does the run resume?).
* :func:`sync`: a barrier, where the others must not go on before the primary has
  finished a write (a damaged checkpoint renamed, say).

With one process (every run without ``--distributed``) :func:`is_primary` is True
and the other two return at once, without compiling anything.

Typical use::

  resumed = processes.broadcast(int(prepare()) if processes.is_primary() else 0)
  if processes.is_primary():
    write_report(...)
"""

from __future__ import annotations

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["broadcast", "is_primary", "sync"]


def is_primary() -> bool:
  """Whether this process writes the run's host-side files: process 0 of the job."""
  return jax.process_index() == 0


def broadcast(value: int) -> int:
  """Process 0's ``value`` on every process (a collective: every process must call it).

  Args:
    value: an integer; only process 0's is used, the others' are ignored.

  Returns:
    Process 0's ``value``.
  """
  if jax.process_count() == 1:
    return int(value)
  return int(multihost_utils.broadcast_one_to_all(np.int32(value)))


def sync(name: str) -> None:
  """Blocks until every process has reached ``sync(name)`` (a collective).

  Args:
    name: the barrier's name, the same on every process; distinct barriers
      should have distinct names (it shows in errors of a process left behind).
  """
  if jax.process_count() > 1:
    multihost_utils.sync_global_devices(name)
