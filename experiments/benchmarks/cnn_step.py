"""One client's local update of a zoo CNN against the zoo's alternatives, same run.

  python -m experiments.benchmarks.cnn_step [--models=cnn_s,cnn_m,resnet_t] [--repeats=15]

For each model, the jitted single-client update of the engine
(:func:`fedjax_mm.core.local_update`: ``--steps`` Adam steps of batch
``--batch`` on 32x32x3 images, 10-class head) is built three ways:

* ``zoo``:      the model as the zoo builds it (im2col convolution on 2-D
  rows, :class:`fedjax_mm.models.norm.GroupNorm`);
* ``nnx_norm``: every zoo GroupNorm run as ``nnx.GroupNorm`` (the same
  parameters; the statistics reduced over ``(H, W, C/G)`` at once);
* ``xla_conv``: every zoo convolution run by ``lax.conv_general_dilated``.

The three take turns, one update each, ``--repeats`` times after an untimed
call, so they share this machine's drifting speed; each alternative's time
ratio to ``zoo`` (above 1: the zoo is faster) is the median of the paired
(same-turn) ratios. It
also prints how far each alternative's gradient of the task loss on the first
minibatch, at the same initial parameters, is from the zoo's (the largest
difference over the largest entry: the three compute the same function, up
to float rounding), and the rate in GFLOP/s (XLA's count of one step, times
the steps).

The last column is the share of the zoo's step that its matrix products take
when each runs alone: the products of one step
(:func:`fedjax_mm.core.cost.matrix_products`: the forward products, and the
backward ones for the kernels' gradients and for the inputs of every layer but
the first), each timed as a jitted ``lax.dot_general`` on random operands of its
shape (``--product_calls`` calls in a row, the mean; the smallest are timed
with their dispatch), summed, and divided by the zoo's time per step in the
same turn (median over the turns). What is left, up to 1.0, is everything else
(the im2col copies, the normalisation, the activations, the optimiser) and any
slow-down of the products inside the step. It is not a floor: XLA:CPU runs
independent operations of the step at the same time, so on several cores the
step can overlap products that this column times one after another.
"""

from __future__ import annotations

import functools
import statistics
import time

import jax
import numpy as np
import optax
from absl import app, flags
from flax import nnx

from experiments import benchmarks
from fedjax_mm import core, data, models
from fedjax_mm.core import cost
from fedjax_mm.models.conv import Conv
from fedjax_mm.models.norm import GroupNorm

_MODELS = benchmarks.define_names(
  "models",
  ["cnn_s", "cnn_m", "resnet_t"],
  [name for name, (modality, _) in models.ENCODERS.items() if modality == "image"],
  "Zoo image encoders to time.",
)
_STEPS = flags.DEFINE_integer("steps", 10, "Local steps per update.", lower_bound=1)
_BATCH = flags.DEFINE_integer("batch", 8, "Minibatch size.", lower_bound=1)
_REPEATS = flags.DEFINE_integer(
  "repeats", 15, "Timed updates per contender (median).", lower_bound=1
)
_PRODUCT_CALLS = flags.DEFINE_integer(
  "product_calls",
  20,
  "Calls of each matrix product timed alone, per turn (the mean).",
  lower_bound=1,
)

TASK = core.Task("classification", "image", "label10", 10)
VARIANTS = ("zoo", "nnx_norm", "xla_conv")


def _factory(encoder, variant):
  def make(rngs):
    model = models.build({"encoder": encoder, "head": "linear", "num_outputs": 10}, rngs=rngs)
    for _, module in nnx.iter_modules(model):
      if variant == "nnx_norm" and type(module) is GroupNorm:
        # The zoo's GroupNorm only overrides __call__: as its base class the
        # same module (same attributes and parameters) runs nnx's own code.
        module.__class__ = nnx.GroupNorm
      if variant == "xla_conv" and isinstance(module, Conv):
        module.impl = "xla"
    return model

  return make


def _update(encoder, variant, client_data):
  """``(update, args, FLOPs of one update, gradient on the first minibatch)``."""
  group, state = core.init_group(
    _factory(encoder, variant),
    name=f"{encoder}/{variant}",
    tx=optax.adam(1e-3),
    task=TASK,
    key=jax.random.key(0),
    num_clients=1,
    batch_size=_BATCH.value,
  )
  objective = core.supervised_objective(group, state.shared)
  update = jax.jit(
    lambda p, o, r, a, m: core.local_update(
      objective, group.tx, p, o, r, a, m, num_epochs=1, batch_size=_BATCH.value
    )[0]
  )
  per = (state.params, state.opt_state, state.rng, client_data.arrays, client_data.sample_mask)
  args = jax.tree.map(lambda x: x[0], per)
  params, _, _, arrays, sample_mask = args
  first = {key: x[: _BATCH.value] for key, x in arrays.items()}
  grad = jax.jit(
    jax.grad(lambda p: objective(p, first, sample_mask[: _BATCH.value], jax.random.key(0))[0])
  )
  # XLA's cost analysis counts the body of the update's scan over steps once.
  return update, args, cost.flops(update, *args) * _STEPS.value, grad(params)


def _products_alone(update, args):
  """A callable returning the seconds of one step's matrix products, each timed alone."""
  counts, operands = {}, {}
  key = jax.random.key(0)
  for product in cost.matrix_products(update, *args):
    lhs, rhs = product["lhs"], product["rhs"]
    signature = (lhs.shape, str(lhs.dtype), rhs.shape, str(rhs.dtype), product["dimension_numbers"])
    counts[signature] = counts.get(signature, 0) + 1
    if signature not in operands:
      key, left, right = jax.random.split(key, 3)
      dot = jax.jit(
        functools.partial(
          jax.lax.dot_general,
          dimension_numbers=product["dimension_numbers"],
          precision=product["precision"],
          preferred_element_type=product["preferred_element_type"],
        )
      )
      operands[signature] = (
        dot,
        jax.random.normal(left, lhs.shape, lhs.dtype),
        jax.random.normal(right, rhs.shape, rhs.dtype),
      )

  def seconds():
    total = 0.0
    for signature, (dot, lhs, rhs) in operands.items():
      jax.block_until_ready(dot(lhs, rhs))  # compiled, operands in cache
      start = time.perf_counter()
      for _ in range(_PRODUCT_CALLS.value):
        out = dot(lhs, rhs)
      jax.block_until_ready(out)
      total += counts[signature] * (time.perf_counter() - start) / _PRODUCT_CALLS.value
    return total

  return seconds


def _relative_difference(tree, reference):
  """``max |tree - reference| / max |reference|`` over all leaves."""
  pairs = zip(jax.tree.leaves(tree), jax.tree.leaves(reference), strict=True)
  diffs, scales = zip(*((np.max(np.abs(a - b)), np.max(np.abs(b))) for a, b in pairs), strict=True)
  return float(max(diffs) / max(scales))


def main(argv):
  del argv
  steps, batch = _STEPS.value, _BATCH.value
  world = data.generate(0, steps * batch)
  stacked, mask = data.stack_clients(data.split_clients(world, [np.arange(steps * batch)]))
  client_data = core.make_client_data(stacked, mask, user_ids=np.arange(1))
  print(
    f"one client's update: {steps} Adam steps of batch {batch}, 32x32x3 images, "
    f"device={jax.devices()[0].device_kind}; client-steps/s of the median update "
    "(GFLOP/s), and each alternative's time over the zoo's (median of the paired ratios)"
  )
  header = (
    f"{'model':>9} | "
    + " | ".join(f"{v:>26}" for v in VARIANTS)
    + " | gradient vs zoo's: nnx_norm, xla_conv"
    + " | products alone / zoo step"
  )
  print(header)
  print("-" * len(header))
  for encoder in _MODELS.value:
    built = {v: _update(encoder, v, client_data) for v in VARIANTS}
    diffs = [_relative_difference(built[v][3], built["zoo"][3]) for v in VARIANTS[1:]]
    products = _products_alone(*built["zoo"][:2])
    times = {v: [] for v in VARIANTS}
    alone = []
    for _ in range(_REPEATS.value):
      for v, (fn, args, _, _) in built.items():
        jax.block_until_ready(fn(*args))  # its own data back in cache
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times[v].append(time.perf_counter() - start)
      alone.append(products())
    zoo = np.asarray(times["zoo"])
    cells = []
    for v in VARIANTS:
      seconds = statistics.median(times[v])
      rate = f"{steps / seconds:.1f} ({built[v][2] / seconds / 1e9:.1f})"
      if v != "zoo":
        rate += f" {float(np.median(np.asarray(times[v]) / zoo)):.2f}x"
      cells.append(f"{rate:>26}")
    step = statistics.median(times["zoo"]) / steps
    share = (
      f"{float(np.median(np.asarray(alone) * steps / zoo)):.2f} "
      f"({statistics.median(alone) * 1e3:.2f} of {step * 1e3:.2f} ms)"
    )
    print(
      f"{encoder:>9} | "
      + " | ".join(cells)
      + " | "
      + ", ".join(f"{d:.1e}" for d in diffs)
      + " | "
      + share
    )


if __name__ == "__main__":
  app.run(main)
