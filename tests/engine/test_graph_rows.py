"""The decode graphs' staging rows (ember.engine.cuda_graphs.fill_rows), on the CPU: what each row
of a decode or verify batch feeds the captured graph."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from ember.engine.cuda_graphs import fill_rows


def _req(rid: str, tokens: list[int]) -> SimpleNamespace:
    return SimpleNamespace(request_id=rid, all_token_ids=tokens, num_tokens=len(tokens))


def test_rows_of_decodes_and_a_verification() -> None:
    bs = 4
    plain = _req("a", [1, 2, 3, 4, 5, 6])  # decodes its last token, known on the host
    fed = _req("b", [7, 8, 9])  # its token is still on the GPU: fed from the previous step's row 2
    verify = _req("c", [10, 11, 12, 13, 14, 15, 16, 17])  # 3 drafts at 8.. over a block edge
    so = SimpleNamespace(
        requests=[plain, fed, verify],
        block_ids=[[5, 9], [3], [8, 2, 6]],
        num_computed_tokens=[5, 3, 7],
        spec_token_ids=[[], [], [21, 22, 23]],
    )
    rows = np.full((6, 8), -7, dtype=np.int64)
    tables = np.zeros((8, 4), dtype=np.int32)
    n = fill_rows(rows, tables, so, [2, 0, 1], {"b": 2}, bs)
    assert n == 6
    # Request c first (order), 4 rows at positions 7..10: its slots cross from block 2 into 6.
    assert rows[:, :4].tolist() == [
        [17, 21, 22, 23],  # input ids: the last known token, then the drafts
        [7, 8, 9, 10],  # positions
        [2 * bs + 3, 6 * bs + 0, 6 * bs + 1, 6 * bs + 2],  # slots
        [8, 9, 10, 11],  # context lengths, each row seeing up to itself
        [-1, -1, -1, -1],  # no row is fed from the previous step
        [4, 0, 0, 0],  # the group: the first row leads 4
    ]
    assert tables[:4, :3].tolist() == [[8, 2, 6]] * 4
    # Request a: one row, its known token.
    assert rows[:, 4].tolist() == [6, 5, 9 * bs + 1, 6, -1, 1]
    assert tables[4, :2].tolist() == [5, 9]
    # Request b: its token comes from row 2 of the previous step.
    assert rows[:, 5].tolist() == [0, 3, 3 * bs + 3, 4, 2, 1]
    assert tables[5, :1].tolist() == [3]
    assert rows[:, 6:].tolist() == [[-7, -7]] * 6  # untouched past the batch
