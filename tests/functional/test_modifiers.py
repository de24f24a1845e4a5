"""The built-in score and mask modifiers (src/attnkit/functional/modifiers.py).

Each built-in is checked against torch's FlexAttention (eager, CPU, forward),
against the independent float64 reference of tests/backends/test_modifiers.py
(forward and gradients, learned tensors included), by gradcheck through the
chunked kernel, and its block rule against the mask it describes.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.nn.attention.flex_attention import create_block_mask, flex_attention

from attnkit import attention
from attnkit.functional import (
    Visibility,
    alibi,
    alibi_slopes,
    and_masks,
    causal,
    document_mask,
    document_positions,
    or_masks,
    prefix_lm,
    sink_window,
    sliding_window,
    softcap,
)
from attnkit.functional.modifiers import AndMasks, Band, KeysBefore, block_rule_of
from tests.backends.test_modifiers import blocks_of, reference

B, H, G, T, S = 2, 4, 2, 6, 9  # the queries are positions 3 .. 8 of 9

_SORTED = torch.tensor([0, 0, 0, 1, 1, 1, 1, 2, 2])
_PER_ROW = torch.tensor([[0, 0, 1, 1, 1, 2, 2, 2, 2], [0, 0, 0, 0, 0, 0, 1, 1, 1]])


def _learned(values: list[float]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float64, requires_grad=True)


def built_ins() -> dict[str, tuple]:
    """name -> (score_mod, mask_mod, the tensors that require grad in them); fresh each time."""
    slopes, caps = _learned([0.5, 0.25, 0.1, 0.05]), _learned([1.0, 2.0, 0.5, 3.0])
    return {
        "alibi": (alibi(H), None, []),
        "learned alibi": (alibi(slopes=slopes), causal(), [slopes]),
        "softcap": (softcap(0.8), None, []),
        "learned softcap": (softcap(caps), sliding_window(3), [caps]),
        "causal": (None, causal(), []),
        "sliding_window": (None, sliding_window(2), []),
        "document_mask": (None, document_mask(_SORTED), []),
        "document_mask per row, prefix_lm inside": (None, document_mask(_PER_ROW, prefix_lm(2)), []),
        "prefix_lm": (None, prefix_lm(5), []),
        "prefix_lm per row": (None, prefix_lm(torch.tensor([0, 6])), []),
        "sink_window": (None, sink_window(2, 2), []),
        "and_masks": (None, and_masks(causal(), document_mask(_SORTED)), []),
        "or_masks": (None, or_masks(sliding_window(1), prefix_lm(2)), []),
    }


NAMES = list(built_ins())


def _qkv(seed: int = 0) -> tuple[torch.Tensor, ...]:
    gen = torch.Generator().manual_seed(seed)
    return tuple(torch.randn(shape, generator=gen, dtype=torch.float64).requires_grad_()
                 for shape in ((B, H, T, 4), (B, G, S, 4), (B, G, S, 3)))


def _flex(q, k, v, score_mod, mask_mod):
    """FlexAttention with attnkit's positions: its q_idx counts from 0, attnkit's from S - T."""
    shift = k.shape[2] - q.shape[2]
    flex_score = None if score_mod is None else (lambda s, b, h, qi, ki: score_mod(s, b, h, qi + shift, ki))
    block_mask = None
    if mask_mod is not None:
        block_mask = create_block_mask(lambda b, h, qi, ki: mask_mod(b, h, qi + shift, ki), q.shape[0], q.shape[1],
                                       q.shape[2], k.shape[2], device="cpu")
    return flex_attention(q, k, v, score_mod=flex_score, block_mask=block_mask, enable_gqa=True)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("name", NAMES)
def test_every_built_in_equals_flex_attention(name):
    score_mod, mask_mod, _ = built_ins()[name]
    q, k, v = (x.detach() for x in _qkv())
    with torch.no_grad():
        expected = _flex(q, k, v, score_mod, mask_mod)
    for backend in ("math", "chunked", "auto"):
        with blocks_of(2, 3):
            out = attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend=backend)
        torch.testing.assert_close(out, expected, msg=lambda m, b=backend: f"{b}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_every_built_in_equals_the_reference_with_gradients(name):
    """Forward and the gradients of q, k, v and the learned tensors, math and chunked (2 x 3 blocks)."""
    score_mod, mask_mod, learned = built_ins()[name]
    q, k, v = _qkv(1)
    inputs = (q, k, v, *learned)
    expected = reference(q, k, v, score_mod=score_mod, mask_mod=mask_mod)
    dout = torch.randn_like(expected)
    want = torch.autograd.grad(expected, inputs, dout)
    for backend in ("math", "chunked"):
        with blocks_of(2, 3):
            out = attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend=backend)
            got = torch.autograd.grad(out, inputs, dout)
        torch.testing.assert_close(out, expected, msg=lambda m, b=backend: f"{b}: {m}")
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            torch.testing.assert_close(g, w, msg=lambda m, b=backend, i=i: f"{b}, gradient {i}: {m}")


@pytest.mark.parametrize("name", NAMES)
def test_gradcheck_of_every_built_in_through_chunked(name):
    score_mod, mask_mod, learned = built_ins()[name]
    q, k, v = (x[:, :, -t:, :2] for x, t in zip(_qkv(2), (3, 5, 5), strict=True))  # 3 queries, 5 keys, D = 2
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    with blocks_of(2, 3):
        assert torch.autograd.gradcheck(
            lambda q, k, v, *_: attention(q, k, v, score_mod=score_mod, mask_mod=mask_mod, backend="chunked"),
            (q, k, v, *learned), fast_mode=True)


# ----------------------------------------------------------------------------- block rules


@st.composite
def masks_and_blocks(draw):
    """A built-in mask (perhaps combined, perhaps with members that have no rule), its batch size, and a block
    of (query positions, key positions)."""
    b = draw(st.integers(1, 2))
    s = draw(st.integers(2, 12))
    gen = torch.Generator().manual_seed(draw(st.integers(0, 999)))
    ids = (torch.rand(b, s, generator=gen) < 0.3).cumsum(-1)
    lengths = torch.randint(0, s + 1, (b,), generator=gen)
    pieces = [causal(), sliding_window(draw(st.integers(1, 4))), prefix_lm(draw(st.integers(0, s))),
              prefix_lm(lengths), KeysBefore(draw(st.integers(0, s)), "length"), KeysBefore(lengths, "lengths"),
              sink_window(draw(st.integers(1, 3)), draw(st.integers(1, 3))), document_mask(ids),
              document_mask(ids[0]), document_mask(torch.randint(0, 3, (s,), generator=gen)),  # ids that come back
              document_mask(ids, causal())]  # nested: NONE only
    mask = draw(st.sampled_from(pieces))
    for _ in range(draw(st.integers(0, 2))):
        mask = draw(st.sampled_from([and_masks, or_masks]))(mask, draw(st.sampled_from(pieces)))
    q0, q1 = sorted(draw(st.lists(st.integers(0, s), min_size=2, max_size=2, unique=True)))
    k0, k1 = sorted(draw(st.lists(st.integers(0, s), min_size=2, max_size=2, unique=True)))
    return mask, b, s, range(q0, q1), range(k0, k1)


@given(case=masks_and_blocks())
@settings(max_examples=500, deadline=None)
def test_a_block_rule_never_contradicts_its_mask(case):
    """NONE: nothing in the block is visible (the chunked kernel skips it unseen); ALL: everything is (the mask
    is not applied); SOME: something is. A wrong NONE or ALL would silently change outputs."""
    mask, b, s, qs, ks = case
    rule = mask.block_rule(b, range(s), range(s))
    if rule is None:
        return
    verdict = rule(qs, ks)
    idx = (torch.arange(b).view(-1, 1, 1, 1), torch.zeros(1, 1, 1, 1, dtype=torch.long),
           torch.arange(qs.start, qs.stop).view(1, 1, -1, 1), torch.arange(ks.start, ks.stop).view(1, 1, 1, -1))
    seen = mask(*idx).expand(b, 1, len(qs), len(ks))
    if verdict is Visibility.NONE:
        assert not seen.any()
    elif verdict is Visibility.ALL:
        assert seen.all()
    elif verdict is Visibility.SOME:
        assert seen.any()


def test_combined_verdicts_are_sound_where_members_are_partial_or_unknown():
    """Two partly visible masks may not overlap, so their intersection is unknown, not SOME; a union with
    one partly visible member is SOME; an unknown member leaves a union of hidden ones unknown."""
    none, some, every = Visibility.NONE, Visibility.SOME, Visibility.ALL
    both = and_masks(causal(), causal())
    assert both.combine([some, some]) is None
    assert both.combine([some, every]) is some and both.combine([every, every]) is every
    assert both.combine([None, none]) is none and both.combine([None, every]) is None
    either = or_masks(causal(), causal())
    assert either.combine([some, some]) is some and either.combine([some, None]) is some
    assert either.combine([none, None]) is None and either.combine([none, none]) is none
    assert either.combine([None, every]) is every


@pytest.mark.parametrize("ids", [[0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 0, 0]])
def test_documents_get_an_exact_rule_whatever_their_ids(ids):
    """A document is a run, so documents are in order along the sequence whether or not their ids are sorted;
    the first and last of [0, 0, 1, 1, 0, 0] are two documents, with nothing visible between them."""
    rule = document_mask(torch.tensor(ids)).block_rule(1, range(6), range(6))
    assert rule(range(0, 2), range(0, 2)) is Visibility.ALL
    assert rule(range(0, 2), range(2, 4)) is Visibility.NONE
    assert rule(range(1, 3), range(0, 4)) is Visibility.SOME
    assert rule(range(4, 6), range(0, 2)) is Visibility.NONE


def test_a_subclass_keeps_an_inherited_block_rule_only_while_the_rule_speaks_for_its_call():
    """A rule describes the call of the class that defines it (or of a subclass of it): a subclass that
    overrides __call__ alone has no rule, alone or inside and_masks; one that overrides both keeps its own."""

    class Renamed(Band):
        def __repr__(self):
            return "renamed"

    class Wider(Band):
        def __call__(self, b, h, q_idx, kv_idx):
            return super().__call__(b, h, q_idx, kv_idx) | (kv_idx == 0)

    class WiderWithRule(Wider):
        def block_rule(self, batch, q_positions, kv_positions):
            return lambda qs, ks: Visibility.SOME

    class Both(AndMasks):
        def __call__(self, b, h, q_idx, kv_idx):
            return super().__call__(b, h, q_idx, kv_idx) | (kv_idx == 0)

    def rule(mask):
        return block_rule_of(mask, 1, range(6), range(6))

    assert rule(Renamed())(range(0, 2), range(4, 6)) is Visibility.NONE
    assert rule(Wider()) is None and and_masks(Wider()).block_rule(1, range(6), range(6)) is None
    assert rule(WiderWithRule())(range(0, 2), range(4, 6)) is Visibility.SOME
    assert rule(and_masks(causal(), causal()))(range(0, 2), range(4, 6)) is Visibility.NONE
    assert rule(Both((causal(), causal()))) is None
    assert rule(lambda b, h, q_idx, kv_idx: kv_idx <= q_idx) is None


# ----------------------------------------------------------------------------- values of the built-ins


def test_alibi_slopes_are_the_papers():
    """Powers of two: 2^(-8/n) .. 2^-8; other counts interleave the next power's odd slopes (the values of
    BLOOM's build_alibi_tensor)."""
    torch.testing.assert_close(alibi_slopes(8), torch.tensor([2.0 ** -i for i in range(1, 9)]))
    torch.testing.assert_close(alibi_slopes(6), torch.tensor([2.0 ** -2, 2.0 ** -4, 2.0 ** -6, 2.0 ** -8,
                                                              2.0 ** -1, 2.0 ** -3]))
    torch.testing.assert_close(alibi_slopes(12)[8:], torch.tensor([2 ** -0.5, 2 ** -1.5, 2 ** -2.5, 2 ** -3.5]))


def test_alibi_penalises_distance_per_head():
    q, k, v = torch.zeros(1, 2, 1, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)  # scores all 0
    _, weights = attention(q, k, v, score_mod=alibi(2), return_weights=True)
    for h, slope in enumerate(alibi_slopes(2).tolist()):
        expected = torch.softmax(torch.tensor([-2.0, -1.0, 0.0]) * slope, dim=0)  # the query is at position 2
        torch.testing.assert_close(weights[0, h, 0], expected)


def test_softcap_bounds_the_scores():
    q, k, v = torch.full((1, 1, 1, 4), 10.0), torch.full((1, 1, 2, 4), 10.0), torch.randn(1, 1, 2, 4)
    k[0, 0, 1] = -10.0  # scores 200 and -200
    _, weights = attention(q, k, v, score_mod=softcap(1.0), return_weights=True)
    expected = torch.softmax(torch.tensor([math.tanh(200.0), math.tanh(-200.0)]), dim=0)
    torch.testing.assert_close(weights[0, 0, 0], expected)


def test_document_positions_restart_at_each_run():
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 0, 0], [5, 5, 5, 5, 5, 5, 5, 5]])
    expected = torch.tensor([[0, 1, 2, 0, 1, 0, 0, 1], [0, 1, 2, 3, 4, 5, 6, 7]])
    assert torch.equal(document_positions(ids), expected)
    assert torch.equal(document_positions(ids[0]), expected[0])


@pytest.mark.parametrize("backend", ["math", "chunked"])
@pytest.mark.parametrize("queries", [6, 2])
def test_a_document_is_a_run_of_equal_ids_so_an_id_that_comes_back_starts_another(backend, queries):
    """Each row holds three documents, as document_positions counts them: no query sees another run's keys,
    though they share its id, and prefix_lm(1) nested inside sees no future token of a later run (its
    positions restart there). The whole sequence, and its last two queries (decoding, positions 4 and 5)."""
    ids = torch.tensor([[0, 0, 1, 1, 0, 0], [3, 3, 3, 5, 3, 3]])
    runs = torch.tensor([[0, 0, 1, 1, 2, 2], [0, 0, 0, 1, 2, 2]])
    visible = (runs[:, :, None] == runs[:, None, :]) & torch.ones(6, 6, dtype=torch.bool).tril()  # (B, S, S)

    def expected_mask(b, h, q_idx, kv_idx):
        return visible[b, q_idx, kv_idx]

    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(2, 2, 6, 3, generator=gen, dtype=torch.float64) for _ in range(3))
    q = q[:, :, -queries:]
    expected = reference(q, k, v, mask_mod=expected_mask)
    for mask in (and_masks(causal(), document_mask(ids)), document_mask(ids, prefix_lm(1))):
        with blocks_of(2, 2):
            out = attention(q, k, v, mask_mod=mask, backend=backend)
        torch.testing.assert_close(out, expected, msg=lambda m, mask=mask: f"{mask!r}: {m}")


def test_a_mask_nested_in_a_document_sees_positions_that_restart_there():
    """prefix_lm(2) inside each document: the second document's first two tokens (positions 3 and 4) see each
    other both ways, as the first document's (positions 0 and 1) do; nothing crosses documents."""
    ids = torch.tensor([0, 0, 0, 1, 1, 1])
    q, k, v = torch.randn(1, 1, 6, 2), torch.randn(1, 1, 6, 2), torch.randn(1, 1, 6, 2)
    _, weights = attention(q, k, v, mask_mod=document_mask(ids, prefix_lm(2)), return_weights=True)
    one = torch.tensor([[1, 1, 0], [1, 1, 0], [1, 1, 1]], dtype=torch.bool)  # prefix of 2, then causal
    expected = torch.block_diag(one, one)
    assert torch.equal(weights[0, 0] > 0, expected)


def test_sink_window_sees_the_first_tokens_and_a_recent_window():
    q, k, v = torch.zeros(1, 1, 6, 2), torch.randn(1, 1, 6, 2), torch.randn(1, 1, 6, 2)
    _, weights = attention(q, k, v, mask_mod=sink_window(1, 2), return_weights=True)
    expected = torch.tensor([[1, 0, 0, 0, 0, 0], [1, 1, 0, 0, 0, 0], [1, 1, 1, 0, 0, 0],
                             [1, 0, 1, 1, 0, 0], [1, 0, 0, 1, 1, 0], [1, 0, 0, 0, 1, 1]], dtype=torch.bool)
    assert torch.equal(weights[0, 0] > 0, expected)


# ----------------------------------------------------------------------------- bad arguments


@pytest.mark.parametrize(("make", "error", "message"), [
    (lambda: alibi(0), ValueError, r"num_heads must be an int >= 1, got num_heads=0"),
    (lambda: alibi(4, slopes=torch.ones(4)), ValueError, r"alibi takes either num_heads .* or slopes=, not both"),
    (lambda: alibi(), ValueError, r"alibi takes either num_heads"),
    (lambda: alibi(slopes=torch.ones(2, 2)), ValueError, r"alibi slopes must be a floating-point \(H,\) tensor"),
    (lambda: softcap(0.0), ValueError, r"softcap's cap must be a positive finite number, got cap=0.0"),
    (lambda: softcap(True), ValueError, r"got cap=True"),
    (lambda: softcap(torch.ones(2, 2)), ValueError, r"or one per head \(H,\); got a torch.float32 tensor of shape"),
    (lambda: sliding_window(0), ValueError, r"window must be an int >= 1, got window=0"),
    (lambda: sink_window(0, 4), ValueError, r"sinks must be an int >= 1, got sinks=0"),
    (lambda: sink_window(2, 0), ValueError, r"window must be an int >= 1, got window=0"),
    (lambda: prefix_lm(-1), ValueError, r"prefix_length must be an int >= 0, got prefix_length=-1"),
    (lambda: prefix_lm(torch.ones(2)), ValueError, r"prefix_length must be an int or an integer \(B,\) tensor"),
    (lambda: document_mask(torch.zeros(4)), ValueError, r"doc_ids must be an integer tensor \(S,\) or \(B, S\)"),
    (lambda: document_mask(torch.zeros(1, 2, 4, dtype=torch.long)), ValueError, r"got torch.int64 \(1, 2, 4\)"),
    (lambda: document_mask(torch.zeros(4, dtype=torch.long), 3), TypeError, r"document_mask's mask_mod must be"),
    (lambda: and_masks(causal(), 3), TypeError, r"and_masks takes mask modifiers, .* argument 1 is int"),
    (lambda: or_masks(), ValueError, r"or_masks needs at least one mask modifier"),
])
def test_bad_arguments_name_what_was_expected(make, error, message):
    with pytest.raises(error, match=message):
        make()
