"""ember's home: where it keeps what it makes once and reuses across starts (imported GGUF and
wheel models, the embedded tiny models, tokenizers converted from a tiktoken vocabulary):
$EMBER_HOME, by default ~/.cache/ember.

Cache entries (`read_entry`, `write_entry`) are named by a hash of everything they were derived
from, so a changed input is a new entry, never a stale hit. Writes are atomic (a temporary file
renamed into place), and an entry that cannot be written or read is skipped: it only saves time.

It also holds each running `ember up`'s cluster secret, for the local operator's tools
(`CLUSTERS_DIR`).
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import urllib.parse
from pathlib import Path

from ember.parent_death import pid_alive

log = logging.getLogger(__name__)


def ember_home() -> Path:
    return Path(os.environ.get("EMBER_HOME", Path.home() / ".cache" / "ember"))


def read_entry(kind: str, name: str) -> str | None:
    try:
        return (ember_home() / kind / name).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):
        return None


def write_entry(kind: str, name: str, text: str) -> None:
    directory = ember_home() / kind
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{name}.")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, directory / name)
    except OSError as e:
        log.info("not caching %s/%s: %s", kind, name, e)


CLUSTERS_DIR = "clusters"
"""`<home>/clusters/router-<port>.json`: one file per running `ember up`, mode 0600 in a 0700
directory, holding its process id, its members' URLs and its cluster secret, so that the local
operator's tools (`ember bench`) reach the cluster's internal routes (/metrics, /load) without
the secret ever being printed. ember up removes its file when it stops; a file whose process is
gone (a SIGKILLed ember up) is ignored, and replaced by the next ember up on that port."""

_LOCAL_HOSTS = frozenset({"127.0.0.1", "localhost", "::1", "0.0.0.0", "::", ""})


def cluster_secret_file(port: int) -> Path:
    return ember_home() / CLUSTERS_DIR / f"router-{port}.json"


def write_cluster_secret(port: int, urls: list[str], secret: str) -> Path:
    """Record the running cluster (router on `port`, members at `urls`) and its secret in a
    private file (0600: created so by mkstemp, then renamed into place); returns its path."""
    path = cluster_secret_file(port)
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump({"pid": os.getpid(), "urls": urls, "secret": secret}, f)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


def remove_cluster_secret(path: Path) -> None:
    """Remove the file `write_cluster_secret` wrote, if it is still this process's."""
    try:
        if json.loads(path.read_text(encoding="utf-8")).get("pid") == os.getpid():
            path.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def local_cluster_secret(url: str) -> str | None:
    """The secret of the running local `ember up` one of whose members (router or engine) `url`
    names; None if none does. A loopback or wildcard address matches any loopback name; any other
    host must match exactly, so the secret never goes to another machine's server."""
    target = urllib.parse.urlsplit(url)
    try:
        files = sorted((ember_home() / CLUSTERS_DIR).glob("router-*.json"))
    except OSError:
        return None
    for f in files:
        try:
            record = json.loads(f.read_text(encoding="utf-8"))
            pid, urls, secret = record["pid"], record["urls"], record["secret"]
            if f.stat().st_uid != os.getuid() or not pid_alive(int(pid)):
                continue
        except (OSError, ValueError, KeyError, TypeError):
            continue
        for member in urls:
            m = urllib.parse.urlsplit(member)
            if m.port != target.port:
                continue
            same = m.hostname == target.hostname or (
                (m.hostname or "") in _LOCAL_HOSTS and (target.hostname or "") in _LOCAL_HOSTS
            )
            if same and isinstance(secret, str) and secret:
                return secret
    return None
