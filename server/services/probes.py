"""ProbeService: liveness and readiness over REST (GET /healthz, GET /readyz), no API key needed."""

from __future__ import annotations

from portico.v1 import probe_pb2, probe_service_pb2_grpc
from server.errors import ServiceUnavailable
from server.health import Readiness


class ProbeServicer(probe_service_pb2_grpc.ProbeServiceServicer):
    def __init__(self, readiness: Readiness) -> None:
        self._readiness = readiness

    async def GetLiveness(self, request, context) -> probe_pb2.GetLivenessResponse:
        return probe_pb2.GetLivenessResponse(status="alive")

    async def GetReadiness(self, request, context) -> probe_pb2.GetReadinessResponse:
        report = self._readiness.report
        if not report.ready:
            raise ServiceUnavailable(f"Not ready: {report.reasons()}.", retry_after=1.0)
        # Deployments are informational (an ejected one does not make the gateway unready), listed among the checks
        # as "deployment:<model>/<name>" so that a gateway without any keeps its answer as it was.
        deployments = self._readiness.deployment_states()  # now, not as of the last check
        checks = {**report.checks, **{f"deployment:{name}": state for name, state in deployments.items()}}
        return probe_pb2.GetReadinessResponse(status=report.status, checks=checks)
