"""Mixed precision in the engine: ``GroupDef.compute_dtype`` and ``core.cast_floating``."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from engine_toys import TASK, TinyMLP, client_arrays
from flax import nnx

from fedjax_mm import core


def _group(compute_dtype, num_clients=3):
  return core.init_group(
    TinyMLP,
    name="tiny",
    tx=optax.adam(1e-2),
    task=TASK,
    key=jax.random.key(0),
    num_clients=num_clients,
    batch_size=4,
    local_epochs=2,
    compute_dtype=compute_dtype,
  )


def _first_client(tree):
  return jax.tree.map(lambda x: x[0], tree)


def test_cast_floating_casts_floats_only_and_its_gradient_comes_back_float32():
  tree = {"w": jnp.ones((2, 3)), "i": jnp.arange(3), "k": jax.random.key(0)}
  cast = core.cast_floating(tree, jnp.bfloat16)
  assert cast["w"].dtype == jnp.bfloat16
  assert cast["i"].dtype == jnp.int32
  assert cast["k"] is tree["k"]
  grad = jax.grad(lambda w: jnp.sum(core.cast_floating(w, jnp.bfloat16) ** 2))(tree["w"])
  assert grad.dtype == jnp.float32
  np.testing.assert_array_equal(grad, 2 * np.ones((2, 3)))


def test_bfloat16_objective_returns_float32_loss_and_grads_near_float32s():
  group32, state = _group(None)
  group16, state16 = _group("bfloat16")
  # Same key, same float32 parameters: only the compute differs.
  jax.tree.map(np.testing.assert_array_equal, state.params, state16.params)
  arrays, mask = client_arrays(0, [8, 8, 8])
  batch = {k: jnp.asarray(v[0]) for k, v in arrays.items()}
  params = _first_client(state.params)
  key = jax.random.key(1)

  def loss_and_grads(group):
    objective = core.supervised_objective(group, state.shared)
    return jax.value_and_grad(lambda p: objective(p, batch, mask[0], key)[0])(params)

  loss32, grads32 = loss_and_grads(group32)
  loss16, grads16 = loss_and_grads(group16)
  assert loss16.dtype == jnp.float32
  assert all(g.dtype == jnp.float32 for g in jax.tree.leaves(grads16))
  np.testing.assert_allclose(loss16, loss32, rtol=2e-2)
  for g16, g32 in zip(jax.tree.leaves(grads16), jax.tree.leaves(grads32), strict=True):
    np.testing.assert_allclose(g16, g32, atol=3e-2 * float(jnp.max(jnp.abs(g32))))
  # bfloat16 really ran: the loss is not float32's to the bit.
  assert float(loss16) != float(loss32)


def test_bfloat16_group_trains_with_float32_state_and_tracks_float32():
  arrays, mask = client_arrays(0, [12, 8, 10])
  data = core.make_client_data(arrays, mask, user_ids=np.arange(3))
  losses = {}
  for dtype in (None, "bfloat16"):
    group, state = _group(dtype)
    # Jitted once per group: a new lambda each round traced and compiled the same round again.
    train = jax.jit(lambda s, d, g=group: core.train_group(g, s, d))
    for _ in range(4):
      state, stats = train(state, data)
    assert all(x.dtype == jnp.float32 for x in jax.tree.leaves(nnx.to_pure_dict(state.params)))
    losses[dtype] = np.asarray(stats["loss"])
  assert np.all(np.isfinite(losses["bfloat16"]))
  np.testing.assert_allclose(losses["bfloat16"], losses[None], rtol=5e-2)


def test_bad_compute_dtype_is_refused():
  with pytest.raises(ValueError, match="compute_dtype"):
    _group("int8")
