import os

# tinygrad picks its device at import; tests run on the CPU backend (clang) unless told otherwise.
os.environ.setdefault("DEV", "CPU")
