r"""FedRGB's DRO client weights (eqs. (3)-(5), App. B eqs. (7)-(11)).

The server keeps weights ``w`` on the simplex and moves them towards the
clients with the larger DRO loss ``v`` (eq. (5)):

.. math::
  w \leftarrow \mathrm{Proj}\big(w \odot e^{\gamma v} / \textstyle\sum_i w_i e^{\gamma v_i},\ \rho\big)

onto the uncertainty set ``Q = {w in simplex : D(N w || 1) <= rho}`` with the
chi-square divergence of ``f(t) = (t - 1)^2 / 2`` (the authors' code,
BioMed-AI-Lab-U-Michgan/TMLR_FedDRA):

.. math::
  D(N w \| 1) = \frac{1}{2N} \sum_i (N w_i - 1)^2 = \frac{N}{2} \|w - u\|^2,\quad u = 1/N.

So ``Q`` is the simplex intersected with the ball of radius ``r = sqrt(2 rho / N)``
around the uniform weights. :func:`project_chi2_ball` is the exact Euclidean
projection of ANY ``w`` onto it (see its docstring for the bracket); unlike the
authors' function it accepts ``rho = 0`` (the uniform weights) and its bracket
holds for every ``rho >= 0``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

BISECTION_STEPS = 64


def project_simplex(v: Array) -> Array:
  """Euclidean projection of ``v`` ``[N]`` onto the probability simplex (sort-based).

  ``max(v - theta, 0)`` with ``theta`` from the largest ``k`` such that the
  ``k`` largest entries minus their shifted mean stay positive (Held et al.
  1974; Duchi et al. 2008).
  """
  n = v.shape[-1]
  s = jnp.sort(v)[::-1]
  css = jnp.cumsum(s) - 1.0
  k = jnp.arange(1, n + 1, dtype=v.dtype)
  cond = s - css / k > 0
  rho = jnp.max(jnp.where(cond, jnp.arange(n), -1))
  theta = css[rho] / (rho + 1).astype(v.dtype)
  return jnp.maximum(v - theta, 0.0)


def chi2_divergence(w: Array) -> Array:
  """``D(N w || 1) = (1 / (2N)) sum_i (N w_i - 1)^2`` for ``w`` ``[N]``."""
  n = w.shape[-1]
  return jnp.sum(jnp.square(n * w - 1.0)) / (2.0 * n)


def _check_rho(rho) -> None:
  try:
    value = float(rho)
  except (TypeError, jax.errors.ConcretizationTypeError):
    return  # traced: the caller validated it
  if not value >= 0.0:
    raise ValueError(f"project_chi2_ball: rho must be >= 0, got {value}.")


def project_chi2_ball(w: Array, rho: float | Array, *, steps: int = BISECTION_STEPS) -> Array:
  r"""Exact Euclidean projection of ``w`` ``[N]`` onto ``{x in simplex : D(N x || 1) <= rho}``.

  With ``u = 1/N`` and ``r = sqrt(2 rho / N)`` the set is
  ``C = simplex ∩ {x : ||x - u|| <= r}``, and ``u`` lies in both.

  **Lagrange multiplier.** For ``mu >= 0`` the minimiser over the simplex of
  ``||x - w||^2 / 2 + mu (||x - u||^2 - r^2) / 2`` is
  ``x(mu) = P_simplex((w + mu u) / (1 + mu)) = P_simplex(u + t (w - u))`` with
  ``t = 1 / (1 + mu)`` in ``(0, 1]``. For ``r > 0`` Slater holds (``u`` is
  strictly inside the ball), so the projection is ``x(mu)`` at a ``mu`` with
  complementary slackness: ``mu = 0`` if ``g(1) <= r``, else ``g(t) = r``,
  where ``g(t) = ||P_simplex(u + t (w - u)) - u||``.

  **Bracket.** (i) ``g(0) = ||P_simplex(u) - u|| = 0 <= r``. (ii) ``g`` is
  continuous, the simplex projection being 1-Lipschitz. (iii) ``g`` is
  non-decreasing in ``t``: the dual function ``q(mu) = min_x L(x, mu)`` is
  concave with derivative ``(||x(mu) - u||^2 - r^2) / 2`` (unique minimiser,
  Danskin), so ``||x(mu) - u||`` is non-increasing in ``mu`` and therefore
  non-decreasing in ``t``. Hence if ``g(1) > r`` the set ``{t : g(t) <= r}``
  is an interval ``[0, t*]`` with ``g(t*) = r``, and bisection on ``t`` over
  ``[0, 1]`` (keeping the feasible end) converges to ``t*`` — for every
  ``rho >= 0``, with no assumption on ``w``. ``rho = 0`` gives ``t* = 0``,
  ``x = u``.

  ``steps`` halvings bring the bracket below float resolution (64 > the 53
  bits of float64); the result is finally shrunk towards ``u`` by
  ``min(1, r / ||x - u||)`` (a convex combination inside the simplex), so it
  is always feasible. For ``w`` on the simplex, ``x = u + min(1, sqrt(rho /
  D(w))) (w - u)``.

  Args:
    w: ``[N]`` any real vector.
    rho: the radius, ``>= 0`` (a negative concrete value raises ValueError).
    steps: bisection steps.

  Returns:
    ``[N]`` the projection.
  """
  _check_rho(rho)
  n = w.shape[-1]
  u = jnp.full_like(w, 1.0 / n)
  r = jnp.sqrt(2.0 * jnp.maximum(jnp.asarray(rho, w.dtype), 0.0) / n)

  def at(t):
    return project_simplex(u + t * (w - u))

  def dist(x):
    return jnp.sqrt(jnp.sum(jnp.square(x - u)))

  def body(_, bracket):
    lo, hi = bracket
    mid = 0.5 * (lo + hi)
    ok = dist(at(mid)) <= r
    return jnp.where(ok, mid, lo), jnp.where(ok, hi, mid)

  full = at(jnp.ones((), w.dtype))
  lo, _ = jax.lax.fori_loop(0, steps, body, (jnp.zeros((), w.dtype), jnp.ones((), w.dtype)))
  x = jnp.where(dist(full) <= r, full, at(lo))
  d = dist(x)
  scale = jnp.where(d > r, r / jnp.maximum(d, jnp.finfo(w.dtype).tiny), 1.0)
  return u + scale * (x - u)


def dro_update(w: Array, v: Array, *, gamma: float | Array, rho: float | Array) -> Array:
  """One DRO weight step (eq. (5) / (11)): ``Proj(w e^{gamma v} / sum, rho)``.

  Computed as a softmax of ``log w + gamma v`` (stable for large ``gamma v``;
  a zero weight stays zero before the projection).

  Args:
    w: ``[N]`` current weights on the simplex.
    v: ``[N]`` each client's DRO loss.
    gamma: the step size, ``>= 0``.
    rho: the radius, ``>= 0``.

  Returns:
    ``[N]`` the new weights.
  """
  logits = jnp.where(w > 0, jnp.log(jnp.maximum(w, jnp.finfo(w.dtype).tiny)), -jnp.inf) + gamma * v
  return project_chi2_ball(jax.nn.softmax(logits), rho)
