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
Large Models in Federated Learning", IJCAI 2022): weighted consensus
distillation. Per sample, the clients vote with their top prediction
(``argmax_j p^c_k(j)``); those in the majority (every tied largest group) are
kept, and each kept client weighs by its confidence, the variance of its
probability vector (a peaked output has a large variance):

.. math::
  \alpha^{(k,c)} = \frac{[c \in \text{majority}_k]\, \mathrm{Var}_j\, p^c_k(j)}
                        {\sum_{c'} [c' \in \text{majority}_k]\, \mathrm{Var}_j\, p^{c'}_k(j)},
  \qquad a_k = \sum_c \alpha^{(k,c)} l^c_k .

FedET's diversity regulariser on the server's extra heads is not part of it
(the server here has one representation per modality, no classifier heads).

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
paper's ``P = 50,000`` and ``C = 10``. :func:`fedet` and :func:`fedgems` stream
the public samples ``k`` in chunks with ``jax.lax.map``, as
:func:`fedjax_mm.server.gca.gca` does, so at most ``C x chunk x P``
probabilities (and, for FedGEMS's ``S_correct``, ``chunk x P`` server scores)
exist at once; ``chunk_size=None`` picks :func:`default_chunk_size`, which keeps
``C x chunk x P`` within :data:`DEFAULT_CHUNK_ELEMENTS` (64 MiB of float32).
Every rule is row by row, so the result equals the unchunked computation
(tested: chunk sizes that divide ``P``, that do not, and ``>= P``, each against
per-sample loops). :func:`retrieval_probabilities` and :func:`server_correct`
are the unchunked references.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

from fedjax_mm.server.gca import DEFAULT_CHUNK_ELEMENTS, default_chunk_size

Array = jax.Array

__all__ = [
  "DEFAULT_CHUNK_ELEMENTS",
  "default_chunk_size",
  "fedet",
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


def _check(local: Array, global_other: Array, present: Array) -> None:
  if local.ndim != 3:
    raise ValueError(f"local must be [C, P, d], got shape {local.shape}.")
  if global_other.shape != local.shape[1:]:
    raise ValueError(
      f"global_other must be [P, d] = {local.shape[1:]}, got shape {global_other.shape}."
    )
  if present.shape != local.shape[:1]:
    raise ValueError(f"present must be [C] = {local.shape[:1]}, got shape {present.shape}.")


def _over_chunks(fn: Callable[[Array, Array], Any], local: Array, chunk_size: int | None) -> Any:
  """``fn(local[:, rows], rows)`` over chunks of public samples, stitched back to ``P`` rows.

  ``fn`` returns a pytree whose leaves have the chunk's samples on axis 0. As
  :func:`fedjax_mm.server.gca.gca`: chunk ``i`` covers samples ``[start_i, start_i +
  chunk)``, the last one shifted back to end at ``P`` (it recomputes a few rows,
  identically, since every rule here is row by row), so nothing is padded.
  """
  num_clients, num_public, _ = local.shape
  chunk = default_chunk_size(num_clients, num_public) if chunk_size is None else int(chunk_size)
  if chunk < 1:
    raise ValueError(f"chunk_size must be positive, got {chunk_size}.")
  if chunk >= num_public:
    return fn(local, jnp.arange(num_public))
  num_chunks = math.ceil(num_public / chunk)
  starts = jnp.minimum(jnp.arange(num_chunks) * chunk, num_public - chunk)

  def at(start):
    rows = start + jnp.arange(chunk)
    return fn(jax.lax.dynamic_slice_in_dim(local, start, chunk, axis=1), rows)

  chunks = jax.lax.map(at, starts)  # leaves [n, c, ...]
  rows = (starts[:, None] + jnp.arange(chunk)).reshape(-1)

  def stitch(x):
    tail = x.shape[2:]
    return jnp.zeros((num_public, *tail), x.dtype).at[rows].set(x.reshape(-1, *tail))

  return jax.tree.map(stitch, chunks)


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
    chunk_size: public samples per chunk (static); ``None`` picks
      :func:`default_chunk_size` (``C x chunk x P`` probabilities within
      :data:`DEFAULT_CHUNK_ELEMENTS`); ``>= P`` computes everything at once.

  Returns:
    ``(aggregated [P, d], weights [C, P])``.
  """
  local, global_other, present = (jnp.asarray(x) for x in (local, global_other, present))
  _check(local, global_other, present)

  def one_chunk(local_chunk, rows):
    del rows
    p = retrieval_probabilities(local_chunk, global_other, temperature=temperature)  # [C, c, P]
    variance = jnp.var(p, axis=-1)  # [C, c]
    vote = jnp.argmax(p, axis=-1)  # [C, c]
    agree = (vote[:, None] == vote[None, :]) & present[None, :, None]  # [C, C', c]
    votes = jnp.where(present[:, None], jnp.sum(agree, axis=1), 0)  # present clients voting as c
    keep = present[:, None] & (votes == jnp.max(votes, axis=0, keepdims=True))
    # A probability vector's variance is 0 only when it is uniform; keep such a client in
    # the mean rather than dividing by zero when every kept client is uniform.
    weights = _normalise(jnp.maximum(variance, 1e-30), keep)
    return jnp.einsum("ck,ckd->kd", weights, local_chunk), weights.T

  agg, weights = _over_chunks(one_chunk, local, chunk_size)
  return agg, weights.T


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
  _check(local, global_other, present)
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

  agg, weights = _over_chunks(one_chunk, local, chunk_size)
  return agg, weights.T
