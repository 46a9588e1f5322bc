"""``python -m tests.foreground_main FLAGS``: ``experiments.main`` as a shell's foreground job.

pytest-xdist's workers ignore SIGINT, and a process started with SIGINT ignored
keeps it ignored: Python then installs no ``KeyboardInterrupt`` handler. A shell
gives a foreground command the default action instead; this restores Python's
handler before running ``experiments.main`` with its flags unchanged, so that a
test's SIGINT is Ctrl-C.
"""

import runpy
import signal

if __name__ == "__main__":
  signal.signal(signal.SIGINT, signal.default_int_handler)
  runpy.run_module("experiments.main", run_name="__main__", alter_sys=True)
