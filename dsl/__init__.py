"""The plan language front end: text -> syntax tree -> checked `Plan`. Imports no torch."""

from .check import Plan, check, check_text, load_plan
from .errors import Diagnostic, PlanError, PlanFileError, PlanSyntaxError, PlanValidationError, Span
from .limits import read_plan_text
from .parser import parse

__all__ = [
    "Diagnostic",
    "Plan",
    "PlanError",
    "PlanFileError",
    "PlanSyntaxError",
    "PlanValidationError",
    "Span",
    "check",
    "check_text",
    "load_plan",
    "parse",
    "read_plan_text",
]
