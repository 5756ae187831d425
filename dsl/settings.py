"""The mesh and the settings blocks (`pipeline`, `data_parallel`, `precision`, `train`), checked.

`SettingsChecker` turns them into specs with their defaults filled in, reports what is wrong
with them, and records what each mesh axis is used for, so that an axis serving two
incompatible purposes is reported once every statement has named its axes. The checker of
`dsl.check` builds on it and adds the module rules.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType

from meshplan.grammar import SCHEDULES

from . import ast
from .axes import GROUP, Axis, MeshSpec, axes_of
from .errors import Collector, Diagnostic, Span, did_you_mean
from .limits import MAX_INT
from .optimizer import OptimizerSpec, check_optimizer, keyword_arguments
from .patterns import Glob, PatternSyntaxError

DTYPE_BITS = {"fp32": 32, "bf16": 16, "fp16": 16}
DEFAULT_BUCKET_BYTES = 25 * 10**6  # DDP's default bucket size


@dataclass(frozen=True)
class PipelineSpec:
    axis: str
    schedule: str
    microbatches: int | None  # None: one per stage, decided once the axis size is known
    virtual_stages: int
    cuts: tuple[ast.Cut, ...]
    span: Span
    spans: Mapping[str, Span] = field(default_factory=dict)


@dataclass(frozen=True)
class CompressSpec:
    """`compress = ...` in `data_parallel`: the gradient all-reduce made lossy to send fewer bytes
    (`runtime/compression.py` has the design). `rank`: PowerSGD's approximation rank; `warmup`: the
    optimizer steps all-reduced uncompressed first (torch's `start_powerSGD_iter`)."""

    method: str  # "powersgd" or "bf16"
    rank: int = 0  # powersgd only
    warmup: int = 0  # powersgd only
    span: Span | None = None  # the setting's value

    @property
    def text(self) -> str:
        """As `explain` and verify's report name it: `powersgd(rank=4)`, `bf16`."""
        if self.method != "powersgd":
            return self.method
        return f"powersgd(rank={self.rank}" + (f", warmup={self.warmup})" if self.warmup else ")")


# compress methods and their arguments with defaults (PowerSGD's rank: torch's hook's default is 1;
# 4 is the rank its paper trains with, and small matrices of a tiny model still compress at it)
COMPRESS_METHODS: dict[str, dict[str, int]] = {"powersgd": {"rank": 4, "warmup": 0}, "bf16": {}}
# named so their refusal can say why, rather than "unknown method"
_COMPRESS_REFUSED = {
    "fp8": "neither gloo nor NCCL sums float8 tensors (an all-reduce needs the backend to add them): "
    "an fp8 payload would have to be all-gathered and summed by each rank, n times the bytes",
}


@dataclass(frozen=True)
class DataParallelSpec:
    axis: str
    zero: int
    bucket_bytes: int
    offload_optimizer: bool
    offload_params: bool
    span: Span
    spans: Mapping[str, Span] = field(default_factory=dict)
    compress: CompressSpec | None = None  # None: gradients all-reduced exactly
    optimizer_on_disk: bool = False  # `offload = optimizer:disk` (offload_optimizer is True too)
    params_on_disk: bool = False  # `offload = params:disk` (offload_params is True too)
    shard: str | None = None  # `zero = N over AXES`: the axes ZeRO cuts the state over (None: all)

    @property
    def axes(self) -> tuple[str, ...]:
        """The mesh axes the batch is split over (`over node x dp`: node, dp)."""
        return axes_of(self.axis)

    @property
    def sharded_over(self) -> str:
        """The axis (or group, `node x dp`) ZeRO cuts the training state over."""
        return self.shard or self.axis

    @property
    def replicated_over(self) -> tuple[str, ...]:
        """The data axes holding copies of one shard under HSDP (`zero = 3 over dp` of
        `data_parallel over node x dp`: node); () when ZeRO shards over every data axis."""
        shard = axes_of(self.sharded_over)
        return tuple(a for a in self.axes if a not in shard)


@dataclass(frozen=True)
class PrecisionSpec:
    compute: str = "fp32"
    params: str = "fp32"
    grads: str = "fp32"
    reduce: str = "fp32"
    loss_scale: str | float | None = None  # "dynamic", a fixed scale, or None
    spans: Mapping[str, Span] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainSpec:
    gradient_accumulation: int = 1
    spans: Mapping[str, Span] = field(default_factory=dict)
    optimizer: OptimizerSpec = field(default_factory=OptimizerSpec)  # `dsl/optimizer.py`


# What an axis is used for; an axis may serve several purposes only within one group.
_ROLE_WORDS = {
    "tensor": "tensor parallelism",
    "sequence": "sequence parallelism",
    "context": "context parallelism",
    "experts": "expert parallelism",
    "pipeline": "pipeline stages",
    "data": "data parallelism",
}
# experts may borrow a data axis (its ranks hold other experts, the batch split as before) or a
# tensor axis (its ranks hold other experts; each routes its own rows of the tokens)
_COMPATIBLE_ROLES = ({"tensor", "sequence", "experts"}, {"data", "experts"})


def _article(noun: str) -> str:
    return "an" if noun[0] in "aeiou" else "a"


def _compatible(roles: set[str]) -> bool:
    """Whether one axis may serve all of `roles`."""
    return len(roles) == 1 or any(roles <= group for group in _COMPATIBLE_ROLES)


class SettingsChecker:
    """Checks a plan's statements other than its `modules` block; the checker's state and its report."""

    def __init__(self, path: str, world_size: int | None, *, broken_lines: frozenset[int] = frozenset()):
        self.path = path
        self.world_size = world_size
        # Lines with syntax errors. A block holding one lost an entry to recovery, so checks
        # that relate its entries (offload needs zero = 3) would report the loss, not the plan.
        self.broken_lines = broken_lines
        self.found = Collector()
        self.roles: dict[str, list[tuple[str, Span]]] = {}
        self.unknown_axis_used = False

    def complete(self, node: ast.Statement | None) -> bool:
        """Whether the statement parsed without losing anything to error recovery."""
        if node is None:
            return True
        return not any(node.span.line <= line <= node.span.end_line for line in self.broken_lines)

    def error(self, span: Span, message: str, hint: str | None = None, related=()) -> None:
        self.found.add(Diagnostic(span, message, hint, "error", tuple(related)))

    def warn(self, span: Span, message: str, hint: str | None = None) -> None:
        self.found.add(Diagnostic(span, message, hint, "warning"))

    # -- mesh
    def mesh(self, node: ast.Mesh) -> MeshSpec:
        seen: dict[str, ast.MeshAxis] = {}
        axes = []
        for ax in node.axes:
            if ax.name.text in seen:
                self.error(
                    ax.name.span,
                    f"axis `{ax.name.text}` is declared twice",
                    hint="give each mesh axis its own name",
                    related=[(seen[ax.name.text].span, "first declared here")],
                )
                continue
            seen[ax.name.text] = ax
            if ax.size is not None and ax.size < 1:
                self.error(ax.span, f"axis `{ax.name.text}` has size {ax.size}; sizes are at least 1")
            axes.append(Axis(ax.name.text, ax.size, ax.span))
        autos = [a for a in axes if a.size is None]
        for extra in autos[1:]:
            self.error(
                extra.span,
                "only one axis can take its size from the world size (`*`)",
                hint=f"`{autos[0].name}` already does; give `{extra.name}` a number",
            )
        known = _product_up_to(MAX_INT + 1, [a.size for a in axes if a.size and a.size > 0])
        if known > MAX_INT:  # each size has at most 12 digits, but thousands of axes multiply
            self.error(
                node.span,
                f"the mesh axes multiply to more than {MAX_INT:,} ranks",
                hint=f"a mesh has 1 to {MAX_INT:,} ranks: the product of its axis sizes",
            )
        elif self.world_size is not None:
            if autos:
                if self.world_size % known:
                    self.error(
                        node.span,
                        f"world size {self.world_size} is not divisible by the fixed axes' product {known}",
                        hint="change the axis sizes or the number of processes",
                    )
                else:
                    axes = [
                        Axis(a.name, self.world_size // known, a.span) if a is autos[0] else a for a in axes
                    ]
            elif known != self.world_size:
                self.error(
                    node.span,
                    f"mesh has {known} ranks but the world size is {self.world_size}",
                    hint=f"make the axis sizes multiply to {self.world_size}, or use `*` for one axis",
                )
        return MeshSpec(tuple(axes), node.span)

    def axis_ref(self, name: ast.Name, mesh: MeshSpec, role: str) -> str | None:
        if name.text not in mesh.names:
            guess = did_you_mean(name.text, mesh.names)
            hint = f"did you mean `{guess}`?" if guess else "the mesh axes are: " + ", ".join(mesh.names)
            self.error(name.span, f"unknown mesh axis `{name.text}`", hint=hint)
            self.unknown_axis_used = True
            return None
        self.roles.setdefault(name.text, []).append((role, name.span))
        return name.text

    def axis_group(
        self, axes: tuple[ast.Name, ...], mesh: MeshSpec, role: str, written: str, noun: str
    ) -> str | None:
        """One axis, or several as one group named `dp x tp`: each a mesh axis, named once, in
        mesh order (a group's ranks are numbered as the mesh numbers them). `written`: what
        precedes the axes in the plan (`experts over`), for the hints; `noun`: the group's name
        in the messages (`expert group`)."""
        names = [self.axis_ref(name, mesh, role) for name in axes]
        for i, name in enumerate(axes):
            if name.text in (a.text for a in axes[:i]):
                once = GROUP.join(dict.fromkeys(a.text for a in axes))
                self.error(
                    name.span,
                    f"axis `{name.text}` is named twice in one {noun}",
                    hint=f"name each axis once: `{written} {once}`",
                )
                return None
        if None in names:
            return None
        ordered = [a for a in mesh.names if a in names]
        if ordered != names:
            self.error(
                axes[0].span,
                f"the axes of {_article(noun)} {noun} are written in mesh order: `{GROUP.join(ordered)}`",
                hint="a group's ranks are numbered as the mesh numbers them",
            )
            return None
        return GROUP.join(names)  # type: ignore[arg-type]

    def check_roles(self) -> None:
        """An axis serves several purposes only within one compatible group, all its uses at once
        (experts borrow a data axis or a tensor axis, never one that is both)."""
        for axis, uses in self.roles.items():
            seen: dict[str, Span] = {}
            for role, span in uses:
                if _compatible({*seen, role}):
                    seen.setdefault(role, span)
                    continue
                # the use it clashes with: one it shares no group with (else the first: tensor
                # and data are each fine with experts, not with each other through them)
                clash = [(r, s) for r, s in seen.items() if not _compatible({r, role})]
                other, other_span = (clash or list(seen.items()))[0]
                self.error(
                    span,
                    f"axis `{axis}` is used for {_ROLE_WORDS[role]} here but for "
                    f"{_ROLE_WORDS[other]} elsewhere",
                    hint="give each kind of parallelism its own mesh axis",
                    related=[(other_span, f"`{axis}` used for {_ROLE_WORDS[other]} here")],
                )
                break

    def check_unused_axes(self, mesh: MeshSpec) -> None:
        if self.unknown_axis_used:
            return  # the misspelt name was most likely meant to be one of the "unused" axes
        for ax in mesh.axes:
            if ax.name not in self.roles and ax.size != 1:
                self.warn(
                    ax.span,
                    f"axis `{ax.name}` is not used by any rule or block",
                    hint=f"its ranks would all compute the same thing; add `data_parallel over {ax.name}` "
                    "or set its size to 1",
                )

    # -- patterns (of cuts here, of rules in `dsl.check`)
    def glob(self, pattern: ast.Pattern) -> Glob | None:
        try:
            return Glob.compile(pattern.text)
        except PatternSyntaxError as e:
            s = pattern.span
            col = s.col + e.offset
            self.error(Span(s.path, s.line, col, s.line, col + e.length), str(e), hint=e.hint)
            return None

    # -- settings blocks
    def settings(self, items, allowed: tuple[str, ...]) -> dict[str, ast.Setting]:
        out: dict[str, ast.Setting] = {}
        for item in items:
            if not isinstance(item, ast.Setting):
                continue
            if item.key in out:
                self.error(
                    item.span,
                    f"`{item.key}` is set twice",
                    hint="keep one",
                    related=[(out[item.key].span, "first set here")],
                )
                continue
            assert item.key in allowed, item.key  # the grammar only admits these
            out[item.key] = item
        return out

    def pipeline(self, node: ast.PipelineBlock | None, mesh: MeshSpec) -> PipelineSpec | None:
        if node is None:
            return None
        axis = self.axis_ref(node.axis, mesh, "pipeline")
        s = self.settings(node.items, ("schedule", "microbatches", "virtual_stages"))
        spans = {k: v.span for k, v in s.items()}
        schedule = s["schedule"].value if "schedule" in s else "1f1b"
        assert isinstance(schedule, str) and schedule in SCHEDULES, schedule  # the grammar admits only these
        num_stages = mesh.size(axis) if axis else None

        virtual = s["virtual_stages"].value if "virtual_stages" in s else None
        complete = self.complete(node)
        if complete and virtual is not None and schedule not in ("interleaved", "zbv"):
            self.error(
                s["virtual_stages"].span,
                f"`virtual_stages` needs `schedule = interleaved` or `zbv`, not {schedule}",
                hint="virtual stages are the chunks each rank holds in the interleaved and V schedules",
            )
        if schedule == "interleaved" and virtual is not None and isinstance(virtual, int) and virtual < 2:
            self.error(
                s["virtual_stages"].value_span,
                "interleaved 1F1B needs at least 2 virtual stages per rank",
                hint="use `schedule = 1f1b` for one stage per rank",
            )
        if schedule == "zbv" and isinstance(virtual, int) and (virtual < 2 or virtual % 2):
            self.error(
                s["virtual_stages"].value_span,
                f"zbv places its chunks in Vs: it needs an even number of virtual stages per rank, not {virtual}",
                hint=f"use `virtual_stages = {max(2, virtual + virtual % 2)}`",
            )
        if virtual is None:
            virtual = 2 if schedule in ("interleaved", "zbv") else 1
        assert isinstance(virtual, int)

        micro = s["microbatches"].value if "microbatches" in s else None
        if isinstance(micro, int):
            if micro < 1:
                self.error(s["microbatches"].value_span, "`microbatches` must be at least 1")
            elif complete and num_stages and schedule != "gpipe" and micro < num_stages:
                self.error(
                    s["microbatches"].value_span,
                    f"{schedule} needs at least as many microbatches as stages: {micro} < {num_stages}",
                    hint=f"set `microbatches = {num_stages}` or more (more microbatches, smaller bubble)",
                )
            elif complete and num_stages and schedule == "interleaved" and micro % num_stages:
                self.error(
                    s["microbatches"].value_span,
                    f"interleaved 1F1B needs microbatches divisible by the {num_stages} pipeline ranks",
                    hint=f"use {micro + (-micro) % num_stages}",
                )

        cuts = tuple(i for i in node.items if isinstance(i, ast.Cut))
        seen_cuts: dict[tuple[str, str], ast.Cut] = {}
        for cut in cuts:
            self.glob(cut.pattern)
            prev = seen_cuts.setdefault((cut.side, cut.pattern.text), cut)
            if prev is not cut:
                self.error(
                    cut.span,
                    "the same cut is given twice",
                    hint="delete one of them",
                    related=[(prev.span, "first here")],
                )
        if complete and cuts and num_stages:
            want = num_stages * virtual - 1
            num_cuts = len(seen_cuts)  # a repeated cut is reported above, not counted twice
            if num_cuts != want:
                self.error(
                    cuts[0].span,
                    f"{num_cuts} cut(s) make {num_cuts + 1} stages, but `{axis}` has "
                    f"{num_stages} rank(s)" + (f" x {virtual} virtual stages" if virtual > 1 else ""),
                    hint=f"give {want} cut(s), or none to balance the stages automatically",
                )
        if axis and num_stages == 1:
            self.warn(node.span, f"pipeline over `{axis}` of size 1 has a single stage")
        return PipelineSpec(
            axis or node.axis.text,
            schedule,
            micro if isinstance(micro, int) else None,
            virtual,
            cuts,
            node.span,
            MappingProxyType(spans),
        )

    def data_parallel(self, node: ast.DataParallelBlock | None, mesh: MeshSpec) -> DataParallelSpec | None:
        if node is None:
            return None
        axis = self.axis_group(node.axes, mesh, "data", "data_parallel over", "data-parallel group")
        s = self.settings(node.items, ("zero", "bucket", "offload", "compress"))
        zero, shard = self.zero_stage(s["zero"], node, mesh) if "zero" in s else (0, None)
        bucket = s["bucket"].value if "bucket" in s else DEFAULT_BUCKET_BYTES
        assert isinstance(bucket, int)
        if bucket <= 0:
            self.error(s["bucket"].value_span, "bucket size must be positive")
        targets = s["offload"].value if "offload" in s else ()
        assert isinstance(targets, tuple)
        offload = tuple(t.split(":")[0] for t in targets)  # "optimizer:disk" -> "optimizer"
        if len(set(offload)) != len(offload):
            self.error(s["offload"].value_span, "an offload target is listed twice")
        if "optimizer:disk" in targets and zero == 0 and self.complete(node):
            self.error(
                s["offload"].value_span,
                "offloading the optimizer state to disk needs ZeRO (`zero = 1` or more)",
                hint="the disk holds each rank's shards of the state, which only ZeRO cuts",
            )
        if self.complete(node) and "params" in offload and zero != 3:
            disk = "params:disk" in targets
            self.error(
                s["offload"].value_span,
                f"offloading parameters{' to disk' if disk else ''} needs `zero = 3`",
                hint="only ZeRO-3 gathers parameters on use, so only it can keep them "
                + ("in files, read back before each all-gather" if disk else "on the CPU"),
            )
        # every ZeRO stage takes it: PowerSGD's factors are all-reduced under ZeRO-2/3 too
        # (`runtime/compression.py`)
        compress = self.compress(s["compress"]) if "compress" in s else None
        if compress is not None and compress.method != "bf16" and shard is not None:
            copies = GROUP.join(a.text for a in node.axes if a.text not in axes_of(shard))
            self.error(
                s["compress"].value_span,
                f"`compress = {compress.method}` cannot compress a ZeRO state replicated over `{copies}`: "
                "each rank holds a shard of a flat, not the whole matrices PowerSGD factors",
                hint=f"`compress = bf16` sends the shards' all-reduce over `{copies}` in bf16",
            )
        return DataParallelSpec(
            axis or GROUP.join(a.text for a in node.axes),
            zero,
            bucket,
            "optimizer" in offload,
            "params" in offload,
            node.span,
            MappingProxyType({k: v.span for k, v in s.items()}),
            compress,
            "optimizer:disk" in targets,
            "params:disk" in targets,
            shard,
        )

    def zero_stage(
        self, setting: ast.Setting, node: ast.DataParallelBlock, mesh: MeshSpec
    ) -> tuple[int, str | None]:
        """`zero = N` or `zero = N over AXES` checked: the stage, and the data axes it shards over
        when they are not all of the block's (HSDP; None: all of them)."""
        value = setting.value
        stage, over = (value.stage, value.over) if isinstance(value, ast.ZeroStage) else (value, ())
        assert isinstance(stage, int)
        if not 0 <= stage <= 3:
            self.error(
                setting.value_span,
                f"ZeRO stage {stage} does not exist",
                hint="0: plain data parallel, 1: shard optimizer state, 2: + gradients, 3: + parameters",
            )
        if not over:
            return stage, None
        data = [a.text for a in node.axes]
        group = GROUP.join(data)
        for name in over:
            if name.text not in data:
                self.error(
                    name.span,
                    f"ZeRO shards over the data axes only, and `{name.text}` is not one of `{group}`",
                    hint=f"name some of `{group}`: the state is sharded over those and replicated "
                    "over the others (HSDP)",
                )
                return stage, None
        if stage == 0:
            self.error(
                setting.value_span,
                "`zero = 0` shards nothing, so it cannot shard over an axis",
                hint=f"`zero = 3 over {over[0].text}` shards the state over `{over[0].text}`",
            )
            return stage, None
        shard = self.axis_group(over, mesh, "data", f"zero = {stage} over", "ZeRO group")
        return stage, None if shard is None or set(axes_of(shard)) == set(data) else shard

    def compress(self, setting: ast.Setting) -> CompressSpec | None:
        """`compress = METHOD(ARG=N, ...)` checked: a known method, its own arguments in range."""
        value = setting.value
        assert isinstance(value, ast.Compression)  # the grammar's `compress` rule makes one
        method = value.method.text
        if method in _COMPRESS_REFUSED:
            self.error(
                value.method.span,
                f"`compress = {method}` cannot run: {_COMPRESS_REFUSED[method]}",
                hint="use `compress = bf16` (half the bytes, error feedback) or `compress = powersgd`",
            )
            return None
        if method not in COMPRESS_METHODS:
            guess = did_you_mean(method, [*COMPRESS_METHODS, *_COMPRESS_REFUSED])
            known = ", ".join(f"`{m}`" for m in COMPRESS_METHODS)
            self.error(
                value.method.span,
                f"unknown compression `{method}`",
                hint=f"did you mean `{guess}`?" if guess else f"the methods are {known}",
            )
            return None

        def invalid(name: str, arg: ast.CompressArg) -> tuple[str, str] | None:
            if name == "rank" and arg.value < 1:
                return "PowerSGD's rank must be at least 1", "`rank=1` sends the least"
            return None

        args = keyword_arguments(
            method, value.args, COMPRESS_METHODS[method], "argument", self.error, invalid
        )
        return CompressSpec(method, args.get("rank", 0), args.get("warmup", 0), setting.value_span)

    def precision(self, node: ast.PrecisionBlock | None) -> PrecisionSpec:
        if node is None:
            return PrecisionSpec()
        s = self.settings(node.items, ("compute", "params", "grads", "reduce", "loss_scale"))

        def get(key: str, default: str) -> str:
            value = s[key].value if key in s else default
            assert isinstance(value, str), value  # the grammar admits only dtype names here
            return value

        compute = get("compute", "fp32")
        params = get("params", "fp32")
        grads = get("grads", params)
        reduce = get("reduce", grads)
        complete = self.complete(node)
        if complete and DTYPE_BITS[params] < DTYPE_BITS[compute]:
            self.error(
                s["params"].value_span,
                f"master weights in {params} are less precise than compute in {compute}",
                hint="keep `params = fp32` (the usual choice), or lower `compute`",
            )
        if complete and "params" in s and "compute" in s and {params, compute} == {"bf16", "fp16"}:
            self.error(
                s["params"].value_span,
                f"params in {params} cannot be cast losslessly to compute in {compute}",
                hint="keep `params = fp32` (the usual choice)",
            )
        loss_scale = (
            s["loss_scale"].value if "loss_scale" in s else ("dynamic" if compute == "fp16" else "none")
        )
        assert isinstance(loss_scale, (str, float)), loss_scale
        if complete and loss_scale != "none" and compute != "fp16" and "loss_scale" in s:
            self.error(
                s["loss_scale"].value_span,
                f"loss scaling is for fp16 compute, but compute is {compute}",
                hint="bf16 and fp32 have fp32's exponent range; remove `loss_scale`",
            )
        if isinstance(loss_scale, float) and loss_scale <= 0:
            self.error(s["loss_scale"].value_span, "a fixed loss scale must be positive")
        if compute == "fp16" and loss_scale == "none":
            self.warn(
                s["loss_scale"].span,
                "fp16 without loss scaling: small gradients will underflow to zero",
                hint="use `loss_scale = dynamic`",
            )
        spans = MappingProxyType({k: v.span for k, v in s.items()} | {"block": node.span})
        return PrecisionSpec(
            compute, params, grads, reduce, None if loss_scale == "none" else loss_scale, spans
        )

    def train(self, node: ast.TrainBlock | None) -> TrainSpec:
        if node is None:
            return TrainSpec()
        s = self.settings(node.items, ("gradient_accumulation", "optimizer"))
        steps = s["gradient_accumulation"].value if "gradient_accumulation" in s else 1
        assert isinstance(steps, int)
        if steps < 1:
            self.error(s["gradient_accumulation"].value_span, "`gradient_accumulation` must be at least 1")
        optimizer = check_optimizer(s["optimizer"], self.error) if "optimizer" in s else OptimizerSpec()
        return TrainSpec(steps, MappingProxyType({k: v.span for k, v in s.items()}), optimizer)


def _product_up_to(cap: int, values: list[int]) -> int:
    """The product of `values`, or `cap` once it reaches `cap`: thousands of 12-digit sizes
    would otherwise make a number too long to print."""
    out = 1
    for v in values:
        out *= v
        if out >= cap:
            return cap
    return out
