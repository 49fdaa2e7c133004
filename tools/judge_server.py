"""A stand-in judge: a real HTTP server on 127.0.0.1 speaking OpenAI's chat-completions API (/v1/chat/completions,
/v1/models), for `make demo TASK=judge` and the tests. It grades as a careful judge would grade the prompt of
judge.DEFAULT_TEMPLATE: the answer to grade (its <answer>...</answer> if it has one) against the reference answer,
"yes" when they agree, "no" otherwise. What it stands in for is a served model: `vllm serve <a judge model>` (or
SGLang, or a hosted API) at the same URL; docs/judge.md. It is no model: a tiny random-init one (this project's)
writes no parsable grade.

    python tools/judge_server.py --port 8011 [--delay_s 0.5] [--fail_every 7] [--trickle_s 1] [--api_key KEY]
                                 [--log requests.jsonl]

--delay_s: seconds before each answer (a slow judge); --fail_every N: every N-th request answers 503; --trickle_s S:
each grade's whole response (status line, headers, body) is written one byte every S seconds; --api_key: every
request without `Authorization: Bearer KEY` answers 401; --log: one JSON line per request (its Authorization
header's presence, never its value, and the prompt's text).
"""
import argparse
import json
import re
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

REFERENCE = re.compile(r"Reference answer:\s*(.*?)\s*\n\s*\nAnswer to grade:\s*(.*?)\s*\n\s*\nIs the answer", re.S)
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.S)


def grade(text):
    """'yes' or 'no' for a prompt of judge.DEFAULT_TEMPLATE's form; 'unsure' for any other prompt."""
    found = REFERENCE.search(text)
    if not found:
        return "unsure"
    reference, answer = found.group(1), found.group(2)
    answer = (ANSWER.findall(answer) or [answer])[-1]
    norm = lambda s: " ".join(s.lower().strip().rstrip(".").split())   # noqa: E731
    return "yes" if norm(reference) == norm(answer) else "no"


def serve(port, delay_s=0.0, fail_every=0, log=None, model="stand-in-judge", trickle_s=0.0, api_key=None):
    count, lock = [0], threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def reply(self, code, body, trickle_s=0.0):
            data = json.dumps(body).encode()
            if trickle_s:   # the whole response, its status line and headers too, one byte at a time
                raw = (f"HTTP/1.0 {code} OK\r\nContent-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
                       .encode() + data)
                try:
                    for i in range(len(raw)):
                        self.wfile.write(raw[i:i + 1])
                        time.sleep(trickle_s)
                except OSError:   # the client gave up waiting
                    pass
                return
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def refused(self):   # --api_key: a request without the key is refused, as a hosted API refuses it
            if api_key and self.headers.get("Authorization") != f"Bearer {api_key}":
                self.reply(401, {"error": {"message": "invalid api key"}})
                return True
            return False

        def do_GET(self):
            if self.refused():
                return
            if self.path.rstrip("/") == "/v1/models":
                return self.reply(200, {"object": "list", "data": [{"id": model, "object": "model"}]})
            self.reply(404, {"error": {"message": f"no route {self.path}"}})

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers.get("Content-Length", 0))) or b"{}")
            if self.refused():
                return
            if self.path.rstrip("/") != "/v1/chat/completions":
                return self.reply(404, {"error": {"message": f"no route {self.path}"}})
            content = body["messages"][-1]["content"]
            text = content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)
            with lock:
                count[0] += 1
                n = count[0]
                if log:
                    with open(log, "a") as f:
                        f.write(json.dumps({"n": n, "authorized": "Authorization" in self.headers, "text": text,
                                            "images": sum(p.get("type") == "image_url" for p in content)
                                            if isinstance(content, list) else 0}) + "\n")
            time.sleep(delay_s)
            if fail_every and n % fail_every == 0:
                return self.reply(503, {"error": {"message": "overloaded"}})
            self.reply(200, {"id": f"judge-{n}", "object": "chat.completion", "model": body.get("model", model),
                             "choices": [{"index": 0, "finish_reason": "stop",
                                          "message": {"role": "assistant", "content": grade(text)}}]}, trickle_s)

        def log_message(self, *a):   # quiet: the run's log is the one to read
            pass

    server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
    server.daemon_threads = True
    print(f"[judge] listening on http://127.0.0.1:{server.server_address[1]}/v1", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--port", type=int, default=8011)
    p.add_argument("--delay_s", type=float, default=0.0)
    p.add_argument("--fail_every", type=int, default=0)
    p.add_argument("--trickle_s", type=float, default=0.0)
    p.add_argument("--api_key", default=None)
    p.add_argument("--log", default=None)
    a = p.parse_args()
    serve(a.port, a.delay_s, a.fail_every, a.log, trickle_s=a.trickle_s, api_key=a.api_key)
