"""The on-disk result of `meshplan compile -o DIR`, and reading it back for `inspect`.

DIR/manifest.json     what was compiled: plan, model, mesh, versions
DIR/plan.txt          the resolved plan: mesh sizes, per-parameter placements
DIR/explain.txt       rule by rule: matched modules, local shapes, collectives
DIR/ledger.txt        collectives per step (and ledger.json, machine-readable)
DIR/program.py        the program every rank runs, as readable Python, collectives marked
DIR/graph.json        the graph with placements, for `meshplan inspect`
DIR/program.pt        the program itself, no weights: what `meshplan run DIR` executes

One program serves every rank (SPMD): a rank binds its own shards and process groups, its
mesh coordinates, when the program is built, so the artifact's size and the time to write it
do not grow with the mesh. The manifest names the plan and the model by content (hashes of
the plan text and of the model's structure), not by where they were on the compiling machine.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
from pathlib import Path

import torch

from .compile import Compiled
from .executable import PROGRAM, model_fingerprint, save_executable, to_executable
from .print_explain import explain
from .print_graph import graph_records
from .print_ledger import ledger_table
from .print_program import annotated_code


def write_artifact(compiled: Compiled, out: Path, *, model_spec: str) -> list[Path]:
    out.mkdir(parents=True, exist_ok=True)
    layout = compiled.layout
    manifest = {
        "meshplan": importlib.metadata.version("meshplan"),
        "torch": torch.__version__,
        "plan": Path(compiled.plan.path).name,
        "plan_sha256": hashlib.sha256(compiled.plan.source.encode()).hexdigest(),
        "model": model_spec,
        "model_sha256": model_fingerprint(
            compiled.source.model if compiled.source else compiled.captured.model
        ),
        "mesh": dict(zip(layout.names, layout.sizes, strict=True)),
        "world_size": layout.world_size,
        "tensor_axes": list(compiled.tensor_axes),
        "collectives_per_step": compiled.ledger.collectives().count(),
        "bytes_per_step": compiled.ledger.collectives().total_bytes(),
        "device_copies_per_step": compiled.ledger.copies().count(),
        "device_copy_bytes_per_step": compiled.ledger.copies().total_bytes(),
    }
    written = {
        "manifest.json": json.dumps(manifest, indent=2) + "\n",
        "plan.txt": resolved_plan(compiled),
        "explain.txt": explain(compiled),
        "ledger.txt": ledger_table(compiled),
        "ledger.json": json.dumps(compiled.ledger.to_json(), indent=1) + "\n",
        "graph.json": json.dumps(graph_records(compiled), indent=1) + "\n",
    }
    written["program.py"] = annotated_code(compiled)
    for name, text in written.items():
        (out / name).write_text(text, encoding="utf-8")
    save_executable(to_executable(compiled), out / PROGRAM)
    return [out / name for name in [*written, PROGRAM]]


def resolved_plan(compiled: Compiled) -> str:
    layout = compiled.layout
    lines = [
        f"# resolved from {Path(compiled.plan.path).name}",
        "mesh " + ", ".join(f"{n}={s}" for n, s in zip(layout.names, layout.sizes, strict=True)),
        "",
    ]
    params = dict(compiled.captured.model.named_parameters())
    width = max((len(n) for n in params), default=0)
    for name, p in params.items():
        placement = compiled.param_placements.get(name, {})
        where = ", ".join(f"{v} over {k}" for k, v in placement.items()) or "Replicate()"
        lines.append(f"{name:<{width}}  {tuple(p.shape)!s:<14} {where}")
    return "\n".join(lines) + "\n"


class ArtifactError(ValueError):
    """A folder that is not a meshplan compile output."""


def read_artifact(folder: Path) -> dict:
    manifest = folder / "manifest.json"
    if not manifest.is_file():
        raise ArtifactError(
            f"{folder} is not a compiled plan (no manifest.json); run `meshplan compile ... -o "
            f"{folder}` first"
        )
    return json.loads(manifest.read_text(encoding="utf-8"))
