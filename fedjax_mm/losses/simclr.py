r"""SimCLR's NT-Xent loss (normalised temperature-scaled cross entropy).

Chen, Kornblith, Norouzi and Hinton, "A Simple Framework for Contrastive
Learning of Visual Representations", ICML 2020 (arXiv 2002.05709), eq. (1).
A batch of ``B`` samples gives ``2B`` views, two per sample; for view ``i``
whose partner (the other view of its sample) is ``p(i)``:

.. math::
  \ell_i = -\log \frac{\exp(\mathrm{sim}(z_i, z_{p(i)}) / \tau)}
                      {\sum_{k \ne i} \exp(\mathrm{sim}(z_i, z_k) / \tau)},

with ``sim`` the cosine similarity; every one of the other ``2B - 2`` views is
a negative. The paper's loss is the mean of ``ell`` over the ``2B`` views.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array


def nt_xent(view1: Array, view2: Array, *, tau: float | Array) -> Array:
  """NT-Xent of each sample: the mean of its two views' losses.

  Examples:
    >>> import jax, jax.numpy as jnp
    >>> z = jax.random.normal(jax.random.key(0), (4, 8))
    >>> nt_xent(z, z + 0.01, tau=0.5).shape
    (4,)

  Args:
    view1: ``[B, d]`` representations of the first view of each sample.
    view2: ``[B, d]`` of the second view (row ``i``: the same sample).
    tau: temperature.

  Returns:
    ``[B]``: ``(ell_i + ell_{i+B}) / 2`` (the caller's mean is the paper's).
  """
  if view1.ndim != 2 or view1.shape != view2.shape:
    raise ValueError(f"views must both be [B, d], got {view1.shape} and {view2.shape}.")
  batch = view1.shape[0]
  z = jnp.concatenate([view1, view2])
  z = z / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), 1e-12)
  logits = z @ z.T / tau
  logits = jnp.where(jnp.eye(2 * batch, dtype=bool), -jnp.inf, logits)  # k != i
  partner = jnp.concatenate([jnp.arange(batch, 2 * batch), jnp.arange(batch)])
  per_view = jax.nn.logsumexp(logits, axis=-1) - logits[jnp.arange(2 * batch), partner]
  return 0.5 * (per_view[:batch] + per_view[batch:])
