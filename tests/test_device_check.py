"""`python -m bench.device_check --dry-run`: lists what the device check runs, on a machine
without a GPU too (the check itself runs where there is one)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_the_dry_run_lists_every_part_with_its_budget_and_what_it_skips():
    done = subprocess.run(
        [sys.executable, "-m", "bench.device_check", "--dry-run"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith("meshplan device check: 4 parts, at most 480 s")
    listed = {line.split()[0] for line in lines[1:] if not line.strip().startswith("skipped:")}
    assert listed == {"gpu-tier", "llama-1b-step", "llama-8b-tp8-memory", "cpu-offload-step"}
    assert not any("skipped:" in line for line in lines)  # every part runs


def test_without_a_gpu_the_check_refuses_with_exit_2():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the check would run")
    done = subprocess.run(
        [sys.executable, "-m", "bench.device_check"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 2 and "needs a CUDA device" in done.stderr


def test_the_one_rank_memory_part_runs_a_meta_built_model_s_rank_alone_on_the_cpu():
    """The 8B part's own code, at a size the CPU runs: a tp=8 rank under the fake process group,
    its training state a rank's share of the model's (16 bytes per local parameter), beside
    `meshplan estimate`'s prediction for that rank."""
    import sys

    sys.path.insert(0, str(ROOT))
    from bench.device_check import compared, one_rank_8b

    numbers = compared(one_rank_8b(device="cpu", seq=32, model="llama_tiny"))
    assert numbers["state_gib"] * 2**30 >= 16 * numbers["parameters_on_rank"]
    assert numbers["peak_tensor_gib"] >= numbers["state_gib"]
    # `meshplan estimate`'s prediction for the same rank, beside it: the same training state
    assert numbers["estimate_state_gib"] == pytest.approx(numbers["state_gib"], rel=0.05)
    assert numbers["estimate_over_measured"] == numbers["estimate_gib"] / numbers["measured_gib"]
    assert numbers["measured_gib"] == numbers["peak_tensor_gib"]  # on a CPU: the tensors' peak


def tied_llama():
    """The 1B's layout (an embedding tied to the head) at a size the CPU compiles."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(config)


def test_the_offload_part_s_plan_holds_the_tied_embedding_and_head_on_the_host():
    """The offload part's plan, compiled for the 1B's layout at a CPU size: the one weight held
    on the host, the activations copied at the two boundaries."""
    sys.path.insert(0, str(ROOT))
    from bench.device_check import OFFLOAD
    from meshplan.compiler.capture import with_token_shape
    from meshplan.compiler.compile import compile_plan
    from meshplan.compiler.load import load_model
    from meshplan.compiler.lower import placed_names
    from meshplan.dsl.check import check_text

    source = with_token_shape(load_model(f"{__file__}:tied_llama"), batch=2, seq=16)
    compiled = compile_plan(check_text(OFFLOAD, "offload.plan"), source)
    assert placed_names(compiled.graph) == {"lm_head.weight": "cpu"}  # the embedding: one tied weight
    copies = compiled.ledger.copies()
    assert {r.op for r in copies.rows} == {"copy_to_host", "copy_to_device"}
    assert copies.total_bytes(phase="forward") > 0 and copies.total_bytes(phase="backward") > 0
