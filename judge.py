"""An LLM (or VLM) judge as a reward: an OpenAI-compatible `/v1/chat/completions` endpoint (`vllm serve`, SGLang, a
hosted API) asked about each completion, its text parsed into a score.

    --reward_funcs accuracy judge --judge_url http://127.0.0.1:8000/v1 --judge_model Qwen/Qwen2.5-VL-7B-Instruct

The prompt is --judge_template, formatted with the sample's fields and `completion` (the question, the reference
answer `solution` where there is one, `image`: the image's path or name); with --judge_images the judge also sees
the images as the policy saw them (PNG data URLs, OpenAI's image_url parts). The reply is parsed by --judge_parser
(yes_no: 1 / 0; number: a number in [0, 1]; score_1_10: (n - 1) / 9); a reply that does not parse, a timeout, a
refused or failed request (after --judge_retries retries with backoff) is a failure: the completion is unscored
(out of its group's statistics and the loss, as a rule reward's failure), never a 0, and counted with its reason.
A step's requests go out at once (--judge_concurrency at a time; identical ones asked once) when the step's
completions are ready (send), and train.py collects them (collect) after the trainer's log-prob passes: the judge
answers while the trainer works. The API key comes from the environment variable --judge_api_key_env names; it is
never logged nor written (the flags hold the variable's name only).

Left out: a reward model colocated in the training processes (docs/judge.md says how an endpoint covers it), and
streaming.
"""
import base64
import concurrent.futures
import dataclasses
import io
import json
import os
import re
import threading
import time
import urllib.error
import urllib.request

DEFAULT_TEMPLATE = ("You are grading an answer to a question about an image ({image}).\n\nQuestion: {question}\n\n"
                    "Reference answer: {solution}\n\nAnswer to grade: {completion}\n\nIs the answer to grade correct? "
                    "Reply with one word, yes or no.")
PARSERS = ("yes_no", "number", "score_1_10")
NUMBER = re.compile(r"[-+]?\d+(?:\.\d+)?")


@dataclasses.dataclass
class Settings:
    """The judge of this run (--judge_*), set once at start-up (configure)."""
    url: str = None                  # OpenAI-compatible base URL, ending in /v1
    model: str = None
    template: str = DEFAULT_TEMPLATE
    parser: str = "yes_no"
    images: bool = False             # send the sample's images to a judge that sees them
    concurrency: int = 16
    timeout_s: float = 60.0
    retries: int = 3
    api_key_env: str = "JUDGE_API_KEY"
    max_tokens: int = 16


SETTINGS = Settings()
_pool, _step, _lock = None, {}, threading.Lock()   # the request threads; this step's requests by their content


def configure(args):
    """The run's judge from its flags (startup.py); a no-op without --judge_url."""
    global _pool
    SETTINGS.__dict__.update(url=args.judge_url, model=args.judge_model, template=args.judge_template,
                             parser=args.judge_parser, images=args.judge_images, concurrency=args.judge_concurrency,
                             timeout_s=args.judge_timeout_s, retries=args.judge_retries,
                             api_key_env=args.judge_api_key_env)
    if SETTINGS.url and _pool is None:
        _pool = concurrent.futures.ThreadPoolExecutor(SETTINGS.concurrency, thread_name_prefix="judge")


def parse(text, parser):
    """The judge's reply -> a score, or ValueError (a failure, never a 0)."""
    words = re.findall(r"[a-z]+", text.lower())
    if parser == "yes_no":
        found = [w for w in words if w in ("yes", "no")]
        if not found:
            raise ValueError(f"no yes or no in the reply {text[:80]!r}")
        return 1.0 if found[0] == "yes" else 0.0
    numbers = [float(n) for n in NUMBER.findall(text)]
    if not numbers:
        raise ValueError(f"no number in the reply {text[:80]!r}")
    lo, hi = (0.0, 1.0) if parser == "number" else (1.0, 10.0)
    n = numbers[-1]
    if not lo <= n <= hi:
        raise ValueError(f"{n:g} is outside {lo:g}..{hi:g} ({parser})")
    return n if parser == "number" else (n - 1.0) / 9.0


def prompt_of(completion, fields):
    """The user message's content for one completion: the template's text and, with --judge_images, the images."""
    image = fields.get("image")
    text = SETTINGS.template.format_map(_Blank({**fields, "completion": completion,
                                                "image": image if isinstance(image, str) else "attached" if image else
                                                "none"}))
    parts = [{"type": "text", "text": text}]
    for im in fields.get("_images", []) if SETTINGS.images else []:
        buf = io.BytesIO()
        im.save(buf, format="PNG")
        parts.insert(0, {"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                                  + base64.b64encode(buf.getvalue()).decode()}})
    return parts


class _Blank(dict):
    def __missing__(self, key):   # a field the template names that the sample lacks
        return "(none)"


def ask(content):
    """One request with retries and backoff -> (score or None, reason or None, seconds)."""
    t0, key = time.perf_counter(), os.environ.get(SETTINGS.api_key_env)
    body = json.dumps({"model": SETTINGS.model, "messages": [{"role": "user", "content": content}],
                       "temperature": 0.0, "max_tokens": SETTINGS.max_tokens}).encode()
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    reason = None
    for attempt in range(SETTINGS.retries + 1):
        if attempt:
            time.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)))
        try:
            req = urllib.request.Request(SETTINGS.url.rstrip("/") + "/chat/completions", body, headers)
            with urllib.request.urlopen(req, timeout=SETTINGS.timeout_s) as r:
                text = json.loads(r.read())["choices"][0]["message"]["content"] or ""
        except urllib.error.HTTPError as e:
            reason = f"http {e.code}"
            if e.code < 500 and e.code != 429:   # a refusal that a retry cannot change (a bad model name, a bad key)
                break
            continue
        except (urllib.error.URLError, TimeoutError, ConnectionError, OSError) as e:
            reason = "timeout" if "timed out" in str(e) else "connection"
            continue
        except (ValueError, KeyError, IndexError, TypeError):
            reason = "bad response"
            continue
        try:
            return parse(text, SETTINGS.parser), None, time.perf_counter() - t0
        except ValueError:
            return None, "parse", time.perf_counter() - t0
    return None, reason, time.perf_counter() - t0


def request_key(completion, fields):
    """What tells two requests apart: the completion, the sample's fields, its images (by identity)."""
    plain = {k: v for k, v in fields.items() if k != "_images"}
    return json.dumps([completion, plain], sort_keys=True, default=str), tuple(map(id, fields.get("_images", [])))


def send(completions, fields):
    """Sends completions[i] with fields[i] (the sample's columns and `_images`) to the judge, identical requests
    once, and returns at once; judge() collects. Each prompt, images included, is built in its request's thread."""
    for c, f in zip(completions, fields):
        key = request_key(c, f)
        with _lock:
            if key not in _step:
                _step[key] = _pool.submit(lambda c=c, f=f: ask(prompt_of(c, f)))


def judge(completions, **columns):
    """The reward function: the judge's score of each completion, None where it failed. It waits for the requests
    send() made, sending what it did not. Failures by reason, latency and wait go to STATS, summed over a step."""
    if not SETTINGS.url:
        raise ValueError("the judge reward needs --judge_url")
    t0 = time.perf_counter()
    fields = [{k: v[i] for k, v in columns.items()} for i in range(len(completions))]
    send(completions, fields)
    out, keys = [], set()
    for c, f in zip(completions, fields):
        key = request_key(c, f)
        score, reason, s = _step[key].result()
        out.append(score)
        if key not in keys:
            keys.add(key)
            STATS["latency_s"] = max(STATS.get("latency_s", 0.0), s)
            if reason:
                STATS[f"failed_{reason.replace(' ', '_')}"] = STATS.get(f"failed_{reason.replace(' ', '_')}", 0) + 1
    STATS["requests"] = STATS.get("requests", 0) + len(keys)
    STATS["wait_s"] = STATS.get("wait_s", 0.0) + time.perf_counter() - t0
    return out


STATS = {}   # this step's: requests, latency_s (the slowest), wait_s (what the step waited), failed_<reason> counts


def new_step():
    """A new step: the last step's requests and figures are forgotten (identical requests are asked once a step)."""
    with _lock:
        _step.clear()
    STATS.clear()
