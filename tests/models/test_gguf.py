"""GGUF reading and the Llama loader, on tiny files written by the test (no download, milliseconds)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests._util import need
from tests.models._decoder import llama_cpp_permute, write_tiny_llama

need("gguf")
need("tokenizers")

from attnkit.models import LlamaConfig, load_gguf  # noqa: E402
from attnkit.models.gguf import read_gguf, unpermute_rows  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, np.ndarray]]:
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    return path, write_tiny_llama(path)


@pytest.mark.parametrize(("rows", "heads"), [(8, 1), (24, 3), (64, 4)])
def test_unpermute_inverts_llama_cpp_permute(rows: int, heads: int) -> None:
    """A wrong reshape order (D/2, 2 vs 2, D/2) would scramble the rotary pairs."""
    w = np.arange(rows * 5, dtype=np.float32).reshape(rows, 5)
    permuted = llama_cpp_permute(w, heads)
    assert not np.array_equal(permuted, w)
    np.testing.assert_array_equal(unpermute_rows(permuted, heads), w)


def test_unpermute_rejects_rows_not_split_into_even_heads() -> None:
    with pytest.raises(ValueError, match="10 rows into 3 heads"):
        unpermute_rows(np.zeros((10, 2), dtype=np.float32), 3)


def test_loader_puts_unpermuted_q_k_v_into_fused_qkv(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    """Q rows, then K rows, then V rows, each back in half-split order; gate and up fused likewise."""
    path, weights = tiny
    model: Any = load_gguf(path)
    for i in range(2):
        expected = np.concatenate([weights[f"blk.{i}.attn_{n}.weight"] for n in "qkv"])
        torch.testing.assert_close(model.layers[i].attention.qkv_proj.weight, torch.from_numpy(expected))
        gate_up = np.concatenate([weights[f"blk.{i}.ffn_gate.weight"], weights[f"blk.{i}.ffn_up.weight"]])
        torch.testing.assert_close(model.layers[i].mlp.gate_up_proj.weight, torch.from_numpy(gate_up))
        torch.testing.assert_close(model.layers[i].attention.out_proj.weight,
                                   torch.from_numpy(weights[f"blk.{i}.attn_output.weight"]))
    torch.testing.assert_close(model.embed.weight, torch.from_numpy(weights["token_embd.weight"]))
    assert model.lm_head.weight is model.embed.weight  # no output.weight in the file: the head is tied
    assert not model.training


def test_loader_reads_config_from_metadata(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    model: Any = load_gguf(tiny[0])
    assert model.config == LlamaConfig(vocab_size=265, d_model=32, num_layers=2, num_heads=4, num_kv_heads=2,
                                       ffn_size=48, context_length=64, rope_base=10000.0,
                                       norm_eps=model.config.norm_eps, tie_embeddings=True)
    assert model.config.norm_eps == pytest.approx(1e-5)
    attn = model.layers[0].attention
    assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == (4, 2, 8)
    assert attn.rope is not None and attn.rope.base == 10000.0


@pytest.mark.filterwarnings("ignore::attnkit.cpu.SlowDtypeWarning")  # CPUs without bfloat16 (test_loader)
def test_loader_casts_to_dtype(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    model = load_gguf(tiny[0], dtype=torch.bfloat16)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert model(torch.tensor([[5, 6]])).dtype == torch.bfloat16


def test_loader_reports_progress(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    calls: list[tuple[int, int]] = []
    load_gguf(tiny[0], progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (3, 3) and [d for d, _ in calls] == sorted(d for d, _ in calls)


def test_bad_dtype_is_named(tiny: tuple[Path, dict[str, np.ndarray]]) -> None:
    with pytest.raises(ValueError, match=r"torch\.int64"):
        load_gguf(tiny[0], dtype=torch.int64)


def test_other_architecture_is_named_with_the_registered_ones_and_what_a_registration_needs(tmp_path: Path) -> None:
    path = tmp_path / "falcon.gguf"
    write_tiny_llama(path, arch="falcon")
    with pytest.raises(ValueError, match=r"architecture 'falcon' is not supported \(general.architecture\); "
                                         r"supported: llama, gemma3, gemma2, phi3, qwen2, qwen3; a registration "
                                         r".* needs the architecture's config reader"):
        load_gguf(path)


def test_truncated_file_is_an_error(tiny: tuple[Path, dict[str, np.ndarray]], tmp_path: Path) -> None:
    data = tiny[0].read_bytes()
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"cut\.gguf"):
        load_gguf(cut)


def test_not_a_gguf_file_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "notes.gguf"
    path.write_text("hello, I am not a model\n" * 20)
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        read_gguf(path)


def test_missing_file_is_file_not_found(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"nothing\.gguf"):
        load_gguf(tmp_path / "nothing.gguf")


def test_missing_tensor_is_named(tmp_path: Path) -> None:
    path = tmp_path / "holes.gguf"
    write_tiny_llama(path, drop=("blk.1.ffn_up.weight",))
    with pytest.raises(ValueError, match=r"blk\.1\.ffn_up\.weight"):
        load_gguf(path)


def test_unknown_tensor_is_named(tmp_path: Path) -> None:
    path = tmp_path / "extra.gguf"
    write_tiny_llama(path, extra={"rope_freqs.weight": np.ones(4, dtype=np.float32)})
    with pytest.raises(ValueError, match=r"rope_freqs\.weight"):
        load_gguf(path)


def test_unsupported_tensor_type_is_named(tiny: tuple[Path, dict[str, np.ndarray]],
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    """A type gguf cannot dequantise: the error names the tensor and its type."""
    gguf = need("gguf")

    def refuse(data: np.ndarray, qtype: object) -> np.ndarray:
        raise NotImplementedError(f"Dequantization for {qtype} is not yet implemented")

    monkeypatch.setattr(gguf, "dequantize", refuse)
    with pytest.raises(ValueError, match=r"token_embd.weight.*type F32"):
        load_gguf(tiny[0])


def _index_reads(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record each parse by gguf's reader (an indexed read makes none)."""
    gguf = need("gguf")
    parsed: list[Path] = []
    real = gguf.GGUFReader

    def reader(path: Any, *args: Any, **kwargs: Any) -> Any:
        parsed.append(Path(path))
        return real(path, *args, **kwargs)

    monkeypatch.setattr(gguf, "GGUFReader", reader)
    return parsed


def test_an_index_gives_the_same_file_without_parsing_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """SmolLM2's file (Q4_1 and Q8_0 tensors): metadata and every dequantised tensor equal through the index."""
    from tests.models._decoder import need_smollm2

    path = need_smollm2()
    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path))
    parsed = _index_reads(monkeypatch)
    first = read_gguf(path)  # large enough to be indexed by default
    second = read_gguf(path)
    assert parsed == [path] and len(list((tmp_path / "gguf-index").iterdir())) == 1
    assert second.metadata == first.metadata and second.tensor_names == first.tensor_names
    assert {first.tensor_type(n) for n in first.tensor_names} >= {"Q4_1", "F32"}
    for name in first.tensor_names:
        np.testing.assert_array_equal(second.tensor(name), first.tensor(name), err_msg=name)


def test_a_changed_file_or_a_damaged_index_is_parsed_again(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from attnkit.models.gguf import index_path

    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, seed=0)
    parsed = _index_reads(monkeypatch)
    read_gguf(path, index=True)
    index_path(path).write_text("{not json")  # damaged: parsed again and rewritten
    read_gguf(path, index=True)
    assert read_gguf(path, index=True).metadata["llama.block_count"] == 2
    weights = write_tiny_llama(path, seed=1)  # a new file at the same path: a new index
    again = read_gguf(path, index=True)
    assert len(parsed) == 3
    np.testing.assert_array_equal(again.tensor("output_norm.weight"), weights["output_norm.weight"])


def test_a_cache_that_cannot_be_written_is_skipped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    blocked = tmp_path / "a-file"
    blocked.write_text("not a folder")
    monkeypatch.setenv("ATTNKIT_CACHE", str(blocked))  # mkdir below it fails
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path)
    assert read_gguf(path, index=True).metadata["llama.block_count"] == 2
    assert read_gguf(path).tensor_names == read_gguf(path, index=True).tensor_names


def test_an_index_that_is_not_an_object_or_from_another_copy_is_not_used(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    import shutil

    from attnkit.models.gguf import index_path

    monkeypatch.setenv("ATTNKIT_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "tiny.gguf"
    write_tiny_llama(path, seed=0)
    read_gguf(path, index=True)
    index_path(path).write_text("[]")  # valid JSON, not an index: parsed again
    assert read_gguf(path, index=True).metadata["llama.block_count"] == 2
    other = tmp_path / "other.gguf"
    weights = write_tiny_llama(other, seed=1)
    first = index_path(path)
    path.unlink()
    shutil.copy2(other, path)  # same path, size and modification time as `other`: a different file all the same
    assert index_path(path) != first
    np.testing.assert_array_equal(read_gguf(path, index=True).tensor("output_norm.weight"),
                                  weights["output_norm.weight"])


@pytest.mark.filterwarnings("ignore:quantize.model, 'int4'.:UserWarning")  # ffn_down: int8, said in a warning
def test_int4_reads_q4_1_blocks_as_quantizing_the_dequantised_model_does(tmp_path: Path,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The registry's reader fills the int4 grids from the file's Q4_1 blocks (Q/K rows un-permuted like the
    weights): the packed model equals the dequantised one quantized; layers that are not Q4_1
    (ffn_down: 48 inputs, not blocks of 32) take another form."""
    gguf = need("gguf")
    import attnkit.modules.packed as packed_module
    from attnkit.modules.quantize import quantize

    add_tensor = gguf.GGUFWriter.add_tensor

    def add_q4_1(writer: Any, name: str, array: np.ndarray, **kwargs: Any) -> None:
        if name.startswith("blk.") and array.ndim == 2 and array.shape[1] % 32 == 0:  # Q4_1: blocks of 32
            kind = gguf.GGMLQuantizationType.Q4_1
            return add_tensor(writer, name, gguf.quants.quantize(array, kind), raw_dtype=kind)
        return add_tensor(writer, name, array, **kwargs)

    with monkeypatch.context() as patch:
        patch.setattr(gguf.GGUFWriter, "add_tensor", add_q4_1)
        write_tiny_llama(tmp_path / "q4.gguf")
    regrids: list[int] = []
    real_grid = packed_module.int4_grid
    monkeypatch.setattr(packed_module, "int4_grid", lambda *a, **k: regrids.append(1) or real_grid(*a, **k))
    reference = quantize(load_gguf(tmp_path / "q4.gguf"), "int4")
    assert len(regrids) == 6  # qkv, out and gate/up of two layers, gridded from their float32 weights
    regrids.clear()
    direct = load_gguf(tmp_path / "q4.gguf", weights="int4")
    assert regrids == []  # the same layers read from their blocks (ffn_down, 48 inputs, is int8 in both)
    ours = dict(direct.named_buffers()) | dict(direct.named_parameters())
    theirs = dict(reference.named_buffers()) | dict(reference.named_parameters())
    assert ours.keys() == theirs.keys()
    for name in ours:
        if name != "lm_head.packed":  # fbgemm's packed float16 head is opaque; compared through the logits
            torch.testing.assert_close(ours[name], theirs[name], rtol=0, atol=0, msg=name)
    ids = torch.tensor([[5, 6, 7, 100, 200, 30]])
    with torch.inference_mode():
        torch.testing.assert_close(direct(ids), reference(ids), rtol=0, atol=0)
