"""Record what lm-eval's own `--model hf` makes of the real SmolLM2-135M-Instruct file on our local
multiple-choice task (not a test; run by hand, output committed as tests/smollm2_lmeval_hf.json, read by
tests/test_lm_eval.py): every (question, choice) pair's loglikelihood and is_greedy flag as lm-eval logs them,
transformers dequantizing the GGUF to float32 on the CPU. lm-eval, torch and transformers are no requirement
of pp; run it in a virtualenv of its own (requirements-eval.txt), from the repository's root:

  python3 -m venv /tmp/lmeval && /tmp/lmeval/bin/pip install torch --index-url https://download.pytorch.org/whl/cpu
  /tmp/lmeval/bin/pip install -r requirements-eval.txt
  /tmp/lmeval/bin/python tests/record_lmeval_hf.py \
      "$(.venv/bin/python -c 'from worker.weights.fetch import installed_model; print(installed_model("smollm2:135m"))')"

This module imports nothing outside the standard library at the top: the test imports its helpers, which
run lm-eval in a subprocess either way.
"""
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASK = "pp_facts"  # tests/lmeval/pp_facts.yaml; its data path is relative to ROOT, where lm_eval runs
RECORD = Path(__file__).with_name("smollm2_lmeval_hf.json")
# nothing may come from the Hub: the task's data is a local jsonl, the model a local file or our own server
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def hf_model_args(gguf: Path) -> str:
    return f"pretrained={gguf.parent},gguf_file={gguf.name},dtype=float32"


def run_lm_eval(python: str, model: str, model_args: str, out: Path, *, extra=(), env=None,
                timeout_s: float = 900) -> list[dict]:
    """`lm_eval --model <model>` on the task with --log_samples, from the repository's root; returns its
    per-sample lines. `out` gets lm-eval's output and, in out/datasets, the datasets cache."""
    args = [python, "-m", "lm_eval", "--model", model, "--model_args", model_args, "--include_path",
            str(ROOT / "tests" / "lmeval"), "--tasks", TASK, "--log_samples", "--output_path", str(out), *extra]
    env = {**os.environ, **OFFLINE, "HF_DATASETS_CACHE": str(out / "datasets"), **(env or {})}
    proc = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s)
    assert proc.returncode == 0, f"lm_eval exited {proc.returncode}:\n{proc.stderr[-4000:]}"
    [samples] = out.glob(f"*/samples_{TASK}_*.jsonl")
    return [json.loads(line) for line in samples.read_text(encoding="utf-8").splitlines()]


def per_choice(samples: list[dict]) -> list[dict]:
    """One row per (doc, choice), in that order. lm-eval logs each response as strings: [loglikelihood, is_greedy]."""
    rows = []
    for s in sorted(samples, key=lambda s: s["doc_id"]):
        for choice, (ll, greedy) in enumerate(s["filtered_resps"]):
            arg = s["arguments"][f"gen_args_{choice}"]
            assert greedy in ("True", "False"), greedy
            rows.append({"doc_id": s["doc_id"], "choice": choice, "context": arg["arg_0"],
                         "continuation": arg["arg_1"], "loglikelihood": float(ll), "is_greedy": greedy == "True"})
    return rows


def token_ids(tok, context: str, continuation: str) -> tuple[list[int], list[int]]:
    """The ids lm-eval scores, split as its TemplateLM._encode_pair splits them: trailing spaces of the context
    move to the continuation, the whole is encoded and the context's length cut off (no BOS: this vocabulary
    adds none)."""
    n = len(context) - len(context.rstrip())
    if n:
        context, continuation = context[:-n], context[-n:] + continuation
    whole = tok(context + continuation, add_special_tokens=False).input_ids
    ctx = tok(context, add_special_tokens=False).input_ids
    return ctx, whole[len(ctx):]


def write_record(record: dict) -> None:
    """As JSON, one line per sample."""
    head = json.dumps({**record, "samples": None}, indent=1, ensure_ascii=False)
    rows = ",\n  ".join(json.dumps(row, ensure_ascii=False) for row in record["samples"])
    RECORD.write_text(head.replace('"samples": null', f'"samples": [\n  {rows}\n ]') + "\n", encoding="utf-8")


def main(gguf: str) -> None:
    from importlib.metadata import version

    from transformers import AutoTokenizer
    path = Path(gguf).resolve()
    model_args = hf_model_args(path)
    with tempfile.TemporaryDirectory() as tmp:
        start = time.monotonic()
        samples = run_lm_eval(sys.executable, "hf", model_args, Path(tmp),
                              extra=["--device", "cpu", "--batch_size", "1"])
        seconds = time.monotonic() - start
    tok = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    rows = per_choice(samples)
    for row in rows:
        row["context_ids"], row["continuation_ids"] = token_ids(tok, row["context"], row["continuation"])
    record = {"file": path.name, "file_bytes": path.stat().st_size,
              "versions": {p: version(p) for p in ("lm_eval", "torch", "transformers", "gguf", "datasets")},
              "lm_eval": f"--model hf --model_args {hf_model_args(Path('<dir>') / path.name)} --device cpu "
                         f"--batch_size 1 --tasks {TASK}", "seconds": round(seconds, 1),
              "acc": sum(s["acc"] for s in samples) / len(samples), "samples": rows}
    write_record(record)
    print(f"wrote {RECORD}: {len(rows)} loglikelihoods of {len(samples)} questions in {seconds:.0f} s")


if __name__ == "__main__":
    main(sys.argv[1])
