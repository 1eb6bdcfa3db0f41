"""Base config: the seeds' reference ViT on CIFAR-10 in float32.

The fields, their types, defaults and docs are the library's settings schema
(haiku_mp/vit/settings/; `--help` lists them). Variants import this file and
change only what differs. Every field can be overridden from the command
line, e.g. `--config.batch_size=256`.
"""

import ml_collections

from haiku_mp.vit import settings


def get_config() -> ml_collections.ConfigDict:
  return settings.default_config()
