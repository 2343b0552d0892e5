"""`merge_streams`: one stream's outputs pass straight through, tagged 0; several interleave as
they come, each tagged with its stream's index; closing the merge early stops every stream."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from ember.server.serving import merge_streams


async def _stream(items: list[str], delay: float, closed: list[str]) -> AsyncIterator[str]:
    try:
        for item in items:
            await asyncio.sleep(delay)
            yield item
    finally:
        closed.append(items[0])


def test_one_stream_passes_straight_through() -> None:
    async def main() -> list[tuple[int, str]]:
        return [x async for x in merge_streams([_stream(["a", "b", "c"], 0, [])])]

    assert asyncio.run(main()) == [(0, "a"), (0, "b"), (0, "c")]


def test_several_interleave_as_they_come() -> None:
    async def main() -> list[tuple[int, str]]:
        slow, fast = _stream(["s1", "s2"], 0.05, []), _stream(["f1", "f2", "f3"], 0.01, [])
        return [x async for x in merge_streams([slow, fast])]

    got = asyncio.run(main())
    assert sorted(got) == [(0, "s1"), (0, "s2"), (1, "f1"), (1, "f2"), (1, "f3")]
    assert got[:3] == [(1, "f1"), (1, "f2"), (1, "f3")]  # the fast one first, in its order


def test_closing_early_stops_the_streams() -> None:
    async def main(n: int) -> list[str]:
        closed: list[str] = []
        streams = [_stream([f"{i}a", f"{i}b", f"{i}c"], 0.01, closed) for i in range(n)]
        merged = merge_streams(streams)
        assert (await anext(merged))[1].endswith("a")
        await merged.aclose()
        for s in streams:  # what the handler's own cleanup does (RequestStream.aclose)
            await s.aclose()
        await asyncio.sleep(0.05)
        return closed

    assert asyncio.run(main(1)) == ["0a"]
    assert sorted(asyncio.run(main(2))) == ["0a", "1a"]
