"""The watchdog's report, without processes: the one line a rank prints when a collective fails,
and how it reads the other ranks' answers from a store (an in-memory `HashStore` here)."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from torch import nn

from meshplan.runtime import watchdog
from meshplan.runtime.collectives import AllReduce, label_collectives
from meshplan.runtime.watchdog import Collective, Stall

TP_3 = Collective("all_reduce", "tp", "all_reduce_tp_3")


@pytest.mark.parametrize(
    ("stall", "line"),
    [
        (
            Stall(rank=0, step=4, collective=TP_3, waited_s=10.2, missing={1: 4}),
            "rank 0 waited 10 s in all_reduce over tp (all_reduce_tp_3, step 4); rank 1 did not join it (stuck or dead)",
        ),
        (
            Stall(rank=2, step=4, collective=TP_3, waited_s=10.0, missing={3: 3, 1: 3, 5: 4}),
            "rank 2 waited 10 s in all_reduce over tp (all_reduce_tp_3, step 4); ranks 1 and 3 did not reach "
            "step 4 (stuck or dead); rank 5 did not join it (stuck or dead)",
        ),
        (
            Stall(
                rank=0,
                step=4,
                collective=Collective("all_reduce", "dp", "bucket 1 of 2, 4.2 MB"),
                waited_s=0.04,
                cause="Read error [127.0.0.1]:6567: Connection reset by peer",
                missing={1: 4},
            ),
            "rank 0 failed in all_reduce over dp (bucket 1 of 2, 4.2 MB, step 4): Read error "
            "[127.0.0.1]:6567: Connection reset by peer; rank 1 did not join it (stuck or dead)",
        ),
        (
            Stall(rank=2, step=7, collective=TP_3, waited_s=300, elsewhere={1: 7}, waiting=(0, 3)),
            "rank 2 waited 300 s in all_reduce over tp (all_reduce_tp_3, step 7); its group waits too; "
            "rank 1 did not join any collective (stuck or dead)",
        ),
        (
            Stall(rank=1, step=2, collective=TP_3, waited_s=5, waiting=(0,)),
            "rank 1 waited 5 s in all_reduce over tp (all_reduce_tp_3, step 2); every other rank failed in "
            "a collective too (do all ranks issue the same collectives?)",
        ),
        (
            Stall(rank=0, step=3, collective=None, unasked="the store did not answer within 5 s"),
            "rank 0 timed out in a collective (step 3); could not ask the other ranks which one is "
            "missing (the store did not answer within 5 s)",
        ),
        (
            Stall(rank=0, step=9, collective=Collective("checkpoint save", ""), waited_s=61, missing={1: 9}),
            "rank 0 waited 61 s in checkpoint save (step 9); rank 1 did not join it (stuck or dead)",
        ),
    ],
)
def test_the_report_is_one_line_naming_the_collective_and_the_missing_ranks(stall: Stall, line: str) -> None:
    assert str(stall) == line


def test_many_missing_ranks_are_counted_not_listed() -> None:
    stall = Stall(rank=0, step=1, collective=TP_3, waited_s=5, missing=dict.fromkeys(range(1, 21), 1))
    assert str(stall).endswith("ranks 1, 2, 3, 4, 5, 6 and 14 more did not join it (stuck or dead)")


def test_gloo_errors_are_shortened_to_their_reason() -> None:
    gloo = RuntimeError(
        "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:6567: "
        "Connection reset by peer. This is typically caused by a remote worker hanging or bugs in "
        "the application. Check the logs of the remote worker before reporting an error. GLHF!"
    )
    assert watchdog.reason(gloo) == "Read error [127.0.0.1]:6567: Connection reset by peer"
    timeout = RuntimeError("[../gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 5000ms for recv")
    assert watchdog.is_timeout(timeout) and not watchdog.is_timeout(gloo)
    assert watchdog.is_timeout(RuntimeError("Application timeout caused pair closure"))  # gloo, after one


def test_the_ranks_that_never_said_they_wait_are_missing() -> None:
    store = dist.HashStore()
    store.append(f"{watchdog.KEY}/waiting", "3 ")  # rank 3 timed out too
    store.set(f"{watchdog.KEY}/step/1", "4")  # rank 1 began step 4, rank 2 never began one
    missing, elsewhere, waiting = watchdog._ask(store, rank=0, group=[0, 1, 2, 3], world=4, grace_s=0)
    assert missing == {1: 4, 2: 0} and elsewhere == {} and waiting == (3,)
    # rank 2's view, in group {2, 0}: its group waits, the ranks outside it that do not are named
    missing, elsewhere, waiting = watchdog._ask(store, rank=2, group=[0, 2], world=4, grace_s=0)
    assert missing == {} and elsewhere == {1: 4} and waiting == (0, 3)


def test_a_collective_notes_its_node_and_a_rank_without_a_store_still_reports_it() -> None:
    program = nn.Module()
    program.all_reduce_tp_3 = AllReduce(None, "tp")
    label_collectives(program)
    watchdog.progress(4)
    program.all_reduce_tp_3.note("all_reduce", "backward")
    stall = watchdog.diagnose(RuntimeError("Timed out waiting 5000ms for recv operation to complete"))
    assert " in all_reduce over tp (all_reduce_tp_3 backward, step 4); " in str(stall)
    assert str(stall).endswith("could not ask the other ranks which one is missing (no c10d store)")
    watchdog.progress(5)  # a new step forgets the collective
    assert watchdog.diagnose(RuntimeError("timed out")).collective is None
