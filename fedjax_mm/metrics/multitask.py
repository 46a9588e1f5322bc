"""The multi-task summary Delta: mean relative improvement over local training.

Users of a federated multi-task system solve different tasks with different
metrics (accuracy, micro-F1, mIoU, Recall@K), so no single metric can be
averaged across them. Following Maninis et al. (2019) and Lu et al. (2024), the
FedMuscle paper summarises an algorithm by the mean over users of the relative
change of each user's own metric against the same user trained locally.

References:
  - FedMuscle paper, Section 6 ("Performance Metrics") and Appendix
    ("Performance Metric for Federated Multi-Task Learning").
  - [Maninis et al., 2019] Attentive Single-Tasking of Multiple Tasks (CVPR).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def delta(metric_alg: Array, metric_local: Array, *, where: Array | None = None) -> Array:
  r"""Mean over users of the relative improvement over local training.

  .. math::
    \Delta = \frac{1}{N} \sum_{n=1}^{N}
      \frac{M^n_{\mathrm{alg}} - M^n_{\mathrm{local}}}{M^n_{\mathrm{local}}}

  over the ``N`` valid users. The result is a fraction: the papers' tables
  print ``100 * delta`` as a percentage (``+26.70`` means ``0.2670``). Each
  metric must be "higher is better" and ``M_local`` nonzero for every valid
  user (a zero gives ``inf`` or NaN, as the formula does); masked-out users
  never contribute, whatever their values. With no valid user Delta is ``0``.
  Both metrics may be in fractions or both in percentages: the ratio is the
  same.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import metrics
    >>> alg = jnp.array([0.75, 0.40, 0.30])
    >>> local = jnp.array([0.50, 0.50, 0.00])
    >>> print(metrics.delta(alg, local, where=jnp.array([True, True, False])))
    0.15

  Args:
    metric_alg: ``[N]`` metric of each user under the evaluated algorithm.
    metric_local: ``[N]`` the same metric of each user under local training.
    where: optional ``[N]`` boolean mask of users to include.

  Returns:
    Scalar float (a fraction; multiply by 100 for a percentage).
  """
  dtype = jnp.result_type(float)
  metric_alg = jnp.asarray(metric_alg, dtype=dtype)
  metric_local = jnp.asarray(metric_local, dtype=dtype)
  if metric_alg.shape != metric_local.shape:
    raise ValueError(
      f"metric_alg {metric_alg.shape} and metric_local {metric_local.shape} must match."
    )
  valid = jnp.ones(metric_alg.shape, bool) if where is None else jnp.asarray(where, bool)
  if valid.shape != metric_alg.shape:
    raise ValueError(f"where must have shape {metric_alg.shape}, got {valid.shape}.")
  # Padding users (often 0 / 0) get a dummy denominator: no NaN is ever formed,
  # so the metric stays clean under jax_debug_nans.
  relative = (metric_alg - metric_local) / jnp.where(valid, metric_local, 1)
  count = jnp.sum(valid)
  total = jnp.sum(jnp.where(valid, relative, 0))
  return jnp.where(count > 0, total / jnp.maximum(count, 1), 0)
