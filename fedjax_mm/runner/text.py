"""Captions for ``hf:`` text encoders: one token space per run, the world's words re-tokenised.

The world's captions are token ids of its own vocabulary (:data:`fedjax_mm.data.world.VOCAB`).
A Hugging Face text encoder (e.g. all-MiniLM-L6-v2) reads its own WordPiece ids, so a run
whose text encoders come from a checkpoint decodes every caption back to words and encodes
it again with that checkpoint's tokenizer. Captions are shared by all who read text (the
public set is one array), so a run has one token space: either every text encoder is the
world's (no ``hf:``) or all of them are the same checkpoint (:func:`shared_tokenizer`).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import numpy as np

from fedjax_mm import data, models
from fedjax_mm.runner.errors import ConfigError

#: Caption length in a checkpoint's tokens: the world's captions are at most 16 words;
#: word pieces and [CLS] / [SEP] need more.
HF_MAX_LEN = 32


def shared_tokenizer(text_encoders: Iterable[str]) -> str | None:
  """The ``hf:`` checkpoint every caption goes through, or None (the world's ids).

  Raises:
    ConfigError: the text encoders mix the world's vocabulary with a checkpoint's,
      or name several checkpoints.
  """
  names = set(text_encoders)
  hf_names = {n for n in names if models.hf.is_hf(n)}
  if not hf_names:
    return None
  if len(names) > 1:
    raise ConfigError(
      "every text encoder reads the same captions, so they must share a tokenizer: either no "
      f"hf: text encoder or the same one for all, got {sorted(names)}."
    )
  return hf_names.pop()


@functools.lru_cache(maxsize=4)
def _tokenizer(checkpoint: str):
  """The checkpoint's tokenizer, read once per process (a run re-tokenises many caption sets)."""
  return models.hf.tokenizer(checkpoint)


def retokenize(captions: np.ndarray, checkpoint: str, max_len: int = HF_MAX_LEN) -> np.ndarray:
  """World caption ids ``int [..., L]`` -> the checkpoint tokenizer's ids ``int32 [..., max_len]``.

  Each caption is decoded to its words and encoded again (``[CLS] ... [SEP]``, padded
  with 0 = the zoo's and BERT's PAD, truncated to ``max_len``).

  Raises:
    ConfigError: the tokenizer pads with another id than the zoo's 0.
  """
  captions = np.asarray(captions)
  texts = data.world.decode(captions.reshape(-1, captions.shape[-1]))
  tok = _tokenizer(checkpoint)
  if tok.pad_token_id != models.hf.PAD_ID:
    raise ConfigError(
      f"{checkpoint}: its tokenizer pads with id {tok.pad_token_id}, the zoo expects "
      f"{models.hf.PAD_ID}."
    )
  out = tok(texts, padding="max_length", truncation=True, max_length=max_len, return_tensors="np")
  return out["input_ids"].astype(np.int32).reshape(*captions.shape[:-1], max_len)


__all__ = ["HF_MAX_LEN", "retokenize", "shared_tokenizer"]
