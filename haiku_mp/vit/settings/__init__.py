"""The settings' schema: every field of a run's config with its type, default
and doc, one frozen dataclass per area, parsed once from the ConfigDict that
config files and flags build. Each field checks its own values when parsed
(the choices a library module makes are read from it), and each group the
rules between its fields (`check_rules`; the whole run's `Settings`, those
between groups); `vit/train/checks.py` keeps the rules against what the
settings build. Every area below `build` takes its own group.
"""

from haiku_mp.vit.settings.advisor import AdvisorSettings
from haiku_mp.vit.settings.dataset import DataSettings
from haiku_mp.vit.settings.fields import replace
from haiku_mp.vit.settings.loss_scale import LossScaleSettings
from haiku_mp.vit.settings.model import ModelSettings
from haiku_mp.vit.settings.parallel import ParallelSettings
from haiku_mp.vit.settings.precision import LowBitSettings
from haiku_mp.vit.settings.precision import PrecisionSettings
from haiku_mp.vit.settings.privacy import PrivacySettings
from haiku_mp.vit.settings.run import default_config
from haiku_mp.vit.settings.run import parse
from haiku_mp.vit.settings.run import Settings

__all__ = ['AdvisorSettings', 'DataSettings', 'LowBitSettings',
           'LossScaleSettings', 'ModelSettings', 'ParallelSettings',
           'PrecisionSettings', 'PrivacySettings', 'Settings',
           'default_config', 'parse', 'replace']
