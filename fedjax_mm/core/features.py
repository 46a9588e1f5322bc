"""A frozen encoder run once per set, not once per step.

A user whose encoder trains nothing (a pretrained CNN fine-tuned with
"adapters": a CNN has no dense layers for LoRA, so only its projector and head
train) computes the same pooled features of a sample in every local step, every
contrastive batch and every evaluation. :func:`cache_frozen_encoders` computes
them once for each of the group's sets and the public set, stores them under a
key of their own, and gives the group a model that reads them
(:meth:`fedjax_mm.models.UserModel.read_pooled`) and a task whose ``input_key``
names them. Parameters, optimiser states and random draws are untouched, so a
round of the cached groups computes what the raw groups compute, up to float32
rounding (the encoder now sees batches of another size); checkpoints are
interchangeable. Only a method that transforms its raw inputs (an augmentation)
needs the raw groups.

A group qualifies (:func:`frozen_encoder`) when its model is a
:class:`~fedjax_mm.models.UserModel` whose head reads the pooled features, whose
task reads images, and none of whose trained parameters sits in its encoder.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
from flax import nnx

from fedjax_mm.core.client import ClientData, ClientState, GroupDef, apply_in_batches
from fedjax_mm.core.tasks import Task
from fedjax_mm.models.user_model import UserModel

Array = jax.Array

#: The data key under which group ``i``'s pooled features are stored.
POOLED_KEY = "pooled:{}"


def _model(group: GroupDef, state: ClientState) -> nnx.Module:
  """Client 0's model, outside any trace (its static graph is what matters here)."""
  return group.merge(jax.tree.map(lambda x: x[0], state.params), state.shared)


def _trains_encoder(state: ClientState) -> bool:
  paths = jax.tree_util.tree_flatten_with_path(state.params)[0]
  return any(
    getattr(entry, "key", getattr(entry, "name", None)) == "encoder"
    for path, _ in paths
    for entry in path
  )


def frozen_encoder(group: GroupDef, state: ClientState) -> bool:
  """Whether the group's encoder is a fixed function its features can be cached for."""
  if group.task.input_key != "image" or _trains_encoder(state):
    return False
  model = _model(group, state)
  return isinstance(model, UserModel) and model.head.reads != "spatial" and not model.pooled_input


def pooled_group(group: GroupDef, state: ClientState, key: str) -> GroupDef:
  """The group reading pooled features under data key ``key`` (same parameters)."""
  model = _model(group, state)
  model.read_pooled()
  graphdef = nnx.split(model)[0]
  return dataclasses.replace(
    group, graphdef=graphdef, task=dataclasses.replace(group.task, input_key=key)
  )


def pooled_features(
  group: GroupDef, state: ClientState, images: Array, *, batch_size: int = 256
) -> Array:
  """The group's frozen pooled features of ``images [..., H, W, C]`` -> ``[..., h]``.

  Leading axes (clients, samples) are flattened into one batch axis and restored.
  """
  lead = images.shape[:-3]
  flat = images.reshape((-1,) + images.shape[-3:])

  @jax.jit
  def run(shared, params, x):
    model = group.merge(jax.tree.map(lambda p: p[0], params), shared)
    return apply_in_batches(model.pooled, x, batch_size)

  out = run(state.shared, state.params, flat)
  return out.reshape(lead + out.shape[-1:])


def cache_frozen_encoders(
  groups: Sequence[GroupDef],
  states: Sequence[ClientState],
  sets: Sequence[Sequence[ClientData]],
  public: dict[str, Array] | None = None,
) -> tuple[tuple[GroupDef, ...], tuple[tuple[ClientData, ...], ...], dict[str, Array] | None]:
  """Every frozen-encoder group reading its features, computed once per set.

  Args:
    groups: the groups.
    states: their initial states (only the frozen ``shared`` weights are read).
    sets: each a per-group tuple of :class:`ClientData` (train, test, ...).
    public: optional public set (dict of ``[P, ...]`` arrays).

  Returns:
    ``(groups, sets, public)``: a frozen-encoder group ``i`` replaced by
    :func:`pooled_group` reading :data:`POOLED_KEY` ``.format(i)``, which its
    sets and the public set gain; every other group, array and key unchanged.
  """
  groups, public = list(groups), None if public is None else dict(public)
  sets = [list(s) for s in sets]
  for i, (group, state) in enumerate(zip(tuple(groups), states, strict=True)):
    if not frozen_encoder(group, state):
      continue
    key = POOLED_KEY.format(i)
    for s in sets:
      arrays = dict(s[i].arrays)
      arrays[key] = pooled_features(group, state, arrays["image"])
      s[i] = s[i].replace(arrays=arrays)
    if public is not None and "image" in public:
      public[key] = pooled_features(group, state, public["image"])
    groups[i] = pooled_group(group, state, key)
  return tuple(groups), tuple(tuple(s) for s in sets), public


def _reads_pooled(task: Task) -> bool:
  return task.input_key.startswith(POOLED_KEY.format(""))


def source_task(task: Task) -> Task:
  """The task as its raw group states it: a pooled group reads its images' features.

  Two groups solve one task when their kind, targets and raw inputs agree; which array
  holds a group's inputs (the images or their cached features) does not change the task.
  """
  return dataclasses.replace(task, input_key="image") if _reads_pooled(task) else task


def cached(groups: Sequence[GroupDef]) -> tuple[bool, ...]:
  """Which groups read pooled features (``input_key`` :data:`POOLED_KEY`)."""
  return tuple(_reads_pooled(g.task) for g in groups)


__all__ = [
  "POOLED_KEY",
  "cache_frozen_encoders",
  "cached",
  "frozen_encoder",
  "pooled_features",
  "pooled_group",
  "source_task",
]
