"""The ViT application, built on the library: the model, CIFAR-10 in memory,
the trainer, its parallelism (pmap, pjit, FSDP), DP-SGD and the typed
settings a config is parsed into. `launch.train` runs it. It imports the
library (`haiku_mp`) and never the lab; it needs the `train` extra."""
