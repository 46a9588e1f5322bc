r"""World-CLIP: pretraining the zoo's encoders on the world's web split.

  python -m experiments.main --config=experiments/pretrain.py

pretrains every image encoder of the zoo against a text tower, CLIP-style, on
50,000 web image-caption pairs (shift 0.5, between the private and the public
distribution), then prints a table of linear-probe accuracies (shape, colour,
multi-label F1) and zero-shot retrieval R@1/5/10 beside the trivial baselines,
and writes each encoder as a Hugging Face-style folder under
``runs/pretrain/world-clip/<encoder>`` (config.json + model.safetensors).

The weights shipped in ``fedjax_mm/weights/world-clip`` are this config's
output at seed 0; to rebuild them::

  python -m experiments.main --config=experiments/pretrain.py --workdir=runs/pretrain
  cp -r runs/pretrain/world-clip fedjax_mm/weights/

``:smoke`` is tiny (the tests use it).
"""

import ml_collections


def get_config(arg=None):
  config = ml_collections.ConfigDict()
  config.seed = 0
  # Each image encoder once; each text encoder's shipped weights come from the
  # first pair that names it (transformer_t's from vitc_t's: the pair FedRGB, RCSR and
  # CreamFL's multimodal clients hold).
  # A tuple, so one run can name its own pairs:
  #   --config.pairs="(('cnn_m', 'transformer_t'),)"
  config.pairs = (
    ("vitc_t", "transformer_t"),
    ("vit_t", "transformer_t"),
    ("cnn_s", "gru"),
    ("vit_s", "transformer_s"),
    ("cnn_m", "transformer_t"),
    ("resnet_t", "transformer_t"),
    ("vit_b", "transformer_s"),
    ("vitc_s", "transformer_s"),
  )
  config.web = ml_collections.ConfigDict({"size": 50_000, "shift": 0.5})
  # Epochs per image encoder: the encoders FedMuscle's default users hold get 12 (cnn_m,
  # resnet_t: 45-55 minutes each on 2 CPU cores) and 20 (vitc_s, about 95 minutes: its
  # shape probe reaches 69% at epoch 9 of 20 where the 12-epoch schedule gave 59%), as
  # does vitc_t (the other systems' image encoder, about 40 minutes); the rest fewer.
  config.default_epochs = 3
  config.epochs = ml_collections.ConfigDict(
    {
      "vit_t": 6,
      "cnn_s": 5,
      "vit_s": 4,
      "cnn_m": 12,
      "vit_b": 1,
      "resnet_t": 12,
      "vitc_s": 20,
      "vitc_t": 20,
    }
  )
  # Feature distillation beside the CLIP loss (fedjax_mm.algorithms.clip): the teacher
  # (an image encoder of this run's pairs, trained first by CLIP alone) is regressed by
  # every other image tower's pooled feature (or those `students` names) with this
  # weight; "" distils nothing. resnet_t, from CLIP alone, learnt little shape (22.7% after
  # 3 epochs); it and the conv-stem ViTs vitc_s and vitc_t (as shipped) are distilled from
  # cnn_m, the zoo's shape expert.
  config.distill = ml_collections.ConfigDict(
    {"teacher": "cnn_m", "weight": 1.0, "students": ("resnet_t", "vitc_s", "vitc_t")}
  )
  # FedMuscle's precondition, printed in the report: every two of these encoders (its
  # default lineup, experiments/fedmuscle.py) share k CCA directions on a public set of
  # its size and shift; how well do those decode shape? (fedjax_mm.zoo.cca) k = 24, not
  # 8: every encoder knows the 10 colours, which fill the top 9 or so directions of any
  # pair (docs/guides/pretrained.md: resnet_t/cnn_m, both ~70% on shape, decode it at 15%
  # from 8 directions, 42% from 16, 66% from 24; the previous zoo's pairs 12-21% at 24).
  config.precondition = ml_collections.ConfigDict(
    {"encoders": ("vitc_s", "resnet_t", "cnn_m"), "public_size": 640, "public_shift": 1.0, "k": 24}
  )
  config.batch_size = 128
  config.embed_dim = 128
  config.learning_rate = 1e-3
  config.weight_decay = 0.1
  config.warmup_fraction = 0.05
  config.dtype = "float16"  # stored tensors; loading gives float32
  config.probe = ml_collections.ConfigDict({"train": 1000, "test": 1000})
  config.eval_pairs = 1000
  # Each encoder's pooled-feature mean and std over this many web inputs, stored in
  # its folder for user models that standardise their features (models.build's
  # `standardize`).
  config.stats_size = 2048
  if arg == "smoke":
    config.pairs = (("vit_t", "transformer_t"), ("cnn_s", "transformer_t"))
    config.web.size = 256
    config.default_epochs = 1
    config.epochs = ml_collections.ConfigDict()
    config.distill = ml_collections.ConfigDict({"teacher": "", "weight": 1.0, "students": ()})
    config.batch_size = 64
    config.embed_dim = 16
    config.dtype = "float32"
    config.probe = ml_collections.ConfigDict({"train": 64, "test": 64})
    config.eval_pairs = 32
    config.stats_size = 64
    config.precondition = ml_collections.ConfigDict(
      {"encoders": ("vit_t", "cnn_s"), "public_size": 64, "public_shift": 1.0, "k": 4}
    )
  elif arg is not None:
    raise ValueError(f"unknown variant {arg!r}; expected smoke.")
  return config
