r"""FedMEKT's embedding knowledge-transfer loss (RCSR's Table 1 baseline).

Paper: Le, Nguyen, Thwal, Qiao, Zhang and Hong, "FedMEKT: Distillation-based embedding
knowledge transfer for multimodal federated learning", Neural Networks 183, 107017
(2025; arXiv 2307.13214). Server and clients exchange the embeddings of a small
multimodal *proxy* (public) set; each side distils its encoder towards the other's
embeddings with a temperature-``T`` KL divergence that treats an embedding vector as
logits over its ``d`` coordinates (the authors' ``KL_Loss(temperature=3.0)``:
``T^2 KL(softmax(t / T) || softmax(s / T))``, ``batchmean``):

.. math::
  \mathcal{L}_{KT}(s, t) = T^2 \sum_{j=1}^{d} \sigma(t/T)_j
      \big(\log\sigma(t/T)_j - \log\sigma(s/T)_j\big)

with ``s`` the student's and ``t`` the teacher's embedding of one proxy sample. RCSR's
Sec. 5.1: "embedding knowledge transfer via KL divergence, temperature 3.0". The
authors add ``1e-7`` to the teacher's probabilities; we do not (the softmax is never 0
on bounded embeddings).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

__all__ = ["TEMPERATURE", "embedding_distillation"]

TEMPERATURE = 3.0


def embedding_distillation(
  student: Array,
  teacher: Array,
  *,
  temperature: float = TEMPERATURE,
  where: Array | None = None,
) -> Array:
  r"""``T^2 KL(softmax(t / T) || softmax(s / T))`` per row; the mean over rows is L_KT.

  Examples:
    >>> import jax.numpy as jnp
    >>> z = jnp.asarray([[1.0, 0.0, 0.0]])
    >>> float(embedding_distillation(z, z)[0])  # the student already agrees
    0.0

  Args:
    student: ``[P, d]`` the student's embeddings of the proxy samples.
    teacher: ``[P, d]`` the teacher's (here: the server's average of the clients').
    temperature: ``T`` (3.0 in FedMEKT and RCSR's Sec. 5.1).
    where: optional ``bool [P]`` valid rows.

  Returns:
    ``[P]`` values (0 for padding).
  """
  log_q = jax.nn.log_softmax(student / temperature, axis=-1)
  log_p = jax.nn.log_softmax(teacher / temperature, axis=-1)
  values = temperature**2 * jnp.sum(jnp.exp(log_p) * (log_p - log_q), axis=-1)
  return values if where is None else jnp.where(where, values, 0.0)
