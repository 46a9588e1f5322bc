"""One process of the multi-process FedAvg test (started by test_distributed.py).

  python tests/distributed_worker.py PROCESS_ID NUM_PROCESSES DEVICES_PER_PROCESS PORT OUT.npz

Every process builds the same group and data from the same seeds, places them
on the ``clients`` mesh over every process's devices (``core.job_mesh``; each
process supplies, and holds, its own devices' slices),
runs one FedAvg round with client sampling, gathers the result and writes it.
"""

import json
import os
import pathlib
import sys
import zlib

process_id, num_processes, devices, port, out = sys.argv[1:]
process_id, num_processes, devices = int(process_id), int(num_processes), int(devices)
os.environ.pop("XLA_FLAGS", None)

import jax  # noqa: E402

jax.config.update("jax_platforms", "cpu")
jax.config.update("jax_num_cpu_devices", devices)
if num_processes > 1:
  jax.config.update("jax_cpu_collectives_implementation", "gloo")
  jax.distributed.initialize(
    f"127.0.0.1:{port}", num_processes, process_id, initialization_timeout=120
  )

import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from engine_toys import client_arrays, make_group  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402

from fedjax_mm import algorithms, core  # noqa: E402
from fedjax_mm.core import processes  # noqa: E402
from fedjax_mm.core.checkpoint import Checkpointer, DamagedCheckpointError  # noqa: E402

assert jax.device_count() == num_processes * devices, jax.devices()
sizes = (3, 7, 2, 9, 4, 6, 5, 8)
group, state = make_group(len(sizes), same_init=True)
arrays, mask = client_arrays(0, sizes)
data = core.make_client_data(arrays, mask, user_ids=np.arange(len(sizes)))
alg = algorithms.fedavg([group], clients_per_round=5)

# The runners' mesh: the first `devices` devices of every process, here all of them.
mesh = core.job_mesh(devices)
assert list(mesh.devices.flat) == jax.devices(), mesh
fed_state = alg.init([state], jax.random.key(1)).place(mesh)
data = data.place(mesh)
# Each process holds only its own devices' clients: 8 / (processes * devices) each.
for leaf in jax.tree.leaves(fed_state.groups[0].params):
  shards = leaf.addressable_shards
  assert len(shards) == devices, shards
  assert all(s.data.shape[0] == len(sizes) // jax.device_count() for s in shards), shards
round_fn = core.jit_round(alg.round, fed_state, donate=False)
for _ in range(2):
  fed_state, stats = round_fn(fed_state, [data])
# What the runners read on the host: split leaves gathered whole (NumPy), replicated ones
# as this process's copy, typed keys as keys; with one process, the tree itself.
params, active, keys, server = processes.gather(
  (fed_state.groups[0].params, stats["tiny"]["active"], fed_state.groups[0].rng, fed_state.round)
)
if num_processes > 1:
  assert isinstance(active, np.ndarray) and active.shape == (len(sizes),), active
  assert isinstance(server, jax.Array) and server.is_fully_addressable, server.sharding
  assert jax.dtypes.issubdtype(keys.dtype, jax.dtypes.prng_key) and keys.shape == (len(sizes),)
expected = multihost_utils.process_allgather(
  jax.random.key_data(fed_state.groups[0].rng), tiled=True
)
np.testing.assert_array_equal(jax.random.key_data(keys), expected)
assert int(server) == 2
leaves = {
  "/".join(str(getattr(k, "key", k)) for k in path): np.asarray(v)
  for path, v in jax.tree_util.tree_leaves_with_path(params)
}

# A checkpoint of the job's arrays: leaves split over the processes (a kernel, typed keys)
# and one replicated over them all restore onto their shardings, each with the CRC-32 of
# its global value, which no process held whole (the split ones' from their pieces).
kernel = next(x for x in jax.tree.leaves(fed_state.groups[0].params) if x.ndim == 3)
tree = {
  "split": kernel,
  "keys": fed_state.groups[0].rng,
  "replicated": core.replicate(jnp.arange(6.0).reshape(2, 3), mesh),
}
with Checkpointer(pathlib.Path(out).parent / f"ckpt-{num_processes}") as checkpointer:
  checkpointer.save(1, tree)
  checkpointer.wait()
  restored = checkpointer.restore(tree, 1)  # onto the shardings of the arrays saved
  checksums = checkpointer.directory / "1" / "checksums" / "metadata"
  summed = json.loads(checksums.read_text())
  assert restored["split"].sharding == kernel.sharding, restored["split"].sharding

  def host(tree):  # Every leaf whole, as NumPy; typed keys as their key data.
    tree = processes.gather(tree)
    return {
      name: np.asarray(jax.random.key_data(x) if name == "keys" else x) for name, x in tree.items()
    }

  whole = host(tree)
  for name, x in host(restored).items():
    np.testing.assert_array_equal(x, whole[name], err_msg=name)
  for name, x in whole.items():
    want = {"dtype": str(x.dtype), "shape": list(x.shape), "crc32": zlib.crc32(x.tobytes())}
    assert summed["state"][f"['{name}']"] == want, (name, summed["state"], want)
  # A piece read back wrong fails the restore in every process: here, the record altered.
  processes.sync("checked")
  if process_id == 0:
    summed["state"]["['split']"]["crc32"] ^= 1
    checksums.write_text(json.dumps(summed))
  processes.sync("altered")
  try:
    checkpointer.restore(tree, 1)
    raise AssertionError("a wrong CRC-32 of a split array went unnoticed")
  except DamagedCheckpointError as e:
    assert "array ['split'] of step 1" in str(e), e

if process_id == 0:
  np.savez(out, active=np.asarray(active), **leaves)
print(f"process {process_id}: {jax.device_count()} devices, done", flush=True)
