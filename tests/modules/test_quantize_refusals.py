"""What quantize() and packed layers refuse or report: fallbacks named, errors before any swap, copies of
fbgemm's opaque matrix, other dtypes and devices."""

from __future__ import annotations

import copy
import io
import re

import pytest
import torch
from torch import nn

from attnkit import KVCache
from attnkit.models import LlamaConfig, LlamaModel
from attnkit.modules.packed import Float16Linear, Int4Linear, Int8Linear, PackedLinear
from attnkit.modules.quantize import quantize, weight_form


def _tiny(d_model: int = 64, ffn_size: int = 128) -> LlamaModel:
    torch.manual_seed(0)
    return LlamaModel(LlamaConfig(vocab_size=48, d_model=d_model, num_layers=2, num_heads=4, num_kv_heads=2,
                                  ffn_size=ffn_size, context_length=32)).eval()


IDS = torch.tensor([[1, 5, 9, 2]])


@pytest.mark.parametrize("form", ["float16", "int4"])
def test_fbgemms_opaque_matrix_is_never_saved_loaded_or_copied(form: str) -> None:
    """Its bytes are a pointer to a C++ object: a state_dict copied into another model made two owners of one
    object (a double free, the process killed). Each way of copying it is refused by name."""
    saved, other = quantize(_tiny(), form), quantize(_tiny(), form)
    with torch.inference_mode():
        before = saved(IDS)
    for what, action in [("saved to a state_dict", saved.state_dict),
                         ("deep-copied", lambda: copy.deepcopy(saved)),
                         ("pickled", lambda: torch.save(saved, io.BytesIO()))]:
        with pytest.raises(ValueError, match=re.escape(f"cannot be {what}")):
            action()
    with pytest.raises(ValueError, match="cannot be loaded from a state_dict"):
        other.load_state_dict(_tiny().state_dict(), strict=False)
    with torch.inference_mode():
        torch.testing.assert_close(saved(IDS), before, rtol=0, atol=0)  # the refusals left it working


def test_layers_a_form_cannot_hold_are_named_in_a_warning_and_a_model_with_none_is_refused() -> None:
    model = nn.Sequential(nn.Linear(24, 16), nn.Linear(16, 16))
    with pytest.warns(UserWarning, match=r"1 of 2 linear layers keep another form: 0 \(float32: inputs not a "
                                         r"multiple of 16"):
        quantize(model, "int8")
    assert type(model[0]) is nn.Linear and isinstance(model[1], Int8Linear) and weight_form(model) == "int8"
    odd = _tiny(d_model=40, ffn_size=56)  # no width a multiple of 16: int8 fits nothing
    with pytest.raises(ValueError, match=r"none of the model's 9 linear layers can take int8 weights: "
                                         r"layers\.0\.attention\.out_proj \(float32: inputs not a multiple of 16.*"
                                         r"and 6 more"):
        quantize(odd, "int8")
    assert weight_form(odd) == "float32" and not any(isinstance(m, PackedLinear) for m in odd.modules())
    with pytest.warns(UserWarning, match=r"8 of 9 linear layers keep another form: layers\.0\.attention\.out_proj "
                                         r"\(float32: sizes outside int4's tiles .*; inputs not a multiple of 16,"):
        quantize(_tiny(d_model=40, ffn_size=56), "int4")  # only the tied head is packed (float16, by design)
    with pytest.raises(ValueError, match=r"given a single nn\.Linear: wrap it"):
        quantize(nn.Linear(64, 64), "int4")
    with pytest.raises(ValueError, match=r"no nn\.Linear layer to take int8 weights"):
        quantize(nn.Sequential(nn.ReLU()), "int8")


def test_float16_refuses_magnitudes_it_would_clip() -> None:
    weight = torch.randn(16, 32)
    weight[0, 0] = 1e6
    with pytest.raises(ValueError, match=r"up to 65504; this weight reaches 1e\+06 \(it would be clipped\)"):
        Float16Linear(weight)
    model = nn.Sequential(nn.Linear(32, 16), nn.Linear(16, 16))
    with torch.no_grad():
        model[0].weight.copy_(weight)
    x = torch.randn(3, 32)
    reference = model(x).detach()
    with pytest.warns(UserWarning, match=r"0 \(float32: weights beyond float16's range"):
        quantize(model, "float16")
    assert type(model[0]) is nn.Linear and isinstance(model[1], Float16Linear)
    torch.testing.assert_close(model(x), reference, rtol=1e-3, atol=1e-3)  # not clipped: 4e5 stays 4e5


def test_an_error_while_packing_leaves_the_model_whole_and_parts_count_as_quantized() -> None:
    model = _tiny()
    wrong = (torch.zeros(8, 32, dtype=torch.int32), torch.ones(8, 1), torch.zeros(8, 1))
    with pytest.raises(ValueError, match="another layer's"):
        quantize(model, "int4", grids={"layers.1.mlp.down_proj": wrong})  # the last layer fails to build
    assert not any(isinstance(m, PackedLinear) for m in model.modules()) and weight_form(model) == "float32"
    quantize(model.layers[0], "int8")
    with pytest.raises(ValueError, match=r"already quantized \(4 packed layers: \['layers\.0\.attention\.out_proj'"):
        quantize(model, "int4")
    whole = quantize(_tiny(), "int4")
    with pytest.raises(ValueError, match="already quantized"):
        quantize(nn.ModuleList([whole]), "int8")


def test_a_model_off_the_cpu_is_refused_before_packing() -> None:
    with torch.device("meta"):
        model = _tiny()
    with pytest.raises(ValueError, match=r"CPU kernels, and this model's linear layers are on \['meta'\]"):
        quantize(model, "int4")


@pytest.mark.parametrize("form", ["float16", "int8", "int4"])
def test_a_quantized_model_keeps_float32_and_the_cpu(form: str) -> None:
    model = quantize(_tiny(), form)
    with torch.inference_mode():
        before = model(IDS)
        torch.testing.assert_close(model.float()(IDS), before, rtol=0, atol=0)  # float32: nothing to change
        torch.testing.assert_close(model.to("cpu", torch.float32)(IDS), before, rtol=0, atol=0)
    assert model.embed.table.dtype == torch.float16  # .float() kept the table in half the bytes
    packed = next(m for m in model.modules() if isinstance(m, (Int4Linear, Int8Linear) if form != "float16"
                                                             else Float16Linear))
    with pytest.raises(ValueError, match=rf"{form} weights computes in float32 and cannot be converted to "
                                         r"torch\.float16"):
        packed.half()
    with pytest.raises(ValueError, match=rf"{form} weights runs PyTorch's CPU kernels and cannot move to meta"):
        packed.to("meta")


@pytest.mark.parametrize("convert", [lambda m: m.half(), lambda m: m.to(torch.bfloat16), lambda m: m.to("meta")],
                         ids=["half", "bfloat16", "meta"])
def test_a_refused_conversion_leaves_every_module_as_it_was(convert) -> None:
    """The model refuses before any module converts: nn.Module._apply visits the embedding and the first norm
    before the first packed layer, and a refusal from that layer alone left them converted."""
    model = quantize(_tiny(), "int8")
    before = {name: t.clone() for name, t in [*model.named_parameters(), *model.named_buffers()]}
    with pytest.raises(ValueError, match="int8 weights"):
        convert(model)
    after = dict([*model.named_parameters(), *model.named_buffers()])
    assert after.keys() == before.keys()
    for name, tensor in before.items():
        torch.testing.assert_close(after[name], tensor, rtol=0, atol=0, msg=name)  # dtype and device checked too


def test_new_caches_names_every_dtype_it_takes() -> None:
    """With KVCache's own message (new_caches had a second check of the same dtypes, worded apart)."""
    with pytest.raises(ValueError, match=r"torch\.bfloat16, torch\.float16, torch\.int8, got dtype=torch\.uint8"
                       ) as got:
        _tiny().new_caches(dtype=torch.uint8)
    with pytest.raises(ValueError) as expected:
        KVCache(dtype=torch.uint8)
    assert str(got.value) == str(expected.value)
