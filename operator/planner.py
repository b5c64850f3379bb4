"""The planner: one metric snapshot in, prefill and decode replica counts out, each with a reason.

Pure (no Kubernetes, no clock, no I/O): `decide(config, state, snapshot) -> (Decision, state)`.
The operator's timer (autoscaler.py) feeds it scraped snapshots and applies its decisions; the
cluster simulation (bench/planner_sim.py) feeds it simulated ones. The same code decides both.

Why two roles need two signals: prefill work is prompt tokens and bounds TTFT; decode work is
generated tokens and bounds ITL. Their right ratio moves with the prompt/output mix, so each
role is sized from its own token rate and its own latency target:

    need(role) = ceil(token rate / (capacity per worker at the SLO × target utilization))

The token rate is the demand: for prefill, the prompt tokens arriving at the router
(`pdserve_router_arrived_prompt_tokens`) when the routers report them, else the prompt tokens
the prefill workers did; for decode, the tokens the decode workers generated. Work done stops
growing when a role saturates (it plateaus at the role's capacity while the queue grows), so a
saturated prefill role is sized from what arrives, in one step, rather than one replica per
miss. Capacity is learned from what the workers did, never from what arrived; and what
arrives is scaled by the share of it the role was seen to do while it kept up (an estimated
count, short prompts that skip prefill), so both are in the workers' units.

*Capacity* (tokens/s one worker sustains while meeting the SLO) is predicted, not guessed from a
threshold: seeded from `spec.slo` (e.g. the GPU measurements in docs/) and corrected from what
the cluster shows. A role that misses its target at r tokens/s per worker cannot do r: the
estimate drops to r. A role comfortably inside its target at r tokens/s per worker can: the
estimate rises to r. Without any estimate yet, a missed target adds one replica (reactive).

Then, in this order: scale from zero (requests held by the router and no worker: one decode
worker, which serves whole requests; router/fallback.py), scale to zero (no traffic for
`scale_to_zero_after_s`), per-role min/max, the P:D ratio bound, the GPU budget (the role with
the most spare capacity gives GPUs up first), then time: scale-up waits `scale_up_cooldown_s`
after the role's last change, scale-down uses the highest need of the last
`scale_down_window_s` (no flapping on a dip), moves at most `max_scale_down_step` replicas, and
waits while the role still has pods draining (a removed worker finishes its in-flight requests
and pinned KV first: the worker's SIGTERM drain; the operator marks the idlest pods to go first).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

from pdserve.protocol.contract import ROLE_DECODE, ROLE_PREFILL

ROLES = (ROLE_PREFILL, ROLE_DECODE)
SIGNAL = {ROLE_PREFILL: "TTFT", ROLE_DECODE: "ITL"}


@dataclass(frozen=True)
class RoleBounds:
    min_replicas: int = 1
    max_replicas: int = 8
    gpus_per_replica: int = 1

    def __post_init__(self) -> None:
        if not 0 <= self.min_replicas <= self.max_replicas:
            raise ValueError(f"need 0 <= minReplicas ({self.min_replicas}) <= maxReplicas ({self.max_replicas})")
        if self.gpus_per_replica < 0:
            raise ValueError(f"gpus per replica must be >= 0, not {self.gpus_per_replica}")


@dataclass(frozen=True)
class PlannerConfig:
    ttft_s: float  # target TTFT at `percentile`
    itl_s: float  # target inter-token latency at `percentile`
    percentile: float = 0.9
    prefill: RoleBounds = RoleBounds()
    decode: RoleBounds = RoleBounds()
    gpu_budget: int | None = None  # most GPUs the two roles may hold together
    ratio_min: float | None = None  # prefill replicas per decode replica
    ratio_max: float | None = None
    # Plan for this fraction of the capacity: the headroom absorbs growth between two decisions
    # and the time a new worker takes to load.
    target_utilization: float = 0.8
    prefill_capacity_tps: float | None = None  # seed: prompt tokens/s one prefill worker does at the SLO
    decode_capacity_tps: float | None = None  # seed: generated tokens/s one decode worker does at the SLO
    scale_up_cooldown_s: float = 30.0
    scale_down_window_s: float = 300.0
    max_scale_down_step: int = 1
    scale_to_zero_after_s: float = 600.0
    # Latency under this fraction of its target counts as "comfortably meeting" it (capacity may rise).
    comfortable: float = 0.7

    def __post_init__(self) -> None:
        if self.ttft_s <= 0 or self.itl_s <= 0:
            raise ValueError("SLO targets must be > 0 seconds")
        if not 0 < self.percentile < 1:
            raise ValueError(f"percentile must be in (0, 1), not {self.percentile}")
        if not 0 < self.target_utilization <= 1:
            raise ValueError(f"targetUtilization must be in (0, 1], not {self.target_utilization}")
        if self.ratio_min is not None and self.ratio_max is not None and self.ratio_min > self.ratio_max:
            raise ValueError(f"ratio min ({self.ratio_min}) exceeds max ({self.ratio_max})")
        if self.gpu_budget is not None:
            floor = sum(b.min_replicas * b.gpus_per_replica for b in (self.prefill, self.decode))
            if self.gpu_budget < floor:
                raise ValueError(f"gpuBudget ({self.gpu_budget}) is below the minReplicas' GPUs ({floor})")
        if self.max_scale_down_step < 1:
            raise ValueError("max scale-down step must be >= 1")

    def bounds(self, role: str) -> RoleBounds:
        return self.prefill if role == ROLE_PREFILL else self.decode

    def target(self, role: str) -> float:
        return self.ttft_s if role == ROLE_PREFILL else self.itl_s

    def seed(self, role: str) -> float | None:
        return self.prefill_capacity_tps if role == ROLE_PREFILL else self.decode_capacity_tps


@dataclass(frozen=True)
class RoleSample:
    """One role, as scraped over the last interval."""

    replicas: int  # desired now (what the planner or the spec last set)
    ready: int  # ready workers
    token_rate: float  # tokens/s this role's workers did: prompt tokens (prefill), generated tokens (decode)
    latency_s: float | None = None  # TTFT (prefill) / ITL (decode) at the SLO percentile; None: no samples
    waiting: float = 0.0  # requests queued in this role's engines
    terminating: int = 0  # pods still draining after an earlier scale-down
    # Tokens/s arriving for this role, where known (prefill: the router's count of arriving prompt
    # tokens). What the workers did plateaus at their capacity once they saturate; what arrives
    # does not, so a saturated role is sized from this in one step.
    arrival_rate: float | None = None

    def demand(self, arrival_scale: float = 1.0) -> float:
        """Tokens/s to size for: what arrives (times the learned share of it this role does), or
        what was done when that is more (a burst's backlog being worked off)."""
        return max(self.token_rate, (self.arrival_rate or 0.0) * arrival_scale)


@dataclass(frozen=True)
class Snapshot:
    t: float  # seconds, any monotonic origin
    prefill: RoleSample
    decode: RoleSample
    held: int = 0  # requests the router holds for want of any worker (scale from zero)

    def role(self, role: str) -> RoleSample:
        return self.prefill if role == ROLE_PREFILL else self.decode

    @property
    def active(self) -> bool:
        return self.held > 0 or self.prefill.demand() > 0 or self.decode.demand() > 0 \
            or self.prefill.waiting > 0 or self.decode.waiting > 0


@dataclass(frozen=True)
class PlannerState:
    capacity: dict[str, float | None] = field(default_factory=dict)  # learned tokens/s per worker at the SLO
    last_change: dict[str, float] = field(default_factory=dict)  # role -> time of its last replica change
    needs: tuple[tuple[float, int, int], ...] = ()  # (t, prefill need, decode need) within the down window
    last_active: float | None = None
    started: float | None = None  # first snapshot: no scale-down or scale-to-zero before a full window
    # role -> tokens its workers do per token counted arriving, learned while the role keeps up
    # (target met, nothing queued). It absorbs what an arrival count cannot know: an estimated
    # count (a router without a tokenizer), requests that skip the role (selective P/D sends
    # short prompts straight to decode).
    arrival_scale: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Decision:
    prefill: int
    decode: int
    reasons: dict[str, str]  # role -> why it has this count now
    capacity: dict[str, float | None]

    def replicas(self, role: str) -> int:
        return self.prefill if role == ROLE_PREFILL else self.decode

    def changed(self, snapshot: Snapshot) -> dict[str, tuple[int, int]]:
        """role -> (from, to), for the roles whose count this decision changes."""
        return {r: (snapshot.role(r).replicas, self.replicas(r)) for r in ROLES
                if snapshot.role(r).replicas != self.replicas(r)}


def learn_capacity(config: PlannerConfig, role: str, known: float | None, sample: RoleSample) -> float | None:
    """The tokens/s one worker of `role` sustains at the SLO, corrected by this sample."""
    if sample.ready <= 0 or sample.token_rate <= 0 or sample.latency_s is None:
        return known
    per_worker = sample.token_rate / sample.ready
    target = config.target(role)
    if sample.latency_s > target:  # it cannot do this much within the SLO
        # Down at most 10% a decision: a miss may also be a backlog left by a burst or a cold
        # start, which says little about what a worker can do.
        return per_worker if known is None else min(known, max(per_worker, 0.9 * known))
    if sample.latency_s <= config.comfortable * target and known is not None and per_worker > known:
        return per_worker  # it did more than we thought, inside the SLO
    return known


def learn_arrival_scale(config: PlannerConfig, role: str, known: float | None, sample: RoleSample) -> float | None:
    """Work done per unit of arrivals, from an interval where the role kept up with what arrived
    (so the two describe the same requests); kept as is while the role is behind."""
    if not sample.arrival_rate or sample.token_rate <= 0 or sample.latency_s is None:
        return known
    if sample.latency_s > config.target(role) or sample.waiting > 0:
        return known
    seen = min(4.0, max(0.25, sample.token_rate / sample.arrival_rate))  # one odd interval moves it boundedly
    return seen if known is None else 0.5 * known + 0.5 * seen


def _raw_need(config: PlannerConfig, role: str, capacity: float | None, sample: RoleSample,
              arrival_scale: float = 1.0) -> tuple[int, str]:
    target, signal = config.target(role), SIGNAL[role]
    violating = sample.latency_s is not None and sample.latency_s > target
    seen = (
        f"{signal} p{round(config.percentile * 100)} "
        + (f"{sample.latency_s * 1000:.0f} ms" if sample.latency_s is not None else "n/a")
        + f" (target {target * 1000:.0f} ms)"
    )
    if capacity:
        demand = sample.demand(arrival_scale)
        need = math.ceil(demand / (capacity * config.target_utilization) - 1e-9)
        rate = f"{demand:.0f} tok/s" + (" arriving" if demand > sample.token_rate else "")
        why = f"{rate} at {capacity:.0f} tok/s per worker x {config.target_utilization:g}; {seen}"
        if violating and need <= sample.ready:
            need, why = sample.ready + 1, f"{seen} missed with the predicted count: one more"
        return need, why
    if violating:
        return sample.replicas + 1, f"{seen} missed, no capacity estimate yet: one more"
    return sample.replicas, f"no capacity estimate yet; {seen}"


def decide(config: PlannerConfig, state: PlannerState, snap: Snapshot) -> tuple[Decision, PlannerState]:
    capacity = {r: learn_capacity(config, r, state.capacity.get(r, config.seed(r)), snap.role(r)) for r in ROLES}
    scales = {r: learn_arrival_scale(config, r, state.arrival_scale.get(r), snap.role(r)) for r in ROLES}
    arrival_scale = {r: scales[r] or 1.0 for r in ROLES}
    started = snap.t if state.started is None else state.started
    last_active = snap.t if snap.active else state.last_active
    need: dict[str, int] = {}
    why: dict[str, str] = {}
    for r in ROLES:
        need[r], why[r] = _raw_need(config, r, capacity[r], snap.role(r), arrival_scale[r])

    # Zero: wake on a held request; sleep after a quiet spell.
    if snap.held > 0 and snap.prefill.replicas == 0 and snap.decode.replicas == 0:
        need[ROLE_DECODE] = max(need[ROLE_DECODE], 1)
        why[ROLE_DECODE] = f"scale from zero: {snap.held} request(s) held by the router"
    elif snap.active and need[ROLE_DECODE] == 0 and need[ROLE_PREFILL] == 0:
        need[ROLE_DECODE], why[ROLE_DECODE] = 1, "traffic: at least one worker serves"
    idle_for = snap.t - (last_active if last_active is not None else started)
    if not snap.active and idle_for >= config.scale_to_zero_after_s:
        for r in ROLES:
            need[r], why[r] = 0, f"no traffic for {idle_for:.0f}s"

    # Per-role bounds, then the P:D ratio, then the budget.
    for r in ROLES:
        b = config.bounds(r)
        clamped = min(max(need[r], b.min_replicas), b.max_replicas)
        if clamped != need[r]:
            why[r] += f"; kept within {b.min_replicas}..{b.max_replicas}"
        need[r] = clamped
    _ratio(config, need, why)
    _budget(config, capacity, arrival_scale, snap, need, why)

    # Time: cooldown up, stabilised and stepped down, drains first.
    window = tuple(x for x in state.needs if snap.t - x[0] < config.scale_down_window_s) + (
        (snap.t, need[ROLE_PREFILL], need[ROLE_DECODE]),)
    out: dict[str, int] = {}
    last_change = dict(state.last_change)
    for i, r in enumerate(ROLES):
        now = snap.role(r).replicas
        want = need[r]
        since = snap.t - last_change.get(r, -math.inf)
        if want > now:
            if since < config.scale_up_cooldown_s and not (now == 0 and snap.held > 0):
                want, why[r] = now, f"up to {need[r]} waits for the cooldown ({since:.0f}s of " \
                                    f"{config.scale_up_cooldown_s:g}s); " + why[r]
        elif want < now:
            stable = max(x[1 + i] for x in window)
            if snap.t - started < config.scale_down_window_s:
                want, why[r] = now, f"down to {need[r]} waits: planner started {snap.t - started:.0f}s ago " \
                                    f"(window {config.scale_down_window_s:g}s)"
            elif snap.role(r).terminating > 0:
                want, why[r] = now, f"down to {need[r]} waits: {snap.role(r).terminating} pod(s) still draining"
            elif stable >= now:
                want, why[r] = now, f"down to {need[r]} waits: needed {stable} within the last " \
                                    f"{config.scale_down_window_s:g}s"
            else:
                want = max(stable, now - config.max_scale_down_step)
                why[r] = f"down: {why[r]}"
        out[r] = want
    # The budget binds what is asked now, too: a role held up by its scale-down window leaves
    # only the rest to a role scaling up.
    if config.gpu_budget is not None:
        for r in ROLES:
            now, g = snap.role(r).replicas, config.bounds(r).gpus_per_replica
            over = sum(out[x] * config.bounds(x).gpus_per_replica for x in ROLES) - config.gpu_budget
            if over > 0 and out[r] > now and g:
                cut = min(out[r] - now, math.ceil(over / g))
                out[r] -= cut
                why[r] += f"; {cut} fewer: the GPU budget ({config.gpu_budget}) is held by the other role"
    for r in ROLES:
        if out[r] != snap.role(r).replicas:
            last_change[r] = snap.t
    decision = Decision(out[ROLE_PREFILL], out[ROLE_DECODE], why, capacity)
    return decision, replace(state, capacity=capacity, last_change=last_change, needs=window, last_active=last_active,
                              started=started, arrival_scale={r: v for r, v in scales.items() if v is not None})


def _ratio(config: PlannerConfig, need: dict[str, int], why: dict[str, str]) -> None:
    d = need[ROLE_DECODE]
    if d == 0:
        return
    p_max = config.prefill.max_replicas
    if config.ratio_min is not None and need[ROLE_PREFILL] < config.ratio_min * d - 1e-9:
        need[ROLE_PREFILL] = min(p_max, math.ceil(config.ratio_min * d - 1e-9))
        why[ROLE_PREFILL] += f"; raised to keep P:D >= {config.ratio_min:g}"
    if config.ratio_max is not None and need[ROLE_PREFILL] > config.ratio_max * d + 1e-9:
        more = min(config.decode.max_replicas, math.ceil(need[ROLE_PREFILL] / config.ratio_max - 1e-9))
        if more > d:
            need[ROLE_DECODE] = more
            why[ROLE_DECODE] += f"; raised to keep P:D <= {config.ratio_max:g}"
        if need[ROLE_PREFILL] > config.ratio_max * need[ROLE_DECODE] + 1e-9:
            need[ROLE_PREFILL] = max(
                config.prefill.min_replicas, math.floor(config.ratio_max * need[ROLE_DECODE] + 1e-9)
            )
            why[ROLE_PREFILL] += f"; lowered to keep P:D <= {config.ratio_max:g}"


def _ratio_ok(config: PlannerConfig, p: int, d: int) -> bool:
    if d == 0:
        return True
    return (config.ratio_min is None or p >= config.ratio_min * d - 1e-9) and \
        (config.ratio_max is None or p <= config.ratio_max * d + 1e-9)


def _budget(config: PlannerConfig, capacity: dict[str, float | None], arrival_scale: dict[str, float],
            snap: Snapshot, need: dict[str, int], why: dict[str, str]) -> None:
    """Over the GPU budget: take replicas from the role that would run least loaded without
    them (its token rate over what it keeps), one at a time, never below a role's minimum."""
    if config.gpu_budget is None:
        return

    def gpus() -> int:
        return sum(need[r] * config.bounds(r).gpus_per_replica for r in ROLES)

    cut = {r: 0 for r in ROLES}
    while gpus() > config.gpu_budget:
        candidates = [r for r in ROLES if need[r] > config.bounds(r).min_replicas and config.bounds(r).gpus_per_replica]
        if not candidates:
            break
        # Prefer cuts that keep the P:D bound; with none, any (the ratio then gives way to the budget).
        keeps = [r for r in candidates if _ratio_ok(config, need[ROLE_PREFILL] - (r == ROLE_PREFILL),
                                                    need[ROLE_DECODE] - (r == ROLE_DECODE))]
        candidates = keeps or candidates

        def load_after(r: str) -> float:
            left = need[r] - 1
            if left <= 0:
                return math.inf
            return snap.role(r).demand(arrival_scale[r]) / (left * (capacity[r] or 1.0))

        r = min(candidates, key=load_after)
        need[r] -= 1
        cut[r] += 1
    for r in ROLES:
        if cut[r]:
            why[r] += f"; {cut[r]} fewer to fit the GPU budget ({config.gpu_budget})"
