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

# SmolLM2-135M-Instruct's template (its GGUF's tokenizer.chat_template): ChatML that writes every turn's role
# and content and nothing else, so it has no tool support: a tool call's name and arguments would vanish
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\n"
    "You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# A tool-aware template written for these tests, in the idioms tool-aware templates use: `'tool_calls' in
# message`, the arguments (an object) through tojson, consecutive tool results in one turn
TOOL_TEMPLATE = """{%- for message in messages %}
    {%- if message.role == 'tool' %}
        {%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}
{{- '<|im_start|>tool\\n' }}
        {%- endif %}
{{- '<result for="' + message.tool_call_id + '">' + message.content | trim + '</result>\\n' }}
        {%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}
{{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- else %}
{{- '<|im_start|>' + message.role + '\\n' + message.content }}
        {%- if 'tool_calls' in message %}
            {%- for call in message.tool_calls %}
{{- '<call id="' + call.id + '">' + {'name': call.function.name, 'arguments': call.function.arguments} | tojson }}
{{- '</call>' }}
            {%- endfor %}
        {%- endif %}
{{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- endif %}"""

# A tool-call history as an OpenAI client sends it, and as the entry hands it to the template
OPENAI_TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and in Zürich?", "name": "ana"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Zürich", "units": ["C"]}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": " 21 °C, sunny "},
    {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "14 °C, "},
                                                            {"type": "text", "text": "rain"}]},
    {"role": "assistant", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
    {"role": "tool", "tool_call_id": "call_3", "content": "12:00"},
]
TOOL_CONVERSATION = [
    {"role": "user", "content": "Weather in Paris and in Zürich?", "name": "ana"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}},
        {"id": "call_2", "type": "function",
         "function": {"name": "get_weather", "arguments": {"city": "Zürich", "units": ["C"]}}}]},
    {"role": "tool", "content": " 21 °C, sunny ", "tool_call_id": "call_1"},
    {"role": "tool", "content": "14 °C, rain", "tool_call_id": "call_2"},
    {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_3", "type": "function", "function": {"name": "get_time", "arguments": {}}}]},
    {"role": "tool", "content": "12:00", "tool_call_id": "call_3"},
]

# TOOL_CONVERSATION through TOOL_TEMPLATE, as transformers 5.24.0 renders it (render_jinja_template, with
# add_generation_prompt=True); test_chat_template checks it against transformers again where it is installed
TOOL_RENDERED = (
    '<|im_start|>user\nWeather in Paris and in Zürich?<|im_end|>\n'
    '<|im_start|>assistant\n<call id="call_1">{"name": "get_weather", "arguments": {"city": "Paris"}}</call>'
    '<call id="call_2">{"name": "get_weather", "arguments": {"city": "Zürich", "units": ["C"]}}</call><|im_end|>\n'
    '<|im_start|>tool\n<result for="call_1">21 °C, sunny</result>\n<result for="call_2">14 °C, rain</result>\n'
    '<|im_end|>\n'
    '<|im_start|>assistant\n<call id="call_3">{"name": "get_time", "arguments": {}}</call><|im_end|>\n'
    '<|im_start|>tool\n<result for="call_3">12:00</result>\n<|im_end|>\n'
    '<|im_start|>assistant\n')
