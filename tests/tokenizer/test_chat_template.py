"""Chat templates: rendered exactly as transformers renders them, sandboxed, with clear errors."""

from __future__ import annotations

import json
from datetime import datetime

import pytest
from tokenizers import Tokenizer as BackendTokenizer
from tokenizers import models

from protoserve.engine.tokenizer.chat_template import ChatTemplate, ChatTemplateError, render_chat_template
from protoserve.engine.tokenizer.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "Hi!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2?"}],
    [
        {"role": "user", "content": "Write a haiku about GPUs."},
        {
            "role": "assistant",
            "content": "Silicon rivers\nthousands of small cores humming\nmatrices bloom fast",
        },
        {"role": "user", "content": "Now in 中文, with emoji 😀 and {{ braces }} and {% raw %}"},
    ],
    [{"role": "user", "content": ""}],
]


@pytest.mark.slow
@pytest.mark.parametrize("add_generation_prompt", [True, False])
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_smollm2_template_matches_transformers(
    smollm2_tokenizer, hf_smollm2_tokenizer, conversation, add_generation_prompt
):
    messages = CONVERSATIONS[conversation]
    ours = smollm2_tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt)
    theirs = hf_smollm2_tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert ours == theirs


def test_smollm2_template_content(smollm2_tokenizer):
    assert smollm2_tokenizer.has_chat_template
    prompt = smollm2_tokenizer.apply_chat_template(CONVERSATIONS[0])
    assert prompt.startswith("<|im_start|>system\n") and prompt.endswith(
        "<|im_start|>user\nHi!<|im_end|>\n<|im_start|>assistant\n"
    )
    # The rendered special tokens encode as single ids.
    assert smollm2_tokenizer.encode(prompt)[0] == 1


# Templates exercising what real checkpoints use: bos/eos, raise_exception, namespace, loop controls,
# tojson, {% generation %}, whitespace control.
TEMPLATES = {
    "llama2": (
        "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
        "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
        "{% set system_message = false %}{% endif %}"
        "{% for message in loop_messages %}"
        "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
        "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
        "{% if loop.index0 == 0 and system_message != false %}"
        "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
        "{% else %}{% set content = message['content'] %}{% endif %}"
        "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
        "{% elif message['role'] == 'assistant' %}{{ ' '  + content.strip() + ' ' + eos_token }}{% endif %}"
        "{% endfor %}"
    ),
    "llama3": (
        "{% set ns = namespace(n=0) %}{{ bos_token }}"
        "{% for message in messages %}{% set ns.n = ns.n + 1 %}"
        "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}"
        "{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}"
        "{{ '' if ns.n > 0 else 'empty' }}"
    ),
    "blocks": (
        "{%- for message in messages %}\n"
        "    {%- if message.role == 'system' %}{% continue %}{% endif %}\n"
        "    {%- if message.role == 'assistant' %}{% generation %}{{ message.content }}{% endgeneration %}\n"
        "    {%- else %}{{ message | tojson }}\n"
        "    {%- endif %}\n"
        "    {%- if loop.index > 5 %}{% break %}{% endif %}\n"
        "{%- endfor %}\n"
        "{%- if add_generation_prompt %}<gen>{% endif %}"
    ),
    "whitespace": (
        "{% for m in messages %}\n    {% if m.role == 'user' %}\n[{{ m.content }}]\n    {% endif %}\n{% endfor %}\n"
        "{% if add_generation_prompt %}\n  > \n{% endif %}"
    ),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
@pytest.mark.parametrize("conversation", range(len(CONVERSATIONS)))
def test_templates_match_transformers_renderer(name, conversation):
    chat_template_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    messages = CONVERSATIONS[conversation]
    kwargs = {"bos_token": "<s>", "eos_token": "</s>"}
    rendered, _ = chat_template_utils.render_jinja_template(
        conversations=[messages], chat_template=TEMPLATES[name], add_generation_prompt=True, **kwargs
    )
    assert render_chat_template(TEMPLATES[name], messages, **kwargs) == rendered[0]


def test_raise_exception_becomes_chat_template_error():
    messages = [{"role": "assistant", "content": "first"}]
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        render_chat_template(TEMPLATES["llama2"], messages, bos_token="<s>", eos_token="</s>")


def test_tojson_does_not_escape_html_or_unicode():
    template = ChatTemplate("{{ messages | tojson }}|{{ messages[0] | tojson(indent=2) }}")
    messages = [{"role": "user", "content": "<b>é & ü</b>"}]
    assert template.render(messages) == (
        json.dumps(messages, ensure_ascii=False) + "|" + json.dumps(messages[0], ensure_ascii=False, indent=2)
    )


def test_strftime_now_and_extra_variables():
    template = ChatTemplate("{{ strftime_now('%Y') }} {{ enable_thinking }} {{ tools | length }}")
    assert (
        template.render([], enable_thinking=False, tools=[{"name": "f"}]) == f"{datetime.now().year} False 1"
    )


def test_bos_and_eos_are_bound():
    template = ChatTemplate("{{ bos_token }}x{{ eos_token }}", bos_token="<B>", eos_token="<E>")
    assert template.render([]) == "<B>x<E>"


@pytest.mark.parametrize(
    "source",
    [
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{% set _ = messages.append({'role': 'user'}) %}",
        "{{ messages[0].update({'role': 'x'}) }}",
    ],
)
def test_templates_are_sandboxed(source):
    with pytest.raises(ChatTemplateError):
        ChatTemplate(source).render([{"role": "user", "content": "x"}])


def test_syntax_error_is_chat_template_error():
    with pytest.raises(ChatTemplateError, match="does not compile"):
        ChatTemplate("{% for m in messages %}")


def test_model_without_template_raises_chat_template_error():
    backend = BackendTokenizer(models.BPE(vocab={"a": 0}, merges=[]))
    tokenizer = Tokenizer(backend, source="tiny.gguf")
    assert not tokenizer.has_chat_template and tokenizer.chat_template is None
    with pytest.raises(ChatTemplateError, match="tiny.gguf: this model has no chat template"):
        tokenizer.apply_chat_template([{"role": "user", "content": "hi"}])
    with pytest.raises(ChatTemplateError):
        render_chat_template(None, [{"role": "user", "content": "hi"}])
    assert issubclass(ChatTemplateError, ValueError)
