"""What a model argument names: a Hugging Face-format directory, or a `.gguf` file that is imported
once into a directory of ember's cache (`ember serve FILE.gguf`, `LLM(model="FILE.gguf")`,
`ember up FILE.gguf`, `ember router --model FILE.gguf`)."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path


def resolve_model(model: str) -> str:
    """A model argument as a directory: a `.gguf` file is imported once into
    `$EMBER_HOME/models/gguf-<name>-<hash of the file>` (float32) and that directory is returned;
    anything else is returned as it is. Keyed by the file's name and content: a changed file is
    imported again."""
    path = Path(model)
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return model
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    home = Path(os.environ.get("EMBER_HOME", Path.home() / ".cache" / "ember"))
    out = home / "models" / f"gguf-{path.stem}-{digest.hexdigest()[:16]}"
    if not (out / "config.json").is_file():
        # Imported beside it, then renamed: a second process importing the same file meanwhile
        # never sees half a directory.
        tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
        from ember.models.gguf import import_gguf  # only now: the gguf reader is heavy

        import_gguf(path, tmp)
        try:
            os.replace(tmp, out)
        except OSError:  # another process got there first
            shutil.rmtree(tmp, ignore_errors=True)
    return str(out)
