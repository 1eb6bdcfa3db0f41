"""The precision advisor for any Haiku model: measure what float16,
bfloat16, fp8 and 4 bits (NVFP4, MXFP4) would lose in each module, judge it, and write the
overrides; and predict on paper what a low-bit format would save each
Linear on a named GPU (`speed`, `gpus`, `placement`: docs/speed.md).
Statistics, predictions and verdicts only: the trainer's driver
(`haiku_mp.lab.advisor`, `launch.lab advise`) lives in the lab."""

from haiku_mp.advisor.fp4_numerics import Fp4Matmuls
from haiku_mp.advisor.fp4_numerics import Fp4Thresholds
from haiku_mp.advisor.fp8_numerics import Fp8Matmuls
from haiku_mp.advisor.fp8_numerics import Fp8Thresholds
from haiku_mp.advisor.gpus import Assumptions
from haiku_mp.advisor.gpus import gpu
from haiku_mp.advisor.matmul_formats import judge as judge_matmuls
from haiku_mp.advisor.matmul_formats import MatmulFormat
from haiku_mp.advisor.measurement import low_bit_linears
from haiku_mp.advisor.measurement import measure_matmuls
from haiku_mp.advisor.measurement import measure_model
from haiku_mp.advisor.measurement import module_classes_of
from haiku_mp.advisor.placement import choose as choose_low_bit
from haiku_mp.advisor.placement import LinearShape
from haiku_mp.advisor.placement import torchao_pays
from haiku_mp.advisor.speed import gain as low_bit_gain
from haiku_mp.advisor.speed import linear_seconds
from haiku_mp.advisor.verdicts import Advice
from haiku_mp.advisor.verdicts import judge
from haiku_mp.advisor.verdicts import overrides
from haiku_mp.advisor.verdicts import Thresholds

__all__ = ('Advice', 'Assumptions', 'Fp4Matmuls', 'Fp4Thresholds',
           'Fp8Matmuls', 'Fp8Thresholds', 'LinearShape', 'MatmulFormat',
           'Thresholds', 'choose_low_bit', 'low_bit_linears', 'gpu', 'judge',
           'judge_matmuls', 'linear_seconds', 'low_bit_gain',
           'measure_matmuls', 'measure_model', 'module_classes_of',
           'overrides', 'torchao_pays')
