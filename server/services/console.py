"""ConsoleService: the admin console's static files at /console/ (no key: they hold no data)."""

from __future__ import annotations

from google.api import httpbody_pb2

from portico.v1 import console_service_pb2_grpc
from server.console import ConsoleFiles
from server.console.files import HEADERS


class ConsoleServicer(console_service_pb2_grpc.ConsoleServiceServicer):
    def __init__(self, files: ConsoleFiles) -> None:
        self._files = files

    async def GetConsoleFile(self, request, context) -> httpbody_pb2.HttpBody:
        found = self._files.get(request.path)
        await context.send_initial_metadata(HEADERS)  # Envoy passes them on as HTTP headers
        return httpbody_pb2.HttpBody(content_type=found.content_type, data=found.data)
