"""Stop strings: find the earliest one that the newest text completes, and where to cut."""

from __future__ import annotations


def find_stop_string(
    text: str, new_chars: int, stops: list[str], include_stop: bool
) -> tuple[int, str] | None:
    """(length to truncate `text` to, the stop string) if a stop string ends in the new text.

    Only matches that overlap the last `new_chars` characters are new; earlier text was checked
    on earlier tokens.
    """
    best: tuple[int, str] | None = None
    for stop in stops:
        start = max(0, len(text) - new_chars - len(stop) + 1)
        idx = text.find(stop, start)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, stop)
    if best is None:
        return None
    idx, stop = best
    return (idx + len(stop) if include_stop else idx), stop
