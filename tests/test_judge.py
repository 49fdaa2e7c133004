"""The LLM judge as a reward (judge.py), against a real HTTP server on 127.0.0.1 that speaks OpenAI's chat-completions
API (tools/judge_server.py: a stand-in grader, since no model here writes a parsable grade; `vllm serve` of the tiny
random-init model starts in about a minute and answers with colour words). Failures are unscored, never 0; the key
never reaches a file; a judge that dies mid-run stops the run after --judge_max_failed_steps with a checkpoint, and a
relaunch resumes once it is back."""
import json
import os
import subprocess
import sys
import threading
import time
import types

import pytest

import judge
import reward
import startup
import train
from conftest import FAST, ROOT, free_port, launch, read_metrics


def start_server(*flags, port=None):
    """tools/judge_server.py on a free port -> (process, base URL). Stop it with .kill()."""
    port = port or free_port()
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "tools", "judge_server.py"), "--port", str(port), *flags],
                         stdout=subprocess.PIPE, text=True)
    assert "listening" in p.stdout.readline()
    return p, f"http://127.0.0.1:{port}/v1"


@pytest.fixture
def configured():
    """judge.SETTINGS from the flags, put back afterwards."""
    before = dict(vars(judge.SETTINGS))

    def use(*flags):
        judge.configure(train.parse_args(["--reward_funcs", "judge", *flags]))
        judge.new_step()
    yield use
    judge.SETTINGS.__dict__.update(before)
    judge.new_step()


def test_replies_parse_into_scores_and_anything_else_fails():
    assert judge.parse("Yes.", "yes_no") == 1.0 and judge.parse("no, it is blue", "yes_no") == 0.0
    assert judge.parse("Score: 0.75", "number") == 0.75
    assert judge.parse("I give it 7/10... final: 10", "score_1_10") == 1.0
    for reply, parser in (("maybe", "yes_no"), ("", "yes_no"), ("1.5", "number"), ("eleven", "score_1_10"),
                          ("0", "score_1_10")):
        with pytest.raises(ValueError):
            judge.parse(reply, parser)


def test_the_judge_scores_concurrently_once_per_request_and_answers_while_the_caller_works(configured, tmp_path):
    """Eight distinct requests of a judge that takes 2 s each, 8 at a time, sent and then collected after 1.8 s of
    other work: collecting waits less than one request takes (they ran during the work), and everything took about
    one request's time, not eight; a repeated (prompt, completion) is asked once; the key goes out as a bearer
    token."""
    log = tmp_path / "requests.jsonl"
    server, url = start_server("--delay_s", "2.0", "--log", str(log))
    try:
        os.environ["JUDGE_API_KEY"] = "sk-test-secret"
        configured("--judge_url", url, "--judge_model", "stand-in-judge", "--judge_concurrency", "8")
        answers = ["red", "blue", "green", "yellow", "<answer>red</answer>", "Red.", "reddish", "RED"]
        cols = {"question": ["What colour?"] * 9, "solution": ["red"] * 9, "image": ["a.png"] * 9}
        t0 = time.perf_counter()
        judge.send(answers + ["red"], [{k: v[i] for k, v in cols.items()} for i in range(9)])
        time.sleep(1.8)
        t1 = time.perf_counter()
        scores = judge.judge(answers + ["red"], **cols)
        waited, took = time.perf_counter() - t1, time.perf_counter() - t0
    finally:
        os.environ.pop("JUDGE_API_KEY", None)
        server.kill()
    assert scores == [1.0, 0.0, 0.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0]
    rows = [json.loads(line) for line in open(log)]
    assert len(rows) == 8 and all(r["authorized"] for r in rows)
    assert judge.STATS["requests"] == 8 and 2.0 <= judge.STATS["latency_s"] and waited < judge.STATS["latency_s"]
    assert took < 2 * 2.0, took   # concurrent: one request's time, not eight


def test_a_failed_or_unparsable_judgement_is_unscored_never_zero(configured):
    """A reply that does not parse, a server that is gone, a 503 that outlasts the retries: each completion is a
    failure of the judge reward (out of its group's statistics and the loss), counted by reason."""
    server, url = start_server("--fail_every", "1")   # every request 503
    try:
        configured("--judge_url", url, "--judge_model", "m", "--judge_retries", "1", "--judge_template", "{completion}")
        total, scores, failed = reward.compute_rewards(["judge"], None, ["red"], {"solution": ["red"]})
        assert failed["judge"] == [True] and judge.STATS["failed_http_503"] == 1
    finally:
        server.kill()
    server, url = start_server()
    try:   # the stand-in cannot grade a prompt without a reference: "unsure", no yes or no
        configured("--judge_url", url, "--judge_model", "m", "--judge_template", "{completion}")
        assert reward.compute_rewards(["judge"], None, ["red"], {"solution": ["red"]})[2]["judge"] == [True]
        assert judge.STATS["failed_parse"] == 1
    finally:
        server.kill()
    configured("--judge_url", url, "--judge_model", "m", "--judge_retries", "0", "--judge_timeout_s", "2")
    total, _, failed = reward.compute_rewards(["judge", "accuracy"], None, ["red"], {"solution": ["red"]})
    assert failed == {"judge": [True], "accuracy": [False]} and judge.STATS["failed_connection"] == 1


def test_the_judge_needs_its_endpoint():
    with pytest.raises(SystemExit, match="--reward_funcs judge needs --judge_url"):
        train.check_args(train.parse_args(["--reward_funcs", "judge"]), 1)


@pytest.mark.launch
def test_a_judge_killed_mid_run_stops_the_run_saved_and_a_relaunch_resumes(tmp_path):
    """Two ranks on the colour task graded by the judge alone, its key in the environment. The judge is killed once
    step 2 is logged: the steps after it count its failures (judge/failed_connection, reward/judge_failures) and
    train on nothing from it; after --judge_max_failed_steps (2) such steps the run stops, checkpoint written,
    naming the judge. With the judge back, the relaunch resumes from that checkpoint and finishes. The key is in no
    file of the run and in no log line."""
    port, out = free_port(), tmp_path / "run"
    server, url = start_server(port=port)
    flags = [*FAST, "--reward_funcs", "judge", "--judge_url", url, "--judge_model", "stand-in-judge", "--judge_retries",
             "1", "--judge_timeout_s", "5", "--judge_max_failed_steps", "2", "--max_steps", "8", "--save_steps", "100",
             "--val_freq", "0", "--no-save_final_model"]
    from test_resume import trained

    from conftest import command
    cmd, env = command(out, flags, 2, env={"JUDGE_API_KEY": "sk-never-written-0451"})
    os.makedirs(out, exist_ok=True)
    with open(out / "first.log", "w") as log:
        p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.time() + 900
        while p.poll() is None and time.time() < deadline and not trained(out, 2):
            time.sleep(0.2)
        server.kill()
        server.wait()
        code = p.wait(timeout=900)
    first = open(out / "first.log").read()
    assert code != 0 and "the judge at" in first and "gave no score in 2 steps in a row" in first, first[-3000:]
    rows = [r for r in read_metrics(out) if "reward/mean" in r or "judge/requests" in r]
    last = max(r["step"] for r in rows)
    assert (out / f"checkpoint-{last}").is_dir()
    dead = [r for r in rows if r.get("judge/failed_connection", 0) > 0]
    assert len(dead) >= 2 and all(r["reward/judge_failures"] > 0 for r in dead)
    server, _ = start_server(port=port)
    try:
        resumed, log = launch(out, *flags, env={"JUDGE_API_KEY": "sk-never-written-0451"})
    finally:
        server.kill()
    assert f"checkpoint-{last}" in log and max(r["step"] for r in resumed) == 8
    assert resumed[-1].get("reward/judge", 0) >= 0 and resumed[-1].get("judge/requests", 0) > 0
    for d, _, files in os.walk(out):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                assert b"sk-never-written-0451" not in fh.read(), os.path.join(d, f)
    assert "sk-never-written-0451" not in first + log


PARSED = [   # (reply, parser, score; None: a failure, never a 0)
    ("Yes.", "yes_no", 1.0), ("no, it is blue", "yes_no", 0.0), ("maybe", "yes_no", None), ("", "yes_no", None),
    ("Score: 0.75", "number", 0.75), ("0.8", "number", 0.8), ("Score: 0.2/1", "number", 0.2),
    ("Rating: 1 out of 1", "number", 1.0), ("Score (0-1): 0.4", "number", 0.4), ("1.5", "number", None),
    ("-0.5", "number", None), ("4/5", "number", None), ("no number here", "number", None),
    ("I would rate this 3 out of 10.", "score_1_10", 2 / 9), ("7", "score_1_10", 6 / 9),
    ("On a scale of 1 to 10: 8", "score_1_10", 7 / 9), ("Rating (1-10): 4", "score_1_10", 3 / 9),
    ("I give it 7/10... final: 10", "score_1_10", 1.0), ("Score: 3. On reflection, score: 5", "score_1_10", 4 / 9),
    ("Grade: 6 (it names 2 of the 3 objects)", "score_1_10", 5 / 9),
    ("It names 2 of the 3 objects, so 7", "score_1_10", None), ("5/7", "score_1_10", None),
    ("Score: 11", "score_1_10", None), ("eleven", "score_1_10", None), ("0", "score_1_10", None),
]


@pytest.mark.parametrize("reply,parser,score", PARSED, ids=[f"{p}:{r[:30]}" for r, p, _ in PARSED])
def test_a_reply_scores_its_marked_number_or_fails(reply, parser, score):
    """A fraction's numerator or the number after a score word; without one, the only number; several unmarked
    numbers, a fraction off the scale, a number outside it: a failure."""
    if score is None:
        with pytest.raises(ValueError):
            judge.parse(reply, parser)
    else:
        assert judge.parse(reply, parser) == pytest.approx(score)


@pytest.mark.parametrize("url,says", [
    ("127.0.0.1:8000/v1", "http://127.0.0.1:8000/v1"), ("localhost:8000", "http://localhost:8000/v1"),
    ("http://127.0.0.1:8000", "http://127.0.0.1:8000/v1"), ("http://h:8000/v1/chat/completions", "http://h:8000/v1"),
    ("ftp://h/v1", "http://h/v1"), ("http://h:port/v1", "--judge_url")])
def test_a_judge_url_without_a_scheme_or_v1_is_refused_with_the_fix(url, says):
    args = train.parse_args(["--reward_funcs", "judge", "--judge_url", url, "--judge_model", "m"])
    with pytest.raises(SystemExit, match="--judge_url") as e:
        train.check_args(args, 1)
    assert says in str(e.value)
    for fine in ("http://127.0.0.1:8000/v1", "https://api.openai.com/v1/"):
        train.check_args(train.parse_args(["--reward_funcs", "judge", "--judge_url", fine, "--judge_model", "m"]), 1)


@pytest.mark.parametrize("url", ["http://user:hunter2@127.0.0.1:8000/v1", "user:hunter2@127.0.0.1:8000/v1",
                                 "https://:hunter2@api.example.com/v1"])
def test_a_judge_url_with_credentials_is_refused_without_printing_them(url):
    args = train.parse_args(["--reward_funcs", "judge", "--judge_url", url, "--judge_model", "m"])
    with pytest.raises(SystemExit, match="--judge_api_key_env") as e:
        train.check_args(args, 1)
    assert "hunter2" not in str(e.value) and "holds credentials" in str(e.value)


@pytest.mark.parametrize("template", ["Grade {completion", "Grade {completion}}", "Grade {0}", "Grade {}",
                                      "{sample.question}: {completion}", "{images[0]} {completion}",
                                      "{completion!x}"])
def test_a_malformed_judge_template_is_refused_at_start(template):
    args = train.parse_args(["--reward_funcs", "judge", "--judge_url", "http://h/v1", "--judge_model", "m",
                             "--judge_template", template])
    with pytest.raises(SystemExit, match="--judge_template"):
        train.check_args(args, 1)
    for fine in (judge.DEFAULT_TEMPLATE, "{question} {completion!r} {{literal braces}}"):
        train.check_args(train.parse_args(["--reward_funcs", "judge", "--judge_url", "http://h/v1", "--judge_model",
                                           "m", "--judge_template", fine]), 1)


def test_an_unreachable_judge_or_a_refused_key_stops_the_start_naming_the_flag(configured, world1):
    """startup.settle_flags asks the judge's /v1/models once on every rank and stops them all alike: a closed port
    names --judge_url, a 401 names --judge_api_key_env, a judge that answers lets the start go on."""
    closed = f"http://127.0.0.1:{free_port()}/v1"
    args = train.parse_args(["--reward_funcs", "judge", "--judge_url", closed, "--judge_model", "m",
                             "--judge_timeout_s", "3"])
    t0 = time.perf_counter()
    with pytest.raises(SystemExit, match="--judge_url") as e:
        startup.settle_flags(args, 0, 1, 1)
    assert closed in str(e.value) and time.perf_counter() - t0 < 4
    server, url = start_server("--api_key", "sk-right")
    try:
        os.environ["JUDGE_API_KEY"] = "sk-wrong"
        configured("--judge_url", url, "--judge_model", "m")
        assert "--judge_api_key_env" in judge.probe() and "sk-wrong" not in judge.probe()
        os.environ["JUDGE_API_KEY"] = "sk-right"
        assert judge.probe() is None
    finally:
        os.environ.pop("JUDGE_API_KEY", None)
        server.kill()


def test_the_timeout_bounds_the_whole_request_of_a_judge_that_trickles(configured):
    """A judge that writes its reply one byte a second: with --judge_timeout_s 3 the request ends as a timeout
    within about 3 s, not after the ~200 s the reply takes."""
    server, url = start_server("--trickle_s", "1")
    try:
        configured("--judge_url", url, "--judge_model", "m", "--judge_timeout_s", "3", "--judge_retries", "0")
        out = []
        asking = threading.Thread(target=lambda: out.append(judge.ask([{"type": "text", "text": "hi"}])), daemon=True)
        asking.start()
        asking.join(10)
    finally:
        server.kill()
    assert out, "the request outlived --judge_timeout_s 3 by 7 s"
    score, reason, seconds = out[0]
    assert score is None and reason == "timeout" and 3 <= seconds < 4, out


@pytest.mark.parametrize("task", ["judge", ""])
def test_every_demo_takes_the_launchers_and_the_judges_port(task):
    """Two demos on one machine: MASTER_PORT goes to deepspeed's --master_port, JUDGE_PORT to the stand-in judge."""
    r = subprocess.run(["make", "-n", "-o", "venv", "demo", f"TASK={task}", "MASTER_PORT=29611", "JUDGE_PORT=8123"],
                       cwd=ROOT, capture_output=True, text=True, check=True)
    assert "--master_port 29611" in r.stdout
    if task == "judge":
        assert "--port 8123" in r.stdout and "http://127.0.0.1:8123/v1" in r.stdout


def test_the_judge_sees_the_images_the_policy_saw_on_every_request(configured, parts, tmp_path):
    """--judge_images: every request train.py sends (ask_judge, then score's collection) carries the sample's
    downscaled image as an image_url part, counted by the stand-in server on the wire; the template's {image} names
    the row's image; score's collection finds ask_judge's requests (no second request without the image)."""
    processor, args, samples, _ = parts
    log = tmp_path / "requests.jsonl"
    server, url = start_server("--log", str(log))
    try:
        flags = ["--judge_url", url, "--judge_images", "--judge_template", "Image {image}. {completion}? yes or no"]
        configured(*flags)
        run = types.SimpleNamespace(args=train.parse_args(["--reward_funcs", "judge", *flags]))
        groups = [train.Group(sample=s, completions=[train.Completion(index=k, token_ids=[5], sampler_logps=[-1.0],
                                                                      text=f"red {i} {k}", finish_reason="stop")
                                                     for k in range(2)]) for i, s in enumerate(samples)]
        train.ask_judge(run, groups)
        comps = [c for g in groups for c in g.completions]
        cols = train.reward_inputs(run, [g.sample for g in groups for _ in g.completions], comps)
        reward.compute_rewards(["judge"], None, [c.text for c in comps], cols)
    finally:
        server.kill()
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(rows) == len(comps), "score's collection sent requests of its own: its fields differ from ask_judge's"
    assert all(r["images"] == 1 for r in rows), [r["images"] for r in rows]
    names = {os.path.basename(s["sources"][0]) for s in samples}
    assert all(any(n in r["text"] for n in names) and "(none)" not in r["text"] for r in rows), rows[0]["text"]
