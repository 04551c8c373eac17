"""Runs a pipetrain schedule in PyTorch's own pipelining runtime (torch.distributed.pipelining).

PyTorch's ``_PipelineScheduleRuntime`` executes any per-rank list of actions it is given, with the
communication actions spelled out. This module lowers a pipetrain schedule (pipetrain.lower: sends and
receives in an order that cannot deadlock), turns every rank's actions into PyTorch's action objects
and loads them, so V-Half, V-Min, ZB-V, exact zero bubble or a planned schedule runs in your own training
loop, with your own ``PipelineStage`` objects:

    import pipetrain, pipetrain.torch
    s = pipetrain.schedule("v-min", stages=world_size, microbatches=8)
    my_stages = [PipelineStage(chunk[i], i, s.stages, device) for i in pipetrain.torch.stages_of(s, rank)]
    runtime = pipetrain.torch.pipeline_schedule(s, my_stages, loss_fn=loss_fn)
    runtime.step(x, target=y, losses=losses)   # x on the rank holding stage 0, target on the last stage's

Letters: pipetrain's F, B (input gradient), W, BW (full backward), SF, RF, SB, RB become PyTorch's F, I,
W, B, SEND_F, RECV_F, SEND_B, RECV_B. Optimizer steps stay yours (PyTorch's schedules leave them to the
caller). Needs PyTorch 2.5 or newer (tested with 2.6): the API used is ``_PipelineScheduleRuntime`` and the
``BACKWARD_INPUT``/``BACKWARD_WEIGHT``/``FULL_BACKWARD`` action types of
``torch.distributed.pipelining.schedules``, which 2.4's module lacks; a runtime without ``_load_actions``
is handed the lowered schedule through its ``_load_csv``.
"""

import os
import tempfile
from typing import Callable, Dict, List, Optional, Sequence

import pipetrain

_TORCH_KIND = {
    "F": "FORWARD",
    "B": "BACKWARD_INPUT",
    "W": "BACKWARD_WEIGHT",
    "BW": "FULL_BACKWARD",
    "SF": "SEND_F",
    "RF": "RECV_F",
    "SB": "SEND_B",
    "RB": "RECV_B",
}


# What this module uses of torch.distributed.pipelining.schedules: the runtime that executes a given action
# list, and the action types of the split backward (the names PyTorch 2.5 gave them).
_REQUIRED = ("_PipelineScheduleRuntime", "_Action") + tuple(sorted(set(_TORCH_KIND.values())))
_MINIMUM = "PyTorch 2.5 or newer"


def _schedules_module():
    try:
        from torch.distributed.pipelining import schedules
    except ImportError as e:  # PyTorch older than 2.4 (no torch.distributed.pipelining), or none
        raise ImportError(f"pipetrain.torch needs torch.distributed.pipelining's schedule runtime ({_MINIMUM}): "
                          + str(e)) from e
    missing = [name for name in _REQUIRED if not hasattr(schedules, name)]
    if missing:
        import torch
        raise ImportError(f"pipetrain.torch needs {_MINIMUM}: this PyTorch ({torch.__version__}) has no "
                          f"{', '.join(missing)} in torch.distributed.pipelining.schedules: upgrade PyTorch")
    return schedules


def check_runnable(schedule: "pipetrain.Schedule") -> None:
    """Raises ValueError when PyTorch's runtime cannot run `schedule`: several optimizer steps (give one step;
    PyTorch's step() is one synchronous step), asynchronous schedules (pipedream, 2bw, spectrain), replicated
    stages (1F1B-RR) and skip routes; pipetrain.ScheduleError (a ValueError) when it is not a valid schedule
    (pipetrain.validate)."""
    pipetrain.validate(schedule)
    if not schedule.synchronous:
        raise ValueError(f"schedule {schedule.name} steps without a flush (weight versions); PyTorch's runtime runs "
                         "synchronous schedules only: choose a synchronous one (gpipe, 1f1b, zb-*, v-*, interleaved, ...)")
    if schedule.steps != 1:
        raise ValueError(f"schedule {schedule.name} lays out {schedule.steps} optimizer steps; PyTorch's step() runs "
                         "one: build it with steps=1 and call step() once per optimizer step")
    if schedule.stage_replicas:
        raise ValueError(f"schedule {schedule.name} replicates stages (1F1B-RR), which PyTorch's runtime cannot run: "
                         "drop replication")
    if schedule.skips:
        raise ValueError(f"schedule {schedule.name} has skip routes; PyTorch's runtime sends to neighbouring stages "
                         "only: drop skips")


def stages_of(schedule: "pipetrain.Schedule", rank: int) -> List[int]:
    """The stage indices `rank` holds in `schedule`, in increasing order (make a PipelineStage for each)."""
    if not 0 <= rank < schedule.ranks:
        raise ValueError(f"rank {rank} is not one of the schedule's {schedule.ranks} ranks (0..{schedule.ranks - 1})")
    return [s for s in range(schedule.stages) if schedule.stage_rank[s] == rank]


def torch_actions(schedule: "pipetrain.Schedule", *, lower: bool = True,
                  costs: Optional["pipetrain.CostModel"] = None) -> Dict[int, list]:
    """Every rank's actions as PyTorch ``_Action`` objects: {rank: [...]}. lower=True (the default) first
    inserts the sends and receives (pipetrain.lower, with `costs` deciding how early they are posted), the
    "compute_comms" form PyTorch's runtime executes as it is; lower=False gives the compute-only form.
    Optimizer steps are left out; a paired slot (dualpipev) becomes its two actions."""
    check_runnable(schedule)
    sched = _schedules_module()
    if lower and not any(a.is_comm for row in schedule.actions for a in row):
        schedule = pipetrain.lower(schedule, costs)
    out: Dict[int, list] = {}
    for rank, row in enumerate(schedule.actions):
        actions = []
        for a in row:
            if a.kind == "S":
                continue
            kind = getattr(sched, _TORCH_KIND[a.kind])
            actions.append(sched._Action(a.stage, kind, a.index))
        out[rank] = actions
    return out


def pipeline_schedule(
    schedule: "pipetrain.Schedule",
    stages: Sequence,
    loss_fn: Optional[Callable] = None,
    *,
    costs: Optional["pipetrain.CostModel"] = None,
    **runtime_kwargs,
):
    """A PyTorch schedule object (``_PipelineScheduleRuntime``) that runs `schedule` with this rank's
    `stages` (PipelineStage objects, one per stage index stages_of(schedule, rank), any order). loss_fn is
    PyTorch's (called per micro-batch on the last stage). Extra keyword arguments go to the runtime's
    constructor (args_chunk_spec, scale_grads on newer PyTorch, ...). Call ``.step(...)`` as with PyTorch's
    own schedules.

    Raises ValueError when the stages do not match the schedule (count, rank, indices) or the schedule
    cannot run in PyTorch (check_runnable)."""
    check_runnable(schedule)
    sched = _schedules_module()
    stages = list(stages)
    if not stages:
        raise ValueError("no stages given: pass this rank's PipelineStage objects")
    num_stages = stages[0].num_stages
    if num_stages != schedule.stages:
        raise ValueError(f"the PipelineStages have num_stages={num_stages} but schedule {schedule.name} has "
                         f"{schedule.stages} stages: build the stages with num_stages={schedule.stages}")
    rank = stages[0].group_rank
    world = stages[0].group_size
    if world != schedule.ranks:
        raise ValueError(f"the process group has {world} ranks but schedule {schedule.name} has {schedule.ranks}: "
                         f"build it with stages={world}")
    want = stages_of(schedule, rank)
    have = sorted(s.stage_index for s in stages)
    if have != want:
        raise ValueError(f"rank {rank} holds stages {want} in schedule {schedule.name} but was given stages {have}: "
                         "make one PipelineStage per index of pipetrain.torch.stages_of(schedule, rank)")
    stages.sort(key=lambda s: s.stage_index)
    stage_to_rank = {s: r for s, r in enumerate(schedule.stage_rank)}
    runtime = sched._PipelineScheduleRuntime(stages, schedule.microbatches_per_step, loss_fn=loss_fn,
                          stage_index_to_group_rank=stage_to_rank, **runtime_kwargs)
    if hasattr(runtime, "_load_actions"):
        runtime._load_actions(torch_actions(schedule, costs=costs), format="compute_comms")
    else:  # PyTorch's CSV loader, with pipetrain's lowered schedule in PyTorch's letters
        lowered = pipetrain.lower(schedule, costs)
        fd, path = tempfile.mkstemp(suffix=".csv")
        try:
            with os.fdopen(fd, "w") as f:
                f.write(pipetrain.to_torch_csv(lowered))
            runtime._load_csv(path, format="compute_comms")
        finally:
            os.unlink(path)
    return runtime


__all__ = ["check_runnable", "pipeline_schedule", "stages_of", "torch_actions"]
