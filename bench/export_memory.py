"""Rank 0's memory while `--export FILE` writes the consolidated weights: every tensor held until
one `save` call (how meshplan wrote a file before) vs `runtime.export.FileWriter` (each tensor's
bytes on disk as it arrives).

    python bench/export_memory.py [--layers 24] [--hidden 1024] [--quick]

Model: the example Llama's parameter shapes at a benchmark's size (default 24 layers, hidden
1024: 0.4B parameters, fp32). The tensors arrive one at a time, each a fresh full tensor, as
rank 0 receives them from the gathers of `_streamed_state` (what both writers are fed in
`meshplan run`; the gathers themselves are not measured). Each writer runs in a fresh process.

Measured: how far the process's resident memory rose while exporting (VmHWM, reset through
/proc/self/clear_refs, minus VmRSS before), divided by the model's bytes. The staged bytes and
the `.pt` file's memory map are file pages (the kernel's to drop), so they count in VmRSS only
while mapped: the `.pt` writer's rise includes them; nothing else does.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import subprocess
import sys
import tempfile
from pathlib import Path

import torch
from common import human_bytes, result, sized_llama

WRITERS = ("held", "streamed")
SUFFIXES = (".safetensors", ".pt")


def _status(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _measure(writer: str, suffix: str, layers: int, hidden: int) -> dict[str, int]:
    from meshplan.runtime.export import FileWriter

    with torch.device("meta"):
        shapes = {name: (p.shape, p.dtype) for name, p in sized_llama(layers, hidden).state_dict().items()}
    model_bytes = sum(torch.Size(s).numel() * d.itemsize for s, d in shapes.values())

    def arriving():
        for name, (shape, dtype) in shapes.items():
            yield name, torch.randn(shape).to(dtype)  # a fresh full tensor, as a gather hands it over

    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"model{suffix}"
        gc.collect()
        ctypes.CDLL("libc.so.6").malloc_trim(0)
        Path("/proc/self/clear_refs").write_text("5")  # VmHWM back to VmRSS
        before = _status("VmRSS")
        if writer == "held":
            state = dict(arriving())
            if suffix == ".safetensors":
                from safetensors.torch import save_file

                save_file(state, str(path))
            else:
                torch.save(state, path)
            del state
        else:
            stream = FileWriter(path)
            for name, tensor in arriving():
                stream.add(name, tensor)
            stream.finish()
        rise = _status("VmHWM") - before
    return {"rise": rise, "model": model_bytes}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--quick", action="store_true", help="4 layers, hidden 512")
    parser.add_argument("--one", nargs=2, help=argparse.SUPPRESS)  # writer suffix: in a fresh process
    args = parser.parse_args()
    if args.quick:
        args.layers, args.hidden = 4, 512
    if args.one:
        print(json.dumps(_measure(*args.one, args.layers, args.hidden)))
        return
    ratios: dict[str, float] = {}
    print(f"{'writer':<10} {'file':<13} {'model':>10} {'rise':>10} {'rise / model':>13}")
    for suffix in SUFFIXES:
        for writer in WRITERS:
            argv = [sys.executable, __file__, "--layers", str(args.layers), "--hidden", str(args.hidden)]
            done = subprocess.run(
                [*argv, "--one", writer, suffix], capture_output=True, text=True, check=True
            )
            got = json.loads(done.stdout.splitlines()[-1])
            ratio = got["rise"] / got["model"]
            ratios[f"{writer} {suffix}"] = round(ratio, 3)
            print(
                f"{writer:<10} {suffix:<13} {human_bytes(got['model']):>10} {human_bytes(got['rise']):>10} "
                f"{ratio:>13.3f}"
            )
    result("export: rank 0's memory rise / the model's bytes", "ratio", ratios)


if __name__ == "__main__":
    main()
