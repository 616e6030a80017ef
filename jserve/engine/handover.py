"""What passes between `AsyncLLMEngine`'s asyncio side and its engine thread: the `Command`s the
thread takes, and items the thread posts back to an event loop (`post`: a stream's queue gets
them, a future its result or exception). Pure Python; the threading model is
`jserve.engine.async_engine`'s."""

from __future__ import annotations

import asyncio
import dataclasses


@dataclasses.dataclass
class Command:
    kind: str  # "add" | "abort" | "stats" | "stop" | "call" (AsyncWeightControl)
    request_id: str | None = None
    args: tuple = ()
    kwargs: dict = dataclasses.field(default_factory=dict)
    queue: asyncio.Queue | None = None  # the stream ("add"; "abort" from a closing stream)
    loop: asyncio.AbstractEventLoop | None = None
    future: asyncio.Future | None = None  # resolved on `loop` ("abort", "stats")
    abort_all: bool = True  # "stop": abort in-flight requests, else finish them first


def post(loop: asyncio.AbstractEventLoop, batch: list) -> bool:
    """Hand (queue or future, item) pairs to `loop`; False if that loop is closed."""
    try:
        loop.call_soon_threadsafe(_deliver, batch)
        return True
    except RuntimeError:
        return False


def _deliver(batch: list) -> None:
    for target, item in batch:
        if isinstance(target, asyncio.Queue):
            target.put_nowait(item)
        elif not target.done():  # the awaiting caller may have been cancelled
            if isinstance(item, BaseException):
                target.set_exception(item)
            else:
                target.set_result(item)


async def latest(queue: asyncio.Queue):
    """The newest item of a stream's queue once it holds any (the steps a slow consumer missed
    coalesced), or the exception posted among them."""
    items = [await queue.get()]
    while not queue.empty():
        items.append(queue.get_nowait())
    return next((i for i in items if isinstance(i, BaseException)), items[-1])
