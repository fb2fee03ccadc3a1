"""Whether an offloaded optimizer's host-side state fits in its node's host RAM: the one rule the search, hand-written
plans and ``tangram-launch estimate`` apply.

Optimizer offload (runtime_adapters/offload.py) keeps Adam's moments and an fp32 master copy in host memory, per GPU
(``model_state_bytes(...).host``, the breakdown's ``host_offload_bytes``). Every GPU of a node may offload, so a GPU's
budget is its share of the node's usable host memory; a plan over it is killed by the Linux OOM killer hours into the
run, not refused at launch. A node without ``host_memory_gib`` is not checked (unknown is not small).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

from tangram_launch.specs.constants import GIB
from tangram_launch.text import plural

if TYPE_CHECKING:  # pragma: no cover
    from tangram_launch.costmodel.slice_plan import StageCost
    from tangram_launch.specs.cluster import NodeHostMemory

# Of a node's host RAM, what its GPUs' offloaded optimizer state may take: the OS, the data loaders' workers, pinned
# staging buffers and the page cache (checkpoint writes, the dataset) need the rest.
USABLE_HOST_MEMORY_FRACTION = 0.8


def usable_host_bytes(host: "NodeHostMemory") -> float:
    """The bytes of the node's host RAM its GPUs' offloaded state may fill together."""
    return USABLE_HOST_MEMORY_FRACTION * host.host_memory_gib * GIB


def fits_host_memory(host_bytes_per_gpu: float, host: "NodeHostMemory | None") -> bool:
    """Whether every GPU of the node can keep ``host_bytes_per_gpu`` in host memory at once (True where the host
    memory is unknown or nothing is offloaded)."""
    return host is None or host_bytes_per_gpu * host.num_gpus <= usable_host_bytes(host)


def host_memory_problem(host_bytes_per_gpu: float, host: "NodeHostMemory | None", *, where: str = "") -> str | None:
    """Why a stage keeping ``host_bytes_per_gpu`` of offloaded optimizer state per GPU cannot run on ``host``'s node,
    or None where it fits (fits_host_memory)."""
    if fits_host_memory(host_bytes_per_gpu, host):
        return None
    assert host is not None  # fits_host_memory accepts an unknown host
    need = host_bytes_per_gpu * host.num_gpus
    return (f"{where + ': ' if where else ''}optimizer offload needs {host_bytes_per_gpu / GIB:.1f} GiB of host memory "
            f"per GPU, {need / GIB:.1f} GiB for the {plural(host.num_gpus, 'GPU')} of node {host.node}, which has "
            f"{host.host_memory_gib:g} GiB ({USABLE_HOST_MEMORY_FRACTION:.0%} usable: "
            f"{usable_host_bytes(host) / GIB:.1f} GiB); run without offload, shard the optimizer over a larger DP "
            f"(ZeRO), or give the node more host memory")


def stage_host_problems(stages: "Sequence[StageCost]", host: "NodeHostMemory | None") -> list[str]:
    """host_memory_problem of each stage of a costed plan (its breakdown's ``host_offload_bytes``), naming the stage
    where there are several."""
    out = []
    for j, st in enumerate(stages):
        where = f"stage {j} (layers {st.layers[0]}:{st.layers[1]})" if len(stages) > 1 else ""
        problem = host_memory_problem(st.breakdown.get("host_offload_bytes", 0.0), host, where=where)
        if problem:
            out.append(problem)
    return out
