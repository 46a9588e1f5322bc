"""FLOPs from XLA's cost analysis: what is counted, and each method's split users / server."""

import functools
import math

import jax
import jax.numpy as jnp
import pytest

from experiments import fedmuscle as fedmuscle_config
from fedjax_mm.algorithms import cost, fedmuscle
from fedjax_mm.core.cost import flops, matrix_products
from fedjax_mm.runner import fedmuscle as runner


@pytest.mark.parametrize("m,k,n", [(8, 16, 4), (3, 5, 7), (32, 256, 32)])
def test_a_matmul_counts_two_m_n_k(m, k, n):
  a, b = jax.ShapeDtypeStruct((m, k), jnp.float32), jax.ShapeDtypeStruct((k, n), jnp.float32)
  assert flops(jnp.matmul, a, b) == 2 * m * n * k


def test_a_loop_body_counts_once():
  # Why algorithms/cost.py counts one step and multiplies: XLA ignores the trip count.
  a = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  w = jax.ShapeDtypeStruct((16, 16), jnp.float32)
  chained = lambda a, w: jax.lax.fori_loop(0, 10, lambda i, x: x @ w, a)
  assert 2 * 8 * 16 * 16 <= flops(chained, a, w) < 2 * (2 * 8 * 16 * 16)


def _split(loss, batch=8, partners=2, dim=16):
  """(user FLOPs: loss and gradient w.r.t. Z^n; server FLOPs: its targets) of one user."""
  mc = fedmuscle.MuscleConfig(num_partners=partners, batch_size=batch, loss=loss)
  z = jax.ShapeDtypeStruct((batch, dim), jnp.float32)
  others = jax.ShapeDtypeStruct((partners, batch, dim), jnp.float32)
  server = functools.partial(fedmuscle.server_targets, mc)
  targets = jax.eval_shape(server, others)
  user = jax.value_and_grad(fedmuscle.user_loss(mc))
  return flops(user, z, targets), flops(server, others)


def test_gramian_costs_the_user_more_than_muscle():
  # On this tiny setting (B = 8, M = 2, d = 16) only. The Muscle user's exp-domain
  # contraction grows as B^(M+1), the Gramian's determinants as B^2 (M+1)^3: at the
  # default B = 32, M = 3, d = 256 XLA counts the Muscle user's loss and gradient at
  # 7.7 MFLOPs per batch and the Gramian's at 3.7 (both far below the encoder's).
  muscle_user, muscle_server = _split("muscle")
  gramian_user, gramian_server = _split("gramian")
  assert gramian_user > muscle_user > 0
  assert muscle_server > 0  # the partners' terms: the server's work
  assert gramian_server == 0  # the server only forwards the partners' Z^m


def test_method_costs_split_users_and_server():
  config = fedmuscle_config.get_config("smoke")
  users, groups, states, train, _, public, _ = runner.build(config)
  archs = tuple(runner._architecture(config, u) for u in users)
  methods = ["fedmuscle", "sage", "cofed", "simclr", "pseudo_label", "local"]
  costs = cost.method_costs(config, methods, groups, states, train, public, architectures=archs)
  local, muscle = costs["local"], costs["fedmuscle"]
  assert local.server == 0 and muscle.server > 0
  assert all(m > loc > 0 for m, loc in zip(muscle.users, local.users, strict=True))
  # Same task, different encoders (users 1 and 3 are cnn_s, user 2 a vit_t): different costs.
  assert local.users[0] != local.users[1]
  assert costs["fedmuscle"].to_dict()["users_total"] == sum(muscle.users)
  for alone in ("simclr", "pseudo_label"):  # no server; more work than local training
    assert costs[alone].server == 0
    assert all(a > loc for a, loc in zip(costs[alone].users, local.users, strict=True))
  # SAGE: every smoke user is alone in its task, so its server averages nothing; CoFED's
  # server tallies votes. Both users do more than local training (public steps, labelling).
  assert costs["sage"].server == 0 and costs["cofed"].server > 0
  for m in ("sage", "cofed"):
    assert all(a > loc for a, loc in zip(costs[m].users, local.users, strict=True)), m


def test_matrix_products_lists_a_scan_bodys_products_once_with_their_gradients():
  # One product in a 5-step scan, differentiated with respect to the matrix: the forward
  # product, and in the backward scan the kernel's and the carried input's gradients.
  a = jax.ShapeDtypeStruct((8, 16), jnp.float32)
  w = jax.ShapeDtypeStruct((16, 4), jnp.float32)

  def loss(w, a):
    return jax.lax.scan(lambda x, _: (jnp.tanh(x @ w) @ w.T, None), a, None, length=5)[0].sum()

  found = matrix_products(jax.grad(loss), w, a)
  shapes = sorted((p["lhs"].shape, p["rhs"].shape, p["dimension_numbers"][0]) for p in found)
  # Forward: x @ w and y @ w.T; backward: two products per forward product (w's gradient
  # and x's), all read once although each runs 5 times.
  assert len(found) == 6
  assert ((8, 16), (16, 4), ((1,), (0,))) in shapes  # x @ w
  assert all(p["lhs"].dtype == jnp.float32 for p in found)

  # The products listed account for XLA's count of the same function but its elementwise
  # work (tanh and its derivative, the sum: 263 FLOPs), which is less than half of the
  # smallest product (1,024): one product missing, or one too many, would fail this.
  def product_flops(p):
    (contracted, _), _ = p["dimension_numbers"]
    out = jax.eval_shape(
      lambda lhs, rhs: jax.lax.dot_general(lhs, rhs, p["dimension_numbers"]), p["lhs"], p["rhs"]
    )
    return 2 * math.prod(out.shape) * math.prod(p["lhs"].shape[i] for i in contracted)

  listed = sum(product_flops(p) for p in found)
  assert listed == 6 * 2 * 8 * 16 * 4
  assert listed <= flops(jax.grad(loss), w, a) < listed + 8 * 16 * 4


def test_matrix_products_enters_jit_and_custom_jvp():
  inner = jax.jit(lambda a, b: a @ b)
  relu = jax.nn.relu  # a custom_jvp in jax.nn
  fn = lambda a, b: relu(inner(a, b)) @ b.T
  a, b = jnp.ones((3, 5)), jnp.ones((5, 7))
  shapes = [(p["lhs"].shape, p["rhs"].shape) for p in matrix_products(fn, a, b)]
  assert shapes == [((3, 5), (5, 7)), ((3, 7), (7, 5))]
