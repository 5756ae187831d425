"""`lower.place`: a rank's program moved to a device names that device in its graph too (a
capture bakes in the host: `arange(..., device=cpu)`, a buffer's `.to(cpu)`). "meta" stands in
for a GPU here; the `gpu` tier runs the real one."""

from pathlib import Path

from meshplan.compiler.capture import with_token_shape
from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import load_model
from meshplan.compiler.lower import build_rank_program, place
from meshplan.dsl import check_text


def test_a_placed_program_names_its_device_and_the_compiled_one_is_left_as_it_was():
    source = with_token_shape(
        load_model(f"{Path(__file__).parent}/hf_factories.py:hf_llama"), batch=2, seq=16
    )
    compiled = compile_plan(check_text("mesh dp=1\n"), source)
    host = "device(type='cpu')"
    assert host in compiled.graph.code  # HF's positions and mask: arange on the capture's device
    program = place(build_rank_program(compiled, source.model, rank=0), "meta")
    assert host not in program.code and "device(type='meta')" in program.code
    assert all(p.device.type == "meta" for p in program.parameters())
    assert host in compiled.graph.code
    on_host = build_rank_program(compiled, source.model, rank=0)
    assert place(on_host, "cpu").code == compiled.graph.code  # on the host nothing is rewritten
