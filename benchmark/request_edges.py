"""Requests at the end of the tiny test models' context (2048 tokens), shared by
``test/test_request_edges.py`` and the GPU serving check (``benchmark/gpu_serve_check.py``).

Each case is ``(prompt tokens, max_new_tokens or None for SGLang's default of 128)``; SGLang admits
prompts of up to 2042 tokens (context - 6) and ``prompt + max_new_tokens < 2048``, so ``EDGE_CODES``
are the HTTP codes a server without speculation answers.
"""

EDGE_CASES = [(1990, 34), (1900, 124), (2023, None), (1990, None), (2040, None), (2041, None), (2043, None),
              (2046, None), (2000, 46), (2000, 60), (600, None)]
EDGE_CODES = [200, 200, 200, 200, 200, 200, 400, 400, 200, 400, 200]


def edge_prompt(n: int) -> list[int]:
    """A prompt of ``n`` tokens with repeats, so that retrieval grafts long chains."""
    return [10 + (i * 7) % 97 for i in range(n)]


def edge_body(n: int, max_new) -> dict:
    """The ``/generate`` body of the case ``(n, max_new)``: greedy."""
    params = {"temperature": 0} if max_new is None else {"temperature": 0, "max_new_tokens": max_new}
    return {"input_ids": edge_prompt(n), "sampling_params": params}
