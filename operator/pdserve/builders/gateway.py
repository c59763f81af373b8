"""The gateway: Deployment, Service, routing ConfigMap, and the identity it discovers pods with."""

from __future__ import annotations

import hashlib
from typing import Any

from pdserve.api import DisaggregatedModel
from pdserve.api.images import DEFAULT_GATEWAY_IMAGE
from pdserve.api.render import EngineApi
from pdserve.builders.kv_compat import kv_compat_digest
from pdserve.builders.names import child_name, meta, selector_labels
from pdserve.builders.peer_key import PEER_KEY_FILE, peer_key_digest
from pdserve.builders.pods import http_probes, pdb, pod_annotations, pod_template, resources
from pdserve.contract.names import (
    CONFIG_HASH_ANNOTATION,
    DATA_PLANE_BINARY,
    ENGINE_PORT,
    GATEWAY_CONTAINER_PORT,
    GATEWAY_DRAIN_SECONDS,
    GATEWAY_SHUTDOWN_SECONDS,
    PEER_KEY_HASH_ANNOTATION,
    PEER_KEY_SECRET_KEY,
    RENDER_PORT,
    Component,
    peer_key_secret_name,
)
from pdserve.contract.pod_layout import PEER_KEY_DIR, ROUTING_DIR
from pdserve.contract.routing import (
    ROUTING_KEY,
    VLLM_DECODER_KV_BLOCKS_TTL_SECONDS,
    VLLM_KV_LEASE_SECONDS,
    GatewayConfig,
    KvTransfer,
    PoolRef,
    Pools,
    Routing,
    Slo,
    config_text_of,
    written_version,
)


def _pool_ref(
    dm: DisaggregatedModel,
    component: Component,
    port: int,
    kv_compat: str | None = None,
    local_ranks: int = 1,
) -> PoolRef:
    extra: dict[str, Any] = {} if kv_compat is None else {"kv_compat": kv_compat}
    if local_ranks > 1:  # left unset at 1, so configs of single-rank pods read as before
        extra["data_parallel_local"] = local_ranks
    return PoolRef(
        service=child_name(dm, component),
        port=port,
        selector=selector_labels(dm, component),
        **extra,
    )


def _engine_pool_ref(dm: DisaggregatedModel, component: Component) -> PoolRef:
    """An engine pool; with P/D, with the KV-compatibility digest its pods get."""
    pool = dm.spec.prefill if component is Component.prefill else dm.spec.decode
    digest = kv_compat_digest(dm, pool) if dm.spec.disaggregated and pool is not None else None
    local_ranks = 1 if pool is None else pool.local_data_parallel_size
    return _pool_ref(dm, component, ENGINE_PORT, digest, local_ranks)


def routing_config(dm: DisaggregatedModel, parity: str) -> GatewayConfig:
    """What the gateway needs to route: pools, the parity hash pods must carry, policies, SLOs."""
    spec = dm.spec
    kv = spec.kv_transfer
    # Keys set only when they apply, so the file leaves them out otherwise. Behind a render
    # pool, what the engines can serve (the gateway refuses what --tokens-only engines cannot);
    # without one there are no tokens engines to describe. Adapters: a model without keeps its
    # file across an upgrade (written_version).
    optional: dict[str, Any] = {}
    if spec.render.enabled:
        tokens_only = spec.render.engine_api is EngineApi.tokens_only
        optional["tokens_engines"] = "tokens_only" if tokens_only else "scale_out"
    if spec.model.adapters:
        optional["adapters"] = [a.name for a in spec.model.adapters]
    config = GatewayConfig(
        model=dm.served_model_name,
        namespace=dm.namespace,
        parity_hash=parity,
        engine_api="tokens" if spec.render.enabled else "openai",
        **optional,
        # The engines' KV block size: the gateway hashes prompts in the same blocks to guess
        # which engine holds a prefix.
        block_size=spec.block_size,
        routing=Routing(
            mode=spec.gateway.routing.mode.value,
            slo=Slo.model_validate(spec.gateway.slo.model_dump(exclude_none=True)),
        ),
        pools=Pools(
            render=_pool_ref(dm, Component.render, RENDER_PORT) if spec.render.enabled else None,
            prefill=_engine_pool_ref(dm, Component.prefill) if spec.disaggregated else None,
            decode=_engine_pool_ref(dm, Component.decode),
            # Peers: the replicas that share the cluster-wide long-prefill limit.
            gateway=_pool_ref(dm, Component.gateway, GATEWAY_CONTAINER_PORT),
        ),
        kv_transfer=KvTransfer(
            connector=kv.connector.value,
            # The engines' durations, vLLM's defaults where the spec leaves them unset: the
            # gateway judges leases on its own clock, never on an engine's expiry time.
            prefill_lease_seconds=kv.lease_duration_seconds or VLLM_KV_LEASE_SECONDS,
            decode_blocks_ttl_seconds=kv.decode_blocks_ttl or VLLM_DECODER_KV_BLOCKS_TTL_SECONDS,
            load_failure_policy=kv.load_failure_policy,
            bidirectional=kv.bidirectional,
            verify=kv.verify.value,
        ),
        replica_check=spec.gateway.replica_check,
    )
    return config.model_copy(update={"schema_version": written_version(config)})


def gateway(
    dm: DisaggregatedModel,
    parity: str,
    peer_key: str | None = None,
    image: str = DEFAULT_GATEWAY_IMAGE,
) -> list[dict[str, Any]]:
    """`peer_key`: the replicas' key for each other's admission endpoints, mounted from its
    Secret (builders.peer_key); None: none, and the replicas send their first API key.
    `image`: the gateway's (spec.image.gateway, else the operator's own)."""
    spec = dm.spec.gateway
    name = child_name(dm, Component.gateway)
    # Indented so a GitOps diff of the ConfigMap shows which setting changed.
    config_text = config_text_of(routing_config(dm, parity))
    # Its own pod name: the gateway tells itself apart from the peers it shares the prefill
    # admission limit with.
    env: list[dict[str, Any]] = [
        {"name": "POD_NAME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}
    ]
    if spec.api_key_secret_ref is not None:
        ref = spec.api_key_secret_ref
        env.append({"name": "PDSERVE_API_KEY",
                    "valueFrom": {"secretKeyRef": {"name": ref.name, "key": ref.key}}})  # fmt: skip
    container: dict[str, Any] = {
        "name": "gateway",
        "image": image,
        "imagePullPolicy": dm.spec.image.pull_policy,
        "command": ["pdserve", "gateway"],
        "args": [
            "--config",
            f"{ROUTING_DIR}/{ROUTING_KEY}",
            "--port",
            str(GATEWAY_CONTAINER_PORT),
            # Within the grace period below: the drain, then the shutdown timeout.
            "--drain-seconds",
            str(GATEWAY_DRAIN_SECONDS),
            "--request-timeout-seconds",
            str(spec.request_timeout_seconds),
            *(
                ["--endpoint-wait-seconds", str(spec.endpoint_wait_seconds)]
                if spec.endpoint_wait_seconds is not None
                else []
            ),
            # The container's stdout: `kubectl logs` shows the lines.
            *(["--request-log", "/dev/stdout"] if spec.request_log else []),
            "--data-plane",
            DATA_PLANE_BINARY,
        ],
        "ports": [{"name": "http", "containerPort": GATEWAY_CONTAINER_PORT, "protocol": "TCP"}],
        "resources": resources(spec.resources),
        **http_probes("/health", slow_start=False),
        "volumeMounts": [{"name": "routing", "mountPath": ROUTING_DIR, "readOnly": True}],
    }
    container["env"] = env
    volumes: list[dict[str, Any]] = [{"name": "routing", "configMap": {"name": name}}]
    extra_annotations = {
        # A routing change rolls the gateway, so no replica serves with an old config.
        CONFIG_HASH_ANNOTATION: hashlib.sha256(config_text.encode()).hexdigest()[:16],
    }
    if peer_key is not None:
        # A file, not a variable: the key stays out of the process environment, which child
        # processes inherit and /proc/<pid>/environ shows.
        container["args"] += ["--peer-key-file", PEER_KEY_FILE]
        container["volumeMounts"].append(
            {"name": "peer-key", "mountPath": PEER_KEY_DIR, "readOnly": True}
        )
        volumes.append({"name": "peer-key", "secret": {
            "secretName": peer_key_secret_name(dm.name),
            "items": [{"key": PEER_KEY_SECRET_KEY, "path": PEER_KEY_SECRET_KEY}],
        }})  # fmt: skip
        # The gateway reads the key once: a new key rolls every replica, so none keeps one
        # its peers no longer accept.
        extra_annotations[PEER_KEY_HASH_ANNOTATION] = peer_key_digest(peer_key)
    annotations = pod_annotations(parity, extra_annotations)
    template = pod_template(
        dm,
        Component.gateway,
        containers=[container],
        volumes=volumes,
        annotations=annotations,
        node_selector=spec.node_selector,
        tolerations=[dict(t) for t in spec.tolerations],
        service_account=name,
        termination_grace_seconds=GATEWAY_DRAIN_SECONDS + GATEWAY_SHUTDOWN_SECONDS,
        overrides=spec.pod_overrides,
    )
    labels_meta = meta(dm, Component.gateway)
    return [
        {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": labels_meta},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": labels_meta,
         "rules": [
             {"apiGroups": [""], "resources": ["pods"], "verbs": ["get", "list", "watch"]},
             # Replica checks report a disagreeing pod in an Event on it; told again, the
             # Event counts one more (get and patch) instead of a new object.
             {"apiGroups": [""], "resources": ["events"], "verbs": ["create", "get", "patch"]},
             {"apiGroups": ["discovery.k8s.io"], "resources": ["endpointslices"],
              "verbs": ["get", "list", "watch"]},
         ]},
        {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding",
         "metadata": labels_meta,
         "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
         "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": dm.namespace}]},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": labels_meta,
         "data": {ROUTING_KEY: config_text}},
        {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": labels_meta,
         "spec": {"replicas": spec.replicas,
                  "selector": {"matchLabels": selector_labels(dm, Component.gateway)},
                  "template": template}},
        {"apiVersion": "v1", "kind": "Service",
         "metadata": {**labels_meta, **({"annotations": dict(spec.service_annotations)}
                                        if spec.service_annotations else {})},
         "spec": {"type": spec.service_type,
                  "selector": selector_labels(dm, Component.gateway),
                  "ports": [{"name": "http", "port": spec.port, "targetPort": "http",
                             "protocol": "TCP"}]}},
        pdb(dm, Component.gateway, name),
    ]  # fmt: skip


def endpoint(dm: DisaggregatedModel) -> str:
    """The in-cluster OpenAI base URL."""
    return (
        f"http://{child_name(dm, Component.gateway)}.{dm.namespace}.svc:{dm.spec.gateway.port}/v1"
    )
