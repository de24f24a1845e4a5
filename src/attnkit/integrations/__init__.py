"""Adapters that let other libraries run their attention on attnkit.

- :mod:`attnkit.integrations.transformers`: ``register()`` adds ``"attnkit"``
  to Hugging Face transformers' attention interface, so that
  ``attn_implementation="attnkit"`` runs a model's attention through
  :func:`attnkit.attention` (extra ``hf``).

Nothing here is imported by ``import attnkit``: each adapter imports its
library only when used.
"""
