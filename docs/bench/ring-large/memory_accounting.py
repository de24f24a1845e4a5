import os, torch
from attnkit.bench.memory import _reset_cpu_peak, _status_kib
from attnkit.distributed import ring_attention
from attnkit.distributed.launch import run_world

def work(rank, world, t):
    n = t // world
    small = torch.randn(1, 12, 2 * world, 64); ring_attention(small, small, small, causal=True)
    before = _status_kib("VmRSS")
    q, k, v = (torch.randn(1, 12, n, 64) for _ in range(3))
    inputs = _status_kib("VmRSS") - before
    with torch.no_grad():
        ring_attention(q, k, v, causal=True)
        _reset_cpu_peak(); base = _status_kib("VmRSS") - before
        ring_attention(q, k, v, causal=True)
    peak = _status_kib("VmHWM") - before
    return dict(rank=rank, n=n, unit_mib=n*12*64*4/2**20, inputs=inputs/1024, base_after_warmup=base/1024, peak=peak/1024)

if __name__ == "__main__":
    os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")
    import sys
    for world in [int(w) for w in (sys.argv[1:] or ["1", "2", "4"])]:
        res = run_world(work, world, args=(16384,), timeout_s=900, pg_timeout_s=600, threads=1)
        print(world, [ {k: round(v, 1) if isinstance(v, float) else v for k, v in r.items()} for r in res][:2])
