r"""CoFED's server: consensus pseudo-labels of a shared unlabelled set, voted across tasks.

Paper: Cao, Li, Sun, Yu and Guizani, "Cross-silo heterogeneous model
federated multitask learning", Knowledge-Based Systems 265:110347, 2023
(arXiv 2202.08603, first titled "CoFED: Cross-silo Heterogeneous Federated
Multi-task Learning via Co-training"). The authors' code
(github.com/flcao/CoFED, ``fed_cifar100_cifar10_pub_*.m``: ``fedLabelling``,
``removeOverlap``) fixes the rule and its constants:

1. Every participant ``i`` predicts the public set with its own model; a
   prediction counts only where its top class beats its second by more than a
   margin, ``p_(1) - p_(2) > 0.3`` (:func:`confident_votes`).
2. Participants' tasks differ, but their classes carry global identities
   (``classList{i}``: a CIFAR-100 class has one id in every task that has it).
   For a sample ``x`` and a class ``c``, the server's vote share is the
   fraction of the participants *whose task has class* ``c`` that predicted
   ``c`` on ``x``, with weights ``w_i`` (uniform, ``1 / N``):

   .. math::
     s(x, c) = \frac{\sum_i w_i\, [\hat y_i(x) = c]}{\sum_{i:\, c \in C_i} w_i},
     \qquad x \text{ pseudo-labelled } c \iff s(x, c) > 0.3

   (:func:`consensus`). Tasks that share no class never vote on each other's
   classes; a class held by one participant alone is its own confident
   predictions.
3. Participant ``i``'s pseudo-labelled set: every sample kept for one of its
   classes; a sample kept for two or more of its classes is dropped
   (``removeOverlap``, :func:`assign`).

**Classes as statements.** This module states the rule over *statements*
(``J`` of them): boolean facts about a sample, each a global class id. A
participant's class is the statement it asserts; where tasks form a
hierarchy, predicting a class also asserts every statement it *implies*
(``implies [J, J]``, reflexive: ``implies[a, b]`` = "a true makes b true").
A participant votes for all the statements its confident prediction implies,
and can vote on (sits in the denominator of) every statement one of its
classes implies. With ``implies`` the identity this is exactly the authors'
rule (tested against a port of ``fedLabelling``). A participant may hold
several independent heads (a multi-label task: one two-class head per label,
its classes "absent" and "present"); it asserts the statements of every head's
confident prediction, and a sample is pseudo-labelled for it only when every
head's label is decided. The world's statements are in
:mod:`fedjax_mm.algorithms.cofed`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def confident_votes(probs: Array, *, margin: float = 0.3) -> Array:
  """Each prediction's class where it beats the runner-up by more than ``margin``, else -1.

  Examples:
    >>> import jax.numpy as jnp
    >>> confident_votes(jnp.array([[0.7, 0.2, 0.1], [0.5, 0.4, 0.1]]))
    Array([ 0, -1], dtype=int32)

  Args:
    probs: ``[..., K]`` class probabilities (``K >= 2``).
    margin: ``p_(1) - p_(2)`` a vote needs (0.3, strict).

  Returns:
    ``int32 [...]``: the argmax, or -1 where not confident.
  """
  top = jax.lax.top_k(probs, 2)[0]
  best = jnp.argmax(probs, axis=-1).astype(jnp.int32)
  return jnp.where(top[..., 0] - top[..., 1] > margin, best, -1)


def asserted(votes: Array, statements: Array, implies: Array) -> Array:
  """``bool [P, J]``: the statements one participant's confident predictions assert.

  Args:
    votes: ``int32 [P, H]`` its votes per head (-1: none).
    statements: ``int32 [H, K]``: the statement id of each class of each head.
    implies: ``bool [J, J]`` reflexive implications between statements.
  """
  own = jnp.take_along_axis(statements[None], jnp.maximum(votes, 0)[..., None], axis=-1)[..., 0]
  return jnp.any(implies[own] & (votes >= 0)[..., None], axis=1)


def expressible(statements: Array, implies: Array) -> Array:
  """``bool [J]``: the statements some class of a participant implies (it can vote on them)."""
  return jnp.any(implies[statements.reshape(-1)], axis=0)


def consensus(
  asserts: Array, can_vote: Array, weights: Array, *, threshold: float = 0.3
) -> tuple[Array, Array]:
  """The statements the participants' votes keep, per sample.

  Args:
    asserts: ``bool [N, P, J]``: what each participant's votes assert.
    can_vote: ``bool [N, J]``: what each participant can vote on.
    weights: ``[N]`` participant weights (uniform; 0 for padding / absent).
    threshold: the vote share a statement needs (0.3, strict).

  Returns:
    ``(kept bool [P, J], share float32 [P, J])``; a statement no present
    participant can vote on has share 0 and is never kept.
  """
  w = jnp.asarray(weights, jnp.float32)
  votes = jnp.einsum("n,npj->pj", w, asserts.astype(jnp.float32))
  voters = jnp.einsum("n,nj->j", w, can_vote.astype(jnp.float32))
  share = jnp.where(voters > 0, votes / jnp.where(voters > 0, voters, 1.0), 0.0)
  return share > threshold, share


def assign(kept: Array, statements: Array) -> Array:
  """``int32 [P, H]``: a participant's pseudo-label per head, -1 unless exactly one class is kept.

  Examples:
    >>> import jax.numpy as jnp
    >>> kept = jnp.array([[True, False, False], [True, True, False], [False, False, False]])
    >>> assign(kept, jnp.array([[0, 1, 2]]))[:, 0]
    Array([ 0, -1, -1], dtype=int32)
  """
  candidates = kept[:, statements]  # [P, H, K]
  unique = jnp.sum(candidates, axis=-1) == 1
  return jnp.where(unique, jnp.argmax(candidates, axis=-1), -1).astype(jnp.int32)
