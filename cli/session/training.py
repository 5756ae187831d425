"""A session's training and what comes out of it: the loop's settings from the run's options,
the program's inputs for a micro-batch of tokens, and the trained weights put back together as
the unpartitioned model's `state_dict()` (for `--export` and `verify`)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

from meshplan.options import run_dir

if TYPE_CHECKING:
    import torch

    from meshplan.runtime.data import CallBatch

    from .rank import Session


def call_inputs(
    args: tuple, kwargs: dict[str, Any], input_ids: torch.Tensor | CallBatch, labels: torch.Tensor | None
) -> tuple[tuple, dict[str, Any]]:
    """A forward call shaped like the model's example inputs, with this micro-batch's tokens.

    Positional (input_ids, labels): labels as given (already shifted, like the built-in
    Llama). Keyword `input_ids`/`labels` (Hugging Face): labels = input_ids, because those
    models shift the labels themselves. A batch of the call's own inputs (`CallBatch`: images
    and labels) is the call.
    """
    import torch

    from meshplan.runtime.data import CallBatch

    if isinstance(input_ids, CallBatch):
        return input_ids.args, input_ids.kwargs
    assert labels is not None, "a token batch is (input_ids, labels)"

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
    """Consolidate this rank's shards into full tensors; rank 0 writes them as they arrive, as
    the unpartitioned model's `state_dict()` (a list of experts under the list's names): to one
    file (`FileWriter`), or to a folder (`exports_a_folder`) as Hugging Face writes one
    (`ShardWriter`), each tied weight once, under the name Hugging Face keeps (a torch file: under
    each of its names), and a Hugging Face model's config beside a folder's weights. Rank 0
    holds one tensor (a file) or one shard (a folder) at a time; the other ranks drop what they
    gather."""
    from meshplan.compiler.load import load_model
    from meshplan.runtime.expert_list import as_list_state
    from meshplan.runtime.export import FileWriter, ShardWriter, exports_a_folder

    assert prepared.options.export is not None, "export_weights runs for --export"
    if rank != 0:
        for _ in _streamed_state(prepared):
            pass
        return
    target = Path(prepared.options.export)
    assert prepared.options.model is not None, "a session's options name its model"
    model = load_model(prepared.options.model, shapes_only=True).model  # for its config and ties
    written_as = _tied_as(prepared.tied, model)
    names = {kept: [n for n, k in written_as.items() if k == kept] for kept in written_as.values()}
    writer = ShardWriter(target) if exports_a_folder(target) else FileWriter(target)
    for name, tensor in _streamed_state(prepared):
        name = written_as.get(name, name)
        if name in writer:
            continue
        for key, value in as_list_state({name: tensor}, prepared.expert_lists).items():
            if isinstance(writer, FileWriter):
                writer.add(key, value, also=names.get(key, ()))
            else:
                writer.add(key, value)
    if isinstance(writer, FileWriter):
        print(f"exported {writer.finish()} tensors to {target}")
        return
    count = writer.finish(_hugging_face_metadata(model))
    print(f"exported {count} tensors to {target}/ ({len(writer.shards)} safetensors files)")


def _tied_as(tied: tuple[tuple[str, ...], ...], model: torch.nn.Module) -> dict[str, str]:
    """Each name of a tied weight -> the one name an export holds it under: the name Hugging
    Face's `save_pretrained` keeps (not in the model's tied-weight keys, e.g. Llama's
    `model.embed_tokens.weight` over `lm_head.weight`), else the model's first name for it."""
    keys = getattr(model, "all_tied_weights_keys", None) or getattr(model, "_tied_weights_keys", None)
    dropped = set(keys or ())  # a dict (dropped -> kept) or a list of the dropped names
    out: dict[str, str] = {}
    for group in tied:
        kept = next((name for name in group if name not in dropped), group[0])
        out.update({name: kept for name in group})
    return out


def _hugging_face_metadata(model: torch.nn.Module) -> list[Any]:
    """What `save_pretrained` writes beside the weights of a Hugging Face model: its config (with
    its class as the architecture) and its generation config; nothing for another model."""
    import sys

    transformers = sys.modules.get("transformers")  # a PreTrainedModel imported it
    if transformers is None or not isinstance(model, transformers.PreTrainedModel):
        return []
    config = model.config
    config.architectures = [type(model).__name__]
    generation = getattr(model, "generation_config", None)
    return [config] if generation is None or not model.can_generate() else [config, generation]


def consolidated_state(prepared: Session) -> dict[str, torch.Tensor]:
    """The trained weights as the unpartitioned model's `state_dict()` (every rank gets them):
    shards gathered over their axes, ZeRO's gathered unit by unit, and each tied weight under
    every name it has."""
    return _with_every_tied_name(dict(_streamed_state(prepared)), prepared.tied)


def _with_every_tied_name(
    state: dict[str, torch.Tensor], tied: tuple[tuple[str, ...], ...]
) -> dict[str, torch.Tensor]:
    """`state` with each tied weight under every name of its group (one tensor, shared)."""
    for group in tied:
        held = next((state[name] for name in group if name in state), None)
        if held is not None:
            state.update({name: held for name in group if name not in state})
    return state


def _streamed_state(prepared: Session) -> Iterator[tuple[str, torch.Tensor]]:
    """The trained weights one full tensor at a time, on every rank, under the program's names
    (each tied weight under the names the program holds it by). Every rank iterates to the end:
    the gathers are collectives. Under a pipeline each stage's tensors are broadcast to the
    other stages in turn, one tensor at a time."""
    if prepared.pipeline_group is None:
        yield from _own_tensors(prepared)
        return
    import torch.distributed as dist

    group = prepared.pipeline_group
    me = dist.get_rank(group)
    for stage in range(dist.get_world_size(group)):
        src = dist.get_global_rank(group, stage)
        if stage == me:
            for item in _own_tensors(prepared):
                dist.broadcast_object_list([item], src=src, group=group)
                yield item
            dist.broadcast_object_list([None], src=src, group=group)  # this stage is done
            continue
        while True:
            box: list[Any] = [None]
            dist.broadcast_object_list(box, src=src, group=group)
            if box[0] is None:
                break
            yield box[0]


def _own_tensors(prepared: Session) -> Iterator[tuple[str, torch.Tensor]]:
    """`_streamed_state` of the parameters and buffers this rank's program holds: ZeRO's gathered
    one unit at a time, each tensor's shards gathered over the axes that cut it."""
    from meshplan.runtime.export import consolidate_each
    from meshplan.runtime.grad_sync import Local

    program, wanted = prepared.program, set(prepared.export_names)
    sync = prepared.dp if prepared.dp is not None else Local(program)
    ids = {name: id(p) for name, p in program.named_parameters(remove_duplicate=False)}
    done: set[str] = set()
    for names in sync.gathered_by_unit():  # ZeRO-3: one unit gathered at a time, not the model
        mine = {ids[n] for n in names if n in ids}
        for name, tensor in consolidate_each(
            prepared.program, prepared.axes, {n for n, i in ids.items() if i in mine} & wanted
        ):
            done.add(name)
            yield name, tensor
    # the rest: buffers, and parameters no ZeRO engine holds
    yield from consolidate_each(program, prepared.axes, wanted - done)


def train_config(prepared: Session):
    """The `TrainConfig` of a run: its options, with the plan's accumulation, loss scale and
    optimizer."""
    from meshplan.runtime.optimizers import OptimizerChoice
    from meshplan.runtime.train import TrainConfig

    options = prepared.options
    return TrainConfig(
        steps=options.steps,
        lr=options.lr,
        warmup_steps=options.warmup,
        min_lr_ratio=options.min_lr_ratio,
        weight_decay=options.weight_decay,
        optimizer=prepared.optimizer or OptimizerChoice(),
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
    from meshplan.runtime.train import Display, train

    rank = dist.get_rank() if dist.is_initialized() else 0
    if show_progress is None:
        show_progress = rank == 0
    progress = Progress() if show_progress else None
    display: Display | None = progress
    if prepared.options.tensorboard:
        from meshplan.tensorboard import Displays, TensorBoard

        program = Path(prepared.options.program) if prepared.options.program else None
        board = TensorBoard(
            Path(prepared.options.tensorboard), rank, plan_text=prepared.plan_text, program=program
        )
        display = board if progress is None else Displays(progress, board)
    summary = train(
        prepared.program,
        prepared.loss_of,
        prepared.batches,
        train_config(prepared),
        axes=prepared.axes,
        sync=prepared.dp,
        display=display,
        forward_backward=prepared.forward_backward,
        step_metrics=prepared.step_metrics,
        after_backward=prepared.after_backward,
        between_steps=prepared.between_steps,
    )
    if progress is not None:  # not when the loop raised: a failed run is not summarized as if it ended
        progress.report(summary)
    return summary
