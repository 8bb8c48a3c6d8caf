"""The protoc plugin: descriptors in, route table and OpenAPI out.

Covers the real protos (the output ``make proto`` wrote is what the plugin
generates now, deterministically) and small test protos that exercise every
google.api.http feature and every annotation mistake the generator must
reject.
"""

from __future__ import annotations

import importlib
import json
import sys
import textwrap
from pathlib import Path

import grpc_tools
import pytest
from google.protobuf import descriptor_pb2
from google.protobuf.compiler import plugin_pb2
from grpc_tools import protoc

from protoserve.gateway import codegen
from protoserve.gateway.generator.openapi import API_KEY_SCHEME, KEY_SECURITY, USER_ID_SCHEME
from protoserve.gateway.protoc_gen_gateway import generate
from protoserve.gateway.runtime.binding import bind_request
from protoserve.gateway.runtime.errors import HttpError
from protoserve.gateway.runtime.route import ErrorStyle, Framing

REPO = Path(__file__).resolve().parents[2]
GEN = REPO / "gen"
OIP_ROOT = REPO / "proto" / "vendor" / "triton"
# Ours, then the vendored Open Inference Protocol files under their upstream names (gateway/codegen.py).
PROTO_FILES = [*codegen.proto_files(REPO / "proto"), *codegen.vendored_files(OIP_ROOT)]
REAL_OPTIONS = f"http_rules={OIP_ROOT / 'http_rules.yaml'},vendored_package={codegen.OPEN_INFERENCE_PACKAGE}"
INCLUDES = [
    f"-I{REPO / 'proto'}",
    f"-I{Path(sys.prefix) / 'lib' / 'python3.11' / 'site-packages'}",
    f"-I{Path(grpc_tools.__file__).parent / '_proto'}",
]
HEADER = """
syntax = "proto3";
package gwtest.v1;
import "google/api/annotations.proto";
import "protoserve/options/v1/gateway.proto";
"""


def _request_from_set(fds: descriptor_pb2.FileDescriptorSet, generate_files, parameter: str = ""):
    return plugin_pb2.CodeGeneratorRequest(
        file_to_generate=generate_files, proto_file=fds.file, parameter=parameter
    )


def _compile(tmp_path: Path, source: str, name: str = "gwtest/v1/test.proto", python: bool = False):
    """Compile one test proto; returns its CodeGeneratorRequest (and writes _pb2 modules if asked)."""
    src = tmp_path / "src"
    (src / name).parent.mkdir(parents=True, exist_ok=True)
    (src / name).write_text(HEADER + textwrap.dedent(source))
    out = tmp_path / "set.binpb"
    args = ["protoc", f"-I{src}", *INCLUDES, "--include_imports", "--include_source_info"]
    args += [f"--descriptor_set_out={out}", name]
    if python:
        (tmp_path / "py").mkdir(exist_ok=True)
        args.insert(1, f"--python_out={tmp_path / 'py'}")
    assert protoc.main(args) == 0
    fds = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes())
    return _request_from_set(fds, [name])


def _real_request(parameter: str = "") -> plugin_pb2.CodeGeneratorRequest:
    """What codegen sends the plugin: our descriptor set, the vendored files, codegen's options (then ``parameter``)."""
    from protoserve.open_inference import grpc_service_pb2, model_config_pb2

    fds = descriptor_pb2.FileDescriptorSet.FromString((GEN / "python/protoserve/generated/protoserve.binpb").read_bytes())
    for module in (model_config_pb2, grpc_service_pb2):
        module.DESCRIPTOR.CopyToProto(fds.file.add())
    return _request_from_set(fds, PROTO_FILES, ",".join(filter(None, (REAL_OPTIONS, parameter))))


def _files(response: plugin_pb2.CodeGeneratorResponse) -> dict[str, str]:
    assert not response.error, response.error
    return {f.name: f.content for f in response.file}


# ------------------------------------------------------------------ the real protos


def test_generated_files_are_current_and_deterministic():
    first = _files(generate(_real_request()))
    second = _files(generate(_real_request()))
    assert first == second
    assert set(first) == {"protoserve/generated/routes.py", "protoserve/generated/openapi.json"}
    assert (
        first["protoserve/generated/routes.py"]
        == (GEN / "python/protoserve/generated/routes.py").read_text()
    )
    assert first["protoserve/generated/openapi.json"] == (GEN / "python/protoserve/generated/openapi.json").read_text()


def test_plugin_options_rename_outputs_and_title():
    files = _files(generate(_real_request("routes=r/routes.py,openapi=api.json,title=T,version=9")))
    assert set(files) == {"r/routes.py", "api.json"}
    assert json.loads(files["api.json"])["info"] == {
        "title": "T",
        "version": "9",
        "description": json.loads(files["api.json"])["info"]["description"],
    }
    assert "unknown plugin option" in generate(_real_request("colour=blue")).error


def test_real_route_table():
    from protoserve.generated.routes import ROUTES

    by_name = {
        r.grpc_method.rsplit("/", 1)[1] + ("@" + r.grpc_method.split("/")[1].split(".")[1]): r for r in ROUTES
    }
    cancel = by_name["Cancel@v1"]
    assert (cancel.http_method, cancel.path.template, cancel.body) == ("POST", "/v1/cancel/{request_id}", "*")
    assert [v.field_path for v in cancel.path.variables] == ["request_id"]
    assert cancel.reject_unknown_fields and cancel.error_style is ErrorStyle.GOOGLE_RPC_STATUS

    for name in (
        "CreateCompletion",
        "CreateCompletionStream",
        "CreateChatCompletion",
        "CreateChatCompletionStream",
    ):
        assert by_name[f"{name}@openai"].reject_unknown_fields, name
    assert by_name["CreateCompletion@openai"].ignored_fields == ()
    chat_ignored = ("metadata", "store", "safety_identifier", "prompt_cache_key")
    assert by_name["CreateChatCompletion@openai"].ignored_fields == chat_ignored
    assert by_name["CreateChatCompletionStream@openai"].ignored_fields == chat_ignored

    retrieve = by_name["RetrieveModel@openai"]
    assert (retrieve.http_method, retrieve.path.template, retrieve.response_body) == (
        "GET",
        "/v1/models/{model}",
        "model",
    )
    assert retrieve.error_style is ErrorStyle.OPENAI and retrieve.reject_unknown_fields

    stream = by_name["GenerateStream@v1"]
    assert stream.server_streaming and stream.body == "request" and stream.path.verb == "stream"

    completion = by_name["CreateCompletion@openai"]
    assert completion.stream is not None and completion.framing is Framing.SSE
    assert completion.stream.grpc_method == "/protoserve.openai.v1.OpenAIService/CreateCompletionStream"
    assert completion.stream.wrap_field == "request"
    assert (
        completion.stream.request_type.DESCRIPTOR.full_name
        == "protoserve.openai.v1.CreateCompletionStreamRequest"
    )

    health = by_name["CheckHealth@v1"]
    assert (health.http_method, health.path.template, health.body) == ("GET", "/health", "")


def test_real_openapi_document():
    doc = json.loads((GEN / "python/protoserve/generated/openapi.json").read_text())
    assert doc["openapi"].startswith("3.1")
    cancel = doc["paths"]["/v1/cancel/{request_id}"]["post"]
    assert cancel["parameters"][0] == {
        "name": "request_id",
        "in": "path",
        "required": True,
        "schema": {"type": "string"},
        "description": "Id of the request to cancel.",
        "example": "my-request-1",
    }
    # GET with an unbound field: a query parameter; path-bound fields are not.
    watch = doc["paths"]["/v1/metrics:watch"]["get"]
    assert [p["name"] for p in watch["parameters"]] == ["interval_ms"]
    assert "text/event-stream" in watch["responses"]["200"]["content"]
    # stream_method: both the unary JSON and the SSE chunk schema, OpenAI error body.
    completions = doc["paths"]["/v1/completions"]["post"]
    content = completions["responses"]["200"]["content"]
    assert content["application/json"]["schema"]["$ref"].endswith("CreateCompletionResponse")
    assert content["text/event-stream"]["schema"]["$ref"].endswith("CreateCompletionStreamResponse")
    assert "[DONE]" in completions["responses"]["200"]["description"]
    assert completions["responses"]["default"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "OpenAIErrorResponse"
    )
    # response_body: the 200 schema is the field's type.
    retrieve = doc["paths"]["/v1/models/{model}"]["get"]["responses"]["200"]["content"]["application/json"]
    assert retrieve["schema"]["anyOf"][0]["$ref"].endswith("protoserve.openai.v1.Model")
    # Proto comments become descriptions; presence and 64-bit ints as JSON prints them.
    schemas = doc["components"]["schemas"]
    assert schemas["protoserve.v1.SamplingParams"]["description"].startswith("SamplingParams controls")
    sampling = schemas["protoserve.v1.SamplingParams"]["properties"]
    assert sampling["max_tokens"]["type"] == ["integer", "null"]
    assert sampling["seed"]["type"] == ["integer", "string", "null"]
    assert sampling["logit_bias"]["additionalProperties"] == {"type": "number", "format": "float"}
    assert (
        "At most one of `prompt`, `token_ids`, `chat`"
        in schemas["protoserve.v1.GenerateRequest"]["properties"]["prompt"]["description"]
    )
    assert "`FINISH_REASON_STOP`: An EOS token" in schemas["protoserve.v1.FinishReason"]["description"]
    assert schemas["protoserve.v1.GenerateRequest"]["properties"]["prompt"] == {
        "type": "string",
        "description": schemas["protoserve.v1.GenerateRequest"]["properties"]["prompt"]["description"],
    }


# ------------------------------------------------------------------ feature coverage on a test proto

FEATURES = """
service Library {
  // GetBook reads one book.
  rpc GetBook(GetBookRequest) returns (Book) {
    option (google.api.http) = {
      get: "/v1/{name=shelves/*/books/*}"
      additional_bindings {get: "/v1/books/{name}"}
    };
  }
  rpc UpdateBook(UpdateBookRequest) returns (Book) {
    option (google.api.http) = {patch: "/v1/{book.name=shelves/*/books/*}" body: "book"};
    option (protoserve.options.v1.gateway) = {reject_unknown_fields: true ignored_fields: ["etag"]};
  }
  rpc Search(SearchRequest) returns (SearchResponse) {
    option (google.api.http) = {
      custom: {kind: "QUERY" path: "/v1/books:search"}
      body: "*"
      response_body: "books"
    };
    option (protoserve.options.v1.gateway) = {
      stream_method: "gwtest.v1.Library.SearchStream"
      framing: STREAM_FRAMING_NDJSON
      error_style: ERROR_STYLE_OPENAI
    };
  }
  rpc SearchStream(SearchStreamRequest) returns (stream Book) {
    option (google.api.http) = {post: "/v1/books:searchStream" body: "query"};
  }
  rpc NoHttp(Book) returns (Book);
}

// A book.
message Book {
  // Resource name.
  string name = 1;
  // Pages.
  int32 pages = 2;
  // Tags.
  repeated string tags = 3;
  // Price in cents.
  int64 price = 4;
  // Available.
  bool available = 5;
}
message GetBookRequest {
  string name = 1;
  int32 page_size = 2;
  repeated string fields = 3;
  Filter filter = 4;
  bool verbose = 5;
}
message Filter {
  string author = 1;
  Filter nested = 2;
}
message UpdateBookRequest {
  Book book = 1;
  bool validate_only = 2;
}
message SearchRequest {
  string query = 1;
  bool stream = 2;
}
message SearchResponse {
  repeated Book books = 1;
}
message SearchStreamRequest {
  SearchRequest query = 1;
}
"""


@pytest.fixture(scope="module")
def feature_routes(tmp_path_factory):
    """The features proto's generated route module, imported from a temp dir next to its _pb2."""
    tmp = tmp_path_factory.mktemp("features")
    request = _compile(tmp, FEATURES, python=True)
    files = _files(generate(request))
    routes_path = tmp / "py" / "protoserve_gateway_features.py"
    routes_path.write_text(files["protoserve/generated/routes.py"])
    sys.path.insert(0, str(tmp / "py"))
    try:
        module = importlib.import_module("protoserve_gateway_features")
        yield module.ROUTES, json.loads(files["protoserve/generated/openapi.json"]), files["protoserve/generated/routes.py"]
    finally:
        sys.path.remove(str(tmp / "py"))
        for name in [n for n in sys.modules if n.startswith(("gwtest", "protoserve_gateway_features"))]:
            del sys.modules[name]


def test_additional_bindings_and_multi_segment_variables(feature_routes):
    routes, doc, _ = feature_routes
    get_book = [r for r in routes if r.grpc_method == "/gwtest.v1.Library/GetBook"]
    assert [r.path.template for r in get_book] == ["/v1/{name=shelves/*/books/*}", "/v1/books/{name}"]
    assert get_book[0].path.match("/v1/shelves/s1/books/b%2F2") == {"name": "shelves/s1/books/b/2"}
    assert get_book[0].path.match("/v1/shelves/s1/books") is None
    assert doc["paths"]["/v1/books/{name}"]["get"]["operationId"] == "Library_GetBook_1"
    assert "GetBook reads one book." in doc["paths"]["/v1/{name}"]["get"]["description"]


def test_get_query_parameters_bind_scalars_repeated_and_nested(feature_routes):
    routes, doc, _ = feature_routes
    route = routes[0]
    query = [
        ("page_size", "10"),
        ("fields", "a"),
        ("fields", "b"),
        ("filter.author", "Le Guin"),
        ("verbose", "true"),
    ]
    call = bind_request(route, {"name": "shelves/1/books/2"}, query, b"")
    assert call.request.name == "shelves/1/books/2"
    assert call.request.page_size == 10
    assert list(call.request.fields) == ["a", "b"]
    assert call.request.filter.author == "Le Guin"
    assert call.request.verbose is True
    names = [p["name"] for p in doc["paths"]["/v1/{name}"]["get"]["parameters"]]
    assert names[0] == "name" and {"page_size", "fields", "filter.author", "filter.nested.author"} <= set(
        names
    )


def test_body_field_with_nested_path_variable(feature_routes):
    routes, doc, _ = feature_routes
    route = next(r for r in routes if r.http_method == "PATCH")
    assert route.body == "book" and route.reject_unknown_fields
    call = bind_request(
        route, {"book.name": "shelves/1/books/2"}, [("validate_only", "1")], b'{"pages": 3, "name": "x"}'
    )
    assert call.request.book.name == "shelves/1/books/2"  # the path wins over the body
    assert call.request.book.pages == 3 and call.request.validate_only
    # The body's ignored field is dropped; any other unknown one is refused.
    assert route.ignored_fields == ("etag",)
    assert (
        bind_request(route, {"book.name": "shelves/1/books/2"}, [], b'{"etag": "w/1"}').request.book.pages
        == 0
    )
    with pytest.raises(HttpError, match="colour: unknown field"):
        bind_request(route, {"book.name": "shelves/1/books/2"}, [], b'{"etag": "w/1", "colour": "red"}')
    assert "except `etag`" in doc["paths"]["/v1/{book.name}"]["patch"]["description"]
    body = doc["paths"]["/v1/{book.name}"]["patch"]["requestBody"]["content"]["application/json"]["schema"]
    assert body["anyOf"][0]["$ref"] == "#/components/schemas/gwtest.v1.Book"


def test_custom_verb_response_body_and_stream_method(feature_routes):
    routes, doc, source = feature_routes
    route = next(r for r in routes if r.http_method == "QUERY")
    assert (route.path.template, route.response_body, route.framing) == (
        "/v1/books:search",
        "books",
        Framing.NDJSON,
    )
    assert route.error_style is ErrorStyle.OPENAI
    assert (
        route.stream.wrap_field == "query" and route.stream.grpc_method == "/gwtest.v1.Library/SearchStream"
    )
    unary = bind_request(route, {}, [], b'{"query": "dune"}')
    assert unary.grpc_method == "/gwtest.v1.Library/Search" and not unary.server_streaming
    assert unary.response_body == "books"
    streamed = bind_request(route, {}, [], b'{"query": "dune", "stream": true}')
    assert streamed.grpc_method == "/gwtest.v1.Library/SearchStream" and streamed.server_streaming
    assert streamed.request.query.query == "dune" and streamed.request.query.stream
    assert "application/x-ndjson" in doc["paths"]["/v1/books:search"]["query"]["responses"]["200"]["content"]
    # int64 in schemas, unannotated methods skipped, generated code names the generated classes.
    assert doc["components"]["schemas"]["gwtest.v1.Book"]["properties"]["price"]["type"] == [
        "integer",
        "string",
    ]
    assert "NoHttp" not in source and "gwtest_v1_test_pb2.SearchStreamRequest" in source


def test_codegen_runs_protoc_with_the_plugin_as_make_proto_does(tmp_path):
    """gateway/codegen.py (make proto, wheel builds) launches the plugin under protoc: its files are gen/'s."""
    from protoserve.gateway import codegen

    out = tmp_path / "gen"
    codegen.generate(REPO, out)
    generated = out / "python" / "protoserve" / "generated"
    assert (generated / "routes.py").read_text().startswith("# Code generated by protoc-gen-gateway")
    for name in ("routes.py", "openapi.json", "protoserve.binpb"):
        assert (generated / name).read_bytes() == (GEN / "python/protoserve/generated" / name).read_bytes(), name
    assert (out / "python/protoserve/v1/inference_pb2.py").is_file()


# ------------------------------------------------------------------ annotations the generator rejects


@pytest.mark.parametrize(
    ("service", "error"),
    [
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {post: "/a" body: "nope"}; }',
            "body field 'nope' is not in gwtest.v1.Req",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {get: "/a/{missing}"}; }',
            "has no field 'missing'",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {get: "/a/{items}"}; }',
            "must be a singular scalar",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {get: "/a" body: "*"}; }',
            "GET routes cannot have a body",
        ),
        ('rpc A(Req) returns (Res) { option (google.api.http) = {get: "a/b"}; }', "must start with '/'"),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {get: "/a/{x=**}/b"}; }',
            "'**' must be the last",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {get: "/a" response_body: "nope"}; }',
            "response_body 'nope' is not in gwtest.v1.Res",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {get: "/a"}; }\n'
            'rpc B(Req) returns (Res) { option (google.api.http) = {get: "/a"}; }',
            "is already bound by gwtest.v1.S.A",
        ),
        (
            'rpc A(stream Req) returns (Res) { option (google.api.http) = {post: "/a" body: "*"}; }',
            "client-streaming methods cannot be served",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {post: "/a" body: "*"};'
            ' option (protoserve.options.v1.gateway) = {stream_method: "gwtest.v1.S.Nope"}; }',
            "service gwtest.v1.S has no method 'Nope'",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {post: "/a" body: "*"};'
            ' option (protoserve.options.v1.gateway) = {stream_method: "gwtest.v1.S.B"}; }\n'
            'rpc B(Req) returns (Res) { option (google.api.http) = {post: "/b" body: "*"}; }',
            "is not server-streaming",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {post: "/a" body: "*"};'
            ' option (protoserve.options.v1.gateway) = {stream_method: "gwtest.v1.S.B"}; }\n'
            'rpc B(Wrap) returns (stream Res) { option (google.api.http) = {post: "/b" body: "other"}; }',
            "body field 'other' is not a gwtest.v1.Req",
        ),
        (
            'rpc A(Res) returns (Res) { option (google.api.http) = {post: "/a" body: "*"};'
            ' option (protoserve.options.v1.gateway) = {stream_method: "gwtest.v1.S.B"}; }\n'
            'rpc B(Wrap) returns (stream Res) { option (google.api.http) = {post: "/b" body: "res"}; }',
            "needs a bool field 'stream'",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {post: "/a" body: "*"};'
            ' option (protoserve.options.v1.gateway) = {ignored_fields: ["store"]}; }',
            "ignored_fields only means something with reject_unknown_fields",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {post: "/a" body: "*"};'
            ' option (protoserve.options.v1.gateway) = {reject_unknown_fields: true ignored_fields: ["x"]}; }',
            "ignored field 'x' is a field of gwtest.v1.Req",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {post: "/a" body: "*"};'
            " option (protoserve.options.v1.gateway) = {reject_unknown_fields: true"
            ' ignored_fields: ["s", "s"]}; }',
            "ignored_fields must be distinct",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {get: "/a"};'
            ' option (protoserve.options.v1.gateway) = {reject_unknown_fields: true ignored_fields: ["s"]}; }',
            "this route has no body",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {post: "/a" body: "*"};'
            " option (protoserve.options.v1.gateway) = {example: '{\"x\": '}; }",
            "gwtest.v1.S.A: example is not JSON",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {post: "/a" body: "*"};'
            " option (protoserve.options.v1.gateway) = {example: '[1]'}; }",
            "example must be a JSON object",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {post: "/a" body: "*"};'
            " option (protoserve.options.v1.gateway) = {example: '{\"x\": \"a\", \"nope\": 1}'}; }",
            "example is not a valid gwtest.v1.Req: nope",
        ),
        (
            'rpc A(Req) returns (Res) { option (google.api.http) = {post: "/a" body: "*"};'
            " option (protoserve.options.v1.gateway) = {example: '{\"items\": \"a\"}'}; }",
            "example is not a valid gwtest.v1.Req: items",
        ),
    ],
)
def test_rejected_annotations(tmp_path, service, error):
    source = f"""
    service S {{
      {service}
    }}
    message Req {{ string x = 1; repeated string items = 2; bool stream = 3; }}
    message Res {{ string y = 1; }}
    message Wrap {{ Req req = 1; Res other = 2; Res res = 3; }}
    """
    response = generate(_compile(tmp_path, source))
    assert error in response.error
    assert not response.file


def test_access_and_examples_in_the_document(tmp_path):
    """GatewayRule.access becomes each operation's security; its example fills path, query and body."""
    source = """
    service S {
      rpc A(Req) returns (Res) {
        option (google.api.http) = {post: "/a/{x}" body: "*"};
        option (protoserve.options.v1.gateway) = {
          stream_method: "gwtest.v1.S.B" access: ACCESS_ADMIN example: '{"x": "id-1", "items": ["a"]}'
        };
      }
      rpc B(Wrap) returns (stream Res) {
        option (google.api.http) = {post: "/b" body: "req"};
        option (protoserve.options.v1.gateway) = {example: '{"req": {"x": "y"}}'};
      }
      rpc C(Req) returns (Res) {
        option (google.api.http) = {get: "/c"};
        option (protoserve.options.v1.gateway) = {access: ACCESS_PUBLIC example: '{"items": ["q"]}'};
      }
      rpc D(Req) returns (Res) { option (google.api.http) = {get: "/d"}; }
    }
    message Req { string x = 1; repeated string items = 2; bool stream = 3; }
    message Res { string y = 1; }
    message Wrap { Req req = 1; }
    """
    doc = json.loads(_files(generate(_compile(tmp_path, source)))["protoserve/generated/openapi.json"])
    assert set(doc["components"]["securitySchemes"]) == {API_KEY_SCHEME, USER_ID_SCHEME}
    with_key = [dict(requirement) for requirement in KEY_SECURITY]
    a, b = doc["paths"]["/a/{x}"]["post"], doc["paths"]["/b"]["post"]
    c, d = doc["paths"]["/c"]["get"], doc["paths"]["/d"]["get"]
    assert a["security"] == b["security"] == d["security"] == with_key
    assert c["security"] == []
    assert "Needs an admin key" in a["description"] and "admin" not in b.get("description", "")
    # Path fields leave the body for their parameter; a stream_method route offers a streamed body too.
    assert a["parameters"][0]["example"] == "id-1"
    examples = a["requestBody"]["content"]["application/json"]["examples"]
    assert examples["request"]["value"] == {"items": ["a"]}
    assert examples["stream"]["value"] == {"items": ["a"], "stream": True}
    assert "**Streaming.**" in a["description"] and "**Streaming.**" in b["description"]
    # A body field: its own part of the example; no streamed variant for a route that always streams.
    assert b["requestBody"]["content"]["application/json"]["examples"] == {
        "request": {"summary": "A request", "value": {"x": "y"}}
    }
    assert {p["name"]: p.get("example") for p in c["parameters"]}["items"] == ["q"]
    assert all("example" not in p for p in d["parameters"])
