"""LayerNorms written out op by op, as torch's legacy exporter and many older exports emit them: casting keeps the
whole pattern in fp32 and quantization leaves it unquantized."""

from __future__ import annotations

from nmdeploy.graph.index import GraphIndex


def decomposed_layer_norms(index: GraphIndex) -> set[int]:
    """Main-graph positions of the nodes of every LayerNorm written out as ReduceMean, Sub, Pow (or Mul),
    ReduceMean, Add, Sqrt, Div, as torch's legacy exporter and many older exports emit it."""
    nodes = index.nodes

    def next_op(name: str, op_type: str) -> list[int]:
        return [use.node for use in index.consumers(name) if nodes[use.node].op_type == op_type]

    found: set[int] = set()
    for first, node in enumerate(nodes):
        if node.op_type != "ReduceMean":
            continue
        source, mean = node.input[0], node.output[0]
        for sub in next_op(mean, "Sub"):
            if list(nodes[sub].input) != [source, mean]:
                continue
            centred = nodes[sub].output[0]
            squares = next_op(centred, "Pow") + [
                i for i in next_op(centred, "Mul") if list(nodes[i].input) == [centred, centred]
            ]
            for square in squares:
                for variance in next_op(nodes[square].output[0], "ReduceMean"):
                    for add in next_op(nodes[variance].output[0], "Add"):
                        for root in next_op(nodes[add].output[0], "Sqrt"):
                            divides = [
                                i
                                for i in next_op(nodes[root].output[0], "Div")
                                if list(nodes[i].input) == [centred, nodes[root].output[0]]
                            ]
                            if divides:
                                found |= {first, sub, square, variance, add, root, *divides}
    return found
