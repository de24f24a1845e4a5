"""Where SmolLM2's resident memory goes, float32 against int4, and what fbgemm's float16 head holds.

    .venv/bin/python docs/bench/generate-round9/memory_breakdown.py > docs/bench/generate-round9/memory_breakdown.txt

Each form is loaded in a fresh process (resident set from /proc/self/status); tensors are summed by the
module that holds them. fbgemm's packed head is opaque: its size is the resident growth of packing it alone.
"""

from __future__ import annotations

import collections
import subprocess
import sys
import warnings


def _rss_mib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) // 1024 for line in status if line.startswith("VmRSS"))


def _one_form(form: str) -> None:
    start = _rss_mib()
    import torch

    after_torch = _rss_mib()
    from attnkit.models import load_smollm2

    after_attnkit = _rss_mib()
    model = load_smollm2(weights=form)
    loaded = _rss_mib()
    sizes: collections.Counter[str] = collections.Counter()
    seen: set[int] = set()
    for module in model.modules():
        for tensor in [*module._parameters.values(), *module._buffers.values()]:
            if tensor is None or tensor.untyped_storage().data_ptr() in seen:
                continue
            seen.add(tensor.untyped_storage().data_ptr())
            sizes[f"{type(module).__name__} {tensor.dtype}"] += tensor.untyped_storage().nbytes()
    print(f"{form}: process {start} MiB, after import torch {after_torch}, attnkit {after_attnkit}, "
          f"model loaded {loaded} (cpu {torch.backends.cpu.get_cpu_capability()})")
    for name, size in sizes.most_common():
        if size >= 2**20:
            print(f"  {size / 2**20:7.1f} MiB  {name}")
    print(f"  {sum(sizes.values()) / 2**20:7.1f} MiB  tensors in all (fbgemm's packed matrices count 8 bytes each)")


def _fbgemm_head() -> None:
    import torch

    weight = torch.randn(49152, 576)  # SmolLM2's head: V x C
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        for columns in (576, 512):
            part = weight[:, :columns].contiguous()
            before = _rss_mib()
            packed = torch.fbgemm_pack_gemm_matrix_fp16(part)
            print(f"fbgemm float16 head, {columns} inputs: {_rss_mib() - before} MiB resident "
                  f"(float16 itself: {part.numel() * 2 / 2**20:.0f} MiB)")
            del packed


if __name__ == "__main__":
    if len(sys.argv) > 1:
        _one_form(sys.argv[1]) if sys.argv[1] != "head" else _fbgemm_head()
    else:
        for what in ("float32", "int4", "head"):
            done = subprocess.run([sys.executable, __file__, what], capture_output=True, text=True, check=True)
            print(done.stdout, end="")
