"""Where a model's tensors come from: the WeightSource contract (contract.py), weights kept in their file's
precision (packed.py), and the sources: GGUF (gguf_header.py, gguf.py, quants.py), Hugging Face (hf.py), the
built-in random models (tiny.py); a model argument resolved to local files (fetch.py) or a stage's slice of a
GGUF fetched by range requests (rangefetch.py). No tinygrad here."""
