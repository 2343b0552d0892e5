"""The marker rules that make every copyable block in the docs a tested one."""

from __future__ import annotations

import pytest

from tests.docs.doc_examples import MarkerError, examples

PAGE = """# A page

<!-- example: run, expect "Paris" -->
```sh
ember generate smollm2 --prompt hi
```

Output, not an example:

```text
Paris
```

<!-- example: server -->
```bash
ember serve smollm2
```

<!-- example: skip: needs a GPU -->
```python
import torch
```

```json
{"not": "an example"}
```
"""


def test_markers_are_read_in_order() -> None:
    found = examples(PAGE, "page.md")
    assert [(e.kind, e.lang, e.line) for e in found] == [
        ("run", "bash", 4),
        ("server", "bash", 15),
        ("skip", "python", 20),
    ]
    assert found[0].expect == "Paris"
    assert found[0].code == "ember generate smollm2 --prompt hi\n"
    assert found[2].reason == "needs a GPU"


def test_a_block_without_a_marker_is_refused() -> None:
    with pytest.raises(MarkerError, match=r"page.md:3: a ```sh block with no"):
        examples("text\n\n```sh\nrm -rf /tmp/x\n```\n", "page.md")


def test_a_skip_must_say_why() -> None:
    with pytest.raises(MarkerError, match="must say why"):
        examples("<!-- example: skip -->\n```python\npass\n```\n", "page.md")


def test_an_unknown_marker_is_refused() -> None:
    with pytest.raises(MarkerError, match="unknown example marker"):
        examples("<!-- example: maybe -->\n```bash\ntrue\n```\n", "page.md")
