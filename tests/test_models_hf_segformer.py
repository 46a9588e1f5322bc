"""SegFormer checkpoints (models/hf_segformer.py through models/hf.py).

Equality with ``transformers``' PyTorch ``SegformerModel`` /
``SegformerForSemanticSegmentation``: tiny random models built with PyTorch,
every tensor perturbed (LayerNorm / BatchNorm weights away from 1, running
statistics away from 0 / 1), saved with ``save_pretrained(safe_serialization=
True)``, loaded by ``hf.load`` and compared stage by stage and on the decode
head's logits. Those tests need torch, which CI does not install
(``pytest.importorskip("torch")``: they are skipped there and run where torch
is present). The rest needs no torch: its checkpoints are written with
``safetensors.numpy`` from an NNX module's own parameters under PyTorch's names
and layouts (``hf.torch_names`` inverted), so a round trip proves the naming
and the errors name the tensors they concern.
"""

import functools
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file
from transformers import SegformerConfig as TorchSegformerConfig

from fedjax_mm import core, data, models
from fedjax_mm.models import hf, hf_segformer

TOL = 1e-4

#: Four stages, every size small; the image size is not a multiple of 32, so the decode
#: head's upsampling runs at fractional ratios (10x12 <- 5x6, 3x3, 2x2).
FOUR = dict(
  num_encoder_blocks=4,
  depths=[1, 1, 2, 1],
  sr_ratios=[8, 4, 2, 1],
  hidden_sizes=[8, 16, 24, 32],
  patch_sizes=[7, 3, 3, 3],
  strides=[4, 2, 2, 2],
  num_attention_heads=[1, 2, 3, 4],
  mlp_ratios=[4, 4, 2, 2],
  decoder_hidden_size=16,
  num_labels=5,
)
#: Two stages (a shorter MiT), square images.
TWO = dict(
  num_encoder_blocks=2,
  depths=[2, 1],
  sr_ratios=[2, 1],
  hidden_sizes=[12, 20],
  patch_sizes=[7, 3],
  strides=[4, 2],
  num_attention_heads=[2, 4],
  mlp_ratios=[4, 4],
  decoder_hidden_size=8,
  num_labels=3,
)


def _max_abs(a, b) -> float:
  return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def _call(module):
  """``module(*args)`` jitted with the module's state as an argument (not constants)."""
  graphdef, state = nnx.split(module)
  jitted = jax.jit(lambda state, *args: nnx.merge(graphdef, state)(*args))
  return lambda *args: jitted(state, *args)


# --- Against transformers' PyTorch model (needs torch) -----------------------------------


def _torch_folder(tmp_path, sizes, *, head: bool, seed: int) -> str:
  torch = pytest.importorskip("torch")
  import transformers

  torch.manual_seed(seed)
  config = TorchSegformerConfig(**sizes)
  cls = transformers.SegformerForSemanticSegmentation if head else transformers.SegformerModel
  model = cls(config).eval()
  rng = np.random.default_rng(seed)
  with torch.no_grad():
    for name, t in model.state_dict().items():
      if not t.is_floating_point():
        continue  # num_batches_tracked
      if name.endswith("running_var"):
        value = rng.uniform(0.5, 2.0, t.shape)
      elif t.ndim == 1 and name.endswith("weight"):  # LayerNorm / BatchNorm scales
        value = 1.0 + 0.2 * rng.standard_normal(t.shape)
      else:
        value = 0.2 * rng.standard_normal(t.shape)
      t.copy_(torch.as_tensor(value, dtype=t.dtype))
  model.save_pretrained(str(tmp_path), safe_serialization=True)
  return str(tmp_path), model


def _torch_forward(model, x: np.ndarray):
  import torch

  pixels = torch.as_tensor(x.transpose(0, 3, 1, 2))  # NHWC -> NCHW
  with torch.no_grad():
    out = model(pixels, output_hidden_states=True)
  to_nhwc = lambda t: t.numpy().transpose(0, 2, 3, 1)
  states = [to_nhwc(t) for t in out.hidden_states]
  logits = to_nhwc(out.logits) if hasattr(out, "logits") else None
  return states, logits


@pytest.mark.parametrize(
  "sizes, image, head",
  [(FOUR, (40, 48), True), (TWO, (32, 32), True), (FOUR, (64, 64), False)],
  ids=["four-stages-40x48", "two-stages-32x32", "encoder-only-64x64"],
)
def test_matches_transformers_pytorch(tmp_path, sizes, image, head):
  folder, ref = _torch_folder(tmp_path, sizes, head=head, seed=sum(image))
  assert ("decode_head.classifier.weight" in load_file(f"{folder}/model.safetensors")) == head
  model = hf.load(folder)
  assert isinstance(model, hf_segformer.SegformerModel)
  assert (model.decode_head is not None) == head
  x = np.random.default_rng(0).standard_normal((2, *image, 3)).astype(np.float32)
  got = _call(model)(x)
  want_states, want_logits = _torch_forward(ref, x)

  diffs = {
    f"stage {i + 1}": _max_abs(g, w)
    for i, (g, w) in enumerate(zip(got.hidden_states, want_states, strict=True))
  }
  want_pooled = want_states[-1].reshape(2, -1, sizes["hidden_sizes"][-1]).mean(1)
  diffs["pooled"] = _max_abs(got.pooled, want_pooled)
  if head:
    assert got.logits.shape == want_logits.shape
    diffs["logits"] = _max_abs(got.logits, want_logits)
  else:
    assert got.logits is None and got.decoded is None
  print(f"SegFormer {image} max |diff|: " + ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
  assert max(diffs.values()) < TOL


def test_bilinear_upsampling_is_pytorchs(tmp_path):
  torch = pytest.importorskip("torch")
  x = np.random.default_rng(1).standard_normal((2, 3, 5, 4)).astype(np.float32)
  for size in [(10, 12), (7, 9), (3, 5), (1, 1), (3, 4)]:
    want = torch.nn.functional.interpolate(
      torch.as_tensor(x.transpose(0, 3, 1, 2)), size=size, mode="bilinear", align_corners=False
    )
    got = hf_segformer.resize_bilinear(jnp.asarray(x), size)
    assert _max_abs(got, want.numpy().transpose(0, 2, 3, 1)) < 1e-5, size


# --- Checkpoints written from the NNX module's own parameters (no torch) -------------------


def _from_torch_layout(var, convert) -> np.ndarray:
  """A variable's value in PyTorch's layout: ``convert`` undone."""
  value = np.asarray(var[...], np.float32)
  if value.ndim == 2:
    return value.T  # Linear: [in, out] -> [out, in]
  if value.ndim == 4:
    return value.transpose(3, 2, 0, 1)  # HWIO -> OIHW
  return value


def _nnx_tensors(sizes, *, seed: int) -> dict[str, np.ndarray]:
  """SegformerForSemanticSegmentation's tensors (``segformer.`` + ``decode_head.``) of a
  randomly initialised NNX model, every value perturbed so that nothing is an identity."""
  c = hf_segformer.SegformerConfig.from_json(sizes)
  model = hf_segformer.SegformerModel(c, decode_head=True, rngs=nnx.Rngs(seed))
  rng = np.random.default_rng(seed)
  tensors = {}
  for name, (var, convert) in hf.torch_names(model).items():
    value = _from_torch_layout(var, convert)
    if name.endswith("running_var"):
      value = rng.uniform(0.5, 2.0, value.shape)
    else:
      value = value + 0.1 * rng.standard_normal(value.shape)
    stored = name if name.startswith("decode_head.") else "segformer." + name
    tensors[stored] = np.asarray(value, np.float32)
  tensors["decode_head.batch_norm.num_batches_tracked"] = np.asarray(7, np.int64)
  return tensors


def _write(folder, sizes, tensors) -> str:
  folder.mkdir(parents=True, exist_ok=True)
  TorchSegformerConfig(**sizes).save_pretrained(str(folder))
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  return str(folder)


@pytest.fixture(scope="module")
def nnx_checkpoint(tmp_path_factory):
  tensors = _nnx_tensors(TWO, seed=1)
  return _write(tmp_path_factory.mktemp("segformer"), TWO, tensors), tensors


def test_checkpoint_names_round_trip(nnx_checkpoint):
  folder, tensors = nnx_checkpoint
  model = hf.load(folder)
  names = hf.torch_names(model)
  stored = {n if n.startswith("decode_head.") else "segformer." + n for n in names}
  assert stored == set(tensors) - {"decode_head.batch_norm.num_batches_tracked"}
  for name, (var, convert) in names.items():
    key = name if name.startswith("decode_head.") else "segformer." + name
    np.testing.assert_array_equal(_from_torch_layout(var, convert), tensors[key])
  stats = nnx.to_flat_state(nnx.state(model, nnx.BatchStat))
  assert {p[-1] for p, _ in stats} == {"running_mean", "running_var"}  # not parameters
  out = _call(model)(np.zeros((1, 32, 32, 3), np.float32))
  assert [s.shape for s in out.hidden_states] == [(1, 8, 8, 12), (1, 4, 4, 20)]
  assert out.decoded.shape == (1, 8, 8, 8) and out.logits.shape == (1, 8, 8, 3)


def _rewrite(tmp_path, tensors, edit) -> str:
  tensors = dict(tensors)
  edit(tensors)
  return _write(tmp_path, TWO, tensors)


def test_errors_name_the_tensors(tmp_path, nnx_checkpoint):
  _, tensors = nnx_checkpoint
  dw = "segformer.encoder.block.0.1.mlp.dwconv.dwconv.weight"

  folder = _rewrite(tmp_path / "a", tensors, lambda t: t.pop(dw))
  with pytest.raises(hf.HfError, match=r"missing tensors segformer\.encoder\.block\.0\.1\.mlp"):
    hf.load(folder)

  var = "decode_head.batch_norm.running_var"  # beside the prefix: named as stored
  folder = _rewrite(tmp_path / "b", tensors, lambda t: t.pop(var))
  with pytest.raises(hf.HfError, match=r"missing tensors decode_head\.batch_norm\.running_var\."):
    hf.load(folder)

  extra = {"segformer.encoder.extra.weight": tensors[dw], "decode_head.extra.bias": tensors[var]}
  folder = _rewrite(tmp_path / "c", tensors, lambda t: t.update(extra))
  with pytest.raises(
    hf.HfError,
    match=r"unexpected tensors decode_head\.extra\.bias, segformer\.encoder\.extra\.weight\.",
  ):
    hf.load(folder)

  folder = _rewrite(tmp_path / "d", tensors, lambda t: t.update({"aux.weight": tensors[var]}))
  with pytest.raises(hf.HfError, match=r"task head's: aux\.weight.*ignore_heads"):
    hf.load(folder)
  assert hf.load(folder, ignore_heads=True).decode_head is not None

  folder = _rewrite(tmp_path / "e", tensors, lambda t: t.update({dw: t[dw][:, :, :2]}))
  with pytest.raises(hf.HfError, match=r"dwconv\.weight is \(48, 1, 2, 3\), config\.json implies"):
    hf.load(folder)

  # No decode head at all: the encoder alone, its tensors under `segformer.`.
  encoder_only = {k: v for k, v in tensors.items() if k.startswith("segformer.")}
  model = hf.load(_write(tmp_path / "f", TWO, encoder_only))
  assert model.decode_head is None and model.width == 20

  with pytest.raises(
    ValueError, match="too small for SegFormer: stage 1's grid 1x1 is below its reduction ratio 2"
  ):
    _call(model)(np.zeros((1, 4, 4, 3), np.float32))


def test_loaded_outputs_equal_the_written_modules(nnx_checkpoint):
  """The checkpoint written from a module and read back computes what that module computes."""
  folder, tensors = nnx_checkpoint
  c = hf_segformer.SegformerConfig.from_json(TWO)
  twin = hf_segformer.SegformerModel(c, decode_head=True, rngs=nnx.Rngs(5))
  for name, (var, convert) in hf.torch_names(twin).items():
    key = name if name.startswith("decode_head.") else "segformer." + name
    var.set_value(jnp.asarray(convert(tensors[key])))
  x = np.random.default_rng(2).standard_normal((2, 36, 36, 3)).astype(np.float32)
  got, want = _call(hf.load(folder))(x), _call(twin)(x)
  jax.tree.map(np.testing.assert_array_equal, got, want)


# --- LoRA and the zoo ------------------------------------------------------------------------


def test_lora_adapts_attention_and_mix_ffn_only(nnx_checkpoint):
  folder, _ = nnx_checkpoint
  plain = hf.load(folder)
  adapted = hf.load(folder, lora_rank=2, rngs=nnx.Rngs(3))
  x = np.random.default_rng(4).standard_normal((1, 32, 32, 3)).astype(np.float32)
  jax.tree.map(
    functools.partial(np.testing.assert_allclose, atol=1e-6), _call(adapted)(x), _call(plain)(x)
  )
  adapters = nnx.to_flat_state(nnx.state(adapted, nnx.LoRAParam))
  layers = {".".join(map(str, p[:-2])) for p, _ in adapters}
  want = {
    f"encoder.block.{i}.{j}.{m}"
    for i, depth in enumerate(TWO["depths"])
    for j in range(depth)
    for m in (
      "attention.self.query",
      "attention.self.key",
      "attention.self.value",
      "attention.output.dense",
      "mlp.dense1",
      "mlp.dense2",
    )
  }
  assert layers == want


@pytest.fixture(scope="module")
def world():
  """The world's segmentation data (FedMuscle's `ss` task): images [n, 32, 32, 3], masks."""
  batch = data.generate(0, 8)
  return jnp.asarray(batch["image"]), jnp.asarray(batch["mask"])


def test_zoo_segmentation_user_trains_only_adapters_and_heads(nnx_checkpoint, world, tmp_path):
  folder, _ = nnx_checkpoint
  processor = {"image_mean": [0.5, 0.4, 0.3], "image_std": [0.2, 0.25, 0.3]}
  (tmp_path / "ckpt").mkdir()
  for file in ("config.json", "model.safetensors"):
    (tmp_path / "ckpt" / file).write_bytes((pathlib.Path(folder) / file).read_bytes())
  (tmp_path / "ckpt" / "preprocessor_config.json").write_text(json.dumps(processor))
  config = {
    "encoder": f"hf:{tmp_path / 'ckpt'}",
    "head": "segmentation",
    "num_outputs": data.NUM_SEG_CLASSES,
    "lora_rank": 2,
    "rep_dim": 8,
    "head_hidden": 8,
  }
  user = models.build(config, rngs=nnx.Rngs(0))
  assert user.modality == "image" and user.encoder.spatial_features == TWO["decoder_hidden_size"]
  images, masks = world
  pixels = (images - jnp.asarray(processor["image_mean"])) / jnp.asarray(processor["image_std"])

  graphdef, state = nnx.split(user)
  (pooled, spatial), out, logits = jax.jit(
    lambda s, x, p: (lambda u: (u.encoder(x), u.encoder.tower(p), u(x)))(nnx.merge(graphdef, s))
  )(state, images, pixels)
  assert pooled.shape == (8, 20) and spatial.shape == (8, 8, 8, 8)  # H/4 = 8, decoder width 8
  np.testing.assert_allclose(spatial, out.decoded, atol=1e-5)  # normalised, not resized
  np.testing.assert_allclose(pooled, out.pooled, atol=1e-5)
  assert logits.shape == (8, 32, 32, data.NUM_SEG_CLASSES)

  wrt = models.trainable_filter(lora=True)
  graphdef, params, frozen = nnx.split(user, wrt, ...)  # the engine's split
  paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(params)]
  assert paths and all("lora" in p or p.startswith(("projector.", "head.")) for p in paths), paths
  frozen_paths = [".".join(map(str, p)) for p, _ in nnx.to_flat_state(frozen)]
  assert any("decode_head.batch_norm.running_var" in p for p in frozen_paths)
  task = core.Task("segmentation", "image", "mask", data.NUM_SEG_CLASSES)
  valid = jnp.ones(images.shape[0], bool)

  def loss(params, x, y):
    return task.loss(nnx.merge(graphdef, params, frozen)(x), y, valid)

  grads = jax.jit(jax.grad(loss))(params, images, masks)
  flat = {".".join(map(str, p)): v[...] for p, v in nnx.to_flat_state(grads)}
  assert set(flat) == set(paths)  # the base weights and statistics get no gradient at all
  assert any(float(jnp.abs(g).max()) > 0 for p, g in flat.items() if p.endswith("lora_b"))

  tx = optax.adam(1e-2)

  @jax.jit
  def step(params, opt):
    value, g = jax.value_and_grad(loss)(params, images, masks)
    updates, opt = tx.update(g, opt, params)
    return optax.apply_updates(params, updates), opt, value

  opt = tx.init(params)
  values = []
  for _ in range(5):
    params, opt, value = step(params, opt)
    values.append(float(value))
  assert values[-1] < values[0], values
