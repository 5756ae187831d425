"""`compress` end to end: `explain` shows the compressed bytes, `verify` holds a compressed plan
to the convergence of the same plan uncompressed (and says so), on plain data parallelism, on
tensor x data parallelism (the same engine, over the dp groups of each tp shard), and under
ZeRO-1 (PowerSGD) and ZeRO-2 (bf16, a bf16 reduce-scatter), and HSDP (bf16 across the copies too)."""

from pathlib import Path

import pytest
from gloo_pool import shared_processes

from meshplan.compiler.compile import compile_plan
from meshplan.compiler.load import load_model
from meshplan.compiler.print_explain import explain
from meshplan.dsl import check_text
from meshplan.verify import render, verify

ROOT = Path(__file__).resolve().parents[2]
LLAMA = f"{ROOT}/examples/models/llama.py:build"
DP = "mesh dp=2\n\ndata_parallel over dp {{\n    compress = {compress}\n}}\n"
ZERO = "mesh dp=2\n\ndata_parallel over dp {{\n    zero = %d\n    compress = {compress}\n}}\n"
# HSDP: the shards' all-reduce across the copies in bf16 too, with its own error feedback
HSDP = "mesh node=2, dp=2\n\ndata_parallel over node x dp {{\n    zero = 2 over dp\n    compress = {compress}\n}}\n"
TP_DP = """mesh dp=2, tp=2

modules {{
    layers.*.self_attn.{{q,k,v}}_proj: column over tp
    layers.*.self_attn.o_proj:       row over tp
    layers.*.mlp.{{gate,up}}_proj:     column over tp
    layers.*.mlp.down_proj:          row over tp
}}

data_parallel over dp {{
    compress = {compress}
}}
"""


@pytest.fixture(scope="module", autouse=True)
def processes():
    with shared_processes():
        yield


def write(tmp_path: Path, text: str) -> str:
    path = tmp_path / "compress.plan"
    path.write_text(text)
    return str(path)


@pytest.mark.parametrize(
    ("template", "compress"),
    [
        (DP, "bf16"),
        (TP_DP, "powersgd(rank=2)"),
        (ZERO % 1, "powersgd(rank=2)"),
        (ZERO % 2, "bf16"),
        (HSDP, "bf16"),
    ],
    ids=["dp-bf16", "tp-x-dp-powersgd", "zero1-powersgd", "zero2-bf16", "hsdp-zero2-bf16"],
)
def test_verify_holds_compression_to_the_uncompressed_run(tmp_path, template, compress):
    report = verify(write(tmp_path, template.format(compress=compress)), LLAMA, steps=3)
    text = render(report)
    assert report.ok, text
    assert report.lossy == compress
    assert "yardstick  convergence" in text and "not to float64 parity" in text
    assert len(report.partitioned.losses) == 3
    assert report.partitioned.losses != report.reference.losses  # the compression acted


def test_explain_shows_the_compressed_bytes():
    def dp_bytes(text: str) -> tuple[int, str]:
        compiled = compile_plan(check_text(text, "c.plan"), load_model(LLAMA), world_size=2)
        rows = [r for r in compiled.ledger.rows if r.kind == "dp_bucket"]
        return sum(r.bytes * r.count for r in rows), explain(compiled)

    exact, _ = dp_bytes("mesh dp=2\n\ndata_parallel over dp {\n}\n")
    half, bf16 = dp_bytes(DP.format(compress="bf16"))
    low, powersgd = dp_bytes(DP.format(compress="powersgd(rank=1, warmup=5)"))
    assert half * 2 == exact
    assert low < exact / 10
    assert f"{half / 1e6:.3f} MB per step instead of {exact / 1e6:.3f} MB" in bf16
    assert "gradients compressed (powersgd(rank=1, warmup=5), line 4)" in powersgd
    assert "the first 5 steps uncompressed" in powersgd


def test_explain_shows_what_zero_sends_compressed():
    """Under ZeRO-2 bf16 is a reduce-scatter of half the bytes, PowerSGD all-reduces its factors;
    explain says what error feedback costs the memory ZeRO-2 saves."""

    def reductions(text: str) -> tuple[dict[str, int], str]:
        compiled = compile_plan(check_text(text, "c.plan"), load_model(LLAMA), world_size=2)
        rows = [r for r in compiled.ledger.rows if r.kind == "zero_bucket" and r.phase == "backward"]
        ops: dict[str, int] = {}
        for r in rows:
            ops[r.op] = ops.get(r.op, 0) + r.bytes * r.count
        return ops, explain(compiled)

    exact, _ = reductions("mesh dp=2\n\ndata_parallel over dp {\n    zero = 2\n}\n")
    bf16, bf16_text = reductions((ZERO % 2).format(compress="bf16"))
    low, powersgd_text = reductions((ZERO % 2).format(compress="powersgd(rank=1)"))
    assert bf16 == {"reduce_scatter": exact["reduce_scatter"] // 2}
    assert set(low) == {"all_reduce"} and low["all_reduce"] < exact["reduce_scatter"] / 10
    assert "under ZeRO-2: reduce-scattered in bf16" in bf16_text
    assert "P and Q all-reduced (no reduce-scatter form)" in powersgd_text
    assert "error feedback keeps a residual of every gradient" in powersgd_text


def test_hsdp_sends_the_copies_all_reduce_in_bf16_too():
    """HSDP under `compress = bf16`: the reduce-scatter within dp in bf16 (half the bytes), then
    the shards' all-reduce over node in bf16 (half of a shard's bytes), each with its residual."""
    layout = "mesh node=2, dp=2\n\ndata_parallel over node x dp {\n    zero = 2 over dp\n%s}\n"
    sent = {}
    for name, extra in (("exact", ""), ("bf16", "    compress = bf16\n")):
        compiled = compile_plan(check_text(layout % extra, "c.plan"), load_model(LLAMA), world_size=4)
        rows = [r for r in compiled.ledger.rows if r.kind == "zero_bucket" and r.phase == "backward"]
        sent[name] = {
            (r.op, r.axis): sum(x.bytes * x.count for x in rows if (x.op, x.axis) == (r.op, r.axis))
            for r in rows
        }
    exact, bf16 = sent["exact"], sent["bf16"]
    assert bf16 == {key: nbytes // 2 for key, nbytes in exact.items()}
    assert exact[("all_reduce", "node")] == exact[("reduce_scatter", "dp")] // 2  # a shard of two
    assert "all-reduced over node in bf16 too" in explain(compiled)
