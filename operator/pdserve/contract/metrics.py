"""pdserve's own metrics that another process reads: the gateway exposes them, the operator's
Builtin render autoscaler and the chart's Prometheus Adapter rules scale render on them."""

from __future__ import annotations

# Per render replica (label RENDER_POD_LABEL): render and derender call latency, queueing in
# the render server included. The rate of its _sum is the busy time render scales on.
GATEWAY_RENDER_CALL_SECONDS = "pdserve_gateway_render_call_seconds"
GATEWAY_RENDER_CALL_SECONDS_SUM = f"{GATEWAY_RENDER_CALL_SECONDS}_sum"
RENDER_POD_LABEL = "render_pod"
# 1 while Auto mode routes everything local because P/D is failing, and the recent P/D handoff
# failures behind it: the operator's transport monitor reports them as GatewayFallback.
GATEWAY_PD_DEGRADED = "pdserve_gateway_pd_degraded"
GATEWAY_PD_RECENT_FAILURES = "pdserve_gateway_pd_recent_failures"
