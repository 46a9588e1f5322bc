r"""FedRGB's losses: image-text contrast, teacher guidance and the DRO teacher loss.

FedRGB paper (``fedrgb.txt``), Sections 4.1-4.2 and App. B. Each client holds
image-text pairs; its encoders give features ``(v, l)``, its local aligners
give representations ``(z_I, z_T)`` and the teacher aligners ``(z*_I, z*_T)``.
All representations are L2-normalised ``[n, d]`` matrices with row ``i`` of the
image and text matrices a positive pair.

* **L_task** (the code's ``L_ITA``; ConVIRT / CLIP): cross-entropy image->text
  plus text->image at a fixed temperature ``tau = 0.07``,
  :func:`task_loss`.
* **L_guide** (eq. (1)): ``||z*_I,i - z_I,i||^2 + ||z*_T,i - z_T,i||^2``,
  :func:`guide_loss`.
* **L_local** (eq. (2)): ``L_guide + alpha L_task``, :func:`local_loss`.
  ``guide="cl"`` is the paper's "->CL" ablation (Sec. 5.4: "we replace the L-2
  regularization with contrastive loss as a weaker regularization"): the guidance
  becomes :func:`guide_contrastive_loss`.
* **L_dro** (eq. (6), default): ``beta (||z~*_I - z*_I||^2 + ||z~*_T - z*_T||^2)
  + L_CL(z*_I, z~*_I) + L_task(z_I, z_T)`` where ``z*`` is the teacher on the
  distorted features (a learnable copy of the encoder), ``z~*`` the teacher on
  the undistorted features (the frozen stage-1 encoder) and ``z`` the frozen
  local aligner on the distorted features, :func:`dro_loss`.
  ``form="eq12"`` (App. B, eq. (12)): the same regulariser plus ``L_CL``
  between the teacher's image and text outputs on the undistorted features
  (the superscript ``fz``, read as "frozen"), and no ``L_task``.
  ``form="appb"`` (App. B as a whole, the default of :mod:`fedjax_mm.algorithms.fedrgb`):
  eq. (12) plus ``L_task`` of the frozen local aligner on the distorted features, which
  App. B's text feeds to ``L_task`` ("the distorted features are input to the frozen g
  to calculate the task loss") before giving eq. (12) as "the regularization term".
  ``L_task`` is the only term through which the encoder copy is distorted: at the start
  the copy equals ``f*``, where the regulariser is at its minimum (zero gradient), and
  eq. (12)'s ``L_CL`` does not read the copy.

Choices (the paper against the authors' code, BioMed-AI-Lab-U-Michgan/TMLR_FedDRA):

* **Reduction.** The paper's eqs. (1), (6) and (12) sum over the ``N_c``
  samples; the code averages over the batch. Every function here returns one
  value per pair (the caller reduces) and the algorithm takes the **mean** over
  the batch, as the code does. Then ``alpha`` weighs the mean contrastive loss
  against the mean squared distance per pair, independently of the batch size
  (under the paper's sum, ``alpha`` would have to grow with ``N_c`` to keep
  the same balance), and ``beta`` weighs the mean squared teacher drift per
  pair against the mean contrastive terms.
* **Temperature.** ``tau = 0.07`` fixed (not learnt) for ``L_task`` and
  ``L_CL`` alike.
* **L_task per pair** is ``CE_i2t(i) + CE_t2i(i)``: its batch mean is the sum
  of the two directional mean cross-entropies ("plus", as the issue reads the
  code), not their average.
* **L_CL** in eq. (6) is the symmetric (both directions) contrastive loss
  between ``z*_I`` and ``z~*_I`` at ``tau``, in the same form as L_task.

Everything imports only ``jax``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

Array = jax.Array

TAU = 0.07
DRO_FORMS = ("appb", "eq6", "eq12")


def _check_pair(a: Array, b: Array, name: str) -> None:
  if a.ndim != 2 or a.shape != b.shape:
    raise ValueError(
      f"{name}: expected two [n, d] matrices of one shape, got {a.shape} and {b.shape}."
    )


def task_loss(z_img: Array, z_txt: Array, *, tau: float | Array = TAU) -> Array:
  r"""Image-text contrastive loss per pair (CLIP / ConVIRT; the code's ``L_ITA``).

  .. math::
    \ell_i = -\log \frac{e^{s_{ii}}}{\sum_j e^{s_{ij}}}
             -\log \frac{e^{s_{ii}}}{\sum_j e^{s_{ji}}},\quad s_{ij} = z^I_i \cdot z^T_j / \tau

  Args:
    z_img: ``[n, d]`` image representations (L2-normalised).
    z_txt: ``[n, d]`` text representations; row ``i`` pairs with ``z_img[i]``.
    tau: the fixed temperature (0.07).

  Returns:
    ``[n]``: image->text plus text->image cross-entropy of each pair.

  >>> z = jnp.eye(3)
  >>> bool(jnp.all(task_loss(z, z) < 1e-3))
  True
  """
  _check_pair(z_img, z_txt, "task_loss")
  s = z_img @ z_txt.T / tau
  diag = jnp.diagonal(s)
  i2t = jax.nn.logsumexp(s, axis=1) - diag
  t2i = jax.nn.logsumexp(s, axis=0) - diag
  return i2t + t2i


def squared_distance(a: Array, b: Array) -> Array:
  """``||a_i - b_i||^2`` per row: ``[n, d], [n, d] -> [n]``."""
  _check_pair(a, b, "squared_distance")
  return jnp.sum(jnp.square(a - b), axis=-1)


def guide_loss(z_img: Array, z_txt: Array, teacher_img: Array, teacher_txt: Array) -> Array:
  r"""Teacher guidance per pair (eq. (1)): ``||z*_I - z_I||^2 + ||z*_T - z_T||^2``.

  Args:
    z_img, z_txt: ``[n, d]`` local aligners' representations.
    teacher_img, teacher_txt: ``[n, d]`` the frozen teacher aligners' representations
      of the same features (the caller stops their gradient).

  Returns:
    ``[n]`` squared distances; eq. (1) sums them, the algorithm takes the mean.
  """
  return squared_distance(teacher_img, z_img) + squared_distance(teacher_txt, z_txt)


def guide_contrastive_loss(
  z_img: Array,
  z_txt: Array,
  teacher_img: Array,
  teacher_txt: Array,
  *,
  tau: float | Array = TAU,
) -> Array:
  r"""The "->CL" ablation's guidance per pair: contrast each local output with the teacher's.

  The paper gives no formula; here it is the symmetric contrastive loss of
  :func:`task_loss` between the local and the teacher representations of the same
  modality (positive: the same sample; negatives: the batch's other samples),
  summed over the two modalities:
  ``task_loss(z_I, z*_I) + task_loss(z_T, z*_T)``. Unlike eq. (1) it only asks
  each local output to be nearer its teacher output than the others are, a
  weaker pull (the paper's reading).

  Returns:
    ``[n]``.
  """
  return task_loss(z_img, teacher_img, tau=tau) + task_loss(z_txt, teacher_txt, tau=tau)


GUIDES = ("l2", "cl")


def local_loss(
  z_img: Array,
  z_txt: Array,
  teacher_img: Array,
  teacher_txt: Array,
  *,
  alpha: float | Array = 1.0,
  tau: float | Array = TAU,
  guide: str = "l2",
) -> Array:
  """Stage-1 loss per pair (eq. (2)): ``L_guide + alpha L_task``; ``[n]``.

  ``guide="l2"`` is eq. (1) (:func:`guide_loss`), ``"cl"`` the "->CL" ablation
  (:func:`guide_contrastive_loss`).
  """
  if guide == "l2":
    g = guide_loss(z_img, z_txt, teacher_img, teacher_txt)
  elif guide == "cl":
    g = guide_contrastive_loss(z_img, z_txt, teacher_img, teacher_txt, tau=tau)
  else:
    raise ValueError(f"guide must be one of {GUIDES}, got {guide!r}.")
  return g + alpha * task_loss(z_img, z_txt, tau=tau)


def dro_loss(
  teacher_img: Array,
  teacher_txt: Array,
  anchor_img: Array,
  anchor_txt: Array,
  local_img: Array | None = None,
  local_txt: Array | None = None,
  *,
  beta: float | Array = 2.0,
  tau: float | Array = TAU,
  form: str = "eq6",
) -> Array:
  r"""Stage-2 teacher loss per pair: eq. (6) (default), eq. (12), or App. B's (eq. (12) + L_task).

  Args:
    teacher_img, teacher_txt: ``[n, d]`` ``z*``: the teacher aligners on the
      distorted features (a learnable copy of the stage-1 encoder).
    anchor_img, anchor_txt: ``[n, d]`` ``z~*``: the teacher aligners on the
      undistorted features (the frozen stage-1 encoder).
    local_img, local_txt: ``[n, d]`` the frozen local aligners on the distorted
      features (needed by ``eq6`` and ``appb``, ignored by ``eq12``).
    beta: the regulariser's weight.
    tau: temperature of ``L_CL`` and ``L_task``.
    form: ``"eq6"``: ``beta reg + L_CL(z*_I, z~*_I) + L_task(z_I, z_T)``;
      ``"eq12"``: ``beta reg + L_CL(z~*_I, z~*_T)``; ``"appb"``: ``beta reg +
      L_CL(z~*_I, z~*_T) + L_task(z_I, z_T)``.

  Returns:
    ``[n]``; ``reg = ||z~*_I - z*_I||^2 + ||z~*_T - z*_T||^2`` per pair.
  """
  if form not in DRO_FORMS:
    raise ValueError(f"dro_loss: form must be one of {DRO_FORMS}, got {form!r}.")
  reg = squared_distance(anchor_img, teacher_img) + squared_distance(anchor_txt, teacher_txt)
  if form == "eq6":  # L_CL between the teacher's image outputs, distorted and not
    value = beta * reg + task_loss(teacher_img, anchor_img, tau=tau)
  else:  # eq. (12)'s L_CL between the teacher's image and text outputs, undistorted
    value = beta * reg + task_loss(anchor_img, anchor_txt, tau=tau)
    if form == "eq12":
      return value
  if local_img is None or local_txt is None:
    raise ValueError(f"dro_loss: form={form!r} needs local_img and local_txt.")
  return value + task_loss(local_img, local_txt, tau=tau)  # L_task, distorted features
