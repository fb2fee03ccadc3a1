"""Why the planner cannot use what it was given: islands that cannot train in the dtype, a model whose state
does not fit the usable GPUs (usable_islands), why no plan was found (infeasible_reasons: one line per island
and per reason, whatever the number of sizes that failed alike), and GPUs a plan leaves idle (idle_gpus). Islands
a plan leaves out are explained by dropped.py."""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from tangram_launch.capabilities import RuntimeCapabilities
from tangram_launch.errors import InfeasibleError
from tangram_launch.parallelizers.base import GIB
from tangram_launch.plan import Plan
from tangram_launch.planner.build import Candidates
from tangram_launch.planner.slices import ModelAtoms, PairSet, dtype_problem
from tangram_launch.text import plural

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.islands import Island


def memory_reasons(atoms: ModelAtoms, usable: Sequence["Island"], caps: RuntimeCapabilities) -> list[str]:
    need = atoms.min_static_bytes(0, atoms.num_layers, offload=caps.offload)
    have = sum(i.gpu.memory_gib * GIB * i.num_gpus for i in usable)
    if need <= have:
        return []
    what = "parameters and gradients" if caps.offload else "parameters, gradients and optimizer state"
    return [f"the model needs {need / GIB:.0f} GiB of {what} ({atoms.model.total_params() / 1e9:.2f} B parameters); "
            f"the cluster's usable GPUs have {have / GIB:.0f} GiB"]


def usable_islands(all_islands: Sequence["Island"], atoms: ModelAtoms, caps: RuntimeCapabilities,
                   dtype: str) -> tuple[tuple["Island", ...], list[str]]:
    """The islands that can train in ``dtype``, and why the others cannot; InfeasibleError where the runtime cannot
    train in it, no island can, or the model's state cannot fit in the usable islands' memory."""
    if caps.dtype_problems(dtype):
        raise InfeasibleError(f"the {caps.name} runtime cannot train in {dtype}", caps.dtype_problems(dtype))
    usable = tuple(i for i in all_islands if dtype_problem(i, dtype) is None)
    reasons = [p for i in all_islands if (p := dtype_problem(i, dtype))]
    if not usable:
        raise InfeasibleError("no island can train in " + dtype, reasons)
    mem = memory_reasons(atoms, usable, caps)
    if mem:
        raise InfeasibleError("no plan fits in memory", mem + reasons)
    return usable, reasons


def infeasible_reasons(cands: dict[int, Candidates], pairset: PairSet, reasons: list[str],
                       caps: RuntimeCapabilities) -> list[str]:
    out = list(reasons) + [n for n in pairset.island_notes.values() if n not in reasons]
    # One line per island and per drop reason, whatever the number of micro-batch sizes that failed alike.
    first: dict[str, tuple[int, str]] = {}
    sizes: dict[str, list[int]] = {}
    dropped: dict[str, list[int]] = {}
    for cand in sorted(cands.values(), key=lambda c: c.b):
        for isl, msgs in cand.infeasible.items():
            if msgs:
                first.setdefault(isl, (cand.b, msgs[0]))  # the smallest micro-batch: the nearest to fitting
                sizes.setdefault(isl, []).append(cand.b)
        for why, n in cand.dropped.items():
            dropped.setdefault(why, [0])[0] += n
            dropped[why].append(cand.b)
    for isl, (b, msg) in first.items():
        text = msg if msg.startswith(isl) else f"{isl}: {msg}"
        more = sizes[isl][1:]
        text += f" (shown at b={b}, the smallest micro-batch; b={','.join(map(str, more))} fail too)" if more else ""
        if text not in out:
            out.append(text)
    for why, (n, *bs) in dropped.items():
        out.append(f"{plural(n, 'slice plan')} dropped at b={','.join(map(str, bs))}: {why} ({caps.name})")
    if not any(c.options for c in cands.values()):
        host = any("host memory" in line for line in out)  # an island's reason (host_memory.host_memory_problem)
        out.append("no slice plan of any pair fits in GPU memory" + (" without offload, and offload does not fit "
                                                                     "in host memory (above)" if host else ""))
    else:
        out.append("slice plans exist, but no sequence of them covers the model with each stage fitting in memory "
                   "at its pipeline position" + (" under one process grid" if caps.uniform_grid else ""))
    return out


def idle_gpus(plan: Plan, islands: Sequence["Island"], b: int) -> dict:
    """How many GPUs the plan leaves idle, and why, per island it uses only in part (islands left out whole are
    explained in islands_dropped)."""
    used: dict[str, int] = {}
    for s in plan.stages:
        used[s.island] = used.get(s.island, 0) + s.num_gpus
    out: dict = {"total": sum(i.num_gpus for i in islands) - sum(used.values()), "islands": {}}
    for isl in islands:
        n = used.get(isl.name)
        if n is None or n == isl.num_gpus:
            continue
        out["islands"][isl.name] = {
            "idle": isl.num_gpus - n,
            "reason": (f"{isl.name}: {n} of {isl.num_gpus} GPUs used; a slice plan's GPUs are pp stages of "
                       f"tp x dp x cp GPUs that divide a node or are whole nodes, with dp dividing the micro-batch "
                       f"of {b} sequences, and no such plan using more of the island was faster")}
    return out
