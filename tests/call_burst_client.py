"""Fires a burst of concurrent ListModels calls at a gRPC server from its own process, then prints how they ended.

`python -m tests.call_burst_client PORT SECRET CALLS CONNECTIONS`: prints "sent" once every call is on its way, then
one JSON object {status code name: count}. Its own process, so that the burst does not wait for the server's GIL.
"""

from __future__ import annotations

import collections
import json
import sys

import grpc

from portico.v1 import model_pb2, model_service_pb2_grpc


def _code(future) -> str:
    try:
        future.result(timeout=90)
    except grpc.RpcError as error:
        return error.code().name
    return grpc.StatusCode.OK.name


def main(port: int, secret: str, calls: int, connections: int) -> None:
    # A channel each: grpc would otherwise share one connection between channels to the same address.
    channels = [grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.use_local_subchannel_pool", 1)])
                for _ in range(connections)]
    for channel in channels:
        grpc.channel_ready_future(channel).result(timeout=10)
    stubs = [model_service_pb2_grpc.ModelServiceStub(channel) for channel in channels]
    metadata = (("authorization", f"Bearer {secret}"),)
    futures = [stubs[i % connections].ListModels.future(model_pb2.ListModelsRequest(), metadata=metadata, timeout=60)
               for i in range(calls)]
    print("sent", flush=True)
    print(json.dumps(collections.Counter(_code(future) for future in futures)), flush=True)
    for channel in channels:
        channel.close()


if __name__ == "__main__":
    main(int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
