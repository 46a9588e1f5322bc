"""How much FedX's and FedMAE's own terms move a FedRGB client's step, beside L_task's.

  python -m experiments.benchmarks.fedrgb_ssl_terms [--config=experiments/fedrgb.py]

For each client of the config's run (its data, its shipped encoders, the initial global
model every row starts from) and one batch of FedAvg's size (plus FedX's batch of
anchors), prints each term of the two baselines' client losses
(:meth:`fedjax_mm.algorithms.fedrgb.FedRGB.fedx_terms`,
:meth:`~fedjax_mm.algorithms.fedrgb.FedRGB.mae_terms`): its value, the norm of its gradient
on the aligners over that of ``L_task`` (FedAvg's whole client loss, measured in the same
run), and the cosine between the sum of the method's other terms' gradients and
``L_task``'s, means over the clients. A ratio near 0 is a term that barely acts on what is
evaluated; a cosine near 1 one that pushes where ``L_task`` already does. FedMAE's rows are
given for both ``mae_contrast`` settings ("clean": the default; "masked": ``L_task`` on the
masked images).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
from absl import app, flags
from ml_collections import config_flags

from fedjax_mm.runner import fedrgb as runner

_CONFIG = config_flags.DEFINE_config_file("config", "experiments/fedrgb.py", "FedRGB config.")
_SEED = flags.DEFINE_integer("batch_seed", 0, "Seed of the batches drawn from each client.")


def _cosine(a, b):
  dot = sum(jnp.vdot(x, y) for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b), strict=True))
  return dot / (optax.global_norm(a) * optax.global_norm(b))


def _rows(state, arrays, batch_size, rng, names, terms_of):
  """Per term: mean value, mean gradient-norm ratio to ``names[0]``; and the mean cosine.

  ``terms_of(params, batch, key)`` -> ``{name: scalar}``; one compile per method."""
  params = {"encoder": {}, "aligner": state.aligner}
  if state.decoder is not None:
    params["decoder"] = state.decoder

  @jax.jit
  def measure(batch, key):
    value = terms_of(params, batch, key)
    grads = {
      n: jax.grad(lambda p, n=n: terms_of(p, batch, key)[n])(params)["aligner"] for n in names
    }
    norms = {n: optax.global_norm(g) for n, g in grads.items()}
    others = jax.tree.map(lambda *g: sum(g), *(grads[n] for n in names[1:]))
    return value, norms, _cosine(others, grads[names[0]])

  out = []
  for c in range(arrays["images"].shape[0]):
    idx = rng.choice(arrays["images"].shape[1], 2 * batch_size, replace=False)
    value, norms, cosine = measure({k: v[c][idx] for k, v in arrays.items()}, jax.random.key(c))
    base = float(norms[names[0]])
    out.append(
      ([float(value[n]) for n in names], [float(norms[n]) / base for n in names], float(cosine))
    )
  values, ratios, cosines = zip(*out, strict=True)
  return np.mean(values, 0), np.mean(ratios, 0), float(np.mean(cosines))


def main(argv):
  del argv
  config = _CONFIG.value
  config.methods = ("fedx", "fedmae", "fedmae_masked")
  config.distortion.enabled = config.downstream.enabled = config.segmentation.enabled = False
  built = runner.build(config)
  arrays = built["train"]
  print(
    f"FedRGB's FedX and FedMAE clients at the initial global model: {arrays['images'].shape[0]} "
    f"clients, a batch of {config.batch_size} each (FedX: + {config.batch_size} anchors), "
    f"{config.image_encoder} + {config.text_encoder}; means over the clients.\n"
  )
  print(f"{'method':<14} {'term':<20} {'value':>9} {'|grad| / |grad L_task|':>24}")
  for row in ("fedx", "fedmae", "fedmae_masked"):
    alg, state = built["algorithms"][row], built["states"][row]
    rng = np.random.default_rng(_SEED.value)
    if row == "fedx":
      names = ("local_contrastive", "local_relational", "global_contrastive", "global_relational")

      def terms_of(p, batch, key, alg=alg, state=state):
        del key
        out = alg.fedx_terms(p, state.encoder, state.aligner, batch)
        return {n: v.mean() for n, v in out.items()}
    else:
      names = ("task", "reconstruction")

      def terms_of(p, batch, key, alg=alg, state=state):
        first = jax.tree.map(lambda x: x[: alg.config.batch_size], batch)
        task, rec = alg.mae_terms(p, state.encoder, first, key)
        return {"task": task, "reconstruction": rec}

    values, ratios, cosine = _rows(state, arrays, config.batch_size, rng, names, terms_of)
    for n, v, r in zip(names, values, ratios, strict=True):
      print(f"{row:<14} {n:<20} {v:>9.4f} {r:>24.4f}")
    print(f"{row:<14} {'cosine(others, L_task)':<30} {cosine:>+24.3f}")


if __name__ == "__main__":
  app.run(main)
