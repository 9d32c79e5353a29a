"""The generation engine's sampling options: top-k / top-p and what its logprobs are of; a bad
or missing argument is an error at the call site."""

import pytest

from policyworker.generation.process import GenerationProcess

pytestmark = pytest.mark.processes


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from policyworker.demo.grpo import tiny_llama
    from policyworker.demo.task import char_tokenizer

    tok = char_tokenizer()
    folder = tiny_llama(tmp_path_factory.mktemp("engine"), len(tok), seed=0)
    tok.save_pretrained(folder)
    with GenerationProcess(str(folder), {}, tokenizer=tok) as gen:
        yield gen


def test_top_k_and_top_p_restrict_the_distribution_the_logprobs_are_of(engine):
    prompts = ["1+2=", "3+4="]
    plain = engine.sample(prompts, n=4, max_new_tokens=3, temperature=1.0, seed=1)
    assert any(lp < -1e-3 for row in plain.response_logprobs for lp in row)
    for options in ({"top_k": 1}, {"top_p": 1e-6}):  # a single token left: probability 1
        greedy = engine.sample(prompts, n=4, max_new_tokens=3, seed=1, **options)
        assert all(abs(lp) < 1e-6 for row in greedy.response_logprobs for lp in row), options
        assert len({tuple(r) for r in greedy.response_ids[:4]}) == 1  # one prompt: one answer


def test_bad_or_missing_sampling_arguments_fail_at_the_call(engine):
    with pytest.raises(TypeError):
        engine.sample(["1+2="], max_new_tokens=3)  # n is required
    for kwargs, field in (({"top_p": 0.0}, "top_p"), ({"top_k": -1}, "top_k"), ({"n": 0}, "n")):
        with pytest.raises(ValueError, match=field):
            engine.sample(["1+2="], **{"n": 2, "max_new_tokens": 3, **kwargs})
    assert len(engine.sample(["1+2="], n=2, max_new_tokens=2).texts) == 2  # still usable
