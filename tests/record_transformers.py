"""Record what Hugging Face transformers makes of the real SmolLM2-135M-Instruct file (not a test; run by
hand, output committed as tests/smollm2_transformers.json, read by tests/test_real_model.py): the chat
template rendered and tokenized as `apply_chat_template` does it for a table of conversations, and
transformers' own greedy answers, float32, for a few prompts. torch and transformers are no requirement of
pp; run it in a throwaway virtualenv:

  python3 -m venv /tmp/tf && /tmp/tf/bin/pip install torch==2.13.0 transformers accelerate gguf
  /tmp/tf/bin/python tests/record_transformers.py \
      "$(.venv/bin/python -c 'from worker.weights.fetch import installed_model; print(installed_model("smollm2:135m"))')"
"""
import json
import sys
from importlib.metadata import version
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

SYSTEM = {"role": "system", "content": "You are a pirate. Answer in one sentence."}


def user(text: str) -> dict:
    return {"role": "user", "content": text}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": text}


CONVERSATIONS = {  # name -> (messages, add_generation_prompt)
    "one user turn: the template inserts its default system prompt": ([user("Say hello")], True),
    "a given system prompt": ([SYSTEM, user("Say hello")], True),
    "multi-turn": ([user("What is 2 + 2?"), assistant("2 + 2 = 4."), user("And times 3?")], True),
    "multi-turn with a system prompt": ([SYSTEM, user("Hi"), assistant("Ahoy!"), user("Where is the treasure?")],
                                        True),
    "no generation prompt": ([user("Say hello"), assistant("Hello!")], False),
    "unicode and whitespace": ([user("  Café, naïve, 日本語 🙂\n\n\ttabs  and  spaces \n")], True),
    "code": ([user("def f(x):\n    return x**2  # square\n\nprint(f(3))")], True),
    # transformers (sanitize_control_tokens=False, its default) and llama.cpp read it as the control token
    "a control token's text in a message": ([user("Say <|im_end|> hello")], True),
}
PROMPTS = ["Say hello", "What is the capital of France?", "Write a haiku about the sea."]  # one user turn each
MAX_NEW_TOKENS = 48
# raw prompts (no chat template), as a completions API takes them: whatever BOS the tokenizer adds, then the text
RAW_PROMPTS = ["Story number 0:", "Once upon a time", "  leading spaces, digits 12345 and é\n"]


def templates(tok) -> dict:
    out = {}
    for name, (messages, add_generation_prompt) in CONVERSATIONS.items():
        text = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=False)
        ids = tok.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True,
                                      return_dict=False)
        out[name] = {"messages": messages, "add_generation_prompt": add_generation_prompt, "text": text,
                     "ids": list(ids)}
    return out


def raw_prompts(tok) -> dict:
    return {text: tok(text, add_special_tokens=True)["input_ids"] for text in RAW_PROMPTS}


def greedy(tok, model, prompt: str) -> dict:
    ids = tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True,
                                  return_dict=False, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=MAX_NEW_TOKENS, do_sample=False, return_dict_in_generate=True,
                             output_logits=True)
    tokens = out.sequences[0, ids.shape[1]:].tolist()
    top2 = [torch.topk(step[0], 2).values.tolist() for step in out.logits]
    return {"prompt": prompt, "prompt_ids": ids[0].tolist(), "token_ids": tokens,
            "text": tok.decode(tokens, skip_special_tokens=True),
            "top_logit": [a for a, _ in top2], "top2_gap": [a - b for a, b in top2]}


def main(gguf: str) -> None:
    path = Path(gguf)
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    model.eval()
    record = {"file": path.name, "file_bytes": path.stat().st_size,
              "versions": {p: version(p) for p in ("transformers", "torch", "gguf", "jinja2")},
              "max_new_tokens": MAX_NEW_TOKENS, "templates": templates(tok), "raw": raw_prompts(tok),
              "greedy": [greedy(tok, model, p) for p in PROMPTS]}
    out = Path(__file__).with_name("smollm2_transformers.json")
    out.write_text(json.dumps(record, indent=1, ensure_ascii=False) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
