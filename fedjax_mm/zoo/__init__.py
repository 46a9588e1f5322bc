"""The World-CLIP zoo: how the shipped encoders (``fedjax_mm/weights/world-clip``) are made.

:mod:`fedjax_mm.zoo.pretrain` pretrains CLIP-style (image, text) encoder pairs on the
world's web split, measures them (linear probes, zero-shot retrieval) and writes each
encoder as a Hugging Face-style folder. It is not a federated system: it has an epoch
loop of its own and uses the runner's plumbing (workdir, metric writers, reports), so it
sits below :mod:`fedjax_mm.runner`. Nothing here is imported by the package's top level.
"""
