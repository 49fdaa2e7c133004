# make demo | make test | make test-fast | make lint | make bench: each creates or reuses .venv with the pinned CPU stack.
VENV ?= .venv
PY := $(VENV)/bin/python
SITE = $$($(PY) -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
export OMP_NUM_THREADS ?= 1
export TORCH_EXTENSIONS_DIR := $(abspath $(VENV))/torch_extensions
DEMO_FLAGS ?= --val_freq 20 --ds_set zero_optimization.stage3_param_persistence_threshold=0

.PHONY: venv demo test test-fast lint bench gpu-check clean
venv: $(VENV)/.installed

$(VENV)/.installed: requirements-cpu.txt tools/torchvision_cpu_shim.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -r requirements-cpu.txt
	# DeepSpeed ships source only; it builds against the torch above.
	$(PY) -m pip install -q --no-build-isolation deepspeed==0.19.8
	# CPU-only accommodation: PyPI's torchaudio/torchcodec are CUDA builds that break imports
	# beside a CPU torch; torchvision stays (the Qwen2.5-VL processor needs it) with a shim.
	$(PY) -m pip uninstall -q -y torchaudio torchcodec || true
	cp tools/torchvision_cpu_shim.py $(SITE)/
	echo "import torchvision_cpu_shim" > $(SITE)/torchvision_cpu_shim.pth
	$(PY) -c "import torch, torchvision, vllm, deepspeed; assert '+cpu' in torch.__version__, torch.__version__"
	touch $@

# make demo [TASK=grounding|zoom|motion|judge|distill] [ARCH=qwen3_vl|qwen3_5|qwen3_vl_moe|qwen3_5_moe]: that task and model family
# make demo TASK=judge: the colour task graded by a judge behind an OpenAI-compatible endpoint (a stand-in on
# 127.0.0.1, tools/judge_server.py, started and stopped here; docs/judge.md)
# Two jobs on one machine need their own ports: MASTER_PORT (deepspeed's --master_port, the ranks' rendezvous) and,
# with TASK=judge, JUDGE_PORT (the stand-in judge), e.g. make demo TASK=judge MASTER_PORT=29501 JUDGE_PORT=8012
# make demo TASK=distill: the colour task learnt from a taught tiny teacher's log-probs alone (--teacher_model; the
# accuracy reward at weight 0, watched, not trained on); the teacher is made once by tools/teach.py into runs/teacher-*;
# TEACHER=untaught: the control, a teacher of random init (docs/demos.md)
MASTER_PORT ?= 29500
JUDGE_PORT ?= 8011
TEACHER ?= taught
TEACHER_DIR = runs/teacher-$(TEACHER)$(if $(ARCH),-$(ARCH))
ifeq ($(TASK),distill)
ifeq ($(filter $(TEACHER),taught untaught),)
$(error TEACHER=$(TEACHER): taught or untaught)
endif
endif
$(TEACHER_DIR)/done: tools/teach.py tiny.py | venv
	$(PY) tools/teach.py --out $(TEACHER_DIR) $(if $(filter untaught,$(TEACHER)),--untaught) $(if $(ARCH),--arch $(ARCH))

demo: venv $(if $(filter distill,$(TASK)),$(TEACHER_DIR)/done)
ifeq ($(TASK),judge)
	mkdir -p runs; $(PY) tools/judge_server.py --port $(JUDGE_PORT) > runs/judge_server.log 2>&1 & judge=$$!; \
	trap "kill $$judge" EXIT; sleep 2; $(VENV)/bin/deepspeed --num_gpus 2 --master_port $(MASTER_PORT) train.py \
	--output_dir runs/demo-judge --reward_funcs judge --judge_url http://127.0.0.1:$(JUDGE_PORT)/v1 --judge_model stand-in-judge \
	$(if $(ARCH),--tiny_arch $(ARCH)) $(DEMO_FLAGS)
else ifeq ($(TASK),distill)
	$(VENV)/bin/deepspeed --num_gpus 2 --master_port $(MASTER_PORT) train.py --output_dir runs/demo-distill-$(TEACHER)$(if $(ARCH),-$(ARCH) \
	--tiny_arch $(ARCH)) --teacher_model $(TEACHER_DIR) --reward_funcs accuracy --reward_weights 0 $(DEMO_FLAGS)
else
	$(VENV)/bin/deepspeed --num_gpus 2 --master_port $(MASTER_PORT) train.py --output_dir runs/demo$(if $(TASK),-$(TASK) --tiny_task $(TASK))$(if $(ARCH),-$(ARCH) --tiny_arch $(ARCH)) $(DEMO_FLAGS)
endif

# Two pytest workers (pytest-xdist): a one-process launch and the tests without a launch leave a core idle otherwise.
# --dist loadgroup hands out a test at a time as a worker frees up (xdist_group marks are inert under pytest 9.2:
# xdist 3.8 renames item._nodeid, which pytest 9 no longer reads); launch tests go first (conftest).
WORKERS ?= 2
test: venv
	$(PY) -m pytest -q -n $(WORKERS) --dist loadgroup --durations=15 tests

test-fast: venv   # every test that does not run the deepspeed launcher
	$(PY) -m pytest -q -n $(WORKERS) --dist loadgroup --durations=10 -m "not launch" tests

lint: venv   # pyflakes' rules and the import order (ruff.toml)
	$(VENV)/bin/ruff check .

bench: venv
	$(PY) tools/bench.py

# The first command on a GPU box: the GPU-only path, one pass/fail line per item, runs/gpu-check/report.json
# (OUT=dir for another folder, MODEL=path for your model). It runs in .venv if there is one, else in python3;
# .venv is the CPU stack of make test, so on a GPU box where make test ran first name the GPU stack's interpreter:
# make gpu-check GPU_PY=/path/to/gpu-env/bin/python. A GPU that the interpreter's torch cannot use fails (exit 2).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
gpu-check:
	$(GPU_PY) tools/gpu_check.py $(if $(MODEL),--model $(MODEL)) $(if $(OUT),--out $(OUT))

clean:
	rm -rf runs .cache
