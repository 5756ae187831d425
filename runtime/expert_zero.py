"""ZeRO under expert parallelism: the training state of each parameter sharded over the ranks
that average its gradient.

    zero = expert_zero(program, axes, lambda over: group_over(layout, over, mesh), ZeroOptions(stage=2))
    train(program, loss_of, batches, config, axes=axes, sync=zero)  # zero.optimizer(config) there

`mesh dp=2, ep=2` with `zero = 2` (ranks dp-major): the dense parameters' fp32 masters,
moments and gradients are cut in quarters over all four ranks, an expert's in halves over
the ranks holding the same experts, {0, 2} and {1, 3}. With `experts over dp` on `mesh dp=2`
no other rank holds a rank's experts, so their state stays whole on it (an engine over a
group of one). The sets are `expert_data_parallel`'s; each is one `Zero` engine over its own
parameters and group, and this object is the `Zero` the loop, checkpoints and export see.

The compiler's ZeRO pass gives each layer a unit per group (`layers.0` over `dp x ep`,
`layers.0+dp` for its experts), its nodes named by the group, and each engine binds its
own: under stage 3 a layer's dense parameters and its experts' are gathered, each over
their own ranks, before the layer and freed after; under stages 1/2 each group's post-step
all-gather overlaps the next forward. Parameters no other rank holds (`experts over dp`)
are in no unit: their engine, over this rank alone, keeps them whole (stage 2 at most).
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Callable, Collection, Iterator, Sequence
from typing import Any

import torch.distributed as dist
from torch import Tensor, nn

from .axes import Axes
from .compression import Bf16Feedback, BucketCompressor, restore_state, saved_state
from .data_parallel import broadcast_parameters
from .expert_data_parallel import PerGroup, averaged_over, data_ranks
from .grad_sync import OptimizerSettings, TrainingState
from .zero import Collective, Zero, ZeroOptions
from .zero_grads import Replicas
from .zero_optim import load_buffers, read_steps, training_state


class ExpertZero(PerGroup[Zero]):
    """Several `Zero` engines over one module, each over the group that averages its params."""

    def optimizer(self, config: OptimizerSettings, axes: Axes | None = None) -> ExpertZero:
        """`Zero.optimizer` of every engine; this object steps them all."""
        for e in self.engines:
            e.optimizer(config, axes)
        return self

    @property
    def param_groups(self) -> list[dict[str, Any]]:
        """The engines' optimizers' param groups, in one list (the loop sets the LR in each)."""
        return [g for e in self.engines for g in e.param_groups]

    def step(self) -> None:
        for e in self.engines:
            e.step()

    def zero_grad(self) -> None:
        for e in self.engines:
            e.zero_grad()

    def gathered(self) -> contextlib.AbstractContextManager[None]:
        return self._in_each(lambda e: e.gathered())

    def memory(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for e in self.engines:
            for key, nbytes in e.memory().items():
                total[key] = total.get(key, 0) + nbytes
        return total

    def collectives(self, micro_steps: int = 1) -> list[Collective]:
        return [c for e in self.engines for c in e.collectives(micro_steps)]

    def issued(self) -> list[Collective]:
        return [c for e in self.engines for c in e.issued()]

    def own_grad_of(self, name: str) -> Tensor:
        """`Zero.own_grad_of`, from the engine holding `name` (a tied weight: a dense one)."""
        return next(e for e in self.engines if e.holds_alone(name)).own_grad_of(name)

    def shard_numel(self, numel: int) -> int:
        """`Zero.shard_numel` of the dense parameters' engine (the widest group): a tied weight's."""
        return max(self.engines, key=lambda e: e.world).shard_numel(numel)

    def gathered_by_unit(self) -> Iterator[set[str]]:
        """`Zero.gathered_by_unit` of every engine in turn."""
        for e in self.engines:
            yield from e.gathered_by_unit()

    def own_state(self) -> TrainingState:
        """`Zero.own_state` of every engine's elements together: the engines own disjoint names."""
        elements = {name: held for e in self.engines for name, held in e.own_elements().items()}
        steps = {name: step for e in self.engines for name, step in e.steps().items()}
        state = training_state(self.module, elements, steps, self.engines[0].optim.choice.kind)
        return dataclasses.replace(state, local=saved_state(self._feedback()))

    def restore_local(self, saved: dict[str, Tensor]) -> bool:
        """`compress`'s state of every engine's flats, numbered across the engines in order."""
        return restore_state(self._feedback(), saved)

    def _feedback(self) -> list[Bf16Feedback | BucketCompressor]:
        return [c for e in self.engines for c in e.feedback()]

    def loaded(self, state: TrainingState) -> None:
        steps = read_steps(state)
        for e in self.engines:
            e.reload(steps)
        load_buffers(self.module, state)


def expert_zero(
    module: nn.Module,
    axes: Axes,
    groups: Callable[[tuple[str, ...]], dist.ProcessGroup | None],
    options: ZeroOptions,
    *,
    programs: Sequence[nn.Module] = (),
    alone: Collection[str] = (),
    replicated: Collection[str] = (),
    compressed: Collection[str] = (),
) -> ExpertZero:
    """One `Zero` per set of data axes a parameter is averaged over (`averaged_over`), sharding
    those parameters over that set's group, from the group's first rank's values; every rank
    calls it. The engine of the parameters averaged over the most ranks (the dense ones) binds
    the compiled program's ZeRO nodes. `programs` and `alone`: `shard_for_zero`'s (a pipeline
    rank's stage programs, the weights tied across pipeline ranks). `replicated` (HSDP): the data
    axes over which each set's state is not cut but copied, its shards all-reduced over them.
    `compressed` (the plan's data-parallel axes): the sets that take one in reduce under
    `options.compression`; the others exactly."""
    names = {id(p): n for n, p in module.named_parameters()}
    engines = []
    for over, params in averaged_over(module, axes).items():  # sorted: the same order on every rank
        cut = tuple(a for a in over if a not in replicated)
        copies = tuple(a for a in over if a in replicated)
        group, settings = groups(cut), options
        if not any(a in compressed for a in over):  # a sum over other axes alone stays exact
            settings = dataclasses.replace(settings, compression=None)
        if group is None:  # no other rank holds them: stage 3 would gather from itself
            group = _own_group()
            settings = dataclasses.replace(options, stage=min(options.stage, 2), compression=None)
        broadcast_parameters(params, groups(over) or group)  # the same seeded model: make it exact
        label, mine = " x ".join(over), {names[id(p)] for p in params}
        peers = groups(copies)
        engines.append(
            Zero(
                module,
                group,
                settings,
                axis=" x ".join(cut) or "(this rank)",
                only=mine,
                node_axis=label,  # the compiler's ZeRO pass names each node's group alike
                divisor=data_ranks(axes, over),
                programs=programs,
                alone=[n for n in alone if n in mine],
                replicas=Replicas(peers, " x ".join(copies)) if peers is not None else None,
            )
        )
    return ExpertZero(module, engines)


def _own_group() -> dist.ProcessGroup:
    """A group of this rank alone (parameters no other rank holds); every rank makes all of them."""
    group, _ = dist.new_subgroups_by_enumeration([[r] for r in range(dist.get_world_size())])
    return group
