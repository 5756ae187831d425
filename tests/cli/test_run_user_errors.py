"""User mistakes with the data and the model's limits: each is one located error and exit 2 from
the command (never exit 1, "a bug in meshplan", a traceback, or the same message once per rank).

The command's own `main` runs in this process: the launcher's checks are the same code,
without a Python and torch started per case. A mistake that only a worker can see goes
through real torchrun and worker processes (tests/runs.py: `meshplan_command`)."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace

import pytest
from runs import meshplan_command

from meshplan.main import main

ROOT = Path(__file__).resolve().parents[2]
TINY_DP = str(ROOT / "examples" / "tiny_dp.plan")  # dp=2: a mistake that reached torchrun would say it twice
SHAPES = ("--steps", "2", "--batch", "2", "--seq", "16", "--out", "run")  # small, into a fresh run folder

FACTORY = """\
import torch

def make_batches(*, batch, seq, seed, dp_rank, dp_size, accumulation):
    def get(step, micro_step):
        {body}
    return get
"""


@pytest.fixture(autouse=True)
def in_tmp_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Each case in its own folder, as the command would run there: no color, no debug re-raise;
    the user's files it imported (data.py, a model file) are forgotten afterwards."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.delenv("MESHPLAN_DEBUG", raising=False)
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        file = getattr(sys.modules[name], "__file__", None)
        if file is not None and Path(file).resolve().is_relative_to(tmp_path.resolve()):
            del sys.modules[name]


def meshplan(*argv: str, capsys: pytest.CaptureFixture[str]) -> SimpleNamespace:
    """`meshplan *argv` in this process (in the test's folder): its exit status and output."""
    status = main(list(argv))
    out, err = capsys.readouterr()
    return SimpleNamespace(returncode=status, stdout=out, stderr=err)


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> SimpleNamespace:
    """`meshplan run` on the tiny plan with small shapes, into a fresh run folder."""
    return meshplan("run", TINY_DP, *SHAPES, *argv, capsys=capsys)


def one_error(done: SimpleNamespace, tmp_path: Path) -> str:
    """The one message of a user mistake: exit 2, no traceback, said once, before any worker."""
    assert done.returncode == 2, done.stdout + done.stderr
    err = done.stderr
    assert "Traceback" not in err and "bug in meshplan" not in err, err
    assert err.count("meshplan: error:") == 1, err
    # found before the plan was compiled (`program.pt`), so before torchrun started
    assert not (tmp_path / "run" / "program.pt").exists() and not done.stdout, done.stdout
    return err


def write(folder: Path, name: str, text: str) -> str:
    (folder / name).write_text(text)
    return name


# ---------------------------------------------------------------------------- --data


@pytest.mark.parametrize(
    ("source", "message"),
    [
        (
            "def make_batches(*, batch, seq, seed, dp_rank, dp_size, accumulation):\n"
            "    raise RuntimeError('no shards in /data/missing')\n",
            "meshplan: error: --data data.py:make_batches raised RuntimeError: no shards in /data/missing "
            "(at data.py:2) (hint: it is called as make_batches(*, batch, seq, seed, dp_rank, dp_size, "
            "accumulation))",
        ),
        (
            "def make_batches(batch, seq):\n    pass\n",
            "meshplan: error: --data data.py:make_batches raised TypeError: make_batches() got an "
            "unexpected keyword argument 'seed'",
        ),
        (
            FACTORY.format(body="raise KeyError('shard 7')"),
            "meshplan: error: --data data.py:make_batches: the batch of step 0, micro-step 0 raised "
            "KeyError: 'shard 7' (at data.py:5)",
        ),
        (
            "import no_such_package_meshplan\n",
            "meshplan: error: running 'data.py' raised ModuleNotFoundError: No module named "
            "'no_such_package_meshplan' (at data.py:1) (hint: run `python data.py`)",
        ),
    ],
    ids=["factory_raises", "factory_signature", "batch_raises", "file_raises"],
)
def test_a_data_factory_that_raises_is_one_located_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], source: str, message: str
) -> None:
    write(tmp_path, "data.py", source)
    err = one_error(run(capsys, "--data", "data.py:make_batches"), tmp_path)
    assert message in err


def test_a_data_factory_file_that_does_not_exist_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    err = one_error(run(capsys, "--data", "missing.py:make_batches"), tmp_path)
    assert "data factory file 'missing.py' does not exist" in err


# ---------------------------------------------------------------------------- the model's limits


def test_token_ids_beyond_the_vocabulary_are_one_error_naming_the_batch(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, "data.py", FACTORY.format(body="return torch.full((2, 16), 300), torch.full((2, 16), 3)"))
    err = one_error(run(capsys, "--data", "data.py:make_batches"), tmp_path)
    assert err.strip() == (
        "meshplan: error: --data data.py:make_batches: step 0, micro-step 0 has input id 300, outside "
        "the model's vocabulary of 256 token ids (0..255) (hint: map the ids below 256, or build the "
        "model with vocab_size >= 301)"
    )


def test_a_vocabulary_smaller_than_the_corpus_bytes_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(
        tmp_path,
        "small.py",
        "from meshplan.examples.models import llama\n\ndef build():\n    return llama.build(vocab_size=100)\n",
    )
    err = one_error(run(capsys, "--model", "small.py:build"), tmp_path)
    assert "corpus.txt' is byte-level and has byte values up to 126, but the model embeds only 100" in err
    assert "(hint: build the model with vocab_size >= 127" in err


def test_a_sequence_longer_than_learned_positions_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # GPT's position table is an embedding: export does not bounds-check it, training would
    write(
        tmp_path,
        "short.py",
        "from meshplan.examples.models import gpt\n\n"
        "def build():\n    return gpt.build(max_position_embeddings=32)\n",
    )
    err = one_error(run(capsys, "--model", "short.py:build", "--seq", "64"), tmp_path)
    assert err.strip() == (
        "meshplan: error: --seq 64 is longer than 'short.py:build' allows: its "
        "config.max_position_embeddings is 32\n"
        "hint: pass --seq 32 or less, or build the model with max_position_embeddings >= 64"
    )


def test_a_sequence_longer_than_rope_tables_is_said_before_capture(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # the tiny Llama's rotary tables have 128 rows: torch.export failed on a broadcast, with pages of log
    err = one_error(run(capsys, "--seq", "256"), tmp_path)
    assert "--seq 256 is longer than 'meshplan.examples.models.llama:build' allows" in err
    assert "torch.export" not in err and len(err.strip().splitlines()) == 2


@pytest.mark.slow
def test_an_id_beyond_the_vocabulary_in_a_later_batch_stops_the_workers_with_one_error(
    tmp_path: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    # the launcher sees a good first batch; rank 1's batch of step 1 is checked in the worker,
    # under real torchrun (`meshplan_command`: the launcher in this process, torchrun and the
    # workers in theirs)
    body = "return (torch.full((2, 16), 300 if step == 1 and dp_rank == 1 else 5),) * 2"
    write(tmp_path, "data.py", FACTORY.format(body=body))
    done = meshplan_command(capfd, "run", TINY_DP, *SHAPES, "--data", "data.py:make_batches")
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip() == (
        "meshplan: error: --data data.py:make_batches: step 1, micro-step 0 has input id 300, outside "
        "the model's vocabulary of 256 token ids (0..255) (hint: map the ids below 256, or build the "
        "model with vocab_size >= 301)"
    )


def test_a_between_steps_function_that_is_not_there_is_one_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    write(tmp_path, "update.py", "def update_bias(model):\n    pass\n")
    err = one_error(run(capsys, "--between-steps", "update.py:update"), tmp_path)
    assert (
        "meshplan: error: --between-steps update.py:update: 'update.py' defines no function 'update'\n"
        "hint: did you mean 'update_bias'? functions defined there: update_bias"
    ) in err


DISK_PLAN = "mesh dp=2\ndata_parallel over dp {\n    zero = 1\n    offload = optimizer:disk\n}\n"


def test_an_offload_dir_that_cannot_be_written_is_one_error(capsys: pytest.CaptureFixture[str]) -> None:
    Path("disk.plan").write_text(DISK_PLAN)
    Path("a-file").write_text("")
    r = meshplan("run", "disk.plan", *SHAPES, "--offload-dir", "a-file/offload", capsys=capsys)
    assert r.returncode == 2
    assert r.stderr == (
        "meshplan: error: `offload = optimizer:disk` cannot write its files in a-file/offload: "
        "Not a directory (hint: pass --offload-dir with a writable folder)\n"
    )


def test_a_disk_too_small_for_the_offloaded_state_is_one_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    Path("disk.plan").write_text(DISK_PLAN)
    monkeypatch.setattr(
        shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(2**30, 2**30 - 2**20, 2**20)
    )
    r = meshplan("run", "disk.plan", *SHAPES, capsys=capsys)
    assert r.returncode == 2
    assert r.stderr.startswith("meshplan: error: --offload-dir run/offload has 1 MiB free, but ")
    assert r.stderr.endswith("(hint: free space, or pass --offload-dir on a larger disk)\n")
    assert r.stderr.count("\n") == 1
    assert not Path("run/program.pt").exists()  # refused before the compile and the workers
