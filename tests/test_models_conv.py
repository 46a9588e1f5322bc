"""The im2col convolution equals XLA's, and vmapping it over kernels equals a loop.

So do the explicitly padded (PyTorch-style) and depthwise forms SegFormer uses.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from fedjax_mm.models import conv


def _xla(x, kernel, stride):
  return jax.lax.conv_general_dilated(
    x, kernel, (stride, stride), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC")
  )


@pytest.mark.parametrize(
  "size,kernel,stride",
  [(8, 3, 1), (8, 3, 2), (7, 3, 2), (9, 1, 2), (6, 1, 1), (5, 5, 2), (6, 2, 2)],
)
def test_im2col_equals_xla_conv_and_its_gradients(size, kernel, stride, x64):
  rng = np.random.default_rng(size * 100 + kernel * 10 + stride)
  x = jnp.asarray(rng.normal(size=(2, size, size + 1, 3)))
  w = jnp.asarray(rng.normal(size=(kernel, kernel, 3, 4)))
  out = conv.conv2d(x, w, stride=stride)
  want = _xla(x, w, stride)
  assert out.shape == want.shape
  np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
  probe = jnp.asarray(rng.normal(size=want.shape))
  grads = jax.grad(lambda x, w: jnp.sum(probe * conv.conv2d(x, w, stride=stride)), (0, 1))(x, w)
  want_grads = jax.grad(lambda x, w: jnp.sum(probe * _xla(x, w, stride)), (0, 1))(x, w)
  for g, h in zip(grads, want_grads, strict=True):
    np.testing.assert_allclose(g, h, rtol=1e-12, atol=1e-12)


def test_vmap_over_kernels_equals_loop(x64):
  rng = np.random.default_rng(0)
  x = jnp.asarray(rng.normal(size=(5, 2, 8, 8, 3)))
  w = jnp.asarray(rng.normal(size=(5, 3, 3, 3, 4)))
  loss = lambda w, x: jnp.sum(jnp.sin(conv.conv2d(x, w, stride=2)))
  batched = jax.vmap(jax.value_and_grad(loss))(w, x)
  for k in range(5):
    single = jax.value_and_grad(loss)(w[k], x[k])
    np.testing.assert_allclose(batched[0][k], single[0], rtol=1e-12)
    np.testing.assert_allclose(batched[1][k], single[1], rtol=1e-12)


def test_module_matches_nnx_conv_parameters_and_output():
  ours = conv.Conv(3, 8, (3, 3), strides=2, rngs=nnx.Rngs(0))
  theirs = nnx.Conv(3, 8, (3, 3), strides=2, rngs=nnx.Rngs(0))
  ours_state, theirs_state = nnx.state(ours, nnx.Param), nnx.state(theirs, nnx.Param)
  assert jax.tree.map(jnp.shape, ours_state) == jax.tree.map(jnp.shape, theirs_state)
  nnx.update(ours, theirs_state)  # nnx.Conv's checkpoint loads into ours as is.
  x = jnp.asarray(np.random.default_rng(1).uniform(size=(2, 9, 9, 3)), jnp.float32)
  np.testing.assert_allclose(ours(x), theirs(x), rtol=1e-5, atol=1e-5)
  xla = conv.Conv(3, 8, (3, 3), strides=2, impl="xla", rngs=nnx.Rngs(0))
  nnx.update(xla, theirs_state)
  np.testing.assert_allclose(xla(x), theirs(x), rtol=1e-6, atol=1e-6)


def test_bad_input_is_a_clear_error():
  with pytest.raises(ValueError, match="impl must be one of"):
    conv.Conv(3, 4, (3, 3), impl="winograd", rngs=nnx.Rngs(0))
  with pytest.raises(ValueError, match="kernel expects 3 input channels"):
    conv.conv2d(jnp.zeros((1, 4, 4, 2)), jnp.zeros((3, 3, 3, 4)))


@pytest.mark.parametrize("kernel,stride,padding", [(7, 4, 3), (3, 2, 1), (2, 2, 0), (1, 1, 0)])
def test_explicit_padding_equals_xla(kernel, stride, padding, x64):
  """``padding=p`` pads ``p`` on every side, as PyTorch's ``Conv2d(padding=p)``."""
  rng = np.random.default_rng(kernel)
  x = jnp.asarray(rng.normal(size=(2, 11, 9, 3)))
  w = jnp.asarray(rng.normal(size=(kernel, kernel, 3, 5)))
  out = conv.conv2d(x, w, stride=stride, padding=padding)
  want = jax.lax.conv_general_dilated(
    x, w, (stride, stride), [(padding, padding)] * 2, dimension_numbers=("NHWC", "HWIO", "NHWC")
  )
  assert (
    out.shape
    == want.shape
    == (2, (11 + 2 * padding - kernel) // stride + 1, (9 + 2 * padding - kernel) // stride + 1, 5)
  )
  np.testing.assert_allclose(out, want, rtol=1e-12, atol=1e-12)
  np.testing.assert_allclose(conv.conv2d(x, w, stride=stride, padding=padding, impl="xla"), want)


def test_depthwise_equals_grouped_xla_conv(x64):
  rng = np.random.default_rng(1)
  x = jnp.asarray(rng.normal(size=(2, 7, 6, 4)))
  w = jnp.asarray(rng.normal(size=(3, 3, 1, 4)))
  want = jax.lax.conv_general_dilated(
    x,
    w,
    (1, 1),
    [(1, 1), (1, 1)],
    dimension_numbers=("NHWC", "HWIO", "NHWC"),
    feature_group_count=4,
  )
  np.testing.assert_allclose(conv.depthwise_conv2d(x, w, padding=1), want, rtol=1e-12, atol=1e-12)


def test_im2col_materialises_its_input_before_copying_views_on_accelerators(monkeypatch):
  """The barrier that keeps XLA from fusing the producer into every view's copy.

  It changes no value (the tests above compare with XLA's convolution); it made a vmapped
  ``cnn_s`` round 1.08-1.22x faster on a GPU and nothing faster on a CPU (see the module
  docstring). A test cannot time that here, so it checks the barrier is in the lowered
  convolution and its gradient, once each, when the backend is an accelerator, and absent on
  a CPU and from ``impl="xla"``.
  """
  x, w = jnp.ones((2, 8, 8, 3)), jnp.ones((3, 3, 3, 4))

  def barriers(impl):
    fn = jax.grad(lambda x, w: jnp.sum(conv.conv2d(x, w, stride=2, impl=impl) ** 2), (0, 1))
    return jax.jit(fn).lower(x, w).as_text().count("stablehlo.optimization_barrier")

  monkeypatch.setattr(jax, "default_backend", lambda: "cpu")
  assert barriers("im2col") == 0
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert barriers("im2col") == 2  # the padded input, and its cotangent in the backward pass
  assert barriers("xla") == 0
  # On the padded input (the padding left out of the views' copies, 1.07x in bfloat16 on an
  # H200): "SAME" with stride 2 pads the 8x8 images to 9x9.
  fn = lambda x, w: conv.conv2d(x, w, stride=2)  # noqa: E731
  (barrier,) = [
    line
    for line in jax.jit(fn).lower(x, w).as_text().splitlines()
    if "optimization_barrier" in line
  ]
  assert "tensor<2x9x9x3xf32>" in barrier, barrier
