"""FedMuscle with text users of several token spaces: the world's ids and two checkpoints.

Users: an MLC image user, a text user on a tiny BERT (MiniLM's 30,522 WordPieces), one on
a tiny DistilBERT (a vocabulary of 80) and one on the world's vocabulary. Each reads the
same captions in its own token space, in its own sets and in the public set; a round runs.
"""

import hf_toys
import numpy as np
import pytest

from experiments import fedmuscle as fedmuscle_config
from fedjax_mm import data
from fedjax_mm.core import text as text_lib
from fedjax_mm.models import hf
from fedjax_mm.runner import fedmuscle as runner
from fedjax_mm.runner import fedmuscle_data


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
  root = tmp_path_factory.mktemp("checkpoints")
  return hf_toys.tiny_bert(root / "bert"), hf_toys.tiny_distilbert(root / "distilbert")


def _config(text_encoders):
  config = fedmuscle_config.get_config("smoke")
  config.users = [dict(config.users[0])] + [
    {"encoder": e, "task": "tc", "train_size": 16} for e in text_encoders
  ]
  config.public.modalities = ("image", "text")
  config.rounds = 1
  config.muscle.num_partners = 1
  return config


def _ids(checkpoint, world_ids):
  """The checkpoint's tokenizer applied to the world's decoded words (not retokenize)."""
  tok = hf.tokenizer(checkpoint)
  texts = data.world.decode(world_ids.reshape(-1, world_ids.shape[-1]))
  out = tok(texts, padding="max_length", max_length=text_lib.HF_MAX_LEN, truncation=True)
  return np.asarray(out["input_ids"]).reshape(*world_ids.shape[:-1], -1)


def test_each_text_user_reads_its_own_tokenizers_ids(checkpoints):
  bert, distilbert = checkpoints
  config = _config((bert, distilbert, "transformer_t"))
  users = runner.validate(config)
  assert fedmuscle_data.text_spaces(users) == (None, *sorted(checkpoints))
  train, test, public = runner._user_data(config, users)
  # The same draws with every text user on the world's vocabulary: the captions as world ids.
  world = _config(("transformer_t",) * 3)
  w_train, w_test, w_public = runner._user_data(world, runner.validate(world))
  for u, space in zip(users[1:], (bert, distilbert, None), strict=True):
    key = text_lib.caption_key(space)
    assert runner._task(u, config).input_key == key
    for got, want in ((train, w_train), (test, w_test)):
      captions = {k for k in got[u.index] if k.startswith("caption") and k != "caption_label"}
      assert captions == {key}  # its own space only
      expected = want[u.index]["caption"]
      expected = expected if space is None else _ids(space, expected)
      np.testing.assert_array_equal(got[u.index][key], expected)
      np.testing.assert_array_equal(got[u.index]["caption_label"], want[u.index]["caption_label"])
  # The public set: the same captions once per space, row for row.
  keys = {text_lib.caption_key(s) for s in (None, bert, distilbert)}
  assert set(public) == {"image"} | keys
  np.testing.assert_array_equal(public["caption"], w_public["caption"])
  for space in (bert, distilbert):
    got = np.asarray(public[text_lib.caption_key(space)])
    np.testing.assert_array_equal(got, _ids(space, np.asarray(w_public["caption"])))
  # Two vocabularies: MiniLM's ids of the world's words are >= 1000, the tiny DistilBERT's < 80.
  words = lambda space: np.asarray(public[text_lib.caption_key(space)])[..., 1]
  assert words(bert).min() >= 1000 and words(distilbert).max() < 80


def test_a_round_with_three_token_spaces(checkpoints, tmp_path):
  bert, distilbert = checkpoints
  config = _config((bert, distilbert, "transformer_t"))
  config.methods = "fedmuscle,feddf,local"  # FedDF distils on the public set's captions too
  results = runner.run(config, tmp_path / "run", progress=False)
  scores = np.asarray(results["fedmuscle"] + results["feddf"] + results["local"], np.float64)
  assert scores.shape == (12,) and np.all(np.isfinite(scores))
  assert np.all(np.isfinite(results["deltas"]["fedmuscle"]))
  report = (tmp_path / "run" / "report.md").read_text()
  assert bert in report and distilbert in report
