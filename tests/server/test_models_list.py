"""/v1/models lists each served model once, under its served names."""

from __future__ import annotations

from ember.server.api_server import listed_names


def test_the_models_directory_is_not_listed_beside_its_name() -> None:
    path = "/home/u/.cache/ember/models/smollm2-135m-instruct"
    # `ember up`'s default model: served by name, its path accepted but not listed again.
    assert listed_names(["smollm2-135m-instruct", path], path) == ["smollm2-135m-instruct"]
    # A model served as given (its path the only id), and names the user chose: all listed.
    assert listed_names([path], path) == [path]
    assert listed_names(["ember-tiny", "alias"], path) == ["ember-tiny", "alias"]
    assert listed_names(["a", "a", "b"], path) == ["a", "b"]
