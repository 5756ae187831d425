"""The models users bring, trained under the production layout: dp=2 x tp=2 with sequence
parallelism, ZeRO-3 and activation checkpointing, on four gloo processes through `meshplan
run`'s own worker setup, against the unpartitioned model trained on the whole global batch in
the same process.

Families (small configs, random weights, no download): Hugging Face GPT-2 (Conv1D, fused
c_attn, tied embeddings), Qwen2 (GQA, q/k/v biases), Llama, and a torchtitan-style Llama in
plain PyTorch (nn.RMSNorm, complex RoPE, sum-reduced loss divided by the token count).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from meshplan.compiler.compile import local_shard
from meshplan.main import build_parser
from meshplan.run import _prepare, _train, call_inputs, train_config
from meshplan.runtime.data import TextBatches, default_corpus, read_bytes
from meshplan.runtime.launch import spawn
from meshplan.runtime.train import lr_at, make_optimizer

pytestmark = pytest.mark.slow

COMPILER_TESTS = Path(__file__).resolve().parents[1] / "compiler"
HF_LAYOUT = """
    {prefix}layers.*.self_attn.{{q,k,v}}_proj: column over tp
    {prefix}layers.*.self_attn.o_proj:       row over tp
    {prefix}layers.*.mlp.{{gate,up}}_proj:     column over tp
    {prefix}layers.*.mlp.down_proj:          row over tp
    {prefix}embed_tokens:                    vocab over tp
    lm_head:                                 vocab over tp
    {prefix}layers.*.{{input,post_attention}}_layernorm: sequence over tp
    {prefix}norm:                            sequence over tp
    {prefix}layers.*:                        checkpoint
"""
FAMILIES = {  # name: (factory, modules block)
    "gpt2": (
        "hf_factories.py:hf_gpt2",
        """
    transformer.h.*.attn.c_attn: column over tp
    transformer.h.*.attn.c_proj: row over tp
    transformer.h.*.mlp.c_fc:    column over tp
    transformer.h.*.mlp.c_proj:  row over tp
    transformer.wte:             vocab over tp
    lm_head:                     vocab over tp
    transformer.h.*.{ln_1,ln_2}: sequence over tp
    transformer.ln_f:            sequence over tp
    transformer.h.*:             checkpoint
""",
    ),
    "llama": ("hf_factories.py:hf_llama", HF_LAYOUT.format(prefix="model.")),
    "qwen2": ("hf_factories.py:hf_qwen2", HF_LAYOUT.format(prefix="model.")),
    "titan_llama": (
        "factories.py:titan_llama",
        """
    layers.*.attention.{wq,wk,wv}: column over tp
    layers.*.attention.wo:         row over tp
    layers.*.feed_forward.{w1,w3}: column over tp
    layers.*.feed_forward.w2:      row over tp
    tok_embeddings:                vocab over tp
    layers.*.{attention_norm,ffn_norm}: sequence over tp
    norm:                          sequence over tp
    layers.*:                      checkpoint
""",
    ),
}
STEPS, MICRO_BATCH, SEQ, CLIP, DP = 3, 2, 32, 0.5, 2
# float32 after three AdamW steps, gradients reduced in another order: see test_composition.py
TOLERANCE = 400 * torch.finfo(torch.float32).eps


def plan_text(modules: str) -> str:
    return f"mesh dp={DP}, tp=2\n\nmodules {{{modules}}}\n\ndata_parallel over dp {{\n    zero = 3\n}}\n"


def reference_losses(source, cfg) -> list[float]:
    """The unpartitioned model, trained as `meshplan run` trains, on the whole global batch."""
    model = source.model
    optimizer = make_optimizer(model, cfg)
    batches = TextBatches(read_bytes(default_corpus()), batch=DP * MICRO_BATCH, seq=SEQ, seed=0)
    losses = []
    for step in range(cfg.steps):
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, cfg)
        args, kwargs = call_inputs(source.args, source.kwargs, *batches(step))
        out = model(*args, **kwargs)
        outs = (
            [out] if isinstance(out, torch.Tensor) else list(out.values() if isinstance(out, dict) else out)
        )
        (loss,) = [o for o in outs if isinstance(o, torch.Tensor) and o.ndim == 0 and o.is_floating_point()]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss.detach()))
    return losses


def train_family(rank: int, world_size: int, tmp: str, family: str) -> dict:
    from meshplan.compiler.capture import load_model, with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.dsl import load_plan

    factory, modules = FAMILIES[family]
    spec = f"{COMPILER_TESTS}/{factory}"
    plan_path = Path(tmp) / f"{family}.plan"
    if rank == 0:
        plan_path.write_text(plan_text(modules))
    torch.distributed.barrier()
    flags = ["--steps", str(STEPS), "--warmup", "1", "--grad-clip", str(CLIP)]
    args = build_parser().parse_args(
        [
            "run",
            str(plan_path),
            "--model",
            spec,
            "--batch",
            str(MICRO_BATCH),
            "--seq",
            str(SEQ),
            "--out",
            str(Path(tmp) / family),
            *flags,
        ]
    )
    prepared = _prepare(args, rank, world_size)
    summary = _train(args, prepared, show_progress=False)
    source = with_token_shape(load_model(spec), batch=DP * MICRO_BATCH, seq=SEQ)
    ref_losses = reference_losses(source, train_config(args, prepared))

    compiled = compile_plan(
        load_plan(plan_path, world_size=world_size),
        with_token_shape(load_model(spec), batch=MICRO_BATCH, seq=SEQ),
    )
    coords = compiled.layout.coords(rank)
    full = dict(source.model.named_parameters(remove_duplicate=False))
    worst, worst_name = 0.0, ""
    with prepared.dp.gathered():
        for name, local in prepared.program.named_parameters():
            if name.endswith(("k_proj.bias", "c_attn.bias")):
                continue  # softmax cancels key biases: their gradient is rounding, which Adam scales up
            expected = local_shard(
                full[name].detach(), compiled.param_placements.get(name, {}), coords, compiled.layout
            )
            diff = float((local.detach() - expected).norm() / expected.norm())
            if diff > worst:
                worst, worst_name = diff, name
    return {"losses": summary.losses, "ref_losses": ref_losses, "worst": worst, "worst_name": worst_name}


def train_all(rank: int, world_size: int, tmp: str) -> dict[str, dict]:
    return {family: train_family(rank, world_size, tmp, family) for family in FAMILIES}


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> list[dict[str, dict]]:
    return spawn(train_all, 4, (str(tmp_path_factory.mktemp("families")),), timeout_s=600)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sp_zero3_checkpointing_matches_one_device(results, family: str) -> None:
    for rank, by_family in enumerate(results):
        r = by_family[family]
        for loss, ref in zip(r["losses"], r["ref_losses"], strict=True):
            assert abs(loss - ref) / ref <= TOLERANCE, (rank, r)
        assert r["worst"] <= TOLERANCE, (rank, r["worst_name"], r["worst"])
