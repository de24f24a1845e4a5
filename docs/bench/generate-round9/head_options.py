"""SmolLM2's vocabulary head (49,152 x 576) four ways, milliseconds per call at 1 to 8 rows, 2 threads.

    .venv/bin/python docs/bench/generate-round9/head_options.py > docs/bench/generate-round9/head_options.txt

fbgemm's float16 product (attnkit's int4 head today, 97 MiB resident: inputs padded to 1,024); the same
over the first 512 inputs plus a float32 product over the last 64 (60 MiB); a plain float16 matrix that
the embedding table could share (54 MiB, no second copy), as torch.mm(W, x.T); and bfloat16 F.linear
(bfloat16 logits). Medians of 31 calls per row count, the ways interleaved in 5 rounds, in one process.
"""

from __future__ import annotations

import statistics
import time
import warnings

import torch
import torch.nn.functional as F

V, C = 49152, 576


def main() -> None:
    torch.set_num_threads(2)
    torch.manual_seed(0)
    weight = torch.randn(V, C) * 0.05
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        full = torch.fbgemm_pack_gemm_matrix_fp16(weight)
        first = torch.fbgemm_pack_gemm_matrix_fp16(weight[:, :512].contiguous())
    last, half, brain, zero = weight[:, 512:].contiguous(), weight.half(), weight.bfloat16(), torch.zeros(V)

    def fbgemm(x: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)
            return torch.fbgemm_linear_fp16_weight_fp32_activation(x, packed, zero)

    ways = {"fbgemm float16 (97 MiB)": lambda x: fbgemm(x, full),
            "fbgemm 512 + float32 64 (60 MiB)": lambda x: fbgemm(x[:, :512], first) + F.linear(x[:, 512:], last),
            "plain float16 mm(W, x.T) (54 MiB)": lambda x: torch.mm(half, x.half().T).T.float(),
            "bfloat16 F.linear (54 MiB)": lambda x: F.linear(x.bfloat16(), brain).float()}
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, 2 threads")
    for rows in (1, 2, 4, 8):
        x = torch.randn(rows, C)
        times: dict[str, list[float]] = {name: [] for name in ways}
        with torch.inference_mode():
            for _ in range(5):
                for name, way in ways.items():
                    way(x)
                    for _ in range(31):
                        start = time.perf_counter()
                        way(x)
                        times[name].append(time.perf_counter() - start)
        base = statistics.median(times["fbgemm float16 (97 MiB)"])
        medians = {name: statistics.median(t) for name, t in times.items()}
        cells = [f"{n} {m * 1e3:.2f} ms ({m / base:.2f}x)" for n, m in medians.items()]
        print(f"{rows} rows: " + "; ".join(cells))


if __name__ == "__main__":
    main()
