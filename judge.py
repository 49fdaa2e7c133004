"""An LLM (or VLM) judge as a reward: an OpenAI-compatible `/v1/chat/completions` endpoint (`vllm serve`, SGLang, a
hosted API) asked about each completion, its text parsed into a score.

    --reward_funcs accuracy judge --judge_url http://127.0.0.1:8000/v1 --judge_model Qwen/Qwen2.5-VL-7B-Instruct

The prompt is --judge_template, formatted with the sample's fields and `completion` (the question, the reference
answer `solution` where there is one, `image`: the image's path or name); with --judge_images the judge also sees
the images as the policy saw them (PNG data URLs, OpenAI's image_url parts). The reply is parsed by --judge_parser
(yes_no: 1 / 0; number: a number in [0, 1]; score_1_10: (n - 1) / 9; see parse for which number); a reply that does
not parse, a timeout (of the whole request), a refused or failed request (after --judge_retries retries with
backoff) is a failure: the completion is unscored (out of its group's statistics and the loss, as a rule reward's
failure), never a 0, and counted with its reason. The URL and the template are checked with the flags, and every
rank asks the judge once at start (probe).
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
import http.client
import io
import json
import os
import re
import socket
import string
import threading
import time
import urllib.error
import urllib.parse
import urllib.request

DEFAULT_TEMPLATE = ("You are grading an answer to a question about an image ({image}).\n\nQuestion: {question}\n\n"
                    "Reference answer: {solution}\n\nAnswer to grade: {completion}\n\nIs the answer to grade correct? "
                    "Reply with one word, yes or no.")
PARSERS = ("yes_no", "number", "score_1_10")
SCALES = {"number": (0.0, 1.0), "score_1_10": (1.0, 10.0)}
_NUM = r"([-+]?(?:\d+(?:\.\d+)?|\.\d+))"
NUMBER = re.compile(_NUM)
RANGE = re.compile(rf"{_NUM}\s*(?:-|\u2013|\bto\b)\s*{_NUM}")                  # "1-10", "1 to 10": a scale
FRACTION = re.compile(rf"{_NUM}\s*(?:/|out of)\s*{_NUM}")                      # "7/10", "3 out of 10"
MARKED = re.compile(rf"\b(?:scored?|rating|rated?|grade[d]?|final)\b[^\d\n+-]{{0,20}}?{_NUM}")   # "Score: 7"


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
    """The judge's reply -> a score, or ValueError (a failure, never a 0). yes_no: the first yes or no. number and
    score_1_10: the last number marked as the score (a fraction's numerator, its denominator the scale's top, or a
    number after score, rating, rate, grade or final), else the only number; a range (1-10) is the scale; several
    unmarked numbers or none fail."""
    if parser == "yes_no":
        found = [w for w in re.findall(r"[a-z]+", text.lower()) if w in ("yes", "no")]
        if not found:
            raise ValueError(f"no yes or no in the reply {text[:80]!r}")
        return 1.0 if found[0] == "yes" else 0.0
    lo, hi = SCALES[parser]
    low = RANGE.sub(lambda m: " " * len(m[0]) if float(m[1]) < float(m[2]) else m[0], text.lower())
    fractions = list(FRACTION.finditer(low))
    marked = {m.start(1): float(m[1]) for m in fractions if float(m[2]) == hi}   # a position -> its number
    marked.update({m.start(1): float(m[1]) for m in MARKED.finditer(low)})
    numbers = [float(n) for n in NUMBER.findall(low)]
    if not marked and fractions:
        raise ValueError(f"{fractions[0][0]!r} in the reply {text[:80]!r} is not on the {lo:g}..{hi:g} scale "
                         f"({parser})")
    if not marked and len(numbers) != 1:
        raise ValueError(f"{'several numbers and none marked as the score' if numbers else 'no number'} in the reply "
                         f"{text[:80]!r}")
    n = marked[max(marked)] if marked else numbers[0]
    if not lo <= n <= hi:
        raise ValueError(f"{n:g} is outside {lo:g}..{hi:g} ({parser})")
    return n if parser == "number" else (n - 1.0) / 9.0


def url_problem(url):
    """--judge_url -> None when it reads as an endpoint's base URL (http or https, ending in /v1), else the error
    with its fix; a URL holding credentials is refused without being repeated."""
    if "@" in re.split(r"[/?#]", url.split("://", 1)[-1], maxsplit=1)[0]:
        return ("--judge_url holds credentials (user:password@), which this client does not send and the run would "
                "log: give the URL without them and the key in the environment variable that --judge_api_key_env "
                "names (sent as a bearer token)")
    u = urllib.parse.urlsplit(url)
    try:
        u.port
    except ValueError:
        return f"--judge_url {url}: its port is not a number"
    if u.scheme in ("http", "https") and u.hostname and u.path.rstrip("/").endswith("/v1"):
        return None
    fix = (url if u.scheme in ("http", "https") else "http://" + url.split("://", 1)[-1]).rstrip("/")
    fix = fix[:fix.index("/v1/") + 3] if "/v1/" in fix else fix if fix.endswith("/v1") else fix + "/v1"
    return (f"--judge_url {url}: an OpenAI-compatible endpoint's base URL starts with http:// or https:// and ends in "
            f"/v1, e.g. --judge_url {fix}")


def template_problem(template):
    """--judge_template -> None when str.format_map can fill it with named fields, else the error with its fix."""
    fix = ("fields are named ({question}, {solution}, {completion}, {image}: the sample's columns); a literal brace "
           "is written {{ or }}")
    try:
        fields = [(f, c) for _, f, _, c in string.Formatter().parse(template) if f is not None]
    except ValueError as e:
        return f"--judge_template: {e}; {fix}"
    for f, conversion in fields:
        if not f.isidentifier() or conversion not in (None, "r", "s", "a"):
            shown = f + ("!" + conversion if conversion else "")
            return f"--judge_template: {{{shown}}} is not a plain named field; {fix}"
    return None


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


class _Deadline:
    """One request's connections, cut (their sockets shut) once timeout_s have passed since it began, however
    slowly the server trickles: a socket's own timeout bounds each read, not the request."""
    def __init__(self, timeout_s):
        self.conns, self.lock, self.expired = [], threading.Lock(), False
        self.timer = threading.Timer(timeout_s, self.cut)
        self.timer.daemon = True

    def cut(self):
        with self.lock:
            self.expired = True
            for c in self.conns:
                if c.sock is not None:
                    try:
                        c.sock.shutdown(socket.SHUT_RDWR)
                    except OSError:   # already closed
                        pass

    def connection(self, cls):
        """http.client's class `cls`, its connections registered before they connect (a timer's cut reaches them)."""
        deadline = self

        class Connection(cls):
            def connect(self):
                with deadline.lock:
                    deadline.conns.append(self)
                super().connect()
                if deadline.expired:   # cut while it connected
                    raise TimeoutError("timed out")
        return Connection


class _HTTP(urllib.request.HTTPHandler):
    def __init__(self, deadline):
        super().__init__()
        self.deadline = deadline

    def http_open(self, req):
        return self.do_open(self.deadline.connection(http.client.HTTPConnection), req)


class _HTTPS(urllib.request.HTTPSHandler):
    def __init__(self, deadline):
        super().__init__()
        self.deadline = deadline

    def https_open(self, req):   # the default TLS context, as urllib's own handler
        return self.do_open(self.deadline.connection(http.client.HTTPSConnection), req)


def request(url, body, timeout_s):
    """One GET (body None) or POST of JSON bytes to url, the key as a bearer token -> the reply's bytes. Raises
    urllib's HTTPError for a refusal, TimeoutError once timeout_s have passed (connecting and reading together)."""
    key = os.environ.get(SETTINGS.api_key_env)
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    deadline = _Deadline(timeout_s)
    deadline.timer.start()
    try:
        with urllib.request.build_opener(_HTTP(deadline), _HTTPS(deadline)).open(
                urllib.request.Request(url, body, headers), timeout=timeout_s) as r:
            return r.read()
    except (OSError, http.client.HTTPException):
        if deadline.expired:
            raise TimeoutError(f"no whole reply within {timeout_s:g} s") from None
        raise
    finally:
        deadline.timer.cancel()


def probe():
    """One GET of {--judge_url}/models, with this run's timeout -> None when the judge answers (any route), else the
    error to stop the start with: nothing answers, or the key is refused (401, 403)."""
    try:
        request(SETTINGS.url.rstrip("/") + "/models", None, SETTINGS.timeout_s)
    except urllib.error.HTTPError as e:
        if e.code in (401, 403):
            return (f"error: the judge at {SETTINGS.url} refused the key (http {e.code}): put it in the environment "
                    f"variable that --judge_api_key_env names ({SETTINGS.api_key_env}, "
                    f"{'set' if os.environ.get(SETTINGS.api_key_env) else 'not set'} here)")
    except (OSError, http.client.HTTPException) as e:
        why = (f"no answer within --judge_timeout_s {SETTINGS.timeout_s:g} s" if "timed out" in str(e) or
               isinstance(e, TimeoutError) else str(getattr(e, "reason", e)))
        return (f"error: --judge_url {SETTINGS.url}: no judge answers there ({why}); start it (vllm serve <model>, "
                f"docs/judge.md) or fix --judge_url")
    return None


def ask(content):
    """One request with retries and backoff -> (score or None, reason or None, seconds)."""
    t0 = time.perf_counter()
    body = json.dumps({"model": SETTINGS.model, "messages": [{"role": "user", "content": content}],
                       "temperature": 0.0, "max_tokens": SETTINGS.max_tokens}).encode()
    reason = None
    for attempt in range(SETTINGS.retries + 1):
        if attempt:
            time.sleep(min(8.0, 0.5 * 2 ** (attempt - 1)))
        try:
            reply = request(SETTINGS.url.rstrip("/") + "/chat/completions", body, SETTINGS.timeout_s)
            text = json.loads(reply)["choices"][0]["message"]["content"] or ""
        except urllib.error.HTTPError as e:
            reason = f"http {e.code}"
            if e.code < 500 and e.code != 429:   # a refusal that a retry cannot change (a bad model name, a bad key)
                break
            continue
        except (OSError, http.client.HTTPException) as e:   # TimeoutError, URLError and ConnectionError are OSErrors
            reason = "timeout" if isinstance(e, TimeoutError) or "timed out" in str(e) else "connection"
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
