"""Two processes on the loopback interface compute the same FedAvg rounds as one."""

import os
import pathlib
import socket
import subprocess
import sys

import numpy as np

WORKER = pathlib.Path(__file__).with_name("distributed_worker.py")


def _free_port():
  with socket.socket() as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _run(num_processes, devices, out):
  env = dict(os.environ)
  env.pop("XLA_FLAGS", None)  # conftest's 8 fake devices are not for the workers.
  env["PYTHONPATH"] = os.pathsep.join(
    [str(WORKER.parent), str(WORKER.parent.parent), env.get("PYTHONPATH", "")]
  )
  port = str(_free_port())
  procs = [
    subprocess.Popen(
      [sys.executable, str(WORKER), str(i), str(num_processes), str(devices), port, str(out)],
      env=env,
      stdout=subprocess.PIPE,
      stderr=subprocess.STDOUT,
      text=True,
    )
    for i in range(num_processes)
  ]
  logs = []
  for p in procs:
    try:
      logs.append(p.communicate(timeout=240)[0])
    finally:
      p.kill()
  for p, log in zip(procs, logs, strict=True):
    assert p.returncode == 0, log[-3000:]
  return dict(np.load(out))


def test_two_processes_equal_one(tmp_path):
  single = _run(1, 1, tmp_path / "single.npz")
  multi = _run(2, 2, tmp_path / "multi.npz")
  assert sorted(single) == sorted(multi) and "active" in single
  np.testing.assert_array_equal(multi["active"], single["active"])
  assert single["active"].sum() == 5
  for name in single:
    np.testing.assert_allclose(multi[name], single[name], rtol=1e-5, atol=1e-6, err_msg=name)
  # FedAvg broadcast the global model: every client holds the same parameters.
  kernel = single[next(k for k in single if k.startswith("hidden/kernel"))]
  np.testing.assert_allclose(kernel, np.broadcast_to(kernel[0], kernel.shape), rtol=1e-6)
