"""One job, several processes: who writes the files, and what every process reads.

A job started with ``jax.distributed.initialize()`` (``experiments/main.py
--distributed``) runs the same program in every process, one per host. The
rounds are collective: the runners spread each group's clients over the devices
of every process (:func:`fedjax_mm.core.job_mesh`), and every process holds
the same host data and makes the same calls. The host-side files of a run (lock,
``config.json``, metrics, reports, ``results.json``, printed tables, progress
bars) are written by **process 0 alone**, the *primary*. Orbax checkpoints stay
collective: every process calls save and restore, and Orbax itself writes each
array once (:mod:`fedjax_mm.core.checkpoint`).

Four helpers carry that rule, so that no other module asks for a process index:

* :func:`is_primary`: whether this process writes.
* :func:`broadcast`: the primary's answer (an int), on every process; used where
  only the primary can decide (is the workdir free? does the run resume?).
* :func:`sync`: a barrier, where the others must not go on before the primary has
  finished a write (a damaged checkpoint renamed, say).
* :func:`gather`: arrays split over (or replicated on) every process's devices,
  made readable by this one: a round's outputs, an evaluation's inputs.

With one process (every run without ``--distributed``) :func:`is_primary` is True
and the other three return at once, without compiling anything.

Typical use::

  resumed = processes.broadcast(int(prepare()) if processes.is_primary() else 0)
  if processes.is_primary():
    write_report(...)
"""

from __future__ import annotations

from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["broadcast", "gather", "is_primary", "sync"]


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


def gather(tree: Any) -> Any:
  """``tree`` with every array this process cannot read whole made readable (a collective).

  A runner whose clients span the processes (:func:`fedjax_mm.core.job_mesh`)
  gets round outputs, evaluations and states back split over, or replicated on,
  every process's devices; each process must read them whole (the primary
  writes them, every process checks them for NaN/Inf alike) or evaluate them on
  its own devices. A leaf replicated over the processes becomes this process's
  copy (a ``jax.Array`` on one of its devices, nothing sent); a leaf split over
  them becomes a NumPy array of its global value (``process_allgather``). Every
  other leaf is returned as it is, so with one process ``gather`` changes
  nothing and costs nothing. Every process must call it on the same structure,
  in the same order.
  """
  if jax.process_count() == 1:
    return tree

  def read(x):
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
      return x
    if x.is_fully_replicated:
      return x.addressable_data(0)
    if jax.dtypes.issubdtype(x.dtype, jax.dtypes.prng_key):
      data = multihost_utils.process_allgather(jax.random.key_data(x), tiled=True)
      return jax.random.wrap_key_data(np.asarray(data), impl=jax.random.key_impl(x))
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))

  return jax.tree.map(read, tree)
