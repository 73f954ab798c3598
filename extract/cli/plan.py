"""`python -m extract plan --dry-run --model M --corpus C [...]`: the job on paper."""

from __future__ import annotations

from ..extraction.estimate import add_arguments as add_estimate_arguments
from .flags import add_plan_arguments


def add_parser(commands) -> None:
    plan = commands.add_parser("plan", help="tokenize the corpus and preview the job plan")
    add_plan_arguments(plan)
    plan.add_argument("--dry-run", action="store_true", help="print counts and the size estimate, write nothing")
    plan.add_argument("--json", action="store_true", help="print one JSON line instead of text")
    add_estimate_arguments(plan)
    plan.set_defaults(handler="extract.commands.plan:run")
