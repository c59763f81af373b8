"""The Builtin autoscaling engine, one module per seam:

- series: which samples of a pod's /metrics feed which signal (the parsing itself is
  pdserve.vllm.metrics);
- rules: the raw recommendation of each pool from its signals (pure);
- behaviour: bounds, stabilization windows, steps and cooldowns over those recommendations
  (pure, the clock passed in);
- plans: the replica counts the live objects hold and what the builders write from a plan;
- targets: the pods to scrape and their /metrics URLs;
- metrics: the operator's own Prometheus metrics about its decisions;
- loop: the periodic scraper that ties them together, and `Autoscaler.plan`, what reconcile
  asks for the replicas to build with.

Rules (each returns a raw recommendation; `behaviour.decide` then applies bounds,
stabilization windows, steps and cooldowns, the same semantics as the HPA behaviour pdserve
writes for render):
- render: parser busy seconds per second (the render servers' render/derender handler time, or
  the gateways' own per-replica call time when higher: it includes queueing) against workers x
  targetParserBusyPercent, and CPU against the request x targetCPUUtilizationPercentage (the
  floor); the higher need wins.
- prefill: (arriving prompt tokens/s + queued prompt tokens / half the TTFT SLO) over the
  measured prefill throughput per replica x targetUtilizationPercent; one more replica while
  the engines' own TTFT runs over the SLO.
- decode: KV-cache usage against targetUtilizationPercent and mean ITL against the ITL SLO.
- slices: whole slices, enough for both pools' recommendations (P:D and domains hold).

Reconcile asks `Autoscaler.plan` for the replicas to build with: the live counts, or a newer
decision (announced once as an Event). Decisions are operator metrics too."""
