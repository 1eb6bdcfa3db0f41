"""haiku_mp: mixed precision for Haiku models, measured.

The public surface for a model of your own (docs/your_model.md): precision
policies per module class and path, Linear and Conv2D whose matmuls really
run in half precision (or fp8), loss scaling that survives jit, and the train
step, all here; the precision advisor in `haiku_mp.advisor`. The rest of the
package (the ViT, its data, its trainer and lab) is the application built on
them.
"""

__version__ = '0.2.0'  # docs/CHANGELOG.md says what each version changed.

from haiku_mp.model import apply_precision
from haiku_mp.model import Conv2D
from haiku_mp.model import describe
from haiku_mp.model import Fp4
from haiku_mp.model import Fp8
from haiku_mp.model import Linear
from haiku_mp.model import LowBit
from haiku_mp.model import make_precision
from haiku_mp.model import Matmuls
from haiku_mp.model import parse_policy
from haiku_mp.model import Precision
from haiku_mp.update import DataParallel
from haiku_mp.update import float32_master
from haiku_mp.update import init_train_state
from haiku_mp.update import learning_rate_schedule
from haiku_mp.update import LossScaler
from haiku_mp.update import LossWithState
from haiku_mp.update import make_classification_loss
from haiku_mp.update import make_eval_step
from haiku_mp.update import make_optimizer
from haiku_mp.update import make_train_step
from haiku_mp.update import scaled_gradients
from haiku_mp.update import TrainState
from haiku_mp.update import without_master

__all__ = ('Conv2D', 'DataParallel', 'Fp4', 'Fp8', 'Linear',
           'LossScaler', 'LossWithState', 'LowBit', 'Matmuls', 'Precision',
           'TrainState', 'apply_precision', 'describe',
           'float32_master', 'init_train_state', 'learning_rate_schedule',
           'make_classification_loss', 'make_eval_step', 'make_optimizer',
           'make_precision', 'make_train_step',
           'parse_policy', 'scaled_gradients', 'without_master')
