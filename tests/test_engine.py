"""Equivalences of the client engine: vmapped == looped, padded == unpadded, sharded == unsharded."""

import dataclasses
import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import rounding
from engine_toys import TASK, client_arrays, make_group
from jax.sharding import PartitionSpec as P

from fedjax_mm import algorithms, core, server
from fedjax_mm import data as data_lib
from fedjax_mm.algorithms import creamfl
from fedjax_mm.core import cost, processes
from fedjax_mm.core import faults as faults_lib

SIZES = (5, 11, 1, 8)


def _data(sizes=SIZES, n_max=None, seed=0, user_ids=None):
  arrays, mask = client_arrays(seed, sizes, n_max)
  return core.make_client_data(
    arrays, mask, user_ids=user_ids if user_ids is not None else np.arange(len(sizes))
  )


def _take(tree, k):
  return jax.tree.map(lambda x: x[k], tree)


@functools.cache
def _train(group):
  return jax.jit(functools.partial(core.train_group, group))


def test_vmapped_round_equals_loop_over_clients():
  group, state = make_group(len(SIZES))
  data = _data()
  trained, stats = _train(group)(state, data)

  single = jax.jit(
    lambda p, o, r, a, m: core.local_update(
      core.supervised_objective(group, state.shared),
      group.tx,
      p,
      o,
      r,
      a,
      m,
      num_epochs=2,
      batch_size=4,
    )
  )
  for k, n in enumerate(SIZES):
    params, opt_state, rng, client_stats = single(
      _take(state.params, k),
      _take(state.opt_state, k),
      state.rng[k],
      _take(data.arrays, k),
      data.sample_mask[k],
    )
    chex.assert_trees_all_close(params, _take(trained.params, k), rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(opt_state, _take(trained.opt_state, k), rtol=1e-5, atol=1e-6)
    assert jax.random.key_data(rng).tolist() == jax.random.key_data(trained.rng[k]).tolist()
    # E = 2 epochs of ceil(n / b) steps each: small clients are not over-trained.
    assert int(client_stats["steps"]) == int(stats["steps"][k]) == 2 * -(-n // 4)


def test_training_reduces_the_loss():
  group, state = make_group(len(SIZES))
  data = _data()
  before = core.evaluate_group(group, state, data)
  for _ in range(20):
    state, _ = _train(group)(state, data)
  after = core.evaluate_group(group, state, data)
  assert float(after["loss"][1]) < 0.5 * float(before["loss"][1])
  assert float(after["accuracy"][1]) > float(before["accuracy"][1])


def test_padded_samples_and_padding_clients_change_nothing():
  group, state = make_group(len(SIZES))
  trained, _ = _train(group)(state, _data())

  # Same clients, samples padded from 11 to 16, plus two padding clients.
  padded_group, padded_state = make_group(len(SIZES) + 2)
  padded_state = jax.tree.map(lambda full, s: full.at[: len(SIZES)].set(s), padded_state, state)
  padded_state = padded_state.replace(shared=state.shared)
  arrays, mask = client_arrays(0, SIZES + (0, 0), n_max=16)
  client_mask = np.array([True] * len(SIZES) + [False, False])
  padded_data = core.make_client_data(arrays, mask, user_ids=np.arange(6), client_mask=client_mask)
  padded_trained, stats = _train(padded_group)(padded_state, padded_data)

  # Two compiled programs (other shapes) of the same arithmetic: equal at float32 rounding.
  rounding.assert_close(_take(padded_trained.params, slice(0, len(SIZES))), trained.params)
  chex.assert_trees_all_equal(
    _take(padded_trained.params, slice(len(SIZES), None)),
    _take(padded_state.params, slice(len(SIZES), None)),
  )
  assert stats["steps"][len(SIZES) :].tolist() == [0, 0]
  assert padded_data.user_ids.tolist()[-2:] == [-1, -1]


@pytest.mark.parametrize("client_map", ["scan", "map:3", "map:8"])
def test_every_client_map_equals_vmap(client_map):
  """scan and chunked lax.map train each client as vmap does (3 does not divide 4)."""
  group, state = make_group(len(SIZES))
  data = _data()
  expected, expected_stats = _train(dataclasses.replace(group, client_map="vmap"))(state, data)
  got, stats = _train(dataclasses.replace(group, client_map=client_map))(state, data)
  chex.assert_trees_all_close(got.params, expected.params, rtol=1e-5, atol=1e-6)
  chex.assert_trees_all_close(got.opt_state, expected.opt_state, rtol=1e-5, atol=1e-6)
  assert stats["steps"].tolist() == expected_stats["steps"].tolist()
  assert jax.random.key_data(got.rng).tolist() == jax.random.key_data(expected.rng).tolist()


def test_client_map_auto_and_bad_specs():
  # Several (fake) CPU devices and no mesh in context: the compiler may shard the
  # client axis, where a loop would run whole on every device, so vmap.
  assert core.resolve_client_map("auto") == "vmap"
  # With a clients mesh in context, a loop per device: scan on the CPU.
  with jax.set_mesh(core.client_mesh()):
    assert core.resolve_client_map("auto") == "scan"
    assert core.client.context_clients() == 8
  assert core.resolve_client_map("map:4") == "map:4"
  for bad in ("map:0", "map:", "pmap", "map:x", ""):
    with pytest.raises(ValueError, match="client_map"):
      core.parse_client_map(bad)
  with pytest.raises(ValueError, match="client_map"):
    make_group_with_map("loop")


def make_group_with_map(client_map):
  return core.init_group(
    lambda rngs: None,
    name="x",
    tx=optax.sgd(0.1),
    task=TASK,
    key=jax.random.key(0),
    num_clients=1,
    client_map=client_map,
  )


def test_sharded_round_equals_unsharded():
  assert jax.device_count() == 8
  sizes = (3, 7, 2, 9, 4, 6, 5, 8)
  group, state = make_group(len(sizes))
  data = _data(sizes)
  alg = algorithms.fedavg([group], clients_per_round=5)
  fed_state = alg.init([state], jax.random.key(1))
  round_fn = jax.jit(alg.round)
  expected, _ = round_fn(fed_state, [data])

  mesh = core.client_mesh()
  sharded_state = fed_state.place(mesh)
  sharded_data = [data.place(mesh)]
  got, _ = core.jit_round(alg.round, sharded_state, donate=False)(sharded_state, sharded_data)
  leaf = jax.tree.leaves(got.groups[0].params)[0]
  assert leaf.sharding.spec[0] == "clients" and len(leaf.sharding.device_set) == 8
  chex.assert_trees_all_close(got.groups[0].params, expected.groups[0].params, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("client_map", ["scan", "map:3", "auto"])
def test_a_loop_over_clients_runs_on_each_device_over_its_own_clients(client_map):
  """Under jit_round, a compiled loop over clients is split over the mesh.

  8 clients on 2 devices: the traced loop runs over a device's 4 clients (not
  all 8), vmapped over the 2 devices, and the compiled program of each device
  carries one device's share through it (its clients' kernels ``[4, 1, ...]``);
  the round equals the unsharded one.
  """
  sizes = (3, 7, 2, 9, 4, 6, 5, 8)
  group, state = make_group(len(sizes))
  group = dataclasses.replace(group, client_map=client_map)
  data = _data(sizes)
  alg = algorithms.fedavg([group], clients_per_round=5)
  fed_state = alg.init([state], jax.random.key(1))
  expected, expected_stats = jax.jit(alg.round)(fed_state, [data])

  mesh = core.client_mesh(2)
  sharded_state = fed_state.place(mesh)
  sharded_data = [data.place(mesh)]
  round_fn = core.jit_round(alg.round, sharded_state, donate=False)
  jaxpr = round_fn.trace(sharded_state, sharded_data).jaxpr.jaxpr
  per_device = 4 if client_map != "map:3" else 1  # map:3: one chunk of 3, then the 4th
  lengths = {e.params["length"] for e in cost.equations(jaxpr, "scan")}
  assert per_device in lengths and len(sizes) not in lengths
  if client_map != "map:3":
    hlo = round_fn.lower(sharded_state, sharded_data).compile().as_text()
    kernel = jax.tree.leaves(state.params)[-1].shape[1:]  # the head's [8, 3]
    loops = [line for line in hlo.splitlines() if " while(" in line]
    assert any(f"f32[4,1,{kernel[0]},{kernel[1]}]" in line for line in loops)
    assert not any(f"f32[4,2,{kernel[0]},{kernel[1]}]" in line for line in loops)
  got, stats = round_fn(sharded_state, sharded_data)
  chex.assert_trees_all_close(got.groups[0].params, expected.groups[0].params, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(stats["tiny"]["loss"], expected_stats["tiny"]["loss"], rtol=1e-5)
  assert stats["tiny"]["steps"].tolist() == expected_stats["tiny"]["steps"].tolist()


def test_a_loop_per_device_reads_what_the_clients_close_over():
  """A client function that gathers, by its own indices, from an array of the enclosing
  round (as CreamFL's clients read the server's representations) runs per device and
  gives what one device gives (a manual shard_map region rejected this gather)."""
  mesh = core.client_mesh(2)
  table = core.replicate(jnp.arange(40.0).reshape(10, 4), mesh)
  x = core.shard_clients(jnp.arange(24.0).reshape(8, 3), mesh)
  index = core.shard_clients(jnp.arange(16).reshape(8, 2) % 10, mesh)

  def round_fn(x, index, table):
    doubled = table * 2.0  # traced in the round, closed over by the clients

    def client(a, i):
      return a.sum() + doubled[i].sum()

    return x, core.map_clients(client, (x, index), "scan")

  _, got = core.jit_round(round_fn, x, donate=False)(x, index, table)
  expected = np.asarray(x).sum(1) + 2 * np.asarray(table)[np.asarray(index)].sum((1, 2))
  np.testing.assert_allclose(got, expected)


def test_a_sharded_loop_needs_a_padded_group_and_one_mesh():
  fn = lambda x: x + 1
  with jax.set_mesh(core.client_mesh()):
    with pytest.raises(ValueError, match="5 clients do not split over the 8 devices"):
      jax.jit(lambda x: core.map_clients(fn, (x,), "scan"))(jnp.zeros((5, 2)))
    # Nested in a shard_map over clients, the axis is this device's: a plain loop.
    inner = jax.shard_map(
      lambda x: core.map_clients(lambda v: v * core.client.context_clients(), (x,), "scan"),
      in_specs=P("clients"),
      out_specs=P("clients"),
    )
    assert jax.jit(inner)(jnp.ones((8, 2))).tolist() == [[1.0, 1.0]] * 8
  state = {
    "a": core.shard_clients(jnp.zeros((8,)), core.client_mesh()),
    "b": core.shard_clients(jnp.zeros((8,)), core.client_mesh(2)),
  }
  with pytest.raises(ValueError, match="2 different meshes"):
    core.jit_round(lambda s: (s, {}), state)


def test_group_is_padded_to_the_mesh():
  mesh = core.client_mesh()
  assert core.padded_size(5, mesh) == 8
  assert core.padded_size(17, mesh) == 24
  with pytest.raises(ValueError, match="multiple of 8"):
    core.shard_clients({"x": jnp.zeros((5, 2))}, mesh)


def test_padding_appends_clients_that_hold_nothing():
  """``ClientData.pad`` as ``data.pad_clients`` pads; ``ClientState.pad`` keeps the real clients."""
  arrays, mask = client_arrays(0, [3, 1, 2])
  real = core.make_client_data(arrays, mask, user_ids=np.arange(3))
  padded = real.pad(4)
  stacked, pmask, cmask = data_lib.pad_clients(arrays, mask, multiple=4)
  chex.assert_trees_all_equal(
    padded, core.make_client_data(stacked, pmask, user_ids=[0, 1, 2, 3], client_mask=cmask)
  )
  assert padded.user_ids.tolist() == [0, 1, 2, -1] and padded.num_samples.tolist() == [3, 1, 2, 0]
  assert real.pad(3) is real
  _, state = make_group(3)
  grown = state.pad(5)
  for x, y in zip(jax.tree.leaves(state.params), jax.tree.leaves(grown.params), strict=True):
    np.testing.assert_array_equal(y, np.concatenate([x, x[:1], x[:1]]))
  keys = jax.random.key_data(grown.rng)
  np.testing.assert_array_equal(keys[:3], jax.random.key_data(state.rng))
  assert len({tuple(k) for k in np.asarray(keys)}) == 5  # every client its own key
  with pytest.raises(ValueError, match="cannot pad 3 clients to 2"):
    state.pad(2)
  with pytest.raises(ValueError, match="asked for 9 devices, this process has 8"):
    core.local_mesh(9)
  assert core.local_mesh(2).devices.tolist() == jax.local_devices()[:2]
  # One process: the runners' mesh is this process's (two processes: tests/test_distributed.py).
  assert core.job_mesh(2).devices.tolist() == jax.local_devices()[:2]
  with pytest.raises(ValueError, match="asked for 9 devices, this process has 8"):
    core.job_mesh(9)
  tree = {"a": jnp.ones(3), "b": np.zeros(2)}
  assert processes.gather(tree) is tree  # One process: nothing to gather.


def test_round_compiles_once():
  group, state = make_group(len(SIZES), same_init=True)
  data = _data()
  alg = algorithms.fedavg([group], clients_per_round=2)
  traced = chex.assert_max_traces(alg.round, n=1)
  round_fn = jax.jit(traced, donate_argnums=0)
  fed_state = alg.init([state], jax.random.key(0))
  for _ in range(3):
    fed_state, _ = round_fn(fed_state, [data])
  assert int(fed_state.round) == 3


def _softmax(z):
  e = np.exp(z - z.max(-1, keepdims=True))
  return e / e.sum(-1, keepdims=True)


def test_fedavg_matches_hand_computation():
  # Two clients of a linear softmax classifier, one full-batch SGD step each.
  sizes = (3, 5)
  group, state = make_group(2, same_init=True, batch_size=8, local_epochs=1, tx=optax.sgd(0.5))
  data = _data(sizes, seed=3)
  alg = algorithms.fedavg([group])
  new_state, _ = jax.jit(alg.round)(alg.init([state], jax.random.key(0)), [data])

  params = jax.tree.map(lambda x: np.asarray(x[0], np.float64), state.params)
  w1, b1 = params["hidden"]["kernel"], params["hidden"]["bias"]
  w2, b2 = params["out"]["kernel"], params["out"]["bias"]
  updated = []
  for k, n in enumerate(sizes):
    x = np.asarray(data.arrays["x"][k, :n], np.float64)
    y = np.asarray(data.arrays["y"][k, :n])
    h_pre = x @ w1 + b1
    h = np.maximum(h_pre, 0)
    g_logits = (_softmax(h @ w2 + b2) - np.eye(3)[y]) / n
    g_w2, g_b2 = h.T @ g_logits, g_logits.sum(0)
    g_h = g_logits @ w2.T * (h_pre > 0)
    g_w1, g_b1 = x.T @ g_h, g_h.sum(0)
    updated.append([w1 - 0.5 * g_w1, b1 - 0.5 * g_b1, w2 - 0.5 * g_w2, b2 - 0.5 * g_b2])
  expected = [(3 * a + 5 * b) / 8 for a, b in zip(*updated, strict=True)]
  got = new_state.groups[0].params
  for k in range(2):  # Both clients hold the new global model.
    np.testing.assert_allclose(got["hidden"]["kernel"][k], expected[0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["hidden"]["bias"][k], expected[1], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["out"]["kernel"][k], expected[2], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(got["out"]["bias"][k], expected[3], rtol=1e-5, atol=1e-6)


def test_fedprox_proximal_term():
  group, state = make_group(1)
  data = _data((6,))
  params = _take(state.params, 0)
  center = jax.tree.map(lambda x: x + 0.1, params)
  base = core.supervised_objective(group, state.shared)
  prox = core.with_proximal_term(base, center, mu=0.3)
  batch = _take(data.arrays, 0)
  mask = data.sample_mask[0]
  key = jax.random.key(0)
  # Jitted: one compile each, where eager the MLP's forward and backward compiled a program
  # per op and shape.
  (loss, _), grad = jax.jit(jax.value_and_grad(base, has_aux=True))(params, batch, mask, key)
  (prox_loss, aux), prox_grad = jax.jit(jax.value_and_grad(prox, has_aux=True))(
    params, batch, mask, key
  )
  num_params = sum(x.size for x in jax.tree.leaves(params))
  np.testing.assert_allclose(prox_loss - loss, 0.5 * 0.3 * 0.01 * num_params, rtol=1e-4)
  np.testing.assert_allclose(aux["proximal"], prox_loss - loss, rtol=1e-5)
  chex.assert_trees_all_close(
    prox_grad, jax.tree.map(lambda g: g - 0.3 * 0.1, grad), rtol=1e-5, atol=1e-6
  )

  # In a round, a large mu keeps the local models near the global one.
  sizes = (6, 9, 4, 7)
  group, state = make_group(4, same_init=True)
  data = _data(sizes)
  drift = {}
  for mu in (0.0, 10.0):
    trained, _ = jax.jit(functools.partial(core.train_group, group, prox_mu=mu))(state, data)
    diff = jax.tree.map(lambda a, b: jnp.sum((a - b) ** 2), trained.params, state.params)
    drift[mu] = float(sum(jax.tree.leaves(diff)))
  assert drift[10.0] < 0.5 * drift[0.0]


def test_client_sampling():
  mask = jnp.array([True, True, False, True, True, True, False, True])
  for seed in range(5):
    chosen = server.sample_clients(jax.random.key(seed), mask, 3)
    assert int(chosen.sum()) == 3 and not bool(jnp.any(chosen & ~mask))
  counts = sum(
    np.asarray(server.sample_clients(jax.random.key(s), mask, 3), int) for s in range(600)
  )
  assert counts[2] == counts[6] == 0
  np.testing.assert_allclose(counts[mask], 600 * 3 / 6, rtol=0.15)
  assert int(server.sample_clients(jax.random.key(0), mask, 20).sum()) == 6


def test_padding_clients_move_no_draw():
  """Draws indexed by rank among the real clients: three groups of 2, 3 and 1 real clients,
  each padded to 4, draw for their real clients what the unpadded groups draw, whether the
  participants, the faults or CreamFL's partner matrices."""
  real = (2, 3, 1)
  compact = jnp.ones(sum(real), bool)
  padded = jnp.array([i < n for n in real for i in range(4)])
  where = np.flatnonzero(padded)  # the real clients' positions in the padded layout
  faults = faults_lib.Faults(dropout=0.34, stragglers=0.5, byzantine=0.25)
  for seed in range(20):
    key = jax.random.key(seed)
    np.testing.assert_array_equal(
      core.client_uniform(key, padded)[where], jax.random.uniform(key, compact.shape)
    )
    chosen = server.sample_clients(key, compact, 3)
    chosen_padded = server.sample_clients(key, padded, 3)
    np.testing.assert_array_equal(chosen_padded[where], chosen)
    assert not chosen_padded[~padded].any()
    masks = faults_lib.draw(key, chosen, faults)
    masks_padded = faults_lib.draw(key, chosen_padded, faults, client_mask=padded)
    for field in ("dropped", "straggler", "work", "byzantine"):
      np.testing.assert_array_equal(getattr(masks_padded, field)[where], getattr(masks, field))
    partners = creamfl.draw_local_partners(key, chosen, 2)
    partners_padded = creamfl.draw_local_partners(key, chosen_padded, 2, valid=padded)
    np.testing.assert_array_equal(where[np.asarray(partners)], partners_padded)
  # Without client_mask the faults are drawn by position, and the padding moves them.
  moved = [
    faults_lib.draw(jax.random.key(s), padded, faults).dropped[where].tolist()
    != faults_lib.draw(jax.random.key(s), compact, faults).dropped.tolist()
    for s in range(20)
  ]
  assert any(moved)


def test_fedavg_select_by_path_keeps_the_rest_personal():
  group, state = make_group(4)  # Different initialisations per client.
  weights = jnp.array([1.0, 2.0, 0.0, 1.0])
  new, aggregate = server.fedavg(state.params, weights, select=server.path_contains("out"))
  out_kernel = np.asarray(state.params["out"]["kernel"])
  expected = (out_kernel[0] + 2 * out_kernel[1] + out_kernel[3]) / 4
  np.testing.assert_allclose(aggregate["out"]["kernel"], expected, rtol=1e-6)
  np.testing.assert_allclose(new["out"]["kernel"][2], expected, rtol=1e-6)
  chex.assert_trees_all_equal(new["hidden"], state.params["hidden"])
  assert jax.tree.leaves(aggregate["hidden"]) == []


def test_fedavg_names_the_leaves_not_stacked_over_the_weights_clients():
  params = {"out": {"kernel": jnp.ones((4, 3, 2)), "bias": jnp.ones((3, 2))}, "step": jnp.ones(())}
  with pytest.raises(ValueError, match=r"K=4 .*: \['out'\]\['bias'\] \(3, 2\), \['step'\] \(\)\.$"):
    server.fedavg(params, jnp.ones(4))
  with pytest.raises(
    ValueError, match=r"weights must be \[K\], one per client, got shape \(4, 1\)"
  ):
    server.weighted_mean(params["out"]["kernel"], jnp.ones((4, 1)))
  # Leaves the predicate leaves out are each client's own: their shapes are not checked.
  _, aggregate = server.fedavg(params, jnp.ones(4), select=lambda path: "kernel" in str(path))
  np.testing.assert_array_equal(aggregate["out"]["kernel"], np.ones((3, 2)))


def test_evaluate_metrics_match_numpy():
  group, state = make_group(len(SIZES))
  data = _data()
  got = core.evaluate_group(group, state, data)
  for k, n in enumerate(SIZES):
    model = group.merge(_take(state.params, k), state.shared)
    logits = np.asarray(model(data.arrays["x"][k, :n]))
    labels = np.asarray(data.arrays["y"][k, :n])
    np.testing.assert_allclose(got["accuracy"][k], np.mean(logits.argmax(-1) == labels), rtol=1e-6)
    log_probs = logits - np.log(np.exp(logits).sum(-1, keepdims=True))
    np.testing.assert_allclose(got["loss"][k], -np.mean(log_probs[np.arange(n), labels]), rtol=1e-5)


@pytest.mark.parametrize("batch_size", [1, 3, 7, 100])
def test_apply_in_batches_equals_one_call_on_arrays_and_pytrees(batch_size):
  """Minibatches of at most ``batch_size`` rows (the last padded) give ``fn`` of the whole."""
  x = {"a": jnp.arange(21.0).reshape(7, 3), "b": jnp.arange(7) % 3}
  seen = []

  def fn(batch):
    seen.append(batch["a"].shape[0])
    return batch["a"].sum(-1) * batch["b"], {"rows": batch["a"] ** 2}

  got = core.client.apply_in_batches(fn, x, batch_size)
  want = fn(x)
  chex.assert_trees_all_equal(got, want)
  assert seen[0] == min(batch_size, 7)  # the traced minibatch, before the whole call
  np.testing.assert_array_equal(
    core.client.apply_in_batches(lambda r: r * 2, x["a"], batch_size), x["a"] * 2
  )
  with pytest.raises(ValueError, match="one leading size"):
    core.client.apply_in_batches(fn, {"a": x["a"], "b": jnp.arange(5)}, batch_size)
  with pytest.raises(ValueError, match="one leading size"):  # a scalar first leaf
    core.client.apply_in_batches(fn, {"a": jnp.float32(1), "b": x["b"]}, batch_size)


def test_task_validation():
  with pytest.raises(ValueError, match="unknown task kind"):
    core.Task(kind="regression", input_key="x", target_key="y", num_outputs=1)
  assert TASK.metric_name == "accuracy"


def test_finite_per_client_names_the_diverged_client():
  tree = {"w": jnp.ones((3, 2, 2)), "b": jnp.zeros((3, 4))}
  tree["b"] = tree["b"].at[1, 2].set(jnp.nan)
  tree["w"] = tree["w"].at[2, 0, 1].set(jnp.inf)
  np.testing.assert_array_equal(core.finite_per_client(tree), [True, False, False])
