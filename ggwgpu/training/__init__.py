"""A training run's parts: the options (options.py), the Trainer and its step regimes
(trainer.py, regimes.py, lbfgs.py), the state a checkpoint carries (state.py), checkpoint
files (checkpoint.py) and the run loop that loses nothing when stopped (run.py)."""
from .options import MAX_SCALE, MIN_SCALE, Bound, TrainOptions, schedule
from .regimes import clip_scale
from .state import RunState, check_state
from .trainer import (LossScaler, Trainer, logits_bound, token_digest,
                      unigram_entropy)

__all__ = ["MAX_SCALE", "MIN_SCALE", "Bound", "LossScaler", "RunState", "TrainOptions", "Trainer",
           "check_state", "clip_scale", "logits_bound", "schedule", "token_digest",
           "unigram_entropy"]
