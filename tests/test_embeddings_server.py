"""The embedding routes (`--task embed`): /v1/embeddings (float and base64, through the openai
client too), /v1/score, /rerank, their refusals, and the other task's routes refused.

The engine is the tiny random SmolLM2-shaped model (tests/data/arch/smollm2) with its vocabulary
padded to the real tokenizer's, mean pooling; the server's vectors are compared with the
EmbedEngine's own for the same token ids (whose pooling tests/test_embeddings.py checks against
transformers).
"""

from __future__ import annotations

import base64
import types

import numpy as np
import openai
import pytest

from arch_helpers import widened
from jserve.engine import EngineConfig, build_engine
from jserve.engine.embed_engine import PoolingParams
from jserve.server.embeddings import require_task
from jserve.server.errors import APIError
from jserve.text.tokenizer import Tokenizer
from test_server import assert_error, request, serving

MODEL = "tiny-embed"
TEXTS = ["Hello, my name is", "The capital of France is", "1, 2, 3,", "Once upon a time there was"]


@pytest.fixture(scope="module")
def engine(smollm2_checkpoint):
    tokenizer = Tokenizer.load(smollm2_checkpoint)
    config, params = widened("smollm2", tokenizer.vocab_size)
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=16, max_model_len=64, page_size=4, num_pages=64,
                       backend="cpu", task="embed", pooling="mean")
    return build_engine(config, params, tokenizer, [], cfg)


@pytest.fixture(scope="module")
def expected(engine):
    """Each text's vector from the engine itself, before the server owns it."""
    ids = [engine.tokenizer.encode(t) for t in TEXTS]
    for i, p in enumerate(ids):
        engine.add_request(f"sync-{i}", p, PoolingParams())
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o.embedding) for o in engine.step())
    return {t: done[f"sync-{i}"] for i, t in enumerate(TEXTS)}, dict(zip(TEXTS, ids))


@pytest.fixture(scope="module")
def server(engine, expected):
    with serving(engine, MODEL) as srv:
        yield srv


def test_embeddings_float_base64_and_ids(server, expected):
    vectors, ids = expected
    status, _, body = request(server, "POST", "/v1/embeddings", {"model": MODEL, "input": TEXTS})
    assert status == 200, body
    assert body["object"] == "list" and body["model"] == MODEL
    assert body["usage"] == {"prompt_tokens": sum(map(len, ids.values())), "total_tokens": sum(map(len, ids.values()))}
    for i, (item, text) in enumerate(zip(body["data"], TEXTS)):
        assert item["object"] == "embedding" and item["index"] == i
        np.testing.assert_allclose(item["embedding"], vectors[text], atol=1e-6)
    status, _, body = request(server, "POST", "/v1/embeddings",
                              {"input": [ids[TEXTS[0]], ids[TEXTS[1]]], "encoding_format": "base64"})
    assert status == 200, body
    for item, text in zip(body["data"], TEXTS):
        np.testing.assert_array_equal(np.frombuffer(base64.b64decode(item["embedding"]), "<f4"), vectors[text])
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    for fmt in ("float", openai.NOT_GIVEN):  # not given: the client asks for base64 and decodes it
        got = client.embeddings.create(model=MODEL, input=TEXTS[2], encoding_format=fmt)
        np.testing.assert_allclose(got.data[0].embedding, vectors[TEXTS[2]], atol=1e-6)
    # truncate_prompt_tokens keeps the last tokens, as vLLM does
    tail = ids[TEXTS[3]][-3:]
    status, _, a = request(server, "POST", "/v1/embeddings", {"input": TEXTS[3], "truncate_prompt_tokens": 3})
    status, _, b = request(server, "POST", "/v1/embeddings", {"input": tail})
    assert a["data"][0]["embedding"] == b["data"][0]["embedding"] and a["usage"]["prompt_tokens"] == 3


def test_score_and_rerank(server, expected):
    vectors, _ = expected

    def cos(a, b):
        return float(np.dot(vectors[a], vectors[b]) / np.linalg.norm(vectors[a]) / np.linalg.norm(vectors[b]))

    status, _, body = request(server, "POST", "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS[1:]})
    assert status == 200, body
    assert [d["index"] for d in body["data"]] == [0, 1, 2]
    np.testing.assert_allclose([d["score"] for d in body["data"]], [cos(TEXTS[0], t) for t in TEXTS[1:]], atol=1e-5)
    status, _, body = request(server, "POST", "/v1/score", {"text_1": TEXTS[:2], "text_2": TEXTS[2:]})
    np.testing.assert_allclose([d["score"] for d in body["data"]],
                               [cos(TEXTS[0], TEXTS[2]), cos(TEXTS[1], TEXTS[3])], atol=1e-5)
    want = sorted(range(3), key=lambda i: -cos(TEXTS[0], TEXTS[1 + i]))
    for path in ("/rerank", "/v1/rerank"):
        status, _, body = request(server, "POST", path, {"query": TEXTS[0], "documents": TEXTS[1:], "top_n": 2})
        assert status == 200, body
        assert [r["index"] for r in body["results"]] == want[:2]
        assert body["results"][0]["document"] == {"text": TEXTS[1 + want[0]]}
        np.testing.assert_allclose(body["results"][0]["relevance_score"], cos(TEXTS[0], TEXTS[1 + want[0]]),
                                   atol=1e-5)


@pytest.mark.parametrize("path, body, param, needle", [
    ("/v1/embeddings", {"input": "x", "dimensions": 8}, "dimensions", "Matryoshka"),
    ("/v1/embeddings", {"input": "x", "encoding_format": "int8"}, "encoding_format", "encoding_format"),
    ("/v1/embeddings", {"input": "x", "normalize": False}, "normalize", "unsupported field"),
    ("/v1/embeddings", {}, "input", "input is required"),
    ("/v1/embeddings", {"input": [[1, 2], [49152]]}, "input", "outside the vocabulary"),
    ("/v1/embeddings", {"input": list(range(1, 70))}, "input", "maximum context length"),
    ("/v1/embeddings", {"input": ""}, "input", "empty"),
    ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_1", "as many"),
    ("/v1/score", {"text_1": "a"}, "text_2", "text_2 is required"),
    ("/rerank", {"query": "a", "documents": []}, "documents", "non-empty list"),
    ("/rerank", {"query": 3, "documents": ["a"]}, "query", "a string"),
])
def test_bad_requests(server, path, body, param, needle):
    status, _, reply = request(server, "POST", path, body)
    assert_error(status, reply, 400, contains=(needle,))
    assert reply["error"]["param"] == param


def test_the_other_task_is_refused(server):
    for path, body in (("/v1/completions", {"prompt": "hi"}), ("/v1/chat/completions", {"messages": []})):
        status, _, reply = request(server, "POST", path, body)
        assert_error(status, reply, 400, "wrong_task", contains=("--task generate",))
    state = types.SimpleNamespace(engine=types.SimpleNamespace(task="generate"), model_name="m")
    with pytest.raises(APIError, match="--task embed") as e:
        require_task(state, "embed", "/v1/embeddings")
    assert e.value.status == 400
    status, _, stats = request(server, "GET", "/metrics")
    assert status == 200


def test_the_readme_examples_work_as_written(server):
    """The README's embeddings block: each curl line (its `jserve serve` line is this server)."""
    import json
    import re
    import subprocess
    from pathlib import Path

    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "--task embed" in b)
    commands = re.findall(r"^curl .*?(?<!\\)$", block.replace("\\\n", " "), re.M)
    assert len(commands) == 3, block
    for command in commands:
        done = subprocess.run(["bash", "-c", command.replace("localhost:8000", f"127.0.0.1:{server.port}")],
                              capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert "error" not in answer and (answer.get("data") or answer.get("results")), answer
