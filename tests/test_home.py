"""ember's home: the running local cluster's secret, kept for the operator's tools."""

from __future__ import annotations

import os
import stat
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from ember.home import (
    cluster_secret_file,
    local_cluster_secret,
    remove_cluster_secret,
    write_cluster_secret,
)
from ember.trust import INTERNAL_HEADER, SECRET_ENV


@pytest.fixture
def home(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("EMBER_HOME", str(tmp_path))
    monkeypatch.delenv(SECRET_ENV, raising=False)
    return tmp_path


def test_the_secret_file_is_private_and_goes_with_its_cluster(home: Path) -> None:
    urls = ["http://127.0.0.1:8000", "http://127.0.0.1:8001", "http://127.0.0.1:8002"]
    path = write_cluster_secret(8000, urls, "s3cret")
    assert path == cluster_secret_file(8000) == home / "clusters" / "router-8000.json"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    for url in ("http://127.0.0.1:8000", "http://localhost:8002/v1", "http://[::1]:8001"):
        assert local_cluster_secret(url) == "s3cret", url
    # Another port, or another machine on the same port: not this cluster's.
    assert local_cluster_secret("http://127.0.0.1:9000") is None
    assert local_cluster_secret("http://10.1.2.3:8000") is None
    remove_cluster_secret(path)
    assert not path.exists()
    assert local_cluster_secret("http://127.0.0.1:8000") is None


def test_a_killed_clusters_file_is_ignored_and_not_removed_by_another(home: Path) -> None:
    path = write_cluster_secret(8000, ["http://127.0.0.1:8000"], "old")
    text = path.read_text().replace(f'"pid": {os.getpid()}', '"pid": 999999999')
    path.write_text(text)
    assert local_cluster_secret("http://127.0.0.1:8000") is None  # its ember up is gone
    remove_cluster_secret(path)  # not this process's file: left for its owner's successor
    assert path.exists()
    write_cluster_secret(8000, ["http://127.0.0.1:8000"], "new")  # the next ember up on the port
    assert local_cluster_secret("http://127.0.0.1:8000") == "new"


class _Metrics(BaseHTTPRequestHandler):
    """/metrics behind a secret, as ember's router keeps it."""

    secret = "s3cret"

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        ok = self.headers.get(INTERNAL_HEADER) == self.secret
        body = b"# metrics\n" if ok else b"{}"
        self.send_response(200 if ok else 401)
        self.send_header("content-length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        pass


def test_ember_bench_finds_the_local_clusters_secret(home: Path) -> None:
    from ember.bench.spec_counters import ScrapeError, fetch_metrics

    server = ThreadingHTTPServer(("127.0.0.1", 0), _Metrics)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{server.server_port}"
    try:
        with pytest.raises(ScrapeError, match="HTTP 401"):
            fetch_metrics(url)  # no secret anywhere
        path = write_cluster_secret(server.server_port, [url], "s3cret")
        assert fetch_metrics(url) == "# metrics\n"
        remove_cluster_secret(path)
        with pytest.raises(ScrapeError, match="HTTP 401"):
            fetch_metrics(url)
    finally:
        server.shutdown()
        server.server_close()
