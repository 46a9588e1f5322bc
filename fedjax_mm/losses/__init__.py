"""Pure losses on representation matrices (``jax``; NumPy only to check static arguments).

Every loss works under ``jax.jit``, ``jax.vmap`` and ``jax.grad``. The
contrastive losses (InfoNCE, pairwise, Muscle, Gramian, CreamFL's) take
L2-normalised representations and return one value per anchor (the caller
reduces)::

  from fedjax_mm import losses
  per_anchor = losses.muscle_loss(z_n, z_others, tau=0.2, gamma=losses.muscle_gamma(0.2, 0.15))
  loss = per_anchor.mean()

The supervised cross-modal retrieval terms of DSCMR / FedSCMR (`dscmr`) are
batch-level (means over pairs, hinges of batch means) and return scalars.
"""

from fedjax_mm.losses.contrastive import info_nce, pairwise_info_nce, symmetric_info_nce
from fedjax_mm.losses.creamfl import (
  inter_modal_contrast,
  intra_modal_contrast,
  representation_distance,
)
from fedjax_mm.losses.dscmr import (
  consistency_loss,
  cross_subspace_loss,
  discrimination_loss,
  dscmr_loss,
  fedscmr_loss,
  fedscmr_terms,
  label_space_loss,
  mean_distance,
)
from fedjax_mm.losses.feddf import ensemble_distillation
from fedjax_mm.losses.fedet import fedet_diversity
from fedjax_mm.losses.fedhenn import center_kernel, cka, cka_distance, linear_kernel
from fedjax_mm.losses.fedmae import masked_reconstruction_loss, patchify, unpatchify
from fedjax_mm.losses.fedrcl import (
  divergence_penalty,
  label_positives,
  relaxed_contrastive_loss,
  set_positives,
  supervised_contrastive,
)
from fedjax_mm.losses.fedrgb import (
  dro_loss,
  guide_contrastive_loss,
  guide_loss,
  local_loss,
  task_loss,
)
from fedjax_mm.losses.fedx import fedx_terms, relational_loss
from fedjax_mm.losses.gramian import gram_volumes, gramian_loss
from fedjax_mm.losses.muscle import (
  DEFAULT_CHUNK_ELEMENTS,
  MuscleTargets,
  default_chunk_size,
  muscle_client_loss,
  muscle_gamma,
  muscle_logit_range,
  muscle_loss,
  muscle_loss_from_paper_targets,
  muscle_paper_targets,
  muscle_server_targets,
)
from fedjax_mm.losses.sage import sage_targets, sage_unlabeled_loss
from fedjax_mm.losses.simclr import nt_xent

__all__ = [
  "DEFAULT_CHUNK_ELEMENTS",
  "MuscleTargets",
  "center_kernel",
  "cka",
  "cka_distance",
  "consistency_loss",
  "cross_subspace_loss",
  "default_chunk_size",
  "discrimination_loss",
  "divergence_penalty",
  "dro_loss",
  "dscmr_loss",
  "ensemble_distillation",
  "fedet_diversity",
  "fedx_terms",
  "fedscmr_loss",
  "fedscmr_terms",
  "gram_volumes",
  "gramian_loss",
  "guide_contrastive_loss",
  "guide_loss",
  "info_nce",
  "inter_modal_contrast",
  "intra_modal_contrast",
  "label_positives",
  "label_space_loss",
  "linear_kernel",
  "local_loss",
  "masked_reconstruction_loss",
  "mean_distance",
  "muscle_client_loss",
  "muscle_gamma",
  "muscle_logit_range",
  "muscle_loss",
  "muscle_loss_from_paper_targets",
  "muscle_paper_targets",
  "muscle_server_targets",
  "nt_xent",
  "pairwise_info_nce",
  "patchify",
  "relational_loss",
  "relaxed_contrastive_loss",
  "representation_distance",
  "sage_targets",
  "sage_unlabeled_loss",
  "set_positives",
  "supervised_contrastive",
  "symmetric_info_nce",
  "task_loss",
  "unpatchify",
]
