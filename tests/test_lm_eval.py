"""lm-eval against a served cluster of the real file (issue 26): `lm_eval --model local-completions` scores our
local multiple-choice task (tests/lmeval/) through a 3-stage `ppsmoke.py --seed --serve` cluster of
SmolLM2-135M-Instruct, and every (question, choice) loglikelihood is within LL_ATOL of what lm-eval's own
`--model hf` gives on the same GGUF (transformers dequantizing it to float32; recorded by
tests/record_lmeval_hf.py in tests/smollm2_lmeval_hf.json), with the same is_greedy flags.

lm-eval reaches the cluster as it reaches vLLM, offline and with its defaults where it can: prompts as token-id
lists (`tokenized_requests`), 4 a request (`--batch_size 4`: a list of prompts), `echo: true, logprobs: 1,
max_tokens: 1`; its tokenizer is the server's own (`tokenizer_backend=remote`: GET /tokenizer_info,
POST /tokenize), which is what lm-eval's `auto` picks when the server has them; naming it makes a server
without them fail here rather than fall back to a tokenizer from the Hub. The ids pp's tokenizer gives for
these texts, split as lm-eval splits them, are the ones hf scored (context_ids, continuation_ids; default suite).

lm-eval needs torch, which pp does not: the test runs it in a virtualenv of its own (requirements-eval.txt)
named by PP_LMEVAL_PYTHON, and is skipped without one. LL_ATOL: a loglikelihood here sums 1 or 2 tokens'
log-softmax, and pp's logits differ from transformers' by float32 summation order alone (about 1e-4;
test_real_model).
"""
import json
import os
import subprocess

import pytest

import test_chaos as chaos
from record_lmeval_hf import RECORD, per_choice, run_lm_eval
from test_real_model import MODEL
from worker.weights.fetch import installed_model
from worker.weights.gguf import GGUFSource

LL_ATOL = 1e-3
N = 3
RECORDED = json.loads(RECORD.read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def lmeval_python() -> str:
    python = os.environ.get("PP_LMEVAL_PYTHON")
    if not python:
        pytest.skip("PP_LMEVAL_PYTHON is not set: the interpreter of a virtualenv with requirements-eval.txt")
    found = subprocess.run([python, "-c", "import lm_eval"], capture_output=True, text=True)
    if found.returncode != 0:
        pytest.skip(f"lm_eval is not importable by PP_LMEVAL_PYTHON={python}: {found.stderr.strip()[-300:]}")
    return python


def local_completions_args(base_url: str, api_key: str) -> str:
    """lm-eval's model_args for a pp cluster at `base_url` (no /v1). The completions carry OPENAI_API_KEY;
    lm-eval sends the tokenizer endpoints `auth_token` alone."""
    return f"model={MODEL},base_url={base_url}/v1/completions,tokenizer_backend=remote,auth_token={api_key}"


def assert_matches_record(rows: list[dict], recorded: dict) -> float:
    """Every row's loglikelihood within LL_ATOL of the record's and its is_greedy flag the same; returns the
    largest difference."""
    want = {(r["doc_id"], r["choice"]): r for r in recorded["samples"]}
    got = {(r["doc_id"], r["choice"]): r for r in rows}
    assert got.keys() == want.keys()
    off = [(k, got[k]["loglikelihood"], w["loglikelihood"], w["context_ids"] + w["continuation_ids"])
           for k, w in want.items() if abs(got[k]["loglikelihood"] - w["loglikelihood"]) > LL_ATOL]
    assert off == [], "(doc, choice), served, hf, the ids hf scored:\n" + "\n".join(map(str, off))
    assert {k: r["is_greedy"] for k, r in got.items()} == {k: r["is_greedy"] for k, r in want.items()}
    return max(abs(got[k]["loglikelihood"] - w["loglikelihood"]) for k, w in want.items())


def test_pp_tokenizes_each_context_and_choice_into_the_ids_lm_eval_s_hf_model_scored():
    tok = GGUFSource(installed_model(MODEL)).tokenizer()
    for row in RECORDED["samples"]:
        context = row["context"].rstrip()  # lm-eval moves a context's trailing spaces to the continuation
        whole = tok.encode_prompt(context + row["context"][len(context):] + row["continuation"])
        ids = tok.encode_prompt(context)
        assert (ids, whole[len(ids):]) == (row["context_ids"], row["continuation_ids"]), row


@pytest.mark.slow
def test_lm_eval_through_a_served_cluster_scores_each_choice_as_lm_eval_s_hf_model_does(lmeval_python, tmp_path):
    assert installed_model(MODEL).stat().st_size == RECORDED["file_bytes"], "not the file the record was made from"
    cluster = chaos.Cluster(tmp_path, n=N, model=MODEL)
    try:
        samples = run_lm_eval(lmeval_python, "local-completions", local_completions_args(cluster.base_url,
                              chaos.API_KEY), tmp_path / "lm_eval", extra=["--batch_size", "4"],
                              env={"OPENAI_API_KEY": chaos.API_KEY}, timeout_s=600)
        worst = assert_matches_record(per_choice(samples), RECORDED)
        print(f"\nlm-eval: {len(RECORDED['samples'])} loglikelihoods through {N} stages, largest difference from "
              f"--model hf {worst:.2e}")
        assert cluster.wait_idle() == [0] * N
    finally:
        cluster.stop()
