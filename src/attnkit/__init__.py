"""attnkit: attention for transformer language models.

- :mod:`attnkit.textbook`: the chapter "Coding attention mechanisms" as code.
"""

__version__ = "0.1.0"
