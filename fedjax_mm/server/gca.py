r"""Global-local contrastive aggregation (GCA): CreamFL eqs. (4)-(6), and plain weighting.

CreamFL paper (``creamfl.txt``), Section 3.3. ``C`` clients sent their local
representations ``l^c`` ``[P, d]`` of the public set in one modality; the server
holds its global representations ``g`` ``[P, d]`` of the OTHER modality. For
public sample ``k`` and client ``c``:

.. math::
  s^{(k,c)} &= l^c_k \cdot g_k / \tau
             - \log \sum_{j \ne k} \exp(l^c_k \cdot g_j / \tau)       &\text{(eq. 4)} \\
  \alpha^{(k,\cdot)} &= \operatorname{softmax}_c\, s^{(k,c)}                &\text{(eq. 5)} \\
  a_k &= \sum_c \alpha^{(k,c)} l^c_k                                        &\text{(eq. 6)}

(``tau = 1`` is the paper's equation; the reference implementation's ``con_w``
aggregation, FLAIR-THU/CreamFL ``src/algorithms/MMFL.py``, divides by no
temperature either. That code normalises over ALL ``j``, ``j = k`` included,
where eq. (4) sums over ``j != k``; this module follows eq. (4) as printed.)
Clients that did not take part (or padding clients) have ``present = False``
and weight 0; a sample with no client present aggregates to 0.

Memory. Eq. (4) needs, per client, the similarities of every public sample to
every other: ``C x P x P`` numbers, 100 GB at the paper's ``P = 50,000`` and
``C = 10``. :func:`gca` streams the anchors ``k`` in chunks with
``jax.lax.map`` and does eqs. (4)-(6) for one chunk at a time, so at most
``C x chunk x P`` similarities exist at once (:data:`DEFAULT_CHUNK_ELEMENTS`
bounds it); the result equals the unchunked computation.

The baselines of CreamFL's Tables 1 and 3 weight whole clients instead
(:func:`client_weighted`): ``reamFL+Mean`` (uniform), ``reamFL+Avg`` (sample
counts) and ``reamFL+IoT`` (sample counts, multimodal clients times 100).
Every function is a pure transform of stacked arrays.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array

# Similarities of one chunk, C x chunk x P float32: 2**24 is 64 MiB.
DEFAULT_CHUNK_ELEMENTS = 2**24


def default_chunk_size(num_clients: int, num_public: int) -> int:
  """Anchors per chunk that keep ``C x chunk x P`` within :data:`DEFAULT_CHUNK_ELEMENTS`."""
  return max(1, min(num_public, DEFAULT_CHUNK_ELEMENTS // max(1, num_clients * num_public)))


def check_inputs(local: Array, global_other: Array, present: Array) -> None:
  """Raises ValueError unless ``local [C, P, d]``, ``global_other [P, d]``, ``present [C]`` agree."""
  if local.ndim != 3:
    raise ValueError(f"local must be [C, P, d], got shape {local.shape}.")
  if global_other.shape != local.shape[1:]:
    raise ValueError(
      f"global_other must be [P, d] = {local.shape[1:]}, got shape {global_other.shape}."
    )
  if present.shape != local.shape[:1]:
    raise ValueError(f"present must be [C] = {local.shape[:1]}, got shape {present.shape}.")


def over_chunks(fn: Callable[[Array, Array], Any], local: Array, chunk_size: int | None) -> Any:
  """``fn(local[:, rows], rows)`` over chunks of public samples, stitched back to ``P`` rows.

  ``fn`` returns a pytree whose leaves have the chunk's samples on axis 0. Chunk ``i``
  covers samples ``[start_i, start_i + chunk)``, the last one shifted back to end at
  ``P`` (it recomputes a few rows, identically, since every rule that uses this is row
  by row), so nothing is padded or copied: each chunk slices ``local`` in place.
  ``chunk_size``: ``None`` picks :func:`default_chunk_size`; ``>= P`` calls ``fn`` once.
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


def _chunk_scores(local: Array, global_other: Array, rows: Array, temperature) -> Array:
  """Eq. (4) for anchors ``rows`` ``[c]``: ``local`` is ``[C, c, d]``; returns ``[C, c]``."""
  logits = jnp.einsum("ckd,pd->ckp", local, global_other) / temperature  # [C, c, P]
  is_pair = rows[:, None] == jnp.arange(global_other.shape[0])[None, :]  # [c, P]
  negatives = jax.nn.logsumexp(jnp.where(is_pair[None], -jnp.inf, logits), axis=-1)
  positive = jnp.einsum("ckd,kd->ck", local, global_other[rows]) / temperature
  return positive - negatives


def _softmax_over_clients(scores: Array, present: Array) -> Array:
  """Eq. (5): ``[C, ...]`` scores -> weights summing to 1 over present clients."""
  mask = present.reshape(present.shape + (1,) * (scores.ndim - 1))
  masked = jnp.where(mask, scores, -jnp.inf)
  top = jnp.max(masked, axis=0, keepdims=True)
  top = jnp.where(jnp.isfinite(top), top, 0.0)
  e = jnp.where(mask, jnp.exp(masked - top), 0.0)
  return e / jnp.maximum(jnp.sum(e, axis=0, keepdims=True), 1e-30)


def contrastive_scores(
  local: Array, global_other: Array, *, temperature: float | Array = 1.0
) -> Array:
  """Eq. (4) for every client and sample at once (``C x P x P`` memory; the reference).

  Args:
    local: ``[C, P, d]`` local representations of one modality.
    global_other: ``[P, d]`` global representations of the other modality.
    temperature: positive scalar (1 in the paper).

  Returns:
    ``[C, P]`` scores ``s^{(k,c)}``.
  """
  local, global_other = jnp.asarray(local), jnp.asarray(global_other)
  rows = jnp.arange(local.shape[1])
  return _chunk_scores(local, global_other, rows, temperature)


def gca(
  local: Array,
  global_other: Array,
  present: Array,
  *,
  temperature: float | Array = 1.0,
  chunk_size: int | None = None,
) -> tuple[Array, Array]:
  """Global-local contrastive aggregation, eqs. (4)-(6), in chunks of anchors.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm.server import gca
    >>> g = jnp.eye(3)
    >>> local = jnp.stack([g, -g])  # client 0 matches its pairs, client 1 is anti-aligned
    >>> agg, w = gca.gca(local, g, jnp.array([True, True]), chunk_size=2)
    >>> [round(float(v), 3) for v in w[:, 0]]
    [0.881, 0.119]

  Args:
    local: ``[C, P, d]`` local representations of one modality.
    global_other: ``[P, d]`` global representations of the other modality.
    present: ``bool [C]`` clients that sent representations this round.
    temperature: positive scalar (1 in the paper).
    chunk_size: anchors per chunk (static); ``None`` picks
      :func:`default_chunk_size`; ``>= P`` computes everything at once.

  Returns:
    ``(aggregated [P, d], weights [C, P])``.
  """
  local, global_other, present = (jnp.asarray(x) for x in (local, global_other, present))
  check_inputs(local, global_other, present)

  def one_chunk(local_chunk, rows):  # [C, c, d], [c] -> [c, d], [c, C]
    weights = _softmax_over_clients(
      _chunk_scores(local_chunk, global_other, rows, temperature), present
    )
    return jnp.einsum("ck,ckd->kd", weights, local_chunk), weights.T

  agg, weights = over_chunks(one_chunk, local, chunk_size)
  return agg, weights.T


def client_weighted(local: Array, client_weights: Array) -> tuple[Array, Array]:
  """Aggregation by one weight per client (reamFL+Mean / +Avg / +IoT).

  Args:
    local: ``[C, P, d]`` local representations.
    client_weights: ``[C]`` non-negative weights (0 for absent clients);
      normalised here.

  Returns:
    ``(aggregated [P, d], weights [C, P])``; all zeros if every weight is 0.
  """
  local = jnp.asarray(local)
  w = jnp.asarray(client_weights, local.dtype)
  w = w / jnp.maximum(jnp.sum(w), 1e-30)
  weights = jnp.broadcast_to(w[:, None], local.shape[:2])
  return jnp.einsum("c,cpd->pd", w, local), weights
