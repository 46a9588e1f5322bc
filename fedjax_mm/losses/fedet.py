r"""FedET's diversity regulariser on representations (CreamFL's Table 1 FedET row).

FedET (Cho et al., IJCAI 2022, arXiv 2204.12703) distils the server from the
clients' weighted consensus and adds ``lambda`` times the KL divergence from
the ensemble of the clients OUTSIDE the consensus to the server's output, so
that the ensemble's diversity still reaches the server. On representations
(:mod:`fedjax_mm.server.kd_aggregate`, where the sources and every adaptation
are written out) an output is a softmax over the public set's global
representations ``g`` of the other modality: the server's ``softmax_j(z_k . g_j
/ tau)`` against the diversity ensemble's ``softmax_j(e_k . g_j / tau)``, ``e_k``
the variance-weighted mean representation of the non-majority clients.

.. math::
  \ell_k = \mathrm{KL}\big(\operatorname{softmax}_j(e_k \cdot g_j / \tau)
                     \,\big\|\, \operatorname{softmax}_j(z_k \cdot g_j / \tau)\big)
"""

from __future__ import annotations

import jax

from fedjax_mm.losses.feddf import ensemble_distillation

Array = jax.Array


def fedet_diversity(
  server: Array,
  ensemble: Array,
  global_other: Array,
  *,
  temperature: float | Array = 1.0,
  where: Array | None = None,
) -> Array:
  r"""KL from the diversity ensemble's retrieval softmax to the server's, per sample.

  Examples:
    >>> import jax.numpy as jnp
    >>> from fedjax_mm import losses
    >>> g = jnp.eye(3)
    >>> float(losses.fedet_diversity(g[:1], g[:1], g)[0])  # the server already agrees
    0.0

  Args:
    server: ``[B, d]`` the server's representations ``z`` of the batch's samples
      (the model being distilled).
    ensemble: ``[B, d]`` the diversity ensemble ``e`` of the same samples
      (:func:`fedjax_mm.server.kd_aggregate.fedet_with_diversity`); a constant
      (its gradient is stopped).
    global_other: ``[P, d]`` the global representations ``g`` of the other
      modality, over which both softmaxes run.
    temperature: ``tau`` (FedET's weights use ``CreamConfig.gca_temperature``).
    where: optional ``bool [B]``: samples with a diversity ensemble (some
      present client outside the majority); others give 0.

  Returns:
    ``[B]`` divergences (non-negative; 0 where the softmaxes agree).
  """
  student = server @ global_other.T / temperature
  teacher = ensemble @ global_other.T / temperature
  return ensemble_distillation(student, teacher, where=where)
