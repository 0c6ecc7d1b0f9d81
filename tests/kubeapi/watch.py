"""Watch streams: newline-delimited `{"type", "object"}` JSON events, as `?watch=true` serves them."""

import asyncio
from collections.abc import AsyncIterator, Callable
from typing import Any

from .errors import ApiError
from .store import Obj, Store
from .resources import ResourceType

# How often an idle watch checks that its client is still there.
_IDLE_CHECK_S = 1.0


async def stream(store: Store, rt: ResourceType, namespace: str | None, predicate: Callable[[Obj], bool],
                 since: str | None, timeout_s: float | None, render: Callable[[Obj], Any],
                 connected: Callable[[], bool]) -> AsyncIterator[Any]:
    """Yield the events for one watch request until it times out, is dropped, or the client leaves.

    The first item is b"" so the response headers go out at once: clients (kubectl, kopf) wait
    for them before they count the watch as established.
    """
    try:
        first, watcher = store.watch(rt, namespace, predicate, since)
    except ApiError as exc:
        # A watch reports a too-old resourceVersion in-band, as an ERROR event (clients relist on 410).
        yield b""
        yield {"type": "ERROR", "object": exc.status()}
        return
    loop = asyncio.get_running_loop()
    deadline = None if timeout_s is None else loop.time() + timeout_s
    try:
        yield b""
        for type_, obj in first:
            yield {"type": type_, "object": render(obj)}
        while connected():
            wait = _IDLE_CHECK_S if deadline is None else min(_IDLE_CHECK_S, deadline - loop.time())
            if wait <= 0:
                return
            try:
                item = await asyncio.wait_for(watcher.queue.get(), wait)
            except TimeoutError:
                continue
            if item is None:
                return  # the server dropped this watch
            type_, obj = item
            yield {"type": type_, "object": render(obj)}
    finally:
        store.unwatch(watcher)
