"""examples/sft-llama3-8b.yaml and examples/continue-llama3-8b.yaml, scaled down to this machine: a tiny
Llama 3.1 saved by `transformers` (random weights, its tokenizer and chat template beside it) is fine-tuned
on a chat JSONL file, or trained on on text JSONL, by `tpujob run --local`; `tpujob export` writes the run's
checkpoint as a Hugging Face directory, and `transformers` loads it and generates from it.

The scaled-down job is the example with only what cannot run here replaced (`job_of`): the model's size
(the `tiny` preset's dimensions, with the example's RoPE scaling, theta and norm epsilon), where the
checkpoint, tokenizer and data are, the slice (one 2x2x1 host: one process of 8 CPU devices), the batch, the
steps, the learning rate (high enough that four steps visibly move a tiny model) and the Splash kernel (its
blocks are 128 tokens; the sequences here are 64). `tpujob run --local --scale-down` would not do: it
trains a fresh model on synthetic data.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.conftest import ROOT, example

pytestmark = pytest.mark.e2e  # process-level: `tpujob run --local` and `tpujob export` processes

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

WORDS = "hello hi how are you fine thanks what is two plus four six be brief ok the sky blue green".split()
TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|start_header_id|>{{ m['role'] }}<|end_header_id|>\n"
    "{{ m['content'] }}<|eot_id|>{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n{% endif %}"
)
SPECIALS = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
CHATS = [
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hello how are you"},
        {"role": "assistant", "content": "fine thanks"},
        {"role": "user", "content": "what is two plus four"},
        {"role": "assistant", "content": "six"},
    ],
    [{"role": "user", "content": "what is the sky"}, {"role": "assistant", "content": "blue"}],
]
STEPS = 4


def tiny_llama(root: Path, template_file: bool) -> tuple[Path, Any]:
    """A random tiny Llama 3.1 (the `tiny` preset's dimensions, Llama 3.1's RoPE and norm epsilon) and a
    word-level tokenizer.json with a Llama 3 style chat template, in one Hugging Face directory: the template
    in chat_template.jinja (as recent transformers versions save it) or in tokenizer_config.json."""
    from tokenizers import AddedToken, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HfTokenizer

    from tpu_workload.interchange.hf_config import LLAMA3_SCALING

    tok = HfTokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = " ".join(WORDS + ["system", "user", "assistant"])
    tok.train_from_iterator([words], trainers.WordLevelTrainer(special_tokens=["[UNK]"]))
    tok.add_special_tokens([AddedToken(s) for s in SPECIALS])
    bos, eos = tok.token_to_id("<|begin_of_text|>"), tok.token_to_id("<|eot_id|>")
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        rms_norm_eps=1e-5,
        max_position_embeddings=131072,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500_000.0, **LLAMA3_SCALING},
        tie_word_embeddings=False,
        bos_token_id=bos,
        eos_token_id=eos,
    )
    model = transformers.LlamaForCausalLM(config)
    model.save_pretrained(root)
    tok.save(str(root / "tokenizer.json"))
    tokenizer_config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>",
    }
    if template_file:
        (root / "chat_template.jinja").write_text(TEMPLATE)
    else:
        tokenizer_config["chat_template"] = TEMPLATE
    (root / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    return root, model


def write_jsonl(root: Path, lines: list[dict]) -> str:
    root.mkdir()
    (root / "part-0.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    return str(root)


def job_of(name: str, hf: Path, train: str, heldout: str) -> dict[str, Any]:
    """The example as this machine runs it (module docstring): a tiny model of the example's kind, its data here."""
    doc = example(name)
    spec = doc["spec"]
    spec["tpu"]["topology"] = "2x2x1"
    init = {**spec["model"]["init"], "path": str(hf)}
    spec["model"] = {k: v for k, v in spec["model"].items() if k != "preset"}
    spec["model"].update(preset="tiny", ropeTheta=500_000.0, init=init)  # llama3-8b's theta; tiny has 10,000
    training = spec["training"]
    for data, path in ((training["data"], train), (training["eval"]["data"], heldout)):
        data.update(path=path, tokenizer=str(hf / "tokenizer.json"))
    training.update(steps=STEPS, globalBatch=8, sequenceLength=64)
    training["learningRate"] = {"peak": 1.0e-2, "warmupSteps": 0, "schedule": "constant"}
    training["eval"].update(interval=STEPS, batches=1)
    spec["kernels"] = {"attention": "xla"}
    return doc


def tpujob(*args: str) -> subprocess.CompletedProcess:
    result = subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return result


def ids_of(encoded: Any) -> Any:
    """The token ids of what `apply_chat_template` returns: transformers 5 gives a BatchEncoding, 4 the ids."""
    return encoded["input_ids"] if hasattr(encoded, "keys") else encoded


def assistant_loss(model: Any, tokenizer: Any, chat: list[dict]) -> float:
    """transformers' loss on the tokens the last assistant message adds (its content and end of turn)."""
    prompt = ids_of(tokenizer.apply_chat_template(chat[:-1], add_generation_prompt=True))
    whole = ids_of(tokenizer.apply_chat_template(chat))
    assert whole[: len(prompt)] == prompt
    labels = [-100] * len(prompt) + whole[len(prompt) :]
    with torch.no_grad():
        return float(model(torch.tensor([whole]), labels=torch.tensor([labels])).loss)


# The sft case in the default run (the "done when"); continued pre-training, whose text path the
# trainer-level test in tests/workload/test_text_data.py already covers, with the multi-minute runs.
@pytest.mark.parametrize(
    "name", ["sft-llama3-8b.yaml", pytest.param("continue-llama3-8b.yaml", marks=pytest.mark.long)]
)
def test_a_local_run_trains_a_transformers_model_and_exports_one_it_loads(name, tmp_path):
    hf, before = tiny_llama(tmp_path / "hf", template_file="sft" in name)
    if "sft" in name:
        train = write_jsonl(tmp_path / "train", [{"messages": CHATS[i % 2]} for i in range(32)])
        heldout = write_jsonl(tmp_path / "heldout", [{"messages": CHATS[1]}])
    else:
        text = [{"text": " ".join(c["content"] for c in CHATS[i % 2])} for i in range(32)]
        train = write_jsonl(tmp_path / "train", text)
        heldout = write_jsonl(tmp_path / "heldout", text[:1])
    doc = job_of(name, hf, train, heldout)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    tpujob("run", "--local", "--no-plan", "-f", str(tmp_path / "job.yaml"), "--run-dir", str(run_dir))
    status = yaml.safe_load((run_dir / "status.yaml").read_text())["status"]
    assert status["phase"] == "Succeeded" and status["step"] == STEPS and status["evalLoss"] > 0
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == list(range(1, STEPS + 1))

    out = tmp_path / "out"
    checkpoints = str(run_dir / "checkpoints")
    job = str(tmp_path / "job.yaml")
    # The tokenizer files and token ids go out with the model: named, or by default (--job) from model.init.
    named = ["--tokenizer-from", str(hf)] if "sft" in name else []
    tpujob("export", checkpoints, "--job", job, *named, "--to", str(out), "--dtype", "float32")
    assert json.loads((out / "config.json").read_text())["eos_token_id"] == before.config.eos_token_id
    assert (out / "chat_template.jinja").exists() == ("sft" in name)
    after = transformers.AutoModelForCausalLM.from_pretrained(out).eval()
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    # It trained: every tensor moved from the checkpoint it started from (Adam moves a weight by about the rate).
    old = dict(before.named_parameters())
    for key, p in after.named_parameters():
        assert not np.allclose(p.detach().numpy(), old[key].detach().numpy(), rtol=0, atol=1e-4), key
    # Fine-tuned, it learnt the assistant's answers: transformers' loss on one falls.
    if "sft" in name:
        assert assistant_loss(after, tokenizer, CHATS[1]) < assistant_loss(before, tokenizer, CHATS[1]) - 1.0
    ids = ids_of(tokenizer.apply_chat_template(CHATS[1][:1], add_generation_prompt=True, return_tensors="pt"))
    generated = after.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] > ids.shape[1] and generated[0, : ids.shape[1]].tolist() == ids[0].tolist()
    assert isinstance(tokenizer.decode(generated[0, ids.shape[1] :]), str)
