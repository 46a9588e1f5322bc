"""CLIP-style image-text pretraining: the library's own "foundation models".

Every paper this library implements starts from pretrained encoders (ImageNet
ViTs and BERT for FedMuscle, CLIP ViT-B/32 for RCSR, pretrained towers for
CreamFL and FedRGB, VGG-19 features for FedSCMR). On the embedded world the
same role is played by encoders pretrained here, contrastively, on a large
"web" split of the world (Radford et al., *Learning Transferable Visual Models
From Natural Language Supervision*, ICML 2021):

    z_i = normalize(W_v f_v(image_i))      [B, d]
    t_i = normalize(W_t f_t(caption_i))    [B, d]
    logits = exp(s) z t^T                   [B, B]   s: learnt log inverse temperature
    L = 1/2 (CE(logits, I) + CE(logits^T, I))          (CLIP's symmetric loss)

``s`` starts at ``log(1 / 0.07)`` and is clipped to ``log(100)`` as in CLIP.
The loss itself is :func:`fedjax_mm.losses.symmetric_info_nce` with
``temperature = exp(-s)``. One caption of each image's ``C`` is drawn per step
(a fresh draw every epoch), which is CLIP's use of several captions per image.

**Distillation** (optional, ``distill_dim > 0``): a linear head ``h`` on the image
tower's pooled feature regresses a frozen teacher's standardised pooled feature of the
same image, ``L += w * mean_i (1 - cos(h(f_v(image_i)), teacher_i))`` (feature
distillation, Romero et al., *FitNets*, ICLR 2015, with a cosine target as in CLIP
distillation work). The zoo uses it to pass one encoder's knowledge of shape to
architectures that CLIP's caption signal alone does not teach it
(:mod:`fedjax_mm.zoo.pretrain`). The head is never saved with the encoder.

The module holds pure functions over an ``nnx`` model split once
(``graphdef, params``); the experiment loop lives in
:mod:`fedjax_mm.zoo.pretrain`.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from fedjax_mm import losses, models
from fedjax_mm.models.user_model import l2_normalize

__all__ = [
  "ClipModel",
  "ClipTrainer",
  "INIT_TEMPERATURE",
  "MAX_LOGIT_SCALE",
  "clip_loss",
  "distill_loss",
]

#: CLIP's initial temperature and the cap on the learnt logit scale.
INIT_TEMPERATURE = 0.07
MAX_LOGIT_SCALE = math.log(100.0)


class ClipModel(nnx.Module):
  """An image tower and a text tower with linear projections to a joint space.

  Args:
    image_encoder: a name in :data:`fedjax_mm.models.ENCODERS` (image).
    text_encoder: a name in :data:`fedjax_mm.models.ENCODERS` (text).
    embed_dim: joint embedding width ``d``.
    image_size: side of the square images.
    vocab_size: token ids of the text encoder.
    max_len: caption length.
    rngs: random streams.
    distill_dim: width of a distillation target; > 0 adds :attr:`distill_head`
      (image pooled feature -> target), 0 none.
  """

  def __init__(
    self,
    image_encoder: str,
    text_encoder: str,
    *,
    embed_dim: int,
    image_size: int,
    vocab_size: int,
    max_len: int,
    rngs: nnx.Rngs,
    distill_dim: int = 0,
  ):
    for name, modality in ((image_encoder, "image"), (text_encoder, "text")):
      if name not in models.ENCODERS or models.ENCODERS[name][0] != modality:
        raise ValueError(f"{name!r} is not an {modality} encoder of models.ENCODERS.")
    self.image_encoder = models.build_encoder(image_encoder, rngs=rngs, image_size=image_size)
    self.text_encoder = models.build_encoder(
      text_encoder, rngs=rngs, vocab_size=vocab_size, max_len=max_len
    )
    self.image_projection = nnx.Linear(
      self.image_encoder.features, embed_dim, use_bias=False, rngs=rngs
    )
    self.text_projection = nnx.Linear(
      self.text_encoder.features, embed_dim, use_bias=False, rngs=rngs
    )
    self.logit_scale = nnx.Param(jnp.asarray(math.log(1.0 / INIT_TEMPERATURE), jnp.float32))
    self.distill_head = (
      nnx.Linear(self.image_encoder.features, distill_dim, rngs=rngs) if distill_dim else None
    )

  def embed_image(self, images: jax.Array) -> jax.Array:
    """``[b, S, S, 3] -> [b, d]`` unit-norm image embeddings."""
    pooled, _ = self.image_encoder(images)
    return l2_normalize(self.image_projection(pooled))

  def embed_text(self, tokens: jax.Array) -> jax.Array:
    """``[b, L] -> [b, d]`` unit-norm caption embeddings."""
    pooled, _ = self.text_encoder(tokens)
    return l2_normalize(self.text_projection(pooled))


def clip_loss(z_image: jax.Array, z_text: jax.Array, logit_scale: jax.Array) -> jax.Array:
  """CLIP's symmetric cross-entropy, per pair.

  Args:
    z_image: ``[B, d]`` unit-norm image embeddings.
    z_text: ``[B, d]`` unit-norm caption embeddings, row ``i`` paired with image ``i``.
    logit_scale: scalar ``s``; the temperature is ``exp(-min(s, log 100))``.

  Returns:
    ``[B]`` losses, ``(CE_i2t + CE_t2i) / 2`` per pair.
  """
  temperature = jnp.exp(-jnp.minimum(logit_scale, MAX_LOGIT_SCALE))
  return losses.symmetric_info_nce(z_image, z_text, temperature=temperature)


def distill_loss(prediction: jax.Array, target: jax.Array) -> jax.Array:
  """``[B]`` cosine distances ``1 - cos(prediction_i, target_i)`` (0 when aligned, 2 opposed)."""
  return 1.0 - jnp.sum(l2_normalize(prediction) * l2_normalize(target), axis=-1)


@dataclasses.dataclass(frozen=True)
class ClipTrainer:
  """A jittable training step for one :class:`ClipModel`.

  Attributes:
    graphdef: the model's graph definition (``nnx.split`` once).
    tx: the optimizer (AdamW with a warm-up cosine schedule in the runner).
    distill_weight: ``w`` of the distillation term (used when :meth:`step` gets
      ``targets``; the model needs a :attr:`ClipModel.distill_head`).
  """

  graphdef: nnx.GraphDef
  tx: optax.GradientTransformation
  distill_weight: float = 0.0

  def step(self, params, opt_state, images: jax.Array, captions: jax.Array, targets=None):
    """One step on a batch of ``B`` pairs; returns ``(params, opt_state, loss)``.

    ``targets``: ``[B, D]`` the teacher's features of ``images``, or None (CLIP alone).
    """

    def loss_fn(p):
      model = nnx.merge(self.graphdef, p)
      pooled, _ = model.image_encoder(images)
      z_i = l2_normalize(model.image_projection(pooled))
      loss = clip_loss(z_i, model.embed_text(captions), model.logit_scale[...]).mean()
      if targets is not None:
        loss += self.distill_weight * distill_loss(model.distill_head(pooled), targets).mean()
      return loss

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = self.tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  def embed(self, params, x: jax.Array, modality: str) -> jax.Array:
    """Embeddings of one batch of images or captions."""
    model = nnx.merge(self.graphdef, params)
    return model.embed_image(x) if modality == "image" else model.embed_text(x)
