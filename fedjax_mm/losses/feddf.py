r"""FedDF's ensemble distillation loss, for every task kind of the engine.

Paper: Lin, Kong, Stich and Jaggi, "Ensemble Distillation for Robust Model
Fusion in Federated Learning", NeurIPS 2020 (arXiv 2006.07242), Algorithm 1,
line 9: the fused model ``x`` of each architecture is trained on unlabelled
server data ``d`` to match the ensemble of the clients' models,

.. math::
  x \leftarrow x - \eta \nabla_x
    \mathrm{KL}\Big(\sigma\big(\tfrac{1}{|S|}\textstyle\sum_{k \in S} f(\hat x_k, d)\big)
                    \,\Big\|\, \sigma\big(f(x, d)\big)\Big),

the KL divergence between the softmax of the clients' *averaged logits* and
the student's softmax. FedDF's classifiers all share one label space; here the
caller averages the logits of users of the same task only
(:mod:`fedjax_mm.algorithms.feddf`), and the divergence follows the task's own
output distribution:

==================  ==================================================
kind                per-example divergence
==================  ==================================================
``classification``  ``KL(softmax(t / T) || softmax(s / T))`` over classes
``multilabel``      mean over labels of the Bernoulli KL of ``sigmoid(t / T)``
                    and ``sigmoid(s / T)`` (each label its own binary outcome)
``segmentation``    the classification KL per pixel, averaged over pixels
==================  ==================================================

The paper distils at ``T = 1`` (no temperature); ``temperature`` is kept as a
keyword for ablations and scales nothing else (no ``T^2`` factor).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

KINDS = ("classification", "multilabel", "segmentation")


def ensemble_distillation(
  student_logits: Array,
  teacher_logits: Array,
  *,
  kind: str = "classification",
  temperature: float = 1.0,
  where: Array | None = None,
) -> Array:
  r"""KL divergence from the ensemble's prediction to the student's, per example.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> t = jnp.array([[2.0, 0.0, -1.0]])
    >>> float(losses.ensemble_distillation(t, t)[0])  # the student already agrees
    0.0

  Args:
    student_logits: ``[b, C]`` (``[b, H, W, C]`` for segmentation) logits of
      the model being distilled.
    teacher_logits: the same shape: the ensemble's logits, i.e. the mean of
      the teachers' logits (the caller averages).
    kind: ``"classification"``, ``"multilabel"`` or ``"segmentation"``.
    temperature: ``T`` dividing both logits.
    where: optional ``bool [b]``: examples that count (others give 0).

  Returns:
    ``[b]`` per-example divergences (non-negative; 0 where they agree).
  """
  if kind not in KINDS:
    raise ValueError(f"kind must be one of {KINDS}, got {kind!r}.")
  s = student_logits / temperature
  t = jax.lax.stop_gradient(teacher_logits) / temperature
  if kind == "multilabel":
    # Bernoulli KL per label: p log p/q + (1-p) log (1-p)/(1-q), with log-sigmoids.
    p = jax.nn.sigmoid(t)
    kl = p * (jax.nn.log_sigmoid(t) - jax.nn.log_sigmoid(s)) + (1 - p) * (
      jax.nn.log_sigmoid(-t) - jax.nn.log_sigmoid(-s)
    )
    loss = kl.mean(-1)
  else:
    log_p = jax.nn.log_softmax(t, axis=-1)
    kl = jnp.sum(jnp.exp(log_p) * (log_p - jax.nn.log_softmax(s, axis=-1)), axis=-1)
    loss = kl.reshape(kl.shape[0], -1).mean(-1)  # pixels averaged for segmentation
  if where is not None:
    loss = jnp.where(where, loss, 0.0)
  return loss
