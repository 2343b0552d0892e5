"""`ember up`: a local cluster in one command. Prefill and decode engines (`ember serve --role ...`)
and a router in front of them, each its own subprocess; waits until all are healthy, prints the URL
and an example request, restarts an engine that dies (with back-off) while the router routes around
it, and stops them all on Ctrl-C or SIGTERM (at once, during start-up too) or when the router dies.

Every child gets a fresh cluster secret through its environment (never its command line, which
`ps` shows): the engines' internal routes answer only the router and each other. API keys go to the
router only, in a private file, for the same reason.

With `--store`, a `mooncake_master` starts first (on `--host`, a free port), every engine gets a
store tier on it (`--kv-store`), it is restarted if it dies, and stopped last.

`spawn`, `wait_healthy`, `wait_routed` and `stop_cluster` also start and stop the servers of the
benchmarks (benchmarks/server_overhead.py, pd_gpu.py, pd_cpu.py); `ember.up_process` runs
`ember up` itself as a child."""

from __future__ import annotations

import argparse
import json
import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType
from typing import NoReturn

from ember.home import remove_cluster_secret, write_cluster_secret
from ember.kv.tiers.store_master import StoreMaster, start_master
from ember.parent_death import child_dies_with_us, left_by_dead_processes
from ember.server.args import add_kv_transport_arg
from ember.trust import SECRET_ENV, TenantKeys, internal_headers, new_secret

LOG_LEVELS = ("debug", "info", "warning", "error", "critical")

RESTART_BACKOFF_S = (1.0, 30.0)
"""A dead engine is restarted after 1 s, then 2, 4 ... up to 30 s while it keeps dying."""


def add_up_args(p: argparse.ArgumentParser) -> None:
    """`ember up`'s flags, in the groups its --help shows."""
    g = p.add_argument_group("model", "what the engines serve, and under which names")
    g.add_argument(
        "model",
        nargs="?",
        default=None,
        help="model directory, .gguf file or known model's name (default: smollm2, "
        "SmolLM2-135M-Instruct, `ember model get smollm2`)",
    )
    g.add_argument(
        "--served-model-name",
        nargs="+",
        default=None,
        metavar="NAME",
        help="the model ids clients send (the first is the one answers carry); default: the "
        "model argument, or for the default model its directory's name (smollm2-135m-instruct)",
    )
    g.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="the engines' context length in tokens (default: the model's own, config.json's "
        "max_position_embeddings)",
    )
    g.add_argument("--dtype", default=None, help="the engines' dtype (engine default: auto)")

    g = p.add_argument_group("cluster", "how many engines of each role, where, and its logs")
    g.add_argument(
        "--prefill",
        type=int,
        default=None,
        help="prefill engines (default: 1, or 0 when --engine-args make the engines tensor "
        "parallel and neither --prefill nor --decode is given: one colocated engine then)",
    )
    g.add_argument(
        "--decode",
        type=int,
        default=None,
        help="decode engines (default: 1, or 0 with tensor-parallel engines and no role given)",
    )
    g.add_argument(
        "--both",
        type=int,
        default=None,
        help="colocated engines (default: 0, or 1 with tensor-parallel engines and no role given)",
    )
    g.add_argument("--host", default="127.0.0.1", help="the address every process listens on")
    g.add_argument("--port", type=int, default=8000, help="the router's port")
    g.add_argument("--engine-port", type=int, default=None, help="first engine port (port + 1)")
    g.add_argument(
        "--ready-timeout",
        type=float,
        default=300.0,
        help="seconds the engines and the router may take to become healthy",
    )
    g.add_argument(
        "--log-level",
        type=str.lower,
        choices=LOG_LEVELS,
        default=None,
        help="the log level of every engine, engine core and the router (default: warning); "
        "they all log to ember up's stderr",
    )

    g = p.add_argument_group("engines", "settings every engine gets")
    g.add_argument("--device", default="cpu", help="cpu, or cuda / cuda:N")
    g.add_argument(
        "--max-num-batched-tokens", type=int, default=None, help="tokens per engine step"
    )
    g.add_argument(
        "--max-num-seqs", type=int, default=None, help="sequences an engine runs at once"
    )
    g.add_argument(
        "--engine-args",
        default="",
        metavar="ARGS",
        help='any other `ember serve` flags for every engine, one string: "--kv-lease-s 60 '
        '--block-size 32" (flags ember up sets itself are refused)',
    )

    g = p.add_argument_group("routing", "how prompts split between prefill and decode engines")
    add_kv_transport_arg(g)
    g.add_argument(
        "--disagg-min-uncached",
        type=int,
        default=256,
        help="prompts with fewer uncached tokens go whole to a decode engine (the router's flag)",
    )
    g.add_argument(
        "--stall-timeout",
        type=float,
        default=None,
        help="the router ends a stream that has sent no token for this long (router default)",
    )
    g.add_argument(
        "--kv-timeout",
        type=float,
        default=None,
        help="decode engines prefill a prompt themselves when its KV read takes longer (10 s)",
    )

    g = p.add_argument_group("KV tiers", "a KV store every engine shares")
    g.add_argument(
        "--store",
        action="store_true",
        help="a Mooncake Store as every engine's shared KV tier: starts a mooncake_master first "
        "and gives each engine --kv-store (an existing master: --engine-args '--kv-store H:P')",
    )

    g = p.add_argument_group("security", "the router's API keys and tenants")
    g.add_argument(
        "--api-key",
        nargs="+",
        default=os.environ.get("EMBER_API_KEY", "").split() or None,
        help="API keys the router asks of clients (each its own tenant); default: EMBER_API_KEY",
    )
    g.add_argument(
        "--api-keys-file",
        default=None,
        help='API keys with tenant names: JSON {"KEY": "TENANT"} or lines KEY TENANT [CACHE_GROUP]',
    )
    g.add_argument(
        "--shared-cache", action="store_true", help="let all tenants share one prefix cache"
    )

    g = p.add_argument_group("demo", "a first request once the cluster is up")
    g.add_argument(
        "--demo", action="store_true", help="once up, send one streamed chat request and print it"
    )
    g.add_argument(
        "--exit-after-demo", action="store_true", help="stop the cluster after the demo request"
    )


UP_SETS = frozenset((
    "--host", "--port", "--role", "--device", "--max-model-len", "--kv-transport", "--kv-host",
    "--cpu-threads", "--log-level", "--kv-peers", "--kv-timeout", "--max-num-batched-tokens",
    "--max-num-seqs", "--dtype", "--served-model-name", "--api-key", "--api-keys-file",
    "--shared-cache", "--cluster-secret", "--require-secret",
))  # fmt: skip
"""`ember serve` flags that ember up sets itself (or has a flag of its own for)."""


class _StrictParser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        raise ValueError(f"--engine-args: {message}")


def tensor_parallel_size(extra: list[str]) -> int:
    """The `--tensor-parallel-size` (`-tp`) of checked `--engine-args`; 1 without it."""
    from ember.server.args import add_serve_args

    p = _StrictParser(prog="ember serve", allow_abbrev=False, add_help=False)
    add_serve_args(p)
    return int(p.parse_args(["MODEL", *extra]).tensor_parallel_size)


def gpu_slices(device: str, tp: int, engines: int) -> list[str] | None:
    """Each engine's CUDA_VISIBLE_DEVICES when its ranks need GPUs of their own: engine i takes
    the i-th run of `tp` GPUs of those visible to ember up (CUDA_VISIBLE_DEVICES, else 0, 1,
    ...). None where nothing is to split (one GPU an engine, or the CPU)."""
    if tp == 1 or not device.startswith("cuda"):
        return None
    if device != "cuda":
        raise ValueError(f"--device {device}: tensor-parallel engines take --device cuda")
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(tp * engines)]
    if len(ids) < tp * engines:
        raise ValueError(
            f"{engines} engines of {tp} GPUs need {tp * engines}; CUDA_VISIBLE_DEVICES has "
            f"{len(ids)}"
        )
    return [",".join(ids[i * tp : (i + 1) * tp]) for i in range(engines)]


def engine_extra_args(text: str) -> list[str]:
    """`--engine-args`, split as a shell would and checked against `ember serve`'s parser now:
    a typo is a one-line error before anything starts, not an engine that dies starting."""
    from ember.server.args import add_serve_args, speculative_config_from_args

    extra = shlex.split(text)
    taken = sorted({a.split("=")[0] for a in extra if a.split("=")[0] in UP_SETS})
    if taken:
        raise ValueError(f"--engine-args: ember up sets {', '.join(taken)} itself (ember up -h)")
    p = _StrictParser(prog="ember serve", allow_abbrev=False, add_help=False)
    add_serve_args(p)
    parsed = p.parse_args(["MODEL", *extra])
    try:
        speculative_config_from_args(parsed)  # values argparse lets through: K = 0, eagle3 alone
    except ValueError as e:
        raise ValueError(f"--engine-args: {e}") from e
    return extra


def served_names(args: argparse.Namespace, model: str) -> list[str] | None:
    """`--served-model-name`, else for the default model or a known one named (`ember up
    smollm2`) its directory's name (and its path, which older clients send: accepted, not listed
    by /v1/models), else None: the engines then serve the model argument as given."""
    from ember.models.resolve import names_known_model

    if names := getattr(args, "served_model_name", None):
        return list(names)
    given = getattr(args, "model", "")
    if given is None or names_known_model(given):
        return [Path(model).name, model]
    return None


@dataclass(slots=True)
class Proc:
    name: str
    url: str
    popen: subprocess.Popen[bytes]
    args: tuple[str, ...] = ()
    """`ember ...` arguments, to start it again the same way."""
    env: dict[str, str] = field(default_factory=dict)


def spawn(name: str, url: str, args: Sequence[str], env: Mapping[str, str] | None = None) -> Proc:
    """`python -m ember.cli *args` as a child process (logging at WARNING unless the caller's
    EMBER_LOG_LEVEL or `env` says otherwise); `url` is where it will answer."""
    level = os.environ.get("EMBER_LOG_LEVEL", "WARNING")
    full_env = {**os.environ, "EMBER_LOG_LEVEL": level, **(env or {})}
    cmd = [sys.executable, "-m", "ember.cli", *args]
    # A SIGKILLed `ember up` (or benchmark) must not leave its cluster serving: the kernel sends
    # every child SIGTERM when its parent dies, and each stops its own children in turn.
    popen = subprocess.Popen(cmd, env=full_env, preexec_fn=child_dies_with_us())  # noqa: PLW1509
    return Proc(name, url, popen, tuple(args), dict(env or {}))


def respawn(p: Proc) -> None:
    """Start a dead process again with its own arguments and environment (same port)."""
    p.popen = spawn(p.name, p.url, p.args, p.env).popen


def port_in_use(host: str, port: int) -> bool:
    """Whether something already listens on host:port (a bind with SO_REUSEADDR fails, as the
    servers' own bind would; a port in TIME_WAIT counts as free, as it does for them)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError:
            return True
        return False


def check_ports(host: str, ports: Sequence[int]) -> None:
    busy = [p for p in ports if port_in_use(host, p)]
    if busy:
        raise ValueError(
            f"port{'s' if len(busy) > 1 else ''} {', '.join(map(str, busy))} "
            f"{'are' if len(busy) > 1 else 'is'} in use"
        )


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def engine_counts(args: argparse.Namespace) -> tuple[int, int, int]:
    """(prefill, decode, both) engines: as given, the rest by default: one prefill and one decode
    engine, or, when `--engine-args` make the engines tensor parallel (each then takes N GPUs)
    and no prefill or decode engines are asked for, one colocated engine."""
    extra = engine_extra_args(getattr(args, "engine_args", "") or "")
    given = (args.prefill, args.decode, args.both)
    roles_given = args.prefill is not None or args.decode is not None
    defaults = (0, 0, 1) if tensor_parallel_size(extra) > 1 and not roles_given else (1, 1, 0)
    prefill, decode, both = (d if n is None else n for n, d in zip(given, defaults, strict=True))
    return prefill, decode, both


def engine_plan(args: argparse.Namespace) -> list[tuple[str, int]]:
    """(role, port) of each engine, in start order."""
    prefill, decode, both = engine_counts(args)
    roles = [("prefill", prefill), ("decode", decode), ("both", both)]
    if sum(n for _, n in roles) == 0 or decode + both == 0:
        raise ValueError("ember up needs at least one decode or colocated engine")
    port = args.engine_port or args.port + 1
    return [(role, port + i) for i, role in enumerate(r for r, n in roles for _ in range(n))]


def start_cluster(
    args: argparse.Namespace,
    model: str,
    secret: str,
    keys_file: str | None = None,
    procs: list[Proc] | None = None,
    store: str | None = None,
) -> list[Proc]:
    """Start the engines and the router; returns them, router last (not yet healthy). `secret`
    reaches every child as EMBER_CLUSTER_SECRET; `keys_file` (API keys) the router only; `store`
    (a mooncake_master's HOST:PORT) every engine as `--kv-store`. Each child is appended to
    `procs` as soon as it exists, so a signal midway leaves none unknown."""
    plan = engine_plan(args)
    threads = max(1, ((os.cpu_count() or 2) - 1) // len(plan))
    # Engines sit behind the router: they ask no API key (the router's calls carry the secret).
    env = {SECRET_ENV: secret, "EMBER_API_KEY": ""}
    # --log-level: the API processes' flag, and the engine cores' EMBER_LOG_LEVEL (unset, the
    # cores keep the caller's EMBER_LOG_LEVEL, else WARNING: see `spawn`).
    level = getattr(args, "log_level", None) or "warning"
    if getattr(args, "log_level", None):
        env["EMBER_LOG_LEVEL"] = level.upper()
    urls: dict[str, list[str]] = {"prefill": [], "decode": [], "both": []}
    for role, port in plan:
        urls[role].append(f"http://{args.host}:{port}")
    procs = [] if procs is None else procs
    batched = getattr(args, "max_num_batched_tokens", None)
    names = served_names(args, model)
    extra = engine_extra_args(getattr(args, "engine_args", "") or "")
    tp = tensor_parallel_size(extra)
    threads = max(1, threads // tp)  # each rank of an engine is a process of its own
    gpus = gpu_slices(args.device, tp, len(plan))
    for i, (role, port) in enumerate(plan):
        cmd = [
            "serve", model, "--host", args.host, "--port", str(port), "--role", role,
            "--device", args.device, "--kv-transport", args.kv_transport, "--kv-host", args.host,
            "--cpu-threads", str(threads), "--log-level", level, "--require-secret",
        ]  # fmt: skip
        if getattr(args, "max_model_len", None):
            cmd += ["--max-model-len", str(args.max_model_len)]
        if batched:
            cmd += ["--max-num-batched-tokens", str(batched)]
        if names:
            cmd += ["--served-model-name", *names]
        if getattr(args, "max_num_seqs", None) is not None:
            cmd += ["--max-num-seqs", str(args.max_num_seqs)]
        if getattr(args, "dtype", None):
            cmd += ["--dtype", args.dtype]
        if getattr(args, "kv_timeout", None) is not None:
            cmd += ["--kv-timeout", str(args.kv_timeout)]
        if role != "prefill" and urls["prefill"]:
            cmd += ["--kv-peers", *urls["prefill"]]  # the only engines it reads KV from
        if store:
            cmd += ["--kv-store", store]
        cmd += extra
        name = f"{role}-{sum(p.name.startswith(role) for p in procs)}"
        engine_env = env if gpus is None else {**env, "CUDA_VISIBLE_DEVICES": gpus[i]}
        procs.append(spawn(name, f"http://{args.host}:{port}", cmd, engine_env))
    rcmd = [
        "router", "--host", args.host, "--port", str(args.port), "--model", model,
        "--disagg-min-uncached", str(args.disagg_min_uncached), "--log-level", level,
    ]  # fmt: skip
    if getattr(args, "stall_timeout", None) is not None:
        rcmd += ["--stall-timeout", str(args.stall_timeout)]
    if keys_file:
        rcmd += ["--api-keys-file", keys_file]
    if getattr(args, "shared_cache", False):
        rcmd.append("--shared-cache")
    for role, found in urls.items():
        if found:
            rcmd += [f"--{role}", *found]
    procs.append(spawn("router", f"http://{args.host}:{args.port}", rcmd, env))
    return procs


KEYS_FILE_PREFIX = "ember-keys-"


def write_keys_file(keys: TenantKeys) -> str | None:
    """The router's API keys as a private JSON file (mode 0600), so no key is on a command line.
    Its name holds this process's id: a later `ember up` removes it if this one was killed."""
    remove_stale_keys_files()
    if not keys.enabled:
        return None
    fd, path = tempfile.mkstemp(prefix=f"{KEYS_FILE_PREFIX}{os.getpid()}-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(
            {k: {"tenant": t.name, "cache_group": t.cache_group} for k, t in keys.keys.items()}, f
        )
    return path


def remove_stale_keys_files(directory: str | None = None) -> list[str]:
    """Remove the keys files of `ember up` processes that are gone (killed before they could);
    returns the paths removed. A file of a live process, or of another user, is left alone."""
    root = Path(directory or tempfile.gettempdir())
    removed = []
    for f in left_by_dead_processes(root.glob(f"{KEYS_FILE_PREFIX}*-*.json"), KEYS_FILE_PREFIX):
        try:
            f.unlink()
            removed.append(str(f))
        except OSError:
            continue
    return removed


def listening_inodes(port: int) -> set[str]:
    """Inodes of the sockets listening on `port` (any address), from /proc/net/tcp and tcp6."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            f = row.split()
            if f[3] == "0A" and int(f[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                inodes.add(f[9])
    return inodes


def holds_port(pid: int, port: int) -> bool | None:
    """Whether process `pid` itself listens on `port`; None where /proc cannot tell (not Linux)."""
    if not Path("/proc/net/tcp").exists():
        return None
    want = listening_inodes(port)
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return False
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:[") and link[8:-1] in want:
            return True
    return False


def answers_as(p: Proc) -> bool:
    """`p` answers /health on its port and the port is `p`'s own: a healthy stranger on it (an
    earlier cluster's router, say) is not our child, which failed to bind or is still starting."""
    port = urllib.parse.urlsplit(p.url).port
    return _healthy(p.url) and (port is None or holds_port(p.popen.pid, port) is not False)


def wait_healthy(procs: list[Proc], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    waiting = list(procs)
    while waiting:
        for p in list(waiting):
            if p.popen.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.popen.returncode} while starting")
            if answers_as(p):
                waiting.remove(p)
        if time.monotonic() > deadline:
            raise TimeoutError(f"not healthy after {timeout_s:.0f} s: {[p.name for p in waiting]}")
        time.sleep(0.3)


def get_load(url: str, secret: str, timeout_s: float = 5.0) -> dict:
    """An engine's or the router's internal /load (it needs the cluster secret)."""
    req = urllib.request.Request(f"{url}/load", headers=internal_headers(secret))
    with urllib.request.urlopen(req, timeout=timeout_s) as r:
        return json.load(r)


def router_endpoints(router_url: str, secret: str) -> list[dict]:
    """The router's view of its engines (its internal /load, which needs the cluster secret)."""
    return get_load(router_url, secret, timeout_s=2)["endpoints"]


def wait_routed(
    router_url: str,
    secret: str,
    timeout_s: float = 60.0,
    child: subprocess.Popen[bytes] | None = None,
) -> None:
    """Until the router has marked every engine behind it healthy (its /health answers once a
    decode-capable engine is up; a prefill engine it has not polled yet would get no traffic).
    `child`, the process that runs them all (an `ember up`), ends the wait if it exits."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            endpoints = router_endpoints(router_url, secret)
            if endpoints and all(e["healthy"] for e in endpoints):
                return
        except (urllib.error.URLError, OSError, ValueError, KeyError):
            pass
        if child is not None and child.poll() is not None:
            raise RuntimeError(f"it exited with {child.returncode}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"the router at {router_url} has unhealthy engines")
        time.sleep(0.1)


def stop_processes(popens: Sequence[subprocess.Popen[bytes]], grace_s: float = 10.0) -> None:
    """SIGTERM to each that still runs, in order; then wait for all of them within `grace_s`,
    killing any that outlives it."""
    for p in popens:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in popens:
        try:
            p.wait(max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def stop_cluster(procs: list[Proc], grace_s: float = 10.0) -> None:
    # The router first: no new requests reach dying engines.
    stop_processes([p.popen for p in reversed(procs)], grace_s)


DEMO_QUESTION = "What is the capital of France?"


def demo_request(url: str, model: str, api_key: str | None = None) -> str:
    """One streamed chat request through the router, its answer printed as it arrives; returns the
    streamed text. The system prompt makes the prompt long enough to be split into two legs."""
    system = "You are a helpful assistant. Answer in one short sentence. " * 40
    body = {
        "model": model,
        "messages": [
            {"role": "system", "content": system},
            {"role": "user", "content": DEMO_QUESTION},
        ],
        "max_tokens": 48,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    headers = {"content-type": "application/json", "x-session-affinity": "ses_demo"}
    if api_key:
        headers["authorization"] = f"Bearer {api_key}"
    req = urllib.request.Request(f"{url}/v1/chat/completions", json.dumps(body).encode(), headers)
    text = []
    with urllib.request.urlopen(req, timeout=120) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(chunk["error"].get("message"))
            for c in chunk.get("choices", []):
                delta = c.get("delta", {}).get("content") or ""
                text.append(delta)
                print(delta, end="", flush=True)
            if chunk.get("usage"):
                print(f"\nusage: {json.dumps(chunk['usage'])}", flush=True)
    return "".join(text)


class Stopped(Exception):
    """Ctrl-C or SIGTERM: raised from the signal handler, so a wait of any kind ends at once."""


@dataclass(slots=True)
class StopSignals:
    """SIGINT and SIGTERM raise `Stopped` wherever the main thread is, except inside `held()`
    (starting a child: raised between fork and the Proc's bookkeeping, it would orphan it), where
    the signal waits until the block ends. Signals are not blocked there instead, because a child
    inherits the blocked mask and would then ignore our SIGTERM."""

    holding: bool = False
    pending: str | None = None

    def install(self) -> None:
        signal.signal(signal.SIGTERM, self._on_signal)
        signal.signal(signal.SIGINT, self._on_signal)

    def _on_signal(self, signum: int, _frame: FrameType | None) -> None:
        # Once stopping, further signals are ignored: stop_cluster must not be interrupted.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        self.pending = signal.Signals(signum).name
        if not self.holding:
            raise Stopped(self.pending)

    @contextmanager
    def held(self) -> Iterator[None]:
        self.holding = True
        try:
            yield
        finally:
            self.holding = False
        if self.pending:
            raise Stopped(self.pending)


@dataclass(slots=True)
class Supervisor:
    """Restarts dead engines with exponential back-off and a dead store master at once (on its
    port: the engines reconnect to it, its index empty); reports a dead router."""

    engines: list[Proc]
    router: Proc
    store: StoreMaster | None = None
    backoff: dict[str, float] = field(default_factory=dict)
    """Per engine: the delay its next restart waits (reset once it answers /health again)."""
    due: dict[str, float] = field(default_factory=dict)
    """Per dead engine: when it is restarted."""
    recovering: set[str] = field(default_factory=set)
    signals: StopSignals = field(default_factory=StopSignals)

    def check(self) -> str | None:
        """One pass; returns why the cluster must stop (the router died), else None."""
        if (rc := self.router.popen.poll()) is not None:
            return f"the router exited ({rc})"
        if self.store is not None and not self.store.running():
            rc = self.store.popen.poll() if self.store.popen else None
            print(f"the KV store master exited ({rc}); restarting it", flush=True)
            with self.signals.held():
                self.store.start()
        now = time.monotonic()
        lo, hi = RESTART_BACKOFF_S
        for p in self.engines:
            if p.popen.poll() is None:
                if p.name in self.recovering and answers_as(p):
                    self.recovering.discard(p.name)
                    self.backoff[p.name] = lo
                    print(f"{p.name} is back: {p.url}", flush=True)
                continue
            if p.name not in self.due:
                delay = self.backoff.get(p.name, lo)
                self.backoff[p.name] = min(hi, delay * 2)
                self.due[p.name] = now + delay
                print(
                    f"{p.name} exited ({p.popen.returncode}); restarting it in {delay:.0f} s "
                    "(the router routes around it meanwhile)",
                    flush=True,
                )
            elif now >= self.due[p.name]:
                del self.due[p.name]
                with self.signals.held():
                    respawn(p)
                self.recovering.add(p.name)
        return None


def logs_line(procs: Sequence[Proc], level: str, store_log: str | None = None) -> str:
    """Where each member logs: every engine (and its engine core) and the router inherit ember
    up's stderr, so their lines come to this terminal; a store master writes a file."""
    names = ", ".join(p.name for p in procs)
    line = f"logs: {names} -> this terminal (stderr), level {level}"
    if store_log:
        line += f"; mooncake_master -> {store_log}"
    return line


def print_up(router: str, procs: list[Proc], model: str, keyed: bool) -> None:
    """`model` is the id clients send: the first served name."""
    print(f"ember is up: {router}  (engines: {', '.join(p.url for p in procs[:-1])})")
    auth = "-H 'authorization: Bearer YOUR_KEY' " if keyed else ""
    print(
        f"  curl {router}/v1/chat/completions -H 'content-type: application/json' {auth}"
        f'-H \'x-session-affinity: ses_1\' -d \'{{"model": "{model}", "messages": '
        '[{"role": "user", "content": "hi"}], "stream": true}\''
    )


def run_cluster(args: argparse.Namespace) -> int:
    from ember.models.resolve import get_model, names_known_model, resolve_model

    keys = TenantKeys.load(args.api_key or (), args.api_keys_file, args.shared_cache)
    # A busy port is the user's to fix: say so now, not after a minute of waiting on engines.
    check_ports(args.host, [args.port, *(port for _, port in engine_plan(args))])
    # The default is a real model, SmolLM2-135M-Instruct from its PyPI wheel (which make installs).
    model = resolve_model(args.model) if args.model else str(get_model("smollm2"))
    known = bool(args.model) and names_known_model(args.model)
    if args.model and model != args.model and not args.served_model_name and not known:
        args.served_model_name = [args.model]  # a .gguf file: served under the name given
    if not Path(model).is_dir():
        raise FileNotFoundError(f"model directory {model!r} does not exist")
    extra = engine_extra_args(args.engine_args)  # a bad flag is an error now, not a dying engine
    if args.store and any(a.split("=")[0] == "--kv-store" for a in extra):
        raise ValueError("--engine-args: --store gives the engines --kv-store itself")
    served = (served_names(args, model) or [model])[0]

    signals = StopSignals()
    # An operator who sets EMBER_CLUSTER_SECRET can reach the internal routes (/load, /metrics);
    # one who did not finds the secret in a private file of ember's home, which `ember bench`
    # reads (ember/home.py); it is never printed.
    secret = os.environ.get(SECRET_ENV) or new_secret()
    keys_file = write_keys_file(keys)
    procs: list[Proc] = []
    master: StoreMaster | None = None
    secret_file: Path | None = None
    try:
        signals.install()
        ports = [args.port, *(port for _, port in engine_plan(args))]
        members = [f"http://{args.host}:{port}" for port in ports]
        secret_file = write_cluster_secret(args.port, members, secret)
        if args.store:
            log = os.path.join(tempfile.gettempdir(), f"ember-mooncake-master-{os.getpid()}.log")
            with signals.held():
                master = start_master(args.host, log_path=log)
        with signals.held():
            start_cluster(
                args, model, secret, keys_file, procs, store=master.address if master else None
            )
        level = args.log_level or "warning"
        print(logs_line(procs, level, master.log_path if master else None), flush=True)
        wait_healthy(procs, args.ready_timeout)
        router = procs[-1].url
        wait_routed(router, secret)
        print_up(router, procs, served, keys.enabled)
        if master:
            print(f"  KV store: mooncake_master at {master.address} (log: {master.log_path})")
        if args.demo:
            key = next(iter(keys.keys), None)
            print(f"demo question: {DEMO_QUESTION}\ndemo answer: ", end="", flush=True)
            demo_request(router, served, key)
            if args.exit_after_demo:
                return 0
        print("Ctrl-C stops the cluster.", flush=True)
        supervisor = Supervisor(procs[:-1], procs[-1], store=master, signals=signals)
        while (why := supervisor.check()) is None:
            time.sleep(0.5)
        print(f"{why}; stopping the cluster", flush=True)
        return 1
    except Stopped as e:
        print(f"{e}: stopping the cluster", file=sys.stderr, flush=True)
        return 0
    except (RuntimeError, TimeoutError, OSError) as e:  # an engine failed to start, the demo failed
        print(f"ember up: {e}; stopping the cluster", file=sys.stderr, flush=True)
        return 1
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_cluster(procs)
        if master:
            master.stop()  # last: the engines leave the store (their segments) before it goes
        if keys_file:
            os.unlink(keys_file)
        if secret_file:
            remove_cluster_secret(secret_file)
