"""The paged cache and the engine on a tiny float64 decoder: every answer equals generate() of that prompt alone."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from attnkit.models import LlamaModel
from attnkit.models.generation_options import GenerationOptions
from attnkit.serve import Engine, Event, PagedBatch, PagedKVPool
from tests.serve._engine import Words, decode_ids, run_requests, tiny_engine, tiny_model


def _alone(model: LlamaModel, prompt: list[int], p: GenerationOptions) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=p.max_new_tokens, temperature=p.temperature,
                         top_p=p.top_p, seed=p.seed, stop_ids=[])
    return out[0, len(prompt):].tolist()


def test_paged_cache_equals_the_contiguous_cache_float64() -> None:
    """Rows with their own block tables, written in chunks, read back as the full forward sees them."""
    model = tiny_model()
    pool = PagedKVPool(num_layers=2, num_blocks=12, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float64)
    ids = torch.randint(0, 50, (2, 11))
    tables = [[5, 2, 9], [0, 7, 3]]  # scattered blocks
    out = []
    with torch.no_grad():
        full = model(ids)
        for start, end in ((0, 6), (6, 7), (7, 11)):
            positions = torch.arange(start, end).expand(2, -1)
            pool.batch = PagedBatch.build(tables, positions, [end, end], 4, pool.spare)
            out.append(model(ids[:, start:end], kv_caches=pool.layers, positions=positions))
    torch.testing.assert_close(torch.cat(out, 1), full, atol=1e-9, rtol=1e-9)


def test_concurrent_greedy_and_seeded_answers_equal_generate_alone() -> None:
    model = tiny_model()
    engine = tiny_engine(model, max_batch=4)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (3, 9, 17, 5, 12, 6)]
    params = [GenerationOptions(max_new_tokens=8, temperature=0.0) if i % 2 else
              GenerationOptions(max_new_tokens=8, temperature=1.5, top_p=0.9, seed=i) for i in range(len(prompts))]
    results = run_requests(engine, prompts, params)
    for prompt, p, (tokens, reason) in zip(prompts, params, results, strict=True):
        assert tokens == _alone(model, prompt, p) and reason == "length"
    assert engine.blocks.free_blocks == engine.blocks.num_blocks  # every block back in the pool


def test_a_bfloat16_pool_holds_twice_the_blocks_and_answers_as_generate_over_a_bfloat16_cache() -> None:
    model = tiny_model().float()
    engine = tiny_engine(model, kv_dtype="bfloat16")
    assert engine.blocks.num_blocks == 2 * tiny_engine(model).blocks.num_blocks
    assert engine.pool.k[0].dtype == torch.bfloat16
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (3, 9, 17)]
    params = [GenerationOptions(max_new_tokens=8, temperature=0.0)] * 3
    for prompt, (tokens, _) in zip(prompts, run_requests(engine, prompts, params), strict=True):
        alone = model.generate(torch.tensor([prompt]), max_new_tokens=8, stop_ids=[], kv_dtype="bfloat16")
        assert tokens == alone[0, len(prompt):].tolist()
    with pytest.raises(ValueError, match=r"kv_dtype=torch\.bfloat16 stores a float32 model's keys in fewer bytes; "
                                         r"this model computes in torch\.float64"):
        tiny_engine(tiny_model(), kv_dtype="bfloat16")


def test_a_shared_prefix_is_reused_and_answers_do_not_change() -> None:
    model = tiny_model()
    engine = tiny_engine(model)
    system = list(range(1, 17))  # four full blocks
    prompts = [[*system, 20, 21], [*system, 30]]
    p = GenerationOptions(max_new_tokens=6, temperature=0.0)
    cold = run_requests(engine, prompts[:1], [p])
    warm = run_requests(engine, prompts, [p, p])
    assert engine.blocks.hit_tokens >= 2 * 16  # the system prompt came from the cache, twice
    assert cold[0][0] == warm[0][0] == _alone(model, prompts[0], p)
    assert warm[1][0] == _alone(model, prompts[1], p)


def test_a_fully_cached_prompt_still_answers() -> None:
    model = tiny_model()
    engine = tiny_engine(model)
    prompt, p = list(range(1, 13)), GenerationOptions(max_new_tokens=5, temperature=0.0)
    first = run_requests(engine, [prompt], [p])
    second = run_requests(engine, [prompt], [p])
    assert first[0][0] == second[0][0] == _alone(model, prompt, p)


def test_preemption_under_tiny_memory_still_answers_every_request_correctly() -> None:
    model = tiny_model()
    per_block = PagedKVPool.bytes_per_block(num_layers=2, block_size=4, num_kv_heads=2, head_dim=8,
                                            dtype=torch.float64)
    engine = tiny_engine(model, kv_memory_mib=14 * per_block / 2**20, max_batch=6)  # 14 blocks for 6 sequences
    prompts = [[i + 1] * 9 for i in range(6)]
    p = GenerationOptions(max_new_tokens=10, temperature=0.0)
    results = run_requests(engine, prompts, [p] * 6)
    assert engine.metrics()["preemptions_total"] > 0
    for prompt, (tokens, _) in zip(prompts, results, strict=True):
        assert tokens == _alone(model, prompt, p)
    assert engine.blocks.free_blocks == engine.blocks.num_blocks


def test_cancelling_frees_blocks_at_the_next_step() -> None:
    model = tiny_model()
    engine = tiny_engine(model)
    events: list[Event] = []
    seq = engine.submit(list(range(1, 10)), GenerationOptions(max_new_tokens=50, temperature=0.0), events.append)
    engine.step()
    engine.step()
    assert engine.blocks.free_blocks < engine.blocks.num_blocks
    engine.cancel(seq)
    engine.step()
    assert engine.blocks.free_blocks == engine.blocks.num_blocks and engine.idle
    assert events[-1].finish_reason == "cancelled"


def test_stop_strings_end_an_answer_and_are_not_shown() -> None:
    model = tiny_model()
    engine = tiny_engine(model)
    prompt, p = [3, 4, 5], GenerationOptions(max_new_tokens=12, temperature=2.0, seed=3)  # sampled: varied tokens
    tokens = _alone(model, prompt, p)
    full = decode_ids(tokens)
    stop = full[len(full) // 2 : len(full) // 2 + 4]  # spans token boundaries
    shown = full[: full.find(stop)]
    texts: list[str] = []
    reasons: list[str | None] = []

    def on_event(event: Event) -> None:
        texts.append(event.text)
        reasons.append(event.finish_reason)

    engine.submit(prompt, GenerationOptions(max_new_tokens=12, temperature=2.0, seed=3, stop=(stop,)), on_event)
    while not engine.idle:
        engine.step()
    assert "".join(texts) == shown and reasons[-1] == "stop"


def _shown(engine: Engine, prompt: list[int], p: GenerationOptions) -> tuple[str, str | None]:
    """Run one request alone to its end: the text it showed and its finish reason."""
    texts: list[str] = []
    reasons: list[str | None] = []

    def on_event(event: Event) -> None:
        texts.append(event.text)
        reasons.append(event.finish_reason)

    engine.submit(prompt, p, on_event)
    while not engine.idle:
        engine.step()
    return "".join(texts), reasons[-1]


@pytest.mark.parametrize("reverse", [False, True])
def test_several_stop_strings_cut_at_the_earliest_match_whatever_their_order(reverse: bool) -> None:
    """Bug: the first stop in list order that matched won, so ["<b>", "><b"] showed "<a>" and the reverse "<a"."""
    model = tiny_model()
    prompt, p = [3, 4, 5], GenerationOptions(max_new_tokens=12, temperature=5.0, seed=3)  # the tiny model's tokens vary
    first, second, third = _alone(model, prompt, p)[:3]
    spans = f"><{third}"  # starts in the second token's text (held back) and ends in the third's
    whole = f"<{third}>"  # the third token's text: both stops are complete at the same step
    shown = f"<{first}><{second}"
    assert decode_ids(_alone(model, prompt, p)).find(spans) == len(shown)  # neither stop matches earlier
    stops = (whole, spans)[::-1] if reverse else (whole, spans)
    assert _shown(tiny_engine(model), prompt, GenerationOptions(max_new_tokens=12, temperature=5.0, seed=3,
                                                         stop=stops)) == (shown, "stop")


@pytest.mark.parametrize(("prompt", "max_new_tokens", "message"), [
    ([], 4, "the prompt is empty"),
    (list(range(1, 30)) * 4, 20, "exceeds the model.s context length \\(128 positions\\)"),
])
def test_requests_that_can_never_fit_are_refused_at_once(prompt: list[int], max_new_tokens: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        tiny_engine(tiny_model()).submit(prompt, GenerationOptions(max_new_tokens=max_new_tokens), lambda e: None)


@pytest.mark.parametrize(("model_device", "device", "message"), [
    ("cpu", "cuda", r"Engine\(device='cuda'\) and the model's parameters on cpu: move the model first "
                    r"\(model.to\('cuda'\)\), or leave device=None"),
    ("cpu", "meta", r"Engine\(device='meta'\) with the model's parameters on cpu: the meta device holds shapes"),
    ("meta", None, r"Engine\(device=None\) with the model's parameters on meta: the meta device holds shapes"),
    ("cpu", "tpu", r"Engine\(device='tpu'\) is not a device: expected cpu, cuda or cuda:N"),
])
def test_an_engine_on_another_device_than_its_model_is_refused_naming_both(model_device: str, device: str | None,
                                                                           message: str) -> None:
    """Bug to avoid: a pool on one device and the weights on another failed at the first step, in the engine
    thread, with PyTorch's device-mismatch error (or, on meta, served nothing)."""
    with pytest.raises(ValueError, match=message):
        tiny_engine(tiny_model().to(model_device), device=device)


def test_an_engine_runs_on_its_models_device_by_default() -> None:
    model = tiny_model()
    assert tiny_engine(model).pool.device == tiny_engine(model, device="cpu").pool.device == torch.device("cpu")


def test_kv_memory_for_fewer_than_two_blocks_is_refused_naming_the_option_and_the_least() -> None:
    """The message names the Python keyword and serve's flag (it was only ``kv_memory_mib=``, read by CLI users)."""
    with pytest.raises(ValueError, match=r"0\.001 MiB of KV memory \(kv_memory_mib, serve's --kv-memory\) holds 0 "
                                         r"blocks .*give at least"):
        tiny_engine(tiny_model(), kv_memory_mib=0.001)


def test_one_row_in_consecutive_blocks_is_read_as_a_slice_with_the_gathers_values() -> None:
    """A single row whose blocks follow each other reads a slice of the pool (no copy); any other layout gathers,
    and both hand the layer the same keys and values."""
    from attnkit.serve.paged import PagedLayerCache

    g = torch.Generator().manual_seed(0)
    storage = torch.randn(2, 6 * 4 + 1, 2, 3, generator=g, dtype=torch.float64)  # keys, values: (N, G, D)
    k, v = torch.randn(2, 1, 2, 1, 3, generator=g, dtype=torch.float64)  # (B, G, T, D): the tenth token's
    positions = torch.tensor([[9]])  # (B, T)
    for tables, lengths, sliced in (([[2, 3, 4]], [10], True), ([[2, 4, 3]], [10], False),
                                    ([[2, 3, 4], [0, 1, 5]], [10, 10], False)):
        rows = len(tables)
        batch = PagedBatch.build(tables, positions.expand(rows, 1), lengths, 4, 6 * 4)
        assert (batch.span is not None) == sliced, tables
        gathered = PagedBatch(batch.write_slots, batch.read_slots, batch.key_positions)
        pools = [storage.clone(), storage.clone()]  # (2, N, G, D) each: keys and values
        read = [PagedLayerCache(*pool, b).update(k.expand(rows, -1, -1, -1), v.expand(rows, -1, -1, -1), positions)
                for pool, b in zip(pools, (batch, gathered), strict=True)]
        torch.testing.assert_close(read[0].k, read[1].k, rtol=0, atol=0)
        torch.testing.assert_close(read[0].v, read[1].v, rtol=0, atol=0)
        torch.testing.assert_close(read[0].k[:, :, 9], k[:, :, 0].expand(rows, -1, -1), rtol=0, atol=0)
        shares = read[0].k.untyped_storage().data_ptr() == pools[0].untyped_storage().data_ptr()
        assert shares == sliced  # the slice is a view of the pool: no copy


def test_a_full_queue_is_refused() -> None:
    from attnkit.serve import QueueFullError

    engine = tiny_engine(tiny_model(), max_waiting=2)
    for _ in range(2):
        engine.submit([1, 2], GenerationOptions(max_new_tokens=2), lambda e: None)
    with pytest.raises(QueueFullError):
        engine.submit([1, 2], GenerationOptions(max_new_tokens=2), lambda e: None)


def test_shared_and_reused_blocks_give_the_full_forwards_logits_float64() -> None:
    """Two sequences share a prefix's blocks (reference counts), a third reuses freed blocks (LRU, evicted)."""
    from attnkit.serve import BlockManager

    model = tiny_model()
    pool = PagedKVPool(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float64)
    blocks = BlockManager(6, 4)

    def run(tokens: list[int]) -> torch.Tensor:
        """Logits of every position of ``tokens`` not already cached, through the pool."""
        got = blocks.allocate(tokens)
        assert got is not None
        start = got.cached_tokens
        ids = torch.tensor([tokens[start:]])
        positions = torch.arange(start, len(tokens))[None]
        pool.batch = PagedBatch.build([got.blocks], positions, [len(tokens)], 4, pool.spare)
        with torch.no_grad():
            logits = model(ids, kv_caches=pool.layers, positions=positions)
        blocks.written(got.blocks, len(tokens), tokens)
        run.blocks = got.blocks  # type: ignore[attr-defined]
        return logits

    first = list(range(1, 10))
    second = [*range(1, 9), 40, 41]  # shares two full blocks with the first
    out1 = run(first)
    out2 = run(second)
    assert blocks.hit_tokens == 8
    blocks.release(run.blocks)  # type: ignore[attr-defined]
    third = [30, 31, 32, 33, 34, 35, 36]  # takes freed blocks: the second's tail, then evicts cached ones
    out3 = run(third)
    with torch.no_grad():
        for tokens, out in ((first, out1), (second, out2), (third, out3)):
            full = model(torch.tensor([tokens]))
            torch.testing.assert_close(out, full[:, -out.shape[1]:], atol=1e-9, rtol=1e-9)


def test_a_dead_engine_fails_requests_fast_and_health_says_so() -> None:
    from attnkit.serve import EngineError

    model = tiny_model()
    engine = tiny_engine(model)

    def broken(*args: Any) -> Any:
        raise RuntimeError("the model broke")

    model.step = broken  # type: ignore[method-assign]
    events: list[Event] = []
    ended = threading.Event()

    def on_event(event: Event) -> None:
        events.append(event)
        if event.finish_reason:
            ended.set()

    engine.start()
    engine.submit([1, 2, 3], GenerationOptions(max_new_tokens=4), on_event)
    assert ended.wait(timeout=10)
    assert not engine.alive and events[-1].finish_reason == "error" and "the model broke" in str(events[-1].error)
    with pytest.raises(EngineError, match="the engine stopped after an error"):
        engine.submit([1, 2], GenerationOptions(max_new_tokens=2), lambda e: None)


def test_health_and_requests_report_a_dead_engine_over_http() -> None:
    from tests._util import need

    need("fastapi")
    testclient = need("fastapi.testclient")
    from attnkit.serve.api import Server, create_app

    model = tiny_model()
    engine = tiny_engine(model)
    engine.start()
    client = testclient.TestClient(create_app(Server(engine, Words(), model_name="tiny", context_length=128)))
    body = {"model": "tiny", "prompt": "one two three", "max_tokens": 3, "temperature": 0}
    assert client.get("/health").json() == {"status": "ok"}
    assert client.post("/v1/completions", json=body).status_code == 200

    def broken(*args: Any) -> Any:
        raise RuntimeError("the model broke")

    model.step = broken  # type: ignore[method-assign]
    failed = client.post("/v1/completions", json=body)
    assert failed.status_code == 500 and "the model broke" in failed.json()["error"]["message"]
    health = client.get("/health")
    assert health.status_code == 503 and "the model broke" in health.json()["error"]
    again = client.post("/v1/completions", json=body)
    assert again.status_code == 503 and again.json()["error"]["code"] == "engine_error"


def test_prompt_chunks_of_one_length_share_a_forward_and_answer_as_alone() -> None:
    """Bug: every prefilling request ran a forward of its own; chunks of one length run together (float64)."""
    model = tiny_model()
    engine = tiny_engine(model, max_batch=8)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 50, (n,), generator=g).tolist() for n in (7, 7, 7, 5)]
    calls: list[tuple[int, ...]] = []
    step = model.step

    def counted(ids: torch.Tensor, *args: Any) -> torch.Tensor:
        calls.append(tuple(ids.shape))
        return step(ids, *args)

    model.step = counted  # type: ignore[method-assign]
    p = GenerationOptions(max_new_tokens=4)
    got = run_requests(engine, prompts, [p] * len(prompts))
    assert sorted(calls[:2]) == [(1, 5), (3, 7)]  # the first step: two forwards, not four
    assert [tokens for tokens, _ in got] == [_alone(model, prompt, p) for prompt in prompts]


def test_metrics_count_the_tokens_and_report_a_rate_once_steps_produced_them() -> None:
    engine = tiny_engine(tiny_model())
    before = engine.metrics()
    assert (before["generated_tokens_total"], before["tokens_per_second"]) == (0, 0.0)
    prompts = [[1, 2, 3], [4, 5, 6, 7]]
    run_requests(engine, prompts, [GenerationOptions(max_new_tokens=8)] * 2)
    after = engine.metrics()
    assert after["generated_tokens_total"] == 16 and after["requests_total"] == 2
    assert after["tokens_per_second"] > 0  # the recent steps' tokens over their time
