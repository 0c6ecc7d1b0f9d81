"""Supervised fine-tuning data (chat.py): chat JSONL rendered with the tokenizer's template in jinja2's
sandbox, the loss mask on exactly the assistant's tokens, through packing into the batch; a tiny
`objective: sft` run trains."""

from __future__ import annotations

import json

import numpy as np
import pytest

from tpu_workload.data import batches as data
from tpu_workload.data import chat
from tpu_workload.data.tokenizer import Tokenizer
from tpu_workload.model import sharding
from tpu_workload.process.exits import UserError

WORDS = "hello hi how are you fine thanks what is two plus four six be brief ok".split()
CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hello how are you"},
    {"role": "assistant", "content": "fine thanks"},
    {"role": "user", "content": "what is two plus four"},
    {"role": "assistant", "content": "six"},
]


def _tokenizer(root, template=CHATML) -> str:
    from tokenizers import AddedToken, models, pre_tokenizers, trainers
    from tokenizers import Tokenizer as HfTokenizer

    root.mkdir(exist_ok=True)
    tok = HfTokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    words = " ".join(WORDS + ["system", "user", "assistant"])
    tok.train_from_iterator([words], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.add_special_tokens([AddedToken("<|im_start|>"), AddedToken("<|im_end|>")])
    tok.save(str(root / "tokenizer.json"))
    config = {"eos_token": "<|im_end|>", "chat_template": template}
    (root / "tokenizer_config.json").write_text(json.dumps(config))
    return str(root / "tokenizer.json")


def _chats(root, conversations):
    root.mkdir()
    (root / "chat.jsonl").write_text("\n".join(json.dumps({"messages": c}) for c in conversations) + "\n")
    return str(root)


def test_the_weights_cover_exactly_the_assistant_content_and_its_end_of_turn(tmp_path):
    path = _tokenizer(tmp_path / "tok")
    docs = chat.ChatDocuments(_chats(tmp_path / "chats", [CONVERSATION]), Tokenizer(path))
    ids, weights = docs.read(0, 1000)
    from tokenizers import Tokenizer as HfTokenizer

    hf = HfTokenizer.from_file(path)
    words = [hf.id_to_token(int(i)) for i in ids]
    assert words[:4] == ["<|im_start|>", "system", "be", "brief"]  # the template's text, no BOS or EOS added
    counted = [w for w, x in zip(words, weights) if x]
    assert counted == ["fine", "thanks", "<|im_end|>", "six", "<|im_end|>"]
    # Not the role headers: the token before each assistant span is its role name.
    starts = np.flatnonzero(np.diff(np.concatenate([[0.0], weights])) > 0)
    assert [words[s - 1] for s in starts] == ["assistant", "assistant"]
    assert docs.lengths().tolist() == [len(ids)]
    # An answer that is also a word of the header: only the answer counts.
    echo = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "assistant"}]
    docs = chat.ChatDocuments(_chats(tmp_path / "echo", [echo]), Tokenizer(path))
    ids, weights = docs.read(0, 1000)
    words = [hf.id_to_token(int(i)) for i in ids]
    assert words[-4:] == ["<|im_start|>", "assistant", "assistant", "<|im_end|>"]
    assert weights.tolist() == [0] * (len(ids) - 2) + [1, 1]


def test_the_batch_mask_counts_only_assistant_targets(tmp_path):
    tok = _tokenizer(tmp_path / "tok")
    conversations = [CONVERSATION, CONVERSATION[1:3], [{"role": "user", "content": "hi"}]]
    src = data.PackedFiles(
        _chats(tmp_path / "chats", conversations), "jsonl", vocab=256, seq_len=63, batch=1, tokenizer=tok, chat=True
    )
    mesh = sharding.make_mesh(dict(data=1, fsdp=1, context=1, expert=1, tensor=8))
    named = sharding.Sharder(mesh).named(("batch", "length"), (1, 63))
    batch = data.Batches(src, named, context=1)(0)
    docs = chat.ChatDocuments(_chats(tmp_path / "again", conversations), Tokenizer(tok))
    # All three share the row (first fit): tokens, weights and document ids side by side, then padding.
    read = [docs.read(i, 64) for i in range(3)]
    weights = np.concatenate([w for _, w in read] + [np.zeros(64)])[:64]
    segments = np.concatenate([np.full(len(t), i + 1) for i, (t, _) in enumerate(read)] + [np.zeros(64)])[:64]
    np.testing.assert_array_equal(
        np.asarray(batch.inputs)[0], np.concatenate([t for t, _ in read] + [np.zeros(64)])[:63]
    )
    # A target counts when it is an assistant token of the input's own document.
    expected = weights[1:] * (segments[1:] == segments[:-1]) * (segments[:-1] > 0)
    np.testing.assert_array_equal(np.asarray(batch.mask)[0], expected)
    assert expected.sum() == 5 + 3  # fine thanks <|im_end|> six <|im_end|>; fine thanks <|im_end|>


def test_a_hostile_template_is_stopped_by_the_sandbox(tmp_path):
    tok = _tokenizer(tmp_path / "tok", template="{{ messages.__class__.__mro__[1].__subclasses__() }}")
    docs = chat.ChatDocuments(_chats(tmp_path / "chats", [CONVERSATION]), Tokenizer(tok))
    with pytest.raises(UserError, match="the chat template failed"):
        docs.read(0, 10)


def test_bad_conversations_are_clear_errors(tmp_path):
    tok = Tokenizer(_tokenizer(tmp_path / "tok"))
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.jsonl").write_text('{"messages": [{"role": "user"}]}\n')
    with pytest.raises(UserError, match="a.jsonl, line 1: a message is not an object with string 'role' and"):
        chat.ChatDocuments(str(tmp_path / "bad"), tok).lengths()
    (tmp_path / "bad" / "a.jsonl").write_text('{"text": "hi"}\n')
    with pytest.raises(UserError, match="a.jsonl, line 1: no field 'messages'"):
        chat.ChatDocuments(str(tmp_path / "bad"), tok).lengths()
    no_template = _tokenizer(tmp_path / "plain", template=None)
    with pytest.raises(UserError, match="sft needs a chat template"):
        chat.ChatDocuments(str(tmp_path / "bad"), Tokenizer(no_template))


def test_sft_settings_are_checked():
    from tpu_operator.api.contract import TrainingSpec

    with pytest.raises(ValueError, match="objective: sft reads chat jsonl"):
        TrainingSpec(steps=1, global_batch=1, sequence_length=8, objective="sft")
    chats = dict(source="files", path="/c", format="jsonl", tokenizer="/t/tokenizer.json", packing=True)
    with pytest.raises(ValueError, match="data.textField: not used by objective sft"):
        TrainingSpec(steps=1, global_batch=1, sequence_length=8, objective="sft", data=chats | {"text_field": "x"})
    with pytest.raises(ValueError, match="eval.data: objective: sft reads chat jsonl"):
        TrainingSpec(
            steps=1,
            global_batch=1,
            sequence_length=8,
            objective="sft",
            data=chats,
            eval=dict(data=dict(source="synthetic")),
        )
    with pytest.raises(ValueError, match="data.tokenizer: objective sft needs a Hugging Face tokenizer.json"):
        TrainingSpec(
            steps=1, global_batch=1, sequence_length=8, objective="sft", data=chats | {"tokenizer": "/t.model"}
        )
    assert TrainingSpec(steps=1, global_batch=1, sequence_length=8, objective="sft", data=chats).objective == "sft"


def test_a_scaled_down_sft_job_pretrains_on_synthetic_data_saying_so(tmp_path):
    from tests.conftest import tiny_job
    from tpu_operator.api.validation import parse_job
    from tpu_operator.local.run import scale_down

    data = {"source": "files", "path": "/chats", "format": "jsonl", "tokenizer": "/tok/tokenizer.json", "packing": True}
    doc = tiny_job(training={"steps": 3, "globalBatch": 16, "sequenceLength": 32, "objective": "sft", "data": data})
    small, changes = scale_down(doc)
    assert parse_job(small).spec.training.objective == "pretrain"
    assert any("synthetic packed documents (objective sft -> pretrain" in c for c in changes)


@pytest.mark.e2e  # process-level: `tpujob run --local`, the operator and the real trainer
def test_tpujob_run_local_fine_tunes_on_a_chat_file(tmp_path):
    import subprocess
    import sys

    import yaml

    from tests.conftest import tiny_job

    tok = _tokenizer(tmp_path / "tok")
    chats = _chats(tmp_path / "chats", [CONVERSATION[: 1 + 2 * (i % 2 + 1)] for i in range(40)])
    data = {"source": "files", "path": chats, "format": "jsonl", "tokenizer": tok, "packing": True}
    doc = tiny_job(training={"steps": 3, "globalBatch": 8, "sequenceLength": 32, "objective": "sft", "data": data})
    doc["spec"].pop("image")
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(doc))
    run_dir = tmp_path / "run"
    command = ["run", "--local", "--no-plan", "-f", str(tmp_path / "job.yaml"), "--run-dir", str(run_dir)]
    result = subprocess.run(
        [sys.executable, "-m", "tpu_operator.cli", *command], capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    status = yaml.safe_load((run_dir / "status.yaml").read_text())["status"]
    assert status["phase"] == "Succeeded" and status["step"] == 3
    records = [yaml.safe_load(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [1, 2, 3] and all(r["loss"] > 0 for r in records)
