"""The adapter interface: a Plan plus a worker's place in it becomes a runtime's own objects.

Adapters import their runtime lazily (inside methods), so this module and the registry import without DeepSpeed or
Megatron installed. Capabilities are data (tangram_launch.capabilities) so the planner reads them without adapters.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, ClassVar, Protocol, runtime_checkable

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.errors import InfeasibleError
from tangram_launch.plan import Place, Plan


@runtime_checkable
class TrainingContext(Protocol):
    """What every adapter's ``setup`` returns: this rank's running part of the plan, closed when training ends."""

    plan: Plan
    place: Place

    def close(self) -> None: ...


class RuntimeAdapter(ABC):
    """Base class: subclasses set ``name`` and ``capabilities`` and implement ``setup``; one protocol for every
    runtime, so a script picks its adapter by name (``runtime_adapters.registry.get_adapter(plan.runtime)``)."""

    name: ClassVar[str]
    capabilities: ClassVar[RuntimeCapabilities]

    @abstractmethod
    def setup(self, plan: Plan, place: Place | None = None, **options: Any) -> TrainingContext:
        """Build this rank's part of the plan in the runtime: process groups, model part, optimizer. Collective
        over every rank of the plan; refuses a plan the runtime cannot run before any process group exists.
        ``place`` defaults to ``plan.place(rank)`` of this process."""

    def plan_problems(self, plan: Plan) -> list[str]:
        """Why this adapter cannot run the plan (pure; no process group). Subclasses add what their construction
        needs beyond the declared capabilities (schedules, model shapes)."""
        return list(self.capabilities.plan_problems(plan))

    def check_plan(self, plan: Plan) -> None:
        """Refuse a plan this runtime cannot run, naming the missing capability, before any process group exists."""
        problems = self.plan_problems(plan)
        if problems:
            raise InfeasibleError(f"the {self.name} runtime cannot execute this plan", problems)


def release_default_group(owns_default_group: bool) -> None:
    """End of training: a barrier, then the process groups destroyed if ``setup`` created the default one (a group
    the caller created is left to the caller). A gloo worker that exits with its groups alive, or destroys them while
    a peer is still in a collective, aborts now and then in their threads (``terminate called without an active
    exception``, exit code -6), and the launcher then reports a finished run as failed."""
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()
        if owns_default_group:
            dist.destroy_process_group()
