"""A session's training and what comes out of it: the loop's settings from the run's options,
the program's inputs for a micro-batch of tokens, and the trained weights put back together as
the unpartitioned model's `state_dict()` (for `--export` and `verify`)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshplan.options import run_dir

if TYPE_CHECKING:
    import torch

    from .rank import Session


def call_inputs(
    args: tuple, kwargs: dict[str, Any], input_ids: torch.Tensor, labels: torch.Tensor
) -> tuple[tuple, dict[str, Any]]:
    """A forward call shaped like the model's example inputs, with this micro-batch's tokens.

    Positional (input_ids, labels): labels as given (already shifted, like the built-in
    Llama). Keyword `input_ids`/`labels` (Hugging Face): labels = input_ids, because those
    models shift the labels themselves.
    """
    import torch

    if "input_ids" in kwargs:
        new = dict(kwargs, input_ids=input_ids)
        if "labels" in new:
            new["labels"] = input_ids
        return args, new
    tokens = iter((input_ids, labels))
    out = tuple(
        next(tokens, a) if isinstance(a, torch.Tensor) and a.dim() == 2 and not a.is_floating_point() else a
        for a in args
    )
    return out, kwargs


INITIAL_DYNAMIC_SCALE = 2.0**16  # fp16's usual starting point; overflows halve it within a few steps


def export_weights(prepared: Session, rank: int) -> None:
    """Consolidate this rank's shards into full tensors; rank 0 writes them, as the
    unpartitioned model's `state_dict()` (a list of experts under the list's names)."""
    from meshplan.runtime.expert_list import as_list_state
    from meshplan.runtime.export import write_state_dict

    state = as_list_state(consolidated_state(prepared), prepared.expert_lists)
    if rank == 0:
        assert prepared.options.export is not None, "export_weights runs for --export"
        write_state_dict(state, Path(prepared.options.export))
        print(f"exported {len(state)} tensors to {prepared.options.export}")


def consolidated_state(prepared: Session) -> dict[str, torch.Tensor]:
    """The trained weights as the unpartitioned model's `state_dict()` (every rank gets them):
    shards gathered over their axes, ZeRO's gathered unit by unit, and each tied weight under
    every name it has."""
    from meshplan.runtime.export import consolidate
    from meshplan.runtime.grad_sync import Local

    program, wanted = prepared.program, set(prepared.export_names)
    sync = prepared.dp if prepared.dp is not None else Local(program)
    ids = {name: id(p) for name, p in program.named_parameters(remove_duplicate=False)}
    state: dict[str, torch.Tensor] = {}
    for names in sync.gathered_by_unit():  # ZeRO-3: one unit gathered at a time, not the model
        mine = {ids[n] for n in names if n in ids}
        state |= consolidate(program, prepared.axes, {n for n, i in ids.items() if i in mine} & wanted)
    # the rest: buffers, and parameters no ZeRO engine holds
    state |= consolidate(program, prepared.axes, wanted - state.keys())
    if prepared.pipeline_group is not None:  # each pipeline rank holds other stages: put them together
        import torch.distributed as dist

        parts: list[Any] = [None] * dist.get_world_size(prepared.pipeline_group)
        dist.all_gather_object(parts, state, group=prepared.pipeline_group)
        state = {name: tensor for part in parts for name, tensor in part.items()}
    for group in prepared.tied:
        held = next((state[name] for name in group if name in state), None)
        if held is not None:
            state.update({name: held for name in group if name not in state})
    return state


def train_config(prepared: Session):
    """The `TrainConfig` of a run: its options, with the plan's accumulation and loss scale."""
    from meshplan.runtime.train import TrainConfig

    options = prepared.options
    return TrainConfig(
        steps=options.steps,
        lr=options.lr,
        warmup_steps=options.warmup,
        min_lr_ratio=options.min_lr_ratio,
        weight_decay=options.weight_decay,
        grad_clip=options.grad_clip,
        accumulation=prepared.accumulation,
        seed=options.seed,
        tokens_per_micro_step=options.batch * prepared.microbatches * options.seq,
        run_dir=run_dir(options),
        save_every=options.save_every,
        resume=options.resume,
        log_every=options.log_every,
        peak_flops=options.peak_tflops * 1e12 if options.peak_tflops else None,
        loss_scale=None
        if prepared.loss_scale is None
        else (INITIAL_DYNAMIC_SCALE if prepared.loss_scale == "dynamic" else float(prepared.loss_scale)),
        dynamic_loss_scale=prepared.loss_scale == "dynamic",
    )


def train_session(prepared: Session, *, show_progress: bool | None = None):
    """Train the session with `meshplan run`'s loop; `show_progress`: draw the progress bar and
    the summary (None: on rank 0 only)."""
    import torch.distributed as dist

    from meshplan.display import Progress
    from meshplan.runtime.train import train

    if show_progress is None:
        show_progress = (dist.get_rank() if dist.is_initialized() else 0) == 0
    return train(
        prepared.program,
        prepared.loss_of,
        prepared.batches,
        train_config(prepared),
        axes=prepared.axes,
        sync=prepared.dp,
        display=Progress() if show_progress else None,
        forward_backward=prepared.forward_backward,
        step_metrics=prepared.step_metrics,
        after_backward=prepared.after_backward,
        between_steps=prepared.between_steps,
    )
