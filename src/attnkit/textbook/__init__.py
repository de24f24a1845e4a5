"""The chapter "Coding attention mechanisms" as importable code.

Each step of the five notebooks attnkit grew from (the README's section "The
chapter as code") with the book's names, constructor signatures and parameter
creation order, so that ``torch.manual_seed(...)`` followed by the same calls
reproduces the printed numbers (the tests in ``tests/textbook`` hold them),
with the notebooks' mistakes fixed. This package imports nothing else
from attnkit: it is the independent reference the production layer is tested
against.

Steps, in the chapter's order:

- 3.3 :mod:`.simple`: scores, ``softmax_naive`` / ``softmax_stable``, context
  vectors, without trainable weights;
- 3.4 :mod:`.trainable`: ``SelfAttention_v1``, ``SelfAttention_v2``;
- 3.5 :mod:`.causal`: causal masks both ways, ``CausalAttention`` with dropout;
- 3.6 :mod:`.multihead`: ``MultiHeadAttentionWrapper``, ``MultiHeadAttention``
  with weight splits, notebook 001's ``PerHeadAttention``.
"""

from .causal import CausalAttention, causal_mask_simple, mask_by_renormalizing, mask_with_neg_inf
from .data import SENTENCE, WORDS, book_batch, book_inputs
from .multihead import (
    MultiHeadAttention,
    MultiHeadAttentionWrapper,
    PerHeadAttention,
    causal_head,
    wrapper_to_multihead,
)
from .simple import (
    attn_scores_for_query,
    attn_scores_for_query_loop,
    attn_scores_loop,
    attn_scores_matrix,
    context_vec_loop,
    context_vecs_matrix,
    normalize_by_sum,
    simple_self_attention,
    softmax_naive,
    softmax_stable,
)
from .trainable import SelfAttention_v1, SelfAttention_v2, transfer_v2_to_v1

__all__ = [
    "SENTENCE",
    "WORDS",
    "CausalAttention",
    "MultiHeadAttention",
    "MultiHeadAttentionWrapper",
    "PerHeadAttention",
    "SelfAttention_v1",
    "SelfAttention_v2",
    "attn_scores_for_query",
    "attn_scores_for_query_loop",
    "attn_scores_loop",
    "attn_scores_matrix",
    "book_batch",
    "book_inputs",
    "causal_head",
    "causal_mask_simple",
    "context_vec_loop",
    "context_vecs_matrix",
    "mask_by_renormalizing",
    "mask_with_neg_inf",
    "normalize_by_sum",
    "simple_self_attention",
    "softmax_naive",
    "softmax_stable",
    "transfer_v2_to_v1",
    "wrapper_to_multihead",
]
