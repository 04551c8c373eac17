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

import operator
import os
import warnings
from typing import Iterable, List, Optional, Sequence, Tuple, Union

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

ProfileLike = Union[dict, str, "os.PathLike[str]"]


def _str_list(value, keyword: str) -> List[str]:
    """A list of strings given as a list (or any iterable of str); one bare string is refused, not split."""
    if value is None:
        return []
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{keyword} must be a list of strings, got the string {value!r}: "
                        f"wrap it in a list, e.g. {keyword}=[{value!r}]")
    out = list(value)
    for item in out:
        if not isinstance(item, str):
            raise TypeError(f"{keyword} must be a list of strings, got an item {item!r} ({type(item).__name__})")
    return out


def _int_list(value, keyword: str) -> List[int]:
    if value is None:
        return []
    if isinstance(value, (str, bytes)):
        raise TypeError(f"{keyword} must be a list of integers, got the string {value!r}")
    return list(value)


def _check_int(key: str, value) -> None:
    """An integer keyword the extension takes as a C++ int: a bool, a float or a str, or a value past int's
    range, raises ValueError naming it (pybind11 listed the private function's 19 positional values)."""
    if value is None:
        return
    try:  # an int, or what stands for one (numpy's integers): not a bool, float or str
        if isinstance(value, bool):
            raise TypeError
        value = operator.index(value)
    except TypeError:
        raise ValueError(f"{key}={value!r} must be a whole number (int), got {type(value).__name__}") from None
    if not -2**31 <= value < 2**31:
        raise ValueError(f"{key}={value!r} is out of range: give a whole number below 2**31")


# The keywords that give the stages' costs, with the command line's defaults (--cost, --comm, --profile, ...).
_COST_DEFAULTS = {"cost": "1:1:1", "comm": 0.0, "profile": None, "balance": "time", "balance_solver": "min-max",
                  "microbatch_size": 0.0, "bandwidth": None, "latency": None, "pipedream_batch": 0}
# The ones that shape a profile's costs (--cost replaces them all), and the one a profile replaces.
_PROFILE_KEYS = ("profile", "balance", "balance_solver", "microbatch_size", "bandwidth", "latency", "pipedream_batch")


def _cost_keywords(given: dict, built: Optional[dict], where: str) -> dict:
    """The cost keywords a run uses: those given (None: not given), else the ones the Schedule was built with
    (Schedule.built_with), else the defaults. cost= replaces a recorded profile (and its balance, ...) and
    profile= a recorded cost, as --cost and --profile exclude each other. The keywords that shape a profile's
    costs raise ValueError without a profile, as their flags do without --profile (they would do nothing)."""
    if given.get("profile") is None and not (built and built.get("profile") is not None and given.get("cost") is None):
        for key in _PROFILE_KEYS[1:]:
            if given.get(key) is not None:
                raise ValueError(f"{where}: {key}={given[key]!r} applies with profile= (it shapes a profile's costs), "
                                 f"and none is given: the costs come from cost= and comm= here: add profile=..., or "
                                 f"drop {key}=")
    out = dict(_COST_DEFAULTS)
    if built:
        base = {k: built[k] for k in _COST_DEFAULTS if k in built}
        if given.get("cost") is not None:
            for k in _PROFILE_KEYS:
                base.pop(k, None)
        if given.get("profile") is not None:
            base.pop("cost", None)
        out.update(base)
    out.update({k: v for k, v in given.items() if v is not None})
    return out


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
    cost: Optional[str] = None,
    comm: Optional[float] = None,
    profile: Optional[ProfileLike] = None,
    balance: Optional[str] = None,
    balance_solver: Optional[str] = None,
    microbatch_size: Optional[float] = None,
    bandwidth: Optional[float] = None,
    latency: Optional[float] = None,
    pipedream_batch: Optional[int] = None,
    return_exact: bool = False,
) -> Union[Schedule, Tuple[Schedule, Optional[ZbExactResult]]]:
    """Builds and validates a schedule, as ``pipetrain schedule --schedule NAME -p STAGES -m MICROBATCHES``.

    name: one of schedule_names() (gpipe, 1f1b, interleaved, zb-h1, zb-h2, zb-auto, zb-v, v-half, v-min,
    dualpipev, pipedream, 2bw, ...). stages (--stages, p) is the number of ranks; microbatches (-m) per
    optimizer step. virtual (-v): stages per rank of the looped schedules. memory_limit: activation memory
    per rank in micro-batches (checked; zb-auto's target, default p). replication (e.g. [3, 1]): 1F1B-RR
    over stage replicas (gpipe or 1f1b; stages may then be left 0). skips: 'FROM:TO[:SIZE]' routes.
    exact: with zb-auto, the branch-and-bound optimum (exact_nodes search nodes at most).
    cost/comm/profile/...: the costs zb-h2 and zb-auto plan with (see costs()); the schedule remembers them
    (Schedule.built_with), and simulate(schedule) and costs(schedule) use them unless given others, so
    ``simulate(schedule("zb-auto", ..., cost="1:1.5:1"))`` times it at the costs it was planned for.
    Left out (None), they are the command line's (cost '1:1:1', comm 0, balance 'time', balance_solver
    'min-max', ...); balance, balance_solver, microbatch_size, bandwidth, latency and pipedream_batch shape a
    profile's costs and raise ValueError without profile=, as their flags do without --profile.
    pipedream_batch (--pipedream-batch): the batch size a PipeDream graph file given as profile was profiled
    at (its format does not record it; VGG-16's: 128); without it such a file is read at 1, with a warning.
    return_exact=True returns (schedule, ZbExactResult of the exact search or None): the summary
    (greedy_makespan, gap_percent, proven, ...) that ``pipetrain schedule --exact`` prints.
    Raises ValueError (pipetrain.ScheduleError for an invalid schedule, with its grid); TypeError for a
    string where a list belongs (skips=['0:3'], not skips='0:3').
    """
    for key, value in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual), ("steps", steps),
                       ("exact_nodes", exact_nodes), ("pipedream_batch", pipedream_batch)):
        _check_int(key, value)
    replication_list = _int_list(replication, "replication")
    skip_list = _str_list(skips, "skips")
    kw = _cost_keywords(dict(cost=cost, comm=comm, profile=profile, balance=balance, balance_solver=balance_solver,
                             microbatch_size=microbatch_size, bandwidth=bandwidth, latency=latency,
                             pipedream_batch=pipedream_batch), None, "schedule")
    s, found = _pipetrain._schedule(
        name, stages, microbatches, virtual, steps, memory_limit, replication_list, skip_list, exact, exact_nodes,
        kw["cost"], kw["comm"], kw["profile"], kw["balance"], kw["balance_solver"], kw["microbatch_size"],
        kw["bandwidth"], kw["latency"], kw["pipedream_batch"])
    s.built_with = dict(name=name, stages=stages, microbatches=microbatches, virtual=virtual, steps=steps,
                        memory_limit=memory_limit, replication=replication_list or None, skips=skip_list,
                        exact=bool(exact), exact_nodes=exact_nodes, exact_result=found, **kw)
    return (s, found) if return_exact else s


generate = schedule


def costs(
    schedule: Schedule,
    *,
    cost: Optional[str] = None,
    comm: Optional[float] = None,
    profile: Optional[ProfileLike] = None,
    balance: Optional[str] = None,
    balance_solver: Optional[str] = None,
    microbatch_size: Optional[float] = None,
    bandwidth: Optional[float] = None,
    latency: Optional[float] = None,
    pipedream_batch: Optional[int] = None,
    skip_bandwidth: float = 0.0,
) -> CostModel:
    """The cost model ``pipetrain simulate`` uses for a schedule: from cost ('F:B:W' for every rank, or one
    triple per rank or per stage; a rank's triple is split over its v chunks) and comm (time of one transfer),
    or from a profile (dict, JSON text or path) cut into the schedule's stages by balance (uniform,
    parameters, time, memory, type:REGEX or '3,2,2') with balance_solver (min-max or block-partition);
    bandwidth in GB/s and latency in us (default: the profile's measured transport, else free);
    pipedream_batch: the batch size a PipeDream graph file was profiled at (--pipedream-batch).
    Defaults: a keyword not given (None) is the one schedule() built the schedule with (Schedule.built_with:
    cost= replaces a recorded profile, profile= a recorded cost), else the command line's (cost '1:1:1',
    comm 0, balance time, ...).
    The schedule is validated first (ScheduleError if it is not a complete, consistent schedule)."""
    kw = _cost_keywords(dict(cost=cost, comm=comm, profile=profile, balance=balance, balance_solver=balance_solver,
                             microbatch_size=microbatch_size, bandwidth=bandwidth, latency=latency,
                             pipedream_batch=pipedream_batch), getattr(schedule, "built_with", None), "costs")
    return _checked_costs(schedule, checked=False, skip_bandwidth=skip_bandwidth, **kw)


_schedule_costs = costs  # the function, for the wrappers below whose own parameter is named costs


def _own_costs(schedule: Schedule, costs: Optional[CostModel]) -> Optional[CostModel]:
    """costs, or (None) those of the keywords schedule() built the schedule with, as simulate() takes them."""
    if costs is None and isinstance(schedule, Schedule) and schedule.built_with:
        return _schedule_costs(schedule)
    return costs


def _keep_built_with(source: Schedule, out: Schedule) -> Schedule:
    if isinstance(source, Schedule) and source.built_with is not None:
        out.built_with = dict(source.built_with)
    return out


def lower(schedule: Schedule, costs: Optional[CostModel] = None) -> Schedule:
    """Inserts the send and receive actions (pipetrain schedule --lower), in an order that cannot deadlock on
    blocking transports. costs only decide how early transfers are posted: None is the costs the schedule was
    built with (Schedule.built_with, as simulate() takes them; schedule --lower --cost ... does the same),
    else F = B = W = 1. The result keeps Schedule.built_with, so simulate(lower(s)) times it at s's costs."""
    return _keep_built_with(schedule, _pipetrain.lower(schedule, _own_costs(schedule, costs)))


def strip_communication(schedule: Schedule) -> Schedule:
    """The inverse of lower(); the result keeps Schedule.built_with."""
    return _keep_built_with(schedule, _pipetrain.strip_communication(schedule))


def predict_heap(schedule: Schedule, costs: Optional[CostModel] = None, reference: bool = False,
                 receives_ahead: int = 4, sends_in_flight: int = 4):
    """Per rank the peak of what a step adds to the heap (activations, weight gradients, transfer buffers).
    costs: None is the costs the schedule was built with (Schedule.built_with), as simulate() takes them,
    else micro-batches at F = B = W = 1 (memory in micro-batches). reference=True: the blocking reference
    executor (train --reference)."""
    return _pipetrain.predict_heap(schedule, _own_costs(schedule, costs), reference, receives_ahead, sends_in_flight)


def _checked_costs(schedule: Schedule, checked: bool = True, **kw) -> CostModel:
    # checked=True: costs() for a schedule simulate() has validated already.
    return _pipetrain._costs(schedule, kw["cost"], kw["comm"], kw["profile"], kw["balance"], kw["balance_solver"],
                             kw["microbatch_size"], kw["bandwidth"], kw["latency"], kw["skip_bandwidth"],
                             kw["pipedream_batch"], checked)


def _own_sizes(schedule: Schedule, key: str, value):
    """Whether a generation keyword given with a Schedule object agrees with it, and what it has."""
    if key == "stages":  # schedule()'s stages: its ranks (p), or with replication its stages
        if schedule.stage_replicas:
            replicas = [len(r) for r in schedule.stage_replicas]
            return value == schedule.stages, (f"it has {schedule.stages} stages, replicated {replicas}; with "
                                              "replication, stages= counts the stages")
        return value == schedule.ranks, f"it has {schedule.ranks} ranks; stages= counts the ranks, p"
    if key == "microbatches":
        return value == schedule.microbatches_per_step, f"it has {schedule.microbatches_per_step} micro-batches per step"
    if key == "virtual":  # as schedule() reads it: the V shapes take 1 (their default) or 2
        own = schedule.virtual_stages
        try:
            agrees = stages_per_rank(schedule.name, value) == own
        except ValueError:
            agrees = value == own
        return agrees, f"it has {own} stages per rank"
    return value == schedule.steps, f"it has {schedule.steps} steps"


def simulate(
    schedule: Union[Schedule, str],
    costs: Optional[CostModel] = None,
    *,
    reference: bool = False,
    stages: Optional[int] = None,
    microbatches: Optional[int] = None,
    virtual: Optional[int] = None,
    steps: Optional[int] = None,
    memory_limit: float = 0.0,
    replication: Optional[Sequence[int]] = None,
    skips: Optional[Iterable[str]] = None,
    exact: Optional[bool] = None,
    exact_nodes: Optional[int] = None,
    cost: Optional[str] = None,
    comm: Optional[float] = None,
    profile: Optional[ProfileLike] = None,
    balance: Optional[str] = None,
    balance_solver: Optional[str] = None,
    microbatch_size: Optional[float] = None,
    bandwidth: Optional[float] = None,
    latency: Optional[float] = None,
    pipedream_batch: Optional[int] = None,
    skip_bandwidth: float = 0.0,
) -> Simulation:
    """Simulates a schedule, as ``pipetrain simulate``: the timeline, makespan, both bubble measures
    (bubble_fraction = 1 - sum(busy) / (p * makespan); max_bubble = max over ranks of span - busy), per-stage
    busy/span/bubble/peak memory and the heap model's per-rank table.

    schedule: a name, built with the keyword arguments as schedule() does, or a Schedule object, handled as
    ``pipetrain simulate --load FILE``: validated first (with memory_limit, in micro-batches, when > 0),
    skips added to a copy (the caller's Schedule is left alone). The keywords that only shape a generated
    schedule (stages, microbatches, virtual, steps, replication, exact, exact_nodes) raise TypeError with a
    Schedule object, unless they equal what the schedule already has: stages its ranks (p), or its stages
    when it replicates them (replication=[3, 1]: stages=2); microbatches per step; replication its replicas
    per stage; exact=True (and exact_nodes) a schedule that schedule(..., exact=True) built, whose search
    summary the Simulation then carries.
    costs: a CostModel (then no cost keyword may be given: TypeError), or (None) the one costs() makes from
    cost/comm/profile/... . A cost keyword not
    given (None) is, for a Schedule object that schedule() built, the one it was built with
    (Schedule.built_with; cost= replaces a recorded profile and profile= a recorded cost), else the command
    line's default (cost '1:1:1', comm 0, balance 'time', ...): ``simulate(schedule("zb-auto", ...,
    cost="1:1.5:1"))`` times it at 1:1.5:1, as ``simulate -s zb-auto ... --cost 1:1.5:1`` does; a Schedule
    read from a file (Schedule.load_csv) has none recorded, as ``simulate --load``. pipedream_batch
    (--pipedream-batch): the batch size a PipeDream graph file given as profile was profiled at.
    reference=True predicts the heap of the blocking reference executor. Returns a Simulation (to_dict()
    is ``simulate --json``'s object, with 'exact' after exact=True; svg(), chrome_trace(),
    write_svg(path), write_trace(path), table(), ascii()).
    """
    found = None
    given_costs = dict(cost=cost, comm=comm, profile=profile, balance=balance, balance_solver=balance_solver,
                       microbatch_size=microbatch_size, bandwidth=bandwidth, latency=latency,
                       pipedream_batch=pipedream_batch)
    if costs is not None:  # a CostModel fixes every cost: the cost keywords would do nothing
        named = [f"{k}={v!r}" for k, v in given_costs.items() if v is not None]
        if skip_bandwidth:
            named.append(f"skip_bandwidth={skip_bandwidth!r}")
        if named:
            raise TypeError(f"simulate: costs= is a CostModel, which fixes every cost, and {', '.join(named)} would "
                            "do nothing: drop costs= (the keywords then make the costs, as costs() does), or drop "
                            f"{'them' if len(named) > 1 else 'it'}; to plan a schedule with some costs and time it with "
                            "a CostModel, build it with schedule(...) first")
    if isinstance(schedule, str):
        kw = _cost_keywords(given_costs, None, "simulate")
        schedule, found = globals()["schedule"](
            schedule, 0 if stages is None else stages, 0 if microbatches is None else microbatches,
            virtual=1 if virtual is None else virtual, steps=1 if steps is None else steps,
            memory_limit=memory_limit, replication=replication, skips=skips, exact=bool(exact),
            exact_nodes=5_000_000 if exact_nodes is None else exact_nodes, return_exact=True, **given_costs)
    elif isinstance(schedule, Schedule):
        built = schedule.built_with
        kw = _cost_keywords(given_costs, built, "simulate")
        for key, value in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual),
                           ("steps", steps)):
            if value is None:
                continue
            agrees, own = _own_sizes(schedule, key, value)
            if not agrees:
                raise TypeError(f"simulate: {key}={value!r} shapes a generated schedule, but the Schedule object "
                                f"already fixes it ({own}): drop {key}=, or give a schedule name")
        if replication is not None:
            own_replicas = [len(r) for r in schedule.stage_replicas]
            if _int_list(replication, "replication") != own_replicas:
                has = (f"it has replicas per stage {own_replicas}, its stage_replicas" if own_replicas
                       else "it has no replicated stages")
                raise TypeError(f"simulate: replication={list(replication)!r} applies to a generated schedule, but the "
                                f"Schedule object already fixes it ({has}): drop replication=, or give a schedule name")
        own_exact = bool(built and built.get("exact"))
        if (exact is not None and bool(exact) != own_exact) or (
                exact_nodes is not None and not (own_exact and built.get("exact_nodes") == exact_nodes)):
            has = (f"it is the exact search's, with exact_nodes={built.get('exact_nodes')}" if own_exact
                   else "it was not built with exact=True")
            named = ", ".join(f"{k}={v!r}" for k, v in (("exact", exact), ("exact_nodes", exact_nodes)) if v is not None)
            raise TypeError(f"simulate: {named} searches zb-auto's schedules, but "
                            f"the Schedule object is already fixed ({has}): drop exact=/exact_nodes=, or give the "
                            "name 'zb-auto'")
        if exact and own_exact:
            found = built.get("exact_result")
        schedule = _pipetrain._prepare(schedule, memory_limit, _str_list(skips, "skips"))
    else:
        raise TypeError(f"simulate: schedule must be a Schedule or a schedule name (str, one of schedule_names()), "
                        f"got {type(schedule).__name__}")
    if costs is None:
        costs = _checked_costs(schedule, skip_bandwidth=skip_bandwidth, **kw)
    elif not isinstance(costs, CostModel):
        raise TypeError(f"simulate: costs must be a CostModel or None, got {type(costs).__name__}")
    return _pipetrain._simulate(schedule, costs, reference, found, True)


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
    rank's activations in micro-batches), ranks, virtual. The asynchronous schedules (pipedream, 2bw,
    spectrain) are left out unless named.

    Bad arguments raise ValueError (a malformed cost, a cost with neither 1, stages nor stages x virtual
    triples, comm < 0 or not finite, stages, microbatches or virtual < 1). A schedule that cannot be
    generated for these sizes (e.g. interleaved when microbatches is not a multiple of stages) is left out
    with a warning (UserWarning) that names it and says why; a named one raises instead."""
    for key, value in (("stages", stages), ("microbatches", microbatches), ("virtual", virtual)):
        if not isinstance(value, int) or isinstance(value, bool) or value < 1:
            raise ValueError(f"compare: {key}={value!r} must be an integer >= 1")
    if not isinstance(comm, (int, float)) or not (0 <= comm < float("inf")):
        raise ValueError(f"compare: comm={comm!r} must be a finite number >= 0 (time of one transfer)")
    triples = len(parse_stage_costs(cost))  # ValueError naming the cell for a malformed cost
    if triples not in (1, stages, stages * virtual):
        raise ValueError(f"compare: cost={cost!r} lists {triples} F:B:W triples but stages is {stages}: give one "
                         f"triple for every stage, one per stage ({stages}), or one per virtual stage "
                         f"({stages * virtual})")
    explicit = names is not None
    if explicit:
        names = _str_list(names, "names")
    rows = []
    for name in (names if explicit else schedule_names()):
        traits = schedule_traits(name)
        if not explicit and not traits["synchronous"]:
            continue
        v = virtual if traits["virtual_stages"] else 1
        try:
            sim = simulate(name, stages=stages, microbatches=microbatches, virtual=v, cost=cost, comm=comm)
        except ValueError as e:
            if explicit:
                raise
            reason = str(e).splitlines()[0] if str(e) else type(e).__name__
            warnings.warn(f"compare: {name} left out: it cannot be built for stages={stages}, "
                          f"microbatches={microbatches}, virtual={v}: {reason}", UserWarning, stacklevel=2)
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
           and n not in ("Iterable", "List", "Optional", "Sequence", "Tuple", "Union", "ProfileLike", "os", "warnings")]
