"""The engine-independent half of the ReAct agent: its tools and its loop.

``tool_registry`` holds the tools a run may call (the built-in ``calculator`` and those installed under
the ``protoserve.tools`` entry point group) and checks each call's arguments; ``calculator`` is the
built-in arithmetic tool; ``loop`` runs model steps and tool calls until the model answers, yielding
one event per thought, call, result and answer. The model step is a callable the server supplies.
"""
