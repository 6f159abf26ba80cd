"""Whether a value of an ONNX graph depends on stored tensors only (initializers, Constant nodes), memoised."""

from __future__ import annotations

from nmdeploy.graph.scope import Definition, Scope


class ConstantValues:
    """Whether a value depends on stored tensors only, memoised by the scope defining each value (graphs revisit
    shared ancestors a lot, and every value on a walk is settled once)."""

    def __init__(self):
        self.memo: dict[tuple[int, str], bool] = {}

    def __call__(self, value: str, scope: Scope) -> bool:
        key, known, node = self._settle(value, scope)
        if known is not None:
            return known
        # An explicit stack, not recursion: a deep model's chain of producers outgrows Python's recursion limit.
        # A node is constant when everything it reads is (its subgraphs' reads from outside included); a read that
        # loops back to a node still on the walk counts as constant, so cycles in subgraphs end.
        on_walk = {key}
        stack = [(key, node, node.scope.reads(node.item), 0)]
        while stack:
            key, node, reads, position = stack[-1]
            if position == len(reads):
                self.memo[key] = True
                on_walk.discard(key)
                stack.pop()
                continue
            read_key, known, read_node = self._settle(reads[position], node.scope)
            if known is None and read_key in on_walk:
                known = True
            if known is None:
                on_walk.add(read_key)
                stack.append((read_key, read_node, read_node.scope.reads(read_node.item), 0))
                continue
            if not known:  # one read from outside the stored tensors settles every node on the walk
                for walked, *_ in stack:
                    self.memo[walked] = False
                return False
            stack[-1] = (key, node, reads, position + 1)
        return self.memo[self._settle(value, scope)[0]]

    def _settle(self, value: str, scope: Scope) -> tuple[tuple[int, str], bool | None, Definition | None]:
        """``value``'s memo key (by its defining scope), its answer when known, else its producing node."""
        hit = scope.lookup(value)
        if hit is None:
            return (id(scope), value), False, None
        key = (id(hit.scope), value)
        if hit.kind == "input":
            return key, False, None
        if hit.kind in ("initializer", "sparse_initializer"):
            return key, True, None
        return key, self.memo.get(key), hit
