"""A Plan as text: the per-stage table and the comparison with baselines (printed by ``tangram-launch plan`` and
logged by the launcher when it plans at launch time)."""
from __future__ import annotations

from tangram_launch.text import device_noun, on_cpu, plural


def _grid(rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:
    widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [v.rjust(w) if c in right else v.ljust(w) for c, (v, w) in enumerate(zip(r, widths))]
        out.append("  ".join(cells).rstrip())
    return out


def _ms(x: float) -> str:
    return f"{x * 1e3:.1f} ms" if x < 1 else f"{x:.2f} s"


def format_plan_table(plan, *, cluster_name: str = "", num_islands: int | None = None, manual: bool = False,
                      mfu_peak: str | None = None) -> str:
    """``mfu_peak`` says what MFU is a fraction of (a measured CPU rate is no hardware peak)."""
    tr = plan.training
    st0 = plan.stages
    b = st0[0].micro_batch_size * st0[0].dp
    where = cluster_name or plan.cluster.get("name")
    cpu = on_cpu(s.island for s in plan.stages)
    used = len({s.island for s in plan.stages})
    head = (f"{'manual plan' if manual else 'plan'} for {plan.model.get('name')} on {where}"
            f" ({plan.world_size} of {sum(n['num_gpus'] for n in plan.cluster.get('nodes', []))} "
            f"{device_noun(cpu=cpu)}"
            + (f", {used} of {plural(num_islands, 'island')} used" if num_islands is not None else "") + ")"
            f", runtime {plan.runtime}, parallelizer {plan.planner.get('parallelizer', '?')}")
    lines = [head,
             f"global batch {tr['global_batch']} x {tr['seq_len']} tokens, {tr['dtype']}; "
             f"{plural(plan.num_microbatches, 'micro-batch', 'micro-batches')} of {plural(b, 'sequence')}, "
             f"{plan.schedule}"
             + (f" ({plan.virtual_stages} model chunks per stage)" if plan.virtual_stages > 1 else ""), ""]
    # columns a plan may not use are shown only where a stage uses them: where the optimizer state lives (offload
    # moves it and an fp32 master copy to the host: the optimizer step runs there) and a tf32 plan's math per stage
    offload = any(s.offload for s in plan.stages)
    math = any(s.math_mode for s in plan.stages)
    rows = [["stage", "layers", "island", "devices" if cpu else "GPUs", "tp", "dp", "cp", "ep", "zero", "recompute"]
            + ["offload"] * offload + ["math"] * math + ["mbs", "time/mb", "memory GiB (of)"]]
    for s, p in zip(plan.stages, plan.predicted.stages):
        nodes = sorted({n for n, _ in s.gpus})
        rows.append([str(s.index), f"{s.layers[0]}-{s.layers[1] - 1}", s.island,
                     f"{s.num_gpus}" + (f" ({','.join(nodes)})" if len(nodes) <= 2 else f" ({len(nodes)} nodes)"),
                     str(s.tp), str(s.dp), str(s.cp), str(s.ep), str(s.zero_stage), s.recompute]
                    + ["optimizer" if s.offload else "-"] * offload + [s.math_mode or "-"] * math
                    + [str(s.micro_batch_size), _ms(p.time_s), f"{p.peak_memory_gib:.1f} ({p.capacity_gib:.0f})"])
    extra = offload + math  # the mbs and time/mb columns move right by the optional ones
    lines += _grid(rows, right={4, 5, 6, 7, 8, 10 + extra, 11 + extra})
    if plan.islands_dropped:
        lines += ["", "islands left out:"]
        lines += [f"  {d['reason']}" for d in plan.islands_dropped]
    split = plan.planner.get("islands_split") or {}
    if split:
        lines += ["", "islands split in two, a slice on each part (planned with one slice per island, the plan left "
                      f"whole nodes idle: iteration {split['unsplit_iteration_s']:.3f} s):"]
        lines += [f"  {name}: " + ", ".join(f"{plural(p['nodes'], 'node')} for stage "
                                            + ", ".join(str(k) for k in p["stages"]) for p in parts)
                  for name, parts in split["islands"].items()]
    idle = plan.planner.get("gpus_idle") or {}
    if idle.get("islands"):
        lines += ["", f"{device_noun(cpu=cpu)} idle: {idle['total']}"]
        lines += [f"  {d['reason']}" for d in idle["islands"].values()]
    pr = plan.predicted
    bd = pr.breakdown
    lines += ["",
              f"iteration {pr.iteration_time_s:.3f} s   tokens/s {pr.tokens_per_s:,.0f}   MFU {pr.mfu * 100:.1f} % "
              f"(model FLOPs, causal attention, over {mfu_peak or f'the peak of the {device_noun(cpu=cpu)} used'})"]
    if bd and "pipeline_s" in bd:
        v = plan.virtual_stages
        schedule = f"interleaved 1F1B ({v} chunks per stage)" if v > 1 else "1F1B"
        closed = "the closed form m x period + (fill - period) / v" if v > 1 else "the composer's closed-form bound"
        lines.append(f"  = simulated {schedule} pipeline {bd['pipeline_s']:.3f} s (period {bd.get('period_s', 0):.3f} "
                     f"s, inter-island p2p {bd.get('p2p_s', 0):.3f} s per micro-batch) + DP sync/optimizer "
                     f"{bd.get('tail_s', 0):.3f} s; {closed}: {bd['formula_s']:.3f} s")
    elif bd:
        lines.append(f"  = (m-1) x period {bd.get('steady_s', 0):.3f} s + fill/drain {bd.get('fill_s', 0):.3f} s "
                     f"(incl. inter-island p2p {bd.get('p2p_s', 0):.3f} s) "
                     f"+ DP sync/optimizer {bd.get('tail_s', 0):.3f} s")
    pl = plan.planner
    if "planning_time_s" in pl:
        pruned = pl.get("pruned", {})
        lines.append(f"planning {pl['planning_time_s']:.2f} s: {pl.get('pairs')} slice/island pairs, "
                     f"{pl.get('queries')} queries (pruned: " + ", ".join(f"{k} {v}" for k, v in pruned.items())
                     + f"), micro-batch sizes tried {pl.get('microbatch_sequences_tried')}")
    return "\n".join(lines)


def format_compare_table(plan, baselines, *, tangram=None) -> str:
    t = plan.predicted.iteration_time_s
    rows = [["plan", "iteration", "tokens/s", "MFU", "speed-up of this plan"]]
    tokens = plan.training["global_batch"] * plan.training["seq_len"]
    rows.append(["this plan" if tangram is not None else "tangram", f"{t:.3f} s", f"{tokens / t:,.0f}",
                 f"{plan.predicted.mfu * 100:.1f} %", "-"])
    if tangram is not None:
        tt = tangram.predicted.iteration_time_s
        rows.append(["tangram (searched)", f"{tt:.3f} s", f"{tokens / tt:,.0f}", f"{tangram.predicted.mfu * 100:.1f} %",
                     f"{tt / t:.2f}x"])
    notes = []
    for bl in baselines:
        bt = bl.time_s
        if bt is None:
            rows.append([bl.name, "infeasible", "-", "-", "-"])
            notes.append(f"  {bl.name}: {bl.reason}")
            continue
        mfu = f"{bl.plan.predicted.mfu * 100:.1f} %" if bl.plan is not None else "100 %"  # the ideal bound
        rows.append([bl.name, f"{bt:.3f} s", f"{tokens / bt:,.0f}", mfu, f"{bt / t:.2f}x"])
        notes.append(f"  {bl.name}: {bl.description}")
    return "\n".join(["comparison under the same cost model:"] + _grid(rows, right={1, 2, 3, 4}) + notes)
