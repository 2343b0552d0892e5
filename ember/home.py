"""ember's home: where it keeps what it makes once and reuses across starts (imported GGUF and
wheel models, the embedded tiny models, tokenizers converted from a tiktoken vocabulary):
$EMBER_HOME, by default ~/.cache/ember.

Cache entries (`read_entry`, `write_entry`) are named by a hash of everything they were derived
from, so a changed input is a new entry, never a stale hit. Writes are atomic (a temporary file
renamed into place), and an entry that cannot be written or read is skipped: it only saves time.
"""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

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
