"""Finds the route for a request, or the 404/405 answer when there is none."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from google.rpc import code_pb2

from protoserve.gateway.runtime.errors import HttpError, gateway_error
from protoserve.gateway.runtime.route import ErrorStyle, Route
from protoserve.v1 import inference_pb2


@dataclass(frozen=True, slots=True)
class RouteMatch:
    """A route and the decoded values of its path variables."""

    route: Route
    path_values: dict[str, str]


class RoutingError(HttpError):
    """No route serves the request; ``style`` is the error style of the API it most likely meant."""

    def __init__(self, error: HttpError, style: ErrorStyle, allow: Iterable[str] = ()) -> None:
        super().__init__(error.status, error.http_status)
        self.style = style
        self.allow = sorted(set(allow))

    @property
    def headers(self) -> dict[str, str]:
        """Allow lists the methods the path does serve (405 only)."""
        return {"allow": ", ".join(self.allow)} if self.allow else {}


class Router:
    """Matches raw request paths against the route table; most specific template wins."""

    def __init__(self, routes: Iterable[Route]) -> None:
        self.routes = sorted(routes, key=lambda route: route.path.specificity, reverse=True)

    def resolve(self, http_method: str, raw_path: str) -> RouteMatch:
        """The matching route, or raise RoutingError (404 unknown path, 405 wrong method)."""
        allowed: list[Route] = []
        for route in self.routes:
            values = route.path.match(raw_path)
            if values is None:
                continue
            if route.http_method == http_method:
                return RouteMatch(route, values)
            allowed.append(route)
        if allowed:
            error = gateway_error(
                code_pb2.UNIMPLEMENTED,
                f"method {http_method} is not allowed on {raw_path}; use {', '.join(r.http_method for r in allowed)}",
                http_status=405,
                reason=inference_pb2.ERROR_REASON_METHOD_NOT_ALLOWED,
            )
            raise RoutingError(error, allowed[0].error_style, (r.http_method for r in allowed))
        error = gateway_error(code_pb2.NOT_FOUND, f"no route for {http_method} {raw_path}", http_status=404)
        raise RoutingError(error, self.style_for_path(raw_path))

    def style_for_path(self, raw_path: str) -> ErrorStyle:
        """The error style of the routes sharing the longest literal prefix with the path.

        An OpenAI client calling an endpoint we lack (``/v1/chat/foo``) then gets
        an OpenAI error body. Where both styles share the prefix (``/v1/embeddings``)
        OpenAI's wins: OpenAI clients cannot read a google.rpc.Status, and an unknown path
        there is most likely an OpenAI endpoint this server lacks. A path sharing nothing
        with any route gets google.rpc.Status.
        """
        segments = raw_path.strip("/").split("/")
        best, styles = 0, set()
        for route in self.routes:
            shared = 0
            for mine, theirs in zip(route.path.literal_prefix, segments, strict=False):
                if mine != theirs.split(":")[0]:
                    break
                shared += 1
            if shared > best:
                best, styles = shared, {route.error_style}
            elif shared == best and shared:
                styles.add(route.error_style)
        if ErrorStyle.OPENAI in styles:
            return ErrorStyle.OPENAI
        if styles == {ErrorStyle.KSERVE}:
            return ErrorStyle.KSERVE  # /v2/...: a KServe client reads {"error": ...} only
        if styles == {ErrorStyle.ANTHROPIC}:  # /v1/messages/...: only Anthropic's routes live there
            return ErrorStyle.ANTHROPIC
        return ErrorStyle.GOOGLE_RPC_STATUS
