"""Base config: the seeds' reference ViT on CIFAR-10 in float32.

Variants import this file and change only what differs. Every field can be
overridden from the command line, e.g. `--config.batch_size=256`.
"""

import ml_collections


def get_config() -> ml_collections.ConfigDict:
  config = ml_collections.ConfigDict()
  config.seed = 0  # Params, dropout, data order and augmentation draws.
  config.batch_size = 128  # Train images per step, over every device.
  config.eval_batch_size = 1000  # Divides val (5,000) and test (10,000).
  config.num_epochs = 10  # Passes over the train split (num_train_steps=-1).
  config.num_train_steps = -1  # -1: derived from num_epochs.
  config.learning_rate = 1e-3  # Adam's peak rate, reached after warmup.
  config.weight_decay = 0.0  # AdamW's decoupled weight decay.
  config.warmup_steps = 0  # Linear warm-up, then cosine decay to 0.
  config.grad_clip_norm = 0.0  # 0: no clipping.
  # The train loss's targets: (1 - label_smoothing) on the label (or the mixed
  # labels) plus label_smoothing spread evenly over the classes.
  config.label_smoothing = 0.0
  # > 0: a moving average of the params (this decay per step) is kept and
  # evaluated beside them (val_ema and test_ema events, ema_* in the summary).
  config.ema_decay = 0.0
  # > 0: the moving average follows the run's length instead: its time
  # constant is this share of the run's train steps (ema_decay = 1 - 1 /
  # (ema_horizon * steps)), so a shorter run gets a faster average.
  config.ema_horizon = 0.0
  config.log_every_steps = 50  # A progress line and a metrics event.
  config.eval_every_steps = 1000  # On val; also at the end (and test).
  config.checkpoint_every_steps = 1000  # Also at the end and on SIGTERM.
  config.keep_checkpoints = 3  # The newest kept; older ones deleted.
  # Train (and eval) steps the host dispatches ahead of the devices: a few
  # keep them fed; a stop or a checkpoint waits for as many. At most 16:
  # XLA:CPU stalls multi-device programs when a device queue (32) fills.
  config.steps_in_flight = 2
  # A step (or eval batch) not finished after this long, or after 4x the
  # slowest so far, ends the run with one line (a stalled device); 0: never.
  config.stall_timeout_sec = 300.0
  # JAX's persistent compilation cache: 'auto' (~/.cache/haiku_mp/jax on a GPU
  # or TPU, none on the CPU), a directory (on every backend) or '' (off).
  # A restarted or resumed run then loads its compiled steps.
  config.compilation_cache_dir = 'auto'

  config.model = ml_collections.ConfigDict(dict(
      image_size=32,  # Side of the square input images (CIFAR-10: 32).
      patch_size=4,  # Side of the square patches that become tokens.
      num_classes=10,  # Logits (CIFAR-10: 10).
      embed_dim=384,  # Token width.
      mlp_dim=1536,  # Hidden width of each block's MLP.
      num_heads=8,  # Attention heads (they divide embed_dim).
      num_layers=6,  # Encoder blocks.
      dropout_rate=0.1,  # Dropout in each block's MLP.
      # Stochastic depth: each block's two residual branches dropped for a
      # random subset of examples, at rates rising linearly from 0 in the
      # first block to drop_path_rate in the last.
      drop_path_rate=0.0,
      layer_norm_epsilon=1e-6,  # The seeds' (Haiku's default is 1e-5).
      # The patch embedding's kernel init: 'lecun_normal' (the original
      # ViT's and big_vision's) or 'xavier_uniform' (before 2026-11-26: 8x
      # too small for a convolution; kept to reproduce old runs).
      patch_init='lecun_normal',
  ))
  # What each encoder block keeps for the backward pass: 'none' (every
  # residual), 'dots' (the weight matmuls' outputs; the rest recomputed) or
  # 'full' (the block's input; the block recomputed). haiku_mp/model/remat.py.
  config.remat = 'none'

  config.precision = ml_collections.ConfigDict(dict(
      # jmp policy of the model class; its compute dtype is the activations'.
      policy='params=float32,compute=float32,output=float32',
      # 'TARGET:POLICY;...': TARGET is a module class name or a path glob.
      overrides='',
      float32_layer_norm=True,  # LayerNorm in float32 under any policy.
      # A jax.default_matmul_precision name for every matmul ('highest',
      # 'tensorfloat32', ...); '' keeps JAX's default.
      matmul_precision='',
      # 'compute': the residual stream in the compute dtype; 'float32': kept in
      # float32 (Megatron's fp32 residual), the branches still in compute.
      residual_stream='compute',
      # How matmuls with half operands run: 'auto' (the fastest form measured
      # for the backend), 'native' (half x half -> float32 sums, rounded once),
      # 'upcast' (operands converted to float32 first) or 'plain' (Haiku's and
      # JAX's own half x half -> half). Float32 matmuls are never changed.
      dot_form='auto',
      # The backend whose kernels 'auto' and the weight gradients' layout are
      # chosen for: '' the one JAX runs on, or 'cpu' / 'gpu' / 'tpu' to trace
      # the program another backend would run (a GPU's, read on a CPU).
      dot_platform='',
      # The training state's layout (docs/precision.md): how params take an
      # update. 'master': float32 params, or half params rounded from a
      # float32 master copy the optimizer keeps. Without that copy (bfloat16
      # params), each step's float32 result rounded into them: 'nearest',
      # 'stochastic' (unbiased, drawn from the run's key) or 'kahan' (to
      # nearest, plus a bfloat16 buffer of what rounding dropped).
      param_update='master',
      # Adam's first moment: 'float32', 'bfloat16' (rounded stochastically) or
      # 'float8_blocks' (8-bit E4M3 codes and a float32 scale per block,
      # rounded stochastically; haiku_mp/update/block_moments.py).
      mu_dtype='float32',
      nu_dtype='float32',  # Adam's second moment: the same choices.
      # 'float8_blocks' moments: values per scale, along each param's last
      # axis (torchao's 256: 0.016 bytes of scale per value).
      moment_block_size=256,
      # fp8 matmuls (haiku_mp/model/fp8.py, docs/fp8.md): E4M3 forward, E5M2
      # gradients, float32 sums, in the Linear layers of these modules.
      fp8=ml_collections.ConfigDict(dict(
          # 'TARGET;...': class names or path globs (a glob selects the
          # Linears inside a module too, e.g. '*/encoder_block_*'); '': off.
          modules='',
          # 'current' (each tensor's amax this step), 'delayed' (the max of
          # its last history_length amaxes) or 'mx' (MXFP8 blocks of 32).
          scaling='current',
          history_length=16,  # delayed: amaxes kept per tensor (>= 1).
          margin=0.0,  # Scales leave amax * 2**margin in range (>= 0).
          # 'fp8', or 4 bits, emulated (haiku_mp/model/fp4.py): 'nvfp4'
          # (E2M1 in blocks of 16 with E4M3 scales) or 'mxfp4' (blocks of
          # 32, E8M0 scales); 4 bits take scaling 'current'.
          format='fp8',
          # 4 bits: weights in 2-D tiles (16x16 / 32x32) shared by the
          # forward and the input gradient's GEMM.
          two_d_weights=True,
          # 4 bits: a random 16x16 Hadamard transform on the weight
          # gradient's GEMM inputs, along the tokens.
          hadamard=True,
          # 4 bits: output gradients rounded stochastically (unbiased).
          stochastic_gradients=True,
          # 4 bits: 'TARGET;...' among `modules` whose Linears keep fp8
          # (E4M3 / E5M2, current scaling), as the advisor suggests; '': none.
          keep_fp8='',
      )),
  ))

  config.loss_scale = ml_collections.ConfigDict(dict(
      kind='none',  # 'none' | 'static' | 'dynamic'
      initial=2.0**15,  # the static scale, or the dynamic scale's start.
      period=2000,  # dynamic: finite steps before the scale grows.
      factor=2.0,  # dynamic: growth and back-off factor.
      minimum=1.0,  # dynamic: the scale never falls below this floor.
      # dynamic: back off on the k-th overflow since the scale last grew and on
      # every one after (Megatron-LM / DeepSpeed hysteresis); 1: on every one.
      hysteresis=1,
      # Stop after this many consecutive skipped steps at the floor. Without
      # dynamic scaling, any non-finite step stops the run.
      max_consecutive_skips=50,
  ))

  config.parallel = ml_collections.ConfigDict(dict(
      strategy='single',  # 'single' | 'pmap' | 'pjit'
      mesh_shape=(-1, 1),  # (batch, model); -1: the remaining devices.
      # 'REGEX=SPEC;...' over 'module/path/param', e.g. '.*/head/w=None,model';
      # tried before the built-in rules (haiku_mp/parallel/sharding.py).
      sharding_rules='',
  ))

  # DP-SGD (haiku_mp/privacy/dp_sgd.py, on JAX Privacy). On: batch_size is the
  # expected size of a Poisson-sampled batch; each example's gradient is
  # clipped to l2_clip_norm and Gaussian noise of std noise_multiplier *
  # l2_clip_norm is added to their float32 sum; epsilon at delta is reported.
  config.privacy = ml_collections.ConfigDict(dict(
      enabled=False,  # DP-SGD on or off.
      l2_clip_norm=1.0,  # Each example's gradient is clipped to this norm.
      noise_multiplier=1.0,  # The noise's std over l2_clip_norm.
      # > 0: the noise multiplier that spends this epsilon in the run's steps
      # (replaces noise_multiplier); 0: noise_multiplier as set.
      target_epsilon=0.0,
      delta=1e-5,  # The delta of the (epsilon, delta) guarantee reported.
      # Examples per device whose per-example gradients exist at once (JAX
      # Privacy's microbatching); 0: all of a device's batch. The reference
      # ViT's 162 at once need 7.5 GB of temp on a CPU; 32 need 1.7 GB, less
      # than its ordinary step, and run faster there (BENCHMARKS.md).
      microbatch_size=32,
      # A sampled batch is padded to batch_size + this many standard
      # deviations of its size (rounded up to divide the devices and
      # microbatches); a larger draw takes a larger shape (a compile).
      padding_stddevs=3.0,
  ))

  # The precision advisor (`python -m launch.lab advise`, haiku_mp/advisor/verdicts.py):
  # how much of a tensor a half format may lose before a module keeps float32.
  config.advisor = ml_collections.ConfigDict(dict(
      # What a format may cost an output or gradient, relative to its norm:
      # rounding (bfloat16's own is ~0.2%, float16's ~0.02%) or, for float16
      # gradients at a loss scale, the values left below its normal range.
      max_relative_error=0.01,
      # Share of an output's values that may overflow float16 (65504).
      max_overflow_share=0.0,
      # The window's top leaves the largest gradient measured this factor
      # below 65504. 1: the largest scale the batches seen allow, where
      # dynamic loss scaling settles (it probes one power of two above now
      # and then); 2 leaves a run's larger gradients room, for a static scale.
      loss_scale_headroom=1.0,
      # From init, float32 training steps taken before measuring: a
      # zero-initialized head passes almost no gradient back at first (the
      # CPU-sized ViT's window was [2^21, 2^24] over its first 8 steps,
      # [2^11, 2^17] after 351). A checkpoint is measured as it is.
      init_steps=200,
      # fp8 (haiku_mp/advisor/fp8_verdicts.py): what E4M3 / E5M2 may cost a Linear's
      # matmul input, weight or output gradient, relative to its norm (their
      # own rounding is ~2-3% and ~5% of a well-scaled tensor's).
      fp8_max_relative_error=0.1,
      # fp8: share of a tensor's non-zero values that may underflow to zero.
      fp8_max_underflow_share=0.01,
      # fp8: share of a tensor's non-zero values that may saturate.
      fp8_max_saturate_share=0.001,
      # 4 bits (haiku_mp/advisor/fp4_verdicts.py): what NVFP4 / MXFP4 may
      # cost an operand, relative to its norm (E2M1 blocks of Gaussian
      # values lose ~10%).
      fp4_max_relative_error=0.2,
      # 4 bits: share of an operand's blocks that an outlier may flush (the
      # block's other values under E2M1's smallest step, rounded to zero).
      fp4_max_flushed_share=0.05,
  ))

  config.data = ml_collections.ConfigDict(dict(
      # 'tfds' (TFDS, read once into memory), 'arrays' (a .npz from
      # `python -m launch.data export`; no TensorFlow) or 'synthetic' (random
      # pixels). Every split is held in memory and augmented on the device.
      source='tfds',
      arrays_path='',  # The .npz of the arrays source.
      name='cifar10',  # The TFDS dataset (its images must fit the model).
      data_dir='',  # empty: the TFDS default (or TFDS_DATA_DIR).
      download=True,  # Download if not prepared in data_dir.
      # TFDS split strings (the arrays source reads the same syntax).
      train_split='train[:45000]',
      val_split='train[45000:]',  # Evaluated every eval_every_steps.
      test_split='test',  # Evaluated once, at the end.
      # The train augmentation, on the device (haiku_mp/data/augment.py), in this
      # order; False: images only normalized.
      augment=True,
      # 'resized': a random crop of crop_area of the area with aspect ratio in
      # crop_aspect_ratio, resized back; 'pad': a random crop of the image's
      # size from the image padded with crop_padding black pixels; 'none'.
      crop='resized',
      crop_area=(0.9, 1.0),
      crop_aspect_ratio=(0.9, 1.1),
      crop_max_attempts=10,  # 'resized': draws before the whole image.
      crop_padding=4,  # 'pad': black pixels on each side.
      flip=True,  # A random horizontal flip.
      # 'none', 'randaugment' (randaugment_ops operations drawn per image, each
      # at randaugment_magnitude of 10) or 'autoaugment' (AutoAugment's
      # CIFAR-10 policy). haiku_mp/data/auto_augment.py.
      policy='none',
      randaugment_ops=2,  # 'randaugment': operations per image (1-14).
      randaugment_magnitude=9.0,  # 'randaugment': strength, 0-10.
      # Random erasing: a box of noise, on this share of the images.
      erasing_probability=0.0,
      # Mixup and CutMix of neighbouring examples with soft labels; the
      # ratio is Beta(alpha, alpha); 0 turns a method off; both on: even odds
      # per example.
      mixup_alpha=0.0,
      cutmix_alpha=0.0,  # CutMix's Beta(alpha, alpha); 0: off.
      # With mixup or CutMix on: the share of examples mixed, each drawn on
      # its own (timm's mix_prob); the others keep their image and label.
      mixing_probability=1.0,
      # With mixup or CutMix on: the share of the run, at its end, trained on
      # whole examples (timm's mixup_off_epoch, as a share); 0: mix to the end.
      mixing_off_share=0.0,
      # Per-channel normalization of pixels in [0, 1] (CIFAR-10's).
      mean=(0.4914, 0.4822, 0.4465),
      std=(0.2023, 0.1994, 0.2010),  # Divides each channel, mean taken.
      prefetch_batches=2,  # Batches on their way to the devices.
      synthetic_train_examples=45000,  # 'synthetic': train split size.
      synthetic_eval_examples=5000,  # 'synthetic': val and test sizes.
  ))
  config.lock()
  return config
