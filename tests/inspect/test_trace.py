"""attnkit.trace: records every intermediate, changes nothing, and leaves no trace behind."""

from __future__ import annotations

import copy
import dataclasses
import io
from unittest import mock

import pytest
import torch
from torch import nn

import attnkit
from attnkit import MultiHeadAttention
from attnkit import textbook as tb
from attnkit.backends import BACKENDS
from attnkit.backends.call import make_call
from attnkit.backends.math import math_attention


def _same_under_seed(model, x, **kw):
    torch.manual_seed(7)
    plain = model(x, **kw)
    torch.manual_seed(7)
    with attnkit.trace(model) as t:
        traced = model(x, **kw)
    return plain, traced, t


TEXTBOOK = [
    lambda: tb.SelfAttention_v1(4, 3),
    lambda: tb.SelfAttention_v2(4, 3, qkv_bias=True),
    lambda: tb.CausalAttention(4, 3, 8, dropout=0.3),
    lambda: tb.MultiHeadAttentionWrapper(4, 2, 8, dropout=0.3, num_heads=3),
    lambda: tb.MultiHeadAttention(4, 6, 8, dropout=0.3, num_heads=3),
    lambda: tb.PerHeadAttention(4, 2, num_heads=3, d_out=6),
]


@pytest.mark.parametrize("make", TEXTBOOK)
@pytest.mark.parametrize("training", [False, True])
def test_textbook_layers_compute_the_same_while_traced(make, training):
    torch.manual_seed(0)
    layer = make().train(training)
    x = torch.randn(2, 5, 4)
    plain, traced, t = _same_under_seed(layer, x)
    torch.testing.assert_close(traced, plain)
    (record,) = t.records
    b, h, q, s = record.weights.shape
    assert (b, q, s) == (2, 5, 5) and record.scores.shape == record.weights.shape
    torch.testing.assert_close(record.output, plain)
    torch.testing.assert_close(record.weights.sum(-1), torch.ones(b, h, q))
    torch.testing.assert_close(torch.softmax(record.scores, -1), record.weights)
    assert "forward" not in layer.__dict__  # restored after the block
    single = layer(x[0])  # 2-d input still works while traced and after
    assert single.shape == plain.shape[1:]


def test_attnkit_layer_records_match_the_math_backend_and_the_output():
    torch.manual_seed(0)
    layer = MultiHeadAttention(8, 8, 4, num_kv_heads=2, rope=True, qkv_bias=True).eval()
    x = torch.randn(2, 6, 8)
    key_mask = torch.tensor([[True] * 6, [True] * 4 + [False] * 2])
    plain, traced, t = _same_under_seed(layer, x, key_mask=key_mask)
    torch.testing.assert_close(traced, plain)
    (r,) = t.records
    assert r.name == "MultiHeadAttention" and r.keys.shape == (2, 4, 6, 2)  # 2 kv heads repeated to 4
    q, k, v = layer.project(x)
    q, k = layer.rope(q, k)
    call = make_call(q, k, v, mask=key_mask[:, None, None, :], causal=True)
    out, weights = math_attention(call)
    torch.testing.assert_close(r.weights, weights)
    torch.testing.assert_close(r.context, out)
    torch.testing.assert_close(r.queries, q)
    assert torch.isinf(r.scores[1, :, :, 4:]).all()  # padding keys blocked
    merged = r.context.transpose(1, 2).reshape(2, 6, 8)
    torch.testing.assert_close(layer.out_proj(merged), r.output)


def test_records_in_call_order_with_names_and_outer_layers_only():
    torch.manual_seed(0)
    model = nn.ModuleDict({
        "first": MultiHeadAttention(4, 4, 2),
        "second": tb.MultiHeadAttentionWrapper(4, 2, 8, 0.0, num_heads=2),
    })
    x = torch.randn(1, 3, 4)
    with attnkit.trace(model) as t:
        model["second"](x)
        model["first"](x)
        model["second"](x)
    assert [r.name for r in t.records] == ["second", "first", "second"]
    assert len(t.named("second")) == 2 and t.records[0].num_heads == 2  # the wrapper's heads are one record


def test_traced_attnkit_layers_use_math_only_inside_the_block():
    layer = MultiHeadAttention(4, 4, 2, backend="sdpa").eval()
    x = torch.randn(1, 3, 4)
    sdpa = BACKENDS["sdpa"]
    spy = mock.Mock(wraps=sdpa.run)
    with mock.patch.dict(BACKENDS, {"sdpa": dataclasses.replace(sdpa, run=spy)}):
        with attnkit.trace(layer) as t:
            layer(x)
        assert spy.call_count == 0 and len(t) == 1  # the math backend computed it, with every step
        layer(x)
        assert spy.call_count == 1  # the layer's own backend again
    assert len(t) == 1  # nothing recorded after the block


def test_everything_is_restored_even_after_an_error():
    model = nn.Sequential(MultiHeadAttention(4, 4, 2), tb.CausalAttention(4, 4, 8, 0.0))
    with pytest.raises(RuntimeError, match="boom"), attnkit.trace(model):
        raise RuntimeError("boom")
    assert not model[0]._forward_hooks and not model[0]._forward_pre_hooks
    assert "forward" not in model[1].__dict__
    assert not torch.nn.modules.module._global_forward_hooks  # the block's global hooks are gone


def test_need_weights_and_cross_attention_while_traced():
    torch.manual_seed(0)
    layer = attnkit.CrossAttention(4, 4, 2, d_context=6).eval()
    x, context = torch.randn(1, 3, 4), torch.randn(1, 5, 6)
    with attnkit.trace(layer) as t:
        out, weights = layer(x, context, need_weights=True)
    torch.testing.assert_close(weights, t.records[0].weights)
    torch.testing.assert_close(out, layer(x, context))
    assert t.records[0].weights.shape == (1, 2, 3, 5)


def test_trace_needs_a_module():
    with pytest.raises(TypeError, match=r"trace\(\) expects an nn.Module, got str"), attnkit.trace("model"):
        pass


def test_a_textbook_layer_deepcopied_inside_a_trace_is_its_own_plain_copy():
    """Before: the copy kept a forward bound to the original, and stayed traced after the block."""
    torch.manual_seed(0)
    layer = tb.MultiHeadAttention(4, 4, 8, 0.0, num_heads=2)
    x = torch.randn(1, 3, 4)
    with attnkit.trace(layer) as t:
        twin = copy.deepcopy(layer)
        with torch.no_grad():
            for p in twin.parameters():
                p.zero_()
        assert torch.equal(twin(x), torch.zeros(1, 3, 4))  # the copy computes with its own (zero) weights
    assert len(t) == 0  # the copy is not the traced model
    twin(x)
    assert len(t) == 0 and "forward" not in twin.__dict__


def test_torch_save_of_a_model_inside_a_trace():
    """Before: "Can't pickle local object '_attach.<locals>.finish'"."""
    model = nn.Sequential(MultiHeadAttention(4, 4, 2), tb.CausalAttention(4, 4, 8, 0.0))
    buffer = io.BytesIO()
    with attnkit.trace(model):
        torch.save(model, buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=False)
    x = torch.randn(1, 3, 4)
    torch.testing.assert_close(loaded(x), model(x))


@pytest.mark.parametrize("inner", ["same", "submodule"])
def test_nested_traces_both_record(inner):
    """Before: IndexError on the next forward, or the outer trace silently recorded nothing."""
    torch.manual_seed(0)
    model = nn.Sequential(MultiHeadAttention(4, 4, 2), tb.MultiHeadAttention(4, 4, 8, 0.0, num_heads=2))
    x = torch.randn(1, 3, 4)
    with attnkit.trace(model) as outer:
        with attnkit.trace(model if inner == "same" else model[1]) as nested:
            model(x)
        model(x)
    assert [r.name for r in outer.records] == ["0", "1", "0", "1"]
    assert [r.name for r in nested.records] == (["0", "1"] if inner == "same" else ["MultiHeadAttention"])
    torch.testing.assert_close(nested.records[-1].weights, outer.records[1].weights)


def test_subclasses_of_textbook_classes_are_traced():
    class MyAttention(tb.CausalAttention):
        pass

    torch.manual_seed(0)
    layer = MyAttention(4, 4, 8, 0.0)
    with attnkit.trace(layer) as t:
        out = layer(torch.randn(1, 3, 4))
    (record,) = t.records
    torch.testing.assert_close(record.output, out)


def test_a_function_calling_attention_outside_any_attnkit_module_is_traced():
    """As a Hugging Face attention module running on attnkit does: the module is not attnkit's."""

    class ForeignAttention(nn.Module):
        def forward(self, q, k, v):
            return attnkit.attention(q, k, v, causal=True, backend="sdpa")

    model = nn.ModuleDict({"block": ForeignAttention()})
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    with attnkit.trace(model) as t:
        out = model["block"](q, k, v)
    (record,) = t.records
    assert record.name == "block" and record.keys.shape == (1, 4, 5, 8)
    torch.testing.assert_close(record.context, out)
    torch.testing.assert_close(record.context, attnkit.attention(q, k, v, causal=True, backend="math"))
    with attnkit.trace() as everything:  # no model: every call in the block
        attnkit.attention(q, k, v)
    assert [r.name for r in everything.records] == ["attention"]


def test_tracing_keeps_no_slot_on_layers():
    """Layers carry nothing for tracing (the old MultiHeadAttention held an observer): tracing a layer leaves its
    attributes, its state dict and its output exactly as they were, and a copy made after tracing records nothing."""
    import copy

    torch.manual_seed(0)
    layer = MultiHeadAttention(4, 4, 2).eval()
    x = torch.randn(1, 3, 4)
    before_attrs, before_state, before_out = dict(vars(layer)), copy.deepcopy(layer.state_dict()), layer(x)
    with attnkit.trace(layer) as t:
        layer(x)
    assert len(t.records) == 1
    assert dict(vars(layer)).keys() == before_attrs.keys()
    assert all(vars(layer)[k] is v for k, v in before_attrs.items() if k != "_forward_hooks")
    torch.testing.assert_close(layer.state_dict(), before_state)
    torch.testing.assert_close(layer(x), before_out)
    twin = copy.deepcopy(layer)
    with attnkit.trace(layer) as t:
        twin(x)  # not the traced layer: nothing is recorded through a slot the copy carried over
    assert t.records == []


def test_another_thread_running_modules_does_not_drop_records():
    """Review finding: frames pushed by other threads left this trace's records unflushed ([] instead of 2)."""
    import threading

    model = nn.Sequential(MultiHeadAttention(8, 8, 2), MultiHeadAttention(8, 8, 2)).eval()
    other = nn.Sequential(MultiHeadAttention(8, 8, 2)).eval()
    x = torch.randn(1, 6, 8)
    stop = threading.Event()

    def busy() -> None:
        with torch.no_grad():
            while not stop.is_set():
                other(x)

    worker = threading.Thread(target=busy)
    worker.start()
    try:
        for _ in range(10):
            with attnkit.trace(model) as t:
                model(x)
            assert [r.name for r in t.records] == ["0", "1"]
    finally:
        stop.set()
        worker.join()


def test_a_module_returning_a_dict_is_traced():
    class Net(nn.Module):
        def forward(self, q):
            return {"out": attnkit.attention(q, q, q, causal=True)}

    q = torch.randn(1, 2, 4, 8)
    net = Net()
    with attnkit.trace(net) as t:
        out = net(q)
    torch.testing.assert_close(t.records[0].output, out["out"])  # the attention output stands in


def test_a_textbook_layer_called_with_a_keyword_input_is_traced():
    torch.manual_seed(0)
    layer = tb.MultiHeadAttention(8, 8, 10, 0.0, 2).eval()
    with attnkit.trace(layer) as t:
        out = layer(x=torch.randn(1, 4, 8))
    torch.testing.assert_close(t.records[0].output, out)


def test_a_textbook_subclass_that_overrides_forward_is_not_recorded_as_the_base_class():
    """Its output would be the base class's steps, not what the layer computed (silently wrong)."""

    class Hot(tb.CausalAttention):
        def forward(self, x):
            return super().forward(x * 3.0)

    torch.manual_seed(0)
    layer = Hot(8, 8, 6, 0.0).eval()
    x = torch.randn(1, 6, 8)
    with attnkit.trace(layer) as t:
        out = layer(x)
    assert all(torch.allclose(r.output, out) for r in t.records)  # nothing recorded that the layer did not compute
