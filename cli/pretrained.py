"""What `--init PATH` names, opened as pretrained weights (`compiler.pretrained.Pretrained`).

    meshplan run my.plan --model m.py:build --init llama-1b/            # a Hugging Face folder
    meshplan run my.plan --model m.py:build --init weights.safetensors  # or .pt/.bin: one file
    meshplan run my.plan --model m.py:build --init runs/pretrain        # a meshplan run's latest checkpoint
    meshplan run my.plan --model m.py:build --init runs/pretrain/checkpoints/step00001000

A meshplan checkpoint gives its model's weights only (`runtime.checkpoint.SavedModel`): a run
started from it is a new run (step 0, fresh optimizer, its own data stream), in any layout. To
continue a run where it stopped, `--resume` it instead.
"""

from __future__ import annotations

from pathlib import Path

from meshplan.compiler.pretrained import InitError, Pretrained


def open_init(path: str, *, verify: bool = True) -> Pretrained:
    """`--init path` opened. A checkpoint's checksums are verified when `verify` (once, before
    the workers start: they open it again with `verify=False`)."""
    from meshplan.runtime.checkpoint import CheckpointError, SavedModel

    checkpoint = saved_checkpoint(Path(path))
    if checkpoint is None:
        return Pretrained.open(path)
    try:
        return Pretrained.of(checkpoint, SavedModel(checkpoint, verify=verify))
    except CheckpointError as e:
        raise InitError(f"--init {path}: {e}") from None


def saved_checkpoint(path: Path) -> Path | None:
    """The checkpoint folder `path` names: itself, or a run folder's latest; None for weights
    that are not a meshplan checkpoint. A run folder without a complete checkpoint is an error."""
    from meshplan.runtime.checkpoint import latest

    if (path / ".metadata").is_file():
        return path
    if not (path / "checkpoints").is_dir():
        return None
    found = latest(path / "checkpoints")
    if found is None:
        raise InitError(f"--init {path}: a run folder without a complete checkpoint (nothing to start from)")
    return found
