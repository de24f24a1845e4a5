"""Context parallelism over torch.distributed: one sequence split across processes and machines.

- :func:`ring_attention`: exact attention over a sharded sequence; keys and
  values travel around a ring of ranks, built on the chunked backend's block
  kernel.
- :func:`shard`, :func:`unshard`, :func:`shard_positions`: the layouts
  ("contiguous", "zigzag") that split a sequence across ranks.
- :class:`ContextParallel`: the component that lets a
  :class:`attnkit.MultiHeadAttention` run on a shard of the sequence.

Works on every torch.distributed backend (gloo on CPU, NCCL on GPUs); start
the processes with ``torchrun``.
"""

from .layout import LAYOUTS, shard, shard_positions, unshard
from .parallel import ContextParallel
from .ring import ring_attention
from .timing import RingTimes, ring_timing

__all__ = ["LAYOUTS", "ContextParallel", "RingTimes", "ring_attention", "ring_timing", "shard", "shard_positions",
           "unshard"]
