"""Chat templates come from the model's own files and give the ids transformers' apply_chat_template gives
(recorded in chat_fixtures); models without one use Llama 3's."""
import json

import pytest

from chat_fixtures import (CONVERSATION, TEMPLATE, TRANSFORMERS_IDS_LLAMA3_TEMPLATE,
                           TRANSFORMERS_IDS_OWN_TEMPLATE)
from tokfiles import gguf_metadata, llama3_vocab, write_tokenizer_json
from worker.tokens import chat
from worker.errors import WorkerError
from worker.tokens.tokenizer import chat_template_from_config, tokenizer_from_gguf_metadata, tokenizer_from_json


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
    ([{"role": "tool", "content": "x"}], r"messages\[0\]: want a role"),
    ([{"role": "user", "content": 3}], r"messages\[0\]"),
])
def test_malformed_messages_are_refused(messages, problem):
    with pytest.raises(WorkerError, match=problem):
        chat.render(TEMPLATE, messages, bos_token="<s>", eos_token="</s>")


def test_tojson_keeps_html_and_non_ascii_as_transformers_does():
    out = chat.render("{{ messages[0] | tojson }}", [{"role": "user", "content": "<b>é</b>"}], bos_token="",
                      eos_token="")
    assert out == '{"role": "user", "content": "<b>é</b>"}'
