"""LoRA adapters over HTTP (`jserve.server.loras`): `model` naming an adapter, /v1/models, vLLM's 404
for an unknown name, the admin's load / unload routes, the metrics; one live server on the default
model with PEFT-format adapters made here."""

from __future__ import annotations

import concurrent.futures
import json
import time

import pytest

from jserve.core.lora_slots import LoRARequest
from jserve.core.request import SamplingParams
from jserve.engine.async_engine import AsyncLLMEngine
from jserve.model.lora_adapters import write_random_adapter
from jserve.server import ServerState, build_app, loras
from test_server import Server, assert_error, request

NAME = "smollm2"
ADMIN = {"Authorization": "Bearer admin-secret"}
USER = {"Authorization": "Bearer user-key"}
PROMPT = "The capital of France is"


def write_peft_adapter(folder, config, rank: int, seed: int, scale: float = 0.2) -> str:
    """A PEFT LoRA adapter on q_proj and v_proj of every layer, big enough to change greedy text."""
    return write_random_adapter(folder, config, rank, seed, modules=("q_proj", "v_proj"), scale=scale)


@pytest.fixture(scope="module")
def served(smollm2_checkpoint, tmp_path_factory):
    """One server: adapter "a" from start-up, runtime updating on, an admin key and an API key;
    with the offline greedy texts of the base model and of each adapter."""
    from jserve import LLM

    llm = LLM(str(smollm2_checkpoint), enable_lora=True, max_loras=2, max_lora_rank=8, max_model_len=128,
              max_num_seqs=4, max_num_batched_tokens=32, warmup=True)
    config = llm.engine.runner.config
    root = tmp_path_factory.mktemp("adapters")
    paths = {"a": write_peft_adapter(root / "a", config, 8, seed=1), "b": write_peft_adapter(root / "b", config, 4, 2)}
    greedy = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    texts = {"base": llm.generate([PROMPT], greedy)[0].outputs[0].text}
    for i, name in enumerate(("a", "b")):
        out = llm.generate([PROMPT], greedy, lora_request=LoRARequest(name, 10 + i, paths[name]))
        texts[name] = out[0].outputs[0].text
        llm.engine.lora.remove(name)  # as new again for the server
    with pytest.raises(ValueError, match="--lora-modules bad=/nonexistent: .*'/nonexistent'"):
        loras.add_modules(llm.engine, [LoRARequest("bad", 7, "/nonexistent")])
    loras.add_modules(llm.engine, loras.parse_modules([f"a={paths['a']}"], (NAME,)))
    engine = AsyncLLMEngine(llm.engine)
    state = ServerState(NAME, api_keys=("user-key",), log_requests=True)
    state.loras.allow_updating = True
    state.attach(engine)
    server = Server(state, admin_key="admin-secret")
    yield server, engine, paths, texts
    server.close()
    engine.shutdown()


def _complete(server, model, prompt=PROMPT, **extra):
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True, **extra}
    return request(server, "POST", "/v1/completions", body, USER)


def test_adapter_by_model_name_base_unchanged_and_concurrent(served):
    server, engine, paths, texts = served
    assert len({texts["base"], texts["a"], texts["b"]}) == 3  # the adapters change the greedy text
    status, _, body = _complete(server, "a")
    assert status == 200 and body["choices"][0]["text"] == texts["a"] and body["model"] == "a", body
    status, _, body = _complete(server, NAME)
    assert status == 200 and body["choices"][0]["text"] == texts["base"] and body["model"] == NAME
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        replies = list(pool.map(lambda m: _complete(server, m), ["a", NAME] * 3))
    assert [r[2]["choices"][0]["text"] for r in replies] == [texts["a"], texts["base"]] * 3
    chat = {"model": "a", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "temperature": 0}
    status, _, body = request(server, "POST", "/v1/chat/completions", chat, USER)
    assert status == 200 and body["model"] == "a", body
    stream = request(server, "POST", "/v1/completions", {"model": "a", "prompt": PROMPT, "max_tokens": 8,
                                                         "temperature": 0, "ignore_eos": True, "stream": True}, USER)
    events = [json.loads(line[6:]) for line in stream[2].decode().splitlines() if line.startswith("data: {")]
    assert "".join(e["choices"][0]["text"] for e in events) == texts["a"] and events[0]["model"] == "a"


def test_request_log_names_the_adapter(served, caplog):
    server, engine, paths, texts = served
    with caplog.at_level("INFO", logger="jserve.server.generate"):
        assert _complete(server, "a")[0] == 200
    assert "with LoRA adapter 'a'" in caplog.text


def test_models_lists_adapters_and_unknown_model_is_vllms_404(served):
    server, engine, paths, texts = served
    status, _, body = request(server, "GET", "/v1/models", headers=USER)
    cards = {c["id"]: c for c in body["data"]}
    assert cards["a"]["root"] == paths["a"] and cards["a"]["parent"] == NAME and cards["a"]["object"] == "model"
    status, _, body = _complete(server, "nope")
    assert_error(status, body, 404, 404, contains=["The model `nope` does not exist."])
    assert body["error"]["type"] == "NotFoundError" and body["error"]["param"] == "model"
    status, _, body = request(server, "POST", "/tokenize", {"model": "a", "prompt": "hi"}, USER)
    assert status == 200 and body["count"] > 0


def test_load_use_unload_at_run_time(served):
    server, engine, paths, texts = served
    load = {"lora_name": "b", "lora_path": paths["b"]}
    assert_error(*request(server, "POST", "/v1/load_lora_adapter", load, USER)[::2], 401, "invalid_admin_key")
    assert_error(*request(server, "POST", "/v1/load_lora_adapter", {"lora_name": "b"}, ADMIN)[::2], 400,
                 contains=["lora_path"])
    assert_error(*request(server, "POST", "/v1/load_lora_adapter", {**load, "x": 1}, ADMIN)[::2], 400,
                 contains=["`x`"])
    status, _, body = request(server, "POST", "/v1/load_lora_adapter", {**load, "lora_path": "/nonexistent"}, ADMIN)
    assert_error(status, body, 400, contains=["/nonexistent"])
    status, _, body = request(server, "POST", "/v1/load_lora_adapter", {**load, "lora_name": "a"}, ADMIN)
    assert_error(status, body, 400, contains=["already been loaded"])
    status, _, body = request(server, "POST", "/v1/load_lora_adapter", {**load, "lora_name": NAME}, ADMIN)
    assert_error(status, body, 400, contains=["served model's name"])
    assert _complete(server, "b")[0] == 404
    status, _, body = request(server, "POST", "/v1/load_lora_adapter", load, ADMIN)
    assert status == 200 and b"'b'" in body, body
    status, _, body = _complete(server, "b")
    assert status == 200 and body["choices"][0]["text"] == texts["b"] and body["model"] == "b", body
    with concurrent.futures.ThreadPoolExecutor(3) as pool:  # two adapters and the base in one batch
        replies = list(pool.map(lambda m: _complete(server, m), ["a", "b", NAME]))
    assert [r[2]["choices"][0]["text"] for r in replies] == [texts["a"], texts["b"], texts["base"]]
    assert "b" in {c["id"] for c in request(server, "GET", "/v1/models", headers=USER)[2]["data"]}
    status, _, body = request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "b"}, ADMIN)
    assert status == 200 and b"removed" in body
    assert _complete(server, "b")[0] == 404

    async def stale():  # a request parsed before the unload does not bring the adapter back
        async for _ in engine.generate("stale", [5, 6], SamplingParams(max_tokens=1),
                                       lora_request=LoRARequest("b", 2, paths["b"])):
            pass
    with pytest.raises(ValueError, match="'b' is not loaded"):
        server.call(stale())
    status, _, body = request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "b"}, ADMIN)
    assert_error(status, body, 404, 404, contains=["'b'"])
    assert server.call(engine.stats())["compilations_after_warmup"] == 0


def test_unload_in_flight_is_refused(served):
    server, engine, paths, texts = served
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        long = pool.submit(_complete, server, "a", max_tokens=100)
        for _ in range(200):  # until the request runs
            if server.call(engine.stats())["lora"]["running"]:
                break
            time.sleep(0.01)
        status, _, body = request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "a"}, ADMIN)
        assert long.result()[0] == 200
    assert_error(status, body, 400, contains=["in flight"])
    assert _complete(server, "a")[2]["choices"][0]["text"] == texts["a"]


def test_metrics(served):
    server, engine, paths, texts = served
    _complete(server, "a")
    status, _, text = request(server, "GET", "/metrics")
    lines = text.decode().splitlines()
    info = [line for line in lines if line.startswith("vllm:lora_requests_info{")]
    assert len(info) == 1 and 'max_lora="2"' in info[0] and 'running_lora_adapters=""' in info[0], info
    assert "jserve_lora_adapters_loaded 1.0" in lines and "jserve_lora_max_loras 2.0" in lines
    assert any(line.startswith('jserve_lora_requests{lora_name="a"}') for line in lines)
    assert any(line.startswith("jserve_lora_slot_loads ") and float(line.split()[1]) >= 1 for line in lines)


def test_without_flag_no_routes_and_modules_need_enable_lora(served):
    server, engine, paths, texts = served
    bare = Server(ServerState(NAME), admin_key="admin-secret")
    try:
        assert request(bare, "POST", "/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "y"}, ADMIN)[0] == 404
    finally:
        bare.close()
    state = ServerState(NAME)
    state.loras.allow_updating = True
    with pytest.raises(ValueError, match="admin key"):
        build_app(state)


@pytest.mark.parametrize("argv, error", [
    (["--lora-modules", "a=/x"], "--lora-modules needs --enable-lora"),
    (["--allow-runtime-lora-updating"], "--allow-runtime-lora-updating needs --enable-lora"),
    (["--enable-lora", "--lora-modules", "a"], "expected name=path"),
    (["--lora-dtype", "float16"], "--lora-dtype: invalid choice: 'float16'"),
    (["--long-lora-scaling-factors", "4"], "LongLoRA")])
def test_serve_refuses_before_loading(argv, error, capsys):
    from jserve.cli import main

    try:
        status = main(["serve", "--model", "/nonexistent-model", *argv])
    except SystemExit as e:  # argparse's own refusals (a choice it does not know)
        status = e.code
    assert status == 2
    assert error in capsys.readouterr().err


@pytest.mark.parametrize("value, error", [
    ("a", "expected name=path"), ('{"name": "a"}', "'path'"), ('{"name": "a", "path": "p", "rank": 2}', "'rank'"),
    (f"{NAME}=p", "taken"), ("{bad", "not valid JSON")])
def test_bad_lora_modules(value, error):
    with pytest.raises(ValueError, match=error):
        loras.parse_modules([value], (NAME,))


def test_lora_modules_forms():
    mods = loras.parse_modules(["x=/p/x", '{"name": "y", "path": "org/y", "base_model_name": "base"}'], (NAME,))
    assert mods == [LoRARequest("x", 1, "/p/x"), LoRARequest("y", 2, "org/y", "base")]


def test_vllm_lora_flags_without_effect_are_logged(caplog):
    from jserve.cli import build_parser
    from jserve.vllm_args import apply_vllm_args

    args = build_parser().parse_args(["serve", "--fully-sharded-loras", "--max-lora-extra-vocab-size", "256",
                                      "--lora-dtype", "auto"])
    with caplog.at_level("INFO", logger="jserve"):
        apply_vllm_args(args)
    assert "--fully-sharded-loras: accepted, no effect" in caplog.text
    assert "--max-lora-extra-vocab-size: accepted, no effect" in caplog.text


def test_the_readme_example_works_as_written(served):
    """The README's LoRA block: its curl line against this server with an adapter loaded as "sql"
    (its `jserve serve` line is this server; the API key added)."""
    import re
    import subprocess
    from pathlib import Path

    server, _, paths, texts = served
    readme = (Path(__file__).parent.parent / "README.md").read_text()
    block = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "--enable-lora" in b)
    (command,) = re.findall(r"^curl .*?(?<!\\)$", block.replace("\\\n", " "), re.M)
    status, _, body = request(server, "POST", "/v1/load_lora_adapter", {"lora_name": "sql", "lora_path": paths["a"]},
                              ADMIN)
    assert status == 200, body
    try:
        command = command.replace("localhost:8000", f"127.0.0.1:{server.port}") + " -H 'Authorization: Bearer user-key'"
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr
        answer = json.loads(done.stdout)
        assert answer["model"] == "sql" and answer["choices"][0]["text"], answer
    finally:
        request(server, "POST", "/v1/unload_lora_adapter", {"lora_name": "sql"}, ADMIN)
