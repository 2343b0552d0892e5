"""The OutputProcessor's outputs: a running sample's token ids as a view of its growing list
(no copy a step), a finished sample's as a list, each output keeping the prefix it was made
with."""

from __future__ import annotations

import pytest

from ember.engine.messages import EngineCoreOutput
from ember.engine.output_processor import OutputProcessor, RequestState, SampleState
from ember.models.tiny import ensure_tiny
from ember.outputs import TokenIdsView
from ember.sampling_params import SamplingParams
from ember.tokenizer.detokenizer import IncrementalDetokenizer
from ember.tokenizer.tokenizer import Tokenizer


def test_token_ids_view_is_a_fixed_prefix_of_a_growing_list() -> None:
    ids = [5, 6, 7]
    view = TokenIdsView(ids, 2)
    ids.append(8)  # the list grows after the view was made: the view does not
    assert len(view) == 2 and list(view) == [5, 6] and view == [5, 6] and view == (5, 6)
    assert view != [5, 6, 7] and view != [5] and view != "ab"
    assert [5, 6] == view  # noqa: SIM300 -- the list on the left: its __eq__ defers to the view's
    assert view[0] == 5 and view[-1] == 6 and view[-2] == 5
    for bad in (2, 3, -3):
        with pytest.raises(IndexError):
            view[bad]
    assert view[:] == [5, 6] and view[1:10] == [6] and view[::-1] == [6, 5] and view[5:] == []
    assert isinstance(view[:], list)
    assert 6 in view and 7 not in view and view.index(6) == 1 and view.count(5) == 1
    assert repr(view) == "[5, 6]"
    with pytest.raises(TypeError):
        hash(view)


def test_running_outputs_share_the_list_and_the_final_one_is_a_list() -> None:
    tok = Tokenizer.from_dir(str(ensure_tiny("llama")))
    op = OutputProcessor(tok)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    sample = SampleState(0, params, IncrementalDetokenizer(tok, [11, 12], True))
    op.add_request(RequestState("r", None, [11, 12], {"r": sample}))
    seen = []
    for step, token in enumerate([21, 22, 23, 24]):
        last = "length" if step == 3 else None
        results, _ = op.process([EngineCoreOutput("r", [token], finish_reason=last)])
        seen.append(results[0].outputs[0].token_ids)
    first, second, _, final = seen
    assert isinstance(first, TokenIdsView) and first._ids is sample.token_ids  # no copy
    assert first == [21] and second == [21, 22]  # each keeps the prefix it was made with
    assert type(final) is list and final == [21, 22, 23, 24]
