"""InfoNCE and its two-view and pairwise extensions.

Every function here takes L2-normalised representation matrices (rows are
samples, row ``i`` of each matrix comes from the same data sample ``i``) and
returns one loss value per anchor; the caller reduces (``.mean()``). They import
only ``jax`` and are safe under ``jit``, ``vmap`` and ``grad``.

References:
  - [Oord et al., 2018] Representation Learning with Contrastive Predictive
    Coding. arXiv:1807.03748.
  - [Radford et al., 2021] Learning Transferable Visual Models From Natural
    Language Supervision (CLIP).
  - FedMuscle paper, eq. (1) (InfoNCE) and Section 4.1 (pairwise alignment).
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

Array = jax.Array


def _check_matrix(name: str, x: Array) -> None:
  if x.ndim != 2:
    raise ValueError(f"{name} must be a [B, d] matrix, got shape {x.shape}.")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"{name} must be floating-point representations, got dtype {x.dtype}.")


def check_positive(name: str, value: float | Array) -> None:
  """Raises if a concrete ``value`` has an entry <= 0 (or NaN); a traced one passes.

  Temperatures divide the similarities: a zero gives NaN losses and a negative one
  turns the loss into its opposite, both silently. A traced value (a learnt
  temperature under ``jit``) cannot be read at trace time and is not checked.
  """
  try:
    concrete = np.asarray(value, np.float64)
  except (jax.errors.ConcretizationTypeError, jax.errors.TracerArrayConversionError):
    return
  if not np.all(concrete > 0):
    raise ValueError(f"{name} must be positive, got {value}.")


def info_nce(
  anchor: Array,
  positive: Array,
  *,
  temperature: float | Array,
  where: Array | None = None,
) -> Array:
  r"""InfoNCE loss of each anchor against the candidates of one other view.

  For anchor ``i`` the candidates are all rows ``j`` of ``positive``; row ``i``
  is the positive, every other row a negative (paper eq. (1)):

  .. math::
    \ell_i = -\log \frac{\exp(a_i \cdot p_i / \tau)}
                        {\sum_j \exp(a_i \cdot p_j / \tau)}

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> z = jnp.eye(2)
    >>> [round(float(v), 4) for v in losses.info_nce(z, z, temperature=1.0)]  # log(1 + 1/e)
    [0.3133, 0.3133]

  Args:
    anchor: ``[B, d]`` anchor representations.
    positive: ``[B, d]`` representations of the same ``B`` samples from the
      other view (model, modality).
    temperature: positive scalar temperature ``tau``.
    where: optional ``[B]`` boolean mask of valid samples. An invalid sample is
      neither an anchor (its loss is 0) nor a candidate for any other anchor,
      so padded batches give the same losses as unpadded ones.

  Returns:
    ``[B]`` per-anchor losses.
  """
  _check_matrix("anchor", anchor)
  _check_matrix("positive", positive)
  if anchor.shape != positive.shape:
    raise ValueError(
      f"anchor and positive must both be [B, d] (row i of each from sample i), got "
      f"shapes {anchor.shape} and {positive.shape}."
    )
  check_positive("temperature", temperature)
  logits = anchor @ positive.T / temperature
  if where is not None:
    logits = jnp.where(where[None, :], logits, -jnp.inf)
  loss = jax.nn.logsumexp(logits, axis=-1) - jnp.diagonal(logits)
  if where is not None:
    loss = jnp.where(where, loss, 0.0)
  return loss


def symmetric_info_nce(
  a: Array,
  b: Array,
  *,
  temperature: float | Array,
  weight: float = 0.5,
  where: Array | None = None,
) -> Array:
  r"""Two-directional InfoNCE (ConVIRT / CLIP style).

  .. math::
    \ell_i = w \, \mathrm{InfoNCE}(a \to b)_i + (1 - w) \, \mathrm{InfoNCE}(b \to a)_i

  Args:
    a: ``[B, d]`` representations of view ``a``.
    b: ``[B, d]`` representations of view ``b``.
    temperature: scalar temperature.
    weight: weight ``w`` of the ``a``-to-``b`` direction (anchors from ``a``).
    where: optional ``[B]`` validity mask, as in :func:`info_nce`.

  Returns:
    ``[B]`` per-sample losses.
  """
  a_to_b = info_nce(a, b, temperature=temperature, where=where)
  b_to_a = info_nce(b, a, temperature=temperature, where=where)
  return weight * a_to_b + (1.0 - weight) * b_to_a


def pairwise_info_nce(anchor: Array, others: Array, *, tau: float | Array) -> Array:
  r"""Pairwise alignment: the sum of InfoNCE losses against each other model.

  .. math::
    \ell_i = \sum_{m=1}^{M} \mathrm{InfoNCE}(z^n \to z^m; \tau_m)_i

  This is the paper's :math:`\mathcal{L}^n_{\mathrm{Pairwise}}` (Section 4.1)
  and what the Muscle loss reduces to when all ``gamma = 0`` (Appendix B).

  Args:
    anchor: ``[B, d]`` anchor representations ``Z^n``.
    others: ``[M, B, d]`` representations ``Z^m`` of the ``M`` other models
      (or a sequence of ``M`` arrays ``[B, d]``).
    tau: scalar or ``[M]`` temperatures ``tau_{n,m}``.

  Returns:
    ``[B]`` per-anchor losses.
  """
  _check_matrix("anchor", anchor)
  others = stack_others(others)
  check_positive("tau", tau)  # Traced inside the vmap below: checked here, once.
  tau = jnp.broadcast_to(jnp.asarray(tau, anchor.dtype), others.shape[:1])
  per_model = jax.vmap(lambda z, t: info_nce(anchor, z, temperature=t))(others, tau)
  return per_model.sum(axis=0)


def stack_others(others: Array | Sequence[Array]) -> Array:
  """``others`` as one ``[M, B, d]`` floating-point array: a sequence of ``[B, d]`` is stacked.

  The other models' representations usually come one model at a time; stacking
  them here gives the one error that names what is wrong instead of an
  ``AttributeError`` or a broadcasting error deep in the loss.
  """
  if isinstance(others, (list, tuple)):
    if not others:
      raise ValueError("others is empty: the loss needs at least one other model (M >= 1).")
    shapes = [jnp.shape(z) for z in others]
    if any(len(s) != 2 for s in shapes) or len(set(shapes)) > 1:
      raise ValueError(
        f"others must be [M, B, d], or M arrays [B, d] of one shape; got shapes {shapes}."
      )
    others = jnp.stack(others)
  others = jnp.asarray(others)
  if others.ndim != 3:
    raise ValueError(f"others must be [M, B, d], got shape {others.shape}.")
  if not jnp.issubdtype(others.dtype, jnp.floating):
    raise ValueError(f"others must be floating-point representations, got dtype {others.dtype}.")
  return others
