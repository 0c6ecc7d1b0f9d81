"""Decoder-only LM on Flax NNX: RMSNorm, RoPE, grouped-query attention, SwiGLU or MoE MLP.

Parameters are f32 (master weights) and cast to bf16 where used; activations are bf16, softmax
and loss f32. `ModelConfig.compute = "f32"` runs the same model in f32 throughout (the parity tests
against `transformers`, tests/workload/test_huggingface.py); the default bf16 path is unchanged by it. Layers are stacked on a leading "layers" axis and run with `jax.lax.scan`; the
remat policy wraps the scanned body. Every parameter names its logical axes in `sharding`
metadata; activations are constrained by logical names (see sharding.py).

Dimension letters: B batch, T length, D model dim, N query heads, K kv heads, H head dim,
F MLP dim, E experts, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from flax import nnx
from jax.ad_checkpoint import checkpoint_name

from tpu_operator.api.contract import REMAT_TENSORS, KernelsSpec, ModelDims, RematSpec

from . import attention, chunked, layer_gather, loss, moe, sharding
from .sharding import constrain, current

COMPUTE = jnp.bfloat16  # the training compute dtype (ModelConfig.compute "bf16")
DTYPES = {"bf16": jnp.bfloat16, "f32": jnp.float32}


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Everything the model needs: shape, kernels, precision, remat. Static under jit."""

    dims: ModelDims
    kernels: KernelsSpec = KernelsSpec(attention="xla", moe_matmul="ragged_dot")
    precision: str = "bf16"
    remat: RematSpec = RematSpec(policy="none")
    interpret: bool = True  # Pallas kernels in interpret mode (off-TPU)
    # The LM head and cross entropy run over this many sequence chunks by vocabulary tiles, each
    # recomputed in the backward pass (loss.py; 1 and 1: the whole head at once).
    loss_chunks: int = 1
    vocab_tiles: int = 1
    # The whole head's logits kept for the backward instead of recomputed (loss.logits_kept).
    keep_logits: bool = False
    # The dense MLP runs over this many slices of its hidden dimension F, each recomputed in the
    # backward pass (chunked.py), where the layer is recomputed and keeps none of the MLP's activations.
    mlp_chunks: int = 1
    # Activations and matmul operands: "bf16" (training) or "f32" (the reference computation that
    # parity tests compare with another implementation; no kernel is tuned for it).
    compute: str = "bf16"

    @property
    def dtype(self):
        return DTYPES[self.compute]


def _param(rngs: nnx.Rngs, shape, axes, std: float | None = None, ones: bool = False) -> nnx.Param:
    value = jnp.ones(shape, jnp.float32) if ones else std * jax.random.normal(rngs.params(), shape, jnp.float32)
    return nnx.Param(value, sharding=axes, eager_sharding=False)


def _einsum(cfg: ModelConfig, eq: str, x, w):
    """A bf16 matmul against an f32 master weight; fp8 (e4m3 forward, e5m2 gradients) via qwix."""
    w = w.astype(cfg.dtype)
    if cfg.precision == "fp8":
        return jnp.einsum(eq, x, w, _dot_general=_fp8_dot_general())
    return jnp.einsum(eq, x, w)


@functools.cache
def _fp8_dot_general():
    # qwix's public API quantises a whole model (quantize_model with a QtProvider) and its public
    # dot_general has no custom VJP; the trainable fp8 matmul with e5m2 gradients is only in _src.
    # qwix is pinned (pyproject) and the fp8 tests hold its behaviour.
    from qwix._src.core import dot_general_qt

    qt = dot_general_qt.DotGeneralQtConfig(
        lhs_qtype=jnp.float8_e4m3fn,
        rhs_qtype=jnp.float8_e4m3fn,
        dlhs_grad_qtype=jnp.float8_e5m2,
        drhs_grad_qtype=jnp.float8_e5m2,
    )

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None, **_):
        out = dot_general_qt.dot_general_qt(lhs, rhs, dimension_numbers, qt)
        return out.astype(preferred_element_type or lhs.dtype)

    return dot_general


class RMSNorm(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.scale = _param(rngs, (cfg.dims.model_dim,), ("norm",), ones=True)
        self.eps, self.dtype = cfg.dims.norm_eps, cfg.dtype  # static: constants of the compiled step

    def __call__(self, x_BTD):
        return rms_norm(x_BTD, self.scale[...], self.eps, self.dtype)


NORM_EPS = 1e-6  # ModelDims.norm_eps's default


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x_BTD, scale_D, eps: float = NORM_EPS, dtype=COMPUTE):
    """RMSNorm computed in f32, out in `dtype` (bf16 in training). Its backward is written out so that the scale's gradient is
    reduced before the input's gradient leaves: left to autodiff, XLA reduced the final norm's scale
    gradient after the whole layer stack's backward and kept the f32 cotangent of the final hidden
    states alive through it (512 MiB per device for the 70B example)."""
    return _rms_norm_forward(x_BTD, scale_D, eps, dtype)[0]


def _rms_norm_forward(x_BTD, scale_D, eps, dtype):
    x = x_BTD.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    return (x * r * scale_D).astype(dtype), (x_BTD, scale_D)


def _rms_norm_backward(eps, dtype, residuals, dy_BTD):
    x_BTD, scale_D = residuals
    x = x_BTD.astype(jnp.float32)
    r = jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + eps)
    dy = dy_BTD.astype(jnp.float32)
    dscale_D = jnp.sum(dy * x * r, axis=tuple(range(x.ndim - 1)))
    g = dy * scale_D
    dx = r * g - x * (r**3) * jnp.mean(g * x, axis=-1, keepdims=True)
    return jax.lax.optimization_barrier((dx.astype(x_BTD.dtype), dscale_D))


rms_norm.defvjp(_rms_norm_forward, _rms_norm_backward)


def rope_frequencies(head_dim: int, theta: float, scaling: str = "none"):
    """RoPE's rotation frequencies of one head; "llama3": Llama 3.1's scaling for long contexts (the
    frequencies whose wavelength passes an 8192-token context divided by 8, those below 2048 kept, and
    a smooth blend between)."""
    freq = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    if scaling == "none":
        return freq
    factor, low, high, context = 8.0, 1.0, 4.0, 8192.0
    wavelength = 2 * jnp.pi / freq
    smooth = jnp.clip((context / wavelength - low) / (high - low), 0.0, 1.0)
    return (1 - smooth) * freq / factor + smooth * freq


def rope(x_BTNH, pos_BT, freq):
    angle_BTh = pos_BT[..., None].astype(jnp.float32) * freq
    sin, cos = jnp.sin(angle_BTh)[:, :, None], jnp.cos(angle_BTh)[:, :, None]
    x1, x2 = jnp.split(x_BTNH.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x_BTNH.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.dims
        self.cfg = cfg
        std = d.model_dim**-0.5
        self.wq = _param(rngs, (d.model_dim, d.heads, d.head_dim), ("embed", "heads", "head_dim"), std)
        self.wk = _param(rngs, (d.model_dim, d.kv_heads, d.head_dim), ("embed", "kv_heads", "head_dim"), std)
        self.wv = _param(rngs, (d.model_dim, d.kv_heads, d.head_dim), ("embed", "kv_heads", "head_dim"), std)
        self.wo = _param(
            rngs, (d.heads, d.head_dim, d.model_dim), ("heads", "head_dim", "embed"), (d.heads * d.head_dim) ** -0.5
        )

    def __call__(self, x_BTD, pos_BT, seg_BT=None):
        """`seg_BT` (packed rows): each token's document, 0 on padding; a token attends only within its
        document, where positions restart at 0 and so order the tokens causally."""
        cfg = self.cfg
        q_BTNH = _einsum(cfg, "btd,dnh->btnh", x_BTD, self.wq[...])
        k_BTKH = _einsum(cfg, "btd,dkh->btkh", x_BTD, self.wk[...])
        v_BTKH = _einsum(cfg, "btd,dkh->btkh", x_BTD, self.wv[...])
        q_BTNH, k_BTKH, v_BTKH = (checkpoint_name(a, "qkv_proj") for a in (q_BTNH, k_BTKH, v_BTKH))
        freq = rope_frequencies(cfg.dims.head_dim, cfg.dims.rope_theta, cfg.dims.rope_scaling)
        q_BTNH = constrain(rope(q_BTNH, pos_BT, freq), ("batch", "length", "act_heads", None))
        k_BTKH = constrain(rope(k_BTKH, pos_BT, freq), ("batch", "length", "act_kv_heads", None))
        v_BTKH = constrain(v_BTKH, ("batch", "length", "act_kv_heads", None))
        if cfg.kernels.attention == "splash":
            # The kernel names its own residuals (output and logsumexp) "attention_out", inside its
            # shard_map: a policy that keeps them never reruns the kernel's forward pass.
            out_BTNH = attention.splash_attention(
                q_BTNH, k_BTKH, v_BTKH, spec=cfg.kernels.splash, interpret=cfg.interpret, segments_BT=seg_BT
            )
        else:
            out_BTNH = checkpoint_name(
                attention.reference_attention(q_BTNH, k_BTKH, v_BTKH, pos_BT, pos_BT, seg_BT, seg_BT), "attention_out"
            )
        out_BTD = _einsum(cfg, "btnh,nhd->btd", out_BTNH, self.wo[...])
        return checkpoint_name(out_BTD, "out_proj")


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.dims
        self.cfg = cfg
        self.gate = _param(rngs, (d.model_dim, d.mlp_dim), ("embed", "mlp"), d.model_dim**-0.5)
        self.up = _param(rngs, (d.model_dim, d.mlp_dim), ("embed", "mlp"), d.model_dim**-0.5)
        self.down = _param(rngs, (d.mlp_dim, d.model_dim), ("mlp", "embed"), d.mlp_dim**-0.5)

    def __call__(self, x_BTD):
        weights = (self.gate[...], self.up[...], self.down[...])
        if self.cfg.mlp_chunks == 1:
            return checkpoint_name(self.swiglu(x_BTD, *weights), "mlp_out"), 0.0
        # The layer is recomputed and keeps none of the MLP's activations: run it over slices of F
        # that the backward pass recomputes one at a time, so one slice's [tokens, F / n] activations
        # exist at a time (chunked.py: no extra compute). Slicing F, not the sequence, gathers each
        # weight byte once per pass and reduces each slice's gradient once: sequence chunks would
        # gather the whole weights again for every chunk.
        sh = current()
        axes = (("embed", "mlp"), ("embed", "mlp"), ("mlp", "embed"))
        like_w = (lambda i, a: constrain(a, axes[i])) if sh else None
        like_x = (lambda a: constrain(a, ("batch", "length", "act_embed"))) if sh else None
        y_BTD = chunked.sum_over_slices(
            self.swiglu,
            (x_BTD,),
            weights,
            (1, 1, 0),
            self.cfg.mlp_chunks,
            like_w,
            like_x,
            groups=sh.degree("mlp") if sh else 1,
        )
        return checkpoint_name(y_BTD, "mlp_out"), 0.0

    def swiglu(self, x_BTD, gate_DF, up_DF, down_FD):
        cfg = self.cfg
        g_BTF = checkpoint_name(_einsum(cfg, "btd,df->btf", x_BTD, gate_DF), "mlp_in")
        u_BTF = checkpoint_name(_einsum(cfg, "btd,df->btf", x_BTD, up_DF), "mlp_in")
        h_BTF = constrain(jax.nn.silu(g_BTF) * u_BTF, ("batch", "length", "act_mlp"))
        return _einsum(cfg, "btf,fd->btd", h_BTF, down_FD)


class MoE(nnx.Module):
    """Under fp8 the experts' grouped matmuls quantise to fp8 (see moe.py); the router stays bf16."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.dims
        self.cfg = cfg
        self.router = _param(rngs, (d.model_dim, d.experts), ("embed", "router"), d.model_dim**-0.5)
        self.gate = _param(rngs, (d.experts, d.model_dim, d.mlp_dim), ("exp", "embed", "mlp"), d.model_dim**-0.5)
        self.up = _param(rngs, (d.experts, d.model_dim, d.mlp_dim), ("exp", "embed", "mlp"), d.model_dim**-0.5)
        self.down = _param(rngs, (d.experts, d.mlp_dim, d.model_dim), ("exp", "mlp", "embed"), d.mlp_dim**-0.5)

    def __call__(self, x_BTD):
        cfg = self.cfg
        weights_BTk, experts_BTk, aux = moe.route(x_BTD, self.router[...], cfg.dims.experts_per_token)
        x_BTD = checkpoint_name(x_BTD, "mlp_in")
        mm = moe.Matmul(
            impl=cfg.kernels.moe_matmul,
            tiles=cfg.kernels.gmm,
            interpret=cfg.interpret,
            fp8=cfg.precision == "fp8",
            recompute=cfg.remat.policy != "none",
        )
        y_BTD = moe.experts(x_BTD, weights_BTk, experts_BTk, self.gate[...], self.up[...], self.down[...], mm=mm)
        return checkpoint_name(y_BTD, "mlp_out"), aux


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.attn_norm = RMSNorm(cfg, rngs)
        self.attn = Attention(cfg, rngs)
        self.mlp_norm = RMSNorm(cfg, rngs)
        self.mlp = MoE(cfg, rngs) if cfg.dims.is_moe else MLP(cfg, rngs)

    def __call__(self, x_BTD, pos_BT, seg_BT=None):
        # Named scopes: a profile (jax.profiler trace) reads by block.
        x_BTD = checkpoint_name(constrain(x_BTD, ("batch", "length", "act_embed")), "decoder_layer_input")
        with jax.named_scope("attention"):
            x_BTD = x_BTD + self.attn(self.attn_norm(x_BTD), pos_BT, seg_BT)
        with jax.named_scope("moe" if isinstance(self.mlp, MoE) else "mlp"):
            y_BTD, aux = self.mlp(self.mlp_norm(x_BTD))
        return x_BTD + y_BTD, aux


def embed_tokens(table_VD, tokens_BT, dtype=COMPUTE):
    """The tokens' rows of the embedding table (in `dtype`, bf16 in training), looked up where the table lives.

    The table's D is split over the weights' axes (fsdp, context, expert), which also split the
    tokens (batch over fsdp and expert, sequence over context). Left to itself, XLA all-gathers the
    whole table for the lookup (1 GiB in bf16 for Llama 3's vocabulary, more copies for the gradient's
    scatter). Instead, under shard_map, each device gathers the token ids of its group (4 bytes a
    token), takes its D columns of every one of their rows, and one all-to-all hands each device its
    own tokens' whole rows; a vocabulary split over `tensor` is looked up per shard and summed. The
    gradient runs the same way back and is scattered into the table's local columns.
    """
    sh = current()
    table_VD = table_VD.astype(dtype)
    if sh is None:
        return jnp.take(table_VD, tokens_BT, axis=0)
    table_spec = sh.spec(("vocab", "embed"), table_VD.shape)
    group = sharding.spec_axes(table_spec[1])  # the axes D is split over
    vocab = sharding.spec_axes(table_spec[0])
    tok_spec = sh.spec(("batch", "length"), tokens_BT.shape)
    if not set(group) <= set(sharding.spec_axes(tok_spec[0]) + sharding.spec_axes(tok_spec[1])):
        return constrain(jnp.take(table_VD, tokens_BT, axis=0), ("batch", "length", "act_embed"))

    @functools.partial(
        jax.shard_map,
        mesh=sh.mesh,
        in_specs=(table_spec, tok_spec),
        out_specs=sh.spec(("batch", "length", None), (*tokens_BT.shape, 0)),
        check_vma=False,
    )
    def lookup(table_vd, tokens_bt):
        ids_nbt = jax.lax.all_gather(tokens_bt, group) if group else tokens_bt[None]
        if vocab:  # this shard's words only; the others come from the other tensor shards
            ids_nbt = ids_nbt - jax.lax.axis_index(vocab) * table_vd.shape[0]
            mine = (ids_nbt >= 0) & (ids_nbt < table_vd.shape[0])
            rows_nbtd = jnp.where(
                mine[..., None], jnp.take(table_vd, jnp.clip(ids_nbt, 0, table_vd.shape[0] - 1), 0), 0
            )
            rows_nbtd = jax.lax.psum(rows_nbtd, vocab)
        else:
            rows_nbtd = jnp.take(table_vd, ids_nbt, axis=0)
        if not group:
            return rows_nbtd[0]
        # Row block i goes to device i of the group; what comes back are this device's tokens' columns
        # from every device, in the order D is split.
        return jax.lax.all_to_all(rows_nbtd, group, 0, 3, tiled=True)[0]

    return lookup(table_VD, tokens_BT)


def remat_policy(spec: RematSpec, offload_ok: bool):
    """The jax.checkpoint policy for a scanned layer; None means no remat at all."""
    cp = jax.checkpoint_policies
    if spec.policy == "none":
        return None
    if spec.policy == "full":
        return cp.nothing_saveable
    if spec.policy == "minimal":
        return cp.dots_with_no_batch_dims_saveable
    keep = [n for n in REMAT_TENSORS if spec.tensors.get(n) == "device"]
    offload = [n for n in REMAT_TENSORS if spec.tensors.get(n) == "offload"]
    if not offload_ok:  # no host-offload memory space (CPU): keep them on device instead
        keep, offload = keep + offload, []
    return cp.save_and_offload_only_these_names(
        names_which_can_be_saved=keep,
        names_which_can_be_offloaded=offload,
        offload_src="device",
        offload_dst="pinned_host",
    )


class Decoder(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d = cfg.dims
        self.cfg = cfg
        self.embed = _param(rngs, (d.vocab, d.model_dim), ("vocab", "embed"), 1.0)

        @nnx.split_rngs(splits=d.layers)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
        def make_layers(rngs):
            return Block(cfg, rngs)

        self.layers = make_layers(rngs)
        self.final_norm = RMSNorm(cfg, rngs)
        self.unembed = _param(rngs, (d.model_dim, d.vocab), ("embed", "vocab"), d.model_dim**-0.5)

    def __call__(self, tokens_BT, pos_BT):
        """Logits (f32) and the mean MoE auxiliary loss."""
        x_BTD, aux = self.hidden(tokens_BT, pos_BT)
        return self.logits(x_BTD), aux

    def logits(self, x_BTD):
        """f32 logits of final hidden states (the loss computes them in tiles: loss.py)."""
        return loss.logits(x_BTD, self.unembed[...])

    def hidden(self, tokens_BT, pos_BT, seg_BT=None):
        """Final-normed hidden states (bf16) and the mean MoE auxiliary loss; `seg_BT` keeps packed
        documents apart (Attention)."""
        cfg = self.cfg
        with jax.named_scope("embed"):
            x_BTD = embed_tokens(self.embed[...], tokens_BT, cfg.dtype)
        graphdef, layers = nnx.split(self.layers)

        def body(carry, layer):
            x_BTD, aux = carry
            # The barrier keeps the slicing of this layer's weights apart from the layer's ops: with it
            # the 70B step compiles to 0.4 GiB less per device (34.91 -> 34.50 GiB). It does not stop
            # XLA casting every layer's weight shards to bf16 at once before the loop (1.1 GiB for the
            # 70B): that pass runs after barriers are removed (docs/plan.md).
            layer = jax.lax.optimization_barrier(layer)
            layer = _gather_weights(layer, cfg.dtype, mlp=gather_mlp)
            with jax.named_scope("layer"):
                x_BTD, layer_aux = nnx.merge(graphdef, layer)(x_BTD, pos_BT, seg_BT)
            return (x_BTD, aux + layer_aux), None

        # The MoE's expert matmuls and the chunked MLP take their weights sharded (moe.py, chunked.py).
        gather_mlp = not cfg.dims.is_moe and cfg.mlp_chunks == 1
        policy = remat_policy(cfg.remat, offload_ok=not cfg.interpret)
        if policy is not None:
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        (x_BTD, aux), _ = jax.lax.scan(body, (x_BTD, jnp.zeros((), jnp.float32)), layers)
        return self.final_norm(x_BTD), aux / cfg.dims.layers


def _gather_weights(layer: nnx.State, dtype, mlp: bool) -> nnx.State:
    """The layer's matrices (not its norm scales; the MLP's only with `mlp`) whole, in `dtype`, in one
    collective where layer_gather applies (XLA:CPU); the layer as it is elsewhere."""
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    leaves, tree = jax.tree_util.tree_flatten_with_path(layer, is_leaf=is_var)
    picked = [
        i
        for i, (path, v) in enumerate(leaves)
        if is_var(v) and v.ndim >= 2 and (mlp or getattr(path[0], "key", None) != "mlp")
    ]
    matrices = [leaves[i][1] for i in picked]
    axes = [tuple(v.get_metadata()["out_sharding"][1:]) for v in matrices]  # less the stacked "layers"
    whole = layer_gather.gathered([v[...] for v in matrices], axes, dtype)
    if whole is None:
        return layer
    out = [v for _, v in leaves]
    for i, w in zip(picked, whole):
        out[i] = out[i].replace(w)
    return jax.tree_util.tree_unflatten(tree, out)


@dataclasses.dataclass(frozen=True)
class LossWeights:
    """What the training loss adds to the cross entropy (TrainingSpec's weights)."""

    moe_aux: float = 0.01
    z_loss: float = 0.0


def loss_fn(
    model: Decoder, tokens_BT, targets_BT, pos_BT, seg_BT=None, mask_BT=None, weights: LossWeights = LossWeights()
):
    """The training loss and its parts: the next-token cross entropy (mean over the tokens `mask_BT`
    counts; all without a mask), plus the weighted z-loss and MoE load-balancing loss."""
    x_BTD, aux = model.hidden(tokens_BT, pos_BT, seg_BT)
    with jax.named_scope("lm_head_loss"):
        ce, z = loss.cross_entropy(
            x_BTD,
            targets_BT,
            model.unembed[...],
            chunks=model.cfg.loss_chunks,
            tiles=model.cfg.vocab_tiles,
            keep=model.cfg.keep_logits,
            mask_BT=mask_BT,
            z_loss=weights.z_loss > 0,
        )
    return ce + weights.moe_aux * aux + weights.z_loss * z, {"ce": ce, "aux": aux, "z_loss": z}
