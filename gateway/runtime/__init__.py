"""Hand-written runtime of the generated REST/JSON gateway.

Everything here is generic: it knows the google.api.http model (path
templates, ``body``, ``response_body``, query parameters) and the
``protoserve.options.v1.GatewayRule`` knobs, never a particular service.
The generated ``protoserve.generated.routes`` module supplies the route table.
"""
