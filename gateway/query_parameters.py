"""What the Lua shaper checks in REST query strings, read from Envoy's descriptor set (pure): the parameters of the
paths under /v1/organization/ and of the anthropic SDK's models route, and the names path templates bind
(`path_variables`).

The Lua shaper checks those paths' queries itself (gateway/lua/query.lua, `organization_query`): the transcoder
skips names it does not know (`ignore_unknown_query_parameters`, which other paths need), and OpenAI's SDKs write
lists as `name[]=v`, which it does not read. The table comes from the request messages of the `google.api.http` GET
bindings, so it cannot drift from what the transcoder maps.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterator

from google.api import annotations_pb2  # registers the google.api.http extension, so parsing keeps the bindings
from google.api import http_pb2
from google.protobuf import descriptor_pb2

PREFIX = "/v1/organization/"
ADMIN_PREFIX = "/v1/admin/"
# envoy.yaml routes the anthropic SDK's models requests (those with `anthropic-version`) to this service alone.
ANTHROPIC_MODELS = "AnthropicModelService"

# path -> parameter name -> whether it is a list (a repeated field)
Parameters = dict[str, dict[str, bool]]


def organization_parameters(descriptor_set: bytes) -> Parameters:
    return _get_parameters(descriptor_set, lambda service, path: path.startswith(PREFIX))


def anthropic_models_parameters(descriptor_set: bytes) -> Parameters:
    """The GET paths of AnthropicModelService: ModelService binds the same ones, and its requests take no parameter."""
    return _get_parameters(descriptor_set, lambda service, path: service == ANTHROPIC_MODELS)


def admin_parameters(descriptor_set: bytes) -> Parameters:
    """The GET paths under /v1/admin/ that take query parameters (ListKeys' page_size and page_token)."""
    parameters = _get_parameters(descriptor_set, lambda service, path: path.startswith(ADMIN_PREFIX))
    return {path: names for path, names in parameters.items() if names}


def _get_parameters(descriptor_set: bytes, wanted: Callable[[str, str], bool]) -> Parameters:
    """The fields of the request messages of the GET bindings `wanted(service name, path)` picks."""
    files = _files(descriptor_set)
    messages = {f".{file.package}.{message.name}": message for file in files for message in file.message_type}
    return {rule.get: {field.name: field.label == descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED
                       for field in messages[method.input_type].field}
            for service, method, rule in _bindings(files) if rule.get and wanted(service.name, rule.get)}


def lua_table(parameters: Parameters) -> str:
    """`parameters` as a Lua table constructor (names are proto identifiers and paths plain ASCII: no escaping)."""
    rows = []
    for path, names in sorted(parameters.items()):
        fields = ", ".join(f'["{name}"] = {str(many).lower()}' for name, many in sorted(names.items()))
        rows.append(f'  ["{path}"] = {{{fields}}},\n')
    return "{\n" + "".join(rows) + "}"


def lua_string(text: str) -> str:
    """`text` as a Lua string literal: anything but printable ASCII (and `"`, `\\`) as a decimal escape."""
    return '"' + "".join(c if c.isascii() and c.isprintable() and c not in '"\\' else f"\\{ord(c):03d}"
                         for c in text) + '"'


def path_variables(descriptor_set: bytes) -> Parameters:
    """The names REST path templates bind (`{id}` in /v1/admin/keys/{id}), by the template's fixed start
    (`/v1/admin/keys/`). The transcoder lets a query parameter of the same name replace the path's value
    (`PATCH /v1/admin/keys/A?id=B` changed key B), so the Lua shaper refuses such a parameter on the paths under that
    start; elsewhere (`POST /v1/chat/completions?model=x`) it binds nothing and is ignored, as other parameters are."""
    variables: Parameters = {}
    for _, _, rule in _bindings(_files(descriptor_set)):
        template = str(getattr(rule, rule.WhichOneof("pattern") or "get", ""))
        names = re.findall(r"\{([A-Za-z_][A-Za-z0-9_.]*)", template)
        if names:
            variables.setdefault(template[:template.index("{")], {}).update(dict.fromkeys(names, False))
    return variables


def route_methods(descriptor_set: bytes) -> dict[str, tuple[str, ...]]:
    """Each REST path template as an anchored Lua pattern (`{id}` one segment, `{path=**}` any rest, a trailing `/`
    allowed as the transcoder allows it) -> the methods bound to it, HEAD with GET (the Lua shaper answers HEAD as
    GET), sorted. The shaper names them when a known path is called with another method, which the transcoder
    answers as an unknown URL."""
    routes: dict[str, set[str]] = {}
    for kind, patterns, _ in _routes(descriptor_set):
        for pattern in patterns:
            routes.setdefault(pattern, set()).update(("GET", "HEAD") if kind == "get" else (kind.upper(),))
    return {pattern: tuple(sorted(methods)) for pattern, methods in routes.items()}


def bodiless_routes(descriptor_set: bytes) -> dict[str, list[str]]:
    """Method -> the Lua patterns of its paths whose binding maps no body (every GET, POST
    /v1/admin/keys/{id}/revoke). The transcoder still read a body sent there into the request message, over the
    URL's own values (`{"id": "B"}` revoked key B), so the Lua shaper refuses one. Paths only: a GET of an unknown
    URL stays the transcoder's 404."""
    bodiless: dict[str, list[str]] = {}
    for kind, patterns, body in _routes(descriptor_set):
        if not body:
            bodiless.setdefault(kind.upper(), []).extend(patterns)
    return bodiless


def _routes(descriptor_set: bytes) -> Iterator[tuple[str, tuple[str, ...], str]]:
    """(method as the rule names it, the path template's Lua patterns, the rule's body) of each REST binding."""
    for _, _, rule in _bindings(_files(descriptor_set)):
        kind = rule.WhichOneof("pattern")
        if kind not in ("get", "post", "put", "patch", "delete"):
            continue
        pieces = re.split(r"(\{[^}]*\})", getattr(rule, kind))
        pattern = "".join((".*" if "**" in piece else "[^/]+") if piece.startswith("{")
                          else re.sub(r"([^A-Za-z0-9/])", r"%\1", piece) for piece in pieces)
        # `/console/{path=**}` also binds `/console` itself
        patterns = (pattern, pattern.removesuffix("/.*")) if pattern.endswith("/.*") else (pattern,)
        yield kind, tuple(f"^{each}/?$" for each in patterns), rule.body


def _files(descriptor_set: bytes):
    return descriptor_pb2.FileDescriptorSet.FromString(descriptor_set).file


def _bindings(files) -> Iterator[tuple[descriptor_pb2.ServiceDescriptorProto, descriptor_pb2.MethodDescriptorProto,
                                       http_pb2.HttpRule]]:
    """Each method's `google.api.http` rule and its additional bindings, with the method and its service."""
    for file in files:
        for service in file.service:
            for method in service.method:
                rule = method.options.Extensions[annotations_pb2.http]
                for binding in (rule, *rule.additional_bindings):
                    yield service, method, binding
