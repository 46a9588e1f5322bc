"""The zoo's GroupNorm equals nnx.GroupNorm: values, gradients, dtypes, parameters, vmap."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fedjax_mm.models.norm import GroupNorm


def _pair(features, **kwargs):
  """(ours, nnx's) with the same random scale and bias, so both parameters act."""
  ours = GroupNorm(features, rngs=nnx.Rngs(0), **kwargs)
  theirs = nnx.GroupNorm(features, rngs=nnx.Rngs(0), **kwargs)
  rng = np.random.default_rng(features)
  params = nnx.state(theirs, nnx.Param)
  params = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=p.shape), p.dtype), params)
  nnx.update(theirs, params)
  nnx.update(ours, params)
  return ours, theirs


def _grads(module, x, probe):
  graphdef, params = nnx.split(module, nnx.Param)

  def loss(params, x):
    return jnp.sum(probe * nnx.merge(graphdef, params)(x))

  return jax.grad(loss, argnums=(0, 1))(params, x)


@pytest.mark.parametrize(
  "shape,groups,kwargs",
  [
    ((2, 5, 6, 16), 4, {}),
    ((3, 4, 4, 16), 1, {}),
    ((2, 3, 5, 16), 16, {}),
    ((2, 7, 12), 3, {}),  # [b, L, C]
    ((4, 12), 3, {}),  # [b, C]: statistics over each group's channels only
    ((2, 5, 6, 8), 2, {"use_scale": False}),
    ((2, 5, 6, 8), 2, {"use_bias": False}),
    ((2, 5, 6, 8), 4, {"use_scale": False, "use_bias": False, "epsilon": 1e-3}),
  ],
)
def test_equals_nnx_group_norm_and_its_gradients(shape, groups, kwargs, x64):
  ours, theirs = _pair(shape[-1], num_groups=groups, param_dtype=jnp.float64, **kwargs)
  rng = np.random.default_rng(len(shape) * 10 + groups)
  # A large offset makes the one-pass variance lose digits in both the same way.
  x = jnp.asarray(rng.normal(size=shape) * 3.0 + 0.5)
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-12, atol=1e-12)
  probe = jnp.asarray(rng.normal(size=shape))
  got, want = _grads(ours, x, probe), _grads(theirs, x, probe)
  for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
    np.testing.assert_allclose(g, w, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16])
def test_half_precision_matches_nnx_dtype_and_values(dtype):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(2, 6, 6, 16)) * 2.0 + 1.0, dtype)
  for kwargs in ({}, {"dtype": dtype}):
    ours, theirs = _pair(16, num_groups=4, **kwargs)
    got, want = ours(x), theirs(x)
    assert got.dtype == want.dtype
    # Statistics are float32 in both; the two differ by the summation order only.
    np.testing.assert_allclose(
      np.asarray(got, np.float32), np.asarray(want, np.float32), rtol=2e-2, atol=2e-2
    )


def test_float32_matches_nnx_within_rounding():
  ours, theirs = _pair(32, num_groups=8)
  x = jax.random.normal(jax.random.key(0), (8, 32, 32, 32)) * 4.0 - 2.0
  got, want = ours(x), theirs(x)
  assert got.dtype == want.dtype == jnp.float32
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_mask_falls_back_to_nnx():
  ours, theirs = _pair(8, num_groups=2)
  rng = np.random.default_rng(2)
  x = jnp.asarray(rng.normal(size=(2, 5, 8)), jnp.float32)
  mask = jnp.asarray(rng.uniform(size=(2, 5, 8)) > 0.3)
  np.testing.assert_array_equal(ours(x, mask=mask), theirs(x, mask=mask))


def test_same_parameter_tree_as_nnx():
  ours = GroupNorm(16, num_groups=4, rngs=nnx.Rngs(0))
  theirs = nnx.GroupNorm(16, num_groups=4, rngs=nnx.Rngs(0))
  assert isinstance(ours, nnx.GroupNorm)
  shapes = lambda m: jax.tree.map(jnp.shape, nnx.state(m, nnx.Param))
  assert shapes(ours) == shapes(theirs)


def test_vmap_over_stacked_parameters_equals_loop(x64):
  ours, _ = _pair(8, num_groups=4, param_dtype=jnp.float64)
  graphdef, params = nnx.split(ours, nnx.Param)
  rng = np.random.default_rng(3)
  stacked = jax.tree.map(lambda p: jnp.asarray(rng.normal(size=(3, *p.shape))), params)
  x = jnp.asarray(rng.normal(size=(3, 2, 4, 4, 8)))
  apply = lambda p, x: nnx.merge(graphdef, p)(x)
  batched = jax.vmap(apply)(stacked, x)
  for k in range(3):
    single = apply(jax.tree.map(lambda p, k=k: p[k], stacked), x[k])
    np.testing.assert_allclose(batched[k], single, rtol=1e-12, atol=1e-12)
