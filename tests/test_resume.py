"""A run resumed from a checkpoint reproduces the uninterrupted run bit for bit."""

import chex
import jax
import numpy as np
from engine_toys import client_arrays, make_group

from fedjax_mm import algorithms, core
from fedjax_mm.core.checkpoint import Checkpointer


def _setup():
  sizes = (3, 7, 2, 9, 4, 6, 5, 8)
  group, state = make_group(len(sizes), same_init=True)
  arrays, mask = client_arrays(0, sizes)
  data = [core.make_client_data(arrays, mask, user_ids=np.arange(len(sizes)))]
  alg = algorithms.fedavg([group], clients_per_round=3, prox_mu=0.01)
  mesh = core.client_mesh()
  make_state = lambda: alg.init([state], jax.random.key(7))
  return alg, make_state, mesh, [d.place(mesh) for d in data]


def test_resume_equals_uninterrupted(tmp_path):
  alg, make_state, mesh, data = _setup()
  state = make_state().place(mesh)
  round_fn = core.jit_round(alg.round, state)
  for _ in range(4):
    state, _ = round_fn(state, data)
  uninterrupted = jax.device_get(state)

  # Run 2 rounds, checkpoint, "crash", restore into an abstract target, run 2 more.
  state = make_state().place(mesh)
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    for _ in range(2):
      state, _ = round_fn(state, data)
      ckpt.save(int(state.round), state)
    ckpt.wait()
  del state
  with Checkpointer(tmp_path / "ckpt") as ckpt:
    assert ckpt.latest_step() == 2
    target = jax.eval_shape(make_state).place(mesh)
    state = ckpt.restore(target)
  assert int(state.round) == 2
  for _ in range(2):
    state, _ = round_fn(state, data)
  chex.assert_trees_all_equal(jax.device_get(state), uninterrupted)
