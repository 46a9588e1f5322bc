r"""FedHeNN's proximal term: centred kernel alignment of representation kernels.

Paper: Makhija, Han, Ho and Ghosh, "Architecture Agnostic Federated Learning
for Neural Networks", ICML 2022 (arXiv 2202.07757). Client ``j`` minimises its
local loss plus ``eta`` times a distance between the kernel of its own
representations of a shared *representation alignment dataset* (RAD) ``X``
and the kernel the server aggregated from every client's representations,

.. math::
  \min_{W_j} \; f_j(W_j) + \eta\, d\big(K(W_j, X), \bar K\big), \qquad
  K(W, X) = \phi(X; W)\,\phi(X; W)^\top, \qquad
  \bar K = \textstyle\sum_i w_i\, K(W_i, X),

with ``d`` built on centred kernel alignment (Kornblith et al., 2019):

.. math::
  \mathrm{CKA}(K, L) = \frac{\mathrm{HSIC}(K, L)}{\sqrt{\mathrm{HSIC}(K, K)\,\mathrm{HSIC}(L, L)}},
  \qquad \mathrm{HSIC}(K, L) = \frac{\mathrm{tr}(K H L H)}{(n - 1)^2},
  \qquad H = I - \tfrac{1}{n}\mathbf 1 \mathbf 1^\top.

Since ``H`` is symmetric and idempotent, ``tr(KHLH) = <HKH, HLH>_F``, and the
``(n - 1)^2`` cancels in the ratio. The distance here is ``1 - CKA`` (in
``[0, 1]`` for positive semi-definite kernels; the same gradient as ``-CKA``).
Kernels are linear (``phi`` = the user's L2-normalised representation ``z``),
as the paper's experiments use.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def linear_kernel(z: Array) -> Array:
  """``K = z z^T`` ``[n, n]`` of representations ``z [n, d]``."""
  return z @ z.T


def center_kernel(k: Array) -> Array:
  """``H K H`` for ``K [n, n]``: rows and columns centred."""
  k = k - k.mean(axis=0, keepdims=True)
  return k - k.mean(axis=1, keepdims=True)


def cka(k: Array, l: Array, *, eps: float = 1e-12) -> Array:
  r"""Centred kernel alignment of two ``[n, n]`` kernels (a scalar in ``[0, 1]``).

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> z = jnp.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    >>> round(float(losses.cka(losses.linear_kernel(z), losses.linear_kernel(2 * z))), 4)
    1.0

  Args:
    k: ``[n, n]`` kernel.
    l: ``[n, n]`` kernel on the same ``n`` samples.
    eps: guards the denominator (a constant kernel has no alignment: 0).

  Returns:
    ``<HKH, HLH>_F / (||HKH||_F ||HLH||_F)``.

  Raises:
    ValueError: ``k`` and ``l`` are not square kernels of one shape (a
      representation matrix ``[n, d]`` in place of its kernel, say).
  """
  if k.ndim != 2 or k.shape[0] != k.shape[1] or k.shape != l.shape:
    raise ValueError(
      f"cka takes two [n, n] kernels on the same n samples, got {k.shape} and {l.shape}; "
      "pass linear_kernel(z) for representations z [n, d]."
    )
  kc, lc = center_kernel(k), center_kernel(l)
  num = jnp.sum(kc * lc)
  den = jnp.sqrt(jnp.sum(kc * kc) * jnp.sum(lc * lc))
  return num / jnp.maximum(den, eps)


def cka_distance(z: Array, target_kernel: Array) -> Array:
  """FedHeNN's proximal distance ``1 - CKA(z z^T, K_bar)`` (a scalar).

  Args:
    z: ``[n, d]`` this user's representations of the RAD.
    target_kernel: ``[n, n]`` the server's aggregated kernel ``K_bar`` (a
      constant for the user: no gradient flows into it).

  Raises:
    ValueError: as :func:`cka` (``z`` on other samples than the kernel's).
  """
  return 1.0 - cka(linear_kernel(z), jax.lax.stop_gradient(target_kernel))
