"""A bounded-depth suffix tree with counts over one or more token sequences: every substring of
up to `max_depth` tokens is a path from the root, and each node counts the occurrences that pass
through it, so child count / parent count estimates how often a continuation follows a pattern
(SuffixDecoding, arXiv 2411.04975). Updated in O(max_depth) per appended token; drafts are
read from it in ember/spec_decode/suffix_draft.py."""

from __future__ import annotations

from array import array
from bisect import bisect_left
from collections.abc import Sequence
from dataclasses import dataclass, field

_ROOT = 0
_NONE = -1
_NO_TOKENS: list[int] = []


@dataclass(slots=True)
class _OpenSequence:
    """The suffixes of the open sequence that still grow (those shorter than max_depth).

    A suffix that runs alone into a leaf stays there: the leaf's length holds the length it
    will have once the suffix is max_depth long, and readers clip it to the tokens that exist
    so far (`_edge_len`), so those suffixes cost nothing per token. The others follow paths
    that earlier occurrences made: for each, `nodes` holds the deepest node whose edge it has
    covered (and is counted in) and `offs` how far it has gone into the next edge, uncounted
    there until it covers that edge too (then the edge's count grows) or leaves it (then the
    edge splits where it left); `edges` holds that next edge's node, valid while its parent
    is still `nodes[i]` (a split puts a new node in between). `starts`: where each suffix
    begins, oldest first. `leaves`: the leaves still growing, settled when the sequence closes.
    """

    nodes: list[int] = field(default_factory=list)
    offs: list[int] = field(default_factory=list)
    edges: list[int] = field(default_factory=list)
    starts: list[int] = field(default_factory=list)
    leaves: list[int] = field(default_factory=list)


class SuffixTree:
    """Suffixes of each sequence, cut at `max_depth` tokens, with occurrence counts.

    Nodes are ints indexing parallel arrays (no object per node: the garbage collector sees a
    few lists, not a million nodes). Node n's edge spells `seq[n][start[n] : start[n] +
    length[n]]`, where `seq[n]` is the token list of whichever sequence last passed through
    and also spells the whole path above the edge, just before `start[n]`. Edges are
    path-compressed; an occurrence ends only at the end of an edge. `top[n]` caches n's child
    of highest count (-1: not known, recomputed on demand).

    One sequence at a time may be open (`append`); `insert` adds a whole sequence and closes
    it. `remove` takes a closed sequence out again and needs no sequence open, since an open
    suffix relies on its nodes referring to its own tokens. Counts are exact once every
    sequence is closed; while one is open, a suffix of it that is part way along an edge made
    by an earlier occurrence is not yet counted on that edge (see _OpenSequence).
    """

    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"suffix tree depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self._count = array("i", [0])
        self._parent = array("i", [_NONE])
        self._seq = [_NO_TOKENS]
        self._start = array("i", [0])
        self._length = array("i", [0])
        self._top = array("i", [_NONE])
        self._children: list[dict[int, int] | None] = [{}]
        self._free: list[int] = []
        self._seqs: dict[int, list[int]] = {}
        self._open_id: int | None = None
        self._open = _OpenSequence()

    def tokens(self, seq_id: int) -> list[int]:
        return self._seqs[seq_id]

    @property
    def num_nodes(self) -> int:
        return len(self._count) - len(self._free)

    # ---- updates -------------------------------------------------------------------------

    def append(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Extend the open sequence `seq_id` (opened if new) by `tokens`."""
        if seq_id != self._open_id:
            if seq_id in self._seqs:
                raise ValueError(f"suffix tree: sequence {seq_id} is closed")
            if self._open_id is not None:
                raise ValueError(f"suffix tree: sequence {self._open_id} is still open")
            self._seqs[seq_id] = []
            self._open_id = seq_id
        self._extend(self._seqs[seq_id], tokens)

    def close(self) -> None:
        """No more tokens for the open sequence: every suffix part way along an edge ends
        there (the edge splits) and the growing leaves keep the lengths they have."""
        if self._open_id is not None:
            state = self._open
            seq = self._seqs[self._open_id]
            end = len(seq)
            for node, off in zip(state.nodes, state.offs, strict=True):
                if off:
                    node, child, off = self._settle(node, off, seq, end)
                    if off:
                        self._split(node, child, off, seq, end - off)
            for leaf in state.leaves:
                self._length[leaf] = self._edge_len(leaf)
        self._open = _OpenSequence()
        self._open_id = None

    def insert(self, seq_id: int, tokens: Sequence[int]) -> None:
        """Add a whole sequence and close it."""
        if seq_id in self._seqs:
            raise ValueError(f"suffix tree: sequence {seq_id} already present")
        self.append(seq_id, tokens)
        self.close()

    def _extend(self, seq: list[int], tokens: Sequence[int]) -> None:
        """Each token makes every growing suffix one position longer (see _OpenSequence)."""
        count, parent, seq_of, start_of = self._count, self._parent, self._seq, self._start
        length, children_of, top = self._length, self._children, self._top
        depth = self.max_depth
        state = self._open
        nodes, offs, edges, starts = state.nodes, state.offs, state.edges, state.starts
        for token in tokens:
            pos = len(seq)
            seq.append(token)
            count[_ROOT] += 1
            nodes.append(_ROOT)  # the suffix that starts at this token
            offs.append(0)
            edges.append(_ROOT)
            starts.append(pos)
            kept = 0
            for i in range(len(nodes)):
                node = nodes[i]
                off = offs[i]
                start = starts[i]
                if off:
                    child = edges[i]
                    if parent[child] != node:  # its edge was split since
                        node, child, off = self._settle(node, off, seq, pos)
                if off:
                    cseq = seq_of[child]
                    cstart = start_of[child]
                    if cseq[cstart + off] != token:
                        # It leaves the edge here: split it; the suffix grows in a new leaf.
                        mid = self._split(node, child, off, seq, pos - off)
                        leaf = self._new(mid, seq, pos, start + depth - pos, 1)
                        children_of[mid][token] = leaf  # type: ignore[index]
                        state.leaves.append(leaf)
                        continue
                    off += 1
                    if off == length[child] or off == len(cseq) - cstart:
                        self._cover(node, child)
                        node = child
                        off = 0
                else:
                    children = children_of[node]
                    child = children.get(token, _NONE) if children else _NONE
                    if child == _NONE:
                        # A new leaf, which only this suffix passes: it grows there from now on.
                        leaf = self._new(node, seq, pos, start + depth - pos, 1)
                        if children is None:
                            children_of[node] = {token: leaf}
                            top[node] = leaf
                        else:
                            children[token] = leaf
                        state.leaves.append(leaf)
                        continue
                    if length[child] == 1 or len(seq_of[child]) - start_of[child] == 1:
                        count[child] += 1  # covered its whole edge (inline _cover: hot)
                        best = top[node]
                        if best != _NONE and count[child] > count[best]:
                            top[node] = child
                        node = child
                    else:
                        off = 1
                if pos - start + 1 == depth:
                    # max_depth long: it ends here (part way along an edge: split it there).
                    if off:
                        self._split(node, child, off, seq, pos + 1 - off)
                    continue
                nodes[kept] = node
                offs[kept] = off
                edges[kept] = child
                starts[kept] = start
                kept += 1
            del nodes[kept:], offs[kept:], edges[kept:], starts[kept:]
            leaves = state.leaves
            if len(leaves) > 4 * depth:  # keep only those still growing
                leaves[:] = [n for n in leaves if start_of[n] + length[n] > len(seq_of[n])]

    def _own_counted(self, length: int) -> int:
        """1 if the open sequence's last `length` tokens (a growing suffix) are counted where
        they end in the tree, else 0 (part way along an edge, see _OpenSequence)."""
        state = self._open
        start = len(self._seqs[self._open_id]) - length  # type: ignore[index]
        i = bisect_left(state.starts, start)
        return 0 if i < len(state.starts) and state.starts[i] == start and state.offs[i] else 1

    def remove(self, seq_id: int) -> None:
        """Take closed sequence `seq_id` out: each of its suffixes is walked down once, its
        counts decremented, emptied subtrees freed and unary chains merged again."""
        if self._open_id is not None:
            raise RuntimeError("suffix tree: remove needs every sequence closed")
        seq = self._seqs.pop(seq_id)
        count, length, top, children_of = self._count, self._length, self._top, self._children
        n = len(seq)
        for start in range(n):
            count[_ROOT] -= 1
            node = _ROOT
            idx = start
            end = min(n, start + self.max_depth)
            while idx < end:
                token = seq[idx]
                children = children_of[node]
                child = children[token]  # type: ignore[index]
                count[child] -= 1
                if top[node] == child:
                    top[node] = _NONE  # it may no longer be the largest
                if count[child] == 0:
                    del children[token]  # type: ignore[union-attr]
                    self._free_subtree(child)
                    break
                idx += length[child]
                node = child
            # Only the last node reached can have become a link of a unary chain.
            children = children_of[node]
            if node != _ROOT and children and len(children) == 1:
                (only,) = children.values()
                if count[only] == count[node]:
                    self._merge_into_child(node, only)

    # ---- nodes ---------------------------------------------------------------------------

    def _new(self, parent: int, seq: list[int], start: int, length: int, count: int) -> int:
        if self._free:
            n = self._free.pop()
            self._count[n] = count
            self._parent[n] = parent
            self._seq[n] = seq
            self._start[n] = start
            self._length[n] = length
            return n
        self._count.append(count)
        self._parent.append(parent)
        self._seq.append(seq)
        self._start.append(start)
        self._length.append(length)
        self._top.append(_NONE)
        self._children.append(None)
        return len(self._count) - 1

    def _free_subtree(self, n: int) -> None:
        stack = [n]
        while stack:
            n = stack.pop()
            children = self._children[n]
            if children:
                stack.extend(children.values())
            self._children[n] = None
            self._seq[n] = _NO_TOKENS  # let a removed sequence's tokens go
            self._top[n] = _NONE
            self._parent[n] = _NONE
            self._free.append(n)

    def _merge_into_child(self, node: int, child: int) -> None:
        up = self._parent[node]
        self._start[child] -= self._length[node]  # its seq spells the path above its edge
        self._length[child] += self._length[node]
        self._parent[child] = up
        self._children[up][self._seq[child][self._start[child]]] = child  # type: ignore[index]
        if self._top[up] == node:
            self._top[up] = child
        self._children[node] = None
        self._free_subtree(node)

    def _edge_len(self, n: int) -> int:
        """Edge length, clipped for a leaf that still grows with its open sequence."""
        room = len(self._seq[n]) - self._start[n]
        length = self._length[n]
        return length if length <= room else room

    def _cover(self, node: int, child: int) -> None:
        """A suffix has covered `child`'s whole edge: count it there."""
        self._count[child] += 1
        best = self._top[node]
        if best != _NONE and self._count[child] > self._count[best]:
            self._top[node] = child

    def _settle(self, node: int, off: int, seq: list[int], end: int) -> tuple[int, int, int]:
        """Re-find a suffix that is `off` tokens past `node` (its last tokens are seq[end - off :
        end]): edges split since it entered may now lie wholly behind it, so count it there."""
        child = self._children[node][seq[end - off]]  # type: ignore[index]
        clen = self._edge_len(child)
        while off >= clen:
            self._cover(node, child)
            node = child
            off -= clen
            if not off:
                return node, child, 0
            child = self._children[node][seq[end - off]]  # type: ignore[index]
            clen = self._edge_len(child)
        return node, child, off

    def _split(self, node: int, child: int, off: int, seq: list[int], start: int) -> int:
        """Cut `child`'s edge after `off` tokens, where a suffix (counted in the upper part)
        leaves it or ends; the upper part, `seq[start : start + off]`, is returned."""
        mid = self._new(node, seq, start, off, self._count[child] + 1)
        self._start[child] += off
        self._length[child] -= off
        self._parent[child] = mid
        self._children[mid] = {self._seq[child][self._start[child]]: child}
        self._top[mid] = child
        self._children[node][seq[start]] = mid  # type: ignore[index]
        best = self._top[node]
        if best == child or (best != _NONE and self._count[mid] > self._count[best]):
            self._top[node] = mid
        return mid

    # ---- queries -------------------------------------------------------------------------

    def match(self, pattern: list[int]) -> tuple[int, int] | None:
        """Where `pattern` ends: (node, positions of its edge used), or None if absent."""
        node = _ROOT
        used = 0
        i = 0
        n = len(pattern)
        while i < n:
            children = self._children[node]
            child = children.get(pattern[i], _NONE) if children else _NONE
            if child == _NONE:
                return None
            used = min(self._edge_len(child), n - i)
            # The key matched the edge's first token; compare the rest as one slice, in C.
            start = self._start[child]
            if used > 1 and self._seq[child][start + 1 : start + used] != pattern[i + 1 : i + used]:
                return None
            node = child
            i += used
        return node, used

    def count(self, pattern: Sequence[int]) -> int:
        """Occurrences of `pattern` (len <= max_depth) across the sequences."""
        hit = self.match(list(pattern))
        return 0 if hit is None else self._count[hit[0]]
