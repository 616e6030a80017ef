"""Scoring through the API: echo with logprobs on /v1/completions, `prompt_logprobs` on both routes
and `max_tokens: 0`, as vLLM's server answers them, and lm-eval's own loglikelihood run.

The shapes and values run on test_server.py's tiny model against the offline engine's prompt
logprobs (to 1e-4: the same engine, batched differently). The lm-eval run (slow: the real default
model) scores tests/data/scoring_golden.json's multiple-choice task through `local-completions`
against a live server; each loglikelihood must equal jserve's offline scoring to 1e-4 (float32)
and Hugging Face transformers' on the same weights (the golden, tests/tools/make_scoring_golden.py)
to 1e-3.
"""

from __future__ import annotations

import json

import pytest

from conftest import DATA
from jserve.core.request import MAX_LOGPROBS, SamplingParams
from test_server import CHAT, MODEL, assert_error, engine, engine_idle, request, serving  # noqa: F401

K = 3  # alternatives the offline reference lists per prompt position
SCORED = ["The capital of France is Paris", "1, 2, 3, 4, 5", "Hello, my name is"]


def run_offline(engine, prompts: list[list[int]], params: SamplingParams) -> list:
    """Final RequestOutputs of the plain LLMEngine (before a server's async engine owns it)."""
    for i, ids in enumerate(prompts):
        engine.add_request(f"offline-{i}", ids, params)
    done = {}
    while engine.has_unfinished_requests():
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    return [done[f"offline-{i}"] for i in range(len(prompts))]




@pytest.fixture(scope="module")
def reference(engine):
    """The offline engine's prompt logprobs (top K) of SCORED and the CHAT conversation, asked for
    with max_tokens 0."""
    tok = engine.tokenizer
    ids = [tok.encode(p) for p in SCORED] + [tok.encode_chat(CHAT)]
    outs = run_offline(engine, ids, SamplingParams(max_tokens=0, prompt_logprobs=K, temperature=0, n=2))
    return {"ids": ids, "outs": outs, "pages_in_use": engine.stats()["pages_in_use"]}


@pytest.fixture(scope="module")
def server(engine, reference):
    with serving(engine, MODEL) as srv:
        yield srv


def sse(data: bytes) -> list[dict]:
    events = [line[6:] for line in data.decode().split("\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events[-3:]
    return [json.loads(e) for e in events[:-1]]


def check_echo_logprobs(lp: dict, ids: list[int], ref, top: int, tok) -> None:
    """An echoed prompt's logprobs object: OpenAI's lists, null for the first token, then the
    offline engine's logprob of each prompt token, with at most `top` alternatives besides it."""
    n = len(ids)
    assert len(lp["tokens"]) >= n and len(lp["token_logprobs"]) == len(lp["top_logprobs"]) == len(lp["text_offset"])
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["tokens"][:n] == [tok.decode([t]) for t in ids]
    offsets = [0]
    for t in lp["tokens"][:-1]:
        offsets.append(offsets[-1] + len(t))
    assert lp["text_offset"] == offsets
    for j in range(1, n):
        want = ref.prompt_logprobs[j]
        assert lp["token_logprobs"][j] == pytest.approx(want[ids[j]].logprob, abs=1e-4)
        alternatives = lp["top_logprobs"][j]
        assert lp["tokens"][j] in alternatives and len(alternatives) <= top + 1
        best = min(want.values(), key=lambda v: v.rank)
        assert max(alternatives.values()) == pytest.approx(best.logprob, abs=1e-4)


# ------------------------------------------------------------------------------ the engine

def test_offline_max_tokens_zero_scores_the_prompt(reference):
    for ids, out in zip(reference["ids"], reference["outs"]):
        assert [(c.index, c.text, c.token_ids, c.finish_reason) for c in out.outputs] == [
            (0, "", [], "length"), (1, "", [], "length")]
        scored = out.prompt_logprobs
        assert len(scored) == len(ids) and scored[0] is None
        for j in range(1, len(ids)):
            assert ids[j] in scored[j] and {v.rank for t, v in scored[j].items() if t != ids[j]} <= set(range(1, K + 1))
    assert reference["pages_in_use"] == 0  # the hidden samples' requests ended and gave their pages back
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=-1)


# ------------------------------------------------------------------------------ /v1/completions

@pytest.mark.parametrize("max_tokens", [0, 1])
def test_echo_with_logprobs_is_lm_evals_request(server, reference, max_tokens):
    """lm-eval's `local-completions` loglikelihood request: token-id prompts, echo, logprobs 1."""
    tok = server.state.tokenizer
    prompts = reference["ids"][:3]
    status, _, body = request(server, "POST", "/v1/completions", {
        "model": MODEL, "prompt": prompts, "temperature": 0, "max_tokens": max_tokens, "logprobs": 1, "seed": 1234,
        "echo": True})
    assert status == 200, body
    choices = sorted(body["choices"], key=lambda c: c["index"])
    assert len(choices) == 3 and body["usage"]["completion_tokens"] == 3 * max_tokens
    for ids, ref, choice in zip(prompts, reference["outs"], choices):
        lp = choice["logprobs"]
        check_echo_logprobs(lp, ids, ref, 1, tok)
        assert len(lp["tokens"]) == len(ids) + max_tokens
        assert choice["text"] == "".join(lp["tokens"]) and choice["text"].startswith(tok.decode(ids))
        assert choice["finish_reason"] == "length"
        if max_tokens:  # greedy: the sampled token is the most likely
            assert lp["token_logprobs"][-1] == pytest.approx(max(lp["top_logprobs"][-1].values()))


def test_echo_text_prompt_streamed_and_whole(server, reference):
    tok = server.state.tokenizer
    body = {"prompt": SCORED[0], "echo": True, "logprobs": 2, "max_tokens": 3, "temperature": 0, "ignore_eos": True}
    status, _, whole = request(server, "POST", "/v1/completions", body)
    assert status == 200, whole
    choice = whole["choices"][0]
    check_echo_logprobs(choice["logprobs"], reference["ids"][0], reference["outs"][0], 2, tok)
    assert choice["text"].startswith(SCORED[0]) and len(choice["logprobs"]["tokens"]) == len(reference["ids"][0]) + 3
    status, _, data = request(server, "POST", "/v1/completions", {**body, "stream": True})
    chunks = [c["choices"][0] for c in sse(data)]
    assert chunks[0]["text"].startswith(SCORED[0])  # the prompt comes first, with its logprobs
    assert "".join(c["text"] for c in chunks) == choice["text"]
    streamed = {key: [v for c in chunks for v in c["logprobs"][key]] for key in choice["logprobs"]}
    assert streamed["tokens"] == choice["logprobs"]["tokens"]
    assert streamed["token_logprobs"][1:] == pytest.approx(choice["logprobs"]["token_logprobs"][1:], abs=1e-4)
    assert streamed["text_offset"] == choice["logprobs"]["text_offset"]


def test_echo_without_logprobs_and_max_tokens_zero(server):
    status, _, body = request(server, "POST", "/v1/completions", {"prompt": SCORED[1], "echo": True, "max_tokens": 0})
    assert status == 200, body
    assert [(c["text"], c["logprobs"], c["finish_reason"]) for c in body["choices"]] == [(SCORED[1], None, "length")]
    assert body["usage"]["completion_tokens"] == 0
    status, _, data = request(server, "POST", "/v1/completions", {"prompt": SCORED[1], "echo": True, "max_tokens": 0,
                                                                  "stream": True, "n": 2})
    chunks = [c["choices"][0] for c in sse(data)]
    assert sorted((c["index"], c["text"], c["finish_reason"]) for c in chunks) == [
        (0, SCORED[1], "length"), (1, SCORED[1], "length")]
    stats = engine_idle(server)
    assert stats["pages_in_use"] == 0 and stats["num_running"] == 0


def test_prompt_logprobs_on_completions(server, reference):
    tok = server.state.tokenizer
    ids, ref = reference["ids"][2], reference["outs"][2]
    status, _, body = request(server, "POST", "/v1/completions", {
        "prompt": ids, "prompt_logprobs": K, "max_tokens": 2, "temperature": 0, "ignore_eos": True, "n": 2,
        "echo": True, "logprobs": 0})
    assert status == 200, body
    for choice in body["choices"]:
        assert len(choice["logprobs"]["tokens"]) == len(ids) + 2
        assert all(len(top) == 1 for top in choice["logprobs"]["top_logprobs"][1:])  # logprobs 0: the token only
        scored = choice["prompt_logprobs"]
        assert len(scored) == len(ids) and scored[0] is None
        for j in range(1, len(ids)):
            want = ref.prompt_logprobs[j]
            assert list(scored[j])[0] == str(ids[j])  # the prompt's token first, as vLLM lists it
            assert {int(t) for t in scored[j]} == set(want)
            for t, entry in scored[j].items():
                lp = want[int(t)]
                assert entry["logprob"] == pytest.approx(lp.logprob, abs=1e-4) and entry["rank"] == lp.rank
                assert entry["decoded_token"] == tok.decode([int(t)])
    status, _, body = request(server, "POST", "/v1/completions", {"prompt": ids, "prompt_logprobs": 1, "max_tokens": 0})
    assert status == 200, body
    choice = body["choices"][0]
    assert (choice["text"], choice["logprobs"], choice["finish_reason"]) == ("", None, "length")
    assert all(len(entry) <= 2 for entry in choice["prompt_logprobs"][1:])


# ------------------------------------------------------------------------------ /v1/chat/completions

def test_prompt_logprobs_on_chat(server, reference):
    ids, ref = reference["ids"][3], reference["outs"][3]
    for extra in ({"max_tokens": 0}, {"max_completion_tokens": 2, "logprobs": True}):
        status, _, body = request(server, "POST", "/v1/chat/completions", {
            "messages": CHAT, "prompt_logprobs": 2, "temperature": 0, "ignore_eos": True, **extra})
        assert status == 200, body
        scored = body["prompt_logprobs"]  # vLLM's place in a chat reply: beside the choices
        assert len(scored) == len(ids) and scored[0] is None
        for j in range(1, len(ids)):
            assert list(scored[j])[0] == str(ids[j]) and len(scored[j]) <= 3
            assert scored[j][str(ids[j])]["logprob"] == pytest.approx(ref.prompt_logprobs[j][ids[j]].logprob, abs=1e-4)
        choice = body["choices"][0]
        if "max_tokens" in extra:
            assert (choice["message"]["content"], choice["finish_reason"]) == ("", "length")
            assert body["usage"]["completion_tokens"] == 0
        else:
            assert len(choice["logprobs"]["content"]) == 2 and body["usage"]["completion_tokens"] == 2


SCORING_ERRORS = [
    ("/v1/completions", {"prompt": "hi", "max_tokens": 0}, "echo or prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1, "echo": True}, "max_tokens"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": -1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": MAX_LOGPROBS + 1}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": "2"}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": True}, "prompt_logprobs"),
    ("/v1/completions", {"prompt": "hi", "prompt_logprobs": 1, "stream": True}, "stream"),
    ("/v1/completions", {"prompt": "hi", "echo": True, "logprobs": MAX_LOGPROBS + 1}, "logprobs"),
    ("/v1/completions", {"prompt": "hi", "echo": "yes", "logprobs": 1}, "echo"),
    ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 0}, "prompt_logprobs"),
    ("/v1/chat/completions", {"messages": CHAT, "max_completion_tokens": 0}, "max_completion_tokens"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 2, "stream": True}, "stream"),
    ("/v1/chat/completions", {"messages": CHAT, "prompt_logprobs": 2, "echo": True}, "echo"),
]


@pytest.mark.parametrize("path,body,needle", SCORING_ERRORS, ids=range(len(SCORING_ERRORS)))
def test_scoring_errors(server, path, body, needle):
    status, _, answer = request(server, "POST", path, body)
    assert_error(status, answer, 400, contains=(needle,))


# ------------------------------------------------------------------------------ lm-eval, the real model

TASK = {"task": "jserve_mc", "dataset_path": "json", "test_split": "test", "output_type": "multiple_choice",
        "doc_to_text": "{{question}}", "doc_to_choice": "choices", "doc_to_target": "answer",
        "metric_list": [{"metric": "acc"}]}


@pytest.fixture(scope="module")
def golden_scoring():
    return json.loads((DATA / "scoring_golden.json").read_text())


def offline_loglikelihoods(llm, pairs: list[tuple[list[int], list[int]]]) -> list[tuple[float, bool]]:
    """jserve's own scoring of (context, continuation) ids: the continuation's summed prompt
    logprobs, and whether each of its tokens is the most likely."""
    outs = llm.generate([ctx + cont for ctx, cont in pairs], SamplingParams(max_tokens=0, prompt_logprobs=1))
    result = []
    for (ctx, cont), out in zip(pairs, outs):
        entries = [out.prompt_logprobs[len(ctx) + i][t] for i, t in enumerate(cont)]
        result.append((sum(e.logprob for e in entries), all(e.rank == 1 for e in entries)))
    return result


@pytest.mark.slow
def test_lm_eval_multiple_choice_matches_offline_and_transformers(smollm2_checkpoint, golden_scoring, tmp_path,
                                                                   monkeypatch):
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    lm_eval = pytest.importorskip("lm_eval")  # the test extra's
    from lm_eval.models.openai_completions import LocalCompletionsAPI
    from lm_eval.tasks import TaskManager

    from jserve import LLM

    items = golden_scoring["items"]
    pairs = [(s["context_ids"], s["continuation_ids"]) for item in items for s in item["scored"]]
    llm = LLM(str(smollm2_checkpoint), max_model_len=512, max_num_seqs=8, max_num_batched_tokens=128,
              warmup=False)  # only the shapes lm-eval's requests run
    offline = offline_loglikelihoods(llm, pairs)
    data = tmp_path / "items.jsonl"
    data.write_text("".join(json.dumps({k: item[k] for k in ("question", "choices", "answer")}) + "\n"
                            for item in items))
    (tmp_path / "jserve_mc.yaml").write_text(json.dumps({**TASK, "dataset_kwargs": {
        "data_files": {"test": str(data)}, "cache_dir": str(tmp_path / "datasets")}}))
    with serving(llm.engine, "smollm2") as srv:  # lm-eval reads /tokenizer_info, then /tokenize, /detokenize
        lm = LocalCompletionsAPI(base_url=f"{srv.url}/v1/completions", model="smollm2", tokenizer_backend="remote",
                                 batch_size=4, max_length=512, max_retries=1)
        results = lm_eval.simple_evaluate(model=lm, tasks=["jserve_mc"], log_samples=True, bootstrap_iters=0,
                                          task_manager=TaskManager(include_path=str(tmp_path), include_defaults=False))
        split = [lm._encode_pair(item["question"], " " + choice) for item in items for choice in item["choices"]]
    assert split == [(list(a), list(b)) for a, b in pairs]  # jserve's /tokenize splits as transformers' tokenizer
    samples = sorted(results["samples"]["jserve_mc"], key=lambda s: s["doc_id"])
    served = [tuple(resp) for s in samples for resp in s["filtered_resps"]]
    assert len(served) == len(pairs)
    hf = [(s["loglikelihood"], s["is_greedy"]) for item in items for s in item["scored"]]
    for (ll, greedy), (want, want_greedy), (ref, ref_greedy) in zip(served, offline, hf):
        assert ll == pytest.approx(want, abs=1e-4) and greedy == want_greedy
        assert ll == pytest.approx(ref, abs=1e-3) and greedy == ref_greedy
    right = [max(range(len(item["scored"])), key=lambda c: item["scored"][c]["loglikelihood"]) == item["answer"]
             for item in items]
    assert results["results"]["jserve_mc"]["acc,none"] == pytest.approx(sum(right) / len(items))
