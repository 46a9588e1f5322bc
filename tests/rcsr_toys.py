"""The tiny RCSR federation the RCSR engine tests share: 4 clients of 6 world scenes
(paired, image-only, text-only, and paired with 4 real samples), 16 x 16 images and
12-token captions, 8-dim embeddings, 3 clients a round."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fedjax_mm.algorithms import rcsr as alg
from fedjax_mm.data import world

N, PER_ROUND, SAMPLES, BATCH = 4, 3, 6, 4
MODALITY = np.array([[1, 1], [1, 0], [0, 1], [1, 1]], bool)


def tiny(image_encoder, text_encoder, *, labels: bool = False, **spec):
  """``(spec, global params, personal, frozen, arrays, mask, modality)``.

  ``image_encoder`` / ``text_encoder``: ``rngs -> module`` (16 x 16 images, captions of 12
  tokens over the world's vocabulary); ``labels``: add MFCPL's classes (``i % 3``);
  ``spec``: further :class:`~fedjax_mm.algorithms.rcsr.RcsrDef` fields.
  """
  cfg = world.WorldConfig(image_size=16, captions_per_image=2, max_caption_len=12)
  d = world.generate(0, N * SAMPLES, config=cfg)
  img = d["image"].reshape(N, SAMPLES, 16, 16, 3) * MODALITY[:, 0, None, None, None, None]
  cap = d["caption"].reshape(N, SAMPLES, 2, 12) * MODALITY[:, 1, None, None, None]
  arrays = {"image": jnp.asarray(img), "caption": jnp.asarray(cap)}
  if labels:
    arrays["label"] = jnp.asarray(np.arange(N * SAMPLES).reshape(N, SAMPLES) % 3)
  mask = np.ones((N, SAMPLES), bool)
  mask[3, 4:] = False
  rngs = nnx.Rngs(0)
  graphdef, glob, personal, frozen = alg.build_model(
    image_encoder(rngs),
    text_encoder(rngs),
    adapter_dim=8,
    head_hidden=16,
    dim=8,
    personal_hidden=8,
    key=jax.random.key(1),
  )
  rcsr = alg.RcsrDef(
    graphdef=graphdef,
    num_clients=N,
    per_round=PER_ROUND,
    rounds=4,
    dim=8,
    batch_size=BATCH,
    lr=1e-2,
    router_width=16,
    router_layers=1,
    warmup_rounds=1,
    client_map="vmap",
    **spec,
  )
  return rcsr, glob, personal, frozen, arrays, jnp.asarray(mask), jnp.asarray(MODALITY)
