"""One rank's training session under `meshplan run` (and `meshplan verify`'s partitioned run).

    session = open_session(options, rank, world_size)   # inside an initialized process group
    summary = train_session(session)
    state = consolidated_state(session)                 # the unpartitioned model's state_dict

The session is put together from parts, one module each:

    program.py    the program a rank runs: the launcher's program.pt, a compile folder's, or
                  compiled by the rank itself; the plan features `run` cannot execute yet
    pipeline.py   a pipeline rank: its stages (`compiler.lower.rank_stages`) run by its schedule,
                  the gradients of weights tied across pipeline ranks summed
    sync.py       the gradient-sync engine the plan asks for (DP, ZeRO, their per-axes forms)
                  and the rank's axes
    hooks.py      each step's extra metrics and `--between-steps`
    training.py   the loop's settings, the program's inputs, the consolidated weights
    rank.py       `Session` and `open_session`, the composition of the above
"""

from .hooks import between_steps_hook
from .pipeline import pipeline_microbatches
from .program import check_supported, compiled_folder, load_program
from .rank import Session, open_session
from .sync import partial_grad_sync, rank_axes
from .training import call_inputs, consolidated_state, export_weights, train_config, train_session

__all__ = [
    "Session",
    "between_steps_hook",
    "call_inputs",
    "check_supported",
    "compiled_folder",
    "consolidated_state",
    "export_weights",
    "load_program",
    "open_session",
    "partial_grad_sync",
    "pipeline_microbatches",
    "rank_axes",
    "train_config",
    "train_session",
]
