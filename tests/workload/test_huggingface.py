"""Hugging Face checkpoints in and out, against `transformers` itself (issue 31).

Tiny random Llama 3 and Mixtral models are built with `transformers` on the CPU (nothing downloaded),
saved with `save_pretrained`, imported into ours (the sharded load the trainer uses) and run in f32
(`ModelConfig.compute = "f32"`): the logits must equal transformers' within the tolerance below, for
every RoPE setting (none and Llama 3.1's scaling, two thetas) and GQA ratio (1, 2, 4 query heads per
kv head) we support, and for Mixtral (4 experts, top-2). Then the checkpoint goes back out
(`tpujob export`'s code, through `tpujob convert`'s Orbax directory), `AutoModelForCausalLM` loads it,
and its logits equal the original's again. One batch's loss, and the loss after one SGD step on both
sides, equal transformers' `labels=` loss (which checks every gradient through the update).

Tolerance: both sides compute in f32 (machine epsilon 1.2e-7) but in different orders (XLA's and
torch's reductions over D, H and the keys, and RoPE's inverse frequencies computed as theta ** -x here
and 1 / theta ** x there, which at positions near 5,000, used so that the long-context scaling matters,
moves an angle by up to ~3e-4 rad). Measured differences are ~2e-5 on logits of magnitude ~3; the
bound is 1e-4 of the logits' largest magnitude, five times that, and still 100x below what a wrong
mapping gives (a transposed or swapped weight moves logits by O(1)).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from tpu_operator.api.contract import ModelDims, ModelInit
from tpu_workload.interchange import commands, hf_config, hf_weights, pretrained, tensorfiles
from tpu_workload.loop import train
from tpu_workload.loop.checkpoint import Checkpointer
from tpu_workload.model import decoder, sharding
from tpu_workload.process import exits

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)  # the suite runs one test per core

LLAMA3 = {"rope_type": "llama3", **hf_config.LLAMA3_SCALING}
TOKENS = np.random.default_rng(0).integers(0, 256, (2, 17))
POSITIONS = 5000 + np.arange(16)  # past the scaling's 2,048-token wavelength: llama3 changes these logits
RELATIVE_TOLERANCE = 1e-4  # of the logits' largest magnitude (module docstring)


def hf_model(kind: str, kv_heads: int, theta: float, scaling: dict | None, seed: int = 0, **overrides):
    """A random tiny transformers model (eager attention, f32), its norms' scales perturbed off 1 so
    their mapping is checked too."""
    torch.manual_seed(seed)
    common = (
        dict(
            vocab_size=256,
            hidden_size=64,
            intermediate_size=96,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=kv_heads,
            head_dim=16,
            rms_norm_eps=1e-5,
            max_position_embeddings=131072,
            rope_parameters={"rope_type": "default", "rope_theta": theta} | (scaling or {}) | {"rope_theta": theta},
            initializer_range=0.1,  # logits of order 1, not 0.02's near-zero ones
            tie_word_embeddings=False,
            attn_implementation="eager",
        )
        | overrides
    )
    if kind == "mixtral":
        model = transformers.MixtralForCausalLM(
            transformers.MixtralConfig(**common, num_local_experts=4, num_experts_per_tok=2)
        )
    else:
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**common))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(0.2 * torch.randn_like(p))
    return model.eval()


def hf_logits(model, tokens=TOKENS[:, :16], positions=POSITIONS) -> np.ndarray:
    pos = torch.tensor(np.broadcast_to(positions, tokens.shape).copy())
    with torch.no_grad():
        return model(torch.tensor(tokens), position_ids=pos).logits.numpy()


def ours(dims: ModelDims, params: dict):
    """Our decoder in f32 holding `params`."""
    graphdef = nnx.split(
        nnx.eval_shape(lambda: decoder.Decoder(decoder.ModelConfig(dims, compute="f32"), nnx.Rngs(0)))
    )[0]
    return nnx.merge(graphdef, params)


def our_logits(dims: ModelDims, params: dict, tokens=TOKENS[:, :16], positions=POSITIONS) -> np.ndarray:
    pos = jnp.broadcast_to(jnp.asarray(positions), tokens.shape)
    return np.asarray(ours(dims, params)(jnp.asarray(tokens), pos)[0])


def single_device(dims: ModelDims) -> dict:
    return commands._abstract(dims)


def assert_close(got: np.ndarray, want: np.ndarray) -> None:
    scale = float(np.max(np.abs(want)))
    assert scale > 0.5  # logits of order 1: the comparison means something
    np.testing.assert_allclose(got, want, rtol=0, atol=RELATIVE_TOLERANCE * scale)


CASES = [
    # (kind, kv heads of 4 query heads, theta, scaling): every RoPE setting at GQA 2, every GQA ratio once
    pytest.param("llama", 2, 10_000.0, None, id="llama-rope1e4"),
    pytest.param("llama", 2, 500_000.0, None, id="llama-rope5e5"),
    pytest.param("llama", 2, 10_000.0, LLAMA3, id="llama-llama3scaling-rope1e4"),
    pytest.param("llama", 2, 500_000.0, LLAMA3, id="llama-llama3scaling-rope5e5"),
    pytest.param("llama", 4, 500_000.0, LLAMA3, id="llama-gqa1"),
    pytest.param("llama", 1, 500_000.0, LLAMA3, id="llama-gqa4"),
    pytest.param("mixtral", 2, 1_000_000.0, None, id="mixtral-gqa2"),
    pytest.param("mixtral", 1, 500_000.0, LLAMA3, id="mixtral-gqa4-llama3scaling"),
]


@pytest.mark.parametrize("kind,kv_heads,theta,scaling", CASES)
def test_round_trip_logits_equal_transformers(kind, kv_heads, theta, scaling, tmp_path):
    model = hf_model(kind, kv_heads, theta, scaling)
    model.save_pretrained(tmp_path / "hf")
    want = hf_logits(model)

    read = pretrained.hf_model(str(tmp_path / "hf"))
    assert (read.dims.kv_heads, read.dims.rope_theta, read.dims.norm_eps) == (kv_heads, theta, 1e-5)
    assert read.dims.rope_scaling == ("llama3" if scaling else "none")
    assert read.dims.experts == (4 if kind == "mixtral" else 0)
    init = ModelInit(format="huggingface", path=str(tmp_path / "hf"))
    params = pretrained.parameters(init, read.dims, single_device(read.dims))
    assert_close(our_logits(read.dims, params), want)

    # Out again, through convert's Orbax directory: transformers loads the export and computes the same logits.
    commands.convert(str(tmp_path / "hf"), str(tmp_path / "orbax"))
    commands.export(str(tmp_path / "orbax"), str(tmp_path / "out"), dtype="float32")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert type(back) is type(model)
    assert_close(hf_logits(back), want)
    for name, p in model.state_dict().items():  # the weights themselves, bit for bit (f32 both ways)
        np.testing.assert_array_equal(back.state_dict()[name].numpy(), p.numpy(), err_msg=name)


@pytest.mark.parametrize("kind", ["llama", "mixtral"])
def test_loss_and_one_sgd_step_equal_transformers(kind, tmp_path):
    """The mean next-token cross entropy of one batch equals transformers' `labels=` loss, and so does the
    loss after one SGD step taken on each side with its own gradients (the MoE load-balancing loss left
    out on both: transformers adds it only with output_router_logits)."""
    model = hf_model(kind, 2, 500_000.0, None, seed=1)
    model.save_pretrained(tmp_path / "hf")
    read = pretrained.hf_model(str(tmp_path / "hf"))
    params = pretrained.parameters(
        ModelInit(format="huggingface", path=str(tmp_path / "hf")), read.dims, single_device(read.dims)
    )
    tokens, lr = TOKENS, 0.5
    pos = jnp.broadcast_to(jnp.arange(16), (2, 16))
    graphdef = nnx.graphdef(ours(read.dims, params))

    def loss(p):
        return decoder.loss_fn(
            nnx.merge(graphdef, p),
            jnp.asarray(tokens[:, :-1]),
            jnp.asarray(tokens[:, 1:]),
            pos,
            weights=decoder.LossWeights(moe_aux=0.0),
        )[0]

    value_and_grad = jax.jit(jax.value_and_grad(loss))  # compiled once, run twice
    ours_before, grads = value_and_grad(params)
    ours_after, _ = value_and_grad(jax.tree.map(lambda p, g: p - lr * g, params, grads))

    model.train()  # no dropout in these configs; train mode as a training step runs it
    theirs_before = model(torch.tensor(tokens), labels=torch.tensor(tokens)).loss
    theirs_before.backward()
    with torch.no_grad():
        for p in model.parameters():
            p -= lr * p.grad
        theirs_after = model(torch.tensor(tokens), labels=torch.tensor(tokens)).loss
    np.testing.assert_allclose(float(ours_before), theirs_before.item(), rtol=1e-5)
    assert abs(float(ours_after) - float(ours_before)) > 1e-2  # the step changed something
    np.testing.assert_allclose(float(ours_after), theirs_after.item(), rtol=1e-4)


def test_sharded_load_reads_each_byte_once_in_row_blocks(tmp_path):
    """On a mesh of 8 devices (fsdp 4 x tensor 2) every parameter is read as row blocks of its stored tensors,
    one contiguous range per tensor per block (bf16 in the file): every byte of the checkpoint exactly once
    (blocks that several devices hold are read once), no range outside its tensor, and the arrays on the
    trainer's shardings equal a load onto one device."""
    model = hf_model("mixtral", 2, 1_000_000.0, None).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    read = pretrained.hf_model(str(tmp_path / "hf"))
    mesh = sharding.make_mesh(dict(data=1, fsdp=4, context=1, expert=1, tensor=2))
    sharder = sharding.Sharder(mesh)
    abstract = nnx.state(nnx.eval_shape(lambda: decoder.Decoder(decoder.ModelConfig(read.dims), nnx.Rngs(0))))
    logical = nnx.get_partition_spec(abstract).to_pure_dict()
    shardings = jax.tree.map(
        lambda spec, a: sharder.named(tuple(spec), a.shape),
        logical,
        abstract.to_pure_dict(),
        is_leaf=lambda x: isinstance(x, jax.sharding.PartitionSpec),
    )
    tensors = tensorfiles.catalogue(str(tmp_path / "hf"))
    reads = tensorfiles.Reads()
    params = hf_weights.load_sharded(read, tensors, shardings, reads)

    assert reads.bytes == sum(t.nbytes for t in tensors.values())
    assert len(set(reads.ranges)) == len(reads.ranges)  # no range read twice
    for path, start, end in reads.ranges:
        (t,) = [t for t in tensors.values() if t.path == path and t.start <= start < t.start + t.nbytes]
        assert end <= t.start + t.nbytes and (start - t.start) % (t.nbytes // t.shape[0]) == 0  # whole rows
    for rule in hf_weights.rules(read.dims):
        blocks = hf_weights.read_sharding(rule, read.dims, hf_weights._at(shardings, rule.path)).mesh.shape["rows"]
        assert blocks == math.gcd(8, hf_weights.stored_shape(rule, read.dims)[0])
        assert hf_weights._at(params, rule.path).sharding == hf_weights._at(shardings, rule.path)
    whole = pretrained.parameters(
        ModelInit(format="huggingface", path=str(tmp_path / "hf")), read.dims, single_device(read.dims)
    )
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(whole)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.e2e  # two processes
def test_two_processes_each_read_only_their_own_bytes(tmp_path):
    """Two processes x 4 CPU devices (jax.distributed) load a Mixtral checkpoint onto fsdp 4 x tensor 2:
    each holds exactly the checkpoint's values in its shards (hf_load_child.py checks them against the
    whole tensors), the two read disjoint byte ranges, and together every byte once (every row block here
    has its devices in one process; a block split across processes would be read by each of them)."""
    import subprocess
    import sys

    from tpu_operator.local.pods import free_port

    model = hf_model("mixtral", 2, 1_000_000.0, None).to(torch.bfloat16)
    model.save_pretrained(tmp_path / "hf")
    coordinator = f"127.0.0.1:{free_port()}"
    children = [
        subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tests.workload.hf_load_child",
                str(tmp_path / "hf"),
                coordinator,
                "2",
                str(i),
                str(tmp_path / f"reads{i}.json"),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    for child in children:
        output = child.communicate(timeout=240)[0]
        assert child.returncode == 0, output[-4000:]
    read = [json.loads((tmp_path / f"reads{i}.json").read_text()) for i in range(2)]
    total = sum(t.nbytes for t in tensorfiles.catalogue(str(tmp_path / "hf")).values())
    assert read[0]["bytes"] + read[1]["bytes"] == total and 0 < read[0]["bytes"] < total
    spans = sorted((path, start, end) for r in read for path, start, end in r["ranges"])
    for (p1, _, e1), (p2, s2, _) in zip(spans, spans[1:]):
        assert p1 != p2 or e1 <= s2  # no byte read twice, by one process or by both


def test_byte_runs_of_a_slice(tmp_path):
    """A slice's contiguous runs in a C-order [4, 6, 8] f32 array; a read of exactly them from a file our
    writer wrote, and one that joins them over gaps into one request."""
    offsets, run = tensorfiles.runs((4, 6, 8), (slice(1, 3), slice(None), slice(None)), 4)
    assert (offsets.tolist(), run) == ([1 * 6 * 8 * 4], 2 * 6 * 8 * 4)  # whole rows: one run
    offsets, run = tensorfiles.runs((4, 6, 8), (slice(None), slice(2, 4), slice(None)), 4)
    assert (offsets.tolist(), run) == ([(i * 48 + 16) * 4 for i in range(4)], 2 * 8 * 4)
    offsets, run = tensorfiles.runs((4, 6, 8), (slice(0, 2), slice(0, 2), slice(4, 8)), 4)
    assert (offsets.tolist(), run) == ([(i * 48 + j * 8 + 4) * 4 for i in range(2) for j in range(2)], 16)
    a = np.arange(4 * 6 * 8, dtype=np.float32).reshape(4, 6, 8)
    tensorfiles.write(str(tmp_path), [("a", a), ("b", a[0])])
    t = tensorfiles.catalogue(str(tmp_path))["a"]
    exact, joined = tensorfiles.Reads(), tensorfiles.Reads()
    index = (slice(0, 2), slice(0, 2), slice(4, 8))
    np.testing.assert_array_equal(tensorfiles.read(t, index, exact), a[index])
    np.testing.assert_array_equal(tensorfiles.read(t, index, joined, gap=1 << 10), a[index])
    assert (exact.bytes, exact.requests, joined.requests) == (64, 4, 1)


def test_trainer_starts_from_a_huggingface_checkpoint(tmp_path):
    """`spec.model.init` in the trainer: the state holds the checkpoint's parameters at step 0 with a fresh
    optimizer, from the Hugging Face directory or from what `tpujob convert` made of it; the run's own
    checkpoint wins over both; a checkpoint of another shape stops the run as the user's error, naming
    the fields."""
    from conftest import trainer_config

    model = hf_model("llama", 2, 10_000.0, None, rms_norm_eps=1e-6, intermediate_size=128)  # the "tiny" preset
    model.save_pretrained(tmp_path / "hf")
    cfg = trainer_config("tiny", steps=1, mesh=dict(data=1, fsdp=8, context=1, expert=1, tensor=1)).model_copy(
        update={"init": ModelInit(format="huggingface", path=str(tmp_path / "hf"))}
    )
    run = train.setup(cfg, peak_flops_per_device=1e12)
    try:
        assert run.start == 0
        embed = np.asarray(run.state["params"]["embed"])
        np.testing.assert_array_equal(embed, model.model.embed_tokens.weight.detach().numpy())
        assert all(float(jnp.max(jnp.abs(m))) == 0 for m in jax.tree.leaves(run.state["opt"]) if m.ndim > 0)
    finally:
        run.batches.close()
    commands.convert(str(tmp_path / "hf"), str(tmp_path / "orbax"))
    own = str(tmp_path / "ckpt")
    from_orbax = cfg.model_copy(
        update={
            "init": ModelInit(format="orbax", path=str(tmp_path / "orbax")),
            "checkpoint": cfg.checkpoint.model_copy(update={"directory": own}),
        }
    )
    run = train.setup(from_orbax, peak_flops_per_device=1e12)
    try:
        assert run.start == 0
        np.testing.assert_array_equal(np.asarray(run.state["params"]["embed"]), embed)
        run.ckpt.save(1, jax.tree.map(lambda a: a * 2 if a.dtype == jnp.float32 else a + 1, run.state))
        run.ckpt.finish()
    finally:
        run.batches.close()
        run.ckpt.close()
    run = train.setup(from_orbax, peak_flops_per_device=1e12)  # resumes its own checkpoint, not init
    try:
        assert run.start == 1
        np.testing.assert_array_equal(np.asarray(run.state["params"]["embed"]), 2 * embed)
    finally:
        run.batches.close()
        run.ckpt.close()
    # `tpujob export` of the job's checkpoint directory, its shape from the job's file (the quickstart: tiny).
    from tpu_operator import cli

    quickstart = str(Path(__file__).resolve().parents[2] / "examples" / "quickstart.yaml")
    assert cli.main(["export", own, "--to", str(tmp_path / "out"), "--job", quickstart, "--dtype", "float32"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    np.testing.assert_array_equal(back.model.embed_tokens.weight.detach().numpy(), 2 * embed)
    other = cfg.model_copy(update={"model": cfg.model.model_copy(update={"layers": 3, "rope_theta": 5e5})})
    with pytest.raises(exits.UserError, match=r"spec.model.layers: 3 in the job, 2 in the checkpoint.*ropeTheta"):
        train.setup(other, peak_flops_per_device=1e12)


def test_export_of_a_jobs_checkpoint_directory(tmp_path):
    """A job's checkpoint directory (its latest step's `params`; the optimizer state is not read) exports with
    the job's shape given, the token ids and tokenizer files of --tokenizer-from carried over."""
    model = hf_model("llama", 2, 500_000.0, LLAMA3, bos_token_id=1, eos_token_id=2)
    model.save_pretrained(tmp_path / "hf")
    (tmp_path / "hf" / "tokenizer.json").write_text('{"model": {}}')
    read = pretrained.hf_model(str(tmp_path / "hf"))
    params = pretrained.parameters(
        ModelInit(format="huggingface", path=str(tmp_path / "hf")), read.dims, single_device(read.dims)
    )
    ckpt = Checkpointer(str(tmp_path / "ckpt"), keep=2)
    for step in (3, 5):  # the latest is exported
        scaled = jax.tree.map(lambda p, f=1.0 if step == 5 else 2.0: p * f, params)
        ckpt.save(step, {"params": scaled, "opt": {"mu": scaled}, "step": jnp.int32(step)})
    ckpt.finish()
    ckpt.close()
    files = commands.export(
        str(tmp_path / "ckpt"),
        str(tmp_path / "out"),
        dims=read.dims,
        tokenizer_from=str(tmp_path / "hf"),
        dtype="float32",
    )
    assert "tokenizer.json" in files and (tmp_path / "out" / "tokenizer.json").exists()
    config = json.loads((tmp_path / "out" / "config.json").read_text())
    assert (config["bos_token_id"], config["eos_token_id"], config["rope_scaling"]["rope_type"]) == (1, 2, "llama3")
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert_close(hf_logits(back), hf_logits(model))


def _config(tmp_path, **changes) -> dict:
    model = hf_model("llama", 2, 10_000.0, None)
    model.save_pretrained(tmp_path)
    cfg = json.loads((tmp_path / "config.json").read_text())
    return cfg | changes


@pytest.mark.parametrize(
    "changes,message",
    [
        (dict(model_type="gpt2"), "model_type: 'gpt2'"),
        (dict(hidden_act="gelu"), "hidden_act: 'gelu'"),
        (dict(attention_bias=True), "attention_bias: true"),
        (dict(mlp_bias=True), "mlp_bias: true"),
        (dict(rope_parameters={"rope_type": "yarn", "rope_theta": 1e4, "factor": 4.0}), "rope_type: 'yarn'"),
        (dict(rope_parameters={**LLAMA3, "rope_theta": 5e5, "factor": 16.0}), "rope_scaling.factor: 16.0"),
        (dict(rope_parameters={**LLAMA3, "rope_theta": 5e5, "original_max_position_embeddings": 4096}), "original_max"),
        (dict(sliding_window=4096), "sliding_window: 4096"),
        (dict(num_key_value_heads=3), "num_key_value_heads: 3 does not divide"),
        (dict(num_hidden_layers=-1), "num_hidden_layers: -1"),
        (dict(vocab_size=10**12), "vocab"),
    ],
)
def test_what_our_model_cannot_express_is_refused_by_key(tmp_path, changes, message):
    with pytest.raises(hf_config.Unsupported, match=message.replace("(", r"\(")):
        hf_config.parse_config(json.dumps(_config(tmp_path, **changes)))


# The Hub's config.json of Llama 3.1 8B and Mixtral 8x7B (transformers 4's spelling: rope_theta, rope_scaling).
HUB_LLAMA31_8B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 128256,
    "rms_norm_eps": 1e-05,
    "rope_theta": 500000.0,
    "max_position_embeddings": 131072,
    "hidden_act": "silu",
    "rope_scaling": {
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "attention_bias": False,
    "attention_dropout": 0.0,
    "mlp_bias": False,
    "pretraining_tp": 1,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}
HUB_MIXTRAL_8X7B = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "vocab_size": 32000,
    "num_local_experts": 8,
    "num_experts_per_tok": 2,
    "rms_norm_eps": 1e-05,
    "rope_theta": 1e6,
    "sliding_window": None,
    "router_aux_loss_coef": 0.02,
    "output_router_logits": False,
    "hidden_act": "silu",
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}


@pytest.mark.parametrize(
    "config,preset,overrides",
    [
        (HUB_LLAMA31_8B, "llama3-8b", dict(rope_scaling="llama3", norm_eps=1e-5)),
        (HUB_MIXTRAL_8X7B, "mixtral-8x7b", dict(norm_eps=1e-5)),
    ],
    ids=["llama3.1-8b", "mixtral-8x7b"],
)
def test_the_hubs_configs_are_our_presets(config, preset, overrides):
    """The published configs read as our presets with the checkpoint's RoPE scaling and epsilon: what the
    job states to start from them (and a Llama 3.2 scaling, factor 32, is refused by key)."""
    from tpu_operator.api.presets import PRESETS

    read = hf_config.parse_config(json.dumps(config))
    assert hf_config.disagreements(ModelDims(**PRESETS[preset], **overrides), read.dims) == []
    assert read.extra["torch_dtype"] == "bfloat16" and not read.tied
    llama32 = {**HUB_LLAMA31_8B, "rope_scaling": {**HUB_LLAMA31_8B["rope_scaling"], "factor": 32.0}}
    with pytest.raises(hf_config.Unsupported, match=r"rope_scaling.factor: 32.0; our llama3 scaling is Llama 3.1's"):
        hf_config.parse_config(json.dumps(llama32))


def test_tied_embeddings_start_untied_from_the_embedding(tmp_path):
    """A checkpoint that ties the unembedding to the embedding: ours starts as the embedding's transpose."""
    model = hf_model("llama", 2, 500_000.0, None, tie_word_embeddings=True)
    model.save_pretrained(tmp_path)
    read = pretrained.hf_model(str(tmp_path))
    assert read.tied
    params = pretrained.parameters(
        ModelInit(format="huggingface", path=str(tmp_path)), read.dims, single_device(read.dims)
    )
    np.testing.assert_array_equal(np.asarray(params["unembed"]), np.asarray(params["embed"]).T)
    assert_close(our_logits(read.dims, params), hf_logits(model))


def test_hostile_files_are_refused_with_the_reason(tmp_path):
    model = hf_model("llama", 2, 10_000.0, None)
    model.save_pretrained(tmp_path)
    (path,) = [p for p in tmp_path.iterdir() if p.suffix == ".safetensors"]
    data = path.read_bytes()
    path.write_bytes((1 << 40).to_bytes(8, "little") + data[8:])  # a header length past any limit
    with pytest.raises(tensorfiles.BadFile, match="header of 1099511627776 bytes"):
        tensorfiles.header(str(path))
    n = int.from_bytes(data[:8], "little")
    head = json.loads(data[8 : 8 + n])
    name = "model.norm.weight"
    head[name]["data_offsets"] = [0, 10**9]
    text = json.dumps(head).encode()
    path.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n :])
    with pytest.raises(tensorfiles.BadFile, match=f"{name} in .*data_offsets"):
        tensorfiles.header(str(path))
    (tmp_path / tensorfiles.INDEX).write_text(json.dumps({"weight_map": {"a": "../elsewhere.safetensors"}}))
    with pytest.raises(tensorfiles.BadFile, match="not a .safetensors file name beside the index"):
        tensorfiles.catalogue(str(tmp_path))
    read = hf_config.parse_config((tmp_path / "config.json").read_text())
    tensors = {
        "model.embed_tokens.weight": tensorfiles.Tensor(
            "model.embed_tokens.weight", "x", np.dtype("float32"), (256, 32), 0
        )
    }
    with pytest.raises(
        tensorfiles.BadFile, match=r"model.embed_tokens.weight: shape \[256, 32\], config.json says \[256, 64\]"
    ):
        hf_weights.check_tensors(read, tensors)


def test_the_cli_converts_and_exports_in_a_child_process(tmp_path, capfd):
    """`tpujob convert` prints the spec.model that agrees with the checkpoint; `tpujob export` writes what
    transformers loads; a config our model cannot express exits 2 naming the key."""
    from tpu_operator import cli

    model = hf_model("mixtral", 2, 1_000_000.0, None)
    model.save_pretrained(tmp_path / "hf")
    assert cli.main(["convert", str(tmp_path / "hf"), "--to", str(tmp_path / "orbax")]) == 0
    printed = capfd.readouterr().out
    spec = json.loads(printed[printed.index("{") :])["model"]
    assert (spec["experts"], spec["normEps"], spec["init"]["format"]) == (4, 1e-5, "orbax")
    assert cli.main(["export", str(tmp_path / "orbax"), "--to", str(tmp_path / "out"), "--dtype", "float32"]) == 0
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", attn_implementation="eager").eval()
    assert_close(hf_logits(back), hf_logits(model))

    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    (tmp_path / "hf" / "config.json").write_text(json.dumps(config | {"sliding_window": 4096}))
    assert cli.main(["convert", str(tmp_path / "hf"), "--to", str(tmp_path / "again")]) == 2
    assert "sliding_window: 4096; our attention is full causal" in capfd.readouterr().err
