"""A tiny FedRGB model and data set shared by the FedRGB tests: 3 clients of
cnn_s + gru towers on 16 x 16 random images and 6-token captions."""

import jax
import jax.numpy as jnp
import numpy as np

from fedjax_mm.algorithms import fedrgb as rgb


def tiny(method="fedrgb", client_map="vmap", num_test=0, **kw):
  """``(alg, state, arrays, mask, test)``: 8 training pairs per client of which
  8, 6 and 5 are real, and ``num_test`` test pairs per client (``test`` is None
  for 0)."""
  cfg = rgb.RgbConfig(
    method=method,
    stage1_steps=2,
    stage2_steps=2,
    batch_size=4,
    learning_rate=1e-2,
    client_map=client_map,
    **kw,
  )
  alg, state = rgb.build(
    cfg,
    image_encoder="cnn_s",
    text_encoder="gru",
    image_size=16,
    vocab_size=20,
    max_len=6,
    dim=8,
    pretrained=False,
    key=jax.random.key(0),
    num_clients=3,
  )
  rng = np.random.default_rng(0)

  def pairs(n):
    return {
      "images": jnp.asarray(rng.normal(size=(3, n, 16, 16, 3)), jnp.float32),
      "captions": jnp.asarray(rng.integers(1, 20, size=(3, n, 6)), jnp.int32),
    }

  arrays = pairs(8)
  test = pairs(num_test) if num_test else None
  mask = jnp.asarray(np.arange(8)[None] < np.array([[8], [6], [5]]))
  return alg, state, arrays, mask, test
