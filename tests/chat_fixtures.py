"""A chat template of a model's own, a conversation for it, and the ids Hugging Face transformers makes of
them, recorded once (transformers is not a dependency of this project):

    write tokfiles.write_tokenizer_json(llama3_vocab(), d) and, in d/tokenizer_config.json,
    {"chat_template": TEMPLATE (or worker.tokens.chat.LLAMA3_TEMPLATE), "bos_token": "<|begin_of_text|>",
     "eos_token": "<|end_of_text|>", "tokenizer_class": "PreTrainedTokenizerFast"}; then, with
    transformers 5.24.0: AutoTokenizer.from_pretrained(d).apply_chat_template(CONVERSATION,
    add_generation_prompt=True, tokenize=True)["input_ids"]
"""

# Sensitive to what transformers' jinja2 settings do: trim_blocks and lstrip_blocks decide every newline
# and indent below; it also takes the system turn out, trims content, and guards the roles.
TEMPLATE = """{%- if messages[0]['role'] == 'system' %}
    {%- set system = messages[0]['content'] %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system = 'You are terse.' %}
{%- endif %}
{{ bos_token }}<|start_header_id|>system<|end_header_id|>

{{ system }}<|eot_id|>
{% for m in messages %}
    {% if m['role'] not in ['user', 'assistant'] %}{{ raise_exception('roles are user or assistant') }}{% endif %}
<|start_header_id|>{{ m['role'] }}<|end_header_id|>

{{ m['content'] | trim }}<|eot_id|>
{% endfor %}
{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

CONVERSATION = [
    {"role": "system", "content": "You answer in one line."},
    {"role": "user", "content": "  Grüß dich! What is 2+2?  "},
    {"role": "assistant", "content": "4."},
    {"role": "user", "content": "And 3+3, über-quickly?"},
]

# transformers' ids for CONVERSATION through TEMPLATE, and through Meta's Llama 3 template (our fallback)
TRANSFORMERS_IDS_OWN_TEMPLATE = [128000, 128006, 9125, 128007, 271, 2675, 4320, 304, 832, 1584, 13, 128009, 198, 128006, 882, 128007, 271, 6600, 2448, 8156, 29953, 0, 3639, 374, 220, 17, 10, 17, 30, 128009, 198, 128006, 78191, 128007, 271, 19, 13, 128009, 198, 128006, 882, 128007, 271, 3112, 220, 18, 10, 18, 11, 14104, 12, 28863, 398, 30, 128009, 198, 128006, 78191, 128007, 271]
TRANSFORMERS_IDS_LLAMA3_TEMPLATE = [128000, 128006, 9125, 128007, 271, 2675, 4320, 304, 832, 1584, 13, 128009, 128006, 882, 128007, 271, 6600, 2448, 8156, 29953, 0, 3639, 374, 220, 17, 10, 17, 30, 128009, 128006, 78191, 128007, 271, 19, 13, 128009, 128006, 882, 128007, 271, 3112, 220, 18, 10, 18, 11, 14104, 12, 28863, 398, 30, 128009, 128006, 78191, 128007, 271]
