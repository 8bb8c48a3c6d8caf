"""The protoc plugin's pieces: the API model read from descriptors and its two emitters.

``api`` turns a CodeGeneratorRequest into validated routes, ``routes_module``
writes the Python route table the runtime serves, ``openapi`` writes the
OpenAPI document. ``protoserve.gateway.protoc_gen_gateway`` is the plugin entry point.
"""
