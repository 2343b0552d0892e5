"""Where an engine step's host time goes, for benchmarks/spec_decode.py: the engine core's phases
timed by wrapping its objects' methods on one engine instance (nothing in `ember` changes).

A speculating request's step is not overlapped with the next one's host work (its drafts come
from its tokens), so each of these phases adds to the step's period; in a plain async decode they
run while the GPU works. `wait` is the time the host blocked on the GPU (the runner's own
`sync_wait_s`); the rest of a step's period is host work. `to_replay` is the host's time from a
step's tokens to the next graph launch, summed where a graph follows a collected step (in a
synchronous step it is the host's share of the critical path; the sampler's launches after the
replay run while the GPU works).

A module of benchmarks/spec_decode.py and benchmarks/probes/spec_step_profile.py, not run on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from ember.engine.llm_engine import LLMEngine

PHASES = ("plan_propose", "schedule", "launch", "finish", "update", "record", "output")
IN_LAUNCH = ("graph_replay", "staged_wait", "graph_launch", "sample")
"""Parts of `launch`: the decode graphs' replay (filling and copying the inputs, waiting for the
staging buffer, launching the graph), of which the wait and the CUDA graph's launch call alone,
and the sampler's host work and launches."""


class PhaseTimer:
    """Seconds per phase since the last `reset`, and the runner's sync wait over the same span."""

    def __init__(self, engine: LLMEngine) -> None:
        core = engine.core
        self.runner = core.runner
        # to_replay: the host's time from one step's tokens (the end of `finish`) to the next
        # graph launch (the start of a graph replay): what a synchronous step adds to the GPU's.
        self.seconds = dict.fromkeys((*PHASES, *IN_LAUNCH, "to_replay"), 0.0)
        self._wait0 = self.runner.sync_wait_s
        self._finished_at: float | None = None
        self.counts = dict.fromkeys(("launches", "replays"), 0)
        self._wrap(core.scheduler, "schedule", "schedule")
        self._wrap(core.scheduler, "update_from_output", "update")
        self._wrap(core.runner, "launch", "launch", before=self._count_launch)
        self._wrap(core.runner, "finish", "finish", after=self._mark_finished)
        self._wrap(engine.processor, "process", "output")
        self._wrap(core.runner, "_sample", "sample")
        graphs = core.runner.graphs
        if graphs.graphs:
            self._wrap(graphs, "replay", "graph_replay", before=self._count_to_replay)
            for g in [*graphs.graphs.values(), *graphs.verify_graphs.values()]:
                g.graph = _TimedGraph(g.graph, self.seconds)
            graphs._staged = _TimedEvent(graphs._staged, self.seconds)
        if core.spec is not None:
            self._wrap(core.spec, "plan", "plan_propose")
            self._wrap(core.spec, "propose", "plan_propose")
            self._wrap(core.spec, "record_step", "record")

    def _wrap(
        self,
        obj: Any,
        method: str,
        phase: str,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> None:
        inner: Callable[..., Any] = getattr(obj, method)
        seconds = self.seconds

        def timed(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                before()
            t0 = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                seconds[phase] += time.perf_counter() - t0
                if after is not None:
                    after()

        setattr(obj, method, timed)

    def _mark_finished(self) -> None:
        self._finished_at = time.perf_counter()

    def _count_launch(self) -> None:
        self.counts["launches"] += 1

    def _count_to_replay(self) -> None:
        self.counts["replays"] += 1
        if self._finished_at is not None:
            self.seconds["to_replay"] += time.perf_counter() - self._finished_at
            self._finished_at = None

    def reset(self) -> None:
        for k in self.seconds:
            self.seconds[k] = 0.0
        self.counts = dict.fromkeys(("launches", "replays"), 0)
        self._finished_at = None
        self._wait0 = self.runner.sync_wait_s

    def take(self) -> dict[str, float]:
        """Seconds per phase since the last take (finish without its wait), the wait, and the
        steps launched without a CUDA graph (`eager`: prefill chunks, shapes with no graph)."""
        wait = self.runner.sync_wait_s - self._wait0
        out = dict(self.seconds)
        out["finish"] = max(out["finish"] - wait, 0.0)
        out["wait"] = wait
        out["eager"] = self.counts["launches"] - self.counts["replays"]
        self.reset()
        return out


class _TimedGraph:
    """A CUDA graph whose replay call is timed (the host's time in cudaGraphLaunch)."""

    def __init__(self, graph: Any, seconds: dict[str, float]) -> None:
        self.graph, self.seconds = graph, seconds

    def replay(self) -> None:
        t0 = time.perf_counter()
        self.graph.replay()
        self.seconds["graph_launch"] += time.perf_counter() - t0


class _TimedEvent:
    """The staging buffer's CUDA event, its synchronize timed."""

    def __init__(self, event: Any, seconds: dict[str, float]) -> None:
        self.event, self.seconds = event, seconds

    def record(self) -> None:
        self.event.record()

    def synchronize(self) -> None:
        t0 = time.perf_counter()
        self.event.synchronize()
        self.seconds["staged_wait"] += time.perf_counter() - t0


def per_step_ms(seconds: dict[str, float], steps: int, wall_s: float) -> dict[str, float]:
    """Milliseconds per engine step: each phase, the wait, the host's share (the period less the
    wait) and the period; and the count of eager steps."""
    if not steps:
        return {}
    out = {k: round(1e3 * v / steps, 4) for k, v in seconds.items() if k != "eager"}
    out["eager_steps"] = seconds.get("eager", 0)
    out["period"] = round(1e3 * wall_s / steps, 4)
    out["host"] = round(out["period"] - out.get("wait", 0.0), 4)
    return out
