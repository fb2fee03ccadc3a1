"""The adapter interface: a Plan plus a worker's place in it becomes a runtime's own objects.

Adapters import their runtime lazily (inside methods), so this module and the registry import without DeepSpeed or
Megatron installed. Capabilities are data (tangram_launch.capabilities) so the planner reads them without adapters.
"""
from __future__ import annotations

from abc import ABC
from typing import ClassVar

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.errors import InfeasibleError
from tangram_launch.plan import Plan


class RuntimeAdapter(ABC):
    """Base class: subclasses set ``name`` and ``capabilities`` and add their runtime-specific builders."""

    name: ClassVar[str]
    capabilities: ClassVar[RuntimeCapabilities]

    def plan_problems(self, plan: Plan) -> list[str]:
        """Why this adapter cannot run the plan (pure; no process group). Subclasses add what their construction
        needs beyond the declared capabilities (schedules, model shapes)."""
        return list(self.capabilities.plan_problems(plan))

    def check_plan(self, plan: Plan) -> None:
        """Refuse a plan this runtime cannot run, naming the missing capability, before any process group exists."""
        problems = self.plan_problems(plan)
        if problems:
            raise InfeasibleError(f"the {self.name} runtime cannot execute this plan", problems)
