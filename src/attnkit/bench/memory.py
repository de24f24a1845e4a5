"""Peak extra memory of one benchmark call, measured in this fresh process.

    python -m attnkit.bench.memory '<case as JSON>'   # prints {"peak_extra_bytes": N}

The case is built and called once (lazy buffers, thread pools and gradient
buffers are not the call's cost), then the peak is reset and the call made
again: on the CPU the peak resident set size above what was resident before
(Linux's VmHWM, reset through /proc/self/clear_refs); on CUDA the peak of
PyTorch's allocator above what was allocated before.
"""

from __future__ import annotations

import gc
import json
import resource
import sys

import torch

from .cases import Case
from .runner import prepare


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def _reset_cpu_peak() -> bool:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM)
        return True
    except OSError:
        return False


def measure(case: Case) -> int:
    fn, _ = prepare(case)
    fn()
    gc.collect()
    if case.device.startswith("cuda"):
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        fn()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    before = _status_kib("VmRSS")
    if _reset_cpu_peak():
        fn()
        return (_status_kib("VmHWM") - before) * 1024
    fn()  # no way to reset the peak: fall back to the process's peak since start (an overestimate)
    return (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print("usage: python -m attnkit.bench.memory '<case as JSON>'", file=sys.stderr)
        return 2
    print(json.dumps({"peak_extra_bytes": measure(Case.from_json(argv[0]))}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
