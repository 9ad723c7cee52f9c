"""Fusion: partition a validated op graph into kernel groups.

A pointwise group is a chain: each node after the first takes the previous node's output
(virtual, used by nothing else, same dims) as one operand, so the chain's value stays in
registers. Everything a group reads from outside is one of its ``inputs``; its last node's
output is the group's ``output`` (a user array, or workspace when virtual). Later families
add anchor groups (matmul, conv, norm) that absorb pointwise prologues and epilogues.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .graph.ops import SCHEMAS
from .kernels import pointwise


@dataclass
class KernelGroup:
    family: str
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)   # Tensors, in kernel argument order
    steps: list = field(default_factory=list)    # pointwise (op, rhs) pairs
    params: list = field(default_factory=list)   # floats, in the chain's slot order

    @property
    def output(self):
        return self.nodes[-1].output

    def describe(self) -> str:
        ops = " -> ".join(n.op for n in self.nodes)
        ins = ", ".join(t.name for t in self.inputs)
        return f"{self.family}[{ops}]({ins}) -> {self.output.name}"


def _operand(group: KernelGroup, tensor) -> str:
    if tensor not in group.inputs:
        group.inputs.append(tensor)
    return f"x{group.inputs.index(tensor)}"


def _append(group: KernelGroup, node, chain_position: int | None) -> None:
    """Add ``node`` to ``group``; ``chain_position`` is which operand carries the chain value."""
    schema = SCHEMAS[node.op]
    kernel_arity = pointwise.OPS[schema.kernel_op].arity
    others = [t for i, t in enumerate(node.inputs) if i != chain_position]
    if chain_position is None:          # the head: its first tensor starts the chain
        _operand(group, node.inputs[0])
        others = node.inputs[1:]
    if kernel_arity == 1:
        group.steps.append((schema.kernel_op, ""))
    elif not others:                    # scalar operand: scale, add(x, 2.0), ...
        op = schema.kernel_op if chain_position in (None, 0) else pointwise.REVERSED[schema.kernel_op]
        group.steps.append((op, "p"))
    else:
        op = schema.kernel_op if chain_position in (None, 0) else pointwise.REVERSED[schema.kernel_op]
        group.steps.append((op, _operand(group, others[0])))
    group.params.extend(node.params)
    group.nodes.append(node)


MAX_INPUTS = 8  # tensors one pointwise kernel takes


def _new_inputs(group: KernelGroup, node, position: int) -> int:
    return len({t.uid for i, t in enumerate(node.inputs) if i != position} - {t.uid for t in group.inputs})


def partition(nodes, consumers) -> list[KernelGroup]:
    """Kernel groups in execution order. ``consumers[uid]`` lists (node, input position).

    A group runs once its last node can: every other group it reads from ends earlier in node
    order, so sorting by the last node gives a valid order."""
    groups: list[KernelGroup] = []
    open_chain: dict[int, KernelGroup] = {}  # uid of a group's current output -> group
    for node in nodes:
        attached = False
        for position, tensor in enumerate(node.inputs):
            group = open_chain.get(tensor.uid)
            if (group is not None and tensor.is_virtual and len(consumers[tensor.uid]) == 1
                    and tensor.dims == node.output.dims and SCHEMAS[node.op].family == group.family
                    and node.inputs.count(tensor) == 1
                    and len(group.inputs) + _new_inputs(group, node, position) <= MAX_INPUTS):
                del open_chain[tensor.uid]
                _append(group, node, position)
                attached = True
                break
        if not attached:
            group = KernelGroup(SCHEMAS[node.op].family)
            _append(group, node, None)
            groups.append(group)
        open_chain[node.output.uid] = group
    order = {id(node): i for i, node in enumerate(nodes)}
    return sorted(groups, key=lambda g: order[id(g.nodes[-1])])
