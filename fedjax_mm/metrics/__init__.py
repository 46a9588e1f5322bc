"""Evaluation metrics of the five papers, as pure functions on arrays.

One function per metric, written for one client's evaluation set; padded sets
carry a boolean ``where`` mask, and ``jax.vmap`` evaluates ``K`` clients at
once. Scalars are fractions in ``[0, 1]`` except Recall@K, which the retrieval
literature reports as percentages.

==================================  =========================================
accuracy                            image / text classification (FedMuscle)
micro_f1                            multi-label classification (FedMuscle)
confusion_matrix, mean_iou,         semantic segmentation (FedMuscle)
mean_iou_from_confusion_matrix
dice                                binary segmentation (FedRGB)
image_text_recall                   i2t / t2i Recall@K (CreamFL, FedMuscle)
map_at_n, ndcg_at_n                 supervised cross-modal retrieval (FedSCMR)
retrieval.chance_recall,            chance levels: a random ranking's R@K (closed
retrieval.random_ranking            form) and mAP@N / NDCG@N (sampled)
delta                               multi-task summary over users (FedMuscle)
seeds.interval, paired_difference,  a mean over seeds with its 95% t interval;
verdict                             a paired comparison and whether it holds
==================================  =========================================

:mod:`fedjax_mm.metrics.seeds` is host-side numpy (and scipy's t quantile), for the
summaries over seeds, and is imported as a module.
"""

from fedjax_mm.metrics.classification import accuracy, micro_f1
from fedjax_mm.metrics.multitask import delta
from fedjax_mm.metrics.retrieval import image_text_recall, map_at_n, ndcg_at_n
from fedjax_mm.metrics.segmentation import (
  confusion_matrix,
  dice,
  mean_iou,
  mean_iou_from_confusion_matrix,
)

__all__ = [
  "accuracy",
  "confusion_matrix",
  "delta",
  "dice",
  "image_text_recall",
  "map_at_n",
  "mean_iou",
  "mean_iou_from_confusion_matrix",
  "micro_f1",
  "ndcg_at_n",
]
