r"""FedRCL: relaxed supervised contrastive local training, then parameter averaging.

Paper: Seo, Kim, Kim and Han, "Relaxed Contrastive Learning for Federated
Learning", CVPR 2024 (arXiv 2401.04928). FedRCL is FedAvg whose clients add
to their cross-entropy a supervised contrastive loss with a divergence penalty
on too-similar same-class pairs (:func:`fedjax_mm.losses.relaxed_contrastive_loss`):

.. math::
  \mathcal L_k = \mathcal L_{task} + w \cdot \tfrac{1}{b} \textstyle\sum_i
    \big(\ell^{SCL}_i + \beta\, \ell^{div}_i\big),

computed on each local batch from the client's own labels; the server
averages the models, weighted by ``n_k``. **It reads no public data** (the
round accepts the public set only to share one signature with the other
methods, and never touches it: a public set of NaNs leaves it unchanged,
tested).

Adaptation to FedMuscle's users, every choice:

* **Averaging within a task group of identical architecture**: users of the
  same task and the same encoder (``architectures[g]``; identical parameter
  trees, checked) are averaged, all trained parameters (adapters, projector,
  head) with weights ``n_k``; a user alone in its (task, architecture) class
  keeps its own model, so with every user distinct FedRCL is local training
  plus the relaxed contrastive term.
* **The contrastive term acts on** ``z`` (encoder + projector, L2-normalised),
  the layer every user has; the paper applies it at several depths of a
  ResNet (not reproduced).
* **Positives**: the same class for classification users (images or
  captions); for multi-label users, label sets with Jaccard index
  ``>= min_jaccard`` (0.5); for segmentation users, the same rule on the set
  of object classes present in each mask: every class but the task's
  ``background`` (the world's 0; COCO panoptic has none, its 0 is person).
  Negatives are all other samples
  of the batch.
* Hyperparameters as the authors' configuration: ``tau = 0.05``,
  ``lambda = 0.7``, ``beta = 1``, weight ``w = 1``.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Hashable, Sequence

import jax
import jax.numpy as jnp

from fedjax_mm import losses, server
from fedjax_mm.algorithms.base import (
  Algorithm,
  FederatedState,
  check_same_shapes,
  classes_of,
  task_classes,
)
from fedjax_mm.core.client import ClientData, ClientState, GroupDef, train_group
from fedjax_mm.core.tasks import Task, masked_mean

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class FedRCLConfig:
  """FedRCL's local contrastive term.

  Attributes:
    tau: temperature of the similarities.
    threshold: ``lambda``: same-class pairs above it are penalised.
    beta: weight of the divergence penalty.
    weight: ``w``, weight of the whole contrastive term beside the task loss.
    min_jaccard: label-set overlap that makes two multi-label (or
      segmentation) samples positives.
  """

  tau: float = 0.05
  threshold: float = 0.7
  beta: float = 1.0
  weight: float = 1.0
  min_jaccard: float = 0.5


def positives(task: Task, targets: Array, *, min_jaccard: float = 0.5) -> Array:
  """``bool [b, b]``: which pairs of a batch share a label, per the task's kind.

  Args:
    task: the user's task.
    targets: the batch's targets (labels ``[b]``, multi-hot ``[b, C]`` or
      masks ``[b, H, W]``).
    min_jaccard: set overlap for multi-label and segmentation.
  """
  if task.kind == "classification":
    return losses.label_positives(targets)
  if task.kind == "multilabel":
    return losses.set_positives(targets, min_jaccard=min_jaccard)
  # A mask's label set: the classes among its pixels (void pixels, outside [0, C), in
  # none), without the task's background class where it has one.
  present = jax.nn.one_hot(targets, task.num_outputs, dtype=jnp.bool_).any(axis=(1, 2))
  if task.background is not None:
    present = jnp.delete(present, task.background, axis=1, assume_unique_indices=True)
  return losses.set_positives(present, min_jaccard=min_jaccard)


def rcl_objective(config: FedRCLConfig, group: GroupDef, shared):
  """One client's FedRCL objective: task loss + ``w`` x the relaxed contrastive term."""

  def objective(params, batch, batch_mask, key):
    model = group.merge(params, shared)
    z, outputs = model.forward(group.task.inputs(batch, key))
    targets = batch[group.task.target_key]
    task_loss = group.task.loss(outputs, targets, batch_mask)
    pos = positives(group.task, targets, min_jaccard=config.min_jaccard)
    rcl = losses.relaxed_contrastive_loss(
      z, pos, tau=config.tau, threshold=config.threshold, beta=config.beta, where=batch_mask
    )
    rcl = masked_mean(rcl, batch_mask)
    return task_loss + config.weight * rcl, {"rcl": rcl}

  return objective


def fedrcl(
  groups: Sequence[GroupDef],
  config: FedRCLConfig,
  *,
  architectures: Sequence[Hashable],
) -> Algorithm:
  """FedRCL over a tuple of groups, as an :class:`Algorithm`.

  ``round(state, data, public=None)``: ``public`` is ignored. Stats: each
  group's local-training stats.

  Args:
    groups: the users' groups.
    config: the contrastive term's hyperparameters.
    architectures: per group, a hashable naming its model architecture;
      groups with the same task and architecture are averaged together.
  """
  groups = tuple(groups)
  tasks = task_classes(groups)
  fusion = classes_of(zip(tasks, architectures, strict=True))

  objective_fn = functools.partial(rcl_objective, config)

  def init(states: Sequence[ClientState], key: Array) -> FederatedState:
    check_same_shapes(states, fusion)
    return FederatedState(round=jnp.zeros((), jnp.int32), rng=key, groups=tuple(states))

  def round_fn(state: FederatedState, data: Sequence[ClientData], public=None):
    del public  # FedRCL uses no public data.
    trained, stats = [], {}
    for group, client_state, client_data in zip(groups, state.groups, data, strict=True):
      client_state, group_stats = train_group(
        group, client_state, client_data, objective_fn=objective_fn
      )
      trained.append(client_state)
      stats[group.name] = group_stats
    params = server.average_within_classes(
      [s.params for s in trained], [d.num_samples * d.client_mask for d in data], fusion
    )
    new_groups = tuple(s.replace(params=p) for s, p in zip(trained, params, strict=True))
    return state.replace(round=state.round + 1, groups=new_groups), stats

  return Algorithm(init=init, round=round_fn)
