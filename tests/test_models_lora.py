"""Tests for LoRA adapters and the trainable/frozen parameter filters.

Real initialisation matters here (LoRA's B starts at 0), so models are built
for real, once per configuration (``_built``, with the ``rbg`` PRNG, whose
kernels compile faster than threefry's); everything else is traced with
``nnx.eval_shape``. Jitted code is compiled at XLA optimisation level 0, as in
``test_models.py``: these tests are compile-bound.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from fedjax_mm import models

RANK = 4
LORA_ENCODERS = ["vit_t", "transformer_t", "gru"]

_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


def _config(encoder, lora_rank):
  return {
    "encoder": encoder,
    "head": "mlp",
    "num_outputs": 5,
    "rep_dim": 32,
    "lora_rank": lora_rank,
    "vocab_size": 50,
    "max_len": 12,
  }


@functools.cache
def _built(encoder, lora_rank):
  rngs = nnx.Rngs(jax.random.key(0, impl="rbg"))
  return nnx.split(models.build(_config(encoder, lora_rank), rngs=rngs))


def _abstract_model(encoder, lora_rank):
  return nnx.eval_shape(lambda: models.build(_config(encoder, lora_rank), rngs=nnx.Rngs(0)))


def _inputs(modality, key=0, b=4):
  rng = np.random.default_rng(key)
  if modality == "image":
    return jnp.asarray(rng.uniform(size=(b, 32, 32, 3)), jnp.float32)
  ids = rng.integers(1, 50, size=(b, 12))
  return jnp.asarray(np.where(np.arange(12) < np.array([12, 7, 0, 9])[:b, None], ids, 0), jnp.int32)


@functools.partial(_jit, static_argnums=0)
def _forward(graphdef, state, x):
  return nnx.merge(graphdef, state).forward(x)


def _flat(state):
  return {path: np.asarray(v) for path, v in nnx.to_flat_state(state)}


# --- Initialisation --------------------------------------------------------------


# transformer_t's adapters sit in the same Attention/Mlp layers as vit_t's.
@pytest.mark.parametrize("encoder", ["vit_t", "gru"])
def test_fresh_lora_model_has_base_weights_and_zero_b(encoder):
  # Same seed -> the same base weights at the same paths, whatever the rank.
  base_params = _flat(_built(encoder, 0)[1])
  graphdef, state = _built(encoder, RANK)
  adapted = nnx.merge(graphdef, state)
  adapted_base = _flat(nnx.state(adapted, nnx.Not(models.adapter_filter)))
  assert base_params.keys() == adapted_base.keys()
  for path, value in base_params.items():
    np.testing.assert_array_equal(adapted_base[path], value, err_msg=str(path))
  adapters = _flat(nnx.state(adapted, models.adapter_filter))
  assert adapters
  for path, value in adapters.items():
    if path[-1] == "lora_b":
      np.testing.assert_array_equal(value, 0.0)
    else:
      assert path[-1] == "lora_a" and np.any(value != 0), path


@pytest.mark.parametrize("encoder", ["vit_t", "gru"])
def test_fresh_lora_model_equals_base_model(encoder):
  modality = models.ENCODERS[encoder][0]
  x = _inputs(modality)
  z0, y0 = _forward(*_built(encoder, 0), x)
  z1, y1 = _forward(*_built(encoder, RANK), x)
  np.testing.assert_allclose(z1, z0, rtol=1e-6, atol=1e-6)
  np.testing.assert_allclose(y1, y0, rtol=1e-6, atol=1e-6)


# --- Counts and filters ------------------------------------------------------------


def _expected_adapter_count(encoder, r):
  """r * (in + out) summed over the adapted dense layers, written out by hand."""
  if encoder == "vit_t":  # width 64, depth 2, MLP hidden 128
    per_block = 4 * r * (64 + 64) + r * (64 + 128) + r * (128 + 64)
    return 2 * per_block
  if encoder == "transformer_t":  # width 64, depth 2, MLP hidden 256
    per_block = 4 * r * (64 + 64) + r * (64 + 256) + r * (256 + 64)
    return 2 * per_block
  if encoder == "gru":  # embed 64, hidden 128: inputs 64 -> 384, recurrent 128 -> 384
    return r * (64 + 384) + r * (128 + 384)
  raise AssertionError(encoder)


@pytest.mark.parametrize("encoder", LORA_ENCODERS)
def test_adapter_param_count(encoder):
  model = _abstract_model(encoder, RANK)
  expected = _expected_adapter_count(encoder, RANK)
  assert models.param_count(model, models.adapter_filter) == expected
  # Cross-check against the layers themselves.
  lora_layers = [m for _, m in nnx.iter_graph(model) if isinstance(m, nnx.LoRALinear)]
  assert expected == sum(RANK * (m.in_features + m.out_features) for m in lora_layers)
  # Adapters are added on top of an unchanged base; rank 0 has none.
  base = _abstract_model(encoder, 0)
  assert models.param_count(base, models.adapter_filter) == 0
  assert models.param_count(model) == models.param_count(base) + expected


def test_filters_select_the_right_parameters():
  model = _abstract_model("vit_t", RANK)
  paths = lambda f: {path for path, _ in nnx.to_flat_state(nnx.state(model, f))}
  everything = paths(nnx.Param)
  assert paths(models.trainable_filter(False)) == everything
  trainable = paths(models.trainable_filter(True))
  frozen = paths(models.frozen_filter(True))
  assert trainable | frozen == everything and not trainable & frozen
  for path in trainable:
    assert path[0] in ("projector", "head") or path[-1] in ("lora_a", "lora_b"), path
  for path in frozen:
    assert path[0] == "encoder" and "lora" not in path, path
  # Contrastive epochs with LoRA: adapters + projector, no head.
  rep = paths(nnx.All(models.trainable_filter(True), models.representation_filter))
  assert rep == {p for p in trainable if p[0] != "head"}
  assert any(p[0] == "projector" for p in rep) and any(p[-1] == "lora_b" for p in rep)


# --- Training only the trainable part ------------------------------------------------


def _task_loss(model, x):
  z, logits = model.forward(x)
  labels = jnp.arange(x.shape[0]) % logits.shape[-1]
  return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean() + jnp.sum(z[0])


def _check_two_steps(before, one, two):
  """Everything trainable moves, except A on the first step (B = 0 kills its gradient)."""
  for path, value in before.items():
    if path[-1] == "lora_a":
      np.testing.assert_array_equal(one[path], value)
      assert not np.array_equal(two[path], value), path
    else:
      assert not np.array_equal(one[path], value), path


def test_functional_step_updates_only_trainable():
  """The engine's path: split by the filter and differentiate the trainable part.

  On the GRU, whose adapters sit inside a ``lax.scan``.
  """
  model = nnx.merge(*_built("gru", RANK))
  x = _inputs("text")
  wrt = models.trainable_filter(True)
  graphdef, trainable, frozen = nnx.split(model, wrt, ...)
  tx = optax.adam(1e-2)

  @_jit
  def two_steps(trainable):
    opt_state = tx.init(trainable)
    loss = lambda t: _task_loss(nnx.merge(graphdef, t, frozen), x)
    out = []
    for _ in range(2):
      updates, opt_state = tx.update(jax.grad(loss)(trainable), opt_state, trainable)
      trainable = optax.apply_updates(trainable, updates)
      out.append(trainable)
    return out

  one, two = two_steps(trainable)
  _check_two_steps(_flat(trainable), _flat(one), _flat(two))
  assert {p[-1] for p in _flat(trainable)} >= {"lora_a", "lora_b"}


def test_nnx_optimizer_with_trainable_filter_freezes_base():
  """``nnx.Optimizer(..., wrt=trainable_filter(True))``, stepped functionally."""
  model = nnx.merge(*_built("vit_t", RANK))
  x = _inputs("image")
  wrt = models.trainable_filter(True)
  optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=wrt)  # no decay: A must stay put
  graphdef, state = nnx.split((model, optimizer))

  @_jit
  def step(state):
    model, optimizer = nnx.merge(graphdef, state)
    grads = nnx.grad(_task_loss, argnums=nnx.DiffState(0, wrt))(model, x)
    optimizer.update(model, grads)
    return nnx.state((model, optimizer))

  frozen_before = _flat(nnx.state(model, models.frozen_filter(True)))
  trainable = [_flat(nnx.state(model, wrt))]
  for _ in range(2):
    state = step(state)
    nnx.update((model, optimizer), state)
    trainable.append(_flat(nnx.state(model, wrt)))
  frozen_after = _flat(nnx.state(model, models.frozen_filter(True)))
  assert frozen_before.keys() == frozen_after.keys() and frozen_before
  for path, value in frozen_before.items():
    np.testing.assert_array_equal(frozen_after[path], value, err_msg=str(path))
  _check_two_steps(*trainable)
  assert optimizer.step[...] == 2


def test_lora_model_under_vmap_equals_loop():
  # Parameters drawn from NumPy: two clients with different (non-zero) adapters.
  graphdef, abstract = nnx.split(_abstract_model("transformer_t", RANK))
  rng = np.random.default_rng(0)
  states = [
    jax.tree.map(lambda v: jnp.asarray(rng.normal(size=v.shape) * 0.2, v.dtype), abstract)
    for _ in range(2)
  ]
  stacked = jax.tree.map(lambda *v: np.stack(v), *states)
  xs = jnp.stack([_inputs("text", key=i) for i in range(2)])
  z, y = _jit(jax.vmap(lambda s, x: nnx.merge(graphdef, s).forward(x)))(stacked, xs)
  for i, s in enumerate(states):
    zi, yi = _forward(graphdef, s, xs[i])
    np.testing.assert_allclose(z[i], zi, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(y[i], yi, rtol=1e-5, atol=1e-5)
  assert not np.allclose(y[0], y[1])
