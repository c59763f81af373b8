"""A parity change rolled out under steady load, on the real node: no request fails, and every
request is served by render, prefill and decode pods of one parity hash."""

from __future__ import annotations

import time
from functools import partial

from devtools.localplane import ControlPlaneError, wait_until
from tests.support.realcluster import (
    MODEL_NAMESPACE,
    Cluster,
    describe,
    model_status,
    patch_dm,
    settled,
)
from tests.support.rollout_load import GatewayLogs, Load, PodHistory, request_log_on, running


def test_parity_change_under_load_fails_no_request_and_never_mixes_hashes(
    cluster: Cluster, model: str
) -> None:
    request_log_on(cluster)
    old = model_status(cluster)["parityHash"]

    history, load = PodHistory(), Load(model)
    logs = GatewayLogs(cluster.node.pod_logs, MODEL_NAMESPACE)
    workers = [(partial(load.run_one, i), load.stop) for i in range(load.clients)]
    with running((lambda: history.watch(cluster), history.stop), (logs.follow, logs.stop)):
        with running(*workers):
            wait_until("steady load", lambda: len(load.sent) >= 10, timeout=60)
            started = time.monotonic()
            # A parity change: the default chat-template kwargs every pool renders with.
            patch_dm(cluster, {"spec": {"serving": {
                "defaultChatTemplateKwargs": {"enable_thinking": False}}}})  # fmt: skip
            wait_until("the new parity hash", lambda: model_status(cluster)["parityHash"] != old,
                       timeout=30)  # fmt: skip
            new = model_status(cluster)["parityHash"]
            wait_until(
                "every pod on the new parity hash",
                lambda: settled(cluster, new),
                timeout=240,
                interval=1,
            )
            rollout_seconds = time.monotonic() - started
            during = len(load.sent)
            wait_until("requests after the rollout", lambda: len(load.sent) >= during + 10,
                       timeout=60)  # fmt: skip

        # Nothing is lost: every request the clients sent reaches a gateway's log (written in
        # the background, so polled for).
        def missing() -> list[str]:
            return sorted(set(load.sent) - set(logs.requests()))

        try:
            wait_until("every request in the request log", lambda: not missing(), timeout=30)
        except ControlPlaneError as error:
            lost = missing()
            raise AssertionError(
                f"{error}: {len(lost)} of {len(load.sent)} never logged ({lost[:10]}); "
                f"failed: {load.failures[:5]}"
            ) from None
        logged = logs.requests()
    logs.close()

    entries = [logged[request_id] for request_id in load.sent]
    print(f"rollout {rollout_seconds:.1f}s, {len(load.sent)} requests, {len(load.failures)} failed")
    assert load.failures == [], f"{len(load.failures)} failed: {load.failures[:5]}"
    assert {e["parity_hash"] for e in entries} == {old, new}, describe(cluster, MODEL_NAMESPACE)
    for entry in entries:
        for stage in ("render_engine", "prefill_engine", "decode_engine"):
            pod = entry[stage]
            if pod is None:
                continue
            # The pod it names existed with the request's parity hash.
            assert entry["parity_hash"] in history.by_name.get(pod, set()), (stage, entry)
