"""Issue 26's embeddings end to end: the official ``openai`` client against a real gateway and a
REAL worker started with ``--task embed`` (the embedded model on the CPU). Every vector equals
transformers' ``last_hidden_state`` of the same model in float32, last token, L2-normalized
(vLLM's default for a causal LM): cosine > 0.9999, in both encodings, for a batch of texts of
different lengths (one spans several prefill chunks) and for token-id inputs; the other
endpoints answer 400 and the worker keeps no KV."""

from __future__ import annotations

from collections.abc import Iterator

import grpc
import httpx
import openai
import pytest
import torch
import torch.nn.functional as F

from protos import common_pb2, worker_pb2
from tests.services.clients import Conn, assert_idle, wait_pool_free
from tests.services.procs import Fleet, Proc, fleet
from tests.services.reference import transformers_hidden

__all__ = ["fleet"]
pytestmark = pytest.mark.slow
MODEL = "SmolLM2-135M-Instruct"
TEXTS = [
    "Hello world",
    "Paris is the capital of France.",
    "q",
    # about 200 tokens: two chunks of a CPU worker's 128-token step
    "The river ran north past the salt villages, and the ferrymen sang as they crossed. " * 11,
]


@pytest.fixture(scope="module")
def stack(fleet: Fleet) -> Iterator[tuple[Proc, Proc]]:
    worker = fleet.spawn("worker", "--task", "embed", name="embed-worker")
    transformers_hidden([1])  # the reference loads while the worker does
    gateway = fleet.gateway(worker=[worker.wait_ready()])
    yield worker, gateway
    for proc in (gateway, worker):
        fleet.forget(proc)
        proc.kill()


def client(gateway: Proc) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=120)


def _ids(gateway: Proc, text: str) -> list[int]:
    body = httpx.post(f"{gateway.url}/tokenize", json={"prompt": text}, timeout=10).json()
    ids: list[int] = body["tokens"]
    return ids


def _expected(ids: list[int]) -> torch.Tensor:
    return F.normalize(transformers_hidden(ids)[-1].float(), dim=-1)


def _check(vectors: list[list[float]], inputs: list[list[int]]) -> None:
    assert len(vectors) == len(inputs)
    for got, ids in zip(vectors, inputs, strict=True):
        ours = torch.tensor(got)
        assert ours.shape == (576,)
        assert F.cosine_similarity(ours, _expected(ids), dim=0).item() > 0.9999
        assert abs(ours.norm().item() - 1.0) < 1e-4


async def test_openai_client_batch_equals_transformers_in_both_encodings(
    stack: tuple[Proc, Proc],
) -> None:
    worker, gateway = stack
    ids = [_ids(gateway, t) for t in TEXTS]
    assert len({len(x) for x in ids}) == 4 and len(ids[3]) > 128  # chunked on the worker
    floats = client(gateway).embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    packed = client(gateway).embeddings.create(model=MODEL, input=TEXTS)  # base64, the default
    for out in (floats, packed):
        assert [d.index for d in out.data] == [0, 1, 2, 3]
        assert out.usage.prompt_tokens == out.usage.total_tokens == sum(map(len, ids))
        _check([d.embedding for d in out.data], ids)
    for a, b in zip(floats.data, packed.data, strict=True):
        # base64 carries float32 values: the same vectors. Two requests, so not bit for bit:
        # the second may read the first's prompt blocks from the prefix cache, or share its
        # steps with other rows, and float32 sums then round differently (~1e-7)
        torch.testing.assert_close(
            torch.tensor(b.embedding), torch.tensor(a.embedding), rtol=1e-5, atol=1e-6
        )
    async with Conn(worker.address, "worker") as w:
        assert_idle(await wait_pool_free([w]))


async def test_token_id_inputs_equal_transformers(stack: tuple[Proc, Proc]) -> None:
    worker, gateway = stack
    ids = [_ids(gateway, t) for t in TEXTS[:2]]
    one = client(gateway).embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    many = client(gateway).embeddings.create(model=MODEL, input=ids)
    _check([one.data[0].embedding], ids[:1])
    _check([d.embedding for d in many.data], ids)
    assert one.usage.prompt_tokens == len(ids[0])
    async with Conn(worker.address, "worker") as w:
        load = await w.load()
        assert load.task == "embed" and load.prefix_cache_hits > 0  # the texts ran before


def test_the_400s_of_an_embedding_server(stack: tuple[Proc, Proc]) -> None:
    _, gateway = stack
    c = client(gateway)
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        c.completions.create(model=MODEL, prompt="hi", max_tokens=2)
    with pytest.raises(openai.BadRequestError, match="--task embed"):
        c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="dimensions"):
        c.embeddings.create(model=MODEL, input="hi", dimensions=64)
    with pytest.raises(openai.BadRequestError, match="maximum context length is 1024 tokens"):
        c.embeddings.create(model=MODEL, input="word " * 1100)
    with pytest.raises(openai.BadRequestError, match="empty"):
        c.embeddings.create(model=MODEL, input="")


async def test_the_worker_refuses_generation_itself(stack: tuple[Proc, Proc]) -> None:
    worker, _ = stack
    async with Conn(worker.address, "worker") as w:
        sampling = common_pb2.SamplingParams(max_tokens=2)
        request = worker_pb2.GenerateRequest(
            request_id="g", prompt_token_ids=[1, 2], sampling=sampling
        )
        with pytest.raises(grpc.aio.AioRpcError) as err:
            async for _ in w.stub.Generate(request, timeout=10):
                pass
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "start it with --task generate" in str(err.value.details())
        assert_idle(await wait_pool_free([w]))
