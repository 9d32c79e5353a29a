import logging
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))

from helpers import make_hf_model

from policyworker.config import PolicyConfig
from policyworker.worker import MegatronPolicyWorker

logging.getLogger("megatron").setLevel(logging.ERROR)


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("llama"), "llama")


def make_worker(folder: Path, **overrides: object) -> MegatronPolicyWorker:
    kw: dict[str, object] = dict(
        model_name=str(folder),
        precision="float32",
        train_global_batch_size=4,
        train_micro_batch_size=2,
        logprob_batch_size=2,
        max_total_sequence_length=64,
    )
    kw.update(overrides)
    return MegatronPolicyWorker(PolicyConfig(**kw))  # type: ignore[arg-type]
