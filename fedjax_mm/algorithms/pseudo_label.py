r"""Pseudo-labelling by Curriculum Labeling, each user alone on the public set.

Paper: Cascante-Bonilla, Tan, Qi and Ordonez, "Curriculum Labeling:
Revisiting Pseudo-Labeling for Semi-Supervised Learning", AAAI 2021 (arXiv
2001.06001), Algorithm 1. A model trained on the labelled set labels the
unlabelled set; only the most confident pseudo-labels are kept, by a
percentile threshold that rises by ``Delta = 20`` points per stage (the top
20%, then 40%, ..., then all of them), and the model trains on the labelled
and the kept pseudo-labelled samples together. The FedMuscle paper (Sec. 6.1,
Baselines) lists it beside SimCLR and local training, "where each user's model is
trained individually", on the public set; read here as: the unlabelled set is the
public set, each user labels it with its own model for its own task, nothing is
sent.

Adaptation to the rounds of this experiment, every choice:

* **Stages spread over the run**: ``1 + 1/step`` stages (6 for ``step =
  0.2``) of ``R / 6`` rounds each: stage 0 trains on the labelled set alone
  (the paper's initial supervised model), stage ``s`` keeps the top ``20 s``
  percent (:func:`kept_fraction`). The paper trains each stage to convergence;
  here a stage is ``R / 6`` rounds of ``E`` epochs.
* **No re-initialisation between stages.** The paper restarts the model from
  scratch at every stage (to stop confirmation bias from accumulating); with
  ``R / 6`` rounds a stage, a restarted model would end the run trained for
  ``R / 6`` rounds only, where every other method trains for ``R``. The
  models keep training, from the same start as every other method.
* **Re-labelling every round**: at the start of each round the user labels
  the whole public set with its current model (the paper re-labels at every
  stage, with the model the previous stage ended with) and ranks it afresh.
* **Confidence**, for every task kind (:func:`pseudo_labels`):

  - classification: the largest softmax probability, the label its argmax
    (the paper's);
  - multi-label: each label is set where its sigmoid exceeds 1/2, and the
    confidence is the probability the model gives the whole predicted label
    set under its own independent sigmoids,
    ``prod_c max(p_c, 1 - p_c)``: the multi-label analogue of the max
    softmax (a sample is confident only if every label is clear-cut);
  - segmentation: each pixel's argmax, the confidence the mean over pixels
    of the largest pixel probability.

* **The kept set** is the top ``round(f P)`` of the ``P`` public samples by
  confidence (a percentile threshold, ties broken by index). Each local epoch
  is one pass over the labelled and the kept samples, shuffled together, in
  the user's own batches (so a stage with more pseudo-labels takes more
  steps: the paper's epochs grow the same way). Caption users label with the
  first caption of each sample and train on a random caption, as on their
  own data.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from fedjax_mm.algorithms.base import Algorithm, FederatedState
from fedjax_mm.core.client import (
  ClientData,
  ClientState,
  GroupDef,
  apply_in_batches,
  train_group,
)
from fedjax_mm.core.tasks import Task

Array = jax.Array


@dataclasses.dataclass(frozen=True)
class PseudoLabelConfig:
  """Curriculum Labeling's schedule.

  Attributes:
    num_rounds: ``R``, the run's rounds, over which the stages are spread.
    step: ``Delta``, percentile points (as a fraction) added per stage (0.2).
    label_batch_size: public samples per forward pass when labelling.
  """

  num_rounds: int = 30
  step: float = 0.2
  label_batch_size: int = 64

  @property
  def num_stages(self) -> int:
    return 1 + math.ceil(1.0 / self.step - 1e-9)


def kept_fraction(round_index: Array, config: PseudoLabelConfig) -> Array:
  """Fraction of the public set kept in a round (0-based): 0, then ``step``, ``2 step``, ... 1.

  Examples:
    >>> import jax.numpy as jnp
    >>> c = PseudoLabelConfig(num_rounds=12, step=0.2)
    >>> [round(float(kept_fraction(jnp.asarray(r), c)), 2) for r in range(0, 12, 2)]
    [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
  """
  stages = config.num_stages
  stage = jnp.minimum(round_index * stages // max(config.num_rounds, 1), stages - 1)
  return jnp.minimum(stage * config.step, 1.0)


def pseudo_labels(task: Task, outputs: Array) -> tuple[Array, Array]:
  """Pseudo-targets and confidence of a model's outputs ``[P, ...]`` (module docstring).

  Returns:
    ``(targets, confidence [P])``: labels ``int32 [P]``, multi-hot ``float32
    [P, C]`` or masks ``int32 [P, H, W]``, as the task's own targets.
  """
  if task.kind == "multilabel":
    p = jax.nn.sigmoid(outputs)
    confidence = jnp.exp(jnp.sum(jnp.log(jnp.maximum(p, 1 - p)), axis=-1))
    return (p > 0.5).astype(jnp.float32), confidence
  p = jax.nn.softmax(outputs, axis=-1)
  labels = jnp.argmax(outputs, axis=-1).astype(jnp.int32)
  confidence = jnp.max(p, axis=-1)
  if task.kind == "segmentation":
    confidence = confidence.reshape(confidence.shape[0], -1).mean(-1)
  return labels, confidence


def keep_top(confidence: Array, fraction: Array) -> Array:
  """``bool [P]``: the ``round(fraction P)`` most confident samples (ties: lower index first)."""
  n = confidence.shape[0]
  rank = jnp.argsort(jnp.argsort(-confidence, stable=True), stable=True)
  return rank < jnp.round(fraction * n).astype(jnp.int32)


def pseudo_label(groups: Sequence[GroupDef], config: PseudoLabelConfig) -> Algorithm:
  """Curriculum Labeling (each user alone) over a tuple of groups, as an :class:`Algorithm`.

  ``round(state, data, public)`` returns each group's local-training stats
  and ``kept`` ``[N]``: the fraction of the public set each user trained on.
  """
  groups = tuple(groups)

  def init(states: Sequence[ClientState], key: Array) -> FederatedState:
    return FederatedState(round=jnp.zeros((), jnp.int32), rng=key, groups=tuple(states))

  def labelled_public(group: GroupDef, state: ClientState, data: ClientData, public, fraction):
    task = group.task
    x = task.inputs(public)  # first caption for caption users

    def label_one(params):
      model = lambda xb: group.merge(params, state.shared)(xb)
      return pseudo_labels(task, apply_in_batches(model, x, config.label_batch_size))

    targets, confidence = jax.vmap(label_one)(state.params)
    keep = jax.vmap(keep_top, in_axes=(0, None))(confidence, fraction) & data.client_mask[:, None]
    k = data.num_clients
    raw = public[task.input_key]
    own = data.arrays[task.target_key]
    arrays = {
      task.input_key: jnp.concatenate(
        [data.arrays[task.input_key], jnp.broadcast_to(raw, (k,) + raw.shape)], axis=1
      ),
      task.target_key: jnp.concatenate([own, targets.astype(own.dtype)], axis=1),
    }
    combined = ClientData(
      arrays=arrays,
      sample_mask=jnp.concatenate([data.sample_mask, keep], axis=1),
      user_ids=data.user_ids,
      client_mask=data.client_mask,
    )
    return combined, keep.mean(-1)

  def round_fn(state: FederatedState, data: Sequence[ClientData], public: dict[str, Array]):
    fraction = kept_fraction(state.round, config)
    new_groups, stats, kept = [], {}, []
    for group, client_state, client_data in zip(groups, state.groups, data, strict=True):
      combined, share = labelled_public(group, client_state, client_data, public, fraction)
      client_state, group_stats = train_group(group, client_state, combined)
      new_groups.append(client_state)
      stats[group.name] = group_stats
      kept.append(share)
    stats["kept"] = jnp.concatenate(kept)
    return state.replace(round=state.round + 1, groups=tuple(new_groups)), stats

  return Algorithm(init=init, round=round_fn)
