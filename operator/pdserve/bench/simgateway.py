"""The gateway for scenarios on time-scaled simulators: `pdserve gateway` with its own time
constants (fair-queue aging, Auto's failure window, load scraping) scaled like the engines',
and the engines' reported durations (in simulated seconds) read back into its own,
so the simulated deployment behaves as the real one would at time scale 1; and fair queueing
optionally off. Benchmark harness only: a real deployment runs `pdserve gateway`.

    python -m pdserve.bench.simgateway --config routing.json --port 8000 --time-scale 0.2
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
from collections.abc import Sequence
from pathlib import Path

from pdserve.contract.routing import ConfigError, load_config
from pdserve.gateway import server
from pdserve.gateway.app import Gateway
from pdserve.gateway.fairqueue import FairQueueSettings
from pdserve.gateway.main import behind_data_plane
from pdserve.gateway.policy import PolicySettings
from pdserve.gateway.settings import GatewaySettings

NO_LIMIT = 1_000_000


def scaled_settings(
    time_scale: float, *, fair_queue: bool, request_log: Path | None = None
) -> GatewaySettings:
    defaults = GatewaySettings()
    queue = defaults.fair_queue
    return GatewaySettings(
        max_inflight=4096,
        policy=dataclasses.replace(
            PolicySettings(),
            failure_window_seconds=defaults.policy.failure_window_seconds * time_scale,
        ),
        fair_queue=FairQueueSettings(
            long_prompt_tokens=queue.long_prompt_tokens,
            max_long_per_replica=queue.max_long_per_replica if fair_queue else NO_LIMIT,
            max_wait_seconds=queue.max_wait_seconds * time_scale,
        ),
        # Scaled too, but no faster than 10 scrapes a second: the engines share the host's CPU.
        load_scrape_seconds=max(0.1, (defaults.load_scrape_seconds or 0.5) * time_scale),
        step_window_seconds=defaults.step_window_seconds * time_scale,
        engine_seconds_scale=time_scale,
        request_log=request_log,
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m pdserve.bench.simgateway", description=__doc__)
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--time-scale", type=float, default=1.0)
    parser.add_argument("--no-fair-queue", dest="fair_queue", action="store_false")
    parser.add_argument(
        "--request-log", type=Path, help="one JSON line per request: engines, Auto's reason"
    )
    parser.add_argument(
        "--data-plane",
        type=Path,
        help="serve clients through this compiled data plane binary (pdserve gateway --data-plane)",
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        config = load_config(args.config)
    except ConfigError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    settings = scaled_settings(
        args.time_scale, fair_queue=args.fair_queue, request_log=args.request_log
    )
    gateway = Gateway(config, settings)
    if args.data_plane is None:
        server.run(gateway.app(), args.host, args.port)
        return 0
    listener = behind_data_plane(gateway, args.data_plane, args.host, args.port)
    host, port = listener.getsockname()[:2]
    server.run(gateway.app(), host, port, front=gateway.data_plane, sock=listener)
    return 0


if __name__ == "__main__":
    sys.exit(main())
