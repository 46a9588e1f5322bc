"""Orbax checkpoints of the whole federated state, plus JSON metadata per step.

The federated state of a run is one arbitrary pytree: ``flax.struct`` dataclasses
of stacked client groups (params, optax states, PRNG keys, masks, every leaf
``[K, ...]``), replicated server state, and Python ints such as the round
number. :class:`Checkpointer` saves that pytree whole, so that a resumed run
reproduces an uninterrupted one exactly (``DESIGN.md`` section 3: everything
seeded), and it saves a JSON document beside it (the config, the round, the
communication ledger's :meth:`~fedjax_mm.core.ledger.Ledger.to_dict`) that can
be read without knowing the state's structure.

Layout on disk (one ``orbax.checkpoint.CheckpointManager`` directory)::

  <directory>/<step>/state/      # the pytree, Orbax StandardSave (OCDBT/Zarr)
  <directory>/<step>/metadata/   # the JSON document, Orbax JsonSave

Guarantees and choices:

* **Atomic saves.** Orbax writes each step into ``<step>.orbax-checkpoint-tmp``
  and renames it to ``<step>`` only once every item is on disk (on object
  stores it writes a ``commit_success.txt`` marker instead). A crash at any
  moment therefore leaves the previous steps untouched. :meth:`latest_step`
  reports *finalised* steps only: those whose directory carries Orbax's
  ``_CHECKPOINT_METADATA`` file, which excludes tmp directories, a save still
  in flight in this process, and a bare step directory left by a crash on a
  file system without atomic rename. Leftover tmp directories are deleted when
  a :class:`Checkpointer` opens the directory.
* **Asynchronous saves.** :meth:`save` returns once the arrays have been copied
  off the accelerator; writing continues in a background thread. The caller
  may then donate or overwrite the state (``jit(..., donate_argnums=...)``).
  :meth:`wait` blocks until the write is finalised; :meth:`close` waits too.
* **Restore into a target.** :meth:`restore` takes the structure, shapes,
  dtypes and shardings from a *target*: usually ``jax.eval_shape(init_fn, ...)``
  (nothing is computed), or a concrete state. Each array leaf is restored onto
  the target leaf's sharding when it has one (a ``ShapeDtypeStruct`` built with
  ``sharding=NamedSharding(mesh, P("clients"))``, or a committed ``jax.Array``),
  so a stacked group is read shard by shard straight onto its devices. A leaf
  without a sharding (a plain ``ShapeDtypeStruct``, an uncommitted array as
  made outside ``jit``) comes back as an *uncommitted* array on the default
  device, exactly like the output of ``init_fn`` run eagerly, so ``jit`` may
  place it anywhere. Sharded layouts stored in the checkpoint are never used
  implicitly: a run saved on 8 GPUs restores on a 1-CPU laptop. Numpy leaves
  come back as numpy and Python scalars as Python scalars.
* **Typed PRNG keys** (``jax.random.key``, dtype ``key<fry>``) need no special
  handling here: Orbax 0.12 stores a key array as its ``jax.random.key_data``
  (``uint32[..., 2]`` for threefry) and records the key implementation in the
  step's array metadata, then rewraps the data with ``jax.random.wrap_key_data``
  on restore. Restored keys are typed keys of the same implementation,
  bit-identical, on the target's sharding (tested for ``threefry2x32`` and
  ``rbg``). Legacy ``jax.random.PRNGKey`` keys are plain ``uint32[2]`` arrays.
* **Metadata** must be JSON: numpy and jax scalars/arrays are converted to
  Python numbers/lists, and any object with a ``to_dict()`` method (an
  ``ml_collections.ConfigDict``, a :class:`~fedjax_mm.core.ledger.Ledger`) is
  stored as that dict.

Typical use (big_vision's order: resume first when the workdir holds a
checkpoint)::

  ckpt = Checkpointer(workdir / "checkpoints", max_to_keep=2)
  abstract = jax.eval_shape(init_fn, rng)          # optionally with shardings
  if ckpt.latest_step() is not None:
    state = ckpt.restore(abstract)
    meta = ckpt.restore_metadata()
  else:
    state = init_fn(rng)
  for r in range(start, num_rounds):
    state, metrics = round_fn(state, ...)
    ckpt.save(r + 1, state, metadata={"round": r + 1, "ledger": ledger})
  ckpt.close()
"""

from __future__ import annotations

import json
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
from etils import epath

__all__ = ["Checkpointer"]

_STATE = "state"
_METADATA = "metadata"
# Written by the CheckpointManager into a step directory before it is
# finalised (renamed or committed); its presence marks a complete step.
_STEP_METADATA_FILE = "_CHECKPOINT_METADATA"


def _to_json(obj: Any) -> Any:
  """``json.dumps`` fallback for numpy/jax values and ``to_dict()`` objects."""
  if isinstance(obj, np.generic):
    return obj.item()
  if isinstance(obj, np.ndarray | jax.Array):
    return np.asarray(obj).tolist()
  if callable(getattr(obj, "to_dict", None)):
    return obj.to_dict()
  if isinstance(obj, set | frozenset):
    return sorted(obj)
  raise TypeError(f"Checkpoint metadata must be JSON-serialisable; got {type(obj).__name__}.")


def _is_prng_key(x: Any) -> bool:
  return jax.dtypes.issubdtype(getattr(x, "dtype", None), jax.dtypes.prng_key)


def _target_sharding(leaf: Any) -> jax.sharding.Sharding | None:
  """The sharding to restore a target leaf onto, or None (uncommitted default)."""
  if isinstance(leaf, jax.Array):
    return leaf.sharding if leaf.committed else None
  return getattr(leaf, "sharding", None)


def _uncommit(x: jax.Array) -> jax.Array:
  """Re-creates ``x`` as an uncommitted array on the default device.

  Arrays restored by Orbax are committed to the sharding they were read onto;
  an uncommitted copy behaves like a freshly built array, which ``jit`` may move
  next to state that lives on a mesh.
  """
  if _is_prng_key(x):
    impl = jax.random.key_impl(x)
    return jax.random.wrap_key_data(_uncommit(jax.random.key_data(x)), impl=impl)
  return jnp.asarray(np.asarray(x))


class Checkpointer:
  """Saves and restores the federated state pytree with Orbax.

  A thin wrapper around ``orbax.checkpoint.CheckpointManager`` that fixes the
  layout (one pytree item plus one JSON item per step), reports only finalised
  steps, and restores onto a target's structure and shardings. See the module
  docstring for the guarantees.

  Args:
    directory: root directory of the checkpoints (created if missing). Local
      paths are made absolute; ``gs://`` style paths are used as given.
    max_to_keep: number of most recent steps kept on disk; older ones are
      deleted after each successful save. ``None`` keeps all.
    save_interval_steps: :meth:`save` writes only steps that are multiples of
      this (unless ``force=True``).
  """

  def __init__(
    self,
    directory: str | os.PathLike[str],
    *,
    max_to_keep: int | None = 2,
    save_interval_steps: int = 1,
  ):
    if max_to_keep is not None and max_to_keep < 1:
      raise ValueError(f"max_to_keep must be >= 1 or None, got {max_to_keep}.")
    if save_interval_steps < 1:
      raise ValueError(f"save_interval_steps must be >= 1, got {save_interval_steps}.")
    directory = os.fspath(directory)
    if "://" not in directory:
      directory = os.path.abspath(directory)
    self._directory = epath.Path(directory)
    options = ocp.CheckpointManagerOptions(
      max_to_keep=max_to_keep,
      save_interval_steps=save_interval_steps,
      cleanup_tmp_directories=True,
      create=True,
    )
    self._manager = ocp.CheckpointManager(
      self._directory, options=options, item_names=(_STATE, _METADATA)
    )

  @property
  def directory(self) -> epath.Path:
    """The root checkpoint directory."""
    return self._directory

  def save(
    self,
    step: int,
    state: Any,
    *,
    metadata: dict[str, Any] | None = None,
    force: bool = False,
  ) -> bool:
    """Starts saving ``state`` (and ``metadata``) as ``step``.

    Returns once the arrays are copied to host memory; the write finishes in
    the background (see :meth:`wait`). Errors of a previous background save
    are raised here.

    Args:
      step: the step number, usually the number of completed rounds.
      state: any pytree of arrays (jax, numpy, typed PRNG keys), Python
        scalars and empty nodes (``None``, optax ``EmptyState``).
      metadata: JSON document stored beside the state (see the module
        docstring for the conversions applied). ``None`` stores ``{}``.
      force: save even if ``step`` is not a multiple of ``save_interval_steps``.

    Returns:
      Whether a save was started (``False`` when skipped by the interval).

    Raises:
      TypeError: if ``metadata`` is not JSON-serialisable.
    """
    # Serialise now, not in the background thread, so that a bad document
    # fails loudly here and later mutation of ``metadata`` cannot race.
    document = json.loads(json.dumps(metadata or {}, default=_to_json))
    return self._manager.save(
      int(step),
      args=ocp.args.Composite(
        **{
          _STATE: ocp.args.StandardSave(state),
          _METADATA: ocp.args.JsonSave(document),
        }
      ),
      force=force,
    )

  def all_steps(self) -> list[int]:
    """The finalised steps on disk, in increasing order."""
    steps = []
    for step in self._manager.all_steps():
      if (self._directory / str(step) / _STEP_METADATA_FILE).exists():
        steps.append(int(step))
    return sorted(steps)

  def latest_step(self) -> int | None:
    """The most recent finalised step, or ``None`` if there is none.

    A save still being written is not reported until it is finalised (call
    :meth:`wait` first to include it).
    """
    steps = self.all_steps()
    return steps[-1] if steps else None

  def _resolve_step(self, step: int | None) -> int:
    self.wait()  # A step being written (or garbage collected) is never read.
    if step is None:
      step = self.latest_step()
      if step is None:
        raise FileNotFoundError(f"No finalised checkpoint in {self._directory}.")
    elif int(step) not in self.all_steps():
      raise FileNotFoundError(
        f"No finalised checkpoint for step {step} in {self._directory}; "
        f"available: {self.all_steps()}."
      )
    return int(step)

  def restore(self, target: Any, step: int | None = None) -> Any:
    """Restores a saved state into the structure and shardings of ``target``.

    Args:
      target: a pytree with the structure of the saved state: the output of
        ``jax.eval_shape(init_fn, ...)`` (optionally with shardings on its
        ``ShapeDtypeStruct`` leaves) or a concrete state. Shapes and dtypes
        must match the checkpoint.
      step: the step to restore; ``None`` means :meth:`latest_step`.

    Returns:
      A pytree with the tree structure of ``target``: array leaves restored
      onto the target leaf's sharding, or uncommitted on the default device
      when the target leaf has none (see the module docstring).

    Raises:
      FileNotFoundError: if there is no such finalised step.
    """
    step = self._resolve_step(step)

    def abstract(leaf):
      if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct):
        sharding = _target_sharding(leaf)
        if sharding is None:
          sharding = jax.sharding.SingleDeviceSharding(jax.local_devices()[0])
        return jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sharding)
      return leaf

    restored = self._manager.restore(
      step,
      args=ocp.args.Composite(**{_STATE: ocp.args.StandardRestore(jax.tree.map(abstract, target))}),
    )[_STATE]

    def finish(leaf, value):
      if isinstance(leaf, jax.Array | jax.ShapeDtypeStruct) and _target_sharding(leaf) is None:
        return _uncommit(value)
      return value

    return jax.tree.map(finish, target, restored)

  def restore_metadata(self, step: int | None = None) -> dict[str, Any]:
    """The JSON metadata saved with ``step`` (default: the latest finalised step).

    Raises:
      FileNotFoundError: if there is no such finalised step.
    """
    step = self._resolve_step(step)
    restored = self._manager.restore(
      step, args=ocp.args.Composite(**{_METADATA: ocp.args.JsonRestore()})
    )
    return dict(restored[_METADATA])

  def wait(self) -> None:
    """Blocks until every started save is finalised on disk."""
    self._manager.wait_until_finished()

  def close(self) -> None:
    """Waits for pending saves and releases the manager's resources."""
    self._manager.close()

  def __enter__(self) -> Checkpointer:
    return self

  def __exit__(self, *exc_info) -> None:
    self.close()
