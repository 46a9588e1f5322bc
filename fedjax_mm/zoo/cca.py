r"""FedMuscle's precondition: what two encoders share, and whether it holds the tasks' shape.

FedMuscle aligns each user's representation of a public set to its partners'. A user can
only borrow from a partner what the two encoders' features have in common, and canonical
correlation analysis (Hotelling, 1936) finds exactly that: the directions ``a_j`` of one
encoder's features ``X`` and ``b_j`` of the other's ``Y`` whose projections are most
correlated, ``rho_j = corr(X a_j, Y b_j)``, each pair uncorrelated with the earlier ones.
With ``C_xx``, ``C_yy`` the (ridge-regularised) covariances and ``C_xy`` the
cross-covariance of the centred features,

    W_x = C_xx^{-1/2},  W_y = C_yy^{-1/2},  W_x C_xy W_y = U diag(rho) V^T   (SVD)
    A = W_x U[:, :k],   B = W_y V[:, :k]

:func:`cca` computes it (float64 numpy). :func:`shared_probe` is the measurement issue 65
asks of the zoo: fit the top ``k = 8`` directions on the public set, project each encoder's
features of labelled private samples onto its own ``k`` directions, and score a linear
probe for the primary shape on them. If the shared directions decode shape poorly (say,
they are colour), aligning to partners can only pull a user toward colour.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

__all__ = ["Cca", "cca", "shared_probe"]


class Cca(NamedTuple):
  """Canonical directions of two feature sets.

  Attributes:
    x_mean, y_mean: ``[p]``, ``[q]`` the means the features are centred by.
    x_directions: ``[p, k]`` ``A``; ``(x - x_mean) @ A`` has unit variance columns.
    y_directions: ``[q, k]`` ``B``.
    correlations: ``[k]`` ``rho_j``, descending.
  """

  x_mean: np.ndarray
  y_mean: np.ndarray
  x_directions: np.ndarray
  y_directions: np.ndarray
  correlations: np.ndarray

  def project_x(self, x: np.ndarray) -> np.ndarray:
    return (np.asarray(x, np.float64) - self.x_mean) @ self.x_directions

  def project_y(self, y: np.ndarray) -> np.ndarray:
    return (np.asarray(y, np.float64) - self.y_mean) @ self.y_directions


def _inverse_sqrt(c: np.ndarray) -> np.ndarray:
  w, v = np.linalg.eigh(c)
  return (v / np.sqrt(w)) @ v.T


def cca(x: np.ndarray, y: np.ndarray, k: int, *, ridge: float = 1e-3) -> Cca:
  """The top ``k`` canonical directions of ``x [n, p]`` and ``y [n, q]`` (rows paired).

  Args:
    x, y: two encoders' features of the same ``n`` inputs.
    k: directions kept, at most ``min(p, q)``.
    ridge: added to each covariance's diagonal, relative to its mean variance (features
      of a frozen encoder are often rank-deficient).

  Raises:
    ValueError: unpaired rows, fewer than 2 rows, or ``k`` out of range.
  """
  x, y = np.asarray(x, np.float64), np.asarray(y, np.float64)
  if x.ndim != 2 or y.ndim != 2 or x.shape[0] != y.shape[0] or x.shape[0] < 2:
    raise ValueError(
      f"cca needs paired [n, p] and [n, q] features, n >= 2; got {x.shape}, {y.shape}"
    )
  if not 1 <= k <= min(x.shape[1], y.shape[1]):
    raise ValueError(f"k must be in [1, {min(x.shape[1], y.shape[1])}], got {k}")
  mx, my = x.mean(0), y.mean(0)
  xc, yc = x - mx, y - my
  n = x.shape[0] - 1
  cxx, cyy, cxy = xc.T @ xc / n, yc.T @ yc / n, xc.T @ yc / n
  cxx += ridge * np.trace(cxx) / cxx.shape[0] * np.eye(cxx.shape[0])
  cyy += ridge * np.trace(cyy) / cyy.shape[0] * np.eye(cyy.shape[0])
  wx, wy = _inverse_sqrt(cxx), _inverse_sqrt(cyy)
  u, s, vt = np.linalg.svd(wx @ cxy @ wy)
  return Cca(mx, my, wx @ u[:, :k], wy @ vt[:k].T, s[:k])


def shared_probe(
  public_x: np.ndarray,
  public_y: np.ndarray,
  train: tuple[np.ndarray, np.ndarray, np.ndarray],
  test: tuple[np.ndarray, np.ndarray, np.ndarray],
  *,
  num_classes: int,
  k: int = 8,
) -> dict[str, float]:
  """How well the top ``k`` shared directions decode a label, from either encoder's side.

  Args:
    public_x, public_y: the two encoders' features of the public set (the fit).
    train, test: ``(x features, y features, labels)`` of labelled private samples.
    num_classes: label classes.
    k: canonical directions kept.

  Returns:
    ``{"x": %, "y": %, "min": %, "correlations": [rho_1, ...]}``: the linear probe's test
    accuracy on each encoder's projection and the smaller of the two.
  """
  import jax.numpy as jnp

  from fedjax_mm.algorithms import probe

  fit = cca(public_x, public_y, k)
  out = {}
  for side, project, i in (("x", fit.project_x, 0), ("y", fit.project_y, 1)):
    out[side] = 100 * probe.linear_probe_score(
      jnp.asarray(project(train[i]), jnp.float32),
      jnp.asarray(train[2]),
      jnp.asarray(project(test[i]), jnp.float32),
      jnp.asarray(test[2]),
      num_outputs=num_classes,
    )
  out["min"] = min(out["x"], out["y"])
  out["correlations"] = [float(r) for r in fit.correlations]
  return out
