"""`jserve bench`'s multi-turn chat workload (a shared system prompt, each chat's history growing
turn by turn); the client and the other workloads: tests/test_bench_serving.py."""

from __future__ import annotations

import pytest

import jserve.bench as bench
from jserve.bench import workloads


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_multi_turn_workload_grows_each_chats_history(endpoint):
    specs = bench.build_workload("multi-turn", 20, endpoint, 0.25, seed=3)
    chats = workloads.MULTI_TURN_CHATS
    assert len(specs) == 20 and {s.kind for s in specs} == {"multi-turn"}
    text = [s.prompt if s.messages is None else "\n\n".join(m["content"] for m in s.messages) for s in specs]
    system = text[0].split("\n\n")[0]
    assert system.startswith("You are a helpful assistant. ") and all(t.startswith(system) for t in text)
    for i in range(chats, 20):  # a turn's prompt starts with the chat's turn before, then an answer
        assert text[i].startswith(text[i - chats] + "\n\n") and len(text[i]) > len(text[i - chats])
        assert not text[i].startswith(text[i - 1] + "\n\n")  # another chat
    if endpoint == "chat":
        assert [m["role"] for m in specs[chats].messages] == ["system", "user", "assistant", "user"]
