"""Small training runs that show what attention heads learn.

- :func:`train_induction`: a two-layer attention-only transformer of
  :class:`attnkit.MultiHeadAttention` layers trained on repeated random
  segments, in which an induction head forms (``attnkit train induction``);
- :func:`make_batch`: the task's sequences; :func:`induction_scores` and
  :func:`previous_token_scores`: what each head does, from its weights;
- :func:`ablate_heads`: zero heads' outputs to see what they were for.
"""

from .data import Batch, make_batch
from .induction import AttentionOnlyTransformer, InductionConfig, InductionRun, ablate_heads, train_induction
from .scores import induction_scores, previous_token_scores

__all__ = ["AttentionOnlyTransformer", "Batch", "InductionConfig", "InductionRun", "ablate_heads",
           "induction_scores", "make_batch", "previous_token_scores", "train_induction"]
