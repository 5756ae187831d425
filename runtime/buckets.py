"""How parameters are grouped for communication: one rule, shared by the data-parallel and
ZeRO engines and by the compiler's ledger, so the ledger's bytes are the engines' by
construction (tests compare them with what was issued).

- `decays`: which parameters AdamW decays; the others get flats and buckets of their own;
- `dp_buckets`: `DataParallel`'s gradient buckets;
- `bucket_params`: ZeRO-1/2's flats (gradient buckets by dtype and decay class);
- `group_by_kind`: a ZeRO-3 unit's flats;
- `by_program`, `read_by_several`: a pipeline rank's parameters by the stage program that
  reads each first (ZeRO-1/2's flats never span two stages), and those several read;
- `compressed_wire`: the all-reduces of a bucket under `compress` (`runtime/compression.py`);
  `zero_compressed_wire`: a ZeRO flat's.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch
from torch import Tensor, fx, nn


def decays(name: str, param: nn.Parameter) -> bool:
    """Whether AdamW decays `param`: not 1-D ones (norm weights, biases), as is usual for transformers."""
    return param.dim() >= 2


def fusable(params: Iterable[Tensor]) -> bool:
    """Whether AdamW's fused kernel takes these parameters: floating point, on a CPU or a GPU,
    contiguous (`make_optimizer` and ZeRO's AdamW use it then: one kernel instead of a dozen ops
    each). The kernel steps a non-contiguous parameter wrongly and silently (torch 2.13: a
    column slice of a matrix moved by twice the learning rate in places), so such a parameter
    takes the per-tensor path."""
    return all(
        p.is_floating_point() and p.device.type in ("cpu", "cuda") and p.is_contiguous() for p in params
    )


def dp_buckets(
    params: Sequence[Tensor], bucket_bytes: int, reduce_dtype: torch.dtype | None
) -> list[tuple[list[Tensor], int]]:
    """`DataParallel`'s buckets, in launch order: (params, bytes on the wire in the reduce dtype).
    Reverse registration order, cut whenever a bucket reaches `bucket_bytes` (at least one param each)."""
    buckets: list[tuple[list[Tensor], int]] = []
    current: list[Tensor] = []
    size = 0
    for p in reversed(params):
        current.append(p)
        size += p.numel() * (reduce_dtype or p.dtype).itemsize
        if size >= bucket_bytes:
            buckets.append((current, size))
            current, size = [], 0
    if current:
        buckets.append((current, size))
    return buckets


def bucket_sizes(params: Sequence[Tensor], bucket_bytes: int, reduce_dtype: torch.dtype | None) -> list[int]:
    """Bytes of each bucket `DataParallel` makes of these params, in launch order (for ledgers)."""
    return [nbytes for _, nbytes in dp_buckets(params, bucket_bytes, reduce_dtype)]


def low_rank_shape(param: Tensor, rank: int) -> tuple[int, int] | None:
    """The (rows, cols) matrix PowerSGD approximates `param`'s gradient as, at `rank`: its first
    dim by the rest; None (sent whole) for a 1-D tensor (biases, norms) or a matrix whose factors
    would not be at least twice smaller than it (torch's `min_compression_rate`)."""
    if param.dim() < 2:
        return None
    rows = param.shape[0]
    cols = param.numel() // rows
    return (rows, cols) if 2 * (rows + cols) * rank < rows * cols else None


def feedback_bytes(params: Sequence[Tensor], method: str, rank: int = 0) -> int:
    """What error feedback keeps across steps for a bucket of `params` (`compression.py`): `bf16`,
    the residual of every gradient; `powersgd`, each approximated matrix's error and its Q
    (cols x rank), in the gradients' dtype (the tensors sent whole keep nothing)."""
    if method == "bf16":
        return sum(p.numel() * p.element_size() for p in params)
    shapes = [(p, low_rank_shape(p, rank)) for p in params]
    return sum((s[0] * s[1] + s[1] * rank) * p.element_size() for p, s in shapes if s is not None)


def compressed_wire(params: Sequence[Tensor], method: str, rank: int = 0) -> list[tuple[str, int]]:
    """The all-reduces one bucket of `params` issues under a compression, in issue order, as
    (what, bytes): `bf16`, the whole bucket in bf16; `powersgd`, the tensors sent whole, then
    the factors P (rows x rank per matrix) and Q (cols x rank), in the gradients' dtype.
    A part with no bytes is not issued."""
    if method == "bf16":
        return [("bf16", sum(p.numel() for p in params) * torch.bfloat16.itemsize)]
    shapes = [(p, low_rank_shape(p, rank)) for p in params]
    whole = sum(p.numel() * p.element_size() for p, s in shapes if s is None)
    factor_p = sum(s[0] * rank * p.element_size() for p, s in shapes if s is not None)
    factor_q = sum(s[1] * rank * p.element_size() for p, s in shapes if s is not None)
    return [(what, b) for what, b in (("whole", whole), ("P", factor_p), ("Q", factor_q)) if b]


def zero_compressed_wire(
    params: Sequence[Tensor], padded: int, stage: int, method: str, rank: int = 0
) -> list[tuple[str, str, int]]:
    """The reductions of one ZeRO flat of `params` (`padded` elements) under a compression, in
    issue order, as (op, what, bytes): `bf16`, the padded flat in bf16, all-reduced under stage
    1 and reduce-scattered under 2 and 3; `powersgd`, `compressed_wire`'s all-reduces at every
    stage (P and Q have no reduce-scatter form: `runtime/compression.py`)."""
    if method == "bf16":
        op = "all_reduce" if stage == 1 else "reduce_scatter"
        return [(op, "bf16", padded * torch.bfloat16.itemsize)]
    return [("all_reduce", what, b) for what, b in compressed_wire(params, method, rank)]


def bucket_params(
    params: Sequence[tuple[str, Tensor]], bucket_bytes: int, decays: dict[int, bool]
) -> list[tuple[list[str], list]]:
    """Consecutive same-dtype params, in reverse order, up to `bucket_bytes` each (at least one param).

    Decayed and undecayed params (`decays[id(p)]`) fill separate buckets side by side, so
    the small undecayed ones (norms, biases) do not cut the stream of large ones.
    """
    buckets: list[tuple[list[str], list]] = []
    open_bucket: dict[bool, int] = {}  # decay class -> index of its bucket being filled
    size: dict[bool, int] = {}
    for name, p in reversed(params):
        nbytes = p.numel() * p.element_size()
        kind = decays[id(p)]
        current = buckets[open_bucket[kind]] if kind in open_bucket else None
        if current is None or current[1][0].dtype != p.dtype or size[kind] + nbytes > bucket_bytes:
            buckets.append(([], []))
            open_bucket[kind], size[kind] = len(buckets) - 1, 0
        buckets[open_bucket[kind]][0].append(name)
        buckets[open_bucket[kind]][1].append(p)
        size[kind] += nbytes
    return buckets


def group_by_kind(
    params: Sequence[tuple[str, Tensor]],
    decays: dict[int, bool],
    gather_dtypes: dict[int, torch.dtype] | None = None,
) -> list[list[tuple[str, Tensor]]]:
    """Stage 3: a unit's params split by dtype, the dtype they are gathered in (`gather_dtypes`
    by id: the compute dtype the graph reads them in; their own by default) and decay class,
    each group one flat."""
    gather_dtypes = gather_dtypes or {}
    by_kind: dict[tuple[torch.dtype, torch.dtype, bool], list[tuple[str, Tensor]]] = {}
    for name, p in params:
        kind = (p.dtype, gather_dtypes.get(id(p), p.dtype), decays[id(p)])
        by_kind.setdefault(kind, []).append((name, p))
    return list(by_kind.values())


def read_by_several(
    params: list[tuple[str, nn.Parameter]], programs: Sequence[nn.Module], aliases: dict[str, nn.Parameter]
) -> set[str]:
    """The names of the `params` that more than one of `programs` reads."""
    readers: dict[int, int] = {}
    for program in programs if len(programs) > 1 else ():
        graph = program.graph if isinstance(program, fx.GraphModule) else None
        nodes = graph.nodes if graph is not None else ()
        read = {id(aliases[str(n.target)]) for n in nodes if n.op == "get_attr" and str(n.target) in aliases}
        for i in read:
            readers[i] = readers.get(i, 0) + 1
    return {n for n, p in params if readers.get(id(p), 0) > 1}


def by_program(
    params: list[tuple[str, nn.Parameter]], programs: Sequence[nn.Module], aliases: dict[str, nn.Parameter]
) -> list[list[tuple[str, nn.Parameter]]]:
    """`params` split by the first of `programs` that reads each: one part per program, in
    their order, then one of those none reads (parts may be empty); one part, all of them,
    when there is one program."""
    if len(programs) == 1:
        return [params]
    first: dict[int, int] = {}
    for k, program in enumerate(programs):
        graph = program.graph if isinstance(program, fx.GraphModule) else None
        for node in graph.nodes if graph is not None else ():
            p = aliases.get(str(node.target)) if node.op == "get_attr" else None
            if p is not None:
                first.setdefault(id(p), k)
    parts: list[list[tuple[str, nn.Parameter]]] = [[] for _ in range(len(programs) + 1)]
    for name, p in params:
        parts[first.get(id(p), len(programs))].append((name, p))
    return parts
