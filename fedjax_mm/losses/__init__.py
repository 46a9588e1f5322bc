"""Pure contrastive losses on representation matrices (import only ``jax``).

Every loss takes L2-normalised representations, returns one value per anchor
(the caller reduces) and works under ``jax.jit``, ``jax.vmap`` and
``jax.grad``::

  from fedjax_mm import losses
  per_anchor = losses.muscle_loss(z_n, z_others, tau=0.2, gamma=losses.muscle_gamma(0.2, 0.15))
  loss = per_anchor.mean()
"""

from fedjax_mm.losses.contrastive import info_nce, pairwise_info_nce, symmetric_info_nce
from fedjax_mm.losses.gramian import gram_volumes, gramian_loss
from fedjax_mm.losses.muscle import (
  DEFAULT_CHUNK_ELEMENTS,
  MuscleTargets,
  default_chunk_size,
  muscle_client_loss,
  muscle_gamma,
  muscle_loss,
  muscle_loss_from_paper_targets,
  muscle_paper_targets,
  muscle_server_targets,
)

__all__ = [
  "DEFAULT_CHUNK_ELEMENTS",
  "MuscleTargets",
  "default_chunk_size",
  "gram_volumes",
  "gramian_loss",
  "info_nce",
  "muscle_client_loss",
  "muscle_gamma",
  "muscle_loss",
  "muscle_loss_from_paper_targets",
  "muscle_paper_targets",
  "muscle_server_targets",
  "pairwise_info_nce",
  "symmetric_info_nce",
]
