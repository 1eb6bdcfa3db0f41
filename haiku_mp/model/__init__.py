"""Precision decided per Haiku module class and path, and matmuls that really
run in it: the names a user's own model imports."""

from haiku_mp.model.module_runs import describe
from haiku_mp.model.fp4 import Fp4
from haiku_mp.model.fp8 import Fp8
from haiku_mp.model.matmuls import Matmuls
from haiku_mp.model.interception import apply as apply_precision
from haiku_mp.model.low_bit import LowBit
from haiku_mp.model.matmul_modules import Conv2D
from haiku_mp.model.matmul_modules import Linear
from haiku_mp.model.policies import make_precision
from haiku_mp.model.policy_strings import parse_policy
from haiku_mp.model.policies import Precision

__all__ = ('Conv2D', 'Fp4', 'Fp8', 'Linear', 'LowBit', 'Matmuls',
           'Precision', 'apply_precision', 'describe', 'make_precision',
           'parse_policy')
