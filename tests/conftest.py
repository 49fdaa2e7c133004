import os
import socket
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session")
def tiny_default():
    """(model_dir, train_jsonl, val_jsonl) of the embedded default, built once into .cache/tiny."""
    import tiny
    return tiny.ensure_default(os.path.join(ROOT, ".cache", "tiny"))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def llm(tiny_default):
    """One vLLM engine for the whole session, created by rollout.create_engine exactly as train.py
    does on each rank (external_launcher, world of one). An engine cannot be torn down without
    destroying the process group, so it lives until pytest exits."""
    import rollout
    import train
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    args = train.p.parse_args(["--max_completion_length", "8"])
    return rollout.create_engine(tiny_default[0], args, "float32", max_num_seqs=64, rank=0)
