"""The ``deepspeed`` runtime: a PipelineModule with the plan's exact layer split, a topology whose rank mapping is
the plan's rank layout, and a DeepSpeed config generated from the plan and merged with the user's.

* Partition: DeepSpeed's ``partition_method`` values (uniform, parameters, type:regex) cannot express an arbitrary
  split, so ``PlanPipelineModule`` (a subclass) overrides ``_partition_layers`` for ``partition_method="plan:b0,b1,.."``
  with the boundaries over DeepSpeed's layer list [embedding, layer 0, ..., layer L-1, head].
* Topology: ``PlanTopology`` (a ProcessTopology subclass) sets ``mapping`` from ``plan.rank_layout``; DeepSpeed builds
  its data, pipe and p2p groups from that mapping.
* Config: the plan owns train_batch_size, train_micro_batch_size_per_gpu, gradient_accumulation_steps (= micro-batches),
  zero_optimization.stage and bf16/fp16.enabled; every other user key wins. A user value that contradicts the plan is
  logged as a warning and the plan's value is kept. Recompute "full" becomes activation_checkpoint_interval=1 over the
  transformer layers.
* A torch optimizer is passed to ``deepspeed.initialize`` (a config optimizer such as AdamW JIT-builds fused_adam,
  +73 s on CPU).

DeepSpeed is imported inside functions only, so this module imports where DeepSpeed is absent. On CPU its comm
backend would JIT-compile the ``deepspeed_shm_comm`` op on first use (46-78 s, 160-270 s on a loaded machine): every
path to ``deepspeed.comm`` constructs a ``TorchBackend``, which builds it when the op is "compatible", i.e. on any
Linux host; neither gloo, an existing torch process group nor DS_ACCELERATOR=cpu avoids it. Training never uses it
(only ``inference_all_reduce``, DeepSpeed's AutoTP inference path, does; training's collectives go through
torch.distributed), so ``setup`` skips the build on CPU: see ``_skip_inference_shm_op``.
"""
from __future__ import annotations

import copy
import json
import logging
import os
from dataclasses import dataclass
from datetime import timedelta
from functools import lru_cache
from typing import Any, ClassVar, Iterator, Mapping

import torch

from runtime_adapters.base import RuntimeAdapter, release_default_group
from runtime_adapters.gpt import Embedding, Head, TransformerLayer, as_model_spec, gpt_plan_problems, lm_loss
from tangram_launch.capabilities import DEEPSPEED, RuntimeCapabilities
from tangram_launch.errors import SpecError
from tangram_launch.plan import Place, Plan
from tangram_launch.specs.yamlio import load_yaml_file

logger = logging.getLogger(__name__)

# Config keys (dotted paths) whose value the plan decides; see planned_config.
PLAN_OWNED_KEYS = ("train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps",
                   "zero_optimization.stage", "bf16.enabled", "fp16.enabled")


def plan_partition(plan: Plan) -> list[int]:
    """Boundaries over [embedding, layer 0..L-1, head]: stage s holds entries [b[s], b[s+1])."""
    bounds = [0] + [s.layers[1] + 1 for s in plan.stages]
    bounds[-1] += 1  # the head belongs to the last stage
    return bounds


def planned_config(plan: Plan) -> dict:
    """The DeepSpeed config keys the plan decides."""
    s = plan.stages[0]
    dtype = str(plan.training.get("dtype", "fp32"))
    return {
        "train_batch_size": s.micro_batch_size * s.dp * plan.num_microbatches,
        "train_micro_batch_size_per_gpu": s.micro_batch_size,
        "gradient_accumulation_steps": plan.num_microbatches,
        "zero_optimization": {"stage": s.zero_stage},
        "bf16": {"enabled": dtype == "bf16"},
        "fp16": {"enabled": dtype == "fp16"},
    }


_MISSING = object()


def _get(d: Mapping, path: str) -> Any:
    for key in path.split("."):
        if not isinstance(d, Mapping) or key not in d:
            return _MISSING
        d = d[key]
    return d


def _merge(base: dict, over: Mapping) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, Mapping) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


def load_user_config(user_config: Mapping | str | os.PathLike | None) -> dict:
    if user_config is None:
        return {}
    if isinstance(user_config, Mapping):
        return copy.deepcopy(dict(user_config))
    path = os.fspath(user_config)
    if path.endswith(".json"):
        try:
            with open(path, encoding="utf-8") as f:
                data = json.load(f)
        except (OSError, json.JSONDecodeError) as exc:
            raise SpecError(f"cannot read the DeepSpeed config ({exc})", source=path) from None
    else:
        data = load_yaml_file(path)
    if not isinstance(data, dict):
        raise SpecError("a DeepSpeed config is a mapping", source=path, value=type(data).__name__)
    return data


def build_config(plan: Plan, user_config: Mapping | str | os.PathLike | None = None) -> dict:
    """The plan's DeepSpeed config merged with the user's: user keys win unless they contradict the plan (then a
    warning, and the plan's value is kept)."""
    user = load_user_config(user_config)
    planned = planned_config(plan)
    defaults = {"steps_per_print": 2**31 - 1, "wall_clock_breakdown": False}  # the caller logs per step
    merged = _merge(_merge(defaults, user), planned)
    for path in PLAN_OWNED_KEYS:
        mine, theirs = _get(planned, path), _get(user, path)
        if theirs is not _MISSING and theirs != mine:
            logger.warning("DeepSpeed config: %s=%r contradicts the plan; keeping the plan's %r", path, theirs, mine)
    return merged


class DeepSpeedAdapter(RuntimeAdapter):
    """DeepSpeed's pipeline engine (1F1B, one grid for all stages, ZeRO <= 1) running a plan."""

    name: ClassVar[str] = "deepspeed"
    capabilities: ClassVar[RuntimeCapabilities] = DEEPSPEED

    def plan_problems(self, plan: Plan) -> list[str]:
        problems = super().plan_problems(plan)
        if plan.schedule != "1F1B":
            problems.append(f"deepspeed's pipeline runs 1F1B only (plan has '{plan.schedule}')")
        return problems + gpt_plan_problems(plan)

    def setup(self, plan: Plan, place: Place | None = None, *, user_config: Mapping | str | None = None,
              optimizer_factory=None, seed: int = 0, timeout_s: float = 600.0) -> "DeepSpeedTrainingContext":
        """Build this rank's part of the plan under DeepSpeed. Collective over every rank of the plan."""
        self.check_plan(plan)  # before DeepSpeed or any process group is touched
        config = build_config(plan, user_config)
        spec = as_model_spec(plan.model)

        import deepspeed
        import torch.distributed as dist
        from deepspeed.pipe import LayerSpec

        use_cuda = torch.cuda.is_available()
        # DeepSpeed's engine and PipelineModule read LOCAL_RANK (torchrun and tangram-launch set it)
        os.environ.setdefault("LOCAL_RANK", str(place.local_gpu if (place is not None and use_cuda) else 0))
        owns_default_group = not dist.is_initialized()
        if owns_default_group:
            dist.init_process_group("nccl" if use_cuda else "gloo", timeout=timedelta(seconds=timeout_s))
        if not use_cuda:
            _skip_inference_shm_op()
        deepspeed.init_distributed(dist_backend=dist.get_backend(), timeout=timedelta(seconds=timeout_s))
        if dist.get_world_size() != plan.world_size:
            raise SpecError("the job's world size differs from the plan's", field="world_size",
                            value=dist.get_world_size(), valid=str(plan.world_size))
        rank = dist.get_rank()
        place = place or plan.place(rank)
        if place.rank != rank:
            raise SpecError("place.rank differs from this process's rank", field="place.rank", value=place.rank,
                            valid=str(rank))

        from runtime_adapters.stage_timing import timer_from_env

        # the run report's timings (a planned launch): the stage module's forward and backward, the last stage's
        # loss with them (as the plan prices the head), the optimizer step from its hooks
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"])) if use_cuda else torch.device("cpu")
        timer = timer_from_env([], rank=rank, coords={"rank": rank, "stage": place.stage.index, **place.coords},
                               microbatches=plan.num_microbatches, device=device)
        specs = ([LayerSpec(Embedding, spec, seed=seed)]
                 + [LayerSpec(TransformerLayer, spec, i, seed=seed) for i in range(spec.num_layers)]
                 + [LayerSpec(Head, spec, seed=seed)])
        bounds = plan_partition(plan)
        module = _pipeline_module_class()(
            layers=specs, topology=_topology_class()(plan),
            loss_fn=timer.timed_loss(lm_loss) if timer is not None else lm_loss,
            partition_method="plan:" + ",".join(map(str, bounds)),
            activation_checkpoint_interval=1 if place.stage.recompute == "full" else 0,
            checkpointable_layers=["TransformerLayer"])  # never the embedding (int inputs carry no grad)
        if list(module.parts) != bounds:
            raise AssertionError(f"DeepSpeed partition {module.parts} differs from the plan's {bounds}")

        client_optimizer = None
        if optimizer_factory is not None or "optimizer" not in config:
            if "optimizer" in config:
                logger.warning("DeepSpeed config: 'optimizer' ignored, the given optimizer_factory is used")
                config.pop("optimizer")
            from runtime_adapters.torch_native import default_optimizer_factory

            client_optimizer = (optimizer_factory or default_optimizer_factory)(
                [p for p in module.parameters() if p.requires_grad])
            # ZeRO-1 shards any torch optimizer's state elementwise; DeepSpeed asks for an explicit opt-in for
            # optimizers outside its tested list (e.g. SGD)
            config.setdefault("zero_allow_untested_optimizer", True)
        engine, _, _, _ = deepspeed.initialize(model=module, optimizer=client_optimizer, config=config,
                                               model_parameters=[p for p in module.parameters() if p.requires_grad])
        if timer is not None:
            timer.watch(module)
            # the torch optimizer DeepSpeed steps (inside its ZeRO wrapper, where there is one)
            stepped = client_optimizer or getattr(engine.optimizer, "optimizer", engine.optimizer)
            if isinstance(stepped, torch.optim.Optimizer):
                timer.watch_optimizer(stepped)
        logger.info("rank %d |PP=%d|DP=%d| entries [%d, %d) of %s zero=%d recompute=%s", rank, place.coords["pp"],
                    place.coords["dp"], bounds[place.stage.index], bounds[place.stage.index + 1], bounds,
                    place.stage.zero_stage, place.stage.recompute)
        return DeepSpeedTrainingContext(plan=plan, place=place, engine=engine, config=config,
                                        num_layers=spec.num_layers, timer=timer,
                                        owns_default_group=owns_default_group)


@lru_cache(maxsize=None)
def _pipeline_module_class() -> type:
    from deepspeed.pipe import PipelineModule

    class PlanPipelineModule(PipelineModule):
        """PipelineModule whose ``partition_method="plan:b0,b1,...,bS"`` sets the stage boundaries exactly."""

        def _partition_layers(self, method: str = "uniform") -> None:
            if not method.startswith("plan:"):
                return super()._partition_layers(method)
            parts = [int(x) for x in method[len("plan:"):].split(",")]
            if len(parts) != self.num_stages + 1 or parts[0] != 0 or parts[-1] != len(self._layer_specs) \
                    or any(b <= a for a, b in zip(parts, parts[1:])):
                raise SpecError("a partition is S+1 increasing boundaries from 0 to the number of entries",
                                field="partition_method", value=method,
                                valid=f"{self.num_stages + 1} boundaries ending at {len(self._layer_specs)}")
            self.parts = parts
            stage_id = self._topo.get_coord(self.global_rank).pipe
            self._set_bounds(start=parts[stage_id], stop=parts[stage_id + 1])

    return PlanPipelineModule


@lru_cache(maxsize=None)
def _topology_class() -> type:
    from deepspeed.runtime.pipe.topology import ProcessTopology

    class PlanTopology(ProcessTopology):
        """DeepSpeed's (pipe, data, model) grid with the plan's rank for every coordinate."""

        def __init__(self, plan: Plan) -> None:
            s0 = plan.stages[0]
            super().__init__(axes=["pipe", "data", "model"], dims=[plan.num_stages, s0.dp, s0.tp])
            self.mapping = {self.ProcessCoord(pipe=r.stage, data=r.dp, model=r.tp): r.rank
                            for r in plan.rank_layout}

    return PlanTopology


def plan_topology(plan: Plan) -> Any:
    """The DeepSpeed ProcessTopology of a plan (imports DeepSpeed)."""
    return _topology_class()(plan)


def _skip_inference_shm_op() -> None:
    """Keep DeepSpeed (0.19.8) from JIT-compiling ``deepspeed_shm_comm`` on a CPU host: training has no use for it.

    ``deepspeed.comm.torch.build_shm_op`` builds the op only when ``deepspeed.ops.__compatible_ops__`` marks it
    compatible; that table is computed once per process and kept in the module (DeepSpeed keeps one dict "so edits to
    it persist"). Marking the op incompatible before ``init_distributed`` makes the backend skip the build, and
    ``inference_all_reduce`` (the op's only user) falls back to torch.distributed's all_reduce. Version-specific:
    ``test_adapter_deepspeed`` trains with an empty TORCH_EXTENSIONS_DIR and checks that nothing was built in it.
    """
    import deepspeed.ops
    from deepspeed.ops.op_builder.cpu import ShareMemCommBuilder

    deepspeed.ops.__compatible_ops__[ShareMemCommBuilder.NAME] = False


@dataclass
class DeepSpeedTrainingContext:
    plan: Plan
    place: Place
    engine: Any  # deepspeed.runtime.pipe.engine.PipelineEngine
    config: dict
    num_layers: int
    timer: Any = None  # runtime_adapters.stage_timing.StageTimer (launched with a run directory)
    steps_done: int = 0
    owns_default_group: bool = False  # setup created the default process group: close destroys it

    @property
    def is_last_stage(self) -> bool:
        return self.place.is_last_stage

    def _micro_batches(self, batch: torch.Tensor) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        stage = self.place.stage
        mbs, m = stage.micro_batch_size, self.plan.num_microbatches
        if batch.shape[0] != mbs * m * stage.dp:
            raise SpecError("a batch has global_batch rows", field="batch.shape[0]", value=batch.shape[0],
                            valid=str(mbs * m * stage.dp))
        d = self.place.coords["dp"]
        rows = batch[d * mbs * m:(d + 1) * mbs * m].to(self.engine.device)
        for i in range(m):
            mb = rows[i * mbs:(i + 1) * mbs]
            yield mb[:, :-1], mb[:, 1:]

    def train_step(self, batch: torch.Tensor) -> float:
        """One iteration on a global batch (global_batch, seq_len + 1) of tokens; the mean loss, on every rank."""
        if self.timer is not None:
            self.timer.start_step()
        loss = float(self.engine.train_batch(data_iter=self._micro_batches(batch)))
        self.steps_done += 1
        if self.timer is not None:
            self.timer.end_step(self.steps_done)
        return loss

    def global_state_dict(self) -> dict[str, torch.Tensor]:
        """This stage's parameters named like ``runtime_adapters.gpt.StageModule`` (global layer indices)."""
        out = {}
        last = self.num_layers + 1
        for name, p in self.engine.module.named_parameters():
            idx, _, rest = name.partition(".")
            i = int(idx)
            prefix = "embedding" if i == 0 else "head" if i == last else f"layers.{i - 1}"
            out[f"{prefix}.{rest}"] = p.detach().cpu().clone()
        return out

    def close(self) -> None:
        release_default_group(self.owns_default_group)
