"""Drives strata's HTTP API with the official `openai` Python client, as an OpenAI user would.

    python check.py --base-url http://127.0.0.1:8080/v1 [--wait 120]

Waits for GET /health to answer 200, then checks: the model list, a completion, a chat completion, the same chat
streamed (role first, text equal to the whole response, usage chunk with the prompt tokens the prefix cache held),
a streamed completion, and that errors come back as the client's typed exceptions (BadRequestError,
NotFoundError). Exits non-zero on the first failure. Run by cli/tests/openai_client.rs against a real `strata local`
process; needs the venv of scripts/python-env.sh.
"""

import argparse
import sys
import time
import urllib.error
import urllib.request

import openai

PROMPT = "The capital of France is"


def wait_healthy(base_url: str, seconds: float) -> None:
    root = base_url.rstrip("/").removesuffix("/v1")
    deadline = time.monotonic() + seconds
    last = "no answer"
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(root + "/health", timeout=10) as r:
                if r.status == 200:
                    return
                last = f"status {r.status}"
        except urllib.error.HTTPError as e:
            last = f"status {e.code}: {e.read()[:300]!r}"
        except OSError as e:
            last = str(e)
        time.sleep(0.5)
    sys.exit(f"{root}/health not 200 within {seconds}s: {last}")


def check(cond: bool, what: str) -> None:
    if not cond:
        sys.exit(f"FAILED: {what}")


def expect_error(kind: type, what: str, call) -> openai.APIStatusError:
    try:
        call()
    except kind as e:
        check(isinstance(e.body, dict) and bool(e.body.get("message")), f"{what}: error body {e.body!r}")
        return e
    except openai.APIError as e:
        sys.exit(f"FAILED: {what}: expected {kind.__name__}, got {type(e).__name__}: {e}")
    sys.exit(f"FAILED: {what}: no error")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--base-url", required=True)
    ap.add_argument("--wait", type=float, default=120)
    args = ap.parse_args()
    wait_healthy(args.base_url, args.wait)
    client = openai.OpenAI(base_url=args.base_url, api_key="x", max_retries=0, timeout=120)

    models = client.models.list()
    check(len(models.data) == 1, f"one model served: {models}")
    model = models.data[0].id

    c = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    text = c.choices[0].text
    check(text.startswith(" Paris"), f"completion {text!r}")
    check(c.choices[0].finish_reason in ("stop", "length"), f"finish_reason {c.choices[0].finish_reason}")
    u = c.usage
    check(u.completion_tokens > 0 and u.total_tokens == u.prompt_tokens + u.completion_tokens, f"usage {u}")

    pieces = []
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0, stream=True):
        pieces.extend(ch.text for ch in chunk.choices)
    check("".join(pieces) == text, f"streamed completion {''.join(pieces)!r} != {text!r}")

    messages = [{"role": "user", "content": "What is the capital of France?"}]
    r = client.chat.completions.create(model=model, messages=messages, max_tokens=16, temperature=0)
    answer = r.choices[0].message.content
    check(r.choices[0].message.role == "assistant" and bool(answer), f"chat answer {r}")
    check(r.choices[0].finish_reason in ("stop", "length"), f"chat finish_reason {r.choices[0].finish_reason}")

    stream = client.chat.completions.create(
        model=model, messages=messages, max_tokens=16, temperature=0, stream=True,
        stream_options={"include_usage": True},
    )
    roles, deltas, finishes, usage = [], [], [], None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for ch in chunk.choices:
            roles.append(ch.delta.role)
            deltas.append(ch.delta.content or "")
            finishes.append(ch.finish_reason)
    check(roles[:1] == ["assistant"], f"the role comes first: {roles}")
    check("".join(deltas) == answer, f"streamed chat {''.join(deltas)!r} != {answer!r}")
    check(finishes[-1] == r.choices[0].finish_reason and all(f is None for f in finishes[:-1]), f"{finishes}")
    check(usage is not None and usage.completion_tokens == r.usage.completion_tokens, f"stream usage {usage}")
    # The same messages again: the prefix cache held the first request's prompt blocks, and usage says so.
    details = usage.prompt_tokens_details
    check(details is not None and 0 < details.cached_tokens < usage.prompt_tokens, f"cached prompt tokens {usage}")

    e = expect_error(openai.BadRequestError, "max_tokens beyond the context",
                     lambda: client.completions.create(model=model, prompt=PROMPT, max_tokens=1_000_000))
    check(e.status_code == 400 and e.type == "invalid_request_error", f"{e.status_code} {e.type}")
    e = expect_error(openai.NotFoundError, "unknown model",
                     lambda: client.chat.completions.create(model="gpt-4o", messages=messages))
    check(e.code == "model_not_found", f"code {e.code}")
    expect_error(openai.BadRequestError, "n = 2",
                 lambda: client.chat.completions.create(model=model, messages=messages, n=2))
    expect_error(openai.BadRequestError, "empty prompt",
                 lambda: client.completions.create(model=model, prompt=""))

    # Still serving after the errors.
    again = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0)
    check(again.choices[0].text == text, "the same greedy completion after the errors")
    print(f"openai {openai.__version__} client against {args.base_url}: all checks passed ({model})")


if __name__ == "__main__":
    main()
