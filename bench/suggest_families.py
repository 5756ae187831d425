"""`meshplan suggest` writes the plan, `meshplan verify` holds it to float64: Hugging Face families
beyond `verify_matrix.py`'s, each built from a small config with random weights (no download).

    python bench/suggest_families.py                      # every family, tp over 4 ranks
    python bench/suggest_families.py falcon bloom --axes pp,tp
    python bench/suggest_families.py --world-size 2 olmo2

Each family: `meshplan suggest --model bench/suggest_families.py:NAME --world-size N --axes A`
(batch 4 x 32, CPU pricing, 64 MiB a rank), then `meshplan verify` of the plan it wrote, as a
user runs them. Prints one line per family: the mesh written, and verify's verdict, or why
suggest wrote nothing (every layout refused: the compiler's reason). Takes about 20 s a family.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

HERE = Path(__file__).resolve()
COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 128,
}
SEQ2SEQ = {
    "vocab_size": 256,
    "d_model": 64,
    "encoder_layers": 2,
    "decoder_layers": 2,
    "encoder_attention_heads": 4,
    "decoder_attention_heads": 4,
    "encoder_ffn_dim": 128,
    "decoder_ffn_dim": 128,
    "max_position_embeddings": 128,
    "dropout": 0.0,
    "attention_dropout": 0.0,
    "activation_dropout": 0.0,
    "pad_token_id": 1,
    "bos_token_id": 0,
    "eos_token_id": 2,
}
IDS = {"pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2}  # inside the small vocabulary

# name: (config class, model class, config arguments)
FAMILIES: dict[str, tuple[str, str, dict]] = {
    "gemma2": (
        "Gemma2Config",
        "Gemma2ForCausalLM",
        {**COMMON, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 16},
    ),
    "gemma3": (
        "Gemma3TextConfig",
        "Gemma3ForCausalLM",
        {**COMMON, "num_key_value_heads": 2, "head_dim": 16, "sliding_window": 16},
    ),
    "mistral": (
        "MistralConfig",
        "MistralForCausalLM",
        {**COMMON, "num_key_value_heads": 2, "sliding_window": 16},
    ),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {**COMMON, "num_key_value_heads": 2, "head_dim": 16}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {**COMMON, "num_key_value_heads": 2}),
    "stablelm": ("StableLmConfig", "StableLmForCausalLM", {**COMMON, "num_key_value_heads": 2}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {**COMMON, "num_key_value_heads": 2, **IDS}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {**COMMON, "num_key_value_heads": 2, **IDS}),
    "smollm3": ("SmolLM3Config", "SmolLM3ForCausalLM", {**COMMON, "num_key_value_heads": 2, **IDS}),
    "phi": ("PhiConfig", "PhiForCausalLM", COMMON),
    "gptj": (
        "GPTJConfig",
        "GPTJForCausalLM",
        {
            "vocab_size": 256,
            "n_embd": 64,
            "n_layer": 2,
            "n_head": 4,
            "n_positions": 128,
            "rotary_dim": 8,
            **IDS,
        },
    ),
    "opt": (
        "OPTConfig",
        "OPTForCausalLM",
        {
            "vocab_size": 256,
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 128,
            "word_embed_proj_dim": 64,
            "dropout": 0.0,
            "attention_dropout": 0.0,
            "activation_dropout": 0.0,
        },
    ),
    "falcon": (
        "FalconConfig",
        "FalconForCausalLM",
        {
            "vocab_size": 256,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "num_kv_heads": 2,
            "new_decoder_architecture": True,
        },
    ),
    "bloom": (
        "BloomConfig",
        "BloomForCausalLM",
        {"vocab_size": 256, "hidden_size": 64, "n_layer": 2, "n_head": 4},
    ),
    "bart": ("BartConfig", "BartForConditionalGeneration", {**SEQ2SEQ, "decoder_start_token_id": 2}),
    "mbart": ("MBartConfig", "MBartForConditionalGeneration", SEQ2SEQ),
    "llama4": (
        "Llama4TextConfig",
        "Llama4ForCausalLM",
        {
            **COMMON,
            "intermediate_size_mlp": 128,
            "num_key_value_heads": 2,
            "head_dim": 16,
            "num_local_experts": 4,
            "num_experts_per_tok": 1,
            **IDS,
        },
    ),
    "mamba": (
        "MambaConfig",
        "MambaForCausalLM",
        {
            "vocab_size": 256,
            "hidden_size": 64,
            "num_hidden_layers": 2,
            "state_size": 8,
            "intermediate_size": 128,
            **IDS,
        },
    ),
}


def build(name: str) -> torch.nn.Module:
    import transformers

    config_class, model_class, args = FAMILIES[name]
    config = getattr(transformers, config_class)(**args)
    torch.manual_seed(0)
    return getattr(transformers, model_class)(config)


def __getattr__(name: str):
    """`--model bench/suggest_families.py:NAME` finds each family's factory here."""
    if name in FAMILIES:
        return lambda: build(name)
    raise AttributeError(name)


def meshplan(*argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "meshplan", *argv], capture_output=True, text=True)


def one(name: str, world: int, axes: str, folder: Path) -> str:
    plan = folder / f"{name}.plan"
    model = f"{HERE}:{name}"
    found = meshplan(
        "suggest", "--model", model, "--world-size", str(world), "--axes", axes, "--batch", "4",
        "--seq", "32", "--hardware", "cpu", "--memory", "64MiB", "-o", str(plan),
    )  # fmt: skip
    if found.returncode != 0:
        lines = (found.stdout + found.stderr).splitlines()  # the report (stdout under -o), the error
        why = [line for line in lines if line.startswith("the compiler refused ")]
        why = why or [line for line in lines if line.startswith("meshplan: error:")] or lines[-1:]
        return f"{name:10s} suggest wrote nothing (exit {found.returncode}): {why[0]}"
    mesh = next(line for line in plan.read_text().splitlines() if line.startswith("mesh "))
    checked = meshplan("verify", str(plan), "--model", model, "--steps", "2")
    verdict = (checked.stdout.strip().splitlines() or [checked.stderr.strip()])[-1]
    return f"{name:10s} {mesh:22s} verify exit {checked.returncode}: {verdict}"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("families", nargs="*", default=list(FAMILIES))
    ap.add_argument("--world-size", type=int, default=4)
    ap.add_argument("--axes", default="tp")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.families:
            print(one(name, args.world_size, args.axes, Path(tmp)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
