"""Fusion: partition a validated op graph into kernel groups.

A pointwise group is a chain: each node after the first takes the previous node's output
(virtual, used by nothing else, same dims) as one operand, so the chain's value stays in
registers. Everything a group reads from outside is one of its ``inputs``; its last node's
output is the group's ``output`` (a user array, or workspace when virtual).

An anchor group (norm, reduce, pool: nvdnn.graph.anchors) is one anchor node plus the
unary / scalar pointwise nodes after its main output (the epilogue) and, for ops that take a
residual, the ``add`` that feeds its ``x`` (the prologue). Its other outputs (saved statistics)
are written too, to the workspace when virtual. A whole-tensor reduction of the group's output
that the anchor ``folds`` (matmul: amax) joins the group as one more output: the kernel reduces
the values as it writes them, with no second pass. An anchor whose ``output_residual`` names a
role (conv: y = act(conv + bias + r)) takes, as that role, the tensor of an ``add`` that is the
first op after its main output: conv -> add(r) -> relu is one kernel. One with ``output_norm``
(conv) takes an inference batch_norm of its bare main output as per-channel roles norm_mean,
norm_var, norm_gamma, norm_beta, normalized after the bias and before that residual: conv ->
batch_norm -> add -> relu is one kernel too.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from .graph.anchors import ANCHORS
from .graph.ops import SCHEMAS
from .kernels import pointwise


@dataclass
class KernelGroup:
    family: str
    nodes: list = field(default_factory=list)
    inputs: list = field(default_factory=list)   # Tensors, in kernel argument order
    steps: list = field(default_factory=list)    # pointwise (op, rhs) pairs (an anchor's epilogue)
    params: list = field(default_factory=list)   # floats, in the chain's slot order
    anchor: object = None                        # the anchor node, for anchor groups
    roles: dict = field(default_factory=dict)    # anchor groups: input role -> Tensor
    prologue: object = None                      # the add folded in as a residual
    norm: object = None                          # the batch_norm folded in (output_norm)
    folded: list = field(default_factory=list)   # reduction nodes of the output folded into the anchor

    @property
    def output(self):
        return self.nodes[-1].output

    @property
    def outputs(self) -> list:
        """Every tensor the group writes: the main output first, then an anchor's other outputs."""
        return ([self.output] + (list(self.anchor.outputs[1:]) if self.anchor is not None else [])
                + [n.output for n in self.folded])

    def describe(self) -> str:
        ops = " -> ".join(n.op for n in ([self.prologue] if self.prologue else []) + self.nodes + self.folded)
        ins = ", ".join(t.name for t in (self.roles.values() if self.anchor is not None else self.inputs))
        return f"{self.family}[{ops}]({ins}) -> {', '.join(t.name for t in self.outputs)}"


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


def _private(tensor, consumers, dims) -> bool:
    """A value fusion may keep in registers: virtual, read once, by a node of the same dims."""
    return tensor.is_virtual and len(consumers[tensor.uid]) == 1 and tensor.dims == dims


def _fits_epilogue(group: KernelGroup, node, position: int) -> bool:
    """An anchor's epilogue takes unary and scalar pointwise ops on the chain value only."""
    return (group.anchor is not None and ANCHORS[group.anchor.op].epilogue and node.op in SCHEMAS
            and len(node.inputs) == 1 and position == 0)


def _fits_residual(group: KernelGroup, node, position: int) -> bool:
    """``node`` adds a second tensor of the same dims to an anchor's bare main output and the
    anchor has an unused role for it: the kernel adds it before its epilogue."""
    role = ANCHORS[group.anchor.op].output_residual
    folded = [group.norm] if group.norm is not None else []   # a batch norm may come first
    if (role is None or role in group.roles or group.nodes[1:] != folded or node.op != "add"
            or len(node.inputs) != 2):
        return False
    other = node.inputs[1 - position]
    return other is not group.output and other.dims == group.output.dims


NORM_ROLES = ("mean", "var", "gamma", "beta")


def _fits_norm(group, node, consumers) -> bool:
    """``node`` is an inference batch_norm of the anchor's bare main output (read by nothing
    else, nothing added yet), its per-channel vectors (C,), contiguous, of one epilogue type."""
    if (group is None or group.anchor is None or not ANCHORS[group.anchor.op].output_norm
            or node.op != "batch_norm" or len(group.nodes) != 1 or node.inputs[0] is not group.output
            or ANCHORS[group.anchor.op].output_residual in group.roles
            or not _private(group.output, consumers, node.output.dims)):
        return False
    vectors = [t for role, t in zip(node.roles, node.inputs) if role in NORM_ROLES]
    channels = group.output.dims[1]
    return (len({t.data_type for t in vectors}) == 1 and vectors[0].data_type in pointwise.DTYPES
            and all(t.dims == (channels,) and (channels == 1 or t.strides == (1,)) for t in vectors))


def _fold_norm(group, node) -> None:
    """The batch_norm's vectors become the anchor's norm_* roles; its output the group's."""
    group.roles = {**group.roles, **{"norm_" + role: t for role, t in zip(node.roles, node.inputs)
                                     if role in NORM_ROLES}}
    group.inputs = list(dict.fromkeys(group.roles.values()))
    group.norm = node
    group.nodes.append(node)


def _anchor_group(node, consumers, open_chain, groups) -> KernelGroup:
    schema = ANCHORS[node.op]
    group = KernelGroup(schema.family, nodes=[node], anchor=node)
    group.roles = dict(zip(node.roles, node.inputs))
    x = group.roles.get("x")
    feeder = open_chain.get(x.uid) if x is not None and schema.residual else None
    if (feeder is not None and feeder.anchor is None and len(feeder.nodes) == 1 and feeder.nodes[0].op == "add"
            and len(feeder.nodes[0].inputs) == 2 and _private(x, consumers, node.inputs[0].dims)
            and all(t.dims == x.dims for t in feeder.nodes[0].inputs) and schema.residual not in group.roles):
        groups.remove(feeder)
        del open_chain[x.uid]
        group.prologue = feeder.nodes[0]
        group.roles = {**group.roles, "x": feeder.nodes[0].inputs[0], schema.residual: feeder.nodes[0].inputs[1]}
    group.inputs = list(dict.fromkeys(group.roles.values()))
    return group


def _folds(group, node) -> bool:
    """``node`` reduces all of the group's output, in float32, and its anchor folds that reduction
    (not an fp8 output: the kernel reduces the values before their quantization)."""
    return (group is not None and group.anchor is not None and node.op in ANCHORS[group.anchor.op].folds
            and node.inputs[0] is group.output and dict(node.attrs).get("axes") is None
            and node.output.data_type == "float32" and not group.output.data_type.startswith("float8"))


def partition(nodes, consumers) -> list[KernelGroup]:
    """Kernel groups in execution order. ``consumers[uid]`` lists (node, input position).

    A group runs once its last node can: every other group it reads from ends earlier in node
    order, so sorting by the last node gives a valid order."""
    groups: list[KernelGroup] = []
    open_chain: dict[int, KernelGroup] = {}  # uid of a group's current output -> group
    for node in nodes:
        if node.op in ANCHORS and node.inputs and _folds(open_chain.get(node.inputs[0].uid), node):
            group = open_chain.pop(node.inputs[0].uid)  # its output is read: no epilogue after it
            group.folded.append(node)
            continue
        if node.op in ANCHORS and node.inputs and _fits_norm(open_chain.get(node.inputs[0].uid), node, consumers):
            group = open_chain.pop(node.inputs[0].uid)
            _fold_norm(group, node)
            open_chain[node.output.uid] = group
            continue
        if node.op in ANCHORS:
            group = _anchor_group(node, consumers, open_chain, groups)
            groups.append(group)
            open_chain[node.output.uid] = group
            continue
        attached = False
        for position, tensor in enumerate(node.inputs):
            group = open_chain.get(tensor.uid)
            if group is None or not _private(tensor, consumers, node.output.dims) or node.inputs.count(tensor) != 1:
                continue
            if group.anchor is not None and _fits_residual(group, node, position):
                other = node.inputs[1 - position]
                group.roles = {**group.roles, ANCHORS[group.anchor.op].output_residual: other}
                group.inputs = list(dict.fromkeys([*group.inputs, other]))
                group.nodes.append(node)
            elif group.anchor is not None:
                if not _fits_epilogue(group, node, position):
                    continue
                group.steps.append((SCHEMAS[node.op].kernel_op, "" if not node.params or
                                    pointwise.OPS[SCHEMAS[node.op].kernel_op].arity == 1 else "p"))
                group.params.extend(node.params)
                group.nodes.append(node)
            elif (SCHEMAS[node.op].family == group.family
                  and len(group.inputs) + _new_inputs(group, node, position) <= MAX_INPUTS):
                _append(group, node, position)
            else:
                continue
            del open_chain[tensor.uid]
            attached = True
            break
        if not attached:
            group = KernelGroup(SCHEMAS[node.op].family)
            _append(group, node, None)
            groups.append(group)
        open_chain[node.output.uid] = group
    order = {id(node): i for i, node in enumerate(nodes)}
    return sorted(groups, key=lambda g: order[id((g.folded or g.nodes)[-1])])
