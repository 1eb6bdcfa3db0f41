"""The precision advisor for any Haiku model: measure what float16 and
bfloat16 would lose in each module, judge it, and write the overrides."""

from haiku_mp.advisor.advisor import measure_model
from haiku_mp.advisor.advisor import module_classes_of
from haiku_mp.advisor.verdicts import Advice
from haiku_mp.advisor.verdicts import judge
from haiku_mp.advisor.verdicts import overrides
from haiku_mp.advisor.verdicts import Thresholds

__all__ = ('Advice', 'Thresholds', 'judge', 'measure_model',
           'module_classes_of', 'overrides')
