"""The compute side of a stage: model, weights, tokenizer and the worker contract."""
