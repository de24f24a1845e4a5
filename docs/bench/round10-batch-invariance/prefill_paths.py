"""What choosing int4's prompt product by positions per row (not rows in the call) costs: SmolLM2 int4 prefill,
milliseconds, kernel against the widened bfloat16 product, 2 threads.

    .venv/bin/python docs/bench/round10-batch-invariance/prefill_paths.py \
        > docs/bench/round10-batch-invariance/prefill_paths.txt

Until round ten a packed layer took the widened product from 256 rows in the call (batch x positions), so a
row's logits depended on the batch beside it; now from 256 positions per row. A batch of 8 prompts of 64
tokens (the generate suite's batched case) now takes the kernel, as each of its prompts alone does. Medians
of 7 forwards after one, the two paths alternating in 3 rounds, in one process.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch

from attnkit.models import load_smollm2
from attnkit.modules.packed import PackedLinear


def main() -> None:
    torch.set_num_threads(2)
    warnings.simplefilter("ignore", UserWarning)
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, 2 threads")
    model = load_smollm2(weights="int4")
    layers = [layer for layer in model.modules() if isinstance(layer, PackedLinear) and layer.form == "int4"]
    generator = torch.Generator().manual_seed(0)

    def forward_ms(ids: torch.Tensor, widened: bool) -> float:
        for layer in layers:
            layer.dense_rows = 1 if widened else None
        with torch.inference_mode():
            model(ids)
            times = []
            for _ in range(7):
                start = time.perf_counter()
                model(ids)
                times.append(time.perf_counter() - start)
        return 1e3 * statistics.median(times)

    for batch, positions in [(8, 64), (1, 32), (1, 64), (1, 128), (1, 256)]:
        ids = torch.randint(100, 40000, (batch, positions), generator=generator)
        rounds = [(forward_ms(ids, False), forward_ms(ids, True)) for _ in range(3)]
        kernel, widened = (statistics.median(r[i] for r in rounds) for i in (0, 1))
        print(f"batch {batch} x {positions} positions: kernel {kernel:.0f} ms, widened {widened:.0f} ms "
              f"(widened / kernel {widened / kernel:.2f})", flush=True)


if __name__ == "__main__":
    main()
