"""Tool calling for chat requests: tools into the prompt, the model's calls out of its text.

``call`` holds the plain data (a tool's spec, a call, the request's choice); ``rendering`` puts tools,
calls and results into the model's chat template; ``parsers`` finds calls in the model's output, the
same way whole or streamed; ``forcing`` builds the grammar that makes ``tool_choice`` "required" or a
named function hold.
"""
