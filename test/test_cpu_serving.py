"""Real SGLang 0.5.23 servers on the CPU: HTTP API, exactness against HF transformers, and
speculative decoding (NGRAM, EAGLE3) token-exact against the same server without speculation."""

from __future__ import annotations

import json

import pytest
import requests

from server_utils import SGLangServer
from tiny_models import hf_greedy

pytestmark = pytest.mark.server

PROMPTS = [
    "def fibonacci(n):\n    ",
    "import os\nimport sys\n\nclass Config:\n    def __init__(self",
    "for i in range(10):\n    for i in range(10):\n        for i in range(",
    "The quick brown fox jumps over the lazy dog. The quick brown fox",
    "return self._data[key]\n\n    def __setitem__(self, key, value):\n        self._data[key] = value\n",
]
NEW_TOKENS = 32


def _prompt_ids(model_dir) -> list[list[int]]:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]


def _server_greedy(server: SGLangServer, prompt_ids) -> list[list[int]]:
    return [server.generate_ids(ids, NEW_TOKENS)["output_ids"] for ids in prompt_ids]


@pytest.fixture(scope="module")
def llama_plain(plain_llama):
    return plain_llama


@pytest.fixture(scope="module")
def llama_reference(tiny_models, llama_plain):
    """Greedy outputs of the plain (no speculation) server, after checking them against HF."""
    ids = _prompt_ids(tiny_models["llama"])
    return ids, _server_greedy(llama_plain, ids)


def test_health_and_model_info(llama_plain):
    assert requests.get(llama_plain.url + "/health", timeout=10).status_code == 200
    info = requests.get(llama_plain.url + "/model_info", timeout=10).json()
    assert info["model_path"].endswith("llama")
    server_info = requests.get(llama_plain.url + "/server_info", timeout=10).json()
    assert server_info["attention_backend"] == "intel_amx" and server_info["device"] == "cpu"


def test_generate_text(llama_plain):
    r = requests.post(llama_plain.url + "/generate", json={
        "text": "def hello(", "sampling_params": {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}},
        timeout=120).json()
    assert r["meta_info"]["completion_tokens"] == 16 and len(r["output_ids"]) == 16
    assert isinstance(r["text"], str) and r["text"]


def test_openai_completions_and_chat(llama_plain):
    comp = requests.post(llama_plain.url + "/v1/completions", json={
        "model": "tiny", "prompt": "import os\nimport", "max_tokens": 12, "temperature": 0}, timeout=120).json()
    assert comp["object"] == "text_completion"
    assert comp["usage"]["completion_tokens"] <= 12 and comp["choices"][0]["text"] is not None
    chat = requests.post(llama_plain.url + "/v1/chat/completions", json={
        "model": "tiny", "messages": [{"role": "user", "content": "Say hi"}], "max_tokens": 10,
        "temperature": 0}, timeout=120).json()
    assert chat["object"] == "chat.completion"
    assert chat["choices"][0]["message"]["role"] == "assistant"
    assert chat["usage"]["prompt_tokens"] > 3


def test_streaming_matches_non_streaming(llama_plain):
    body = {"model": "tiny", "prompt": "class Foo:\n    def", "max_tokens": 16, "temperature": 0}
    full = requests.post(llama_plain.url + "/v1/completions", json=body, timeout=120).json()
    pieces, done = [], False
    with requests.post(llama_plain.url + "/v1/completions", json={**body, "stream": True},
                       stream=True, timeout=120) as r:
        for line in r.iter_lines(decode_unicode=True):
            if not line or not line.startswith("data: "):
                continue
            payload = line[len("data: "):]
            if payload == "[DONE]":
                done = True
                break
            pieces.append(json.loads(payload)["choices"][0]["text"])
    assert done and len(pieces) > 1
    assert "".join(pieces) == full["choices"][0]["text"]


def test_llama_greedy_matches_hf(tiny_models, llama_reference):
    ids, served = llama_reference
    assert len(ids) >= 4
    assert served == hf_greedy(tiny_models["llama"], ids, NEW_TOKENS)


def test_qwen3_greedy_matches_hf(tiny_models, server_logs):
    ids = _prompt_ids(tiny_models["qwen3"])
    with SGLangServer(tiny_models["qwen3"], log_path=server_logs / "qwen3-plain.log") as srv:
        served = _server_greedy(srv, ids)
    assert served == hf_greedy(tiny_models["qwen3"], ids, NEW_TOKENS)


def test_ngram_token_exact(tiny_models, server_logs, llama_reference):
    ids, reference = llama_reference
    args = ["--speculative-algorithm", "NGRAM", "--speculative-num-draft-tokens", "8"]
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / "llama-ngram.log") as srv:
        outs = [srv.generate_ids(p, NEW_TOKENS) for p in ids]
    assert [o["output_ids"] for o in outs] == reference
    # the drafts were really verified, and some were accepted (repetitive prompts / outputs)
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
    assert max(o["meta_info"]["spec_accept_length"] for o in outs) > 1.0


@pytest.mark.parametrize("topk,steps,draft_tokens", [(2, 3, 6), (1, 3, 4)])
def test_eagle3_token_exact(tiny_models, server_logs, llama_reference, topk, steps, draft_tokens):
    ids, reference = llama_reference
    args = ["--speculative-algorithm", "EAGLE3",
            "--speculative-draft-model-path", str(tiny_models["llama-eagle3"]),
            "--speculative-num-steps", str(steps), "--speculative-eagle-topk", str(topk),
            "--speculative-num-draft-tokens", str(draft_tokens)]
    with SGLangServer(tiny_models["llama"], args, log_path=server_logs / f"llama-eagle3-{topk}.log") as srv:
        outs = [srv.generate_ids(p, NEW_TOKENS) for p in ids]
    assert [o["output_ids"] for o in outs] == reference
    assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)


def test_a_server_whose_port_is_taken_is_relaunched_on_another(tiny_models, server_logs):
    """The port race of two servers started side by side: the first port is held by a listening
    socket, so the server exits with ``address already in use`` and comes up on a new port."""
    import socket

    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        taken = held.getsockname()[1]
        srv = SGLangServer(tiny_models["llama"], log_path=server_logs / "port-taken.log")
        srv.port, srv.url = taken, f"http://127.0.0.1:{taken}"
        srv.args[srv.args.index("--port") + 1] = str(taken)
        with srv:
            assert srv.port != taken and srv.proc.poll() is None
            assert len(srv.generate_ids([5, 6, 7], 3)["output_ids"]) == 3
