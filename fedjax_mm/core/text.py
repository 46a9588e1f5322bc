"""Captions for ``hf:`` text encoders: token spaces, the world's words re-tokenised.

The world's captions are token ids of its own vocabulary (:data:`fedjax_mm.data.world.VOCAB`).
A Hugging Face text encoder (e.g. all-MiniLM-L6-v2) reads its own WordPiece ids, so a run
whose text encoders come from a checkpoint decodes every caption back to words and encodes
it again with that checkpoint's tokenizer (:func:`retokenize`).

A *token space* is what a text encoder reads: ``None`` for the world's vocabulary (every
zoo encoder), or an ``hf:`` checkpoint's name (:func:`token_space`). The same captions are
held once per token space, under :func:`caption_key`: ``caption`` for the world's ids,
``caption:<checkpoint>`` for a checkpoint's. A user's task reads the key of its space
(:class:`fedjax_mm.core.Task` ``input_key``), so users of several tokenizers share one
public set, each reading its own tokenisation of the same captions: :func:`in_spaces`
for the world's captions, :func:`joint_tokenizer` / :func:`split_joint` for English text
read through TFDS. FedMuscle's users and CreamFL's server and client groups (their
``text_key``) read so; CreamFL's zoo towers on TFDS read the ids of an ``hf:`` tokenizer
(``data.text_tokenizer``, :func:`fedjax_mm.runner.creamfl_data.token_space`) and take its
:func:`vocab_size`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable, Sequence

import numpy as np

from fedjax_mm import data, models
from fedjax_mm.core import tasks

#: Caption length in a checkpoint's tokens: the world's captions are at most 16 words;
#: word pieces and [CLS] / [SEP] need more.
HF_MAX_LEN = 32


def token_space(encoder: str) -> str | None:
  """The token space a text encoder reads: its ``hf:`` checkpoint, or None (the world's ids)."""
  return encoder if models.hf.is_hf(encoder) else None


def token_spaces(
  text_encoders: Iterable[str], space_of: Callable[[str], str | None] = token_space
) -> tuple[str | None, ...]:
  """The distinct token spaces of some text encoders: None (the world's) first, then sorted.

  ``space_of`` maps an encoder to its space (a runner's own rule, e.g. CreamFL's zoo
  towers on TFDS)."""
  spaces = {space_of(e) for e in text_encoders}
  return (None,) * (None in spaces) + tuple(sorted(s for s in spaces if s is not None))


def caption_key(space: str | None) -> str:
  """The data key of captions in a token space: ``caption`` (world) or ``caption:<checkpoint>``.

  >>> caption_key(None), caption_key("hf:all-MiniLM-L6-v2")
  ('caption', 'caption:hf:all-MiniLM-L6-v2')
  """
  return tasks.CAPTION_KEY if space is None else f"{tasks.CAPTION_KEY}:{space}"


def in_spaces(
  arrays: dict[str, np.ndarray], spaces: Iterable[str | None], max_len: int = HF_MAX_LEN
) -> dict[str, np.ndarray]:
  """``arrays`` with its world captions (``caption``) held in ``spaces`` instead.

  Each space's key gets :func:`retokenize` of the world's ids (the world's space keeps
  them); ``caption`` itself stays only if None is among ``spaces``. Arrays without
  captions, or an empty ``spaces``, come back as they are.
  """
  spaces = tuple(spaces)
  if tasks.CAPTION_KEY not in arrays or not spaces:
    return arrays
  out = {}
  for key, value in arrays.items():  # in order: the spaces' keys where ``caption`` was
    if key != tasks.CAPTION_KEY:
      out[key] = value
      continue
    for space in spaces:
      out[caption_key(space)] = value if space is None else retokenize(value, space, max_len)
  return out


def joint_tokenizer(checkpoints: Sequence[str], max_len: int = HF_MAX_LEN):
  """One :data:`fedjax_mm.data.tfds.Tokenizer` for several checkpoints: their ids side by side.

  ``texts -> int32 [len(texts), len(checkpoints) * max_len]``, checkpoint ``i``'s ids in
  columns ``[i * max_len, (i + 1) * max_len)``, so a dataset's text is read (and its
  images decoded) once for every token space; :func:`split_joint` takes them apart.
  """
  from fedjax_mm.data import tfds as tfds_data  # its tokenizer: the same call as retokenize

  tokenizers = [tfds_data.hf_tokenizer(c, max_len) for c in checkpoints]
  return lambda texts: np.concatenate([tok(texts) for tok in tokenizers], axis=-1)


def split_joint(
  arrays: dict[str, np.ndarray], checkpoints: Sequence[str], max_len: int = HF_MAX_LEN
) -> dict[str, np.ndarray]:
  """``arrays`` read through :func:`joint_tokenizer`: ``caption`` split into each checkpoint's key."""
  if tasks.CAPTION_KEY not in arrays:
    return arrays
  out = {}
  for key, value in arrays.items():
    if key != tasks.CAPTION_KEY:
      out[key] = value
      continue
    for i, checkpoint in enumerate(checkpoints):
      out[caption_key(checkpoint)] = value[..., i * max_len : (i + 1) * max_len]
  return out


@functools.lru_cache(maxsize=4)
def _tokenizer(checkpoint: str):
  """The checkpoint's tokenizer, read once per process (a run re-tokenises many caption sets)."""
  return models.hf.tokenizer(checkpoint)


def vocab_size(checkpoint: str) -> int:
  """Token ids of the checkpoint's tokenizer (its added tokens included): 30,522 for BERT's.

  The embedding size a zoo text encoder needs to read its ids.
  """
  return len(_tokenizer(checkpoint))


def retokenize(captions: np.ndarray, checkpoint: str, max_len: int = HF_MAX_LEN) -> np.ndarray:
  """World caption ids ``int [..., L]`` -> the checkpoint tokenizer's ids ``int32 [..., max_len]``.

  Each caption is decoded to its words and encoded again (``[CLS] ... [SEP]``, padded
  with 0 = the zoo's and BERT's PAD, truncated to ``max_len``).

  Raises:
    fedjax_mm.models.hf.HfError: the tokenizer pads with another id than the zoo's 0.
  """
  captions = np.asarray(captions)
  texts = data.world.decode(captions.reshape(-1, captions.shape[-1]))
  tok = _tokenizer(checkpoint)
  if tok.pad_token_id != models.hf.PAD_ID:
    raise models.hf.HfError(
      f"{checkpoint}: its tokenizer pads with id {tok.pad_token_id}, the zoo expects "
      f"{models.hf.PAD_ID}."
    )
  out = tok(texts, padding="max_length", truncation=True, max_length=max_len, return_tensors="np")
  return out["input_ids"].astype(np.int32).reshape(*captions.shape[:-1], max_len)


__all__ = [
  "HF_MAX_LEN",
  "caption_key",
  "in_spaces",
  "joint_tokenizer",
  "retokenize",
  "split_joint",
  "token_space",
  "token_spaces",
  "vocab_size",
]
