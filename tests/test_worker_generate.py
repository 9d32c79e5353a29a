"""Generation in the worker (`generate`): transformers' greedy tokens, logprobs equal to
`get_logprobs` of the output, seeded sampling, stop rules, the context's end, bad input."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from conftest import make_worker
from helpers import make_hf_model

from policyworker.data.batched_data_dict import BatchedDataDict
from policyworker.memory.residency import PhaseError
from policyworker.model.attention.core import CoreAttention

EOS = 7
LENGTHS = [5, 3, 7, 1]


def prompts(lengths: list[int] = LENGTHS, width: int = 8, seed: int = 0) -> BatchedDataDict:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(10, 101, (len(lengths), width), generator=g)
    for row, n in enumerate(lengths):
        ids[row, n:] = 0
    return BatchedDataDict({"input_ids": ids, "input_lengths": torch.tensor(lengths)})


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_hf_model(tmp_path_factory.mktemp("gen"), "qwen3", eos_token_id=EOS)


@pytest.fixture(scope="module")
def worker(folder: Path):
    return make_worker(folder, temperature=0.7, generation={"max_new_tokens": 12})


def scored(worker, out: BatchedDataDict) -> torch.Tensor:
    """`get_logprobs` of the generated sequences."""
    seqs = {"input_ids": out["output_ids"], "input_lengths": out["unpadded_sequence_lengths"]}
    return worker.get_logprobs(data=BatchedDataDict(seqs))["logprobs"]


def response_mask(out: BatchedDataDict, lengths: list[int]) -> torch.Tensor:
    pos = torch.arange(out["output_ids"].shape[1])[None, :]
    start = torch.tensor(lengths)[:, None]
    return (pos >= start) & (pos < out["unpadded_sequence_lengths"][:, None])


def test_greedy_tokens_are_transformers_and_logprobs_are_get_logprobs(worker, folder):
    from transformers import AutoModelForCausalLM

    data = prompts()
    out = worker.generate(data=data, greedy=True)
    assert out["output_ids"].shape[1] == int(out["unpadded_sequence_lengths"].max())
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for row, n in enumerate(LENGTHS):
        want = hf.generate(
            data["input_ids"][row : row + 1, :n], max_new_tokens=12, do_sample=False,
            eos_token_id=EOS, pad_token_id=0,
        )[0]  # fmt: skip
        end = int(out["unpadded_sequence_lengths"][row])
        assert out["output_ids"][row, :end].tolist() == want.tolist()
        assert int(out["generation_lengths"][row]) == end - n
        assert bool(out["truncated"][row]) == (want[-1].item() != EOS)
        assert (out["output_ids"][row, end:] == 0).all()  # padding: the model's pad id (none: 0)
    mask = response_mask(out, LENGTHS)
    assert (out["logprobs"][~mask] == 0).all()
    assert (scored(worker, out) - out["logprobs"])[mask].abs().max() <= 1e-6


def test_sampling_is_seeded_and_its_logprobs_are_get_logprobs(worker):
    data = prompts()
    a, b = worker.generate(data=data, seed=3), worker.generate(data=data, seed=3)
    assert torch.equal(a["output_ids"], b["output_ids"])
    assert not torch.equal(a["output_ids"], worker.generate(data=data, seed=4)["output_ids"])
    mask = response_mask(a, LENGTHS)
    assert (scored(worker, a) - a["logprobs"])[mask].abs().max() <= 1e-6
    # calls without a seed take the next one each: a worker built alike draws alike
    assert not torch.equal(worker.generate(data=data)["output_ids"], a["output_ids"])


def test_top_k_1_and_a_tiny_top_p_draw_the_greedy_tokens(folder):
    data = prompts()
    for options in ({"top_k": 1}, {"top_p": 1e-6}):
        w = make_worker(folder, generation={"max_new_tokens": 6, **options})
        greedy = w.generate(data=data, greedy=True)
        drawn = w.generate(data=data, seed=1)
        assert torch.equal(drawn["output_ids"], greedy["output_ids"]), options
        # reported: the unfiltered distribution's logprob, as get_logprobs (not 0)
        assert torch.allclose(drawn["logprobs"], greedy["logprobs"])
        assert drawn["logprobs"].min() < -1e-3


def test_a_row_stops_at_the_context_end_and_the_output_is_a_batch_to_score(folder):
    w = make_worker(folder, max_total_sequence_length=10, generation={"max_new_tokens": 5})
    out = w.generate(data=prompts([8, 2], width=8), greedy=True)
    assert out["generation_lengths"].tolist() == [2, 5]  # 10 - 8; max_new_tokens
    # as wide as the longest row (10), not prompt width + longest response (8 + 5 = 13)
    assert out["output_ids"].shape[1] == 10
    scored(w, out)  # the natural next call takes it
    # a batch wider than the context is judged by its rows' lengths
    wide = prompts([8, 2], width=8)
    wide["input_ids"] = torch.cat([wide["input_ids"], torch.zeros(2, 6, dtype=torch.long)], 1)
    lp = w.get_logprobs(data=wide)["logprobs"]
    assert lp.shape == (2, 14)
    assert torch.equal(lp[:, :8], w.get_logprobs(data=prompts([8, 2], width=8))["logprobs"])


def test_a_rows_draws_are_keyed_by_its_id_not_its_place_or_neighbours(worker):
    """Copies of one prompt draw independently; a row given its id (`row_ids`, what the driver
    sets for each data-parallel shard) draws what it draws inside the whole batch."""
    data = prompts()
    whole = worker.generate(data=data, seed=5)
    copies = prompts([LENGTHS[2]] * 8)
    copies["input_ids"][:] = data["input_ids"][2]
    drawn = worker.generate(data=copies, seed=5)["output_ids"]
    assert len({tuple(r) for r in drawn.tolist()}) == 8
    part = BatchedDataDict({k: v[2:] for k, v in data.items()})
    part["row_ids"] = torch.tensor([2, 3])
    half = worker.generate(data=part, seed=5)
    for row in (0, 1):
        end = int(half["unpadded_sequence_lengths"][row])
        assert half["output_ids"][row, :end].tolist() == whole["output_ids"][2 + row, :end].tolist()
    part["row_ids"] = torch.tensor([0, 1])  # other ids: other draws
    assert not torch.equal(worker.generate(data=part, seed=5)["output_ids"], half["output_ids"])
    for bad in (torch.tensor([-1, 0]), torch.tensor([0]), torch.tensor([0.0, 1.0])):
        part["row_ids"] = bad
        with pytest.raises(ValueError, match="row_ids"):
            worker.generate(data=part, seed=5)


def test_stop_strings_from_the_config_and_the_batch(tmp_path):
    from policyworker.config import PolicyConfig
    from policyworker.demo.grpo import tiny_llama
    from policyworker.demo.task import char_tokenizer
    from policyworker.worker import MegatronPolicyWorker

    tok = char_tokenizer()
    folder = tiny_llama(tmp_path / "m", len(tok), seed=0)

    def worker(**generation: object) -> MegatronPolicyWorker:
        generation = {"max_new_tokens": 8, "stop_token_ids": [], **generation}
        cfg = PolicyConfig(model_name=str(folder), precision="float32", generation=generation)
        return MegatronPolicyWorker(cfg, tokenizer=tok)

    ids = tok("1+2=")["input_ids"]
    data = BatchedDataDict({"input_ids": torch.tensor([ids] * 2),
                            "input_lengths": torch.tensor([len(ids)] * 2)})  # fmt: skip
    free = worker().generate(data=data, greedy=True)["output_ids"][0, len(ids) :].tolist()
    assert len(free) == 8
    word = tok.decode(free[2:4])
    # the response ends with the token that completes the string's first occurrence
    want = next(i + 1 for i in range(8) if word in tok.decode(free[: i + 1]))
    out = worker(stop_strings=[word]).generate(data=data, greedy=True)
    assert out["generation_lengths"].tolist() == [want, want]
    assert not out["truncated"].any()
    per_row = BatchedDataDict({**data, "stop_strings": [None, [tok.decode(free[:1])]]})
    out = worker().generate(data=per_row, greedy=True)
    assert out["generation_lengths"].tolist() == [8, 1]
    assert out["truncated"].tolist() == [True, False]


def test_bad_input_is_a_value_error_naming_the_field(worker, folder):
    from policyworker.config import PolicyConfig

    cases = {
        "input_lengths": prompts([0, 3]),
        "input_ids": BatchedDataDict(
            {
                "input_ids": torch.zeros(2, 0, dtype=torch.long),
                "input_lengths": torch.tensor([1, 1]),
            }
        ),
        "stop_strings": BatchedDataDict({**prompts([2, 3]), "stop_strings": ["x"]}),
    }
    for field, data in cases.items():
        with pytest.raises(ValueError, match=field):
            worker.generate(data=data)
    with pytest.raises(ValueError, match="input_lengths"):  # no room left in the context
        make_worker(folder, max_total_sequence_length=8).generate(data=prompts([8, 2]))
    with pytest.raises(ValueError, match="stop_strings"):  # text stops need the tokenizer
        worker.generate(data=BatchedDataDict({**prompts([2, 3]), "stop_strings": [["a"], None]}))
    with pytest.raises(ValueError, match="seed"):
        worker.generate(data=prompts(), seed=-1)
    for key, value in (
        ("max_new_tokens", 0),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", 0),
        ("decode_attention", "flash"),
    ):
        with pytest.raises(ValueError, match=f"generation.{key}"):
            PolicyConfig(model_name=str(folder), generation={key: value})
    assert worker.generate(data=prompts(), greedy=True)["output_ids"].shape[0] == 4  # usable


def test_the_kv_cache_is_gone_after_a_call_and_generation_needs_the_params(folder):
    w = make_worker(folder, generation={"max_new_tokens": 3})
    w.generate(data=prompts())
    cores = [m for m in w.state.model.modules() if isinstance(m, CoreAttention)]
    paths = w.scorer.paths  # the model's phases: training is back, the cache's phase gone
    assert cores and all(c.switch is paths.switch for c in cores)
    assert paths.switch.now is paths.training
    w.offload_after_refit()
    with pytest.raises(PhaseError, match="generate"):
        w.generate(data=prompts())
    w.prepare_for_lp_inference()
    assert w.generate(data=prompts(), greedy=True)["output_ids"].shape[0] == 4


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral", "glm4_moe", "deepseek_v3", "gpt_oss"])
def test_moe_generation_records_its_routes_and_replaying_them_scores_the_same(tmp_path, arch):
    from transformers import AutoModelForCausalLM

    folder = make_hf_model(tmp_path / "m", arch, eos_token_id=EOS)
    w = make_worker(folder, moe={"router_replay": True}, generation={"max_new_tokens": 6})
    data = prompts()
    out = w.generate(data=data, greedy=True)
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    for row, n in enumerate(LENGTHS):
        want = hf.generate(data["input_ids"][row : row + 1, :n], max_new_tokens=6,
                           do_sample=False, eos_token_id=EOS, pad_token_id=0)[0]  # fmt: skip
        assert out["output_ids"][row, : len(want)].tolist() == want.tolist()
    routes = out["routed_experts"]
    b, s = out["output_ids"].shape
    assert routes.shape[:2] == (b, s)
    ends = out["unpadded_sequence_lengths"]
    for row in range(b):  # routed up to the last token, which was never fed
        assert (routes[row, : ends[row] - 1] >= 0).all() and (
            routes[row, ends[row] - 1 :] == -1
        ).all()
    seqs = {"input_ids": out["output_ids"], "input_lengths": ends, "routed_experts": routes}
    replayed = w.get_logprobs(data=BatchedDataDict(seqs))["logprobs"]
    mask = response_mask(out, LENGTHS)
    assert (replayed - out["logprobs"])[mask].abs().max() <= 1e-6


def test_the_graphed_decode_loop_draws_what_the_eager_one_does(worker, monkeypatch):
    """The CUDA-graph path's loop (static inputs updated in place, the whole cache's key length,
    no pipeline schedule), with each replay run eagerly on the CPU: the same rows."""
    import dataclasses

    from policyworker.generation import decode

    class Eager:  # GraphedStep's contract: replay() runs the captured function again
        def __init__(self, run):
            self.run = run

        def replay(self):
            return self.run()

    data = prompts()
    want = worker.generate(data=data, seed=5)
    monkeypatch.setattr(decode, "GraphedStep", Eager)
    monkeypatch.setattr(
        worker.sampler, "decoder", dataclasses.replace(worker.sampler.decoder, graphs=True)
    )
    got = worker.generate(data=data, seed=5)
    assert torch.equal(got["output_ids"], want["output_ids"])
    assert (got["logprobs"] - want["logprobs"]).abs().max() <= 1e-6
