"""From raw recommendations to decisions: bounds, stabilization windows, steps and cooldowns,
the same semantics as the HPA behaviour pdserve writes for render. Pure: the time of each call
is passed in (`now`), and what must be remembered between calls is a value (ScalerState)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.api import DisaggregatedModel
from pdserve.api.autoscaling import ScalingBehaviour


@dataclass(frozen=True)
class Behaviour:
    min_replicas: int
    max_replicas: int
    up_window: float
    down_window: float
    up_step: int
    down_step: int
    cooldown: float

    @classmethod
    def of(cls, spec: ScalingBehaviour, bounds: tuple[int, int] | None = None) -> Behaviour:
        low, high = bounds or (spec.min_replicas, spec.max_replicas)
        return cls(
            low, high, spec.scale_up_stabilization_seconds,
            spec.scale_down_stabilization_seconds, spec.scale_up_step, spec.scale_down_step,
            spec.cooldown_seconds,
        )  # fmt: skip

    def strictest(self, other: Behaviour) -> Behaviour:
        """The more conservative of two (slices follow both pools' settings)."""
        return Behaviour(
            self.min_replicas, self.max_replicas, max(self.up_window, other.up_window),
            max(self.down_window, other.down_window), min(self.up_step, other.up_step),
            min(self.down_step, other.down_step), max(self.cooldown, other.cooldown),
        )  # fmt: skip


@dataclass(frozen=True)
class ScalerState:
    """What `decide` remembers between calls: recent recommendations and the last steps."""

    history: tuple[tuple[float, int], ...] = ()
    last_up: float | None = None
    last_down: float | None = None
    started: float | None = None  # the first recommendation: a window must be filled first


@dataclass(frozen=True)
class Decision:
    replicas: int
    current: int
    reason: str

    @property
    def direction(self) -> str:
        if self.replicas > self.current:
            return "up"
        return "down" if self.replicas < self.current else "hold"


def throughout(window: float) -> str:
    return f" throughout {window:g} s" if window else ""


def decide(
    current: int, recommended: int, now: float, state: ScalerState, behaviour: Behaviour
) -> tuple[Decision, ScalerState]:
    """HPA semantics: a scale-up goes to the lowest recommendation of the up window, a
    scale-down to the highest of the down window (so brief swings change nothing), and only once
    a whole window has been observed (after a restart too); then at most one step per direction
    per cooldown; then the bounds, which always hold."""
    horizon = max(behaviour.up_window, behaviour.down_window)
    kept = [h for h in state.history if now - h[0] <= horizon]
    history = (*kept, (now, recommended))
    started = now if state.started is None else state.started
    up = min(r for t, r in history if now - t <= behaviour.up_window)
    down = max(r for t, r in history if now - t <= behaviour.down_window)
    target, why = current, "within the stabilization windows"
    if up > current and now - started >= behaviour.up_window:
        target, why = up, f"recommended {up}" + throughout(behaviour.up_window)
    elif down < current and now - started >= behaviour.down_window:
        target, why = down, f"recommended at most {down}" + throughout(behaviour.down_window)
    state = replace(state, history=history, started=started)
    if target > current:
        if state.last_up is not None and now - state.last_up < behaviour.cooldown:
            target, why = current, f"scale-up cooldown ({behaviour.cooldown:g} s)"
        elif target > current + behaviour.up_step:
            target, why = current + behaviour.up_step, why + f"; {behaviour.up_step} per step"
    elif target < current:
        if state.last_down is not None and now - state.last_down < behaviour.cooldown:
            target, why = current, f"scale-down cooldown ({behaviour.cooldown:g} s)"
        elif target < current - behaviour.down_step:
            target, why = current - behaviour.down_step, why + f"; {behaviour.down_step} per step"
    bounded = max(behaviour.min_replicas, min(behaviour.max_replicas, target))
    if bounded != target:
        why += f"; bounded to {behaviour.min_replicas}-{behaviour.max_replicas}"
    if bounded > current:
        state = replace(state, last_up=now)
    elif bounded < current:
        state = replace(state, last_down=now)
    return Decision(bounded, current, why), state


def behaviour_of(dm: DisaggregatedModel, pool: str) -> Behaviour:
    """The behaviour of one Builtin pool (render, prefill, decode) or of the slices, which follow
    the stricter settings of both engine pools within the spec's slice bounds."""
    if pool == "render":
        return Behaviour.of(dm.spec.render.autoscaling)
    if pool == "slices":
        merged: Behaviour | None = None
        for _, scaled in dm.spec.engine_pools():
            assert scaled.autoscaling is not None
            this = Behaviour.of(scaled.autoscaling, dm.spec.slice_bounds())
            merged = this if merged is None else merged.strictest(this)
        assert merged is not None
        return merged
    engine = dm.spec.prefill if pool == "prefill" else dm.spec.decode
    assert engine is not None
    assert engine.autoscaling is not None
    return Behaviour.of(engine.autoscaling)
