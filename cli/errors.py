"""Exit codes, the user-mistake errors of the command line, and how they are said: a leaf that
every front (`main`, `run`, `launcher`, `verify`, `session`) imports and that imports none of them.

    0 success · 1 a bug in meshplan · 2 the user's input (plan, model, arguments, data)
    3 a rank died or hung; the others stopped

A worker of `meshplan run` that stops on a user mistake does not print it: torchrun may stop
rank 0 before it prints, or print its own failure report first. It leaves the message in the
folder named by `ERRORS_ENV` (`leave_for_launcher`), and the launcher says it once torchrun is done.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from collections.abc import Callable
from pathlib import Path

from meshplan.compiler.errors import CompileError
from meshplan.dsl import PlanError

EXIT_OK, EXIT_INTERNAL, EXIT_USER = 0, 1, 2  # 1: a bug in meshplan
EXIT_PEER = 3  # a rank died or hung; the others stopped

# The folder where a worker that stops on a user mistake leaves its message (`rank<R>.txt`).
ERRORS_ENV = "MESHPLAN_ERRORS"
HINT = "  hint: "  # how a hint line starts under an error


class UsageError(Exception):
    """A user mistake outside any plan file (a bad flag value, a missing output folder)."""


class RunError(ValueError):
    """A user mistake found by `meshplan run` or `verify` (one line, with a hint)."""


def use_color(stream) -> bool:
    if os.environ.get("NO_COLOR"):
        return False
    return os.environ.get("FORCE_COLOR") is not None or (hasattr(stream, "isatty") and stream.isatty())


def report(error: PlanError) -> None:
    """The first diagnostics (dsl.errors.MAX_SHOWN), a count of the rest, the totals."""
    print(error.render(color=use_color(sys.stderr)), file=sys.stderr)
    print(error.summary(), file=sys.stderr)


def guarded(command: Callable[[], int]) -> int:
    """Run a command and turn what it raises into one message and an exit code: a user mistake is
    said with its location (2), a meshplan bug is summarized (1; `MESHPLAN_DEBUG=1` re-raises it)."""
    try:
        return command()
    except PlanError as e:
        report(e)
        return EXIT_USER
    except (CompileError, UsageError, RunError) as e:
        print(f"meshplan: error: {e}", file=sys.stderr)
        return EXIT_USER
    except KeyboardInterrupt:
        print("meshplan: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader left (`meshplan estimate --json | head`): stop quietly,
        # as the shell's tools do, and keep Python's flush at exit off the closed pipe
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 128 + 13  # SIGPIPE's status
    except Exception as e:  # a bug in meshplan, not a user mistake
        if os.environ.get("MESHPLAN_DEBUG"):
            raise
        print(
            f"meshplan: internal error: {type(e).__name__}: {e}\n"
            "this is a bug in meshplan; rerun with MESHPLAN_DEBUG=1 for the traceback and report it",
            file=sys.stderr,
        )
        return EXIT_INTERNAL


def leave_for_launcher(error: Exception, rank: int) -> None:
    """Leave a worker's user-mistake message for the launcher (every rank: whichever stops first is
    the one torchrun reports); under a user's own torchrun, rank 0 prints it."""
    text = io.StringIO()
    with contextlib.redirect_stderr(text):
        if isinstance(error, PlanError):
            report(error)
        else:
            print(f"meshplan: error: {error}", file=sys.stderr)
    folder = os.environ.get(ERRORS_ENV)
    if folder is not None and Path(folder).is_dir():
        partial = Path(folder) / f".rank{rank}.txt"  # renamed when whole: torchrun may stop us mid-write
        partial.write_text(text.getvalue())
        partial.replace(partial.with_name(f"rank{rank}.txt"))
    elif rank == 0:
        sys.stderr.write(text.getvalue())
