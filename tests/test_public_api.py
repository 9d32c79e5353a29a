"""What a new user meets first: the top-level names, the README's example as written, and a
command line that refuses bad input with one line and exit status 2 before any work starts."""

import json
import re
from pathlib import Path

import pytest
import transformers

import policyworker
from policyworker.cli import main
from policyworker.demo.grpo import tiny_llama
from policyworker.demo.task import char_tokenizer

README = Path(__file__).parent.parent / "README.md"


def test_public_names_import():
    assert {
        "MegatronPolicyWorker",
        "PolicyConfig",
        "BatchedDataDict",
        "ClippedPGLoss",
        "ClippedPGConfig",
        "NLLLoss",
        "DPOLoss",
        "DistillationLoss",
        "load_config",
    } <= set(policyworker.__all__)
    for name in policyworker.__all__:
        assert getattr(policyworker, name).__name__ == name
    from policyworker import MegatronPolicyWorker  # noqa: F401  (the form users write)

    assert (Path(policyworker.__file__).parent / "py.typed").exists()
    with pytest.raises(AttributeError):
        _ = policyworker.no_such_name


def test_readme_python_example_runs_as_written(llama_dir, tmp_path):
    section = README.read_text().split("## Using the worker", 1)[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    assert '"/ckpt/llama"' in code and '"/out/hf"' in code
    code = code.replace('"/ckpt/llama"', repr(str(llama_dir)))
    code = code.replace('"/out/hf"', repr(str(tmp_path / "hf")))
    scope: dict[str, object] = {}
    exec(compile(code, "README.md", "exec"), scope)
    assert scope["metrics"]["grad_norm"] > 0
    assert (tmp_path / "hf" / "model.safetensors").exists()


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli")
    tok = char_tokenizer()
    ckpt = tiny_llama(root / "ckpt", len(tok), seed=0)
    tok.save_pretrained(ckpt)
    tiny_llama(root / "no_tokenizer", len(tok), seed=0)
    gpt2 = root / "gpt2"
    transformers.GPT2Config(n_layer=1, n_embd=8, n_head=2).save_pretrained(gpt2)
    (gpt2 / "model.safetensors").write_bytes(b"")
    (root / "config_only").mkdir()
    (root / "config_only" / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (root / "tasks.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    (root / "bad.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n{"prompt": "2+2="}\n')
    (root / "long.jsonl").write_text(json.dumps({"prompt": "1+" * 200 + "1=", "answer": "2"}))
    (root / "a_file").write_text("")
    return root


CASES = {
    "unknown key": (["nonsense_key=3"], "nonsense_key: unknown field"),
    "negative steps": (["grpo_steps=-1"], "grpo_steps: expected >= 0"),
    "ill-typed": (["grpo_steps=abc"], "grpo_steps: expected an integer"),
    "bad choice": (["precision=fp8"], "precision: expected one of"),
    "group of one": (["group_size=1"], "group_size"),
    "mbs not a divisor": (["micro_batch_size=7"], "micro_batch_size"),
    "bad loss option": (["loss.ratio_clip_c=0.5"], "ratio_clip_c"),
    "loss combination": (["loss.use_cispo=true", "loss.ratio_clip_c=3"], "use_cispo"),
    "no equals sign": (["grpo_steps"], "key.path=value"),
    "missing yaml": (["--config", "{root}/none.yaml"], "config file"),
    "no such model": (["--model", "/no/such/dir", "--data", "{root}/tasks.jsonl"], "--model"),
    "no weights": (
        ["--model", "{root}/config_only", "--data", "{root}/tasks.jsonl"],
        "no model.safetensors",
    ),
    "no tokenizer": (
        ["--model", "{root}/no_tokenizer", "--data", "{root}/tasks.jsonl"],
        "no tokenizer files",
    ),
    "unsupported": (["--model", "{root}/gpt2", "--data", "{root}/tasks.jsonl"], "not supported"),
    "model without data": (["--model", "{root}/ckpt"], "--data: required"),
    "data without model": (["--data", "{root}/tasks.jsonl"], "--data: needs --model"),
    "missing data": (["--model", "{root}/ckpt", "--data", "{root}/none.jsonl"], "--data"),
    "bad row": (["--model", "{root}/ckpt", "--data", "{root}/bad.jsonl"], r"bad\.jsonl:2"),
    "too long": (["--model", "{root}/ckpt", "--data", "{root}/long.jsonl"], "max_sequence_length"),
    "out is a file": (["--out", "{root}/a_file"], "--out"),
}


@pytest.mark.parametrize("case", CASES)
def test_bad_command_line_is_one_line_and_exit_2(case, files, tmp_path, capsys):
    args, match = CASES[case]
    args = [a.format(root=files) for a in args]
    out = tmp_path / "run"
    if "--out" not in args:
        args = ["--out", str(out), *args]
    with pytest.raises(SystemExit) as exc:
        main(["demo", *args])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith("policyworker demo: error: "), err
    assert re.search(match, err), err
    assert not out.exists()  # no work started
