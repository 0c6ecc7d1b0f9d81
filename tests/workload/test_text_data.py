"""Text data (text.py, tokenizer.py, prepare.py): jsonl, parquet and text files tokenized on the fly
give the documents' tokens then the EOS, packed like token files; `tpujob data prepare` writes the
same tokens to ArrayRecord, batch for batch; resume is exact; bad input is a clear error."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from conftest import trainer_config

from tpu_workload.data import batches as data
from tpu_workload.data import prepare as prepare_lib
from tpu_workload.data import text
from tpu_workload.data.tokenizer import Tokenizer
from tpu_workload.model import sharding
from tpu_workload.process.exits import UserError

WORDS = "the a cat dog sat ran on under mat log big small red blue quick slow".split()
EOS = 1  # "</s>", the second special token of the tiny tokenizer


def _sentences(n: int, seed: int = 0) -> list[str]:
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, rng.integers(1, 40))) for _ in range(n)]


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory) -> str:
    """A WordLevel tokenizer.json over WORDS, its EOS declared in tokenizer_config.json."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import models, pre_tokenizers, trainers

    root = tmp_path_factory.mktemp("tokenizer")
    tok = HfTokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator([" ".join(WORDS)], trainers.WordLevelTrainer(special_tokens=["[UNK]", "</s>"]))
    tok.save(str(root / "tokenizer.json"))
    (root / "tokenizer_config.json").write_text(json.dumps({"eos_token": "</s>"}))
    return str(root / "tokenizer.json")


def _jsonl(tmp_path, sentences, name="corpus", field="text"):
    root = tmp_path / name
    root.mkdir()
    half = len(sentences) // 2
    for part, chunk in (("a", sentences[:half]), ("b", sentences[half:])):
        lines = [json.dumps({field: s, "id": i}) for i, s in enumerate(chunk)]
        (root / f"{part}.jsonl").write_text("\n".join(lines[:3]) + "\n\n" + "\r\n".join(lines[3:]))  # blank, CRLF
    return str(root)


def _packed(path, fmt, tokenizer=None, **kw):
    kw = dict(vocab=256, seq_len=32, batch=4, shuffle=True, seed=5) | kw
    return data.PackedFiles(path, fmt, tokenizer=tokenizer, **kw)


def _rows(src, steps):
    return [src.rows(s, range(0, src.batch)) for s in steps]


def _equal(a, b):
    for x, y in zip(a, b, strict=True):
        np.testing.assert_array_equal(x.tokens, y.tokens)
        np.testing.assert_array_equal(x.segments, y.segments)


def test_a_document_is_its_encoding_then_the_eos(tmp_path, hf_tokenizer):
    sentences = _sentences(8)
    docs = text.Tokenized(_jsonl(tmp_path, sentences), "jsonl", Tokenizer(hf_tokenizer))
    assert len(docs) == 8  # the blank line is no document; CRLF lines are whole
    from tokenizers import Tokenizer as HfTokenizer

    hf = HfTokenizer.from_file(hf_tokenizer)
    for i, s in enumerate(sentences):
        np.testing.assert_array_equal(docs.read(i, 1000), hf.encode(s).ids + [EOS])
    np.testing.assert_array_equal(docs.lengths(), [len(s.split()) + 1 for s in sentences])
    np.testing.assert_array_equal(docs.read(2, 3), docs.read(2, 1000)[:3])


def test_on_the_fly_and_prepared_tokens_give_the_same_batches(tmp_path, hf_tokenizer):
    sentences = _sentences(120)
    path = _jsonl(tmp_path, sentences)
    out = io.StringIO()  # not a terminal: plain progress lines
    docs, tokens = prepare_lib.prepare(
        [path], "jsonl", hf_tokenizer, str(tmp_path / "prepared"), 256, records_per_file=50, stream=out
    )
    assert docs == 120 and "120/120 documents" in out.getvalue() and "\r" not in out.getvalue()
    assert len(list((tmp_path / "prepared").glob("*.array_record"))) == 3  # 50 + 50 + 20
    on_the_fly = _packed(path, "jsonl", hf_tokenizer)
    prepared = _packed(str(tmp_path / "prepared"), "arrayrecord")
    assert tokens == sum(len(s.split()) + 1 for s in sentences)
    steps = range(len(on_the_fly.source) // 4 + 3)  # past a whole pass
    _equal(_rows(on_the_fly, steps), _rows(prepared, steps))


def test_text_and_parquet_read_the_same_documents_as_jsonl(tmp_path, hf_tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    sentences = _sentences(60, seed=1)
    (tmp_path / "txt").mkdir()
    (tmp_path / "txt" / "0.txt").write_text("\n".join(sentences[:30]) + "\n\n")
    (tmp_path / "txt" / "1.txt").write_text("\n".join(sentences[30:]))
    (tmp_path / "pq").mkdir()
    pq.write_table(pa.table({"body": sentences[:25]}), tmp_path / "pq" / "0.parquet", row_group_size=10)
    pq.write_table(pa.table({"body": sentences[25:]}), tmp_path / "pq" / "1.parquet", row_group_size=10)
    jsonl = _rows(
        _packed(_jsonl(tmp_path, sentences, field="body"), "jsonl", hf_tokenizer, text_field="body"), range(8)
    )
    _equal(jsonl, _rows(_packed(str(tmp_path / "txt"), "text", hf_tokenizer), range(8)))
    _equal(jsonl, _rows(_packed(str(tmp_path / "pq"), "parquet", hf_tokenizer, text_field="body"), range(8)))


def _batches(src, steps, workers):
    mesh = sharding.make_mesh(dict(data=1, fsdp=4, context=1, expert=1, tensor=2))
    named = sharding.Sharder(mesh).named(("batch", "length"), (src.batch, src.seq_len))
    batches = data.Batches(src, named, context=1, workers=workers, prefetch=2)
    try:
        return [{k: np.asarray(v) for k, v in batches(s)._asdict().items()} for s in steps]
    finally:
        batches.close()


def test_a_reader_built_at_step_k_reads_what_an_uninterrupted_reader_reads(tmp_path, hf_tokenizer):
    """Tokenized in the read-ahead workers, a restart at step 6 reads what an uninterrupted run reads."""
    path = _jsonl(tmp_path, _sentences(80, seed=2))
    uninterrupted = _batches(_packed(path, "jsonl", hf_tokenizer), range(10), workers=2)
    resumed = _batches(_packed(path, "jsonl", hf_tokenizer), range(6, 10), workers=2)  # a fresh process
    on_the_thread = _batches(_packed(path, "jsonl", hf_tokenizer), range(6, 10), workers=0)
    for a, b, c in zip(uninterrupted[6:], resumed, on_the_thread, strict=True):
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)
            np.testing.assert_array_equal(a[key], c[key], err_msg=key)


def test_a_sentencepiece_model_gives_its_encoding_then_its_eos(tmp_path):
    import sentencepiece as spm

    corpus = tmp_path / "corpus.txt"
    corpus.write_text("\n".join(_sentences(200, seed=3)))
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "sp"),
        vocab_size=40,
        model_type="word",
        hard_vocab_limit=False,
        minloglevel=2,
    )
    tok = Tokenizer(str(tmp_path / "sp.model"))
    sp = spm.SentencePieceProcessor(model_file=str(tmp_path / "sp.model"))
    assert tok.eos_id == sp.eos_id() and tok.vocab_size == sp.get_piece_size()
    np.testing.assert_array_equal(tok.encode("the cat sat"), sp.encode("the cat sat") + [sp.eos_id()])
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.txt").write_text("the cat sat\nthe dog ran\n")
    src = _packed(str(tmp_path / "docs"), "text", str(tmp_path / "sp.model"), shuffle=False, batch=1)
    row = src.rows(0, range(0, 1))
    eos = [sp.eos_id()]
    assert list(row.tokens[0][:8]) == sp.encode("the cat sat") + eos + sp.encode("the dog ran") + eos


def test_bad_settings_and_bad_input_are_clear_errors(tmp_path, hf_tokenizer):
    path = _jsonl(tmp_path, _sentences(8))
    with pytest.raises(UserError, match=r"tokenizer: .* has 18 tokens, more than model.vocab \(16\)"):
        _packed(path, "jsonl", hf_tokenizer, vocab=16)
    with pytest.raises(UserError, match="eosId: 0, but the tokenizer's end-of-sequence token is 1"):
        _packed(path, "jsonl", hf_tokenizer, eos=0)
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "a.jsonl").write_text('{"text": "the cat"}\n{"body": "x"}\n')
    with pytest.raises(UserError, match=r"a.jsonl, line 2: no field 'text' \(training.data.textField\)"):
        _packed(str(tmp_path / "bad"), "jsonl", hf_tokenizer)
    (tmp_path / "bad" / "a.jsonl").write_text('{"text": "the cat"}\n\n{"text": [1]}\n')
    with pytest.raises(UserError, match=r"a.jsonl, line 3: field 'text' .* is a list, not a string"):
        _packed(str(tmp_path / "bad"), "jsonl", hf_tokenizer)
    (tmp_path / "bad" / "a.jsonl").write_text('{"text": "the cat"}\n{"text": "the\n')
    with pytest.raises(UserError, match=r"a.jsonl, line 2: not a JSON object"):
        _packed(str(tmp_path / "bad"), "jsonl", hf_tokenizer)
    (tmp_path / "bad" / "a.jsonl").write_text("[" * 100_000 + "\n")
    with pytest.raises(UserError, match=r"a.jsonl, line 1: not a JSON object"):
        _packed(str(tmp_path / "bad"), "jsonl", hf_tokenizer)
    (tmp_path / "bad" / "a.jsonl").write_bytes(b"x" * (text.MAX_DOCUMENT_BYTES + 1))
    with pytest.raises(UserError, match=r"a.jsonl, line 1: 16777217 bytes, more than the 16777216"):
        _packed(str(tmp_path / "bad"), "jsonl", hf_tokenizer)
    with pytest.raises(UserError, match="is not a tokenizer.json .* nor a directory holding one"):
        Tokenizer(str(tmp_path))


def test_text_formats_need_their_settings():
    from tpu_operator.api.contract import DataSpec

    with pytest.raises(ValueError, match="tokenizer: required with format jsonl"):
        DataSpec(source="files", path="/d", format="jsonl", packing=True)
    with pytest.raises(ValueError, match="packing: required with format text"):
        DataSpec(source="files", path="/d", format="text", tokenizer="/t/tokenizer.json")
    with pytest.raises(ValueError, match="tokenizer: only used with the text formats"):
        DataSpec(source="files", path="/d", format="npy", tokenizer="/t/tokenizer.json")
    with pytest.raises(ValueError, match="textField\n  String should match pattern"):
        DataSpec.model_validate(
            {
                "source": "files",
                "path": "/d",
                "format": "jsonl",
                "tokenizer": "/t.json",
                "packing": True,
                "textField": "a b",
            }
        )


def test_tpujob_data_prepare(tmp_path, hf_tokenizer):
    """The command as users run it (the operator's CLI, the trainer's code in a child process)."""

    def tpujob(*args: str) -> subprocess.CompletedProcess:
        command = [sys.executable, "-m", "tpu_operator.cli", *args]
        return subprocess.run(command, capture_output=True, text=True, timeout=300)

    path = _jsonl(tmp_path, _sentences(10))
    args = ["data", "prepare", path, "--tokenizer", hf_tokenizer, "--format", "jsonl", "--vocab", "256"]
    done = tpujob(*args, "--out", str(tmp_path / "out"))
    assert done.returncode == 0 and "wrote 10 documents" in done.stdout, done.stderr
    again = tpujob(*args, "--out", str(tmp_path / "out"))  # not twice into one directory
    assert again.returncode == 2 and "already holds ArrayRecord files" in again.stderr
    small = tpujob(*args[:-1], "16", "--out", str(tmp_path / "other"))
    assert small.returncode == 2 and "more than model.vocab (16)" in small.stderr


def _records(cfg, capsys):
    from tpu_workload.loop import train

    train.run(cfg, peak_flops_per_device=5e10)
    return [r for r in map(json.loads, capsys.readouterr().out.splitlines()) if not r.get("summary")]


def test_a_text_run_trains_as_its_prepared_files_do_and_resumes_exactly(tmp_path, hf_tokenizer, capsys):
    """Through the trainer: a text run stopped after step 1 and resumed from its checkpoint has, step for
    step, the losses of an uninterrupted run on the prepared files; another tokenizer is a data change."""
    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tok / name).write_bytes((Path(hf_tokenizer).parent / name).read_bytes())
    path = _jsonl(tmp_path, _sentences(60))
    prepare_lib.prepare([path], "jsonl", str(tok), str(tmp_path / "prepared"), 256, stream=io.StringIO())
    common = dict(mesh=dict(data=1, fsdp=8, context=1, expert=1, tensor=1), batch=8, seq=32, interval=1)
    prepared = dict(source="files", path=str(tmp_path / "prepared"), format="arrayrecord", packing=True)
    text_data = dict(source="files", path=path, format="jsonl", tokenizer=str(tok), packing=True, workers=2)
    whole = _records(trainer_config("tiny", steps=3, data=prepared, **common), capsys)
    ckpt = str(tmp_path / "ckpt")
    first = _records(trainer_config("tiny", steps=1, checkpoint=ckpt, data=text_data, **common), capsys)
    resumed = _records(trainer_config("tiny", steps=3, checkpoint=ckpt, data=text_data, **common), capsys)
    assert [r["step"] for r in first + resumed] == [1, 2, 3]
    assert [r["loss"] for r in first + resumed] == [r["loss"] for r in whole]
    (tok / "tokenizer.json").write_text(json.dumps(json.loads((tok / "tokenizer.json").read_text()), indent=1))
    with pytest.raises(UserError, match=r"spec\.training\.data\.tokenizerFile: \[.*tokenizer\.json', \d+\] at the"):
        _records(trainer_config("tiny", steps=4, checkpoint=ckpt, data=text_data, **common), capsys)


def test_text_and_tokenizer_behind_a_url_read_like_local_ones(tmp_path, hf_tokenizer):
    """fsspec's in-memory filesystem stands in for gs:// (text files copied to a local cache, the
    tokenizer and its config read whole)."""
    import uuid

    import fsspec

    fs, root = fsspec.filesystem("memory"), f"memory://text-{uuid.uuid4().hex}"
    local = _jsonl(tmp_path, _sentences(30, seed=4))
    for name in ("a.jsonl", "b.jsonl"):
        fs.pipe(f"{root}/data/{name}", (Path(local) / name).read_bytes())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        fs.pipe(f"{root}/tok/{name}", (Path(hf_tokenizer).parent / name).read_bytes())
    remote = _packed(f"{root}/data", "jsonl", f"{root}/tok")
    _equal(_rows(remote, range(4)), _rows(_packed(local, "jsonl", hf_tokenizer), range(4)))
