"""Table 1's FedAvg / FedIoT on CreamFL's clients: the public set, the towers, their average."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import creamfl as creamfl_config
from fedjax_mm import core
from fedjax_mm.algorithms import creamfl, creamfl_fedavg
from fedjax_mm.runner import creamfl as runner


def _group(modalities):
  return creamfl.ClientGroup(group=None, modalities=modalities)


def test_client_towers_map_server_attributes_to_the_clients():
  assert creamfl_fedavg.client_towers(_group(("image",))) == {
    "image": {"image_encoder": "encoder", "image_projector": "projector"}
  }
  assert creamfl_fedavg.client_towers(_group(("text",))) == {
    "text": {"text_encoder": "encoder", "text_projector": "projector"}
  }
  both = creamfl_fedavg.client_towers(_group(("image", "text")))
  assert both["text"] == {"text_encoder": "text_encoder", "text_projector": "text_projector"}


def test_with_public_appends_the_public_set_to_every_real_client():
  rng = np.random.default_rng(0)
  images = rng.normal(size=(3, 4, 2, 2, 3)).astype(np.float32)
  captions = rng.integers(0, 9, size=(3, 4, 5, 6)).astype(np.int32)
  mask = np.array([[1, 1, 1, 0], [1, 1, 0, 0], [1, 1, 1, 1]], bool)
  data = core.make_client_data(
    {"image": images, "caption": captions},
    mask,
    user_ids=np.arange(3),
    client_mask=np.array([True, True, False]),  # the third is padding
  )
  public = {
    "image": jnp.asarray(rng.normal(size=(7, 2, 2, 3)), jnp.float32),
    "caption": jnp.asarray(rng.integers(0, 9, size=(7, 5, 6)), jnp.int32),
  }
  out = creamfl_fedavg.with_public(data, public)
  np.testing.assert_array_equal(np.asarray(out.num_samples), [3 + 7, 2 + 7, 0])
  for key in ("image", "caption"):
    got = np.asarray(out.arrays[key])
    assert got.shape == (3, 4 + 7) + data.arrays[key].shape[2:]
    assert got.dtype == data.arrays[key].dtype
    np.testing.assert_array_equal(got[:, :4], np.asarray(data.arrays[key]))
    for k in range(3):
      np.testing.assert_array_equal(got[k, 4:], np.asarray(public[key]))


def test_receive_sends_the_server_towers_to_the_active_clients_only():
  rng = np.random.default_rng(1)
  k = 3
  params = {
    "encoder": {"w": jnp.asarray(rng.normal(size=(k, 2, 3)))},
    "projector": {"w": jnp.asarray(rng.normal(size=(k, 3)))},
    "head": {"w": jnp.asarray(rng.normal(size=(k, 4)))},
  }
  server = {
    "image_encoder": {"w": jnp.asarray(rng.normal(size=(2, 3)))},
    "image_projector": {"w": jnp.asarray(rng.normal(size=(3,)))},
  }
  names = {"image_encoder": "encoder", "image_projector": "projector"}
  active = jnp.array([True, False, True])
  out = creamfl_fedavg.receive(params, server, names, active)
  for s, c in names.items():
    for i in range(k):
      want = server[s]["w"] if active[i] else params[c]["w"][i]
      np.testing.assert_array_equal(np.asarray(out[c]["w"][i]), np.asarray(want))
  np.testing.assert_array_equal(np.asarray(out["head"]["w"]), np.asarray(params["head"]["w"]))


@pytest.mark.parametrize("image_weights", [[2.0, 0.0, 5.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
def test_average_towers_is_the_weighted_mean_per_modality(image_weights):
  """Against a loop over clients; a modality nobody sent keeps the server's tower."""
  rng = np.random.default_rng(2)

  def tree(prefix, k):
    shape = () if k is None else (k,)
    return {
      f"{prefix}_encoder": {"w": jnp.asarray(rng.normal(size=shape + (2, 3)), jnp.float32)},
      f"{prefix}_projector": {"b": jnp.asarray(rng.normal(size=shape + (3,)), jnp.float32)},
    }

  server = tree("image", None) | tree("text", None)
  # Image towers from an image group (2 clients) and a multimodal group (2); text from the latter.
  towers = {"image": [tree("image", 2), tree("image", 2)], "text": [tree("text", 2)]}
  w_image = np.asarray(image_weights, np.float32)
  w_text = np.array([0.0, 3.0], np.float32)
  weights = {"image": [w_image[:2], w_image[2:]], "text": [w_text]}
  out, received = creamfl_fedavg.average_towers(server, towers, weights)
  for m, w in (("image", w_image), ("text", w_text)):
    for name in creamfl_fedavg.TOWERS[m]:
      (leaf,) = server[name]
      clients = np.concatenate([np.asarray(t[name][leaf]) for t in towers[m]])
      want = np.asarray(server[name][leaf])
      if w.sum() > 0:
        want = sum(w[c] * clients[c] for c in range(len(w))) / w.sum()
      np.testing.assert_allclose(np.asarray(out[name][leaf]), want, rtol=1e-6, atol=1e-6)
    assert int(received[m]) == int((w > 0).sum())


def test_round_averages_the_trained_towers_with_the_iot_factor():
  """One round on the smoke config: server towers == the weighted mean of the trained clients'."""
  config = creamfl_config.get_config("smoke")
  _, _, _, _, server_params, public, _, _ = runner.build(config)
  clients, states, data, _ = runner._client_groups(config, jax.random.key(0), server_size=True)
  data = tuple(
    creamfl_fedavg.with_public(d, public) if c.multimodal else d
    for c, d in zip(clients, data, strict=True)
  )
  cc = runner._cream_config(config)
  avg = creamfl_fedavg.fedavg_towers(clients, cc)
  step = jax.jit(lambda s, f: avg.round(s, data, f))
  start = avg.init(server_params, states, jax.random.key(1))
  servers, mixed = {}, set()
  for factor in (1.0, cc.iot_weight):
    state, stats = step(start, jnp.float32(factor))
    servers[factor] = state.server_params
    for m, server_names in creamfl_fedavg.TOWERS.items():
      rows, weights = [], []
      for c, g, g0, d, act in zip(
        clients, state.groups, start.groups, data, stats["active"], strict=True
      ):
        pairs = creamfl_fedavg.client_towers(c).get(m, {})
        act = np.asarray(act)
        for c_name in pairs.values():
          # Clients not selected keep their towers.
          for new, old in zip(
            jax.tree.leaves(g.params[c_name]), jax.tree.leaves(g0.params[c_name]), strict=True
          ):
            np.testing.assert_array_equal(np.asarray(new)[~act], np.asarray(old)[~act])
        if pairs:
          rows.append({s: g.params[cn] for s, cn in pairs.items()})
          n = np.asarray(d.num_samples, np.float64) * act
          weights.append(n * (factor if c.multimodal else 1.0))
          if act.any():
            mixed.add((m, c.multimodal))
      w = np.concatenate(weights)
      assert w.sum() > 0 and int(stats["received"][m]) == int((w > 0).sum())
      for name in server_names:
        stacked = [jax.tree.leaves(r[name]) for r in rows]
        for i, got in enumerate(jax.tree.leaves(state.server_params[name])):
          clients_leaf = np.concatenate([np.asarray(s[i], np.float64) for s in stacked])
          want = np.tensordot(w / w.sum(), clients_leaf, axes=1)
          np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-5)
  # FedIoT's factor moves a tower that uni-modal and multimodal clients both sent this round.
  moved = [m for m in creamfl_fedavg.TOWERS if {(m, True), (m, False)} <= mixed]
  assert moved  # this key selects such a modality (text: clients 3, 5 and 6)
  for m in moved:
    a, b = (jax.tree.leaves(servers[f][f"{m}_encoder"]) for f in (1.0, cc.iot_weight))
    assert any(not np.allclose(np.asarray(x), np.asarray(y)) for x, y in zip(a, b, strict=True))
