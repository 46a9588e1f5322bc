"""A tiny model and data set shared by the engine tests (and the 2-process worker)."""

import jax
import numpy as np
import optax
from flax import nnx

from fedjax_mm import core

TASK = core.Task(kind="classification", input_key="x", target_key="y", num_outputs=3)


class TinyMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.hidden = nnx.Linear(4, 8, rngs=rngs)
    self.out = nnx.Linear(8, 3, rngs=rngs)

  def __call__(self, x):
    return self.out(jax.nn.relu(self.hidden(x)))


def client_arrays(seed, sizes, n_max=None):
  """Stacked toy data: client k has sizes[k] real samples, padded to n_max."""
  rng = np.random.default_rng(seed)
  n_max = n_max or max(sizes)
  x = np.zeros((len(sizes), n_max, 4), np.float32)
  y = np.zeros((len(sizes), n_max), np.int32)
  mask = np.zeros((len(sizes), n_max), bool)
  for k, n in enumerate(sizes):
    x[k, :n] = rng.normal(size=(n, 4))
    y[k, :n] = rng.integers(0, 3, size=n)
    mask[k, :n] = True
  return {"x": x, "y": y}, mask


def make_group(num_clients, *, seed=0, same_init=False, batch_size=4, local_epochs=2, tx=None):
  return core.init_group(
    TinyMLP,
    name="tiny",
    tx=tx or optax.adam(1e-2),
    task=TASK,
    key=jax.random.key(seed),
    num_clients=num_clients,
    same_init=same_init,
    batch_size=batch_size,
    local_epochs=local_epochs,
  )
