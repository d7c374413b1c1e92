"""Text to token ids and back: the model's vocabulary as a stage serves it (vocabulary.py), the tokenizer it wraps
(tokenizer.py), a GGUF vocabulary as llama.cpp reads it (gguf_vocab.py), and chat templates (chat.py)."""
