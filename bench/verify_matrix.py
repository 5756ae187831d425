"""Every composition cell on the model families users bring, trained by `meshplan verify`.

    python bench/verify_matrix.py                 # every cell (about 15 minutes on 2 cores)
    python bench/verify_matrix.py gpt2 llama      # some families
    python bench/verify_matrix.py --cells tp2 tp4

Families (built in-process from small configs, random weights, no download): Hugging Face
Llama (GQA), Qwen2 (GQA, q/k/v biases), GPT-2 (Conv1D, fused c_attn, tied), Mixtral (experts
replicated until expert parallelism lands), BERT MLM (tied decoder bias), PyTorch's DTensor
test Transformer, and a Llama in plain PyTorch (`nn.RMSNorm`, complex RoPE, sum-reduced loss).

Cells: tp=2, tp=2 + sequence parallelism, tp=4, dp=2 x tp=2 + SP with ZeRO 1, 2 and 3, and
cp=2 x tp=2 + SP (ring attention, each rank's slice of the sequence cut again by the norms'
sequence shards); the plain-PyTorch Llama also with checkpointing and with bf16 compute.

MoE families (experts split over an expert axis): Hugging Face Mixtral, Qwen3-MoE, Qwen2-MoE
(a shared expert), OLMoE, DeepSeek-V3 (latent attention, a shared expert, biased group
routing), GPT-OSS (experts with biases, attention sinks), and the example MoE with its
experts stacked and kept as a list. Cells: ep=2; dp=2 x ep=2 with a capacity and ZeRO-3;
ep=2 x tp=2 with attention over tp (the tokens whole at the experts, split there); dp=2 x
tp=2 with the experts over `dp x tp`, a capacity, ZeRO-3 (and a shared expert over tp).

Families from other corners (issue 32): PyTorch's `nn.TransformerEncoder` (nn.MultiheadAttention,
its packed projection split by heads), a vision transformer fed images (timm's fused qkv
reshape), T5 (an encoder-decoder), a state-space-shaped mixer (an input projection chunked in
two), a GPT whose linears are matmuls, and an MoE in torchtitan's grouped-experts layout. Cells:
tp=2, tp=2 + SP where the sequence is the second dim, dp=2 ZeRO-3 with checkpointing, pp=2,
dp=2 x tp=2 in bf16, and ep=2 where there are experts.

Each cell trains 3 AdamW
steps beside the float64 model and the one-device yardstick (see cli/verify.py) and prints
the partitioned program's distance to float64 next to the yardstick's; a cell `check`
refuses prints the refusal. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TESTS = ROOT / "tests/compiler"  # the model factories
sys.path.insert(0, str(ROOT / "tests"))  # the plans

from plans import (  # noqa: E402
    BERT_RULES,
    BERT_SEQUENCE,
    DTENSOR_RULES,
    DTENSOR_SEQUENCE,
    GPT2_RULES,
    GPT2_SEQUENCE,
    MIXTRAL_RULES,
    TITAN_RULES,
    TITAN_SEQUENCE,
    llama_rules,
    llama_sequence,
    plan,
)

FAMILIES = {  # name: (factory, tensor rules, sequence rules, checkpointed modules)
    "llama": ("hf_factories.py:hf_llama", llama_rules("model."), llama_sequence("model."), "model.layers.*"),
    "qwen2": ("hf_factories.py:hf_qwen2", llama_rules("model."), llama_sequence("model."), "model.layers.*"),
    "gpt2": ("hf_factories.py:hf_gpt2", GPT2_RULES, GPT2_SEQUENCE, "transformer.h.*"),
    "mixtral": ("hf_factories.py:hf_mixtral", MIXTRAL_RULES, llama_sequence("model."), "model.layers.*"),
    "bert": ("hf_factories.py:hf_bert_mlm", BERT_RULES, BERT_SEQUENCE, "bert.encoder.layer.*"),
    "dtensor": ("factories.py:dtensor_transformer", DTENSOR_RULES, DTENSOR_SEQUENCE, "model.layers.*"),
    "plain_llama": ("factories.py:titan_llama", TITAN_RULES, TITAN_SEQUENCE, "layers.*"),
}

# name: (factory, module prefix, attention rules over tp ("" to keep attention whole), the
# shared expert's rules over tp)
MOE_FAMILIES = {
    "mixtral": ("hf_factories.py:hf_mixtral_aux", "model.", MIXTRAL_RULES, ""),
    "qwen3_moe": ("hf_factories.py:hf_qwen3_moe", "model.", MIXTRAL_RULES, ""),
    "qwen2_moe": (
        "hf_factories.py:hf_qwen2_moe",
        "model.",
        MIXTRAL_RULES,
        "    model.layers.*.mlp.shared_expert.{gate_proj,up_proj}: column over tp\n"
        "    model.layers.*.mlp.shared_expert.down_proj: row over tp\n",
    ),
    "olmoe": ("hf_factories.py:hf_olmoe", "model.", MIXTRAL_RULES, ""),
    "deepseek_v3": (
        "hf_factories.py:hf_deepseek_v3",
        "model.",
        "",
        "    model.layers.*.mlp.shared_experts.{gate_proj,up_proj}: column over tp\n"
        "    model.layers.*.mlp.shared_experts.down_proj: row over tp\n",
    ),
    "gpt_oss": ("hf_factories.py:hf_gpt_oss", "model.", MIXTRAL_RULES, ""),
    "moe_stacked": (
        "../../examples/models/moe.py:build",
        "",
        llama_rules(vocab=False).split("    layers.*.mlp")[0],
        "",
    ),
    "moe_list": (
        "../../examples/models/moe.py:build_listed",
        "",
        llama_rules(vocab=False).split("    layers.*.mlp")[0],
        "",
    ),
}

# Families from corners the decoder families above do not cover (issue 32): name -> (factory,
# tensor rules, sequence rules ("" for the ViT: 16 patches and a class token, 17 positions, which
# no tp=2 divides), the
# checkpointed modules, the experts module for an `experts over ep` rule ("" without experts)).
# What each cell splits is what its rules name: attention (or the mixer) and the MLP over tp.
_T5_ATTENTION = """
    {encoder,decoder}.block.*.layer.0.SelfAttention.{q,k,v}: column over tp
    {encoder,decoder}.block.*.layer.0.SelfAttention.o:       row over tp
    decoder.block.*.layer.1.EncDecAttention.{q,k,v}:         column over tp
    decoder.block.*.layer.1.EncDecAttention.o:               row over tp
    encoder.block.*.layer.1.DenseReluDense.wi:               column over tp
    encoder.block.*.layer.1.DenseReluDense.wo:               row over tp
    decoder.block.*.layer.2.DenseReluDense.wi:               column over tp
    decoder.block.*.layer.2.DenseReluDense.wo:               row over tp
"""
ANY_FAMILIES = {
    "encoder_lm (nn.TransformerEncoder)": (
        "plain_models.py:encoder_lm",
        "\n    encoder.layers.*.self_attn: column over tp\n    encoder.layers.*.self_attn.out_proj: row over tp\n"
        "    encoder.layers.*.linear1: column over tp\n    encoder.layers.*.linear2: row over tp\n",
        "    encoder.layers.*.{norm1,norm2}: sequence over tp\n",
        "encoder.layers.*",
        "",
    ),
    "vit (images)": (
        "vision_models.py:build",
        "\n    blocks.*.attn.qkv: column over tp\n    blocks.*.attn.proj: row over tp\n"
        "    blocks.*.mlp.fc1: column over tp\n    blocks.*.mlp.fc2: row over tp\n",
        "",
        "blocks.*",
        "",
    ),
    "t5 (encoder-decoder)": (
        "hf_factories.py:hf_t5",
        _T5_ATTENTION,
        "    {encoder,decoder}.block.*.layer.*.layer_norm: sequence over tp\n"
        "    {encoder,decoder}.final_layer_norm: sequence over tp\n",
        "{encoder,decoder}.block.*",
        "",
    ),
    "gated_mixer (state-space shape)": (
        "plain_models.py:gated_mixer",
        "\n    mixers.*.in_proj: column over tp\n    mixers.*.out_proj: row over tp\n",
        "    norms.*: sequence over tp\n",
        "mixers.*",
        "",
    ),
    "matmul_gpt (linears as matmuls)": (
        "plain_models.py:matmul_gpt",
        "\n    blocks.*.attn.{q,k,v}: column over tp\n    blocks.*.attn.proj: row over tp\n"
        "    blocks.*.fc1: column over tp\n    blocks.*.fc2: row over tp\n",
        "    blocks.*.{norm1,norm2}: sequence over tp\n",
        "blocks.*",
        "",
    ),
    "grouped_moe (torchtitan layout)": (
        "grouped_experts.py:build",
        "\n    layers.*.attention.{q,k,v}_proj: column over tp\n    layers.*.attention.o_proj: row over tp\n",
        "    layers.*.{attention,ffn}_norm: sequence over tp\n",
        "layers.*",
        "layers.*.moe.experts",
    ),
}

BF16 = "\nprecision {\n    compute = bf16\n}\n"
PIPELINE = "\npipeline over pp {\n    schedule = 1f1b\n    microbatches = 2\n}\n"


def zero(stage: int) -> str:
    return f"\ndata_parallel over dp {{\n    zero = {stage}\n}}\n"


def attention(tensor: str) -> str:
    """The attention module of a family's tensor rules: the parent of its first projection."""
    first = next(line for line in tensor.splitlines() if ":" in line)
    return first.split(":")[0].strip().rsplit(".", 1)[0]


def cells(family: str) -> dict[str, str]:
    """Cell name -> plan text."""
    _, tensor, sequence, checkpointed = FAMILIES[family]
    out = {
        "tp2": plan(tensor),
        "tp2+sp": plan(tensor + sequence),
        "tp4": plan(tensor, mesh="tp=4"),
        **{
            f"dp2xtp2+sp+zero{s}": plan(tensor + sequence, mesh="dp=2, tp=2", extra=zero(s))
            for s in (1, 2, 3)
        },
        # ring attention over cp, the norms' sequence shards cut again over tp
        "cp2xtp2+sp": plan(
            f"\n    {attention(tensor)}: context ring over cp{sequence}{tensor}", mesh="cp=2, tp=2"
        ),
        # HSDP: ZeRO-3 within dp, a copy of the state per node, the shards all-reduced over node
        "node2xdp2 hsdp3": plan(
            "\n",
            mesh="node=2, dp=2",
            extra="\ndata_parallel over node x dp {\n    zero = 3 over dp\n}\n",
        ),
    }
    if family == "plain_llama":
        composed = plan(
            tensor + sequence + f"    {checkpointed}: checkpoint\n", mesh="dp=2, tp=2", extra=zero(3)
        )
        out["dp2xtp2+sp+zero3+ckpt"] = composed
        out["tp2 bf16"] = out["tp2"] + BF16
        out["tp2+sp bf16"] = out["tp2+sp"] + BF16
        out["dp2xtp2+sp+zero3+ckpt bf16"] = composed + BF16
    return out


def any_cells(family: str) -> dict[str, str]:
    """Cell name -> plan text, for a family of `ANY_FAMILIES`: the issue's cells. A family with
    experts has them captured as one unit in every cell (`experts over ep`, an axis of one rank
    where the cell does not split them): the model's data-dependent loop cannot be one graph."""
    _, tensor, sequence, checkpointed, experts = ANY_FAMILIES[family]

    def cell(rules: str, mesh: str, extra: str = "", ep: int = 1) -> str:
        if experts:
            rules += f"    {experts}: experts over ep (top_k=2)\n"
            mesh = f"{mesh}, ep={ep}"
        return plan(rules, mesh=mesh, extra=extra)

    out = {"tp2": cell(tensor, "tp=2")}
    if sequence:
        out["tp2+sp"] = cell(tensor + sequence, "tp=2")
    out["dp2+zero3+ckpt"] = cell(f"\n    {checkpointed}: checkpoint\n", "dp=2", zero(3))
    out["pp2"] = cell("\n", "pp=2", PIPELINE)
    out["dp2xtp2 bf16"] = cell(tensor, "dp=2, tp=2", zero(1) + BF16)
    if experts:
        out["ep2"] = plan(f"\n    {experts}: experts over ep (top_k=2)\n", mesh="ep=2")
        out["ep2xtp2"] = cell(tensor, "tp=2", ep=2)
    return out


def moe_cells(family: str) -> dict[str, str]:
    """Cell name -> plan text, for an MoE family."""
    _, prefix, attention, shared = MOE_FAMILIES[family]
    experts = f"    {prefix}layers.*.mlp.experts: experts over"
    return {
        "ep2": plan(f"\n{experts} ep (top_k=2)\n", mesh="ep=2"),
        "dp2xep2+cap+zero3": plan(
            f"\n{experts} ep (top_k=2, capacity_factor=1.0)\n", mesh="dp=2, ep=2", extra=zero(3)
        ),
        "ep2xtp2": plan(f"{attention or chr(10)}{experts} ep (top_k=2)\n{shared}", mesh="ep=2, tp=2"),
        "dp2xtp2 dp x tp+cap+zero3": plan(
            f"{attention or chr(10)}{experts} dp x tp (top_k=2, capacity_factor=1.0)\n{shared}",
            mesh="dp=2, tp=2",
            extra=zero(3),
        ),
    }


def run_cell(family: str, factory: str, text: str, folder: Path) -> str:
    """One Markdown row's measurements (everything after the family and cell names)."""
    from meshplan.compiler.errors import CompileError
    from meshplan.dsl import PlanError
    from meshplan.verify import verify

    path = folder / f"{family.split()[0]}.plan"
    path.write_text(text)
    start = time.perf_counter()
    try:
        report = verify(str(path), f"{TESTS}/{factory}", steps=3)
    except (PlanError, CompileError) as error:
        first = str(error).strip().splitlines()
        return f"refused: {' / '.join(line.strip() for line in first[:2])} | | | | |"
    seconds = time.perf_counter() - start
    by_what = {m.what.split(":")[0]: m for m in report.measures}

    def pair(what: str) -> str:
        m = by_what[what]
        theirs = f"{m.yardstick:.2e}" if m.yardstick is not None else "—"
        return f"{m.partitioned:.2e} / {theirs}"

    verdict = "ok" if report.ok else "**FAILED**"
    if not report.float64:
        verdict += " (no float64: fixed bounds)"
    return (
        f"{verdict} | {pair('losses')} | {pair('gradient norms')} | {pair('weights (whole model)')} | "
        f"{pair('worst tensor')} | {seconds:.0f} s"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    every = [
        *FAMILIES,
        *(f for f in MOE_FAMILIES if f not in FAMILIES),
        *(f.split()[0] for f in ANY_FAMILIES),
    ]
    parser.add_argument("families", nargs="*", help=f"some of: {', '.join(every)} (default: all)")
    parser.add_argument("--cells", nargs="*", help="only these cells (e.g. tp2 tp4)")
    args = parser.parse_args()
    unknown = set(args.families) - set(every)
    if unknown:
        parser.error(f"unknown families {sorted(unknown)}; choose from {', '.join(every)}")
    print(
        "| family | cell | verdict | losses | gradient norms | weights | worst tensor | time |\n"
        "|---|---|---|---|---|---|---|---|"
    )
    print("| | | | partitioned / yardstick: relative distance to float64 after 3 AdamW steps | | | | |")
    failed = 0
    with tempfile.TemporaryDirectory() as tmp:
        chosen = args.families or every
        jobs = [(f, FAMILIES[f][0], c, t) for f in chosen if f in FAMILIES for c, t in cells(f).items()]
        jobs += [
            (f, MOE_FAMILIES[f][0], c, t)
            for f in chosen
            if f in MOE_FAMILIES
            for c, t in moe_cells(f).items()
        ]
        jobs += [
            (name, ANY_FAMILIES[name][0], c, t)
            for name in ANY_FAMILIES
            if name.split()[0] in chosen
            for c, t in any_cells(name).items()
        ]
        for family, factory, cell, text in jobs:
            if args.cells and cell not in args.cells:
                continue
            row = run_cell(family, factory, text, Path(tmp))
            failed += "FAILED" in row
            print(f"| {family} | {cell} | {row} |", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
