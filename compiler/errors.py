"""Errors the compiler raises for problems a user can fix.

Plan problems are `meshplan.dsl.errors.PlanError`s, located in the `.plan` file. The
errors here concern the model and its capture, which have no plan span: each carries a
one-line message and a hint, and `str(error)` is what the command line prints.
"""

from __future__ import annotations


class CompileError(ValueError):
    """A problem with the model or its capture that the user can fix; never an internal bug."""

    def __init__(self, message: str, *, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        if self.hint is None:
            return self.message
        return f"{self.message}\nhint: {self.hint}"


class ModelLoadError(CompileError):
    """The `--model` spec could not be turned into a model and example inputs."""


class CaptureError(CompileError):
    """torch.export could not capture the model as a graph."""
