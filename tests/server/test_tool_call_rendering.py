"""Tools, past calls and tool results into the chat template, checked against transformers.

For templates that render tools (Qwen2.5-Instruct's, Llama-3.1-Instruct's, the real texts in
``fixtures/``), our prompt must be byte-identical to what ``transformers``' ``apply_chat_template``
makes of the same conversation as its users pass it: OpenAI-style messages whose calls carry their
arguments as a dict. For a template that ignores tools (SmolLM2's plain ChatML), the tools are taught
in the system message, past calls are written in the format's own text (which parses back to the
same calls) and tool results become ``<tool_response>`` user turns.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers.models import WordLevel
from transformers import PreTrainedTokenizerFast

from protoserve.engine.tokenizer.chat_template import ChatTemplate, ChatTemplateError
from protoserve.server.models.chat_turn import ChatTurn
from protoserve.server.tool_calls.call import ToolCall, ToolSpec
from protoserve.server.tool_calls.parsers import FORMATS, HERMES, LLAMA3_JSON, SMOLLM2, parse_output
from protoserve.server.tool_calls.rendering import (
    ToolTemplate,
    choose_format,
    instructions,
    template_messages,
    template_renders_tools,
    written_calls,
)

FIXTURES = Path(__file__).parent / "fixtures"
QWEN = (FIXTURES / "qwen2.5-instruct.jinja").read_text()
LLAMA = (FIXTURES / "llama-3.1-instruct.jinja").read_text()
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# (template, bos, eos) as each model's tokenizer_config.json has them.
MODELS = {
    "qwen2.5": (QWEN, None, "<|im_end|>"),
    "llama3.1": (LLAMA, "<|begin_of_text|>", "<|eot_id|>"),
}

WEATHER = ToolSpec(
    "get_weather",
    "Get the current weather in a city",
    {
        "type": "object",
        "properties": {
            "city": {"type": "string", "description": "e.g. Paris"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
        },
        "required": ["city"],
    },
)
CALC = ToolSpec("calculate", "", {"type": "object", "properties": {"expression": {"type": "string"}}})
TOOLS = [WEATHER, CALC]


def transformers_tokenizer(source: str, bos: str | None, eos: str) -> PreTrainedTokenizerFast:
    """A transformers tokenizer built offline: a word-level vocabulary of the special tokens only."""
    specials = [t for t in ("<unk>", bos, eos) if t]
    backend = BackendTokenizer(WordLevel({t: i for i, t in enumerate(specials)}, unk_token="<unk>"))
    return PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token=bos, eos_token=eos, chat_template=source
    )


def call(call_id: str, name: str, arguments: dict) -> ToolCall:
    return ToolCall(call_id, name, json.dumps(arguments))


def openai_message(turn: ChatTurn, content_none_with_calls: bool) -> dict:
    """The turn as a transformers user writes it: call arguments as a dict, as the docs show."""
    message: dict = {"role": turn.role, "content": turn.content}
    if turn.tool_calls:
        if content_none_with_calls and not turn.content:
            message["content"] = None
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for c in turn.tool_calls
        ]
    if turn.tool_call_id:
        message["tool_call_id"] = turn.tool_call_id
    return message


def ours(source: str, bos: str | None, eos: str, turns: list[ChatTurn], tools: list[ToolSpec]) -> str:
    fmt = choose_format(source, True, None)
    messages, variables = template_messages(turns, tools, ToolTemplate(fmt, renders_tools=True))
    return ChatTemplate(source, bos_token=bos, eos_token=eos).render(messages, **variables)


def theirs(
    source: str, bos: str | None, eos: str, turns: list[ChatTurn], tools: list[ToolSpec], none_content=True
):
    tokenizer = transformers_tokenizer(source, bos, eos)
    return tokenizer.apply_chat_template(
        [openai_message(t, none_content) for t in turns],
        tools=[t.as_openai() for t in tools] or None,
        tokenize=False,
        add_generation_prompt=True,
    )


ONE_CALL = [
    ChatTurn("system", "Answer briefly."),
    ChatTurn("user", "What is the weather in Paris?"),
    ChatTurn(
        "assistant", "", tool_calls=(call("call_1", "get_weather", {"city": "Paris", "unit": "celsius"}),)
    ),
    ChatTurn("tool", '{"temperature": 18, "sky": "clear"}', tool_call_id="call_1"),
]
CONVERSATIONS = {
    "a question": [ChatTurn("user", "What is the weather in Paris?")],
    "a system message and a question": ONE_CALL[:2],
    "one call and its result": ONE_CALL,
    "one call, its result and the answer": [
        *ONE_CALL,
        ChatTurn("assistant", "It is 18 °C and clear in Paris."),
        ChatTurn("user", "And in Tokyo?"),
    ],
    "no system message": ONE_CALL[1:],
    "arguments with quotes, unicode and nesting": [
        ChatTurn("user", "Search"),
        ChatTurn(
            "assistant",
            "",
            tool_calls=(call("call_9", "calculate", {"expression": 'say "hi" — ok', "n": [1, {"k": None}]}),),
        ),
        ChatTurn("tool", "done", tool_call_id="call_9"),
    ],
}
PARALLEL = [
    ChatTurn("user", "Weather in Paris, and 17 * 23?"),
    ChatTurn(
        "assistant",
        "Let me look both up.",
        tool_calls=(
            call("call_1", "get_weather", {"city": "Paris"}),
            call("call_2", "calculate", {"expression": "17 * 23"}),
        ),
    ),
    ChatTurn("tool", "18 C", tool_call_id="call_1"),
    ChatTurn("tool", "391", tool_call_id="call_2"),
]


@pytest.mark.parametrize("model", MODELS)
@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_prompt_with_tools_equals_transformers(model, conversation):
    source, bos, eos = MODELS[model]
    turns = CONVERSATIONS[conversation]
    expected = theirs(source, bos, eos, turns, TOOLS)
    assert ours(source, bos, eos, turns, TOOLS) == expected
    assert "get_weather" in expected and '"enum": [' in expected  # the tools are in the prompt


@pytest.mark.parametrize("model", MODELS)
def test_prompt_without_tools_equals_transformers(model):
    source, bos, eos = MODELS[model]
    turns = [ChatTurn("system", "Be kind."), ChatTurn("user", "Hello")]
    assert ours(source, bos, eos, turns, []) == theirs(source, bos, eos, turns, [])


def test_parallel_calls_and_their_results_equal_transformers_for_qwen():
    source, bos, eos = MODELS["qwen2.5"]
    expected = theirs(source, bos, eos, PARALLEL, TOOLS, none_content=False)
    assert ours(source, bos, eos, PARALLEL, TOOLS) == expected
    # Both results are one user turn, as Qwen's template groups consecutive tool messages.
    assert expected.count("<tool_response>") == 2 and expected.count("<|im_start|>user") == 2


def test_llama31_refuses_parallel_calls_as_transformers_does():
    source, bos, eos = MODELS["llama3.1"]
    with pytest.raises(Exception, match="single tool-calls"):
        theirs(source, bos, eos, PARALLEL, TOOLS)
    with pytest.raises(ChatTemplateError, match="single tool-calls"):
        ours(source, bos, eos, PARALLEL, TOOLS)


# -- which templates render tools, and which format they get ---------------------------------------


def test_templates_that_render_tools_are_measured_so():
    assert template_renders_tools(ChatTemplate(QWEN, eos_token="<|im_end|>").render)
    assert template_renders_tools(
        ChatTemplate(LLAMA, bos_token="<|begin_of_text|>", eos_token="<|eot_id|>").render
    )
    assert not template_renders_tools(ChatTemplate(SMOLLM2_TEMPLATE, eos_token="<|im_end|>").render)


def test_a_template_that_fails_with_tools_does_not_render_them():
    refusing = "{% if tools %}{{ raise_exception('no tools here') }}{% endif %}{{ messages[0]['content'] }}"
    assert not template_renders_tools(ChatTemplate(refusing).render)


def test_the_format_is_read_off_the_template():
    assert choose_format(QWEN, True, None) is HERMES
    assert choose_format(LLAMA, True, None) is LLAMA3_JSON
    assert choose_format(SMOLLM2_TEMPLATE, False, None) is SMOLLM2
    assert choose_format("{{ tools }}{{ messages }}", True, None) is None  # renders tools, format unknown
    for name, fmt in FORMATS.items():
        assert choose_format(QWEN, True, name) is fmt  # --tool-parser wins


# -- a template that does not render tools: they are written in ---------------------------------------

SMOL = ToolTemplate(SMOLLM2, renders_tools=False)


def smollm2_prompt(turns: list[ChatTurn], tools: list[ToolSpec]) -> str:
    messages, variables = template_messages(turns, tools, SMOL)
    assert variables == {}  # the template would drop a tools variable
    return ChatTemplate(SMOLLM2_TEMPLATE, bos_token="<|im_start|>", eos_token="<|im_end|>").render(messages)


def test_tools_are_taught_in_a_new_system_message():
    messages, _ = template_messages([ChatTurn("user", "Weather in Paris?")], TOOLS, SMOL)
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == instructions(TOOLS, SMOLLM2)
    listed = messages[0]["content"].split("<tools>")[1].split("</tools>")[0]
    assert json.loads(listed) == [
        {"name": "get_weather", "description": WEATHER.description, "parameters": WEATHER.parameters},
        {"name": "calculate", "parameters": CALC.parameters},
    ]
    prompt = smollm2_prompt([ChatTurn("user", "Weather in Paris?")], TOOLS)
    assert prompt.startswith("<|im_start|>system\nYou are an expert in composing functions.")
    assert "named SmolLM" not in prompt  # our system message replaces the template's default one


def test_tools_are_taught_after_an_existing_system_message():
    messages, _ = template_messages(
        [ChatTurn("system", "Answer briefly."), ChatTurn("user", "Hi")], TOOLS, SMOL
    )
    assert [m["role"] for m in messages] == ["system", "user"]
    assert messages[0]["content"] == "Answer briefly.\n\n" + instructions(TOOLS, SMOLLM2)


def test_without_tools_nothing_is_taught():
    turns = [ChatTurn("user", "Hi")]
    assert template_messages(turns, [], SMOL) == ([{"role": "user", "content": "Hi"}], {})


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_the_taught_example_is_a_call_the_parser_reads(fmt):
    example = instructions(TOOLS, fmt).split("NO other text MUST be included:\n", 1)[1]
    found = parse_output(example, fmt)
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == [
        ("func_name1", {"argument1": "value1"})
    ]


def test_past_calls_and_results_are_written_in_the_format():
    messages, _ = template_messages(PARALLEL + [ChatTurn("assistant", "It is 18 C; 391.")], TOOLS, SMOL)
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user", "assistant"]
    assistant = messages[2]["content"]
    assert assistant.startswith("Let me look both up.\n<tool_call>[")
    found = parse_output(assistant, SMOLLM2)
    assert found.content == "Let me look both up.\n"
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in PARALLEL[1].tool_calls
    ]
    # Consecutive results are one user turn, a block each, as SmolLM2's tool-use data has them.
    assert messages[3] == {
        "role": "user",
        "content": "<tool_response>\n18 C\n</tool_response>\n<tool_response>\n391\n</tool_response>",
    }
    prompt = smollm2_prompt(PARALLEL, TOOLS)
    assert prompt.endswith(
        "<|im_start|>user\n<tool_response>\n18 C\n</tool_response>\n<tool_response>\n391\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n"
    )


def test_results_of_separate_steps_stay_separate_turns():
    step = [
        ChatTurn("assistant", "", tool_calls=(call("call_1", "calculate", {"expression": "1+1"}),)),
        ChatTurn("tool", "2", tool_call_id="call_1"),
    ]
    messages, _ = template_messages([ChatTurn("user", "Go"), *step, *step], [], SMOL)
    assert [m["role"] for m in messages] == ["user", "assistant", "user", "assistant", "user"]
    assert (
        messages[1]["content"]
        == '<tool_call>[{"name": "calculate", "arguments": {"expression": "1+1"}}]</tool_call>'
    )
    assert messages[2]["content"] == messages[4]["content"] == "<tool_response>\n2\n</tool_response>"


@pytest.mark.parametrize("fmt", FORMATS.values(), ids=lambda f: f.name)
def test_written_calls_parse_back_to_the_same_calls(fmt):
    calls = [
        call("call_1", "get_weather", {"city": "São Paulo", "note": 'a "}" ; </tool_call>'}),
        call("call_2", "calculate", {"expression": "17 * 23", "deep": [{"a": [1, 2]}, None]}),
    ]
    found = parse_output(written_calls(calls, fmt), fmt)
    assert found.content is None
    assert [(c.name, json.loads(c.arguments)) for c in found.tool_calls] == [
        (c.name, json.loads(c.arguments)) for c in calls
    ]
