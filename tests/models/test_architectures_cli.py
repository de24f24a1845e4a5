"""Each architecture added for issue 36 through the command line: ``generate --gguf`` writes what the library's
``generate()`` gives for the same file, and ``explain --gguf`` shows the layer the model ran; then the Phi-3
tokenizer of a file as llama.cpp's converter writes it (no ``tokenizer.ggml.add_space_prefix``)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

from attnkit.cli import main
from tests._util import need

need("gguf")
need("tokenizers")
need("rich")

from attnkit import trace  # noqa: E402
from attnkit.models import load_gguf  # noqa: E402
from tests.models import test_phi3 as phi3  # noqa: E402
from tests.models.test_gemma2 import write_tiny_gemma2  # noqa: E402
from tests.models.test_qwen import write_tiny_qwen  # noqa: E402

WRITERS: dict[str, Callable[[Path], Any]] = {
    "qwen2": lambda path: write_tiny_qwen(path, "qwen2"),
    "qwen3": lambda path: write_tiny_qwen(path, "qwen3"),
    "phi3": lambda path: phi3.write_tiny_phi3(path, space_prefix=None),  # as llama.cpp's converter writes it
    "gemma2": write_tiny_gemma2,
}


@pytest.fixture(scope="module", params=list(WRITERS))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    arch = request.param
    path = tmp_path_factory.mktemp(arch) / f"tiny-{arch}.gguf"
    WRITERS[arch](path)
    return arch, str(path)


def _library_text(path: str, prompt: str, n: int, *, chat: bool = False) -> tuple[str, int]:
    """What ``stream()`` of the file continues ``prompt`` with (loaded as the command loads it; the command
    prints a stream too: a random tiny model may end on a broken UTF-8 sequence, whose bytes a whole decode and
    a stream spell differently, and a stream keeps the space a SentencePiece decode drops at a text's start),
    and how many tokens ``generate()`` makes of it."""
    model = load_gguf(path, weights="auto")
    if chat:
        ids = torch.tensor([model.tokenizer.chat_ids([{"role": "user", "content": prompt}])])
    else:
        ids = model.tokenize(prompt)["input_ids"]
    new = model.generate(ids, max_new_tokens=n)[0, ids.shape[1] :].tolist()
    return "".join(model.stream(ids, max_new_tokens=n)), len(new)


def test_generate_writes_the_librarys_greedy_text(tiny: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    _, path = tiny
    assert main(["generate", "--gguf", path, "--max-new-tokens", "8", "hello world"]) == 0
    out, err = capsys.readouterr()
    expected, count = _library_text(path, "hello world", 8)
    assert out == expected + "\n" and expected.strip()
    assert f"generation: {count} tokens" in " ".join(err.split())  # the same tokens, not only the same text


def test_generate_chat_writes_the_librarys_answer(tiny: tuple[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    arch, path = tiny
    if arch == "gemma2":
        pytest.skip("the tiny Gemma 2 file has no chat template")
    assert main(["generate", "--gguf", path, "--chat", "--max-new-tokens", "6", "hello"]) == 0
    assert capsys.readouterr().out == _library_text(path, "hello", 6, chat=True)[0] + "\n"


def test_explain_shows_the_layer_the_model_ran(tiny: tuple[str, str], tmp_path: Path,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The last layer's last head, as trace records it when the model runs the text: the file's architecture
    (Gemma 2's soft-capped scores, Phi-3's window, Qwen 3's normed heads) in the walkthrough."""
    arch, path = tiny
    model = load_gguf(path)
    last, head = len(model.layers) - 1, model.layers[-1].attention.num_heads - 1
    code = main(["explain", "--gguf", path, "hello world", "--layer", str(last), "--head", str(head), "--steps",
                 "softmax", "--json", str(tmp_path / "s.json")])
    out, err = capsys.readouterr()
    assert code == 0, err
    assert f"({arch}: {len(model.layers)} layers x" in " ".join(out.split())
    ids = torch.tensor([model.tokenizer.encode("hello world")])
    with trace(model) as recorded, torch.inference_mode():
        model(ids)
    expected = recorded.records[last].weights[0, head]  # (T, T)
    doc = json.loads((tmp_path / "s.json").read_text())
    shown = torch.tensor(next(s for s in doc["steps"] if s["key"] == "softmax")["tensors"]["weights"]["data"])
    torch.testing.assert_close(shown.reshape(expected.shape), expected, rtol=0, atol=1e-4)


# --- Phi-3's tokenizer, from a file without tokenizer.ggml.add_space_prefix -----------------------------------


@pytest.fixture(scope="module")
def phi3_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("phi3-tok") / "tiny-phi3.gguf"
    phi3.write_tiny_phi3(path, space_prefix=None)
    return path


def _pieces(path: Path, text: str) -> list[str]:
    return [phi3.TOKENS[i] for i in load_gguf(path).tokenizer.encode(text)]


@pytest.mark.parametrize(("text", "pieces"), [
    ("hello world", ["\u2581hello", "\u2581world"]),  # without the prefix: "hello", "\u2581world"
    (" hello", ["\u2581", "\u2581hello"]),
    ("ab 12", ["\u2581", "a", "b", "\u2581", "12"]),
    ("<|endoftext|>hello", ["<|endoftext|>", "\u2581hello"]),  # a space after a special token too
])
def test_a_file_without_the_key_puts_a_space_before_the_text_as_llama_cpp_does(phi3_file: Path, text: str,
                                                                                pieces: list[str]) -> None:
    """llama.cpp's default for a SentencePiece vocabulary is add_space_prefix = true (the key, when present,
    overrides it): the text, and each stretch after a special token, starts with a space."""
    assert _pieces(phi3_file, text) == pieces


def test_decoding_drops_the_space_put_before_the_text(phi3_file: Path) -> None:
    tokenizer = load_gguf(phi3_file).tokenizer
    for text in ("hello world", " hello", "ab 12", "é"):
        assert tokenizer.decode(tokenizer.encode(text)) == text


def test_phi3s_chat_tokens_swallow_the_newline_after_them(phi3_file: Path) -> None:
    """Phi-3's tokenizer.json marks its chat tokens rstrip (llama.cpp sets the same): the template's newlines
    after <|user|>, <|end|> and <|assistant|> are not tokens; <|endoftext|> keeps what follows it."""
    model = load_gguf(phi3_file)
    ids = model.tokenizer.chat_ids([{"role": "user", "content": "hello"}])
    assert [phi3.TOKENS[i] for i in ids] == ["<|user|>", "\u2581hello", "<|end|>", "<|assistant|>"]
    assert _pieces(phi3_file, "<|endoftext|>\nhello") == ["<|endoftext|>", "\u2581", "<0x0A>", "hello"]


def test_the_ids_are_transformers_on_hostile_texts(phi3_file: Path) -> None:
    """transformers' GGUF reader builds Phi-3's tokenizer as its tokenizer.json does (a space prepended to the
    text); on text without special tokens, where it does not differ from llama.cpp, the ids must be its ids."""
    transformers = need("transformers")
    from tests.models.test_tokenizer_reference import TEXTS

    ours = load_gguf(phi3_file).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(str(phi3_file.parent), gguf_file=phi3_file.name)
    for text in [*TEXTS, "hello world", "  two  spaces ", "\n\nhello"]:
        assert ours.encode(text) == theirs.encode(text, add_special_tokens=False), text


@pytest.mark.parametrize(("value", "pieces"), [(False, ["hello", "\u2581world"]), (True, ["\u2581hello",
                                                                                          "\u2581world"])])
def test_the_key_when_present_decides(tmp_path: Path, value: bool, pieces: list[str]) -> None:
    phi3.write_tiny_phi3(tmp_path / "f.gguf", space_prefix=value)
    assert _pieces(tmp_path / "f.gguf", "hello world") == pieces


def test_a_key_that_is_not_a_boolean_is_refused_by_name(tmp_path: Path) -> None:
    phi3.write_tiny_phi3(tmp_path / "f.gguf", space_prefix=None,
                         strings={"tokenizer.ggml.add_space_prefix": "yes"})
    with pytest.raises(ValueError, match=r"tokenizer.ggml.add_space_prefix = 'yes' is not a boolean"):
        load_gguf(tmp_path / "f.gguf")


# --- every weight form and the serving engine, on each architecture (issue 36, item 4) ---------------------------


@pytest.mark.filterwarnings("ignore:quantize.*keep another form")  # tiny heads fit no int4 tile
@pytest.mark.parametrize(("form", "error"), [("float16", 0.01), ("int8", 0.05), ("int4", 0.3)])
def test_every_weight_form_loads_each_architecture_and_generates(tiny: tuple[str, str], form: str,
                                                                 error: float) -> None:
    """The logits within the form's rounding of the float32 model's (a bias, norm or fused tensor lost in a form's
    conversion puts them far off)."""
    from attnkit.modules.quantize import available_forms, weight_form

    if form not in available_forms():
        pytest.skip(f"{form} needs fbgemm's kernels (x86 CPUs: AVX2 or AVX512), which this PyTorch lacks")
    _, path = tiny
    model, reference = load_gguf(path, weights=form), load_gguf(path)
    ids = reference.tokenize("hello world")["input_ids"]
    with torch.inference_mode():
        ours, expected = model(ids), reference(ids)
    assert weight_form(model) == form
    assert torch.linalg.norm(ours - expected) < error * torch.linalg.norm(expected)
    assert model.generate(ids, max_new_tokens=4, stop_ids=[]).shape == (1, ids.shape[1] + 4)


def test_the_serving_engine_answers_each_architecture_as_generate(tiny: tuple[str, str]) -> None:
    """attnkit serve's engine (paged cache, continuous batching) on each file: two prompts at once, each the
    greedy answer generate() gives it alone."""
    from attnkit.models.generation_options import GenerationOptions
    from attnkit.serve import Engine

    _, path = tiny
    model = load_gguf(path)
    engine = Engine(model, model.decode, kv_memory_mib=1, block_size=4)
    prompts = [model.tokenize(text)["input_ids"][0].tolist() for text in ("hello world", "the sin a in the")]
    answers: list[list[int]] = [[], []]
    for i, prompt in enumerate(prompts):
        engine.submit(prompt, GenerationOptions(max_new_tokens=6, stop_ids=[]),
                      lambda event, i=i: answers[i].extend(event.token_ids))
    while not engine.idle:
        engine.step()
    for prompt, answer in zip(prompts, answers, strict=True):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=6, stop_ids=[])[0, len(prompt) :]
        assert answer == alone.tolist()


def test_each_architectures_tokenizer_gives_transformers_ids_on_hostile_texts(tiny: tuple[str, str]) -> None:
    """The SmolLM2 tests' hostile texts (digits, spaces, unicode, code) through each file's tokenizer (Qwen's
    byte-level BPE with its pre-tokenizer, Phi-3's and Gemma 2's SentencePiece) against transformers' GGUF
    tokenizer of the same file."""
    transformers = need("transformers")
    from tests.models.test_tokenizer_reference import TEXTS

    _, path = tiny
    ours = load_gguf(path).tokenizer
    theirs = transformers.AutoTokenizer.from_pretrained(str(Path(path).parent), gguf_file=Path(path).name)
    for text in [*TEXTS, "  two  spaces ", "\n\nhello", "a12b 1212"]:
        assert ours.encode(text) == theirs.encode(text), text  # with the file's BOS where it asks for one (Gemma)
