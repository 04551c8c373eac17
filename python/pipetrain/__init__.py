"""pipetrain from Python: schedules, validation, lowering, simulation, the heap model, timelines,
profiles, balances, the PipeDream and UMPIPE planners, the plan search and PyTorch's schedule CSV.

The functions take the `pipetrain` command line's flags as keyword arguments, with its defaults
(``--microbatches`` is ``microbatches=``, ``--memory-limit`` is ``memory_limit=``, ...). Bad values raise
ValueError with the command line's message; an invalid schedule raises pipetrain.ScheduleError (a
ValueError) whose message carries the step x rank grid.

    >>> import pipetrain
    >>> s = pipetrain.schedule("v-min", stages=4, microbatches=8)
    >>> sim = pipetrain.simulate(s)
    >>> sim.makespan, sim.bubble_fraction, sim.peak_memory
    >>> print(sim.table())
    >>> sim.write_svg("v-min.svg")

`pipetrain.torch` hands a schedule to PyTorch's own pipelining runtime (torch.distributed.pipelining).
"""

from typing import Iterable, List, Optional, Sequence, Union

from ._pipetrain import (  # noqa: F401  (re-exported)
    Action,
    CostModel,
    HeapPeak,
    Metrics,
    RankMetrics,
    Schedule,
    ScheduleError,
    Simulation,
    SkipEdge,
    StageCost,
    TimedAction,
    Timeline,
    TorchCsv,
    ZbExactResult,
    ascii_gantt,
    balance,
    balance_block_partition,
    balance_costs,
    balance_min_max,
    balance_uniform,
    bottleneck,
    check_balance,
    chrome_trace_json,
    compute_metrics,
    from_torch_csv,
    gantt_svg,
    load_profile,
    load_torch_csv,
    lower,
    parse_action,
    parse_cell,
    parse_pipedream_graph,
    parse_stage_costs,
    plan_pipedream,
    predict_heap,
    profile,
    profile_to_json,
    render_grid,
    schedule_names,
    schedule_traits,
    search_plans,
    stage_costs,
    stages_per_rank,
    strip_communication,
    to_torch_csv,
    umpipe,
    validate,
    write_file,
    zb_exact,
)
from . import _pipetrain

__version__ = "0.1.0"

ProfileLike = Union[dict, str]


def schedule(
    name: str,
    stages: int = 0,
    microbatches: int = 0,
    *,
    virtual: int = 1,
    steps: int = 1,
    memory_limit: float = 0.0,
    replication: Optional[Sequence[int]] = None,
    skips: Optional[Iterable[str]] = None,
    exact: bool = False,
    exact_nodes: int = 5_000_000,
    cost: str = "1:1:1",
    comm: float = 0.0,
    profile: Optional[ProfileLike] = None,
    balance: str = "time",
    balance_solver: str = "min-max",
    microbatch_size: float = 0.0,
    bandwidth: Optional[float] = None,
    latency: Optional[float] = None,
) -> Schedule:
    """Builds and validates a schedule, as ``pipetrain schedule --schedule NAME -p STAGES -m MICROBATCHES``.

    name: one of schedule_names() (gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-auto, zb-v, v-half, v-min,
    dualpipev, pipedream, 2bw, ...). stages (--stages, p) is the number of ranks; microbatches (-m) per
    optimizer step. virtual (-v): stages per rank of the looped schedules. memory_limit: activation memory
    per rank in micro-batches (checked; zb-auto's target, default p). replication (e.g. [3, 1]): 1F1B-RR
    over stage replicas (gpipe or 1f1b; stages may then be left 0). skips: 'FROM:TO[:SIZE]' routes.
    exact: with zb-auto, the branch-and-bound optimum (exact_nodes search nodes at most).
    cost/comm/profile/...: the costs zb-h2 and zb-auto plan with (see costs()).
    Raises ValueError (pipetrain.ScheduleError for an invalid schedule, with its grid).
    """
    s, _ = _pipetrain._schedule(
        name, stages, microbatches, virtual, steps, memory_limit, list(replication or []), list(skips or []),
        exact, exact_nodes, cost, comm, profile, balance, balance_solver, microbatch_size, bandwidth, latency)
    return s


generate = schedule


def costs(
    schedule: Schedule,
    *,
    cost: str = "1:1:1",
    comm: float = 0.0,
    profile: Optional[ProfileLike] = None,
    balance: str = "time",
    balance_solver: str = "min-max",
    microbatch_size: float = 0.0,
    bandwidth: Optional[float] = None,
    latency: Optional[float] = None,
    skip_bandwidth: float = 0.0,
) -> CostModel:
    """The cost model ``pipetrain simulate`` uses for a schedule: from cost ('F:B:W' for every rank, or one
    triple per rank or per stage; a rank's triple is split over its v chunks) and comm (time of one transfer),
    or from a profile (dict, JSON text or path) cut into the schedule's stages by balance (uniform,
    parameters, time, memory, type:REGEX or '3,2,2') with balance_solver (min-max or block-partition);
    bandwidth in GB/s and latency in us (default: the profile's measured transport, else free)."""
    return _pipetrain._costs(schedule, cost, comm, profile, balance, balance_solver, microbatch_size, bandwidth,
                             latency, skip_bandwidth)


def simulate(
    schedule: Union[Schedule, str],
    costs: Optional[CostModel] = None,
    *,
    reference: bool = False,
    stages: int = 0,
    microbatches: int = 0,
    virtual: int = 1,
    steps: int = 1,
    memory_limit: float = 0.0,
    replication: Optional[Sequence[int]] = None,
    skips: Optional[Iterable[str]] = None,
    exact: bool = False,
    exact_nodes: int = 5_000_000,
    cost: str = "1:1:1",
    comm: float = 0.0,
    profile: Optional[ProfileLike] = None,
    balance: str = "time",
    balance_solver: str = "min-max",
    microbatch_size: float = 0.0,
    bandwidth: Optional[float] = None,
    latency: Optional[float] = None,
    skip_bandwidth: float = 0.0,
) -> Simulation:
    """Simulates a schedule, as ``pipetrain simulate``: the timeline, makespan, both bubble measures
    (bubble_fraction = 1 - sum(busy) / (p * makespan); max_bubble = max over ranks of span - busy), per-stage
    busy/span/bubble/peak memory and the heap model's per-rank table.

    schedule: a Schedule, or a name built with the keyword arguments as schedule() does. costs: a CostModel,
    or (None) the one costs() makes from cost/comm/profile/... reference=True predicts the heap of the
    blocking reference executor. Returns a Simulation (to_dict() is ``simulate --json``'s object; svg(),
    chrome_trace(), write_svg(path), write_trace(path), table(), ascii()).
    """
    if isinstance(schedule, str):
        schedule = globals()["schedule"](
            schedule, stages, microbatches, virtual=virtual, steps=steps, memory_limit=memory_limit,
            replication=replication, skips=skips, exact=exact, exact_nodes=exact_nodes, cost=cost, comm=comm,
            profile=profile, balance=balance, balance_solver=balance_solver, microbatch_size=microbatch_size,
            bandwidth=bandwidth, latency=latency)
    if costs is None:
        costs = globals()["costs"](
            schedule, cost=cost, comm=comm, profile=profile, balance=balance, balance_solver=balance_solver,
            microbatch_size=microbatch_size, bandwidth=bandwidth, latency=latency, skip_bandwidth=skip_bandwidth)
    return _pipetrain._simulate(schedule, costs, reference)


def compare(
    names: Optional[Sequence[str]] = None,
    stages: int = 4,
    microbatches: int = 8,
    *,
    cost: str = "1:1:1",
    comm: float = 0.0,
    virtual: int = 2,
) -> List[dict]:
    """Simulates several schedules on the same sizes and costs (default: every name that builds for them)
    and returns one row per schedule: name, makespan, bubble_fraction, max_bubble, peak_memory (the largest
    rank's activations in micro-batches), ranks. Schedules that refuse the sizes are left out; the
    asynchronous ones (pipedream, 2bw, spectrain) are left out unless named."""
    rows = []
    explicit = names is not None
    for name in (names if explicit else schedule_names()):
        traits = schedule_traits(name)
        if not explicit and not traits["synchronous"]:
            continue
        v = virtual if traits["virtual_stages"] else 1
        try:
            sim = simulate(name, stages=stages, microbatches=microbatches, virtual=v, cost=cost, comm=comm)
        except ValueError:
            if explicit:
                raise
            continue
        rows.append({"name": name, "makespan": sim.makespan, "bubble_fraction": sim.bubble_fraction,
                     "max_bubble": sim.max_bubble, "peak_memory": sim.peak_memory, "ranks": sim.schedule.ranks,
                     "virtual": sim.schedule.virtual_stages})
    return rows


def format_table(rows: Sequence[dict], columns: Optional[Sequence[str]] = None) -> str:
    """Rows of dicts as an aligned text table (floats with 3 decimals)."""
    if not rows:
        return ""
    columns = list(columns or rows[0].keys())
    cells = [[f"{r[c]:.3f}" if isinstance(r[c], float) else str(r[c]) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(columns, widths))]
    lines += ["  ".join(x.rjust(w) for x, w in zip(row, widths)) for row in cells]
    return "\n".join(lines) + "\n"


__all__ = [n for n in dir() if not n.startswith("_")
           and n not in ("Iterable", "List", "Optional", "Sequence", "Union", "ProfileLike")]
