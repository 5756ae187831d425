"""Which parameters multiply the activations as a linear layer's weight, and which of their dims
holds the layer's outputs, read from the graph. So a `column`/`row` rule splits any module whose
forward multiplies by its own weight, however the model's code spells the product:

    F.linear(x, self.in_proj_weight, b)       # nn.MultiheadAttention: weight (out, in)
    x @ self.weight.T                         # a hand-written linear: (out, in), transposed
    x @ self.w                                # stored (in, out)
    torch.mm(x.view(-1, n), self.weight)      # Hugging Face's Conv1D

A parameter is followed through dtype casts, copies and transposes (`t`, `.T`, `transpose`,
`permute`) to the operand it becomes: the weight of `linear`, or the right-hand side of
`matmul`/`mm`/`bmm`/`addmm`, whose last dim is the output features and next-to-last the input
features. A parameter read any other way (or two ways that disagree) is not a weight.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch import fx

from meshplan.runtime.collectives import CopyToAxis

from ...graph import as_int, as_list, shape

aten = torch.ops.aten

# ops that hand their input on unchanged in layout (a cast, a copy)
_SAME = (
    aten._to_copy.default,
    aten.to.dtype,
    aten.clone.default,
    aten.contiguous.default,
    aten.alias.default,
    aten.detach.default,
)
_TRANSPOSES = (aten.t.default, aten.numpy_T.default, aten.transpose.int, aten.permute.default)


@dataclass(frozen=True)
class WeightUse:
    """A parameter multiplied as a weight: the dim of it holding output features (a column
    split cuts it) and the one holding input features (a row split cuts it)."""

    out_dim: int
    in_dim: int
    # > 1: the parameter packs this many weights along its dim 0, each product taking one
    # (nn.MultiheadAttention's `in_proj_weight.view(3, E, E)[i]` for cross-attention)
    pieces: int = 1


@dataclass
class Weights:
    """The weights of a graph by parameter name, and the 1-D parameters added to their products
    (biases: `linear`'s third argument, or `x @ W.T + b`), by name, with their weight's name."""

    uses: dict[str, WeightUse] = field(default_factory=dict)
    biases: dict[str, str] = field(default_factory=dict)
    bias_pieces: dict[str, int] = field(default_factory=dict)  # a bias packing several: how many


def weights(gm: fx.GraphModule) -> Weights:
    found = Weights()
    for node in gm.graph.nodes:
        if node.op != "get_attr" or not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        uses = {use for _, use in _products(node)}
        if len(uses) == 1 and None not in uses:
            found.uses[str(node.target)] = uses.pop()  # type: ignore[assignment]
    for node in gm.graph.nodes:
        if node.op != "get_attr" or len(shape(node)) != 1:
            continue
        readers, packed = [], 1
        for user in _through_same(node):
            pieces = _pieces(user)
            readers += [r for piece in pieces[1] for r in piece.users] if pieces else [user]
            packed = pieces[0] if pieces else packed
        of = {name for user in readers if (name := _bias_of(user, node)) is not None}
        unknown = any(_bias_of(user, node) is None for user in readers)
        # one bias packing the biases of `packed` weights (nn.MultiheadAttention's `in_proj_bias`
        # beside separate q/k/v weights) is cut as they are: each piece by its weight's split
        if of and (len(of) == 1 or len(of) == packed) and not unknown and of <= set(found.uses):
            found.biases[str(node.target)] = min(of)
            if packed > 1:
                found.bias_pieces[str(node.target)] = packed
    return found


def source(node: fx.Node) -> tuple[fx.Node, tuple[int, ...]] | None:
    """The parameter `node` is a cast, copy or transpose of, and which of the parameter's dims
    each of `node`'s dims is; None if `node` is not one."""
    dims: tuple[int, ...] | None = None
    while node.op != "get_attr":
        if node.op == "call_module" and isinstance(_module(node), CopyToAxis):  # an earlier axis's f
            node = node.args[0]  # type: ignore[assignment]
            continue
        if node.op != "call_function" or not isinstance(node.args[0], fx.Node):
            return None
        order = _order(node)
        if order is None:
            return None
        dims = tuple(order) if dims is None else tuple(order[d] for d in dims)
        node = node.args[0]
    return node, dims if dims is not None else tuple(range(len(shape(node))))


def _order(node: fx.Node) -> list[int] | None:
    """For an op of `_SAME` or `_TRANSPOSES`: which input dim each output dim is."""
    ndim = len(shape(node))
    if node.target in _SAME:
        return list(range(ndim))
    if node.target in (aten.t.default, aten.numpy_T.default):
        return list(reversed(range(ndim)))
    if node.target is aten.transpose.int:
        a, b = (as_int(d) % ndim for d in node.args[1:3])
        order = list(range(ndim))
        order[a], order[b] = b, a
        return order
    if node.target is aten.permute.default:
        return [as_int(d) % ndim for d in as_list(node.args[1])]
    return None


def _products(param: fx.Node):
    """(product node, WeightUse or None) for every reader of `param` past casts and transposes."""
    stack = [param]
    while stack:
        node = stack.pop()
        for user in node.users:
            if _order(user) is not None and user.args[0] is node:
                stack.append(user)
                continue
            pieces = _pieces(user) if node is param else None
            if pieces is not None:
                k, taken = pieces
                for piece in taken:
                    for product in piece.users:
                        use = _use(product, piece, packed=True)
                        yield product, (WeightUse(use.out_dim, use.in_dim, k) if use else None)
                continue
            yield user, _use(user, node)


def _pieces(view: fx.Node) -> tuple[int, list[fx.Node]] | None:
    """If `view` splits its input's dim 0 into (k, rest) and every reader takes one of the k
    (`select(0, i)`, or `unbind(0)` then `[i]`): k and those pieces."""
    if view.target not in (aten.view.default, aten.reshape.default) or not isinstance(view.args[0], fx.Node):
        return None
    whole, split = shape(view.args[0]), shape(view)
    if len(split) != len(whole) + 1 or not isinstance(split[0], int) or split[0] < 2:
        return None
    if split[0] * split[1] != whole[0] or list(split[2:]) != list(whole[1:]):
        return None
    taken: list[fx.Node] = []
    for user in view.users:
        if user.target is aten.select.int and as_int(user.args[1]) == 0:
            taken.append(user)
        elif user.target is aten.unbind.int and (len(user.args) < 2 or as_int(user.args[1]) == 0):
            taken += list(user.users)  # its `[i]`s
        else:
            return None
    return split[0], taken


def _piece_of(node: fx.Node) -> fx.Node | None:
    """The parameter `node` is one packed piece of (`_pieces`), if it is one."""
    view = node.args[0] if node.target is aten.select.int else None
    if node.target is operator.getitem and isinstance(node.args[0], fx.Node):
        view = node.args[0].args[0] if node.args[0].target is aten.unbind.int else None
    if not isinstance(view, fx.Node) or _pieces(view) is None or not isinstance(view.args[0], fx.Node):
        return None
    return view.args[0] if view.args[0].op == "get_attr" else None


def _use(product: fx.Node, operand: fx.Node, packed: bool = False) -> WeightUse | None:
    found = (operand, (0, 1)) if packed else source(operand)
    if found is None:
        return None
    _, dims = found
    args = product.args
    if product.target is aten.linear.default and len(args) > 1 and args[1] is operand and len(dims) == 2:
        return WeightUse(out_dim=dims[0], in_dim=dims[1])
    position = _RHS.get(product.target)
    if position is not None and len(args) > position and args[position] is operand and len(dims) == 2:
        return WeightUse(out_dim=dims[-1], in_dim=dims[-2])
    return None


# where the right-hand side, a weight, is in the matmul ops' arguments
_RHS: dict[object, int] = {
    aten.matmul.default: 1,
    aten.mm.default: 1,
    aten.bmm.default: 1,
    aten.addmm.default: 2,
}


def _through_same(node: fx.Node) -> list[fx.Node]:
    """The readers of `node` past casts and copies."""
    out = []
    for user in node.users:
        if user.target in _SAME:
            out += _through_same(user)
        else:
            out.append(user)
    return out


def _bias_of(user: fx.Node, bias: fx.Node) -> str | None:
    """The weight whose product `bias` is added to by `user`, if it is a bias."""
    positions = _BIAS_POSITIONS.get(user.target)
    if positions is not None and len(user.args) > max(positions) and _is(user.args[positions[0]], bias):
        return _param_name(user.args[positions[1]])
    if user.target in (aten.add.Tensor, aten.add_.Tensor) and len(user.args) == 2:
        other = next((a for a in user.args if isinstance(a, fx.Node) and not _is(a, bias)), None)
        if other is not None and other.target in (aten.matmul.default, aten.mm.default):
            return _param_name(other.args[1])
    return None


# (bias position, weight position) in the ops that add a bias themselves
_BIAS_POSITIONS: dict[object, tuple[int, int]] = {aten.linear.default: (2, 1), aten.addmm.default: (0, 2)}


def _param_name(arg: object) -> str | None:
    if not isinstance(arg, fx.Node):
        return None
    found = source(arg)
    param = found[0] if found else _piece_of(arg)
    return str(param.target) if param is not None else None


def _is(arg: object, param: fx.Node) -> bool:
    if not isinstance(arg, fx.Node):
        return False
    found = source(arg)
    return (found[0] if found else _piece_of(arg)) is param


def _module(node: fx.Node) -> torch.nn.Module | None:
    owner = node.graph.owning_module
    return owner.get_submodule(str(node.target)) if owner is not None else None
