r"""CoFED: consensus pseudo-labels of the public set, voted across heterogeneous tasks.

Paper: Cao, Li, Sun, Yu and Guizani, "Cross-silo heterogeneous model
federated multitask learning", Knowledge-Based Systems 265:110347, 2023
(arXiv 2202.08603); the authors' code (github.com/flcao/CoFED,
``fed_cifar100_cifar10_pub_*.m``). Participants with different models and
different tasks (different class sets) share only an unlabelled public set:

1. each participant trains its model on its private data;
2. it predicts the public set and sends its confident predictions (top
   class ahead of the second by more than ``margin = 0.3``);
3. the server keeps, for every class, the public samples that more than
   ``threshold = 0.3`` of the participants *having that class* predicted as
   it (the vote share, :func:`fedjax_mm.server.cofed.consensus`), and sends
   each participant the samples kept for exactly one of its classes;
4. each participant trains on its private data plus those pseudo-labelled
   public samples.

Classes shared by several tasks are what carries knowledge across tasks; the
paper identifies them by their global class identity (a CIFAR-100 class keeps
its id in every participant's task).

Adaptation to FedMuscle's users (multi-label MLC over the 10 shapes, IC100 =
shape x colour of the primary object, IC10 = its shape; Setup 2's TC = its
colour), every choice:

* **Classes as statements about a public scene** (:data:`WORLD_STATEMENTS`,
  ``J = 140``): ``fine(s, c)`` "the primary object is a colour-``c`` shape
  ``s``" (IC100's classes), ``shape(s)`` "the primary is a shape ``s``"
  (IC10's), ``present(s)`` / ``absent(s)`` "some object is / no object is a
  shape ``s``" (MLC's), ``colour(c)`` "the primary is colour ``c``" (TC's).
  The world's labels are nested, so a prediction implies coarser statements
  (:func:`world_implications`): ``fine(s, c)`` implies ``shape(s)``,
  ``colour(c)`` and ``present(s)``; ``shape(s)`` implies ``present(s)``. A
  user votes for every statement its confident prediction implies and sits
  in the denominator of every statement its classes can imply
  (:mod:`fedjax_mm.server.cofed`); with no implications this is the authors'
  rule exactly. So IC10's labels are voted by the IC10 and IC100 users,
  IC100's by the IC100 users alone, MLC's ``present(s)`` by every user and
  ``absent(s)`` by the MLC users. (An IC user that predicts another shape
  still counts in ``present(s)``'s denominator, as a participant having a
  class does in the paper, though its prediction does not deny it.)
* **Multi-label users** are ten two-class heads (``absent(s)``,
  ``present(s)``), each voted with the margin rule on ``(1 - p, p)``, i.e.
  ``|2 p - 1| > margin``; a public sample is pseudo-labelled for an MLC user
  only when every one of its ten labels is decided (the paper's users are
  single-label; ``removeOverlap`` drops a label kept both ways).
* **Segmentation users** (Setup 2's SS) have no CoFED analogue here: they
  neither vote nor receive pseudo-labels, and train locally.
* **Rounds**: CoFED labels once, with converged local models, and trains to
  early stopping. Here every round re-labels the public set with each user's
  current model (at the round's start, as Curriculum Labeling does here),
  then every user trains ``E`` epochs over its own samples and its kept
  public samples, shuffled together, in its own batches: one pass over the
  public set per local epoch, FedMuscle's ``T = 1`` at ``E = 1``. Round 1
  labels with the initial models; the margin keeps their guesses out.
* **Class-balanced loss** (``class_balanced``, on by default), as the code
  (``classWeights = 1 ./ countcats(yTrain)``, divided by their maximum, in a
  weighted classification layer that divides by the minibatch size): each
  example's cross-entropy is weighted by ``min_c n_c / n_y``, ``n_c`` counting
  class ``c`` over the client's combined set of the round (its own samples and
  its kept public ones; classes with no sample left out), and the minibatch
  loss stays the mean over its examples (:func:`class_weights`). An MLC user's
  ten two-class heads are balanced each on its own (absent vs present). The
  paper does not mention it; with it off, a user with no kept public sample
  trains exactly as local training.
* **Weights** uniform over present users (the code's ``1 / N``); padding
  clients have weight 0, send nothing, receive nothing and keep their state.
* Caption users label with each sample's first caption and train on a random
  one, as on their own data.

What crosses the wire per round: each participating user uploads ``int32
[P, H]`` votes (a class per head, -1 where not confident) and downloads its
``int32 [P, H]`` pseudo-labels (-1 where none); ``H`` is 1 for a
single-label user and 10 for an MLC user (:func:`messages`).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mm import data as world
from fedjax_mm.algorithms.base import Algorithm, FederatedState
from fedjax_mm.core.client import (
  ClientData,
  ClientState,
  GroupDef,
  apply_in_batches,
  train_group,
)
from fedjax_mm.core.tasks import SAMPLE_WEIGHT_KEY, Task
from fedjax_mm.server import cofed as vote

Array = jax.Array

_S, _C = world.NUM_SHAPES, world.NUM_COLORS
#: Offsets of the world's statements: fine (s, c) at ``10 s + c``, then shape, present,
#: absent (one per shape) and colour (one per colour).
FINE, SHAPE, PRESENT, ABSENT, COLOUR = 0, _S * _C, _S * _C + _S, _S * _C + 2 * _S, _S * _C + 3 * _S
#: ``J``: every statement a world user's class can make.
WORLD_STATEMENTS = COLOUR + _C


@dataclasses.dataclass(frozen=True)
class CoFEDConfig:
  """CoFED's vote (the authors' constants).

  Attributes:
    margin: ``p_(1) - p_(2)`` a prediction needs to count as a vote.
    threshold: the vote share a class needs to pseudo-label a sample.
    label_batch_size: public samples per forward pass when labelling.
    class_balanced: weight the local loss by inverse class frequency of the
      combined set, as the authors' code (:func:`class_weights`).
  """

  margin: float = 0.3
  threshold: float = 0.3
  label_batch_size: int = 64
  class_balanced: bool = True


def class_weights(task: Task, targets: Array, mask: Array) -> Array:
  """One client's class-balanced example weights: ``min_c n_c / n_y`` (the authors' code).

  Args:
    task: a classification or multi-label task.
    targets: ``[n]`` labels or ``[n, C]`` multi-hot targets of the combined set.
    mask: ``bool [n]``: the samples the client trains on.

  Returns:
    ``float32 [n]`` (multi-label ``[n, C]``: each label a two-class head,
    weighted by its own absent / present counts); 0 where ``mask`` is False.
  """
  m = mask.astype(jnp.float32)
  if task.kind == "multilabel":
    t = targets.astype(jnp.float32)
    present = jnp.einsum("n,nc->c", m, t)
    absent = jnp.einsum("n,nc->c", m, 1 - t)
    rarest = jnp.minimum(
      jnp.where(present > 0, present, jnp.inf), jnp.where(absent > 0, absent, jnp.inf)
    )
    w = jnp.where(t > 0, rarest / jnp.maximum(present, 1), rarest / jnp.maximum(absent, 1))
    return w * m[:, None]
  if task.kind != "classification":
    raise ValueError(f"class weights need a classification or multi-label task, not {task.kind!r}.")
  counts = jnp.zeros(task.num_outputs, jnp.float32).at[targets].add(m)
  rarest = jnp.min(jnp.where(counts > 0, counts, jnp.inf))
  return rarest / jnp.maximum(counts[targets], 1) * m


def world_implications() -> np.ndarray:
  """``bool [J, J]``: which world statement makes which true (reflexive)."""
  implies = np.eye(WORLD_STATEMENTS, dtype=bool)
  for s in range(_S):
    for c in range(_C):
      implies[FINE + _C * s + c, [SHAPE + s, PRESENT + s, COLOUR + c]] = True
    implies[SHAPE + s, PRESENT + s] = True
  return implies


def world_statements(task: Task) -> np.ndarray | None:
  """``int32 [H, K]``: the statement of each class of each head of a world task; None: no vote.

  The runner's tasks by target: ``label100`` (IC100), ``label10`` (IC10),
  ``multilabel`` (MLC: ten heads, classes absent / present),
  ``caption_label`` (TC); segmentation (``mask``) has none.
  """
  if task.kind == "multilabel" and task.num_outputs == _S:
    return np.stack([ABSENT + np.arange(_S), PRESENT + np.arange(_S)], axis=1).astype(np.int32)
  first = {"label100": FINE, "label10": SHAPE, "caption_label": COLOUR}.get(task.target_key)
  if task.kind != "classification" or first is None:
    return None
  return (first + np.arange(task.num_outputs, dtype=np.int32))[None]


def head_probs(task: Task, outputs: Array) -> Array:
  """``[P, H, K]`` class probabilities per head: one softmax head, or a two-class head per label."""
  if task.kind == "multilabel":
    p = jax.nn.sigmoid(outputs)
    return jnp.stack([1 - p, p], axis=-1)
  return jax.nn.softmax(outputs, axis=-1)[:, None, :]


def messages(statements: np.ndarray | None, num_public: int):
  """Abstract shapes of what a user sends and receives per round: ``(votes, labels)``."""
  if statements is None:
    return ()
  heads = statements.shape[0]
  return (jax.ShapeDtypeStruct((num_public, heads), jnp.int32),) * 2


def _targets(task: Task, labels: Array) -> Array:
  """The task's own targets from per-head labels ``[..., P, H]`` (every head decided)."""
  if task.kind == "multilabel":
    return jnp.maximum(labels, 0).astype(jnp.float32)
  return jnp.maximum(labels[..., 0], 0).astype(jnp.int32)


def cofed(
  groups: Sequence[GroupDef],
  config: CoFEDConfig,
  *,
  statements: Sequence[np.ndarray | None],
  implies: np.ndarray,
) -> Algorithm:
  """CoFED over a tuple of groups, as an :class:`Algorithm`.

  ``round(state, data, public)`` returns each group's local-training stats
  and ``kept`` ``[N]``: the share of the public set each user trained on (0
  for users that take no part).

  Args:
    groups: the users' groups.
    config: the vote's constants.
    statements: per group, ``int32 [H, K]`` statement ids of its classes
      (:func:`world_statements`), or None for a group that takes no part.
    implies: ``bool [J, J]`` reflexive implications between statements.
  """
  groups = tuple(groups)
  statements = tuple(None if s is None else np.asarray(s, np.int32) for s in statements)
  if len(statements) != len(groups):
    raise ValueError("statements needs one entry per group.")
  implies = np.asarray(implies, bool)
  voting = [g for g, s in enumerate(statements) if s is not None]

  def init(states: Sequence[ClientState], key: Array) -> FederatedState:
    return FederatedState(round=jnp.zeros((), jnp.int32), rng=key, groups=tuple(states))

  def votes_of(group: GroupDef, state: ClientState, public) -> Array:
    """``int32 [K, P, H]``: every client's confident predictions on the public set."""
    x = group.task.inputs(public)  # first caption for caption users

    def one(params):
      model = lambda xb: group.merge(params, state.shared)(xb)
      outputs = apply_in_batches(model, x, config.label_batch_size)
      return vote.confident_votes(head_probs(group.task, outputs), margin=config.margin)

    return jax.vmap(one)(state.params)

  def with_public(group: GroupDef, data: ClientData, public, targets: Array, keep: Array):
    """The client's own samples followed by the public set with its pseudo-labels (and,
    ``class_balanced``, every sample's class weight over that combined set)."""
    task, k = group.task, data.num_clients
    raw = public[task.input_key]
    own = data.arrays[task.target_key]
    combined = jnp.concatenate(
      [own, jnp.broadcast_to(targets, (k,) + targets.shape).astype(own.dtype)], axis=1
    )
    sample_mask = jnp.concatenate([data.sample_mask, keep], axis=1)
    arrays = {
      task.input_key: jnp.concatenate(
        [data.arrays[task.input_key], jnp.broadcast_to(raw, (k,) + raw.shape)], axis=1
      ),
      task.target_key: combined,
    }
    if config.class_balanced:
      weigh = functools.partial(class_weights, task)
      arrays[SAMPLE_WEIGHT_KEY] = jax.vmap(weigh)(combined, sample_mask)
    return ClientData(
      arrays=arrays,
      sample_mask=sample_mask,
      user_ids=data.user_ids,
      client_mask=data.client_mask,
    )

  def round_fn(state: FederatedState, data: Sequence[ClientData], public: dict[str, Array]):
    implies_ = jnp.asarray(implies)
    asserts, can_vote, weights = [], [], []
    for g in voting:
      votes = votes_of(groups[g], state.groups[g], public)  # uplink: [K, P, H]
      st = jnp.asarray(statements[g])
      asserts.append(jax.vmap(vote.asserted, in_axes=(0, None, None))(votes, st, implies_))
      can = vote.expressible(st, implies_)
      can_vote.append(jnp.broadcast_to(can, (data[g].num_clients,) + can.shape))
      weights.append(data[g].client_mask.astype(jnp.float32))
    kept = None
    if voting:
      kept, _ = vote.consensus(
        jnp.concatenate(asserts),
        jnp.concatenate(can_vote),
        jnp.concatenate(weights),
        threshold=config.threshold,
      )

    new_groups, stats, shares = [], {}, []
    for g, (group, client_state, d) in enumerate(zip(groups, state.groups, data, strict=True)):
      if statements[g] is None:
        client_state, group_stats = train_group(group, client_state, d)
        shares.append(jnp.zeros(d.num_clients))
      else:
        labels = vote.assign(kept, jnp.asarray(statements[g]))  # downlink: [P, H]
        keep = jnp.all(labels >= 0, axis=-1)[None, :] & d.client_mask[:, None]
        combined = with_public(group, d, public, _targets(group.task, labels), keep)
        client_state, group_stats = train_group(group, client_state, combined)
        shares.append(keep.mean(-1))
      new_groups.append(client_state)
      stats[group.name] = group_stats
    stats["kept"] = jnp.concatenate(shares)
    return state.replace(round=state.round + 1, groups=tuple(new_groups)), stats

  return Algorithm(init=init, round=round_fn)
