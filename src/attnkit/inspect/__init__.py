"""Seeing inside attention: walkthroughs, tracing, pictures and a web page.

matplotlib is imported only by the plotting functions (extra ``viz``).
"""

from .trace import AttentionRecord, Trace, trace

__all__ = ["AttentionRecord", "Trace", "trace"]
