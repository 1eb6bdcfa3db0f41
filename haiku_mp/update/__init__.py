"""What a train step does to a TrainState, for any Haiku model: loss
scaling, the optimizer on the state's layout, the step itself."""

from haiku_mp.update.classification import make_classification_loss
from haiku_mp.update.classification import make_eval_step
from haiku_mp.update.data_parallel import DataParallel
from haiku_mp.update.gradients import scaled_gradients
from haiku_mp.update.loss_scaling import LossScaler
from haiku_mp.update.losses import LossWithState
from haiku_mp.update.optimizer import make_optimizer
from haiku_mp.update.param_updates import float32_master
from haiku_mp.update.param_updates import without_master
from haiku_mp.update.schedule import learning_rate_schedule
from haiku_mp.update.step import make_train_step
from haiku_mp.update.train_state import init_train_state
from haiku_mp.update.train_state import TrainState

__all__ = ('DataParallel', 'LossScaler', 'LossWithState', 'TrainState', 'float32_master',
           'init_train_state', 'learning_rate_schedule',
           'make_classification_loss', 'make_eval_step', 'make_optimizer',
           'make_train_step', 'scaled_gradients',
           'without_master')
