"""The admission endpoints peer gateways call (see peers.py): what this replica counts
against the shared long-prefill limit, and holding a slot for a peer's long prefill."""

from __future__ import annotations

import asyncio
from contextlib import suppress

from aiohttp import web

from pdserve.gateway.errors import GatewayError, error_response
from pdserve.gateway.fairqueue import LONG, PrefillAdmission
from pdserve.gateway.intake import Intake
from pdserve.gateway.peers import GRANTED, PeerAdmission


class AdmissionHandlers:
    def __init__(
        self,
        admission: PrefillAdmission,
        peers: PeerAdmission,
        intake: Intake,
        *,
        hold_seconds: float,
    ) -> None:
        self.admission, self.peers, self.intake = admission, peers, intake
        self.hold_seconds = hold_seconds
        """At most this long a slot is held for a peer (its prefill call's own timeout)."""

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/admission", self.admission_state)
        app.router.add_post("/admission/hold", self.admission_hold)

    async def admission_state(self, _: web.Request) -> web.Response:
        """What peers count against the shared long-prefill limit."""
        admission = self.admission
        return web.json_response(
            {
                "longInFlight": admission.long_in_flight,
                "queued": len(admission.queue),
                "replicas": dict(admission.in_flight),
                "heldAt": self.peers.holdings(),
            }
        )

    async def admission_hold(self, request: web.Request) -> web.StreamResponse:
        """A peer replica's long prefill waits in this replica's queue (it is the leader, see
        peers.py); `granted <replica>` answers when one of the prefill replicas it named has
        room, and the slot is held until the peer closes the connection (aiohttp then cancels
        this handler, which releases it)."""
        try:
            self.intake.authorize(request)  # a slot held here blocks every replica's documents
        except GatewayError as error:
            return error_response(error)
        if (leader := self.peers.leader()) is not None:
            # Two replicas running queues at once would break the limit: the asking replica
            # admits on its own (counting this one's holdings) until their views agree.
            message = f"this replica is not the admission leader: {leader} is"
            return error_response(GatewayError(409, message, kind="ConflictError"))
        try:
            body = await request.json()
            replicas = body.get("replicas") if isinstance(body, dict) else None
            if not isinstance(replicas, list) or not replicas:
                raise ValueError
            if not all(isinstance(r, str) and r for r in replicas):
                raise ValueError
        except (ValueError, TypeError):
            message = "replicas: expected the prefill replica URLs the request may use, best first"
            return error_response(GatewayError(400, message, param="replicas"))
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        async with self.admission.admit(LONG, replicas) as replica:
            try:
                await response.prepare(request)
                await response.write(f"{GRANTED} {replica}\n".encode())
            except ConnectionResetError:
                return response  # the peer left as it was granted: the slot goes back
            # Bounded like the peer's prefill call: a holder that vanished without closing its
            # connection cannot keep the slot for longer.
            with suppress(TimeoutError):
                async with asyncio.timeout(self.hold_seconds):
                    await asyncio.Event().wait()
        return response
