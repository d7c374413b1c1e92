"""Record what llama.cpp's own tokenizer gives for the parity texts (not a test; run by hand, output
committed as tests/llamacpp_ids.json). llama.cpp built as docs/benchmarks.md says, plus the target
llama-tokenize:

  cmake --build build --target llama-tokenize
  PYTHONPATH=.:tests python tests/record_llamacpp_ids.py $LLAMA_CPP/build/bin/llama-tokenize
"""
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from vocabfiles import HARD, VOCABS, template_of, write_vocab_gguf


def ids(binary: str, gguf: Path, text: str, *, special: bool) -> list[int]:
    with tempfile.NamedTemporaryFile("w", encoding="utf-8", suffix=".txt", delete=False) as f:
        f.write(text)
    args = [binary, "-m", str(gguf), "-f", f.name, "--ids", "--no-escape", "--log-disable", "--no-bos"]
    out = subprocess.run(args + ([] if special else ["--no-parse-special"]), check=True, capture_output=True,
                         text=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(binary: str) -> None:
    version = subprocess.run([binary, "--version"], capture_output=True, text=True)
    record = {"llama.cpp": (version.stdout + version.stderr).strip().splitlines()[0], "vocabs": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name in VOCABS:
            gguf = Path(tmp) / f"{name}.gguf"
            write_vocab_gguf(gguf, name)
            record["vocabs"][name] = {"hard": ids(binary, gguf, HARD, special=False),
                                      "template": ids(binary, gguf, template_of(name), special=True)}
    out = Path(__file__).with_name("llamacpp_ids.json")
    out.write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main(sys.argv[1])
