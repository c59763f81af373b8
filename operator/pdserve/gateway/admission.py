"""The admission endpoints peer gateways call (see peers.py): what this replica counts
against the shared long-prefill limit, and holding a slot for a peer's long prefill. Both need
the peer key or an API key when one is set (intake.py checks it before they run); a hold waits in
the one fair queue like this replica's own long requests, ends at a deadline, and one peer has
at most `max_holds_per_peer` holds open (a peer cannot have more requests in flight)."""

from __future__ import annotations

import asyncio
import hmac
from collections import Counter
from contextlib import suppress

from aiohttp import web

from pdserve.gateway.errors import GatewayError, error_response
from pdserve.gateway.fairqueue import LONG, PrefillAdmission
from pdserve.gateway.peers import GRANTED, PeerAdmission

DATAPLANE_ADMISSION_PATH = "/dataplane/admission"
DATAPLANE_TOKEN_HEADER = "X-PDServe-Dataplane-Token"


class AdmissionHandlers:
    def __init__(
        self,
        admission: PrefillAdmission,
        peers: PeerAdmission,
        *,
        hold_seconds: float,
        max_holds_per_peer: int = 256,
    ) -> None:
        self.admission, self.peers = admission, peers
        self.hold_seconds = hold_seconds
        """At most this long a slot is held for a peer (its prefill call's own timeout)."""
        self.max_holds_per_peer = max_holds_per_peer
        self.holds: Counter[str] = Counter()
        """Holds open (queued or granted) per peer address."""
        self.dataplane_token: str | None = None
        """Set when this gateway starts a data plane: what it presents (DATAPLANE_TOKEN_HEADER)."""

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/admission", self.admission_state)
        app.router.add_post("/admission/hold", self.admission_hold)
        app.router.add_post(DATAPLANE_ADMISSION_PATH, self.dataplane_hold)

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
        if (leader := self.peers.leader()) is not None:
            # Two replicas running queues at once would break the limit: the asking replica
            # admits on its own (counting this one's holdings) until their views agree.
            message = f"this replica is not the admission leader: {leader} is"
            return error_response(GatewayError(409, message, kind="ConflictError"))
        replicas = await self._replicas(request)
        if replicas is None:
            message = "replicas: expected the prefill replica URLs the request may use, best first"
            return error_response(GatewayError(400, message, param="replicas"))
        peer = request.remote or "unknown"
        if self.holds[peer] >= self.max_holds_per_peer:
            # Queued holds are admitted anyway once they age: unbounded ones would overrun the
            # limit for every replica's documents.
            message = f"this peer already has {self.holds[peer]} admission holds open"
            return error_response(GatewayError(429, message))
        self.holds[peer] += 1
        try:
            return await self._hold(request, replicas)
        finally:
            self.holds[peer] -= 1
            if self.holds[peer] <= 0:
                del self.holds[peer]

    async def dataplane_hold(self, request: web.Request) -> web.StreamResponse:
        """The data plane's long prompt (dataplane.py) takes a slot as this replica's own long
        requests do: from the leader when there is one, else from this replica's queue. Only
        the data plane this gateway started may ask (its token: it is not a peer, and holds
        count against no peer's limit)."""
        if self.dataplane_token is None or not hmac.compare_digest(
            request.headers.get(DATAPLANE_TOKEN_HEADER, ""), self.dataplane_token
        ):
            return error_response(GatewayError(403, "only this gateway's data plane may ask"))
        replicas = await self._replicas(request)
        if replicas is None:
            message = "replicas: expected the prefill replica URLs the request may use, best first"
            return error_response(GatewayError(400, message, param="replicas"))
        async with self.peers.slot(LONG, replicas) as granted:
            return await self._granted(request, granted or replicas[0])

    @staticmethod
    async def _replicas(request: web.Request) -> list[str] | None:
        """The body's `replicas` (prefill replica URLs, best first); None when malformed."""
        try:
            body = await request.json()
        except ValueError:
            return None
        replicas = body.get("replicas") if isinstance(body, dict) else None
        if not isinstance(replicas, list) or not replicas:
            return None
        if not all(isinstance(r, str) and r for r in replicas):
            return None
        return replicas

    async def _hold(self, request: web.Request, replicas: list[str]) -> web.StreamResponse:
        async with self.admission.admit(LONG, replicas) as replica:
            return await self._granted(request, replica or replicas[0])

    async def _granted(self, request: web.Request, replica: str) -> web.StreamResponse:
        """Say which replica was granted, then hold the slot until the holder closes the
        connection (aiohttp then cancels the handler) or the hold's deadline passes."""
        # The deadline, for the holder: the slot goes back then, whatever its prefill does.
        deadline = {"X-PDServe-Hold-Seconds": f"{self.hold_seconds:g}"}
        response = web.StreamResponse(headers={"Content-Type": "text/plain", **deadline})
        try:
            await response.prepare(request)
            await response.write(f"{GRANTED} {replica}\n".encode())
        except ConnectionResetError:
            return response  # the holder left as it was granted: the slot goes back
        # Bounded like the holder's prefill call: a holder that vanished without closing its
        # connection cannot keep the slot for longer.
        with suppress(TimeoutError):
            async with asyncio.timeout(self.hold_seconds):
                await asyncio.Event().wait()
        return response
