r"""FedET's and FedGEMS's ensemble weights, adapted to representations (CreamFL's Table 1).

CreamFL (``creamfl.txt``, Section 4.1) runs FedET and FedGEMS on the same
clients and public set as CreamFL: each client sends its representations
``l^c`` ``[P, d]`` of the public set per modality, the server aggregates them
into one target per public sample and distils its large model into it (eq.
(7)). Both methods were designed for classifier LOGITS, where each client's
output on a sample is a probability vector; CreamFL notes that "FedGEMS uses
entropy and FedET uses variance of logit for weighting" (Section 4.2) without
saying how a representation gets a probability. Here it gets the one GCA
already computes (eq. (4), :mod:`fedjax_mm.server.gca`): the softmax over the
public set of the similarities of the local representation of sample ``k`` to
the server's global representations ``g`` of the OTHER modality,

.. math::
  p^{c}_{k}(j) = \operatorname{softmax}_j\, (l^c_k \cdot g_j / \tau), \quad j = 1..P,

a retrieval distribution whose "label" is ``j = k`` (the pair of sample ``k``).
So the rules below see the same scores as GCA at the same ``tau``
(``CreamConfig.gca_temperature``); only the rule that turns them into client
weights differs.

**FedET** (Cho et al., "Heterogeneous Ensemble Knowledge Transfer for Training
Large Models in Federated Learning", IJCAI 2022, arXiv 2204.12703): weighted
consensus distillation with diversity regularisation. Per sample, the clients
vote with their top prediction (``argmax_j p^c_k(j)``); those in the majority
(every tied largest group) are kept, and each kept client weighs by its
confidence, the variance of its probability vector (a peaked output has a
large variance):

.. math::
  \alpha^{(k,c)} = \frac{[c \in \text{majority}_k]\, \mathrm{Var}_j\, p^c_k(j)}
                        {\sum_{c'} [c' \in \text{majority}_k]\, \mathrm{Var}_j\, p^{c'}_k(j)},
  \qquad a_k = \sum_c \alpha^{(k,c)} l^c_k .

*Diversity regularisation, what the source says.* The paper's abstract:
"Fed-ET uses a weighted consensus distillation scheme with diversity
regularization that efficiently extracts reliable consensus from the ensemble
while improving generalization by exploiting the diversity within the
ensemble"; the clients that do not follow the consensus still teach the
server. The paper's method section could not be read in the stored corpora
this module was written from, so the equation below is that of a public
re-implementation, Yoruko-Tang/FedProphet ``src/server/kdserver.py``
(``FedET_Server.aggregate``), which matches the abstract: on every public
sample ``x`` the server minimises

.. math::
  \mathrm{CE}\big(f(x), \hat y_x\big)
  + \lambda\, \mathrm{KL}\big(\operatorname{softmax}(\textstyle\sum_{c \in D_x} \beta^{(x,c)} z_c(x))
                                \,\big\|\, \operatorname{softmax} f(x)\big),

with ``z_c(x)`` client ``c``'s logits (or log-softmax), ``hat y_x`` the argmax of
their variance-weighted mean (the consensus), ``D_x`` the clients whose own
argmax differs from ``hat y_x``, ``beta`` their variances normalised over
``D_x``, and ``lambda = 0.05`` (``diver_lamb``, its default and every command in
its README). That value is the default of ``CreamConfig.fedet_diversity_weight``;
whether the paper uses the same could not be checked.

*Diversity regularisation, as adapted here.* ``D_k`` is the present clients
OUTSIDE the majority (the complement of the consensus set above; the
re-implementation's consensus is an argmax of a weighted mean instead of a
vote, so its ``D`` is the clients disagreeing with that label), ``beta`` their
variances normalised over ``D_k`` (:func:`fedet_with_diversity`), and the
ensemble's output is the softmax of the ``beta``-weighted mean of their logits
``l^c_k . g_j / tau``, which is the softmax of the similarities of their
weighted mean REPRESENTATION ``e_k``:

.. math::
  e_k = \sum_{c \in D_k} \beta^{(k,c)} l^c_k, \qquad
  s^{\mathrm{div}}_k = \operatorname{softmax}_j (e_k \cdot g_j / \tau)

(averaging log-softmaxes instead gives the same softmax: each client's
normaliser is constant in ``j`` and the ``beta`` sum to 1). The server's own
output on sample ``k`` is defined as the clients' are: the softmax over ``j`` of
``z_k . g_j / tau``, ``z_k`` the server's representation of ``k`` in the same
modality (the model being distilled), ``g`` the global representations of the
other modality sent to the clients this round. The FedET row adds

.. math::
  \lambda \cdot \tfrac{1}{B} \sum_{k \in \text{batch}}
  \mathrm{KL}\big(s^{\mathrm{div}}_k \,\|\, \operatorname{softmax}_j(z_k \cdot g_j / \tau)\big)

to each batch of the server's distillation, per modality
(:func:`fedjax_mm.losses.fedet_diversity`,
:func:`fedjax_mm.algorithms.creamfl.server_kd_objective`); a sample whose present
clients all sit in the majority (one client, or unanimity) has no diversity
ensemble and adds 0 (the re-implementation's target there is the uniform
distribution, an artifact of dividing zero weights by ``sum + 1e-6``). What
stays CreamFL's: the consensus term is eq. (7)'s l2 distance to ``a_k`` instead
of the cross-entropy to a label (a representation has no label), so ``lambda``
weighs the KL against that distance.

**FedGEMS** (Cheng et al., "FedGEMS: Federated Learning of Larger Server Models
via Selective Knowledge Fusion", arXiv 2110.11027, 2021): selective knowledge
fusion. The public samples the server already gets right (its global
representation of ``k`` retrieves ``k`` among the other modality's, ``S_correct``)
are distilled from the server's own representation (FedGEMS's self-distillation
from its stored logits); on the others (``S_incorrect``) the server learns from
the clients that get the sample right (``argmax_j p^c_k(j) = k``; all present
clients when none does), weighted by low entropy:

.. math::
  \alpha^{(k,c)} = \operatorname{softmax}_{c \in \text{selected}_k}\,(-H(p^c_k)),
  \qquad H(p) = -\sum_j p(j) \log p(j).

The softmax of the negative entropy is this module's choice of "entropy-based"
weighting (lower entropy, more weight); FedGEMS's own normalisation of the
entropies could not be checked here. FedGEMS's logit memory across rounds is
replaced by the server's representation of the current round.

Both rules give absent clients (``present = False``) weight 0, and a sample
with no client present aggregates to 0, as :func:`fedjax_mm.server.gca.gca`.

Memory. The probabilities ``p^c_k`` are ``C x P x P`` numbers, 100 GB at the
paper's ``P = 50,000`` and ``C = 10``. :func:`fedet_with_diversity` (and
:func:`fedet`) and :func:`fedgems` stream the public samples ``k`` in chunks
with ``jax.lax.map``, as :func:`fedjax_mm.server.gca.gca` does, so at most
``C x chunk x P`` probabilities (and, for FedGEMS's ``S_correct``, ``chunk x P``
server scores) exist at once; ``chunk_size=None`` picks :func:`default_chunk_size`,
which keeps ``C x chunk x P`` within :data:`DEFAULT_CHUNK_ELEMENTS` (64 MiB of
float32). Every rule is row by row, so the result equals the unchunked
computation (tested: chunk sizes that divide ``P``, that do not, and ``>= P``,
each against per-sample loops). :func:`retrieval_probabilities` and
:func:`server_correct` are the unchunked references. The diversity term's
server side needs only the batch's ``B x P`` similarities.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fedjax_mm.server.gca import (
  DEFAULT_CHUNK_ELEMENTS,
  check_inputs,
  default_chunk_size,
  over_chunks,
)

Array = jax.Array

__all__ = [
  "DEFAULT_CHUNK_ELEMENTS",
  "default_chunk_size",
  "fedet",
  "fedet_with_diversity",
  "fedgems",
  "retrieval_probabilities",
  "server_correct",
]


def retrieval_probabilities(
  local: Array, global_other: Array, *, temperature: float | Array = 1.0
) -> Array:
  """``p^c_k(j)``: ``[C, P', P]`` softmax over ``j`` of ``l^c_k . g_j / tau``.

  Args:
    local: ``[C, P', d]`` local representations of one modality (all ``P`` public
      samples, or a chunk of them).
    global_other: ``[P, d]`` the server's global representations of the other modality.
    temperature: positive scalar ``tau``.
  """
  logits = jnp.einsum("ckd,jd->ckj", local, global_other) / temperature
  return jax.nn.softmax(logits, axis=-1)


def _normalise(scores: Array, keep: Array) -> Array:
  """Non-negative ``[C, P]`` scores -> weights over the kept clients, summing to 1 (or all 0)."""
  scores = jnp.where(keep, scores, 0.0)
  return scores / jnp.maximum(jnp.sum(scores, axis=0, keepdims=True), 1e-30)


def fedet_with_diversity(
  local: Array,
  global_other: Array,
  present: Array,
  *,
  temperature: float | Array = 1.0,
  chunk_size: int | None = None,
) -> tuple[Array, Array, Array, Array]:
  """FedET's consensus and its diversity ensemble (module docstring), in chunks of samples.

  Args:
    local: ``[C, P, d]`` local representations of one modality.
    global_other: ``[P, d]`` global representations of the other modality.
    present: ``bool [C]`` clients that sent representations this round.
    temperature: ``tau`` of :func:`retrieval_probabilities`.
    chunk_size: public samples per chunk (static); ``None`` picks
      :func:`default_chunk_size` (``C x chunk x P`` probabilities within
      :data:`DEFAULT_CHUNK_ELEMENTS`); ``>= P`` computes everything at once.

  Returns:
    ``(aggregated [P, d], weights [C, P], diversity [P, d], diversity_weights [C, P])``:
    the consensus ``a_k`` and its weights ``alpha``, and the diversity ensemble
    ``e_k`` and its weights ``beta`` (all 0 for a sample whose present clients are
    all in the majority).
  """
  local, global_other, present = (jnp.asarray(x) for x in (local, global_other, present))
  check_inputs(local, global_other, present)

  def one_chunk(local_chunk, rows):
    del rows
    p = retrieval_probabilities(local_chunk, global_other, temperature=temperature)  # [C, c, P]
    # A probability vector's variance is 0 only when it is uniform; keep such a client in
    # the mean rather than dividing by zero when every kept client is uniform.
    variance = jnp.maximum(jnp.var(p, axis=-1), 1e-30)  # [C, c]
    vote = jnp.argmax(p, axis=-1)  # [C, c]
    agree = (vote[:, None] == vote[None, :]) & present[None, :, None]  # [C, C', c]
    votes = jnp.where(present[:, None], jnp.sum(agree, axis=1), 0)  # present clients voting as c
    keep = present[:, None] & (votes == jnp.max(votes, axis=0, keepdims=True))
    weights = _normalise(variance, keep)
    diversity_weights = _normalise(variance, present[:, None] & ~keep)
    return (
      jnp.einsum("ck,ckd->kd", weights, local_chunk),
      weights.T,
      jnp.einsum("ck,ckd->kd", diversity_weights, local_chunk),
      diversity_weights.T,
    )

  agg, weights, diversity, diversity_weights = over_chunks(one_chunk, local, chunk_size)
  return agg, weights.T, diversity, diversity_weights.T


def fedet(
  local: Array,
  global_other: Array,
  present: Array,
  *,
  temperature: float | Array = 1.0,
  chunk_size: int | None = None,
) -> tuple[Array, Array]:
  """FedET's weighted consensus: majority vote, then variance-weighted mean (module docstring).

  Args:
    local: ``[C, P, d]`` local representations of one modality.
    global_other: ``[P, d]`` global representations of the other modality.
    present: ``bool [C]`` clients that sent representations this round.
    temperature: ``tau`` of :func:`retrieval_probabilities`.
    chunk_size: public samples per chunk (:func:`fedet_with_diversity`).

  Returns:
    ``(aggregated [P, d], weights [C, P])``.
  """
  agg, weights, _, _ = fedet_with_diversity(
    local, global_other, present, temperature=temperature, chunk_size=chunk_size
  )
  return agg, weights


def _retrieves_own_pair(queries: Array, global_other: Array, rows: Array) -> Array:
  """``bool [c]``: query ``i`` (the representation of sample ``rows[i]``) retrieves ``rows[i]``."""
  scores = jnp.einsum("kd,jd->kj", queries, global_other)
  return jnp.argmax(scores, axis=-1) == rows


def server_correct(global_same: Array, global_other: Array) -> Array:
  """``bool [P]``: the server's representation of sample ``k`` retrieves ``k`` (``S_correct``).

  Unchunked (``P x P`` scores); :func:`fedgems` computes it chunk by chunk.
  """
  global_same, global_other = jnp.asarray(global_same), jnp.asarray(global_other)
  return _retrieves_own_pair(global_same, global_other, jnp.arange(global_same.shape[0]))


def fedgems(
  local: Array,
  global_same: Array,
  global_other: Array,
  present: Array,
  *,
  temperature: float | Array = 1.0,
  chunk_size: int | None = None,
) -> tuple[Array, Array]:
  """FedGEMS's selective fusion: the server's own target on ``S_correct``, else correct clients by entropy.

  Args:
    local: ``[C, P, d]`` local representations of one modality.
    global_same: ``[P, d]`` the server's global representations of THIS modality.
    global_other: ``[P, d]`` those of the other modality.
    present: ``bool [C]`` clients that sent representations this round.
    temperature: ``tau`` of :func:`retrieval_probabilities`.
    chunk_size: public samples per chunk (static); ``None`` picks
      :func:`default_chunk_size`; ``>= P`` computes everything at once.

  Returns:
    ``(aggregated [P, d], weights [C, P])``; the weights are 0 on the samples the
    server keeps (``S_correct``), where the target is ``global_same``.
  """
  local, global_same, global_other, present = (
    jnp.asarray(x) for x in (local, global_same, global_other, present)
  )
  check_inputs(local, global_other, present)
  if global_same.shape != global_other.shape:
    raise ValueError(
      f"global_same must be [P, d] = {global_other.shape}, got shape {global_same.shape}."
    )

  def one_chunk(local_chunk, rows):
    p = retrieval_probabilities(local_chunk, global_other, temperature=temperature)  # [C, c, P]
    entropy = -jnp.sum(p * jnp.log(jnp.maximum(p, 1e-30)), axis=-1)  # [C, c]
    correct = jnp.argmax(p, axis=-1) == rows[None, :]
    selected = present[:, None] & correct
    selected = jnp.where(jnp.any(selected, axis=0, keepdims=True), selected, present[:, None])
    # softmax over the selected clients of -H, shifted by the smallest selected entropy.
    low = jnp.min(jnp.where(selected, entropy, jnp.inf), axis=0, keepdims=True)
    low = jnp.where(jnp.isfinite(low), low, 0.0)
    weights = _normalise(jnp.exp(-(entropy - low)), selected)
    own = global_same[rows]  # [c, d]
    keep = _retrieves_own_pair(own, global_other, rows)  # [c]: S_correct
    weights = jnp.where(keep[None, :], 0.0, weights)
    fused = jnp.einsum("ck,ckd->kd", weights, local_chunk)
    return jnp.where(keep[:, None], own, fused), weights.T

  agg, weights = over_chunks(one_chunk, local, chunk_size)
  return agg, weights.T
