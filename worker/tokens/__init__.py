"""Text to token ids and back: the tokenizer a stage uses (tokenizer.py), a GGUF vocabulary as llama.cpp reads
it (gguf_vocab.py), and chat templates (chat.py)."""
