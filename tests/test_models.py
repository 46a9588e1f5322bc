"""Tests for fedjax_mm.models: encoders, heads, the user model and the registry.

These tests are compile-bound on CPU, so they are written to compile little:

* models are traced with ``nnx.eval_shape`` (nothing compiled) and their
  parameters filled from NumPy (``_materialize``) -- random initialisers
  would compile a kernel per parameter shape. Initialisation itself is tested
  in ``test_models_lora.py`` and by ``test_stacked_init_under_vmap_equals_loop``.
* every computation goes through a few jitted helpers keyed on the static
  graphdef, compiled at XLA optimisation level 0, and shared between tests;
* tests that only need shapes use ``jax.eval_shape``;
* gradients are checked on the smallest encoder of each class (``cnn_s``,
  ``resnet_t``, ``vit_t``, ``transformer_t``, ``gru``); the larger siblings run
  the same code with other widths and depths and get forward checks only.
"""

import functools

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from flax import nnx

from fedjax_mm import models

IMAGE = [n for n, (m, _) in models.ENCODERS.items() if m == "image"]
TEXT = [n for n, (m, _) in models.ENCODERS.items() if m == "text"]
VOCAB, MAX_LEN = 50, 24
TEXT_KW = {"vocab_size": VOCAB, "max_len": MAX_LEN}
# Row lengths of the text batch shared by the text tests (one compiled program):
# an all-PAD row, a padded row and a full row.
LENGTHS = (0, 9, 16)

_jit = functools.partial(jax.jit, compiler_options={"xla_backend_optimization_level": 0})


# --- Helpers -------------------------------------------------------------------


def _materialize(build, seed=0):
  """``(graphdef, state)`` of ``build()`` with NumPy-drawn parameters.

  Kernels get N(0, 1/fan_in) entries, norm scales 1 + N(0, 0.1^2), other
  vectors N(0, 0.1^2): generic, non-degenerate values, so no test relies on a
  special initialisation (e.g. zero biases or zero LoRA B).
  """
  graphdef, abstract = nnx.split(nnx.eval_shape(build))
  rng = np.random.default_rng(seed)

  def draw(path, leaf):
    if len(leaf.shape) >= 2:
      scale = 1.0 / np.sqrt(np.prod(leaf.shape[:-1]))
    else:
      scale = 0.1
    value = rng.normal(size=leaf.shape) * scale
    if "scale" in jax.tree_util.keystr(path):
      value += 1.0
    return jnp.asarray(value, leaf.dtype)

  return graphdef, jax.tree.map_with_path(draw, abstract)


@functools.cache
def _encoder(name, **kwargs):
  kwargs = {**TEXT_KW, **kwargs}
  return _materialize(lambda: models.build_encoder(name, rngs=nnx.Rngs(0), **kwargs))


@functools.cache
def _user_model(items, seed=0):
  config = {**TEXT_KW, **dict(items)}
  return _materialize(lambda: models.build(config, rngs=nnx.Rngs(0)), seed)


@functools.partial(_jit, static_argnums=(0, 3))
def _call(graphdef, state, x, method="__call__"):
  return getattr(nnx.merge(graphdef, state), method)(x)


def _readout(outputs):
  """A scalar depending on every output entry with fixed, non-constant weights.

  A plain sum would hide gradients (LayerNorm outputs sum to a constant).
  """
  leaves = jax.tree.leaves(outputs)
  return sum(jnp.sum(o * jnp.sin(jnp.arange(o.size) + 0.5).reshape(o.shape)) for o in leaves)


@functools.partial(_jit, static_argnums=(0, 3))
def _outputs_and_grads(graphdef, state, x, method="__call__"):
  """``(outputs, d readout(outputs) / d state)`` in one compiled program."""

  def f(s):
    outputs = getattr(nnx.merge(graphdef, s), method)(x)
    return _readout(outputs), outputs

  grads, outputs = jax.grad(f, has_aux=True)(state)
  return outputs, grads


def _images(key, b=2, size=32, channels=3):
  return jnp.asarray(
    np.random.default_rng(key).uniform(size=(b, size, size, channels)), jnp.float32
  )


def _tokens(key, lengths, total):
  """Token ids ``[len(lengths), total]``; row i: ``lengths[i]`` non-PAD ids, then PAD."""
  ids = np.random.default_rng(key).integers(1, VOCAB, size=(len(lengths), total))
  valid = np.arange(total)[None, :] < np.asarray(lengths)[:, None]
  return jnp.asarray(np.where(valid, ids, 0), jnp.int32)


def _abstract(shape, dtype=jnp.float32):
  return jax.ShapeDtypeStruct(shape, dtype)


def _eval_shape(build, x):
  """Output shapes of ``build()(x)`` without allocating or compiling anything."""
  return jax.eval_shape(lambda x: build()(x), x)


def _assert_all_leaves_get_gradient(grads):
  for path, g in jax.tree.leaves_with_path(grads):
    name = jax.tree_util.keystr(path)
    assert np.all(np.isfinite(g)), name
    assert np.any(g != 0), f"no gradient reaches {name}"


# --- Image encoders ------------------------------------------------------------


_WITH_GRADS = {"cnn_s", "resnet_t", "vit_t", "transformer_t", "gru"}


def _encoder_outputs(name, x):
  graphdef, state = _encoder(name)
  if name in _WITH_GRADS:
    outputs, grads = _outputs_and_grads(graphdef, state, x)
    _assert_all_leaves_get_gradient(grads)
    return outputs, grads
  return _call(graphdef, state, x), None


@pytest.mark.parametrize("name", IMAGE)
def test_image_encoder_shapes_finite_and_gradients(name):
  encoder = nnx.merge(*_encoder(name))
  (pooled, spatial), _ = _encoder_outputs(name, _images(1))
  assert pooled.shape == (2, encoder.features)
  assert spatial.shape == (2, 8, 8, encoder.spatial_features)
  assert np.all(np.isfinite(pooled)) and np.all(np.isfinite(spatial))
  # The pooled feature is the spatial mean (ViT: mean of the patch tokens).
  np.testing.assert_allclose(pooled, spatial.mean(axis=(1, 2)), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("name", IMAGE)
def test_image_encoder_small_grayscale_input_shapes(name):
  build = lambda: models.build_encoder(name, image_size=8, channels=1, rngs=nnx.Rngs(0))
  features = nnx.eval_shape(build).features
  pooled, spatial = _eval_shape(build, _abstract((2, 8, 8, 1)))
  assert pooled.shape == (2, features)
  assert spatial.shape == (2, 2, 2, features)


def test_image_encoders_check_their_input():
  with pytest.raises(ValueError, match="not divisible"):
    nnx.eval_shape(lambda: models.build_encoder("vit_t", image_size=30, rngs=nnx.Rngs(0)))
  vit = lambda: models.build_encoder("vit_t", image_size=16, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="16x16"):
    _eval_shape(vit, _abstract((1, 32, 32, 3)))
  cnn = lambda: models.build_encoder("cnn_s", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="expected images"):
    _eval_shape(cnn, _abstract((1, 32, 32, 1)))
  with pytest.raises(ValueError, match="stem must be"):
    models.image.Vit(width=16, depth=1, num_heads=2, stem="hybrid", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="conv stem downsamples by 4; got patch 2"):
    models.image.Vit(width=16, depth=1, num_heads=2, patch=2, stem="conv", rngs=nnx.Rngs(0))


def test_vit_spatial_map_is_patch_grid():
  """Grid cell (i, j) of the spatial map is the token of patch (i, j).

  With depth 0 a ViT is embed + pos + LayerNorm per token, so changing the
  pixels of one 4x4 patch must change exactly one grid cell, the matching one:
  this pins the patch -> grid layout (row-major, no transposition).
  """
  graphdef, state = _materialize(
    lambda: models.image.Vit(width=16, depth=0, num_heads=2, rngs=nnx.Rngs(0))
  )
  x = _images(0, b=1)
  y = x.at[:, 8:12, 20:24, :].add(0.5)  # patch row 2, column 5
  _, a = _call(graphdef, state, x)
  _, b = _call(graphdef, state, y)
  changed = np.any(np.abs(np.asarray(a - b)) > 1e-6, axis=-1)[0]
  expected = np.zeros((8, 8), bool)
  expected[2, 5] = True
  np.testing.assert_array_equal(changed, expected)


# --- Text encoders -------------------------------------------------------------


def _text_outputs(name):
  return _encoder_outputs(name, _tokens(1, LENGTHS, 16))


@pytest.mark.parametrize("name", TEXT)
def test_text_encoder_shapes_finite_and_gradients(name):
  features = nnx.merge(*_encoder(name)).features
  (pooled, tokens), grads = _text_outputs(name)
  assert pooled.shape == (3, features)
  assert tokens.shape == (3, 16, features)
  assert np.all(np.isfinite(pooled)) and np.all(np.isfinite(tokens))
  if grads is not None:
    # PAD tokens embed to nothing that matters, so the PAD row learns nothing.
    np.testing.assert_array_equal(grads["embed"]["embedding"][...][0], 0.0)


@pytest.mark.parametrize("name", TEXT)
def test_all_pad_row_is_zero(name):
  (pooled, tokens), _ = _text_outputs(name)
  np.testing.assert_array_equal(pooled[0], 0.0)
  np.testing.assert_array_equal(tokens[0], 0.0)


@pytest.mark.parametrize("name", TEXT)
def test_text_encoder_ignores_padding(name):
  graphdef, state = _encoder(name)
  x = _tokens(1, LENGTHS, 16)
  (pooled, tokens), _ = _text_outputs(name)
  np.testing.assert_array_equal(np.asarray(tokens)[~np.asarray(x != 0)], 0.0)

  # Appending PAD tokens changes nothing.
  longer = jnp.pad(x, ((0, 0), (0, MAX_LEN - 16)))
  pooled2, tokens2 = _call(graphdef, state, longer)
  np.testing.assert_allclose(pooled2, pooled, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(tokens2[:, :16], tokens, rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(tokens2[:, 16:], 0.0)

  # Whatever a PAD position embeds to is irrelevant: perturb the PAD embedding
  # row (and, for the Transformer, the positional rows past the longest row).
  perturbed = nnx.merge(graphdef, state)
  table = perturbed.embed.embedding
  table[...] = table[...].at[0].add(3.0)
  if hasattr(perturbed, "pos"):
    perturbed.pos[...] = perturbed.pos[...].at[16:].add(3.0)
  pooled3, tokens3 = _call(graphdef, nnx.state(perturbed), longer)
  np.testing.assert_array_equal(pooled3, pooled2)
  np.testing.assert_array_equal(tokens3, tokens2)


def test_gru_pooled_is_state_at_last_token():
  (pooled, tokens), _ = _text_outputs("gru")
  for row, length in enumerate(LENGTHS[1:], start=1):
    np.testing.assert_array_equal(pooled[row], tokens[row, length - 1])


def test_transformer_pooled_is_masked_mean():
  (pooled, tokens), _ = _text_outputs("transformer_t")
  for row, length in enumerate(LENGTHS[1:], start=1):
    np.testing.assert_allclose(pooled[row], tokens[row, :length].mean(0), rtol=1e-5, atol=1e-6)


def test_text_encoders_check_their_input():
  encoder = lambda: models.build_encoder("transformer_t", max_len=8, rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="max_len"):
    _eval_shape(encoder, _abstract((1, 9), jnp.int32))
  with pytest.raises(ValueError, match="int token ids"):
    _eval_shape(encoder, _abstract((1, 4)))


# --- Heads ---------------------------------------------------------------------


@pytest.mark.parametrize("head_cls", [models.LinearHead, models.MlpHead])
def test_classification_heads(head_cls):
  graphdef, state = _materialize(lambda: head_cls(16, 5, rngs=nnx.Rngs(0)))
  out, grads = _outputs_and_grads(graphdef, state, jnp.asarray(np.ones((3, 16)), jnp.float32))
  assert out.shape == (3, 5)
  _assert_all_leaves_get_gradient(grads)


def test_mlp_head_is_two_layer_relu():
  graphdef, state = _materialize(lambda: models.MlpHead(6, 3, hidden=7, rngs=nnx.Rngs(0)))
  head = nnx.merge(graphdef, state)
  z = np.random.default_rng(0).normal(size=(4, 6)).astype(np.float32)
  w1, b1 = np.asarray(head.fc1.kernel[...]), np.asarray(head.fc1.bias[...])
  w2, b2 = np.asarray(head.fc2.kernel[...]), np.asarray(head.fc2.bias[...])
  expected = np.maximum(z @ w1 + b1, 0) @ w2 + b2
  np.testing.assert_allclose(_call(graphdef, state, z), expected, rtol=1e-5, atol=1e-5)


def test_segmentation_head_shapes_and_upsampling():
  graphdef, state = _materialize(lambda: models.SegmentationHead(16, 4, hidden=8, rngs=nnx.Rngs(0)))
  fmap = jnp.asarray(np.random.default_rng(0).normal(size=(2, 8, 8, 16)), jnp.float32)

  @_jit
  def run(state):
    head = lambda s, size: nnx.merge(graphdef, s)(fmap, out_size=size)
    grads, out = jax.grad(lambda s: (_readout(o := head(s, (32, 32))), o), has_aux=True)(state)
    return out, head(state, (8, 8)), grads

  out, low, grads = run(state)
  assert out.shape == (2, 32, 32, 4)
  _assert_all_leaves_get_gradient(grads)
  # Bilinear upsampling of the low-resolution logits: same mean, no overshoot.
  np.testing.assert_allclose(out.mean(axis=(1, 2)), low.mean(axis=(1, 2)), atol=1e-5)
  assert out.max() <= low.max() + 1e-5 and out.min() >= low.min() - 1e-5


# --- User model ------------------------------------------------------------------

CASES = [
  ((("encoder", "vit_t"), ("head", "linear"), ("num_outputs", 10)), "image"),
  ((("encoder", "cnn_s"), ("head", "mlp"), ("num_outputs", 7)), "image"),
  ((("encoder", "resnet_t"), ("head", "segmentation"), ("num_outputs", 5)), "image"),
  ((("encoder", "gru"), ("head", "mlp"), ("num_outputs", 4)), "text"),
]


def _inputs(modality, key=0, b=3):
  if modality == "image":
    return _images(key, b=b)
  return _tokens(key, [16, 5, 0, 8][:b], 16)  # with an all-PAD row


@functools.partial(_jit, static_argnums=0)
def _all_outputs(graphdef, state, x):
  """forward, represent, __call__ and (classification) head(projector(pooled))."""
  model = nnx.merge(graphdef, state)
  outs = {"forward": model.forward(x), "represent": model.represent(x), "call": model(x)}
  if model.head.reads == "representation":
    outs["head_on_projector"] = model.head(model.projector(model.encoder(x)[0]))
  return outs


@pytest.mark.parametrize("items,modality", CASES)
def test_forward_equals_represent_and_call(items, modality):
  config = dict(items)
  graphdef, state = _user_model(items)
  model = nnx.merge(graphdef, state)
  assert model.modality == modality and model.rep_dim == 256
  outs = _all_outputs(graphdef, state, _inputs(modality))
  z, out = outs["forward"]
  np.testing.assert_allclose(z, outs["represent"], rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(out, outs["call"], rtol=1e-5, atol=1e-6)
  assert z.shape == (3, 256)
  np.testing.assert_allclose(jnp.linalg.norm(z, axis=-1), 1.0, rtol=1e-5)
  if modality == "text":  # the all-PAD row pools to 0: z is the normalised projector bias
    np.testing.assert_allclose(z[2], models.l2_normalize(model.projector.bias[...]), atol=1e-6)
  n = config["num_outputs"]
  assert out.shape == ((3, 32, 32, n) if config["head"] == "segmentation" else (3, n))
  if "head_on_projector" in outs:  # the head reads the unnormalised projector output
    np.testing.assert_allclose(out, outs["head_on_projector"], rtol=1e-5, atol=1e-5)


def test_l2_normalize_is_safe_at_zero():
  x = jnp.array([[0.0, 0.0, 0.0], [3.0, 0.0, 4.0]])
  np.testing.assert_allclose(models.l2_normalize(x), [[0, 0, 0], [0.6, 0, 0.8]], atol=1e-7)
  g = jax.grad(lambda x: models.l2_normalize(x).sum())(x)
  assert np.all(np.isfinite(g))


@pytest.mark.parametrize("items,modality", [CASES[0], CASES[2], CASES[3]])
def test_vmap_over_stacked_clients_equals_loop(items, modality):
  k = 3
  splits = [_user_model(items, seed=i) for i in range(k)]
  graphdef = splits[0][0]
  assert all(g == graphdef for g, _ in splits)  # one architecture, one graphdef
  stacked = jax.tree.map(lambda *leaves: np.stack(leaves), *[s for _, s in splits])
  xs = jnp.stack([_inputs(modality, key=i) for i in range(k)])

  apply = lambda s, x: nnx.merge(graphdef, s).forward(x)
  z, out = _jit(jax.vmap(apply))(stacked, xs)
  for i, (_, state) in enumerate(splits):
    zi, outi = _all_outputs(graphdef, state, xs[i])["forward"]
    np.testing.assert_allclose(z[i], zi, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(out[i], outi, rtol=1e-5, atol=1e-5)
  assert not np.allclose(out[0], out[1])  # the clients really differ


def test_stacked_init_under_vmap_equals_loop():
  """The engine may initialise K clients at once with ``jax.vmap`` over keys."""
  config = {"encoder": "cnn_s", "num_outputs": 3, "rep_dim": 16}
  init = lambda key: nnx.split(models.build(config, rngs=nnx.Rngs(key)))[1]
  keys = jax.random.split(jax.random.key(0), 2)
  stacked, looped = _jit(lambda keys: (jax.vmap(init)(keys), [init(k) for k in keys]))(keys)
  for i, state in enumerate(looped):
    jax.tree.map(lambda a, b, i=i: np.testing.assert_allclose(a[i], b, atol=1e-6), stacked, state)
  assert not np.allclose(
    looped[0]["projector"]["kernel"][...], looped[1]["projector"]["kernel"][...]
  )


def test_representation_and_head_filters_partition_the_params():
  model = nnx.eval_shape(lambda: models.build("vit_t", head="mlp", num_outputs=3, rngs=nnx.Rngs(0)))
  _, rep, head, rest = nnx.split(model, models.representation_filter, models.head_filter, ...)
  assert not jax.tree.leaves(rest)
  assert {path[0] for path, _ in nnx.to_flat_state(rep)} == {"encoder", "projector"}
  assert {path[0] for path, _ in nnx.to_flat_state(head)} == {"head"}
  count = functools.partial(models.param_count, model)
  assert count() == count(models.representation_filter) + count(models.head_filter)
  assert count(models.head_filter) == (256 * 256 + 256) + (256 * 3 + 3)
  assert count(nnx.PathContains("projector")) == 64 * 256 + 256


# --- Registry ------------------------------------------------------------------


@pytest.mark.parametrize("name", list(models.ENCODERS))
def test_every_encoder_builds_and_runs(name):
  modality = models.ENCODERS[name][0]
  # The most demanding valid head: segmentation for images.
  head = "segmentation" if modality == "image" else "mlp"
  build = lambda: models.build({"encoder": name, "head": head, "num_outputs": 3}, rngs=nnx.Rngs(0))
  x = _abstract((2, 32, 32, 3)) if modality == "image" else _abstract((2, 32), jnp.int32)
  z, out = _eval_shape(lambda: build().forward, x)
  assert z.shape == (2, 256)
  assert out.shape == ((2, 32, 32, 3) if modality == "image" else (2, 3))


@pytest.mark.parametrize("encoder", ["cnn_s", "gru"])
def test_every_valid_head_builds(encoder):
  modality = models.ENCODERS[encoder][0]
  heads = ["linear", "mlp"] + (["segmentation"] if modality == "image" else [])
  for head in heads:
    config = {"encoder": encoder, "head": head, "num_outputs": 3, "head_hidden": 16}
    model = nnx.eval_shape(lambda config=config: models.build(config, rngs=nnx.Rngs(0)))
    assert isinstance(model, models.UserModel) and model.modality == modality
    assert isinstance(model.head, models.HEADS[head])
    assert model.head.reads == ("spatial" if head == "segmentation" else "representation")


def test_build_encoder_rejects_unknown_arguments():
  with pytest.raises(ValueError, match="unknown encoder arguments \\['image_sise'\\]"):
    models.build_encoder("vit_t", image_sise=16, rngs=nnx.Rngs(0))


def test_build_accepts_config_dict_and_overrides():
  config = ml_collections.ConfigDict(
    {"encoder": "transformer_t", "num_outputs": 6, "vocab_size": 40, "max_len": 10}
  )
  model = nnx.eval_shape(lambda: models.build(config, rep_dim=24, rngs=nnx.Rngs(0)))
  assert model.rep_dim == 24
  assert model.encoder.embed.embedding.shape == (40, 64)
  assert model.encoder.pos.shape == (10, 64)


@pytest.mark.parametrize(
  "config,match",
  [
    ({"encoder": "vgg", "num_outputs": 3}, "unknown encoder 'vgg'; valid names: cnn_m, cnn_s, gru"),
    (
      {"encoder": "vit_t", "head": "conv", "num_outputs": 3},
      "valid names: linear, mlp, segmentation",
    ),
    ({"encoder": "vit_t", "num_output": 3}, "unknown model config keys \\['num_output'\\]"),
    ({"encoder": "vit_t"}, "num_outputs must be a positive int, got None"),
    ({"encoder": "vit_t", "num_outputs": 3, "rep_dim": 0}, "rep_dim must be a positive int"),
    ({"encoder": "gru", "head": "segmentation", "num_outputs": 3}, "needs an image encoder"),
    ({"encoder": "gru", "modality": "image", "num_outputs": 3}, "is a text encoder"),
    ({"encoder": "cnn_s", "lora_rank": 4, "num_outputs": 3}, "no dense layers to adapt"),
    ({"encoder": "vit_t", "lora_rank": -1, "num_outputs": 3}, "lora_rank must be >= 0"),
  ],
)
def test_build_rejects_bad_configs(config, match):
  with pytest.raises(ValueError, match=match):
    nnx.eval_shape(lambda: models.build(config, rngs=nnx.Rngs(0)))
