"""A resync of a settled DisaggregatedModel writes nothing (no apply, no pod annotation, no
status patch) and leaves the replicas an HPA set; a status write needs something new to say,
such as the transport health scraper's first verdict, and then happens once."""

from __future__ import annotations

from pdserve.controller.health import HealthVerdict, TransportMonitor
from pdserve.controller.reconcile import DM_KIND
from tests.support.fakekube import NAME, NS, FakeKube, model_in, one_pass, settled


async def test_a_settled_resync_writes_nothing_and_leaves_hpa_replicas_alone() -> None:
    kube, health = FakeKube(), TransportMonitor(lambda _: None)
    model_in(kube)
    await settled(kube, health=health)
    body = await kube.get(DM_KIND, NS, NAME)
    assert body is not None
    assert body["status"]["phase"] == "Ready"
    kube.scale("Deployment", NS, "qwen-render", 3)  # the HPA
    await settled(kube, health=health)
    for _ in range(3):  # resyncs
        writes = len(kube.writes)
        again = await one_pass(kube, health=health)
        assert kube.writes[writes:] == []
        assert (again.applied, again.pruned, again.status_written) == ([], [], False)
    render = kube.objects[("Deployment", NS, "qwen-render")]
    assert render["spec"]["replicas"] == 3
    body = await kube.get(DM_KIND, NS, NAME)
    assert body is not None
    assert body["status"]["pools"]["render"]["summary"] == "3/3"


async def test_only_a_new_transport_verdict_writes_status_and_only_once() -> None:
    # The health scraper's first verdict (on the local plane: decode pods' /metrics do not
    # answer) comes at its own period, not at a resync: one status write, then none.
    kube, health = FakeKube(), TransportMonitor(lambda _: None)
    model_in(kube)
    await settled(kube, health=health)
    health.tracked[(NS, NAME)].verdict = HealthVerdict(
        None, "MetricsUnreachable", "none of 1 decode engines answered on /metrics"
    )
    writes = len(kube.writes)
    assert (await one_pass(kube, health=health)).status_written
    assert [w.split(" ")[1] for w in kube.writes[writes:]] == ["DisaggregatedModel/qwen/status"]
    writes = len(kube.writes)
    assert not (await one_pass(kube, health=health)).status_written
    assert kube.writes[writes:] == []
